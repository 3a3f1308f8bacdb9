"""StructuredHeads: chunks shaped by the target's layers (hypnettorch's StructuredHMLP idea).

:class:`~nnxscan.pure.hyper.ChunkedHeads` cuts the flat parameter vector into equal chunks
wherever they fall. Here a chunk is ``units`` output units of one layer: for a layer whose
generated tensors share their last axis (a Linear's kernel ``(in, out)`` and bias
``(out,)``, a conv's ``(kh, kw, in, out)`` and ``(out,)``), chunk ``k`` holds units
``k·units .. (k+1)·units - 1`` of every one of them: each unit's whole fan-in and its bias.
Layers whose chunks differ in size get their own output layer; the hidden layer is shared::

    a_k   = tanh(h · W_h + c_k · W_c + b)        # (d_m,): chunk k's hidden features
    â_k   = a_k / rms(a_k)
    raw_k = â_k · W_o[g] + b_o[g]                # (units, Σ fan-in sizes of layer g)
    θ_t   = gain_t · (t's columns of raw, chunk after chunk, moved to the last axis)
            + offset_t

The init is :class:`~nnxscan.pure.hyper.ChunkedHeads`' (unit-variance raw entries, per-tensor
gains giving tensor ``t`` the variance ``init`` chooses). The gains and offsets are applied
to a layer's whole ``(units, Σ fan-in)`` block, each spread over its tensor's columns, and
the heads' vector (``heads.vector(h)``) is the blocks themselves, layer after layer: unit
after unit, each unit's fan-in of every tensor of the layer. Tensors are grouped by their
parent path and last-axis size; a scalar is a layer of one unit.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from nnxscan.pure import checks
from nnxscan.pure.hyper.chunked import _RMS_EPS, select_table
from nnxscan.pure.hyper.spec import ParamSpec
from nnxscan.pure.hyper.variance import check_init, init_moments
from nnxscan.pure.hyper.vector import EVERY_CONDITION, VectorHeads

__all__ = ["StructuredHeads", "layer_groups"]


# One compiled draw per set of shapes, cut into the weights (a random call per array costs a
# threefry compile per shape).
@functools.partial(jax.jit, static_argnames=("shapes", "scales", "dtype"))
def _draw_normal(key, *, shapes, scales, dtype):
    noise = jax.random.normal(key, (sum(math.prod(s) for s in shapes),), dtype)
    out, offset = [], 0
    for shape, scale in zip(shapes, scales, strict=True):
        out.append(scale * noise[offset : offset + math.prod(shape)].reshape(shape))
        offset += math.prod(shape)
    return out


def layer_groups(spec: ParamSpec) -> list[tuple[int, list[int]]]:
    """The target's layers as ``(units, [tensor indices])``, in order of first appearance.

    Tensors with the same parent path and last-axis size are one layer (a scalar is a
    layer of one unit).

    Example:
      >>> layer_groups(hyper.ParamSpec.from_module(mlp))   # bias and kernel of each Linear
      [(8, [0, 1]), (2, [2, 3])]
    """
    groups: dict[Any, tuple[int, list[int]]] = {}
    for t, leaf in enumerate(spec.leaves):
        units = leaf.shape[-1] if leaf.shape else 1
        key = (leaf.path[:-1], units) if leaf.shape else (leaf.path, "scalar")
        groups.setdefault(key, (units, []))[1].append(t)
    return list(groups.values())


class StructuredHeads(VectorHeads):
    """Maps features ``h`` to generated params, a chunk per ``units`` output units of a layer.

    A drop-in for :class:`~nnxscan.pure.hyper.HyperHeads` (same call, same output);
    ``Hypernetwork(..., structured_units=...)`` builds one. See the module doc.

    Args:
      spec: the target's :class:`ParamSpec`.
      in_features: ``d_k``, the size of the last axis of ``h``.
      units: output units per chunk (a layer with fewer has one chunk).
      embedding_features: the size of each learned chunk embedding.
      hidden_features: ``d_m``, the width of the shared hidden layer (default
        ``in_features``).
      input_variance, num_conditions, init, init_gain, param_dtype, rngs: as for
        :class:`~nnxscan.pure.hyper.ChunkedHeads`.

    Attributes:
      chunk_embeddings: ``(num_chunks, embedding_features)`` (or per condition) Param.
      feature_kernel, embedding_kernel, hidden_bias: the shared hidden layer.
      out_kernels, out_biases: one output layer per layer of the target.
      gains, offsets: one entry per generated tensor, in spec order.

    Example:
      >>> heads = hyper.StructuredHeads(spec, 32, units=4, rngs=nnx.Rngs(0))
      >>> params = heads(jnp.ones(32))      # the target's shapes
    """

    def __init__(
        self,
        spec: ParamSpec,
        in_features: int,
        *,
        units: int = 1,
        embedding_features: int = 8,
        hidden_features: int | None = None,
        input_variance: float = 1.0,
        num_conditions: int | None = None,
        init: str = "target",
        init_gain: float = 2.0,
        param_dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if not isinstance(spec, ParamSpec):
            raise TypeError(
                f"StructuredHeads needs a ParamSpec (hyper.ParamSpec.from_module(target)), got "
                f"{type(spec).__name__}."
            )
        check_init(init, init_gain)
        in_features = checks.check_count(in_features, "in_features", 1)
        units = checks.check_count(units, "units", 1)
        embed = checks.check_count(embedding_features, "embedding_features", 1)
        hidden = checks.check_count(hidden_features or in_features, "hidden_features", 1)
        if num_conditions is not None:
            num_conditions = checks.check_count(num_conditions, "num_conditions", 1)
        if not input_variance > 0:
            raise ValueError(f"input_variance must be positive, got {input_variance!r}.")
        self.in_features = in_features
        self.num_conditions = num_conditions
        self.treedef = spec.treedef
        self.leaves = spec.leaves
        # (units of the layer, units per chunk, chunks, [tensor indices]) for each layer.
        self.layers = tuple(
            (n, min(units, n), math.ceil(n / min(units, n)), tuple(ts))
            for n, ts in layer_groups(spec)
        )
        self.num_chunks = sum(layer[2] for layer in self.layers)
        dtype = jnp.dtype(param_dtype)
        tables = (num_conditions,) if num_conditions else ()
        width = tuple(per_chunk * self._fan_sizes(ts)[1] for _, per_chunk, _, ts in self.layers)
        shapes = (
            (*tables, self.num_chunks, embed),
            (in_features, hidden),
            (embed, hidden),
            *((hidden, w) for w in width),
        )
        scales = (1.0, math.sqrt(0.5 / (in_features * input_variance)), math.sqrt(0.5 / embed))
        scales += (1 / math.sqrt(hidden),) * len(width)
        drawn = _draw_normal(rngs.params(), shapes=shapes, scales=scales, dtype=dtype)
        self.chunk_embeddings = nnx.Param(drawn[0])
        self.feature_kernel = nnx.Param(drawn[1])
        self.embedding_kernel = nnx.Param(drawn[2])
        self.hidden_bias = nnx.Param(jnp.zeros(hidden, dtype))
        self.out_kernels = nnx.List([nnx.Param(w) for w in drawn[3:]])
        self.out_biases = nnx.List([nnx.Param(jnp.zeros(w, dtype)) for w in width])
        variance, constant = init_moments(spec, init, init_gain)
        self.gains = nnx.Param(jnp.sqrt(variance).astype(dtype))
        self.offsets = nnx.Param(constant.astype(dtype))

    def _fan_sizes(self, tensors: tuple[int, ...]) -> tuple[list[int], int]:
        """Per-unit sizes of a layer's tensors (``prod(shape[:-1])``) and their sum."""
        sizes = [math.prod(self.leaves[t].shape[:-1]) for t in tensors]
        return sizes, sum(sizes)

    @property
    def paths(self) -> tuple[str, ...]:
        """The target paths generated, in spec order."""
        return tuple(leaf.name for leaf in self.leaves)

    def _to_tensor(self, piece: jax.Array, t: int) -> jax.Array:
        """Tensor ``t`` from its ``(..., units, fan-in)`` columns of its layer's block."""
        leaf = self.leaves[t]
        batch = piece.shape[:-2]
        if not leaf.shape:
            return piece.reshape(batch).astype(leaf.dtype)
        units = piece.reshape(*batch, leaf.shape[-1], *leaf.shape[:-1])
        return jnp.moveaxis(units, len(batch), -1).astype(leaf.dtype)

    def _params(self, blocks: list[jax.Array]) -> nnx.State:
        """The params from each layer's ``(..., units, Σ fan-in)`` block."""
        tensors = dict(
            (t, self._to_tensor(piece, t))
            for (_, _, _, layer), block in zip(self.layers, blocks, strict=True)
            for t, piece in zip(
                layer, jax.lax.split(block, self._fan_sizes(layer)[0], axis=-1), strict=True
            )
        )
        return jax.tree.unflatten(self.treedef, [tensors[t] for t in range(len(self.leaves))])

    def params_of(self, vector: jax.Array) -> nnx.State:
        vector = self._check_vector(vector)
        sizes = [n * self._fan_sizes(layer)[1] for n, _, _, layer in self.layers]
        batch = vector.shape[:-1]
        blocks = [
            block.reshape(*batch, n, -1)
            for (n, *_), block in zip(
                self.layers, jax.lax.split(vector, sizes, axis=-1), strict=True
            )
        ]
        return self._params(blocks)

    params_of.__doc__ = VectorHeads.params_of.__doc__

    def vector_of(self, params: Any) -> jax.Array:
        leaves = self._check_leaves(params)
        blocks = []
        for _, _, _, layer in self.layers:
            columns = []
            for t in layer:
                x, shape = jnp.asarray(leaves[t]), self.leaves[t].shape
                batch = x.ndim - len(shape)
                x = jnp.moveaxis(x, -1, batch) if shape else x[..., None]
                columns.append(x.reshape(*x.shape[: batch + 1], -1))
            block = jnp.concatenate(columns, axis=-1)
            blocks.append(block.reshape(*block.shape[:-2], -1))
        return jnp.concatenate(blocks, axis=-1)

    vector_of.__doc__ = VectorHeads.vector_of.__doc__

    def _blocks(self, h: jax.Array, condition: jax.Array | int | None) -> list[jax.Array]:
        """Each layer's ``(..., units, Σ fan-in)`` block, gains and offsets applied: unit
        after unit, each unit's fan-in of every tensor of the layer (as computed)."""
        if jnp.shape(h)[-1:] != (self.in_features,):
            raise ValueError(
                f"StructuredHeads expects features with a last axis of size "
                f"{self.in_features}, got shape {jnp.shape(h)}. Check the trunk's output size."
            )
        every = condition is EVERY_CONDITION
        if (condition is None) != (self.num_conditions is None) and not every:
            raise ValueError(
                "pass condition=c exactly when the chunk embeddings are per condition "
                f"(num_conditions={self.num_conditions})."
            )
        table = self.chunk_embeddings[...]
        if condition is not None and not every:
            table = select_table(table, condition, "StructuredHeads")
        per_chunk = table @ self.embedding_kernel[...] + self.hidden_bias[...]
        hidden = jnp.tanh((h @ self.feature_kernel[...])[..., None, :] + per_chunk)
        hidden = hidden * jax.lax.rsqrt(jnp.mean(hidden**2, axis=-1, keepdims=True) + _RMS_EPS)
        batch = hidden.shape[:-2]
        gains = jax.lax.split(self.gains[...], [1] * len(self.leaves))
        offsets = jax.lax.split(self.offsets[...], [1] * len(self.leaves))
        blocks = []
        per_layer = jax.lax.split(hidden, [layer[2] for layer in self.layers], axis=-2)
        for (n, per_chunk_units, chunks, tensors), hidden_l, w_o, b_o in zip(
            self.layers, per_layer, self.out_kernels, self.out_biases, strict=True
        ):
            sizes, total = self._fan_sizes(tensors)
            raw = hidden_l @ w_o[...] + b_o[...]
            raw = raw.reshape(*batch, chunks * per_chunk_units, total)
            if chunks * per_chunk_units > n:  # the last chunk's unused units
                raw = jax.lax.split(raw, [n, chunks * per_chunk_units - n], axis=-2)[0]
            # Each tensor's gain and offset spread over its columns: one pass over the
            # block, which stays contiguous (a split per tensor would copy every piece).
            gain = jnp.concatenate(
                [jnp.broadcast_to(gains[t], (k,)) for t, k in zip(tensors, sizes, strict=True)]
            )
            offset = jnp.concatenate(
                [jnp.broadcast_to(offsets[t], (k,)) for t, k in zip(tensors, sizes, strict=True)]
            )
            blocks.append(raw * gain + offset)
        return blocks

    def __call__(self, h: jax.Array, condition: jax.Array | int | None = None) -> nnx.State:
        """Generated params for features ``h`` of shape ``(..., in_features)``.

        Example:
          >>> params = heads(jnp.ones(32))
        """
        return self._params(self._blocks(h, condition))

    def vector(self, h: jax.Array, condition: jax.Array | int | None = None) -> jax.Array:
        """The generated params as one ``(..., spec.size)`` vector in the heads' own order:
        layer after layer, unit after unit, each unit's fan-in of every tensor of the layer
        in spec order (a Linear's bias entry, then its kernel column; see ``vector.py``).

        Example:
          >>> heads.params_of(heads.vector(h))   # == heads(h), bitwise
        """
        blocks = self._blocks(h, condition)
        return jnp.concatenate([b.reshape(*b.shape[:-2], -1) for b in blocks], axis=-1)
