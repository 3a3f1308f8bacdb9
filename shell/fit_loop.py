"""The loop every ``fit`` runs: epochs of compiled calls, callbacks, evaluation, progress.

Per compiled call it does no host sync (the progress bar shows the newest loss already on
the host side); per epoch it makes one: reading the epoch's losses for the logs.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
from flax import nnx

from nnxscan.shell.callbacks import Callbacks
from nnxscan.shell.epochs import EpochCalls, EpochStats, epoch_logs, learning_rate
from nnxscan.shell.history import History
from nnxscan.shell.loop import Execution, LiveState, NonFiniteStop, run_calls
from nnxscan.shell.progress import RunProgress

if TYPE_CHECKING:
    from nnxscan.shell.trainer import Trainer

__all__ = ["EvalSpec", "train_epochs"]


class EvalSpec(NamedTuple):
    """``fit``'s held-out evaluation: every ``every`` epochs, logged as ``eval_<name>``."""

    data: Any
    metric_fn: Callable
    every: int
    batch_size: int


def train_epochs(
    trainer: Trainer,
    epochs: int,
    execution: Execution,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    opt_state: Any,
    epoch_calls: EpochCalls,
    *,
    calls_per_epoch: int | None,
    callbacks: Callbacks,
    progress: bool,
    evaluation: EvalSpec | None,
) -> History:
    """Trains ``epochs`` epochs of ``epoch_calls`` on ``trainer``'s objects; the History."""
    history = History()
    if epochs == 0:
        return history
    live = LiveState(state, opt_state, trainer._write, trainer._placement)
    # Whether tx came from inject_hyperparams: looked up once, not every epoch.
    injected = learning_rate(opt_state) is not None
    trainer.stop_training = False
    skipping = trainer.on_nonfinite == "skip"
    warned = False
    callbacks("on_train_begin", trainer)
    # Several processes train one model: only the first one reports.
    progress = progress and jax.process_index() == 0
    bar = RunProgress(epochs, calls_per_epoch, progress, has_aux=trainer.has_aux)
    bar.set_last_epoch(trainer.epoch + epochs - 1)
    with bar:
        for _ in range(epochs):
            epoch, first_step, stats = trainer.epoch, trainer.step, EpochStats()
            if trainer.stop_training:  # set in on_train_begin or a previous epoch's hooks
                break
            callbacks("on_epoch_begin", trainer, epoch)
            if trainer.stop_training:
                break
            start = time.perf_counter()

            def on_call(steps: int, out: Any, epoch: int = epoch) -> None:
                bar.call_done(epoch, steps, out)
                if callbacks.has_call_hooks:
                    callbacks("on_call_end", trainer, {"epoch": epoch, "step": trainer.step})

            try:
                outs = run_calls(
                    trainer._program, execution, graphdef, live, epoch_calls(epoch, stats),
                    on_call, lambda: trainer.stop_training,
                )  # fmt: skip
            except NonFiniteStop as stop:
                logs, losses = epoch_logs(epoch, stop.outs, start, trainer.has_aux, stats, True)
                history._append(losses, logs)
                error = FloatingPointError(
                    f"non-finite loss at epoch {epoch}, global step {trainer.step} (step "
                    f"{trainer.step - first_step} of the epoch); on_nonfinite='stop' ended "
                    f"fit with the model at the state before that step."
                )
                error.history = history
                raise error from None
            finally:
                # The epoch counts as soon as all its steps are in the model, even if an
                # interrupt lands later (in the progress bar or the host sync).
                complete = stats.complete(trainer.step - first_step)
                if complete:
                    trainer.epoch = epoch + 1
            if not outs:  # stopped before the epoch's first call
                break
            logs, losses = epoch_logs(epoch, outs, start, trainer.has_aux, stats, skipping)
            if injected:
                logs["learning_rate"] = learning_rate(trainer.opt_state)
            if not complete:
                logs["stopped"] = True
            elif evaluation is not None and (epoch + 1) % evaluation.every == 0:
                metrics = trainer.evaluate(
                    evaluation.data, evaluation.metric_fn, batch_size=evaluation.batch_size
                )
                logs.update({f"eval_{name}": value for name, value in metrics.items()})
            if stats.dropped and not warned:
                warned = True
                warnings.warn(
                    f"nnxscan: dropped the final short batch of {stats.dropped} examples in "
                    f"epoch {epoch} (and will in every epoch that has one; see "
                    f"History.epochs[i]['dropped_examples']); pass drop_remainder=False to "
                    f"train on it.",
                    stacklevel=4,
                )
            history._append(losses, logs)
            bar.epoch_done(epoch, logs)
            if complete:
                callbacks("on_epoch_end", trainer, epoch, logs)
            if trainer.stop_training:
                break
    callbacks("on_train_end", trainer, history)
    return history
