"""Running a plan's compiled calls while keeping the user's objects live.

State buffers are donated to the compiled calls (:func:`donates_carry` says when: not for a
small carry on a TPU), so the arrays the user's module held before the call are deleted
when it runs. The module is therefore written back with the newest state after each call
(the per-step plan: at the end of the stretch of calls, to spare per-step Python) and,
whatever stops the loop, before the exception leaves.

Only buffers nothing else references are donated. Before a call that would donate arrays
the user's objects held (the first call of a run, and every call after a write-back or a
hand-out of the carry), each leaf's reference count is compared with the one reference
the owner keeps: a leaf something else also holds (``nnx.clone(model)`` shares arrays, a
teacher sharing a submodule, a dict of ``model.kernel[...]``, a callback's snapshot) is
copied, and the copy is donated; the other object keeps its array. Between calls whose
carry nobody saw (the per-step plan's stretch) no check runs. Also:

- Ctrl-C is held while a call is in flight and raised right after its result is kept (a
  SIGINT landing between the donation and the bookkeeping would otherwise lose the state);
- a step with host callbacks (which can fail inside the call) is run without donation and
  waited for, so a failure leaves the last completed state;
- two leaves holding one buffer (tied variables, an optax state that keeps a reference to
  the params) are copied apart first: a buffer can be donated only once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscan.pure import paused_gc
from nnxscan.shell._engine.placement import Placement
from nnxscan.shell._engine.plans import Plan, choose_plan
from nnxscan.shell._engine.programs import TrainProgram


class Execution(NamedTuple):
    """How :func:`run_calls` executes: the plan, whether the state is donated, and whether
    each call is waited for (a step with host callbacks, which can fail inside the call)."""

    plan: Plan
    donate: bool
    waits: bool


#: On a TPU, a carry (the state and optimizer state, every member's) of at most this many
#: bytes is not donated to a compiled call. Donating ties the loop's carry to the call's
#: argument buffers, which constrains XLA:TPU's buffer assignment: measured on a TPU v5e,
#: the same scan undonated runs 0.81x (small MLP), 0.94x (784-512-512-10 MLP) and
#: 0.90x (8x8 CNN) the donated one's step, as Flax's ``nnx.scan`` under ``nnx.jit`` (which
#: donates nothing) does (docs/performance.md). Not donating keeps the old buffers alive
#: during a call: at most this much more device memory (0.4% of a 16 GiB chip). A larger
#: carry is donated, as everywhere else: there device memory is what counts.
ACCELERATOR_KEPT_CARRY_BYTES = 64 * 1024 * 1024


def donates_carry(carry: Any, backend: str | None = None) -> bool:
    """Whether the compiled calls donate ``carry`` (a pytree of arrays): everywhere but on
    a TPU, where a carry of at most ``ACCELERATOR_KEPT_CARRY_BYTES`` is faster kept (a GPU
    keeps the CPU's rule until measured there). Only a TPU reads the carry's sizes.

    Example:
      >>> donates_carry({"w": jnp.zeros(3)}, backend="cpu")
      True
      >>> donates_carry({"w": jnp.zeros(3)}, backend="tpu")
      False
    """
    if (backend or jax.default_backend()) != "tpu":
        return True
    nbytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(carry))
    return nbytes > ACCELERATOR_KEPT_CARRY_BYTES


def prepare_execution(
    program: TrainProgram,
    explicit: Plan | None,
    graphdef: Any,
    carry: Callable[[], tuple[Any, Any]],
    batch: Any,
    donate: bool = True,
) -> Execution:
    """Traces the step once (no compile) to pick the plan (unless given) and donation;
    ``carry()`` gives the ``(state, opt_state)`` to trace it with (called on a miss);
    ``donate`` is :func:`donates_carry` of the real carry (a step with host callbacks is
    never donated: a failure inside the call must leave the last state)."""
    traits = program.traits(graphdef, carry, batch)
    plan = explicit or choose_plan(traits, jax.default_backend())
    return Execution(plan, donate=donate and not traits.has_callback, waits=traits.has_callback)


class LiveState:
    """The newest ``(state, opt_state)`` of one run of calls, kept as flat leaves: the carry
    in flight between the owner's reads and writes.

    ``write(leaves, treedef, steps)`` (an owner's write-back) puts it into the owner's objects
    and receives the number of steps trained since the last write. ``make_runner(carry_def,
    carry_shardings, donate)`` builds the compiled runner for this carry (see
    ``programs.TrainProgram.runner``).
    """

    def __init__(
        self,
        state: nnx.State,
        opt_state: Any,
        write: Callable[[nnx.State, Any, int], None],
        placement: Placement | None = None,
        make_runner: Callable[..., Any] | None = None,
    ):
        self.placement = placement or Placement()
        leaves, self.treedef = jax.tree.flatten((state, opt_state))
        # Decided once per run of calls, from the model (see placement.py): pinned in and out.
        self.shardings = self.placement.carry_shardings(state, opt_state)
        self.leaves = _unaliased(self.placement.put_carry(leaves, self.shardings), key=_buffer_key)
        # The owner's own arrays, until the first call has checked who else holds them:
        # placing may wrap one in a new Array object over the same buffer, so the count
        # that tells whether it is shared is the original's.
        self._sources: list | None = leaves
        self._make_runner = make_runner
        self._runner: tuple | None = None
        self._write = write
        self.unwritten_steps = 0
        # Seconds spent compiling calls of this run (their dispatch blocks while XLA
        # compiles): what the logs subtract to report steady steps/s.
        self.compile_s = 0.0
        # Whether the leaves differ from what the owner holds. Not the same as
        # unwritten_steps > 0: a call that halted at its first step trained 0 steps, yet
        # consumed (donated) the buffers the owner holds, so its output must be written.
        self.unwritten = False
        # Whether code outside this object may hold the leaves (they came from the owner,
        # were written into it or handed out): the next donating call checks them first.
        self._exposed = True

    def carry(self) -> tuple[nnx.State, Any]:
        """The newest ``(state, opt_state)`` as pytrees (the same arrays, no copy)."""
        self._exposed = True  # the caller may keep them (a checkpointer does)
        return jax.tree.unflatten(self.treedef, self.leaves)

    def donatable(self) -> list:
        """The leaves to donate to the next call: the carry itself, except that a leaf
        something besides this carry and the owner references is copied (the copy is
        donated, the other holder keeps its array), and so is the second of two leaves
        over one buffer. Checks only when the leaves were exposed since the last call:
        the outputs of a call nobody saw are this carry's alone."""
        if not self._exposed:
            return _unaliased(self.leaves)
        self._exposed = False
        leaves, sources, self._sources = self.leaves, self._sources, None
        if sources is not None:
            # Just read from the owner: each original is held once by the owner and once
            # by ``sources`` (and once more by ``leaves`` when placing kept the object).
            counts = _reference_counts(sources)
            limits = [_UNSHARED + 1 + (x is y) for x, y in zip(sources, leaves, strict=True)]
        else:
            # A call's outputs: held by ``leaves``, and by the owner once written back.
            counts = _reference_counts(leaves)
            limits = [_UNSHARED + (0 if self.unwritten else 1)] * len(leaves)
        seen: set[int] = set()
        out = None
        for i, leaf in enumerate(leaves):
            if counts[i] > limits[i] or id(leaf) in seen:
                out = list(leaves) if out is None else out
                out[i] = _copy(leaf)
            seen.add(id(leaf))
        return leaves if out is None else out

    def reload_state(self, state: nnx.State, opt_state: Any = None) -> None:
        """Carries on from a module state read anew from the owner (after it was changed between
        calls, e.g. metrics reset); the optax state too when given (a member frozen), else it
        stays."""
        assert not self.unwritten, "reload would lose unwritten steps"
        opt_state = self.carry()[1] if opt_state is None else opt_state
        leaves, treedef = jax.tree.flatten((state, opt_state))
        assert treedef == self.treedef, "the carry's structure changed"
        self.leaves = _unaliased(self.placement.put_carry(leaves, self.shardings), key=_buffer_key)
        self._sources, self._exposed = leaves, True

    def keep_between_runs(self) -> bool | None:
        """Lets this object outlive its run of calls (``kept_setup.py``): drops the carry's
        arrays (the owner's objects hold them), its write-back and the runner's maker (the
        engine that built it refers to the owner); returns the built runner's ``donate``
        (None when none was built). :meth:`start_run` takes it up again."""
        self._make_runner = None
        self.leaves, self._sources, self._exposed, self._write = [], None, True, None
        self.unwritten, self.unwritten_steps, self.compile_s = False, 0, 0.0
        return None if self._runner is None else self._runner[0]

    def start_run(self, sources: list, write: Callable[[list, Any, int], None]) -> None:
        """A new run of calls from ``sources``, the owner's own arrays in the carry's order
        and placement (as read from it: the next donating call checks who else holds them),
        written back through ``write``."""
        self.leaves, self._sources, self._exposed = list(sources), sources, True
        self._write = write

    def runner(self, donate: bool) -> Any:
        """The compiled runner for this carry, looked up once per fit, not per epoch:
        the lookup hashes the graphdef, which costs more than a small model's step."""
        if self._runner is None or self._runner[0] != donate:
            run = self._make_runner(self.treedef, self.shardings, donate)
            self._runner = (donate, run)
        return self._runner[1]

    def advance(self, leaves: list, steps: int) -> None:
        self.leaves = leaves
        self.unwritten_steps += steps
        self.unwritten = True
        self._exposed = False  # a call's outputs: nothing else has seen them

    def flush(self) -> None:
        if self.unwritten:
            steps, self.unwritten_steps, self.unwritten = self.unwritten_steps, 0, False
            self._write(self.leaves, self.treedef, steps)
            self._exposed = True  # the user's objects hold them now


@contextlib.contextmanager
def held_interrupts() -> Iterator[Callable[[], bool]]:
    """Holds SIGINT inside the block; yields ``received()`` to ask whether one came."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: False
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield lambda: bool(received)
    finally:
        signal.signal(signal.SIGINT, previous)


def _buffer_key(leaf: Any) -> Any:
    """Identifies the buffer behind a leaf: two Array objects can share one."""
    try:
        return leaf.unsafe_buffer_pointer()
    except Exception:  # sharded or non-array leaves: fall back to the object
        return id(leaf)


def _reference_counts(leaves: list) -> list[int]:
    """``sys.getrefcount`` of each leaf, as seen from here (see ``_UNSHARED``)."""
    return [sys.getrefcount(leaf) for leaf in leaves]


# What _reference_counts gives for an object only one list holds: the list's reference
# plus this interpreter's own (the loop variable, the call's argument), measured rather
# than assumed, since CPython versions count borrowed references differently.
_UNSHARED = _reference_counts([object()])[0]


def _copy(leaf: Any) -> Any:
    """A new buffer with ``leaf``'s value, on its sharding."""
    return jnp.copy(leaf)


def _unaliased(leaves: list, key: Callable[[Any], Any] = id) -> list:
    """``leaves`` with every repeated buffer replaced by a copy (donation needs distinct)."""
    seen: set[Any] = set()
    out = None
    for i, leaf in enumerate(leaves):
        k = key(leaf)
        if k in seen:
            out = list(leaves) if out is None else out
            out[i] = jnp.copy(leaf)
        seen.add(k)
    return leaves if out is None else out


class NonFiniteStop(Exception):
    """A call halted at a non-finite loss (``on_nonfinite="stop"``); the model is written.

    ``steps_in_call`` steps of that call were trained before it; ``outs`` holds the
    epoch's outputs so far.
    """

    def __init__(self, steps_in_call: int, outs: list):
        super().__init__(steps_in_call)
        self.steps_in_call = steps_in_call
        self.outs = outs


class Call(NamedTuple):
    """One compiled call: train ``length`` steps on ``data`` gathered by
    ``indices[..., start:start+length, ...]`` (steps along the runner's steps axis). When
    ``sink`` is a list, the call's outputs (losses) are appended to it, so the caller can
    wait for the call to finish. ``unroll`` overrides the plan's (a short final batch runs
    unrolled, as the core trains it). With ``rows``, ``indices`` are batch numbers of
    ``data`` in its stored order, ``rows`` examples each (sliced, not gathered). ``kept``:
    ``(count, slots)`` for fused epochs that save checkpoints (the runner's ``kept`` and
    ``slots``: each epoch's end state into its slot, ``count`` of them returned)."""

    data: Any
    indices: Any
    start: int
    length: int
    sink: list | None = None
    unroll: bool | None = None
    rows: int | None = None
    kept: tuple[int, Any] | None = None


def plan_calls(
    plan: Plan, data: Any, indices: Any, num_steps: int, rows: int | None = None
) -> Iterator[Call]:
    """The calls that train ``num_steps`` steps of ``indices`` in the plan's chunks."""
    for start, length in plan.chunks(num_steps):
        yield Call(data, indices, start, length, rows=rows)


HaltPolicy = Callable[[Any, Any, int], int]


def run_calls(
    program: TrainProgram,
    execution: Execution,
    live: LiveState,
    calls: Iterable[Call],
    on_call: Callable[[int, Any], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    *,
    write_every_call: bool = False,
    refresh: Callable[[], None] | None = None,
    on_halt: HaltPolicy | None = None,
    ready: Callable[[Hashable], None] | None = None,
) -> list[Any]:
    """Runs the compiled calls in order; returns each call's stacked outputs. ``ready(key)``
    (a :func:`call_key`) returns once a program compiling ahead for that call is ready.
    ``should_stop()`` is asked before each call starts and after each ends: once it says
    True, no further call starts. ``refresh()`` runs before each call (the owner's carry
    may have changed since the last: a member frozen)."""
    plan, donate, waits = execution
    # The per-step plan writes back once per stretch of calls (per-step Python would cost
    # more than the step) unless something looks at the objects after every call.
    write_each_call = plan.kind != "step" or write_every_call
    run = live.runner(donate)
    outs, called = [], set()
    try:
        for data, indices, start, length, sink, unroll, rows, kept in calls:
            if should_stop is not None and should_stop():
                # A stop (a signal) that came while the previous call's hooks ran, or while
                # this one's batches were read: no call starts after it.
                break
            if refresh is not None:
                refresh()
            unroll = plan.unroll if unroll is None else unroll
            # Ctrl-C is held only around the call and its bookkeeping, not while waiting
            # for the next batch: a stalled loader can still be interrupted.
            with held_interrupts() as interrupted:
                leaves = live.donatable() if donate else live.leaves
                compiled, started = _cache_size(run), time.perf_counter()
                key = call_key(indices, length, unroll, rows, data, kept)
                if ready is not None:
                    ready(key)
                saving = {} if kept is None else {"kept": kept[0], "slots": kept[1]}
                # A call of a new shape may trace its program: with the collector paused
                # (only then: a long synchronous call would otherwise run with it off).
                with paused_gc() if key not in called else contextlib.nullcontext():
                    leaves, out, halted = run(
                        leaves, data, indices, start, length=length, unroll=unroll, rows=rows,
                        **saving,
                    )  # fmt: skip
                called.add(key)
                if _cache_size(run) > compiled:  # this call traced and compiled a program
                    live.compile_s += time.perf_counter() - started
                if waits:
                    jax.block_until_ready(leaves)  # a callback's failure surfaces here
                trained = length
                if program.halts and np.any(jax.device_get(halted)):  # one sync a call
                    host_halted, losses = jax.device_get((halted, _losses(out, program)))
                    trained = on_halt(host_halted, losses, length)
                live.advance(leaves, trained)
                outs.append(out)
                if sink is not None:
                    sink.append(out)  # the losses: never donated, ready when the call is
                if write_each_call or trained < length:
                    live.flush()
                if trained < length:
                    raise NonFiniteStop(trained, outs)
            if interrupted():
                raise KeyboardInterrupt
            if on_call is not None:
                on_call(length, out)
            if should_stop is not None and should_stop():
                break
    finally:
        live.flush()
        # A stream's generator owns a prefetch thread: stop it now, not when a kept
        # traceback lets the generator be collected.
        close = getattr(calls, "close", None)
        if close is not None:
            close()
    return outs


def call_key(
    indices: Any, length: int, unroll: Any, rows: Any, data: Any = None, kept: Any = None
) -> Hashable:
    """What tells a call's program from another's within one fit (its runner and carry
    being the fit's): the indices' shape and the static options (fused epochs' kept states
    too); for stacked batches in order (``indices=None``: a stream's chunks, whose lengths
    may differ) the data's steps."""
    if indices is None:
        return ("in order", np.shape(jax.tree.leaves(data)[0])[0], length, unroll)
    saving = None if kept is None else (kept[0], np.shape(kept[1]))
    return (np.shape(indices), length, unroll, rows, saving)


def _cache_size(run: Any) -> int:
    """How many programs a jitted function has compiled (0 where JAX does not say)."""
    size = getattr(run, "_cache_size", None)
    return size() if callable(size) else 0


def _losses(out: Any, program: TrainProgram) -> Any:
    return out[0] if program.has_aux else out
