"""The checks that a model is an NNX module (the user's, or what ``model_fn`` built), with the
way out for a Flax Linen one."""

from __future__ import annotations

import sys
from collections.abc import Callable
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


def call_model_fn(model_fn: Callable, seed: int, rngs: nnx.Rngs | None = None) -> nnx.Module:
    """``model_fn(nnx.Rngs(seed))``, checked to be an NNX module. ``rngs``: the ``nnx.Rngs``
    to pass instead (one made from a traced key under a members' ``vmap``); ``seed`` then
    only names the call in an error."""
    model = model_fn(nnx.Rngs(seed) if rngs is None else rngs)
    if is_linen(model):
        raise TypeError(
            f"model_fn(nnx.Rngs({seed})) returned {type(model).__name__}, a Flax Linen module, "
            f"not an nnx.Module: return it wrapped, e.g. model_fn=lambda rngs: "
            f"nnxscan.adapters.linen.LinenModule({type(model).__name__}(...), sample_x, "
            f"rngs=rngs), which initializes it from an example input and lets model.eval() "
            f"switch its train mode (docs/porting.md, 'A Linen model')."
        )
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model_fn(nnx.Rngs({seed})) returned {type(model).__name__}, not an nnx.Module: "
            f"it must build and return one module, e.g. model_fn=lambda rngs: MLP(rngs=rngs)."
        )
    return model
