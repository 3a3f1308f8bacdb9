"""What every metric writer does with an epoch's logs: plain numbers, process 0 only."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from nnxscan.adapters.distributed import is_primary


def plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds; anything else unchanged."""
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "shape", None) == ():
        return item()
    return value


def is_number(value: Any) -> bool:
    """A real number that is not a bool (bools are flags, not metrics)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def primary_only(hook: Any) -> Any:
    """Runs a writer's hook on process 0 only: several processes train one model, and
    one log is wanted, not one per process writing over the others."""

    @functools.wraps(hook)
    def wrapped(self: Any, *args: Any) -> Any:
        if is_primary():
            return hook(self, *args)
        return None

    return wrapped


def spread(logs: Mapping[str, Any]) -> dict[str, Any]:
    """Logs with every array value spread into one entry per element: ``key/i``, and
    ``key/i/j`` for two axes. A ``Population``'s logs hold one value per member along
    their first axis (its ``num_members`` says how many), so ``loss/2`` is member 2's
    loss; a Trainer's array metric (``hits_per_class``) gives one entry per class; scalars
    are unchanged."""
    out: dict[str, Any] = {}
    for key, value in logs.items():
        if np.ndim(value) >= 1 and not isinstance(value, str):
            out.update(spread({f"{key}/{i}": v for i, v in enumerate(np.asarray(value))}))
        else:
            out[key] = value
    return out


def numeric_logs(logs: Mapping[str, Any], num_members: int | None = None) -> dict[str, float]:
    """The numbers among one epoch's logs, as ``{key: float}``, arrays spread into
    ``key/i`` (:func:`spread`; for a ``Population``, of ``num_members`` members, ``i`` is
    the member). Anything that is not a real number (text, flags) is left out."""
    out: dict[str, float] = {}
    for key, value in spread(logs).items():
        value = plain(value)
        if is_number(value):
            out[key] = float(value)
    return out


def run_params(trainer: Any, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The hyperparameters of a run: the user's ``params``, then, for a ``Population``,
    ``num_members`` and each member's ``seed/i`` and ``<hyperparameter>/i``."""
    out = {key: plain(value) for key, value in (params or {}).items()}
    members = getattr(trainer, "num_members", None)
    if members is None:
        return out
    out["num_members"] = members
    for i, seed in enumerate(getattr(trainer, "seeds", ())):
        out[f"seed/{i}"] = plain(seed)
    for name, values in (getattr(trainer, "hyperparams", None) or {}).items():
        for i, value in enumerate(values):
            out[f"{name}/{i}"] = plain(value)
    return out
