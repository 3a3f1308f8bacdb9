"""The loop a ``Population.fit`` runs: epochs of compiled calls over all members, frozen
members, per-member logs, callbacks, evaluation and checkpoints.

It gets narrow inputs: the :class:`~nnxscan.shell._members.Members` owner, the jitted
runner, the plan, the callbacks, and the optional evaluation and checkpoints; it never
reaches into ``Population``.
"""

from __future__ import annotations

import signal
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from rich.console import Console

from nnxscan.pure import epoch_order
from nnxscan.pure.population import population_batches
from nnxscan.shell._epochs import _RESERVED_LOGS
from nnxscan.shell._fit import CallbackList, Checkpoints, Evaluation, Preempted, caught_signals
from nnxscan.shell._members import Members
from nnxscan.shell._placement import to_host
from nnxscan.shell._plans import Plan
from nnxscan.shell.history import History


class PopulationEpochs(NamedTuple):
    """What every epoch of one ``Population.fit`` trains, and how."""

    data: Any  # placed on the device(s), shared by every member
    num_examples: int
    batch_size: int
    drop_remainder: bool
    order_seeds: tuple[int, ...]  # the seed of each member's shuffle
    plan: Plan
    has_aux: bool
    skips_nonfinite: bool  # on_nonfinite="skip": NaN losses mark skipped steps
    halts: bool  # on_nonfinite="stop": a member halts (and freezes) at its first one


