"""The check that a model is an NNX module, with the way out for a Flax Linen one."""

from __future__ import annotations

import sys
from typing import Any

from flax import nnx

LINEN_HINT = (
    "wrap it with nnxscan.adapters.linen.LinenModule(module, sample_x, rngs=nnx.Rngs(0)), "
    "which initializes it from an example input and lets model.eval() switch its train "
    "mode (docs/porting.md, 'A Linen model')"
)


def is_linen(value: Any) -> bool:
    """Whether ``value`` is a Flax Linen module (``flax.linen`` is looked up, not imported:
    a Linen module exists only where it was imported already)."""
    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(value, linen.Module)


def check_module(model: Any, name: str = "model") -> None:
    """Raises TypeError unless ``model`` is an ``nnx.Module``; a Linen module is told how to
    wrap itself.

    Example:
      >>> check_module(LinenMLP())
      TypeError: model is a Flax Linen module (LinenMLP), not an nnx.Module: wrap it with ...
    """
    if isinstance(model, nnx.Module):
        return
    kind = type(model).__name__
    if is_linen(model):
        raise TypeError(f"{name} is a Flax Linen module ({kind}), not an nnx.Module: {LINEN_HINT}.")
    raise TypeError(f"{name} must be an nnx.Module, got {kind}.")
