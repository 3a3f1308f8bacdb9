"""What ``Trainer`` and ``Population`` share: one argument-checking path for the step built
from a loss, and one implementation of the counters, ``fit``'s hand-over to the engine,
``save`` and ``restore``.

Both are facades over the one fit engine (``_engine.Engine``); they differ only in the owner
they hand it (the user's objects, or stacked members) and in what their ``fit`` calls a
run (one seed, or the members' order rule).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from nnxscan.pure.checks import check_count, check_no_captured_nnx
from nnxscan.shell._engine.engine import Engine
from nnxscan.shell._engine.options import fit_options
from nnxscan.shell.history import History

NONFINITE_POLICIES = ("ignore", "skip", "stop")


def check_policy(on_nonfinite: Any) -> None:
    if on_nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"on_nonfinite={on_nonfinite!r}; use one of {', '.join(NONFINITE_POLICIES)}."
        )


def check_loss_options(
    loss_fn: Any,
    *,
    accumulate: Any,
    metrics: Any,
    update_metrics: Any,
    captured: dict[str, Any] | None = None,
) -> int:
    """Checks the options of the step built from a loss; returns the checked
    ``accumulate``. ``captured``: the objects the loss receives (named), to tell a captured
    copy of one from a truly captured object. Run first: nothing may compile before it."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    check_no_captured_nnx(loss_fn, "loss_fn", arguments=captured)
    if (metrics is None) != (update_metrics is None):
        raise ValueError(
            "metrics and update_metrics go together: metrics=nnx.MultiMetric(...) and "
            "update_metrics=lambda metrics, loss, aux, batch: metrics.update(...)."
        )
    if update_metrics is not None and not callable(update_metrics):
        raise TypeError(f"update_metrics must be callable, got {type(update_metrics).__name__}.")
    return check_count(accumulate, "accumulate", 1)


class FrontDoor:
    """The part of ``Trainer`` and ``Population`` that only talks to the engine."""

    _engine: Engine
    _owner: Any

    @property
    def step(self) -> int:
        """Steps trained so far (an ``nnx.Optimizer``'s ``step`` when a Trainer has one)."""
        return self._owner.step

    @property
    def epoch(self) -> int:
        """The global index of the next epoch ``fit`` trains (epochs completed so far)."""
        return self._owner.epoch

    def _fit(
        self,
        data: Any,
        epochs: int,
        options: dict[str, Any],
        run_keys: dict[str, Any],
        member_batches: bool = False,
    ) -> History:
        checked = fit_options(
            self._engine, data, epochs, options, run_keys=run_keys,
            member_batches=member_batches, front_end="fit",
        )  # fmt: skip
        return self._engine.fit(data, checked)

    def save(self, directory: str | os.PathLike[str], *, max_to_keep: int = 3) -> pathlib.Path:
        """Writes a checkpoint of everything a resume needs, numbered by the global step:
        the model state (every member's, for a population: parameters, batch statistics,
        RNG keys and counts), the optax state, the epoch and step counters, the seed (the
        seeds and frozen members). The last ``max_to_keep`` are kept. Atomic: a crash
        mid-save leaves the earlier ones restorable. Saving again at a step that has a
        checkpoint keeps it, unless a state was loaded since.

        Example:
          >>> trainer.fit(data, epochs=2, batch_size=32)
          >>> trainer.save("/tmp/run")
          PosixPath('/tmp/run/16')
        """
        return self._engine.save(directory, max_to_keep=max_to_keep)

    def restore(self, directory: str | os.PathLike[str], *, step: int | None = None) -> int:
        """Loads the newest good (or the given) checkpoint into the model and optimizer
        (the members) and the counters; returns the epoch reached.

        A later ``fit`` continues exactly where the saved run stopped (seed included).
        Without ``step``, a damaged newer checkpoint (crc32 mismatch, truncated or missing
        files, a manifest nnxscan never writes) is skipped with a warning and left on
        disk; with ``step``, it raises ``CorruptCheckpointError`` (a ``ValueError``). A
        checkpoint whose structure or shapes differ (another architecture, other seeds)
        raises ``ValueError`` naming the first mismatching path and both shapes; a missing
        directory or checkpoint raises ``FileNotFoundError``. Every check runs before
        anything changes.

        Example:
          >>> trainer = Trainer(Model(nnx.Rngs(0)), optax.adam(1e-3), loss_fn)
          >>> trainer.restore("/tmp/run")
          2
        """
        return self._engine.restore(directory, step)