class PopulationFit:
    """Runs ``epochs`` epochs of ``run`` (the jitted population runner) over the members."""

    def __init__(
        self,
        members: Members,
        run: Callable,
        epochs_spec: PopulationEpochs,
        callbacks: CallbackList,
        evaluation: Evaluation | None,
        checkpoints: Checkpoints | None,
        learning_rate: Callable[[Any], Any],
        console: Console | None,
    ):
        self.members, self.run, self.spec = members, run, epochs_spec
        self.callbacks, self.evaluation, self.checkpoints = callbacks, evaluation, checkpoints
        self.learning_rate, self.console = learning_rate, console
        self._saved_step = -1

    def train(self, history: History, epochs: int) -> History:
        subject = self.callbacks.subject
        subject.stop_training = False
        self.callbacks("on_train_begin")
        # With checkpoints, SIGTERM / SIGINT end fit after the epoch in flight, saved.
        with caught_signals(self.checkpoints is not None) as signals:
            try:
                for _ in range(epochs):
                    if not self.members.active.any():
                        break  # every member is frozen: nothing left to train
                    self._epoch(history)
                    if signals:
                        self._preempted(history, signals[0])
                    if subject.stop_training:
                        break
            except BaseException as error:
                self.callbacks.close()
                error.history = history
                raise
        self.callbacks("on_train_end", history)
        if self.checkpoints is not None and self.members.loaded_since_checkpoint:
            # EarlyStopping put members back to their best epochs: the checkpoint holds that.
            self.checkpoints.save(history, np.zeros((0,), np.float32))
        return history

    def _preempted(self, history: History, signum: int) -> None:
        if self.members.step != self._saved_step:
            self.checkpoints.save(history, np.zeros((0,), np.float32))
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Preempted(
            f"Population.fit stopped on signal {signal.Signals(signum).name} after the epoch "
            f"in flight; a checkpoint at step {self.members.step} holds everything: run the "
            f"same fit with resume=True to go on."
        )

    def _epoch(self, history: History) -> None:
        members, spec = self.members, self.spec
        epoch = members.epoch
        self.callbacks("on_epoch_begin", epoch)
        n = spec.num_examples
        orders = np.stack([epoch_order(seed, epoch, n) for seed in spec.order_seeds])
        full, tail = population_batches(orders, spec.batch_size, drop_remainder=spec.drop_remainder)
        start = time.perf_counter()
        outs = []
        if full.shape[1]:
            indices = members.placement.put_data(full, members.leaves)
            for first, length in spec.plan.chunks(full.shape[1]):
                outs.append(self._call(indices, first, length, spec.plan.unroll, epoch))
        if tail is not None:
            indices = members.placement.put_data(tail, members.leaves)
            outs.append(self._call(indices, 0, 1, True, epoch))
        members.epoch = epoch + 1
        # One host read per epoch: the outputs and the members' learning rates together.
        outs, rate = to_host((outs, self.learning_rate(members.carry()[1])))
        stacked = jax.tree.map(lambda *xs: np.concatenate(xs), *outs)
        logs, losses = self._logs(epoch, stacked, rate, time.perf_counter() - start)
        history._append(losses, logs)
        if self.console is not None:
            low, mid, high = np.nanpercentile(logs["loss"], [0, 50, 100])
            active = int(members.active.sum())
            self.console.print(
                f"epoch {epoch}: loss over {members.size} members min {low:.4g} median "
                f"{mid:.4g} max {high:.4g} ({active} training)",
                highlight=False, markup=False,
            )  # fmt: skip
        self.callbacks("on_epoch_end", epoch, logs)
        checkpoints = self.checkpoints
        if checkpoints is not None and (epoch + 1) % checkpoints.every_epochs == 0:
            checkpoints.save(history, np.zeros((0,), np.float32))
            self._saved_step = members.step

    def _call(self, indices: Any, first: int, length: int, unroll: bool, epoch: int) -> Any:
        members = self.members
        # With every member training, no mask: the program without the per-step select
        # is ~10% faster to compile and run; the masked one compiles at the first freeze.
        active = None
        if not members.active.all():
            active = members.placement.put_data(members.active, members.leaves)
        with members.call() as keep:
            leaves, outs, halted = self.run(
                members.leaves, self.spec.data, indices, active, first, length=length,
                unroll=unroll,
            )  # fmt: skip
            keep(leaves)
            members.step += length
        if self.spec.halts:
            self._freeze_halted(halted, outs, members.step - length, epoch)
        self.callbacks("on_call_end", {"epoch": epoch, "step": members.step})
        return outs

    def _freeze_halted(self, halted: Any, outs: Any, first_step: int, epoch: int) -> None:
        """``on_nonfinite="stop"``: a member that halted in this call is frozen, with a
        warning naming its step (one host read per call, as Trainer's "stop")."""
        members = self.members
        halted, outs = to_host((halted, outs))
        halted = np.asarray(halted, bool) & members.active
        losses = np.asarray(outs[0] if self.spec.has_aux else outs)
        for index in np.flatnonzero(halted):
            step = first_step + int(np.argmax(np.isnan(losses[:, index])))
            warnings.warn(
                f"member {index}: non-finite loss at global step {step} (epoch {epoch}); "
                f"on_nonfinite='stop' froze it at the state before that step. The other "
                f"members go on.",
                RuntimeWarning,
                stacklevel=6,
            )
        members.active = members.active & ~halted

    def _logs(self, epoch: int, outs: Any, rate: Any, wall_time: float) -> tuple[dict, np.ndarray]:
        """One epoch's logs (``(N,)`` arrays per member) and its ``(steps, N)`` losses."""
        spec = self.spec
        losses, aux = outs if spec.has_aux else (outs, None)
        losses = np.asarray(losses, np.float32)
        mean = _nanmean if spec.skips_nonfinite else _mean
        logs: dict[str, Any] = {"epoch": epoch, "loss": mean(losses)}
        if spec.skips_nonfinite:
            logs["skipped_steps"] = np.isnan(losses).sum(axis=0)
        for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
            if np.ndim(leaf) == 2:  # a scalar per step and member
                key = jax.tree_util.keystr(path, simple=True, separator="/") or "aux"
                logs[f"aux/{key}" if key in _RESERVED_LOGS else key] = mean(np.asarray(leaf))
        if rate is not None:
            logs["learning_rate"] = np.asarray(rate)
        logs["active"] = self.members.active.copy()
        if self.evaluation is not None and (epoch + 1) % self.evaluation.every == 0:
            logs.update({f"eval_{k}": v for k, v in self.evaluation.run().items()})
        steps = int(losses.shape[0])
        logs.update(steps=steps, steps_per_sec=steps / max(wall_time, 1e-9), wall_time=wall_time)
        dropped = spec.num_examples % spec.batch_size if spec.drop_remainder else 0
        if dropped:
            logs["dropped_examples"] = dropped
        return logs, losses


def _mean(values: np.ndarray) -> np.ndarray:
    return values.mean(axis=0)


def _nanmean(values: np.ndarray) -> np.ndarray:
    """The mean over steps of each member, skipped (NaN) steps left out; NaN for a member
    whose every step was skipped (without numpy's empty-slice warning)."""
    counts = np.sum(~np.isnan(values), axis=0)
    sums = np.nansum(values, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan).astype(values.dtype)


def history_from_run(run: tuple[History, np.ndarray], size: int) -> History:
    """A restored run's History with a population's shapes: ``(steps, N)`` losses and
    per-member logs as numpy arrays again (JSON kept them as lists)."""
    history, _ = run
    losses = np.asarray(history.losses, np.float32).reshape(-1, size)
    epochs = [
        {k: np.asarray(v) if isinstance(v, list) else v for k, v in logs.items()}
        for logs in history.epochs
    ]
    return History(losses, epochs, history.events)


def order_seeds(seeds: Sequence[int], shared_order: bool) -> tuple[int, ...]:
    """Each member's shuffle seed: its own, or the first member's for a shared order."""
    return (seeds[0],) * len(seeds) if shared_order else tuple(seeds)
