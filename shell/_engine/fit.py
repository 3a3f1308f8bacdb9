"""The one fit loop: the schedule's stretches of compiled calls, callbacks, evaluation,
checkpoints, preemption and progress, for a Trainer and a Population alike.

Per compiled call it does no host sync (the progress bar shows the newest loss already on
the host side); per epoch it makes one: reading the epoch's losses for the logs.

:class:`FitLoop` gets narrow inputs: the compiled program and how to execute it, the
:class:`~nnxscan.shell._engine.owner.Owner` (one model, or members stacked), the runner factory,
the callbacks, the progress switch, the evaluation and the checkpoints; what to train comes
from a :class:`~nnxscan.shell._engine.schedule.Schedule`. It never reads the Trainer or the
Population; the only object it shares with the callbacks is the ``trainer`` they receive,
whose public ``stop_training`` flag it sets (False, as fit starts) and reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from nnxscan.adapters.distributed import is_primary
from nnxscan.shell._edges.logs import (
    empty_losses,
    epoch_logs,
    host_outputs,
    learning_rate,
    partial_scalar_aux,
    prepend_losses,
    split_steps,
)
from nnxscan.shell._edges.progress import RunProgress
from nnxscan.shell._edges.warn import warn
from nnxscan.shell._engine.calls import (
    Execution,
    LiveState,
    NonFiniteStop,
    call_key,
    run_calls,
)
from nnxscan.shell._engine.epochs import Epochs, EpochStats
from nnxscan.shell._engine.held_states import BankPacking
from nnxscan.shell._engine.layout import Layout
from nnxscan.shell._engine.owner import Owner
from nnxscan.shell._engine.placement import Placement
from nnxscan.shell._engine.programs import TrainProgram
from nnxscan.shell._engine.schedule import Saves, Schedule, Stretch
from nnxscan.shell.history import History

_HOOKS = ("on_train_begin", "on_epoch_begin", "on_call_end", "on_epoch_end", "on_train_end")


class CallbackList:
    """Calls each hook on every callback that has it, in order, with ``trainer`` first (the
    Trainer or the Population that runs the fit)."""

    def __init__(self, callbacks: Sequence[Any], trainer: Any):
        # Every hook is optional (an object with none is a valid, silent callback).
        self._hooks = {
            hook: [getattr(cb, hook) for cb in callbacks if hasattr(cb, hook)] for hook in _HOOKS
        }
        self.trainer = trainer
        self.callbacks = list(callbacks)
        self.has_call_hooks = bool(self._hooks["on_call_end"])
        self.has_epoch_hooks = bool(self._hooks["on_epoch_begin"] or self._hooks["on_epoch_end"])

    def __call__(self, hook: str, *args: Any) -> None:
        for method in self._hooks[hook]:
            method(self.trainer, *args)

    def close(self) -> None:
        """Closes every callback that can be closed (writers' files), ignoring failures:
        called while another exception is on its way out."""
        for callback in self.callbacks:
            close = getattr(callback, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    close()


class Evaluation(NamedTuple):
    """``fit``'s held-out evaluation: ``run()`` every ``every`` epochs, logged as
    ``eval_<name>``; ``lowered()``, the program ``run()`` calls, lowered (not compiled)."""

    every: int
    run: Callable[[], dict[str, float]]
    lowered: Callable[[], Any] | None = None


def call_shape(run: Callable, epoch_calls: Any) -> Hashable:
    """What a fit's calls' programs depend on besides a fused stretch's length: the runner
    (step, carry, placement), the epoch's steps and short batch, and the data's shapes."""
    data = getattr(epoch_calls, "data", None)
    shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(data))
    return (
        run, epoch_calls.steps_per_epoch, epoch_calls.keep_tail, jax.tree.structure(data),
        shapes, getattr(epoch_calls, "batch_size", None), getattr(epoch_calls, "shuffle", None),
    )  # fmt: skip


def lowered_or_none(lower: Callable[[], Any] | None) -> Any:
    """``lower()`` (a program, traced and lowered), or None where that fails: the call
    itself then raises the error, where it always did."""
    try:
        return None if lower is None else lower()
    except Exception:
        return None


class Ahead:
    """Lowered programs (``jax.stages.Lowered`` by key, None skipped) that the run will
    surely call, compiling in order on one thread while this one goes on: XLA compiles
    without the GIL, so the first training call's compile and these share the cores.

    ``ready(key)`` waits until the program of ``key`` has compiled, so that its call finds
    it in jit's cache instead of racing the thread with a compile of its own: which
    thread compiles what never depends on timing. ``wait()`` waits for all of them. This
    changes when programs compile, never what runs."""

    def __init__(self, programs: Sequence[tuple[Hashable, Any]]):
        programs = [(key, p) for key, p in programs if p is not None]
        self._compiled = {key: threading.Event() for key, _ in programs}
        self._thread: threading.Thread | None = None
        if programs:
            self._thread = threading.Thread(
                target=self._compile_all, args=(programs,), name="nnxscan-compile", daemon=True
            )
            self._thread.start()

    def _compile_all(self, programs: list[tuple[Hashable, Any]]) -> None:
        for key, program in programs:
            try:
                program.compile()
            except Exception:  # the call itself raises it
                pass
            finally:
                self._compiled[key].set()

    def ready(self, key: Hashable) -> None:
        event = self._compiled.get(key)
        if event is not None:
            event.wait()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


class Checkpoints(NamedTuple):
    """Where and when ``fit`` saves: ``save(history, partial_losses, carry=None,
    partial_aux=None, at=None)`` writes a checkpoint of the owner's objects (``carry``: the
    state just written into them; with ``at``, the counters of an earlier epoch end whose
    state ``carry`` is: a fused call's) with the run so far (``partial_aux``: the
    unfinished epoch's scalar aux logs per step, beside its losses); every ``every_epochs``
    epochs, every
    ``every_steps`` steps (at call boundaries; None: never mid-epoch), on SIGTERM or SIGINT,
    and at the end when the budget is spent or a callback loaded a state (EarlyStopping's
    best epoch). A save may return before it is on disk; ``close()`` waits for it (fit calls
    it on every way out). ``run_log``: where the saves put the History
    (``_edges.checkpointing.RunLog``; a resume tells it where the restored run's lines end).
    ``lock()``: takes the directory lock (fit does, before it reads or trains
    anything; ``close()`` releases it). ``keep``: how many checkpoints the directory keeps
    (0: saves never fuse epochs — a storage whose saves must see the device arrays).
    ``together()``: a context in which saves are written as one batch (a fused call's)."""

    every_epochs: int
    every_steps: int | None
    save: Callable[..., Any]
    close: Callable[[], None] = lambda: None
    run_log: Any = None
    lock: Callable[[], None] = lambda: None
    keep: int = 0
    together: Callable[..., Any] = lambda last=False: contextlib.nullcontext()


def written_carry(live: LiveState) -> tuple | None:
    """The carry when the owner's objects hold it (everything flushed), else None."""
    return None if live.unwritten else live.carry()


class NonFiniteLossWarning(UserWarning):
    """Issued once after a ``fit`` under ``on_nonfinite="ignore"`` (the default) in which
    some steps had a non-finite loss: those steps were applied as the plain loop applies
    them, so the weights may be NaN now. It says how many steps (per member for a
    ``Population``) and where the first was; ``on_nonfinite="skip"`` leaves such steps
    out, ``"stop"`` halts before the first one.

    Example:
      >>> import warnings
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("error", NonFiniteLossWarning)  # fail the run instead
      ...     trainer.fit(data, epochs=3, batch_size=32)
    """


class Preempted(Exception):
    """``fit`` received SIGTERM (a preemption notice): it finished the compiled call in
    flight, started nothing more (no call, no evaluation), saved a checkpoint, closed its
    writers and stopped. Run the same ``fit`` with ``resume=True`` to go on from there
    (an epoch whose steps all ran before the signal is evaluated and ended there).

    Example:
      >>> try:
      ...     trainer.fit(data, epochs=100, batch_size=32, checkpoint_dir=d, resume=True)
      ... except Preempted:
      ...     sys.exit(143)   # the scheduler restarts the job, which resumes
    """


@contextlib.contextmanager
def caught_signals(enabled: bool) -> Iterator[list[int]]:
    """While active, SIGINT and SIGTERM are recorded in the yielded list instead of interrupting
    (the fit loop stops after the call in flight and saves)."""
    received: list[int] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield received
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    previous = {}
    for signum, default in defaults.items():
        if signal.getsignal(signum) is default:
            previous[signum] = signal.signal(signum, lambda s, frame: received.append(s))
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class FitLoop:
    """Trains a schedule's stretches of compiled calls on the owner's objects and returns
    their History.

    ``make_runner(carry_def, carry_shardings, donate)`` builds the compiled runner (one
    model, or members vmapped) of the fit's ``layout`` (the owner's, for this fit's data and
    mesh: ``Engine.run_layout``): the loop never asks which.
    """

    def __init__(
        self,
        *,
        program: TrainProgram,
        execution: Execution,
        owner: Owner,
        layout: Layout,
        placement: Placement,
        make_runner: Callable[..., Any],
        callbacks: CallbackList,
        progress: bool,
        evaluation: Evaluation | None,
        checkpoints: Checkpoints | None = None,
        progress_logs: Sequence[str] | None = None,
    ):
        self.program, self.execution = program, execution
        self.owner, self.placement, self.make_runner = owner, placement, make_runner
        self.callbacks, self.evaluation = callbacks, evaluation
        self.checkpoints = checkpoints
        self.layout = layout
        self._signals: list[int] = []
        self._partial = empty_losses(self.layout)
        # The unfinished epoch's scalar aux logs per step trained before a resume (None:
        # unknown, a run log written without them).
        self._partial_aux: dict[str, np.ndarray] | None = {}
        self._save_at_epoch_end = False
        # Several processes train one model: only the first one reports.
        self.progress = progress and is_primary()
        self.progress_logs = progress_logs
        self._warned_drop = False
        # Under on_nonfinite="ignore": steps whose loss was not finite (per member), and
        # the first one's (epoch, step of the epoch); counted from the epochs' host losses.
        self._nonfinite: Any = 0
        self._steps_logged = 0
        self._first_nonfinite: tuple[int, int] | None = None
        self._ahead = Ahead([])  # the programs this fit compiles ahead (run() sets them)
        # Members a call halted (on_nonfinite="stop"), frozen before the next call starts;
        # and the owner's revision the live carry was read at.
        self._halted_members: list[int] = []
        self._revision = owner.revision

    @property
    def _stop_requested(self) -> bool:
        return bool(getattr(self.callbacks.trainer, "stop_training", False))

    def run(
        self,
        schedule: Schedule,
        epoch_calls: Epochs,
        *,
        history: History,
        partial: np.ndarray | None = None,
        partial_aux: dict[str, np.ndarray] | None = None,
    ) -> History:
        """Trains what ``schedule`` plans, in ``epoch_calls``' calls, from the owner's state, onto
        ``history`` (a resumed run's so far, else empty)."""
        owner = self.owner
        # An epoch's train_<metric> logs cover exactly that epoch's steps: start afresh,
        # unless this fit goes on inside an epoch (a resume from a mid-epoch checkpoint,
        # whose metrics hold the sums of the epoch's steps trained before it).
        if owner.epoch_step == 0:
            owner.reset_metrics()
        # No local keeps the owner's arrays: the first call counts who else references
        # them (see calls.LiveState.donatable).
        live = LiveState(
            *owner.read()[1:], owner.make_write_back(), self.placement, self.make_runner
        )
        owner.release_reads()  # from here on callbacks may change the objects
        # Whether tx came from inject_hyperparams: looked up once, not every epoch.
        injected = learning_rate(live.carry()[1], self.layout) is not None
        fuse = self._may_fuse(injected, live)
        saves = self._saves(live) if fuse and self.checkpoints is not None else None
        lengths = self.program.compiled_lengths(
            (call_shape(live.runner(self.execution.donate), epoch_calls), saves is not None)
        )
        schedule = dataclasses.replace(
            schedule, per_epoch=epoch_calls.steps_per_epoch, tail=epoch_calls.keep_tail,
            plan=self.execution.plan, fuse=fuse,
            every=None if self.evaluation is None else self.evaluation.every,
            compiled=frozenset(lengths), fused_steps=epoch_calls.fused_steps, saves=saves,
        )  # fmt: skip
        # Compiled by this fit (the first as it runs, the others ahead): whole epochs.
        lengths.update(s.epochs for s in schedule.stretches() if not s.skip and s.steps == s.ends)
        if partial is not None:
            self._partial, self._partial_aux = partial, partial_aux
        self.callbacks.trainer.stop_training = False
        first, later = self._lowered_ahead(schedule, epoch_calls, live)
        # In the order the run calls them: the first stretch's, its evaluation, the rest.
        self._ahead = Ahead([*first, ("evaluate", self._evaluation_ahead(schedule)), *later])
        total, last_epoch = schedule.progress()
        bar = RunProgress(total, self.progress, last_epoch=last_epoch, has_aux=self.program.has_aux,
                          layout=self.layout, log_names=self.progress_logs)  # fmt: skip
        try:
            with caught_signals(self.checkpoints is not None) as self._signals, bar:
                self.callbacks("on_train_begin")
                for stretch in schedule.stretches(lambda: owner.step):
                    if self._signals:  # came between calls: nothing more starts
                        self._preempted(history, [])
                    if self._stop_requested or not owner.trains():
                        break
                    # The budget's last stretch: its saves are the fit's last (see together()).
                    final = schedule.spent(stretch.epoch + stretch.epochs,
                                           owner.step + (stretch.steps or 0))  # fmt: skip
                    if not self._train(history, live, epoch_calls, stretch, bar, injected, final):
                        break
                if self._signals:  # came during the last epoch's hooks or save: not absorbed
                    self._preempted(history, [])
                self._ahead.wait()  # compiled by now, unless fit stopped early
        except BaseException as error:
            self._ahead.wait()  # no compile outlives the fit
            # The epochs trained so far stay reachable, files the callbacks opened are
            # closed, a checkpoint in flight is finished: an exception loses no record.
            error.history = history
            self.callbacks.close()
            if self.checkpoints is not None:
                with contextlib.suppress(Exception):  # the error on its way out matters more
                    self.checkpoints.close()
            raise
        self.callbacks("on_train_end", history)
        if self.checkpoints is not None:
            if owner.loaded_since_checkpoint or schedule.spent(owner.epoch, owner.step):
                # EarlyStopping put the best epoch's weights back: the checkpoint holds them
                # and the History's events. A run that trained its whole budget ends saved
                # whatever checkpoint_every is, so its rerun trains nothing (no-op when
                # the last epoch was saved already).
                self.checkpoints.save(history, empty_losses(self.layout))
            self.checkpoints.close()  # every checkpoint is on disk when fit returns
        self._warn_nonfinite()
        return history

    def _lowered_ahead(
        self, schedule: Schedule, epoch_calls: Epochs, live: LiveState
    ) -> tuple[list, list]:
        """The training programs of the schedule's calls after its first (a call of another
        length: a stretch cut by evaluation, ``max_steps`` or ``FUSED_STEPS``; a short
        last batch), lowered and keyed by :func:`call_key`: the first stretch's, and the
        others'. Only when epochs fuse: then nothing but an error stops the schedule early,
        so each will surely run."""
        placeholder_calls = getattr(epoch_calls, "placeholder_calls", None)
        run = live.runner(self.execution.donate)
        if not schedule.fuse or placeholder_calls is None or not hasattr(run, "lower"):
            return [], []
        stretches = list(schedule.stretches())
        if len(stretches) == 1 and len(stretches[0].calls) == 1:
            # One call (a fit of one epoch, say): it compiles as it runs, and nothing is
            # left to lower, so no placeholder order is made and placed (host time a short
            # fit felt).
            return [], []
        seen_stretches, seen, first, later = set(), set(), [], []
        for stretch in stretches:
            shape = (stretch.epochs, stretch.skip, stretch.steps, stretch.calls)
            if shape in seen_stretches:
                continue
            seen_stretches.add(shape)
            for call in placeholder_calls(stretch):
                unroll = self.execution.plan.unroll if call.unroll is None else call.unroll
                key = call_key(call.indices, call.length, unroll, call.rows, call.data, call.kept)
                if key not in seen and seen:  # the first call compiles as it runs
                    args = (live.leaves, call.data, call.indices, call.start)
                    options = dict(length=call.length, unroll=unroll, rows=call.rows)
                    if call.kept is not None:
                        options.update(kept=call.kept[0], slots=call.kept[1])
                    lower = functools.partial(run.lower, *args, **options)
                    (later if len(seen_stretches) > 1 else first).append((key, lower))
                seen.add(key)
        return (
            [(key, lowered_or_none(lower)) for key, lower in first],
            [(key, lowered_or_none(lower)) for key, lower in later],
        )

    def _evaluation_ahead(self, schedule: Schedule) -> Any:
        """The evaluation's program, lowered, when the schedule surely reaches an
        evaluation: one within its epochs, and in its first stretch unless nothing but an
        error stops the schedule early (its epochs may fuse)."""
        if self.evaluation is None or self.evaluation.lowered is None:
            return None
        planned = list(schedule.stretches())
        if not planned:
            return None
        first, every = planned[0], self.evaluation.every
        evaluated = first.epoch + (-(first.epoch + 1)) % every  # (epoch + 1) % every == 0
        last = planned[-1].epoch + planned[-1].epochs - 1
        if evaluated > last or not (schedule.fuse or evaluated < first.epoch + first.epochs):
            return None
        return lowered_or_none(self.evaluation.lowered)

    def _on_halt(self, live: LiveState) -> Callable[[Any, Any, int], int]:
        """``on_nonfinite="stop"``: the layout's policy for a call that halted."""

        def on_halt(halted: Any, losses: Any, length: int) -> int:
            first = self.owner.step + live.unwritten_steps
            return self.layout.halted_steps(
                halted, losses, length, first, self.owner.epoch, self._halted_members.extend
            )

        return on_halt

    def _refresh(self, live: LiveState) -> Callable[[], None]:
        """Before each call: freezes the members the last call halted, and carries on from
        the owner's carry when it changed since it was read (a member frozen)."""

        def refresh() -> None:
            if self._halted_members:
                live.flush()  # the halted call's carry is the owner's: freeze in it
                self.owner.set_active(self._halted_members, False)
                self._halted_members = []
            if self.owner.revision != self._revision:
                self._revision = self.owner.revision
                live.reload_state(*self.owner.read()[1:])

        return refresh

    def _may_fuse(self, injected: bool, live: LiveState) -> bool:
        """Whether whole epochs may run fused into one stretch: when nothing needs the host
        between them (see ``docs/performance.md``). Checkpoints do not: a fused call
        returns the states their saves need (``held_states.py``), the checkpoint of each
        epoch bitwise the one a call of that epoch alone leaves (unless saves come inside
        epochs, or the model is placed on a mesh or over processes, whose saves go
        through orbax from the devices' arrays)."""
        checkpoints = self.checkpoints
        return not (
            self.callbacks.has_epoch_hooks
            or self.callbacks.has_call_hooks
            or injected  # the learning rate is logged per epoch
            or self.owner.metrics is not None  # train_<metric> is computed per epoch
            or self.program.halts  # the non-finite stop names its epoch
            or self.execution.waits  # host callbacks: a failure keeps the last epoch
            or (checkpoints is not None and not self._saves_fuse(live))
        )

    def _saves_fuse(self, live: LiveState) -> bool:
        """Whether epochs that save may fuse: saves at epoch ends only (those inside epochs
        come at call boundaries), written as nnxscan's own files from host copies of the
        states a fused call keeps (one process holding the model whole, off a mesh)."""
        checkpoints = self.checkpoints
        return (
            checkpoints.every_steps is None
            and checkpoints.keep > 0
            and live.shardings is None
            and jax.process_count() == 1
        )

    def _saves(self, live: LiveState) -> Saves:
        """The checkpoints' schedule, for fused epochs: which states their calls keep."""
        carry_bytes = sum(int(x.nbytes) for x in live.leaves)
        return Saves(self.checkpoints.every_epochs, self.checkpoints.keep, carry_bytes)

    def _train(
        self, history, live, epoch_calls, stretch: Stretch, bar, injected, final=False
    ) -> bool:
        """Trains one stretch of the schedule; False when fit should end. ``final``: the
        schedule's last (its saves are the fit's last, the ``state/`` item's with them)."""
        owner, callbacks, checkpoints = self.owner, self.callbacks, self.checkpoints
        epoch, count, skip = stretch.epoch, stretch.epochs, stretch.skip
        first_step, stats = owner.step, EpochStats()
        callbacks("on_epoch_begin", epoch)
        if self._stop_requested:
            return False
        start = time.perf_counter()
        outs: list = []
        kept: list = []  # a fused call's kept epoch-end states (see held_states.py)
        every_steps = checkpoints.every_steps if checkpoints is not None else None
        next_save = [(first_step // every_steps + 1) * every_steps if every_steps else None]

        def on_call(steps: int, out: Any) -> None:
            if stretch.held:
                out, states = out
                kept.append(states)
            outs.append(out)
            bar.call_done(epoch, steps, out, live.compile_s)
            if next_save[0] is not None and owner.step >= next_save[0]:
                # At the first call boundary at or after each multiple of every_steps
                # (before the hooks: a hook that raises finds the call saved). A call that
                # ends the epoch leaves the save to the epoch's end, once it is counted.
                if stretch.ends is not None and owner.step - first_step >= stretch.ends:
                    self._save_at_epoch_end = True
                else:
                    self._save_mid_epoch(history, outs, skip + owner.step - first_step, live)
                next_save[0] = (owner.step // every_steps + 1) * every_steps
            if callbacks.has_call_hooks:
                # Written back after every call when there are hooks: owner.step is a
                # Python int, so reading it forces no host sync.
                callbacks("on_call_end", {"epoch": epoch, "step": owner.step})

        compiled_before = live.compile_s
        refresh = self._refresh(live)
        try:
            run_calls(
                self.program, self.execution, live, epoch_calls(stretch, stats), on_call,
                lambda: self._stop_requested or bool(self._signals),
                write_every_call=callbacks.has_call_hooks or every_steps is not None,
                refresh=refresh, on_halt=self._on_halt(live), ready=self._ahead.ready,
            )  # fmt: skip
            refresh()  # the stretch's logs and hooks see the members it froze
        except NonFiniteStop as stop:
            raise self._nonfinite_error(history, epoch, first_step, stop, start, stats) from None
        finally:
            # The epochs count as soon as all their steps are in the model, even if an
            # interrupt lands later (in the progress bar or the host sync).
            trained = owner.step - first_step
            complete = stretch.complete(trained, stats.ended)
            owner.epoch, owner.epoch_step = stretch.reached(trained, complete)
            finished = owner.epoch - epoch
            if outs and finished and not complete:  # fit is ending
                self._log_finished(history, stretch, finished, complete, outs, start)
        if not outs and not (skip and complete) and not self._signals:
            return False  # stopped before the epoch's first call

        def on_signal(last: Any = None) -> None:
            """A signal before the epoch's end (its metrics, evaluation, hooks) began: they
            are left to the resumed run, which finds the epoch with all its steps trained
            and none logged (``epoch_step`` = its steps) and ends it. Saves and raises.
            Fused epochs (``last``: the outputs of the last) end as without a signal but
            the last, whose end is left to the resumed run: the signal is acted on as
            that end begins (nothing of the user's runs between fused epochs)."""
            if not self._signals:
                return
            if complete and count == 1:
                owner.epoch, owner.epoch_step = epoch, skip + trained
            elif complete and last is None:
                return  # asked again as the last epoch's end begins
            elif complete:
                owner.epoch, owner.epoch_step = epoch + count - 1, stretch.per_epoch
                outs[:] = [last]  # the unfinished epoch's losses: the last one's
            self._preempted(history, outs)

        if outs:  # the host sync: waits for the calls to finish
            stacked, wall_time = host_outputs(outs, start)
        on_signal()
        if skip and complete and not outs:
            # The end of an epoch trained whole before a preemption: the checkpoint of
            # this step holds the epoch unended, so the next save of this step replaces it.
            owner.loaded_since_checkpoint = True
        if not outs:  # a resumed epoch whose every step was trained before the interruption
            empty = empty_losses(self.layout)
            stacked, wall_time = ((empty, None) if self.program.has_aux else empty), 0.0
        if skip:  # the resumed epoch's first steps were trained before the interruption
            stacked = prepend_losses(self._partial, stacked, self.program.has_aux,
                                     self._partial_aux, self.layout)  # fmt: skip
        self._partial, self._partial_aux = empty_losses(self.layout), {}
        timing = (wall_time / count, (live.compile_s - compiled_before) / count)
        pieces = [stacked] if count == 1 else split_steps(stacked, count)
        saved = self._fused_saves(live, stretch, first_step, kept)
        together = None
        if checkpoints is not None:
            # The fit's last save is this stretch's when its last epoch saves; else the
            # fit's end saves the final state after it.
            last = final and (epoch + count) % checkpoints.every_epochs == 0
            together = checkpoints.together(last=last)
        with together or contextlib.nullcontext():
            for i, piece in enumerate(pieces):
                last = i == count - 1
                signal_check = on_signal if count == 1 else (
                    functools.partial(on_signal, piece) if last else lambda: None)  # fmt: skip
                self._log_epoch(history, epoch + i, piece, timing, stats, complete, live,
                                injected, bar, signal_check, saved.get(i))  # fmt: skip
        return not self._stop_requested and owner.trains()

    def _fused_saves(self, live: LiveState, stretch: Stretch, first_step: int, kept: list) -> dict:
        """What the saves due at the ends of a fused stretch's epochs write, by epoch (see
        :meth:`_log_epoch`'s ``saved``): the kept states with their epochs' counters; ``()``
        for a due save the stretch's own newer saves would delete at once (not written);
        the last epoch's: the carry, as an epoch's alone."""
        if stretch.epochs == 1 or self.checkpoints is None:
            return {}
        saved: dict[int, Any] = {i: () for i in range(stretch.epochs - 1)}
        if kept:
            packing = BankPacking.of(live.leaves)
            states = packing.unpack(kept[0], len(stretch.held))
            for i, leaves in zip(stretch.held, states, strict=True):
                step = first_step + (i + 1) * stretch.per_epoch
                at = {"epoch": stretch.epoch + i + 1, "step": step, "epoch_step": 0}
                saved[i] = (jax.tree.unflatten(live.treedef, leaves), at)
        return saved

    def _log_finished(self, history, stretch, finished, complete, outs, start) -> None:
        """Logs the ``finished`` first epochs of a stretch that an error or a signal ends
        (fused epochs stopped between their calls):
        their losses and aux means, in the History the error carries; no hooks run."""
        stacked, wall_time = host_outputs(outs, start)
        if stretch.skip:  # the resumed epoch's first steps were trained before
            stacked = prepend_losses(self._partial, stacked, self.program.has_aux,
                                     self._partial_aux, self.layout)  # fmt: skip
        if not complete:
            stacked = jax.tree.map(lambda x: x[: finished * stretch.per_epoch], stacked)
        for i, piece in enumerate(split_steps(stacked, finished)):
            logs, losses = self._logs(stretch.epoch + i, piece, wall_time / finished, EpochStats())
            history._append(losses, logs)

    def _logs(
        self, epoch: int, stacked: Any, timing: Any, stats: EpochStats, skipping=None
    ) -> tuple:
        skipping = self.program.skips_nonfinite if skipping is None else skipping
        wall_time, compile_time = timing if isinstance(timing, tuple) else (timing, 0.0)
        logs, losses = epoch_logs(
            epoch, stacked, wall_time, has_aux=self.program.has_aux, layout=self.layout,
            skipping=skipping, dropped=stats.dropped, compile_time=compile_time,
        )  # fmt: skip
        if not self.program.has_loss:  # a stateful train_step that returns no loss
            del logs["loss"]
        elif not skipping and not self.program.halts:  # "ignore": applied, so counted
            self._count_nonfinite(epoch, losses)
        return logs, losses

    def _count_nonfinite(self, epoch: int, losses: np.ndarray) -> None:
        """Counts an epoch's non-finite losses (already on the host: no extra sync)."""
        bad = ~np.isfinite(losses)
        self._steps_logged += int(bad.shape[0])
        if not bad.any():
            return
        self._nonfinite = self._nonfinite + bad.sum(axis=0)
        if self._first_nonfinite is None:
            member_axes = tuple(range(1, 1 + len(self.layout.shape)))  # the layout's, not bad's
            self._first_nonfinite = (epoch, int(np.argmax(bad.any(axis=member_axes))))

    def _warn_nonfinite(self) -> None:
        """One warning after a fit whose losses were not all finite under "ignore"."""
        if self._first_nonfinite is None:
            return
        what = self.layout.nonfinite_steps(np.asarray(self._nonfinite), self._steps_logged)
        epoch, step = self._first_nonfinite
        warn(
            f"nnxscan: {what} of this fit had a non-finite loss (NaN or inf; the first at "
            f'epoch {epoch}, step {step} of the epoch). With on_nonfinite="ignore" (the '
            f"default) those steps were applied, so the weights may be non-finite now. Pass "
            f'on_nonfinite="skip" to leave such steps out, or on_nonfinite="stop" to '
            f"halt before the first one.",
            NonFiniteLossWarning,
        )

    def _losses_so_far(self, outs: list) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
        """The unfinished epoch's losses and scalar aux logs per step: before a resume, and
        from ``outs`` since."""
        aux = partial_scalar_aux(self._partial_aux, outs, self.program.has_aux, self.layout)
        if not outs:
            return self._partial, aux
        stacked, _ = host_outputs(outs, time.perf_counter())
        losses = stacked[0] if self.program.has_aux else stacked
        return np.concatenate([self._partial, np.asarray(losses, np.float32)]), aux

    def _save_mid_epoch(
        self, history: History, outs: list, epoch_step: int, live: LiveState
    ) -> None:
        """A checkpoint inside an epoch: the model and counters as they are, the epoch's
        losses so far, and how many of its steps are done (what a resume skips)."""
        owner = self.owner
        complete_epoch_step, owner.epoch_step = owner.epoch_step, epoch_step
        try:
            losses, aux = self._losses_so_far(outs)
            self.checkpoints.save(history, losses, written_carry(live), aux)
        finally:
            owner.epoch_step = complete_epoch_step

    def _preempted(self, history: History, outs: list) -> None:
        """A SIGTERM or SIGINT arrived: the call in flight finished, and no other started.
        Save where the owner stands (``outs``: the calls of its unfinished epoch since the
        last resume, or since the epoch began), then raise."""
        if self.owner.epoch_step:
            partial, aux = self._losses_so_far(outs)
        else:  # at an epoch boundary
            partial, aux = empty_losses(self.layout), {}
        self.checkpoints.save(history, partial, None, aux)
        self.checkpoints.close()  # on disk before the process is told it may exit
        signum = self._signals[0]
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Preempted(
            f"fit stopped on signal {signal.Signals(signum).name} after the compiled call in "
            f"flight (if any), starting nothing more; a checkpoint at step {self.owner.step} "
            f"holds everything: run the same fit with resume=True to go on."
        )

    def _log_epoch(
        self, history, epoch, outputs, timing, stats, complete, live, injected, bar, on_signal,
        saved=None,
    ):  # fmt: skip
        """One epoch's logs: losses, metrics, evaluation; then the on_epoch_end hooks.
        ``on_signal()`` saves and raises if a signal came: asked before the epoch's end
        (metrics, evaluation) begins. ``saved``: what a save due now writes (a fused
        epoch's: ``(carry, counters)`` of its end, or ``()``: nothing), else the owner's
        objects as they are."""
        owner = self.owner
        logs, losses = self._logs(epoch, outputs, timing, stats)
        if complete:
            on_signal()
        if owner.metrics is not None:
            logs.update({f"train_{k}": v for k, v in owner.take_metrics().items()})
            # take_metrics reset the metrics: the next epoch starts from them.
            live.reload_state(owner.read_state())
        if injected:
            # From the carry: reading an nnx.Optimizer's optax state traces tx.init.
            logs["learning_rate"] = learning_rate(live.carry()[1], self.layout)
        logs.update(owner.active_logs())
        if not complete:
            logs["stopped"] = True
        elif self.evaluation is not None and (epoch + 1) % self.evaluation.every == 0:
            self._ahead.ready("evaluate")
            logs.update({f"eval_{k}": v for k, v in self.evaluation.run().items()})
        self._warn_dropped(epoch, stats)
        history._append(losses, logs)
        bar.epoch_done(epoch, logs)
        if complete:
            self.callbacks("on_epoch_end", epoch, logs)
            checkpoints, due = self.checkpoints, self._save_at_epoch_end
            self._save_at_epoch_end = False
            if checkpoints is not None:
                checkpoints.run_log.check(epoch, logs)  # what it cannot keep: refused now
                if saved is not None and (epoch + 1) % checkpoints.every_epochs == 0:
                    if saved:  # a fused call's epoch before its last
                        carry, at = saved
                        checkpoints.save(history, empty_losses(self.layout), carry, at=at)
                elif due or (epoch + 1) % checkpoints.every_epochs == 0:
                    checkpoints.save(history, empty_losses(self.layout), written_carry(live))

    def _nonfinite_error(self, history, epoch, first_step, stop, start, stats) -> Exception:
        stacked, wall_time = host_outputs(stop.outs, start)
        # The halted call's steps after the stop report NaN: left out of the mean.
        logs, losses = self._logs(epoch, stacked, wall_time, stats, skipping=True)
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
            warn(
                f"nnxscan: dropped the final short batch of {stats.dropped} examples in "
                f"epoch {epoch} (and will in every epoch that has one; see "
                f"History.epochs[i]['dropped_examples']); pass drop_remainder=False to "
                f"train on it."
            )
