"""The variance each generated tensor starts with: the init choices of the heads.

Every kind of heads (:class:`~nnxscan.pure.hyper.HyperHeads`,
:class:`~nnxscan.pure.hyper.ChunkedHeads`, :class:`~nnxscan.pure.hyper.StructuredHeads`)
scales its output so that generated tensor ``t`` starts with the variance ``v_t`` chosen
here (and constant tensors at the value ``m_t``):

- ``"target"`` (default): the variance and constants the spec measured on the target's own
  freshly initialized tensors (``spec.init_var``, ``spec.init_mean``);
- ``"hyperfan_in"`` / ``"hyperfan_out"``: Chang, Flokas & Lipson (ICLR 2020), as
  hypnettorch's ``apply_hyperfan_init`` computes them. With ``c`` the gain (2 for ReLU
  targets, 1 for linear or tanh ones), a kernel of fan-in ``d_j`` and fan-out ``d_i``
  (``prod(shape[:-1])`` and ``prod(shape[:-2]) · shape[-1]``: a Linear's ``(in, out)``, a
  conv's ``(kh, kw, in, out)``) gets ``c / (c_b · d_j)`` (in) or ``c / d_i`` (out), with
  ``c_b = 2`` when its layer's bias is generated too; that bias gets ``c / 2`` (in) or
  ``c · max(0, 1 − d_j / d_i)`` (out). A head then draws its weights with variance
  ``v_t / (d_k · Var(e))`` (the paper's head variances). A 1-D tensor with no generated
  kernel beside it (a norm's scale) keeps its ``"target"`` value;
- ``"zeros"``: every generated tensor starts at exactly zero (a delta added to pretrained
  weights, :class:`~nnxscan.pure.hyper.Hypernetwork`'s ``pretrained=``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from nnxscan.pure.hyper.spec import ParamSpec

__all__ = ["INITS", "check_init", "init_moments"]

INITS = ("target", "hyperfan_in", "hyperfan_out", "zeros")


def check_init(init: str, gain: float) -> None:
    """Raises ValueError for an unknown ``init`` or a non-positive ``gain``."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}.")
    if not gain > 0:
        raise ValueError(f"init_gain must be positive, got {gain!r}.")


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    receptive = math.prod(shape[:-2])
    return receptive * shape[-2], receptive * shape[-1]


def init_moments(spec: ParamSpec, init: str = "target", gain: float = 2.0) -> tuple:
    """Per-tensor ``(variance, constant)`` the heads start each generated tensor with.

    Args:
      spec: the target's spec.
      init: ``"target"``, ``"hyperfan_in"``, ``"hyperfan_out"`` or ``"zeros"`` (module doc).
      gain: the hyperfan inits' ``c`` (2 for ReLU targets, 1 for linear/tanh).

    Returns:
      ``(variance, constant)``: two ``(len(spec.leaves),)`` float32 arrays; tensors
      with zero variance start at ``constant`` exactly, the others are zero-mean.

    Example:
      >>> var, const = init_moments(spec, "hyperfan_in", gain=2.0)
      >>> float(var[1])            # the 64→100 kernel of a ReLU MLP with a generated bias
      0.015625
    """
    check_init(init, gain)
    n = len(spec.leaves)
    if init == "zeros":
        return jnp.zeros(n, jnp.float32), jnp.zeros(n, jnp.float32)
    # jnp, not numpy: the spec's moments may be traced (heads built under nnx.eval_shape).
    measured_var = jnp.asarray(spec.init_var, jnp.float32)
    constant = jnp.where(measured_var == 0, spec.init_mean, 0.0).astype(jnp.float32)
    if init == "target":
        return measured_var, constant
    kernels = {leaf.path[:-1]: leaf for leaf in spec.leaves if len(leaf.shape) >= 2}
    generated_bias = {leaf.path[:-1] for leaf in spec.leaves if len(leaf.shape) == 1}

    def closed_form(leaf) -> float | None:
        layer = leaf.path[:-1]
        if len(leaf.shape) >= 2:
            fan_in, fan_out = _fans(leaf.shape)
            c_b = 2.0 if layer in generated_bias else 1.0
            return gain / (c_b * fan_in) if init == "hyperfan_in" else gain / fan_out
        if len(leaf.shape) == 1 and layer in kernels:
            fan_in, fan_out = _fans(kernels[layer].shape)
            return gain / 2 if init == "hyperfan_in" else gain * max(0, 1 - fan_in / fan_out)
        return None  # a norm's scale, a scalar: the target's own value

    values = [closed_form(leaf) for leaf in spec.leaves]
    by_formula = np.array([v is not None for v in values])
    formula = np.array([0.0 if v is None else v for v in values], np.float32)
    return (
        jnp.where(by_formula, formula, measured_var),
        jnp.where(by_formula, 0.0, constant).astype(jnp.float32),
    )
