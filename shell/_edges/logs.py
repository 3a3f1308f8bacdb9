"""An epoch's logs from its outputs on the host: one reducer for one model and for members.

Per-step losses have shape ``(steps, *layout.shape)``: ``(steps,)`` for one model,
``(steps, N)`` for a population. Every statistic reduces over the steps axis only, and the
run's layout (``_engine.layout``) says how a reduced value is logged: a float for one
model, an ``(N,)`` array for N members. The layout says which, never the shapes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax

from nnxscan.shell._edges.host import to_host
from nnxscan.shell.history import History

if TYPE_CHECKING:  # the engine's type only: the edges import nothing of the engine
    from nnxscan.shell._engine.layout import Layout

RESERVED_LOGS = frozenset(
    {
        "epoch",
        "loss",
        "steps",
        "steps_per_sec",
        "wall_time",
        "dropped_examples",
        "skipped_steps",
        "learning_rate",
        "active",
        "compile_time",
    }
)


def scalar_aux(aux: Any, layout: Layout) -> dict[str, Any]:
    """The aux leaves that are a scalar per step (per member): ``(steps, *layout.shape)``, as
    ``layout.log_shape`` says, keyed by their log name (their path; a name that would shadow
    one of fit's own logs gets ``aux/``)."""
    leaves = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
        if layout.log_shape(leaf, steps=1) == ():
            key = jax.tree_util.keystr(path, simple=True, separator="/") or "aux"
            leaves[f"aux/{key}" if key in RESERVED_LOGS else key] = leaf
    return leaves


def aux_means(aux: Any, layout: Layout, skipping: bool = False) -> dict[str, Any]:
    """Means over steps of every aux leaf that is a scalar per step (per member), keyed as
    :func:`scalar_aux` names them."""
    return {
        key: layout.value(layout.step_mean(np.asarray(leaf), skipping))
        for key, leaf in scalar_aux(aux, layout).items()
    }


def epoch_logs(
    epoch: int,
    stacked: Any,
    wall_time: float,
    *,
    has_aux: bool,
    layout: Layout,
    skipping: bool = False,
    dropped: int = 0,
    compile_time: float = 0.0,
) -> tuple[dict[str, Any], np.ndarray]:
    """The epoch's logs and its per-step losses (``(steps, *layout.shape)``)."""
    losses, aux = stacked if has_aux else (stacked, None)
    losses = np.asarray(losses, np.float32)
    logs: dict[str, Any] = {"epoch": epoch}
    logs["loss"] = layout.value(layout.step_mean(losses, skipping))
    if skipping:
        logs["skipped_steps"] = layout.count(np.sum(~np.isfinite(losses), axis=0))
    if aux is not None:
        logs.update(aux_means(aux, layout, skipping))
    steps = int(losses.shape[0])
    running = max(wall_time - compile_time, 1e-9)
    logs.update(
        steps=steps, steps_per_sec=steps / running, wall_time=wall_time,
        compile_time=compile_time,
    )  # fmt: skip
    if dropped:
        logs["dropped_examples"] = dropped
    return logs, losses


#: The states of ``optax.inject_hyperparams``: theirs hold the CURRENT value of a scheduled
#: rate. A step's own state of the same shape (the PPO demo's ``PPOHyperparams``, which
#: ``with_hyperparams`` and populations set alike) may hold a base rate that the step
#: anneals: logging it as the rate would be wrong, so only optax's own states are read.
_OPTAX_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def learning_rate(opt_state: Any, layout: Layout) -> Any:
    """The current learning rate (an ``(N,)`` array for members), when ``tx`` came from
    ``optax.inject_hyperparams``; else None."""

    def injected(node: Any) -> bool:
        return isinstance(node, _OPTAX_INJECTED)

    for node in jax.tree.leaves(opt_state, is_leaf=injected):
        if injected(node) and "learning_rate" in node.hyperparams:
            return layout.value(to_host(node.hyperparams["learning_rate"]))
    return None


def host_outputs(outs: list[Any], start: float) -> tuple[Any, float]:
    """The calls' stacked outputs joined on the host, and the seconds since ``start``.

    One host transfer per epoch (or fused group of epochs): the only sync fit makes. The
    clock stops after it, so steps/s counts the work, not just its asynchronous dispatch.
    """
    outs = to_host(outs)
    wall_time = time.perf_counter() - start
    return jax.tree.map(lambda *xs: np.concatenate(xs), *outs), wall_time


def split_steps(stacked: Any, count: int) -> list[Any]:
    """``stacked`` outputs of ``count`` fused epochs of equal length, one per epoch."""
    return [jax.tree.map(lambda x, i=i: np.array_split(x, count)[i], stacked) for i in range(count)]


def prepend_losses(
    partial: np.ndarray,
    stacked: Any,
    has_aux: bool,
    partial_aux: dict[str, np.ndarray] | None,
    layout: Layout,
) -> Any:
    """The resumed epoch's outputs with those of the steps trained before the interruption first:
    their losses, and (``partial_aux``, from :func:`partial_scalar_aux`) their scalar aux logs, so
    the epoch's logs average every step of it."""
    if not has_aux:
        return np.concatenate([partial, np.asarray(stacked, np.float32)])
    losses, aux = stacked
    losses = np.concatenate([partial, np.asarray(losses, np.float32)])
    if partial_aux is not None:
        aux = scalar_aux(aux, layout)
        aux = _joined([partial_aux, aux], {**partial_aux, **aux})
    return losses, aux


def partial_scalar_aux(
    before: dict[str, np.ndarray] | None, outs: list[Any], has_aux: bool, layout: Layout
) -> dict[str, np.ndarray] | None:
    """The unfinished epoch's scalar aux logs per step (:func:`scalar_aux`, on the host):
    ``before`` (those of its steps trained before a resume; None: unknown) followed by
    those of ``outs``, its calls since. None when unknown or when the step reports no aux."""
    if not has_aux or before is None:
        return None
    new = [scalar_aux(out[1], layout) for out in to_host(outs)]
    return _joined([before, *new], new[0] if new else before)


def _joined(parts: list[dict[str, Any]], keys: Any) -> dict[str, np.ndarray]:
    """Each key's per-step arrays in ``parts`` (dicts, not all holding every key), joined."""
    return {key: np.concatenate([np.asarray(p[key]) for p in parts if key in p]) for key in keys}


def empty_losses(layout: Layout) -> np.ndarray:
    """No steps' losses yet: ``(0, *layout.shape)``."""
    return np.zeros((0, *layout.shape), np.float32)


def empty_history(layout: Layout) -> History:
    """A History of no steps yet, laid out as ``layout``: losses ``(0, *layout.shape)``, and
    ``layout.num_members`` declared (plots and writers read it, never the shapes)."""
    return History(empty_losses(layout), num_members=layout.num_members)
