"""ChunkedHeads: generate the target's flat parameter vector in chunks of ``chunk_size``.

One :class:`~nnxscan.pure.hyper.HyperHeads` head per tensor has ``d_k`` weights per generated
scalar, so the hypernetwork is always larger than its target. Chunking (Ha, Dai & Le 2017;
von Oswald et al. 2020) reuses one small output layer for every chunk of the target's flat
parameter vector (in spec order, the order of :func:`~nnxscan.pure.hyper.ravel`): chunk
``i`` is computed from the trunk's features ``h`` joined with a learned chunk embedding
``c_i``, so the hypernetwork's own size grows with ``chunk_size`` and the number of chunks,
not with the target's size.

The network, for ``h`` of size ``d_k`` and ``n = ceil(spec.size / chunk_size)`` chunks::

    a_i   = tanh(h · W_h + c_i · W_c + b)          # (d_m,): hidden features of chunk i
    â_i   = a_i / rms(a_i)                          # unit mean square
    raw_i = â_i · W_o + b_o                         # (chunk_size,)
    θ     = concat(raw_0, ..., raw_{n-1})[:size]    # the flat vector, cut into tensors:
    θ_t   = gain_t · raw[t's slice] + offset_t      # one learned gain and offset per tensor

The hidden layer is what makes chunks differ in how they respond to ``h``: with a linear
layer on ``[h, c_i]`` every chunk would be the same linear function of ``h`` plus a fixed
per-chunk offset. (Computed as one ``(..., num_chunks, d_m) @ (d_m, chunk_size)`` product
for every chunk, the flat vector cut into tensors by one ``jax.lax.split``, whose gradient
is one concatenation: slicing it tensor by tensor would pad every tensor's gradient to the
whole vector; docs/hypernetworks.md measures it.)

Initialization. Chunks cross tensor boundaries, so one output layer cannot carry a scale per
tensor; the per-tensor gain does. ``W_o ~ N(0, 1/d_m)`` on the RMS-normalized ``â_i``
(``|â_i|² = d_m`` exactly) gives every raw entry unit variance whatever the trunk's output
variance or the activation, and ``gain_t = sqrt(v_t)``, ``offset_t = 0`` then give tensor
``t`` the variance ``v_t`` of the target's own freshly initialized tensor (``spec.init_var``,
as :class:`HyperHeads` matches it). Constant tensors (``v_t = 0``: zero biases, unit norm
scales) start with ``gain_t = 0`` and ``offset_t = m_t``, so they start exactly at the
target's value; the gain's gradient ``Σ raw · ∂L/∂θ_t`` is not zero, so they learn. ``W_h``
and ``W_c`` split the hidden pre-activation's unit variance evenly between ``h`` (assumed
of variance ``input_variance``) and the chunk embedding (``c_i ~ N(0, 1)``), so chunks are
neither copies of each other nor blind to ``h``. Entries at the same position of different
chunks are correlated at init (their hidden features share ``h · W_h``); the per-tensor
variance is what the init matches.

It matches it in expectation over the draw of the heads, not in every draw: all of a
tensor's entries come from the same few output columns and chunk terms ``c_i · W_c`` (fixed
for every ``h``), so one draw's per-tensor variance over many ``h`` spreads around ``v_t``,
more for small tensors. Over 40 draws (chunks of 100, ``d_k = 64``) the ratio's standard
deviation was 0.03 (range 0.93-1.05) for 64→128 and 128→32 kernels, 0.05 (0.90-1.13) for a
64→3 kernel and 0.14 (0.68-1.45) for a 36-entry 3x3 conv kernel; averaged over 16 draws,
0.95-1.09. What holds in every draw: ``gains == sqrt(v_t)``, and constant tensors start at
``m_t`` exactly.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from nnxscan.pure import checks
from nnxscan.pure.hyper.spec import ParamSpec
from nnxscan.pure.hyper.variance import check_init, init_moments
from nnxscan.pure.hyper.vector import EVERY_CONDITION, VectorHeads

__all__ = ["ChunkedHeads", "select_table"]

_RMS_EPS = 1e-6


# One compiled initializer per set of shapes, with ONE random draw cut into the weights (every
# random call costs its own threefry in the compiled program).
@functools.partial(
    jax.jit,
    static_argnames=("num_chunks", "in_features", "embed", "hidden", "chunk", "tables", "dtype"),
)
def _init_chunk_weights(
    key, input_variance, *, num_chunks, in_features, embed, hidden, chunk, tables, dtype
):
    shapes = [(tables, num_chunks, embed), (in_features, hidden), (embed, hidden), (hidden, chunk)]
    noise = jax.random.normal(key, (sum(math.prod(shape) for shape in shapes),), dtype)
    pieces, offset = [], 0
    for shape in shapes:
        pieces.append(noise[offset : offset + math.prod(shape)].reshape(shape))
        offset += math.prod(shape)
    embeddings, w_h, w_c, w_o = pieces
    # Half of the pre-activation's unit variance from h, half from the chunk embedding.
    w_h = w_h * jnp.sqrt(0.5 / (in_features * input_variance)).astype(dtype)
    w_c = w_c * jnp.sqrt(0.5 / embed).astype(dtype)
    w_o = w_o * jnp.sqrt(1.0 / hidden).astype(dtype)
    return embeddings, w_h, w_c, w_o


def select_table(table: jax.Array, condition: jax.Array | int, name: str) -> jax.Array:
    """``table[condition]``; a concrete id out of range raises, a traced one gives NaN rows
    (as :meth:`~nnxscan.pure.hyper.ConditionalHypernetwork.embed` does)."""
    n = table.shape[0]
    dtype = jnp.result_type(condition)
    if not jnp.issubdtype(dtype, jnp.integer) or isinstance(condition, bool):
        raise TypeError(f"{name}: condition must be an integer id, got dtype {dtype}.")
    if jnp.shape(condition) != ():
        raise ValueError(
            f"{name}: condition must be one id (a scalar), got shape {jnp.shape(condition)}; "
            f"jax.vmap over several."
        )
    if not isinstance(condition, jax.core.Tracer) and not 0 <= int(condition) < n:
        raise ValueError(f"{name}: condition {int(condition)} is out of range: ids are 0..{n - 1}.")
    index = jnp.where((condition >= 0) & (condition < n), condition, n)
    return jnp.take(table, index, axis=0, mode="fill", fill_value=jnp.nan)


class ChunkedHeads(VectorHeads):
    """Maps features ``h`` to generated params, chunk by chunk, with one shared output layer.

    A drop-in for :class:`~nnxscan.pure.hyper.HyperHeads` (same call, same output) whose
    size does not grow with ``d_k · spec.size``; see the module doc for the network and its
    initialization. ``Hypernetwork(..., chunk_size=...)`` builds one.

    Args:
      spec: the target's :class:`ParamSpec`.
      in_features: ``d_k``, the size of the last axis of ``h``.
      chunk_size: generated scalars per chunk; ``ceil(spec.size / chunk_size)`` chunks, the
        last one cut short.
      embedding_features: the size of each learned chunk embedding.
      hidden_features: ``d_m``, the width of the per-chunk hidden layer (default:
        ``in_features``).
      input_variance: the variance of ``h``'s entries the init assumes.
      num_conditions: ``None`` (default): one set of chunk embeddings shared by every
        network. An int: one set per condition (hypnettorch's ``cond_chunk_embs``), chosen by
        ``heads(h, condition=c)``: each task then owns its chunk embeddings, so learning a new
        task need not move what the earlier tasks' chunks are made from (the guide's
        continual-learning section measures it).
      order: the order each tensor is read from the flat vector in. ``"units"`` (default): output
        unit by output unit, each unit's whole fan-in contiguous (a kernel ``(..., out)``
        is read as ``(out, ...)``; hypnettorch's order, as torch stores ``(out, in)``), so a
        chunk generates whole neurons. ``"ravel"``: :func:`~nnxscan.pure.hyper.ravel`'s
        order (a flax kernel ``(in, out)`` row by row: a chunk cuts across every neuron).
        Split digits forgot less with ``"units"`` (the guide's continual-learning section).
      init, init_gain: the variance each generated tensor starts with (the per-tensor
        gains): ``"target"`` (default), ``"hyperfan_in"``, ``"hyperfan_out"`` or ``"zeros"``;
        see :func:`~nnxscan.pure.hyper.variance.init_moments`.
      param_dtype: dtype of the weights.
      rngs: draws the weights.

    Attributes:
      chunk_embeddings: ``(num_chunks, embedding_features)`` Param, or
        ``(num_conditions, num_chunks, embedding_features)`` with ``num_conditions``.
      feature_kernel, embedding_kernel, hidden_bias: the hidden layer on ``[h, c_i]``.
      out_kernel, out_bias: the shared ``(d_m, chunk_size)`` output layer.
      gains, offsets: one Param entry per generated tensor, in spec order.

    Example:
      >>> heads = hyper.ChunkedHeads(spec, 32, chunk_size=256, rngs=nnx.Rngs(0))
      >>> y = hyper.call(spec, heads(jnp.ones(32)), x)
      >>> heads.num_params < spec.size
      True
    """

    def __init__(
        self,
        spec: ParamSpec,
        in_features: int,
        *,
        chunk_size: int,
        embedding_features: int = 16,
        hidden_features: int | None = None,
        input_variance: float = 1.0,
        num_conditions: int | None = None,
        order: str = "units",
        init: str = "target",
        init_gain: float = 2.0,
        param_dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        check_init(init, init_gain)
        if order not in ("units", "ravel"):
            raise ValueError(f"order must be 'units' or 'ravel', got {order!r}.")
        self.order = order
        if num_conditions is not None:
            num_conditions = checks.check_count(num_conditions, "num_conditions", 1)
        if not isinstance(spec, ParamSpec):
            raise TypeError(
                f"ChunkedHeads needs a ParamSpec (hyper.ParamSpec.from_module(target)), got "
                f"{type(spec).__name__}."
            )
        in_features = checks.check_count(in_features, "in_features", 1)
        chunk_size = checks.check_count(chunk_size, "chunk_size", 1)
        embedding_features = checks.check_count(embedding_features, "embedding_features", 1)
        hidden = in_features if hidden_features is None else hidden_features
        hidden = checks.check_count(hidden, "hidden_features", 1)
        if not input_variance > 0:
            raise ValueError(f"input_variance must be positive, got {input_variance!r}.")
        if chunk_size > spec.size:
            raise ValueError(
                f"chunk_size={chunk_size} is larger than the {spec.size} generated scalars "
                f"(spec.size): one chunk would be mostly padding. Use chunk_size <= "
                f"{spec.size}, or HyperHeads (Hypernetwork without chunk_size)."
            )
        self.in_features = in_features
        self.chunk_size = chunk_size
        self.num_chunks = math.ceil(spec.size / chunk_size)
        self.size = spec.size
        self.treedef = spec.treedef
        self.leaves = spec.leaves
        self.num_conditions = num_conditions
        dtype = jnp.dtype(param_dtype)
        embeddings, w_h, w_c, w_o = _init_chunk_weights(
            rngs.params(),
            jnp.float32(input_variance),
            num_chunks=self.num_chunks,
            in_features=in_features,
            embed=embedding_features,
            hidden=hidden,
            chunk=chunk_size,
            tables=num_conditions or 1,
            dtype=dtype,
        )
        self.chunk_embeddings = nnx.Param(embeddings if num_conditions else embeddings[0])
        self.feature_kernel = nnx.Param(w_h)
        self.embedding_kernel = nnx.Param(w_c)
        self.hidden_bias = nnx.Param(jnp.zeros(hidden, dtype))
        self.out_kernel = nnx.Param(w_o)
        self.out_bias = nnx.Param(jnp.zeros(chunk_size, dtype))
        variance, constant = init_moments(spec, init, init_gain)
        self.gains = nnx.Param(jnp.sqrt(variance).astype(dtype))
        self.offsets = nnx.Param(constant.astype(dtype))

    def _to_tensor(self, piece: jax.Array, t: int) -> jax.Array:
        """Tensor ``t`` from its slice of the flat vector (see ``order``)."""
        leaf = self.leaves[t]
        batch, shape = piece.shape[:-1], leaf.shape
        if self.order == "ravel" or len(shape) < 2:
            return piece.reshape(*batch, *shape).astype(leaf.dtype)
        # Output unit by output unit: unit j's whole fan-in (kernel[..., j]) is contiguous.
        units = piece.reshape(*batch, shape[-1], *shape[:-1])
        return jnp.moveaxis(units, len(batch), -1).astype(leaf.dtype)

    def _to_piece(self, tensor: jax.Array, t: int) -> jax.Array:
        shape = self.leaves[t].shape
        batch = tensor.ndim - len(shape)
        if self.order == "units" and len(shape) >= 2:
            tensor = jnp.moveaxis(tensor, -1, batch)
        return tensor.reshape(*tensor.shape[:batch], -1)

    @property
    def paths(self) -> tuple[str, ...]:
        """The target paths generated, e.g. ``'out/kernel'``, in spec order."""
        return tuple(leaf.name for leaf in self.leaves)

    @property
    def num_params(self) -> int:
        """Number of scalars in the heads' own Params (embeddings, layers, gains, offsets).

        Example:
          >>> heads.num_params / spec.size     # < 1: the heads are smaller than the target
        """
        return sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param)))

    def _embeddings(self, condition: jax.Array | int | None) -> jax.Array:
        """The ``(num_chunks, embedding_features)`` chunk embeddings for ``condition``."""
        if condition is EVERY_CONDITION:  # every table, (num_conditions, ...) or shared
            return self.chunk_embeddings[...]
        if self.num_conditions is None:
            if condition is not None:
                raise ValueError(
                    "these ChunkedHeads share one set of chunk embeddings (num_conditions="
                    "None), so they take no condition; build them with num_conditions=... "
                    "for one set per condition."
                )
            return self.chunk_embeddings[...]
        if condition is None:
            raise ValueError(
                f"these ChunkedHeads hold chunk embeddings per condition (num_conditions="
                f"{self.num_conditions}): call heads(h, condition=c)."
            )
        return select_table(self.chunk_embeddings[...], condition, "ChunkedHeads")

    def _hidden(self, h: jax.Array, condition: jax.Array | int | None = None) -> jax.Array:
        """The RMS-normalized hidden features of every chunk: ``(..., num_chunks, d_m)``."""
        if jnp.shape(h)[-1:] != (self.in_features,):
            raise ValueError(
                f"ChunkedHeads expects features with a last axis of size {self.in_features}, "
                f"got shape {jnp.shape(h)}. Check the trunk's output size (trunk_features)."
            )
        # The chunk part does not depend on h: under vmap it is computed once, unbatched.
        embeddings = self._embeddings(condition)
        per_chunk = embeddings @ self.embedding_kernel[...] + self.hidden_bias[...]
        hidden = jnp.tanh((h @ self.feature_kernel[...])[..., None, :] + per_chunk)
        return hidden * jax.lax.rsqrt(jnp.mean(hidden**2, axis=-1, keepdims=True) + _RMS_EPS)

    def flat(self, h: jax.Array, condition: jax.Array | int | None = None) -> jax.Array:
        """The raw ``(..., spec.size)`` vector before the per-tensor gains and offsets.

        Example:
          >>> heads.flat(jnp.ones(32)).shape == (spec.size,)
          True
        """
        return self._raw(h, condition)[..., : self.size]

    def _raw(self, h: jax.Array, condition: jax.Array | int | None) -> jax.Array:
        """Every chunk's raw output, as one ``(..., num_chunks * chunk_size)`` vector."""
        raw = self._hidden(h, condition) @ self.out_kernel[...] + self.out_bias[...]
        return raw.reshape(*raw.shape[:-2], self.num_chunks * self.chunk_size)

    def _split(self, raw: jax.Array) -> list[jax.Array]:
        """``raw`` cut into one piece per tensor (spec order), then the unused tail.

        ``jax.lax.split``, not one slice per tensor: the gradient of a slice is a pad to the
        whole vector, one full pass per tensor; ``split``'s is one concatenation.
        """
        sizes = [leaf.size for leaf in self.leaves]
        tail = raw.shape[-1] - self.size
        return jax.lax.split(raw, [*sizes, tail] if tail else sizes, axis=-1)

    def _pieces(self, h: jax.Array, condition: jax.Array | int | None) -> list[jax.Array]:
        """Each tensor's piece, gain and offset applied, in spec order (the vector's)."""
        raw = self._raw(h, condition)
        gains, offsets = self.gains[...], self.offsets[...]
        return [
            piece * gains[t] + offsets[t]
            for t, piece in enumerate(self._split(raw)[: len(self.leaves)])
        ]

    def __call__(self, h: jax.Array, condition: jax.Array | int | None = None) -> nnx.State:
        """Generated params for features ``h`` of shape ``(..., in_features)``.

        ``condition`` (an int id) picks the chunk embeddings when they are per condition
        (``num_conditions``), and must be left out otherwise.

        Example:
          >>> params = heads(jnp.ones(32))       # one network's params
          >>> params = per_task_heads(jnp.ones(32), condition=2)
        """
        return self._params(self._pieces(h, condition))

    def vector(self, h: jax.Array, condition: jax.Array | int | None = None) -> jax.Array:
        """The generated params as one ``(..., spec.size)`` vector in the heads' own order:
        tensor after tensor in spec order, each as the chunks hold it (with ``order=
        "units"``, a kernel output unit by output unit; see ``vector.py``).

        Example:
          >>> heads.params_of(heads.vector(h))   # == heads(h), bitwise
        """
        return jnp.concatenate(self._pieces(h, condition), axis=-1)
