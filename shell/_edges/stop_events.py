"""What EarlyStopping leaves in the History: the epoch it stopped at, the epoch it restored.

``History.events`` is a list of small dicts, so ``History.plot`` can mark them and a
checkpoint (through the run log, history.jsonl) keeps them. Each is::

    {"epoch": e, "step": s, "what": "early_stopping_stopped" | "restored_best"}

``epoch`` is the global epoch index ``fit`` logs; ``step`` the global step count at that
epoch's end. A ``Population``'s are per member, with ``"member": i`` added.
"""

from __future__ import annotations

from typing import Any

STOPPED = "early_stopping_stopped"
RESTORED = "restored_best"


def _step_after(history: Any, epoch: int, last_step: int) -> int:
    """The global step count at the end of ``epoch``: the count now, less the steps of the
    History's epochs after it."""
    later = [logs for logs in history.epochs if logs.get("epoch", -1) > epoch]
    return int(last_step) - sum(int(logs.get("steps", 0)) for logs in later)


def record_one_model(stop: Any, trainer: Any, history: Any) -> None:
    """Appends ``stop``'s events of this ``fit`` on one model to ``history.events``."""
    events = getattr(history, "events", None)
    if events is None:
        return
    if stop.stopped_epoch is not None:
        events.append({"epoch": int(stop.stopped_epoch), "step": int(trainer.step),
                       "what": STOPPED})  # fmt: skip
    if stop._best_state is not None and trainer.step != stop._best_step:
        events.append({"epoch": int(stop.best_epoch), "step": int(stop._best_step),
                       "what": RESTORED})  # fmt: skip


def record_members(stop: Any, population: Any, history: Any) -> None:
    """:func:`record_one_model` for each member of a population, with ``"member": i``."""
    events = getattr(history, "events", None)
    if events is None:
        return
    kept_best = stop._best_state is not None  # restore_best, and some epoch improved
    last = history.epochs[-1]["epoch"] if history.epochs else None
    for i in range(len(stop.best_epoch)):
        stopped, best = int(stop.stopped_epoch[i]), int(stop.best_epoch[i])
        if stopped >= 0:
            events.append({"epoch": stopped,
                           "step": _step_after(history, stopped, population.step),
                           "what": STOPPED, "member": i})  # fmt: skip
        trained_until = stopped if stopped >= 0 else last
        if kept_best and best >= 0 and best != trained_until:
            events.append({"epoch": best, "step": _step_after(history, best, population.step),
                           "what": RESTORED, "member": i})  # fmt: skip
