"""A fit's budget as compiled calls: the one place the engine counts epochs and steps.

The budget (``epochs``, ``max_steps``) becomes stretches, each one run of compiled calls: an
epoch, or several fused, cut where ``max_steps`` ends. The same stretches give the fit loop
its calls, the owner its place after each, and the progress bar its total.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from nnxscan.shell._engine.plans import Plan

# At most this many steps in one fused stretch: the progress bar still moves, and a Ctrl-C
# (held while a call runs) is still answered soon.
FUSED_STEPS = 10_000
# At most this many calls of a compiled stretch length in place of compiling a new one: a
# call's host cost is about a thousandth of a small program's compile (docs/performance.md),
# so even this many extra calls cost less than one more compile.
REUSED_CALLS = 64
# With checkpoints, a fused stretch's steps times the bytes of the carry (model and optimizer
# state) it updates stay within this: a preemption waits for the call in flight, and a
# bigger model's steps take longer, so it fuses fewer of them (none past 128 MiB of carry:
# two steps' worth). It bounds the epoch-end states the call holds for the saves too (at
# most one per step). A rule on sizes, not a clock: where epochs are cut never depends on
# timing.
SAVED_FUSED_BYTES = 256 * 2**20


def with_steps_per_call(plan: Plan, steps_per_call: int | None) -> Plan:
    """The ``"scan"`` plan with calls of ``steps_per_call`` steps (a data set's epoch)."""
    if steps_per_call is None or plan.kind != "scan":
        return plan
    return plan._replace(steps_per_call=steps_per_call)


class Saves(NamedTuple):
    """The checkpoints a fit saves at the ends of epochs: every ``every`` epochs, of which
    the directory keeps the newest ``keep``; ``carry_bytes``: what one state (the model's
    and the optimizer's) weighs. Fused epochs then return the states of the epochs whose
    saves stay (:attr:`Stretch.held`)."""

    every: int
    keep: int
    carry_bytes: int


class Stretch(NamedTuple):
    """``epochs`` epochs from ``epoch`` less their first ``skip`` steps (trained before), in
    one run of compiled calls. A stream's epoch has ``ends``, ``calls`` and ``per_epoch``
    None or empty (its length shows when it ends, its chunks make its calls).

    ``held``: of fused epochs that save checkpoints, those (counted from ``epoch``) whose
    end state the call returns besides its carry: the epochs saved that ``keep`` leaves on
    disk, but the last (its state is the carry). The others' saves would be deleted by the
    stretch's own newer ones: they are not written."""

    epoch: int
    epochs: int
    steps: int | None  # those it trains (a stream's: the budget left, or None)
    skip: int
    ends: int | None  # the steps from ``skip`` to the end of its epochs
    # (start, length) of each call, from ``skip``; one past the full batches: the short one
    calls: tuple[tuple[int, int], ...]
    per_epoch: int | None
    held: tuple[int, ...] = ()

    def saved(self, index: int, every: int, keep: int) -> bool:
        """Whether the save due at the end of epoch ``epoch + index`` is written: a fused
        stretch writes the newest ``keep`` of its due saves (every ``every`` epochs)."""
        due = [i for i in range(self.epochs) if (self.epoch + i + 1) % every == 0]
        return index in due[-keep:]

    def complete(self, trained: int, ended: Callable[[], bool]) -> bool:
        """Whether ``trained`` steps finish its epochs (a stream's: whether it ``ended()``)."""
        return ended() if self.ends is None else trained == self.ends

    def reached(self, trained: int, complete: bool) -> tuple[int, int]:
        """The owner's ``(epoch, epoch_step)`` after ``trained`` of its steps: where the
        next fit (or a resume) goes on."""
        if complete:
            return self.epoch + self.epochs, 0
        if self.per_epoch is None:
            return self.epoch, self.skip + trained
        finished, into = divmod(self.skip + trained, self.per_epoch)
        return self.epoch + finished, into


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One fit's budget from where the owner stands (its next ``epoch``, the ``skip`` steps
    of it trained before, its global ``step``), and how its epochs become calls: the
    ``plan``'s, over epochs of ``per_epoch`` steps (None: a stream's) whose last may be a
    short batch (``tail``: a call of its own, never fused). With ``fuse``, whole epochs run
    as one stretch, ending where evaluation runs (every ``every`` epochs); with ``saves``
    (checkpoints), within :data:`SAVED_FUSED_BYTES` of steps times the carry's bytes, the
    stretch returning the states its saves need (:attr:`Stretch.held`)."""

    epoch: int
    skip: int
    step: int
    end_epoch: int | None  # the epoch the fit ends before (None: max_steps decides)
    stop_at: int | None  # the global step the fit ends at (None: epochs decide)
    per_epoch: int | None = None
    tail: bool = False
    plan: Plan | None = None
    fuse: bool = False
    every: int | None = None
    # Fused stretch lengths (epochs) whose program is compiled already: one that divides
    # the epochs to the next boundary into at most REUSED_CALLS calls is run again rather
    # than a new length compiled (fit(epochs=1), then fit(epochs=5): five calls of one).
    compiled: frozenset[int] = frozenset()
    # At most this many steps fused in one stretch: FUSED_STEPS, or fewer where one gather
    # holds fewer (pure.batching.steps_per_gather), so that a call is one loop of steps,
    # not an outer loop of chunks around it, which XLA compiles longer.
    fused_steps: int = FUSED_STEPS
    saves: Saves | None = None

    def __post_init__(self) -> None:
        if self.per_epoch is not None and self.skip > self.per_epoch:
            raise ValueError(f"cannot skip {self.skip} steps of a {self.per_epoch}-step epoch")

    @classmethod
    def of(
        cls, epochs: int | None, max_steps: int | None, *, whole_run: bool, at: tuple[int, ...]
    ) -> Schedule:
        """``epochs`` and ``max_steps`` more from ``at``, the owner's ``(epoch, epoch_step,
        step)``; with ``whole_run`` (a resume), both count the whole run."""
        epoch, skip, step = at
        first_epoch, first_step = (0, 0) if whole_run else (epoch, step)
        end_epoch = None if epochs is None else first_epoch + epochs
        stop_at = None if max_steps is None else first_step + max_steps
        return cls(epoch, skip, step, end_epoch, stop_at)

    def spent(self, epoch: int, step: int) -> bool:
        """Whether an owner at ``epoch`` and global ``step`` trained the whole budget."""
        return (self.end_epoch is not None and epoch >= self.end_epoch) or (
            self.stop_at is not None and step >= self.stop_at
        )

    def stretches(self, step_now: Callable[[], int] | None = None) -> Iterator[Stretch]:
        """The stretches in order, each assumed to train all its steps; ``step_now()``, the
        owner's global step as each starts, cuts a stream's epoch where the budget ends."""
        epoch, skip, step = self.epoch, self.skip, self.step
        if self.per_epoch is not None and 0 < skip == self.per_epoch:
            # An epoch trained whole before a preemption, its end (evaluation, hooks) not
            # run: a stretch of no steps ends it, whatever the budget.
            yield self._stretch(epoch, skip, 0)
            epoch, skip = epoch + 1, 0
        while not self.spent(epoch, step := step if step_now is None else step_now()):
            left = None if self.stop_at is None else self.stop_at - step
            stretch = self._stretch(epoch, skip, left)
            yield stretch
            epoch, skip = epoch + stretch.epochs, 0
            step += 0 if stretch.ends is None else stretch.steps

    def progress(self) -> tuple[int | None, int | None]:
        """The compiled calls planned (None: a stream's, unknown) and the last epoch."""
        planned = list(self.stretches())
        total = None if self.per_epoch is None else sum(len(s.calls) for s in planned)
        last = planned[-1].epoch + planned[-1].epochs - 1 if planned else None
        return total, last

    def _stretch(self, epoch: int, skip: int, left: int | None) -> Stretch:
        per = self.per_epoch
        if per is None:  # a stream's epoch
            return Stretch(epoch, 1, left, skip, None, (), None)
        epochs = 1
        # Epochs that save fuse only into one call (its outer loop returns their states).
        one_call = self.saves is None or self.plan.steps_per_call is None
        if self.fuse and not self.tail and not skip and one_call:
            most = []
            if self.end_epoch is not None:
                most.append(self.end_epoch - epoch)
            if self.every is not None:  # evaluation runs after the stretch's last epoch
                most.append(self.every - epoch % self.every)
            if left is not None:  # whole epochs only: the budget's last one runs alone
                most.append(left // per)
            fused_steps = self.fused_steps
            if self.saves is not None:
                fused_steps = min(fused_steps, SAVED_FUSED_BYTES // max(self.saves.carry_bytes, 1))
            cap = max(1, fused_steps // per)
            epochs = max(1, even_share(min(most), cap) if most else cap)
            if most and epochs not in self.compiled:
                run = min(most)
                fits = [k for k in self.compiled if k < epochs and run % k == 0]
                if fits and run // max(fits) <= REUSED_CALLS:
                    epochs = max(fits)
        ends = epochs * per - skip
        steps = ends if left is None else min(ends, left)
        full = max(epochs * (per - self.tail) - skip, 0)
        calls = [(a, min(n, steps - a)) for a, n in self.plan.chunks(full) if a < steps]
        if steps > full:  # the short batch: one step of its own shape, as the core trains it
            calls.append((full, 1))
        stretch = Stretch(epoch, epochs, steps, skip, ends, tuple(calls), per)
        if epochs > 1 and self.saves is not None:
            every, keep = self.saves.every, self.saves.keep
            held = [i for i in range(epochs - 1) if stretch.saved(i, every, keep)]
            stretch = stretch._replace(held=tuple(held))
        return stretch


def even_share(epochs: int, cap: int) -> int:
    """The epochs of each of the fewest stretches of at most ``cap`` epochs that share
    ``epochs`` evenly: all of one length where up to twice the fewest do (one program
    compiled, not two: 300 epochs in 2 of 150 rather than 227 + 73, 12 in 3 of 4 rather
    than 5 + 5 + 2), else the fewest stretches, as even as they come (151 + 150).

    Example:
      >>> even_share(300, 227), even_share(301, 227), even_share(12, 5)
      (150, 151, 4)
    """
    if epochs <= cap:
        return epochs
    fewest = -(-epochs // cap)
    for count in range(fewest, 2 * fewest + 1):
        if epochs % count == 0:
            return epochs // count
    return -(-epochs // fewest)


def one_epoch(source: Any, plan: Plan) -> Stretch:
    """The whole of epoch 0 of ``source`` (an epoch source) in ``plan``'s calls."""
    shape = dict(per_epoch=source.steps_per_epoch, tail=source.keep_tail, plan=plan)
    return next(Schedule(0, 0, 0, 1, None, **shape).stretches())
