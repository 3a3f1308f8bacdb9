"""HyperHeads: one linear head per generated tensor, initialized to match the target's init.

Each generated tensor ``t`` of shape ``S`` (``n_t`` scalars) gets its own head,
``θ_t = reshape(h · K_t, S) + B_t`` with ``K_t`` of shape ``(d_k, n_t)`` and ``B_t`` of shape
``S``; ``h`` is the ``d_k`` features the hypernetwork's trunk produces. The output is an
``nnx.State`` shaped like the target's generated params: no long vector to cut up, one matmul
per tensor, and in the backward pass no concatenation of all the tensors' gradients.

Initialization (hyperfan-in, matched per tensor). For ``h`` with i.i.d. entries of variance
``Var(e)`` (``input_variance``, 1 by default) and ``K_t`` i.i.d. with variance ``σ_t²``, each
generated entry has variance ``d_k · Var(e) · σ_t²``. We want the generated tensor to be
distributed like the target's own freshly initialized tensor, whose mean ``m_t`` and
variance ``v_t`` the spec measured on the target (``spec.init_mean``, ``spec.init_var``):

- ``σ_t² = v_t / (d_k · Var(e))``, so generated entries have variance ``v_t``;
- ``B_t = m_t`` when the target's tensor is constant (``v_t = 0``: zero biases, unit
  BatchNorm/LayerNorm scales), else ``0`` (random initializers are zero-mean);
- so constant tensors start exactly at the target's value, with zero head weights (their
  gradient ``h ⊗ ∂L/∂θ_t`` is not zero, so they learn).

For a ``lecun_normal`` kernel (flax's default, ``v_t = 1/d_j`` for fan-in ``d_j``) this is
Chang, Flokas & Lipson's hyperfan-in ``Var(K) = c / (c_b · d_j · d_k · Var(e))`` with
``c = 1``; for ``he_normal`` (``v_t = 2/d_j``) it is ``c = 2``: measuring ``v_t`` picks the
gain the target itself chose. The paper's ``c_b = 2`` and its bias-head variance
``c / (2 · d_k · Var(e))`` split the pre-activation variance between a random kernel and a
random bias; flax targets initialize biases to zero, so we keep all of it in the kernel
(``c_b = 1``) and start generated biases at zero, like the target. ``v_t`` is measured on
the target's one realized tensor, so for tensors of a few elements it is a rough estimate.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from nnxscan.pure.hyper.spec import ParamSpec
from nnxscan.pure.hyper.variance import check_init, init_moments
from nnxscan.pure.hyper.vector import VectorHeads

__all__ = ["HyperHeads", "head_init_scale"]


def head_init_scale(
    spec: ParamSpec,
    in_features: int,
    input_variance: float = 1.0,
    init: str = "target",
    init_gain: float = 2.0,
) -> jax.Array:
    """Per-tensor standard deviation of the head weights: ``sqrt(v_t / (d_k · Var(e)))``.

    ``v_t`` is the variance ``init`` chooses for generated tensor ``t`` (see
    :func:`~nnxscan.pure.hyper.variance.init_moments`: the target's own, hyperfan-in or
    -out, or zero).

    Example:
      >>> head_init_scale(spec, 32)   # (len(spec.leaves),)
      >>> head_init_scale(spec, 32, init="hyperfan_out", init_gain=2.0)
    """
    variance, _ = init_moments(spec, init, init_gain)
    return jnp.sqrt(variance / (in_features * input_variance))


# One compiled initializer per set of head shapes, drawing all head weights with one random
# call (a random call per tensor costs a threefry compile per shape).
@functools.partial(jax.jit, static_argnames=("shapes", "in_features", "dtype"))
def _init_head_weights(key, scales, fills, *, shapes, in_features, dtype):
    sizes = [in_features * math.prod(shape) for shape in shapes]
    noise = jax.random.normal(key, (sum(sizes),), dtype)
    kernels, offset = [], 0
    for scale, size in zip(scales, sizes, strict=True):
        piece = noise[offset : offset + size].reshape(in_features, size // in_features)
        kernels.append((scale * piece).astype(dtype))
        offset += size
    biases = [jnp.full(shape, fill, dtype) for fill, shape in zip(fills, shapes, strict=True)]
    return kernels, biases


class HyperHeads(VectorHeads):
    """Maps features ``h`` to generated params: one linear head per target tensor.

    Args:
      spec: the target's :class:`ParamSpec`.
      in_features: ``d_k``, the size of the last axis of ``h``.
      input_variance: the variance of ``h``'s entries the init assumes (see module doc).
      init: the variance each generated tensor starts with: ``"target"`` (default, the
        target's own initializer's), ``"hyperfan_in"``, ``"hyperfan_out"`` (Chang et al.,
        with gain ``init_gain``: 2 for ReLU targets, 1 for linear/tanh) or ``"zeros"``
        (every generated tensor starts at zero); see
        :func:`~nnxscan.pure.hyper.variance.init_moments`.
      init_gain: the hyperfan inits' ``c``.
      param_dtype: dtype of the head weights.
      rngs: draws the head weights.

    Calling ``heads(h)`` with ``h`` of shape ``(..., in_features)`` returns an ``nnx.State``
    shaped like the target's generated params, each leaf with ``h``'s leading axes in front
    and cast to the target tensor's dtype. Pass one ``h`` per network to :func:`call`; for
    many networks, ``jax.vmap`` over ``h``.

    Attributes:
      kernels, biases: ``nnx.List`` of Params, one per generated tensor in spec order
        (``paths`` names them).

    Example:
      >>> heads = hyper.HyperHeads(spec, 32, rngs=nnx.Rngs(0))
      >>> params = heads(jnp.ones(32))
      >>> y = hyper.call(spec, params, x)
    """

    def __init__(
        self,
        spec: ParamSpec,
        in_features: int,
        *,
        input_variance: float = 1.0,
        init: str = "target",
        init_gain: float = 2.0,
        param_dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        check_init(init, init_gain)
        if not isinstance(spec, ParamSpec):
            raise TypeError(
                f"HyperHeads needs a ParamSpec (hyper.ParamSpec.from_module(target)), got "
                f"{type(spec).__name__}."
            )
        if int(in_features) != in_features or in_features < 1:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}.")
        if not input_variance > 0:
            raise ValueError(f"input_variance must be positive, got {input_variance!r}.")
        self.in_features = int(in_features)
        self.treedef = spec.treedef
        self.leaves = spec.leaves
        _, constant = init_moments(spec, init, init_gain)
        kernels, biases = _init_head_weights(
            rngs.params(),
            head_init_scale(spec, self.in_features, input_variance, init, init_gain),
            constant,
            shapes=tuple(leaf.shape for leaf in spec.leaves),
            in_features=self.in_features,
            dtype=jnp.dtype(param_dtype),
        )
        self.kernels = nnx.List([nnx.Param(k) for k in kernels])
        self.biases = nnx.List([nnx.Param(b) for b in biases])

    @property
    def paths(self) -> tuple[str, ...]:
        """The target path each head generates, e.g. ``'out/kernel'``, in spec order."""
        return tuple(leaf.name for leaf in self.leaves)

    def _pieces(self, h: jax.Array) -> list[jax.Array]:
        if jnp.shape(h)[-1:] != (self.in_features,):
            raise ValueError(
                f"HyperHeads expects features with a last axis of size {self.in_features}, "
                f"got shape {jnp.shape(h)}. Check the trunk's output size (trunk_features)."
            )
        return [
            h @ kernel[...] + bias[...].reshape(-1)
            for kernel, bias in zip(self.kernels, self.biases, strict=True)
        ]

    def __call__(self, h: jax.Array) -> nnx.State:
        """Generated params for features ``h`` of shape ``(..., in_features)``.

        Example:
          >>> params = heads(jnp.ones(32))       # one network's params
        """
        return self._params(self._pieces(h))

    def vector(self, h: jax.Array) -> jax.Array:
        """The generated params as one ``(..., spec.size)`` vector: here in
        :func:`~nnxscan.pure.hyper.ravel`'s order (see ``vector.py``).

        Example:
          >>> heads.params_of(heads.vector(h))   # == heads(h), bitwise
        """
        return jnp.concatenate(self._pieces(h), axis=-1)
