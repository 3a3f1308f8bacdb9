"""The loop every ``fit`` runs: epochs of compiled calls, callbacks, evaluation, progress.

Per compiled call it does no host sync (the progress bar shows the newest loss already on
the host side); per epoch it makes one: reading the epoch's losses for the logs.

:class:`FitLoop` gets narrow inputs: the compiled program and how to execute it, the
:class:`~nnxscan.shell._owner.Owner` of the user's objects, the callbacks, the progress
switch and the evaluation to run. It never reads the Trainer; the only object it shares
with the callbacks is the ``subject`` they receive, whose public ``stop_training`` flag it
reads.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from flax import nnx

from nnxscan.adapters.distributed import is_primary
from nnxscan.shell._calls import Execution, LiveState, NonFiniteStop, run_calls
from nnxscan.shell._epochs import (
    EpochCalls,
    EpochStats,
    epoch_logs,
    host_outputs,
    learning_rate,
    split_steps,
)
from nnxscan.shell._owner import Owner
from nnxscan.shell._placement import Placement
from nnxscan.shell._programs import TrainProgram
from nnxscan.shell._progress import RunProgress
from nnxscan.shell.history import History

# At most this many steps in one fused call of several epochs: the progress bar still
# moves, and a Ctrl-C (held while a call runs) is still answered within seconds.
FUSED_STEPS = 10_000
_HOOKS = ("on_train_begin", "on_epoch_begin", "on_call_end", "on_epoch_end", "on_train_end")


class CallbackList:
    """Calls each hook on every callback that has it, in order, with ``subject`` first."""

    def __init__(self, callbacks: Sequence[Any], subject: Any):
        # Every hook is optional (an object with none is a valid, silent callback).
        self._hooks = {
            hook: [getattr(cb, hook) for cb in callbacks if hasattr(cb, hook)] for hook in _HOOKS
        }
        self.subject = subject
        self.has_call_hooks = bool(self._hooks["on_call_end"])
        self.has_epoch_hooks = bool(self._hooks["on_epoch_begin"] or self._hooks["on_epoch_end"])

    def __call__(self, hook: str, *args: Any) -> None:
        for method in self._hooks[hook]:
            method(self.subject, *args)


class Evaluation(NamedTuple):
    """``fit``'s held-out evaluation: ``run()`` every ``every`` epochs, logged as
    ``eval_<name>``."""

    every: int
    run: Callable[[], dict[str, float]]


class FitLoop:
    """Trains epochs of compiled calls on the owner's objects and returns their History."""

    def __init__(
        self,
        *,
        program: TrainProgram,
        execution: Execution,
        owner: Owner,
        placement: Placement,
        callbacks: CallbackList,
        progress: bool,
        evaluation: Evaluation | None,
    ):
        self.program, self.execution = program, execution
        self.owner, self.placement = owner, placement
        self.callbacks, self.evaluation = callbacks, evaluation
        # Several processes train one model: only the first one reports.
        self.progress = progress and is_primary()
        self._warned_drop = False

    @property
    def _stop_requested(self) -> bool:
        return bool(getattr(self.callbacks.subject, "stop_training", False))

    def run(
        self,
        epochs: int,
        graphdef: nnx.GraphDef,
        state: nnx.State,
        opt_state: Any,
        epoch_calls: EpochCalls,
    ) -> History:
        """Trains ``epochs`` epochs of ``epoch_calls`` from ``(state, opt_state)``."""
        history = History()
        if epochs == 0:
            return history
        if self.owner.metrics is not None:
            # An epoch's train_<metric> logs cover exactly that epoch's steps: start the
            # metrics afresh, and carry their reset state (read again after the reset).
            self.owner.reset_metrics()
            _, state, opt_state = self.owner.read()
        live = LiveState(state, opt_state, self.owner.writer(), self.placement)
        # Whether tx came from inject_hyperparams: looked up once, not every epoch.
        injected = learning_rate(opt_state) is not None
        groups = self._fused_groups(self.owner.epoch, epochs, epoch_calls, injected)
        self.callbacks.subject.stop_training = False
        self.callbacks("on_train_begin")
        calls = getattr(epoch_calls, "calls", None)
        total = None if calls is None else sum(calls(count) for count in groups)
        bar = RunProgress(1, total, self.progress, has_aux=self.program.has_aux)
        bar.set_last_epoch(self.owner.epoch + epochs - 1)
        with bar:
            for count in groups:
                if self._stop_requested:  # set in on_train_begin or the last epoch's hooks
                    break
                if not self._epochs(history, graphdef, live, epoch_calls, count, bar, injected):
                    break
        self.callbacks("on_train_end", history)
        return history

    def _fused_groups(self, first: int, epochs: int, epoch_calls: Any, injected: bool) -> list:
        """How many epochs each compiled stretch trains: 1, or several fused into one call
        when nothing needs the host between them (see ``docs/performance.md``)."""
        hooks = self.callbacks.has_epoch_hooks or self.callbacks.has_call_hooks
        per_epoch = getattr(epoch_calls, "steps_per_epoch", 0)
        if (
            not getattr(epoch_calls, "fusable", False)
            or hooks
            or injected  # the learning rate is logged per epoch
            or self.owner.metrics is not None  # train_<metric> is computed per epoch
            or self.program.halts  # the non-finite stop names its epoch
            or not self.execution.donate  # host callbacks: a failure keeps the last epoch
        ):
            return [1] * epochs
        most = max(1, FUSED_STEPS // max(per_epoch, 1))
        every = self.evaluation.every if self.evaluation is not None else None
        groups, epoch, end = [], first, first + epochs
        while epoch < end:
            # A group ends where evaluation runs, and at most FUSED_STEPS steps long.
            stop = end if every is None else min(end, (epoch // every + 1) * every)
            count = min(stop - epoch, most)
            groups.append(count)
            epoch += count
        return groups

    def _epochs(self, history, graphdef, live, epoch_calls, count, bar, injected) -> bool:
        """Trains ``count`` epochs (one compiled stretch); False when fit should end."""
        owner, callbacks = self.owner, self.callbacks
        epoch, first_step, stats = owner.epoch, owner.step, EpochStats()
        callbacks("on_epoch_begin", epoch)
        if self._stop_requested:
            return False
        start = time.perf_counter()

        def on_call(steps: int, out: Any) -> None:
            bar.call_done(epoch, steps, out)
            if callbacks.has_call_hooks:
                # Written back after every call when there are hooks: owner.step is a
                # Python int, so reading it forces no host sync.
                callbacks("on_call_end", {"epoch": epoch, "step": owner.step})

        calls = epoch_calls(epoch, stats) if count == 1 else epoch_calls(epoch, stats, count)
        try:
            outs = run_calls(
                self.program, self.execution, graphdef, live, calls,
                on_call, lambda: self._stop_requested,
                write_every_call=callbacks.has_call_hooks,  # hooks see the trained model
            )  # fmt: skip
        except NonFiniteStop as stop:
            raise self._nonfinite_error(history, epoch, first_step, stop, start, stats) from None
        finally:
            # The epochs count as soon as all their steps are in the model, even if an
            # interrupt lands later (in the progress bar or the host sync).
            complete = stats.complete(owner.step - first_step)
            if complete:
                owner.epoch = epoch + count
        if not outs:  # stopped before the epoch's first call
            return False
        stacked, wall_time = host_outputs(outs, start)
        pieces = [stacked] if count == 1 else split_steps(stacked, count)
        for i, piece in enumerate(pieces):
            self._log_epoch(history, epoch + i, piece, wall_time / count, stats, complete, live,
                            injected, bar)  # fmt: skip
        return not self._stop_requested

    def _log_epoch(self, history, epoch, outputs, wall_time, stats, complete, live, injected, bar):
        """One epoch's logs: losses, metrics, evaluation; then the on_epoch_end hooks."""
        owner = self.owner
        skipping = self.program.skips_nonfinite
        logs, losses = epoch_logs(epoch, outputs, wall_time, self.program.has_aux, stats, skipping)
        if owner.metrics is not None:
            logs.update({f"train_{k}": v for k, v in owner.take_metrics().items()})
            # take_metrics reset the user's metrics: the next epoch starts from them.
            _, state, opt_state = owner.read()
            live.reload(state, opt_state)
        if injected:
            logs["learning_rate"] = learning_rate(owner.opt_state)
        if not complete:
            logs["stopped"] = True
        elif self.evaluation is not None and (epoch + 1) % self.evaluation.every == 0:
            logs.update({f"eval_{k}": v for k, v in self.evaluation.run().items()})
        self._warn_dropped(epoch, stats)
        history._append(losses, logs)
        bar.epoch_done(epoch, logs)
        if complete:
            self.callbacks("on_epoch_end", epoch, logs)

    def _nonfinite_error(self, history, epoch, first_step, stop, start, stats) -> Exception:
        stacked, wall_time = host_outputs(stop.outs, start)
        logs, losses = epoch_logs(epoch, stacked, wall_time, self.program.has_aux, stats, True)
        history._append(losses, logs)
        step = self.owner.step
        error = FloatingPointError(
            f"non-finite loss at epoch {epoch}, global step {step} (step {step - first_step} "
            f"of the epoch); on_nonfinite='stop' ended fit with the model at the state before "
            f"that step."
        )
        error.history = history
        return error

    def _warn_dropped(self, epoch: int, stats: EpochStats) -> None:
        if stats.dropped and not self._warned_drop:
            self._warned_drop = True
            warnings.warn(
                f"nnxscan: dropped the final short batch of {stats.dropped} examples in "
                f"epoch {epoch} (and will in every epoch that has one; see "
                f"History.epochs[i]['dropped_examples']); pass drop_remainder=False to "
                f"train on it.",
                stacklevel=7,
            )
