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
per-chunk offset. (Computed per tensor, from the chunks it overlaps, as
``â_i · (gain_t · W_o) + (gain_t · b_o + offset_t)``: the same values, without passes over
the whole generated vector; :meth:`ChunkedHeads.flat` gives the raw vector itself.)

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

__all__ = ["ChunkedHeads"]

_RMS_EPS = 1e-6


# One compiled initializer per layout (a random call per array costs a compile per shape).
@functools.partial(
    jax.jit, static_argnames=("num_chunks", "in_features", "embed", "hidden", "chunk", "dtype")
)
def _init_chunk_weights(
    key, input_variance, *, num_chunks, in_features, embed, hidden, chunk, dtype
):
    k_emb, k_h, k_c, k_o = jax.random.split(key, 4)
    embeddings = jax.random.normal(k_emb, (num_chunks, embed), dtype)
    w_h = jax.random.normal(k_h, (in_features, hidden), dtype)
    w_c = jax.random.normal(k_c, (embed, hidden), dtype)
    w_o = jax.random.normal(k_o, (hidden, chunk), dtype)
    # Half of the pre-activation's unit variance from h, half from the chunk embedding.
    w_h = w_h * jnp.sqrt(0.5 / (in_features * input_variance)).astype(dtype)
    w_c = w_c * jnp.sqrt(0.5 / embed).astype(dtype)
    w_o = w_o * jnp.sqrt(1.0 / hidden).astype(dtype)
    return embeddings, w_h, w_c, w_o


class ChunkedHeads(nnx.Module):
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
      param_dtype: dtype of the weights.
      rngs: draws the weights.

    Attributes:
      chunk_embeddings: ``(num_chunks, embedding_features)`` Param.
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
        param_dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
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
        dtype = jnp.dtype(param_dtype)
        embeddings, w_h, w_c, w_o = _init_chunk_weights(
            rngs.params(),
            jnp.float32(input_variance),
            num_chunks=self.num_chunks,
            in_features=in_features,
            embed=embedding_features,
            hidden=hidden,
            chunk=chunk_size,
            dtype=dtype,
        )
        self.chunk_embeddings = nnx.Param(embeddings)
        self.feature_kernel = nnx.Param(w_h)
        self.embedding_kernel = nnx.Param(w_c)
        self.hidden_bias = nnx.Param(jnp.zeros(hidden, dtype))
        self.out_kernel = nnx.Param(w_o)
        self.out_bias = nnx.Param(jnp.zeros(chunk_size, dtype))
        self.gains = nnx.Param(jnp.sqrt(spec.init_var).astype(dtype))
        self.offsets = nnx.Param(jnp.where(spec.init_var == 0, spec.init_mean, 0.0).astype(dtype))

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

    def _hidden(self, h: jax.Array) -> jax.Array:
        """The RMS-normalized hidden features of every chunk: ``(..., num_chunks, d_m)``."""
        if jnp.shape(h)[-1:] != (self.in_features,):
            raise ValueError(
                f"ChunkedHeads expects features with a last axis of size {self.in_features}, "
                f"got shape {jnp.shape(h)}. Check the trunk's output size (trunk_features)."
            )
        # The chunk part does not depend on h: under vmap it is computed once, unbatched.
        per_chunk = self.chunk_embeddings[...] @ self.embedding_kernel[...] + self.hidden_bias[...]
        hidden = jnp.tanh((h @ self.feature_kernel[...])[..., None, :] + per_chunk)
        return hidden * jax.lax.rsqrt(jnp.mean(hidden**2, axis=-1, keepdims=True) + _RMS_EPS)

    def flat(self, h: jax.Array) -> jax.Array:
        """The raw ``(..., spec.size)`` vector before the per-tensor gains and offsets.

        Example:
          >>> heads.flat(jnp.ones(32)).shape == (spec.size,)
          True
        """
        raw = self._hidden(h) @ self.out_kernel[...] + self.out_bias[...]
        raw = raw.reshape(*raw.shape[:-2], self.num_chunks * self.chunk_size)
        return raw[..., : self.size]

    def __call__(self, h: jax.Array) -> nnx.State:
        """Generated params for features ``h`` of shape ``(..., in_features)``.

        Example:
          >>> params = heads(jnp.ones(32))       # one network's params
        """
        hidden = self._hidden(h)
        batch = hidden.shape[:-2]
        w_o, b_o = self.out_kernel[...], self.out_bias[...]
        gains, offsets = self.gains[...], self.offsets[...]
        values, start = [], 0
        for t, leaf in enumerate(self.leaves):
            # Each tensor from only the chunks it overlaps, not a slice of the whole flat
            # vector: the backward pass then never pads a tensor's gradient to the full
            # (..., spec.size) (2.5x slower training steps when measured); chunks shared
            # by two tensors are computed twice (at most two extra per tensor).
            # The gain and offset go into the small shared layer (gain·W_o, gain·b_o +
            # offset), not onto the generated entries: same values, no extra passes over
            # the (..., spec.size) output in either direction.
            first, last = start // self.chunk_size, (start + leaf.size - 1) // self.chunk_size
            raw = hidden[..., first : last + 1, :] @ (gains[t] * w_o) + (
                gains[t] * b_o + offsets[t]
            )
            raw = raw.reshape(*batch, (last + 1 - first) * self.chunk_size)
            offset = start - first * self.chunk_size
            piece = raw[..., offset : offset + leaf.size]
            values.append(piece.reshape(*batch, *leaf.shape).astype(leaf.dtype))
            start += leaf.size
        return jax.tree.unflatten(self.treedef, values)
