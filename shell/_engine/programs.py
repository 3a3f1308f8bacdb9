"""Compiled training and evaluation programs, cached by what they close over.

A compiled function rebuilt from a fresh closure on every call recompiles every time, which
throws the speed of scanning away. So the shell builds one program per
step (a user's :class:`~nnxscan.pure.Step` or function, or the one of ``(loss_fn, tx, wrt,
has_aux, ...)``) and one evaluation per ``(metric_fn, batch_size)``, keeps the
most recent ones, and lets ``jax.jit``'s own cache handle shapes and graphdefs: a second
``fit`` or ``scan_train`` with the same objects and shapes compiles nothing.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from nnxscan.pure import (
    HaltState,
    Step,
    canonical_conv_dimensions,
    halt_after_nonfinite,
    make_evaluate,
    make_evaluate_metrics,
    make_train_step,
    nnx_train_step,
    paused_gc,
    scan_indexed_steps,
    scan_steps,
    skip_nonfinite,
    step_outputs,
)
from nnxscan.pure.batching import constrain_sharding
from nnxscan.pure.step_node import unpack_step_node
from nnxscan.shell._engine.caching import identity_key as _identity_key
from nnxscan.shell._engine.caching import lookup as _lookup
from nnxscan.shell._engine.held_states import BankPacking
from nnxscan.shell._engine.plans import StepTraits, step_traits
from nnxscan.shell._engine.trace_notes import noting_batch

if TYPE_CHECKING:
    from nnxscan.shell._engine.layout import Layout

_TRAIN: OrderedDict[Hashable, TrainProgram] = OrderedDict()
_EVAL: OrderedDict[Hashable, Callable] = OrderedDict()


class TrainProgram:
    """The compiled pieces of training for one step (a :class:`~nnxscan.pure.Step`).

    ``runner(graphdef, carry_def)`` is the jitted ``run(leaves, data, indices, start,
    length=, unroll=, rows=)`` that trains ``length`` steps on the batches
    ``indices[start:start+length]`` gathered from ``data``, donating the carry's leaves.
    The graphdef is closed over rather than passed: a graphdef argument is hashed on every
    call, which costs more than a small model's step.

    Args:
      step: the step, with its non-finite guard already in it when ``on_nonfinite`` is
        not ``"ignore"`` (``halt_after_nonfinite`` is added here for ``"stop"``).
      on_nonfinite: ``"ignore"``, ``"skip"`` or ``"stop"``.
      user_functions: the user's functions by name, for error notes.
    """

    def __init__(
        self,
        step: Step,
        on_nonfinite: str = "ignore",
        user_functions: dict[str, Callable] | None = None,
    ):
        self.step = step
        self.user_functions = dict(user_functions or {})  # error notes
        self._jitted: OrderedDict[Hashable, Callable] = OrderedDict()
        self.has_aux = bool(step.has_aux)
        #: Whether the step reports a loss (a stateful NNX step may return nothing: its
        #: logs then have no ``loss``). Known once the step was traced.
        self.has_loss = True
        # "stop": every call halts at its first non-finite step and reports whether it did.
        self.halts = on_nonfinite == "stop"
        # "skip": a skipped step reports a NaN loss, left out of the epoch's mean.
        self.skips_nonfinite = on_nonfinite == "skip"
        self._traits: OrderedDict[Hashable, StepTraits] = OrderedDict()
        self._runners: OrderedDict[Hashable, Callable] = OrderedDict()
        self._stretch_lengths: OrderedDict[Hashable, set[int]] = OrderedDict()

    def runner(
        self,
        graphdef: Any,
        carry_def: Any,
        *,
        donate: bool = True,
        carry_shardings: tuple | None = None,
        batch_sharding: Any = None,
        layout: Layout,
    ) -> Callable:
        """The jitted chunk runner for this graphdef and carry structure:
        ``run(leaves, data, indices, start, length=, unroll=, rows=) -> (leaves, outs,
        halted)`` trains the steps ``start:start+length`` of ``indices``.

        The ``layout`` (``_engine.layout``) says what runs: one model (``OneModel``:
        ``indices`` is ``(steps, ...)``), or members (``Members``: the same step wrapped by
        ``vmap_members``, ``indices`` ``(steps, N, ...)`` unless the batch is shared; the
        carry's ``MembersState.active`` freezes the members where it is False). ``halted``
        (``on_nonfinite="stop"``, else None) has the layout's shape.

        With ``donate`` the carry's buffers are donated to the call (the default: training
        then holds one copy of the state). A step with host callbacks is run without
        donation, since a callback can fail after the inputs were consumed.

        The carry ``(state, opt_state)`` crosses the call as a flat list of arrays:
        flattening an ``nnx.State`` of Variables costs a sort per node on every call, more
        than a small model's step, while a list flattens in C++.

        On a mesh, ``batch_sharding`` makes every step data-parallel and the new carry is
        constrained to ``carry_shardings`` (the input's), so the state stays where it was
        placed, call after call, and its buffers can be donated.
        """
        step = Step(_held, self.jitted_step(graphdef), self.has_aux)
        if self.halts:
            step = halt_after_nonfinite(step)
        step = layout.wrap(step)

        def build():
            return chunk_runner(
                step, graphdef, carry_def, self.halts, layout, carry_shardings,
                batch_sharding, donate,
            )  # fmt: skip

        key = (graphdef, carry_def, donate, carry_shardings, batch_sharding, layout)
        return _lookup(self._runners, key, build)

    def traits(self, graphdef: Any, carry: Callable[[], tuple[Any, Any]], batch: Any) -> StepTraits:
        """The step's traits for these shapes, traced once (no compile) and remembered;
        ``carry()`` gives the ``(state, opt_state)`` to trace with, called only then."""
        shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(batch))
        key = (graphdef, shapes, jax.tree.structure(batch))

        def build() -> StepTraits:
            state, opt_state = carry()
            with paused_gc(), noting_batch("training step", self.user_functions, batch):
                return step_traits(self.jitted_step(graphdef), graphdef, state, opt_state, batch)

        return _lookup(self._traits, key, build)

    def compiled_lengths(self, call_shape: Hashable) -> set[int]:
        """The stretch lengths (epochs) compiled for fits whose calls have this shape
        (``fit.call_shape``), to add to: a later fit runs one of them rather than compile
        another (``schedule.Schedule.compiled``)."""
        return _lookup(self._stretch_lengths, call_shape, set)

    def jitted_step(self, graphdef: Any) -> Callable:
        """The step for this graphdef under ``jax.jit`` (XLA inlines it in the compiled
        calls), so that it is traced ONCE: the plan probe's trace is cached and reused when
        a compiled call traces its loop body. The graphdef is closed over, not a static
        argument: a Variable with dict metadata makes it unhashable."""

        def build():
            jitted = jax.jit(
                lambda state, opt_state, batch: self.step(graphdef, state, opt_state, batch)
            )
            return lambda _graphdef, state, opt_state, batch: jitted(state, opt_state, batch)

        return _lookup(self._jitted, graphdef, build)


def _held(graphdef: Any, held: tuple[Any, Any]) -> Any:
    """The init of a runner's innermost step: the owner holds the step's state already.

    A call's carry is its step's ``init(graphdef, (state, held))``: every wrapper's init
    (a halt's, the members') builds its own state around what this one returns, the
    state the owner holds (``held``; one member's, inside the members')."""
    return held[1]


def _halted(carry: Any) -> tuple[Any, Any]:
    """``(held, halted)``: the carry with the halt's state (the outermost
    :class:`~nnxscan.pure.HaltState`, one member's inside the members') taken off, as the
    owner holds it, and its ``halted``."""
    halted: list = []

    def strip(node: Any) -> Any:
        if isinstance(node, HaltState):
            halted.append(node.halted)
            return node.inner
        return node

    held = jax.tree.map(strip, carry, is_leaf=lambda node: isinstance(node, HaltState))
    return held, halted[0]


def chunk_runner(
    step: Step,
    graphdef: Any,
    carry_def: Any,
    halts: bool,
    layout: Layout,
    carry_shardings: tuple | None,
    batch_sharding: Any,
    donate: bool,
) -> Callable:
    """The jitted ``run(leaves, data, indices, start, length=, unroll=, rows=) -> (leaves,
    outs, halted)`` of every training call: it trains the steps ``start:start+length`` of
    ``indices`` (batch numbers of ``rows`` stored examples each when ``rows`` is given) with
    ``scan_indexed_steps``, or with ``indices=None`` the stacked batches
    ``data[start:start+length]`` in order with ``scan_steps``, and keeps the new carry where
    it was placed (``carry_shardings``).

    With ``slots`` (an int array, one per epoch of the call's ``length`` steps) and ``kept``
    (static), the call trains whole epochs that save checkpoints: each epoch as the loop of
    steps a call of that epoch alone runs (bitwise the same), in an outer loop over the
    epochs; epoch ``i``'s end state goes to slot ``slots[i]`` (``kept``: not kept), and
    ``outs`` is ``(outs, kept_states)`` (see ``held_states.py``). Never with halts."""

    def one_epoch(state, carry, idx, *, data, unroll, rows):
        data, idx = layout.gathered(data, idx)
        return scan_indexed_steps(
            step, graphdef, state, carry, data, idx, unroll=unroll,
            batch_sharding=batch_sharding, batch_rows=rows,
        )  # fmt: skip

    def run(leaves, data, indices, start, *, length, unroll, rows=None, kept=0, slots=None):
        state, held = jax.tree.unflatten(carry_def, leaves)
        carry = step.init(graphdef, (state, held))
        if slots is not None:
            idx = jax.lax.dynamic_slice_in_dim(indices, start, length, axis=0)
            epoch = functools.partial(one_epoch, data=data, unroll=unroll, rows=rows)
            state, carry, outs = _holding_epochs(epoch, state, carry, idx, kept, slots)
        elif indices is None:
            # Stacked batches in order (scan_train's, a stream chunk's): the loop scans
            # their slice, each step's batch at the loop's own counter. Nothing is copied
            # when the call trains them all, and no step reads its batch's place from an
            # array (an accelerator would wait for it every step: pure.batching).
            batches = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, length), data)
            state, carry, outs = scan_steps(
                step, graphdef, state, carry, batches, unroll=unroll,
                batch_sharding=batch_sharding,
            )  # fmt: skip
        else:
            idx = jax.lax.dynamic_slice_in_dim(indices, start, length, axis=0)
            state, carry, outs = one_epoch(state, carry, idx, data=data, unroll=unroll, rows=rows)
        held, halted = _halted(carry) if halts else (carry, None)
        leaves = jax.tree.leaves((state, held))
        if carry_shardings is not None:
            leaves = [
                constrain_sharding(x, s) for x, s in zip(leaves, carry_shardings, strict=True)
            ]
        return leaves, outs, halted

    donated = (0,) if donate else ()
    if jax.default_backend() == "cpu":  # loop-body convolutions are slow there (jax#12868)
        run = canonical_conv_dimensions(run)  # after vmap: a population's convs too
    static = ("length", "unroll", "rows", "kept")
    return jax.jit(run, static_argnames=static, donate_argnums=donated)


def _holding_epochs(
    epoch: Callable, state: Any, carry: Any, idx: Any, kept: int, slots: Any
) -> tuple[Any, Any, Any]:
    """Trains the epochs of ``idx`` (``len(slots)`` epochs of equal length, steps first),
    each by ``epoch(state, carry, its_idx)``, in an outer loop that writes each epoch's end
    state into slot ``slots[i]`` of a bank of ``kept + 1`` (the last: the spare). Returns
    ``(state, carry, (outs, kept_states))``, ``outs`` stacked along the steps axis as one
    loop would."""
    count = slots.shape[0]
    idx = idx.reshape(count, idx.shape[0] // count, *idx.shape[1:])
    leaves = jax.tree.leaves((state, carry))
    packing = BankPacking.of(leaves)

    def body(loop_carry, xs):
        state, carry, banks = loop_carry
        epoch_idx, slot = xs
        state, carry, outs = epoch(state, carry, epoch_idx)
        return (state, carry, packing.put(banks, jax.tree.leaves((state, carry)), slot)), outs

    start = (state, carry, packing.empty(leaves, kept + 1))
    (state, carry, banks), outs = jax.lax.scan(body, start, (idx, slots))
    outs = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), outs)
    return state, carry, (outs, packing.outputs(banks, kept))


def train_program(
    loss_fn: Callable,
    tx: Any,
    wrt: Any,
    has_aux: bool,
    on_nonfinite: str = "ignore",
    accumulate: int = 1,
    with_rngs: bool = False,
    update_metrics: Callable | None = None,
) -> TrainProgram:
    """The cached :class:`TrainProgram` of the step built from a loss (built on first use)."""
    key = (
        _identity_key(loss_fn),
        _identity_key(tx),
        _identity_key(wrt),
        bool(has_aux),
        on_nonfinite,
        accumulate,
        with_rngs,
        _identity_key(update_metrics),
    )

    def build() -> TrainProgram:
        # The built-in step guards itself (it sees the gradient); "stop" halts on its skip.
        step = make_train_step(
            loss_fn, tx, wrt=wrt, has_aux=has_aux, skip_nonfinite=on_nonfinite != "ignore",
            accumulate=accumulate, with_rngs=with_rngs, update_metrics=update_metrics,
        )  # fmt: skip
        named = {"loss_fn": loss_fn, "update_metrics": update_metrics}
        return TrainProgram(step, on_nonfinite, {k: f for k, f in named.items() if f})

    return _lookup(_TRAIN, key, build)


def step_program(step: Step, on_nonfinite: str = "ignore") -> TrainProgram:
    """The cached :class:`TrainProgram` of a user's :class:`~nnxscan.pure.Step`; a non-finite
    policy other than ``"ignore"`` guards it with :func:`~nnxscan.pure.skip_nonfinite`."""

    def build() -> TrainProgram:
        guarded = step if on_nonfinite == "ignore" else skip_nonfinite(step)
        return TrainProgram(guarded, on_nonfinite, {"train_step.update": step.update})

    return _lookup(_TRAIN, ("step", _identity_key(step), on_nonfinite), build)


def nnx_step_program(fn: Callable, on_nonfinite: str = "ignore") -> TrainProgram:
    """The cached :class:`TrainProgram` of a user's stateful NNX ``train_step`` function
    (see :func:`~nnxscan.pure.nnx_train_step`): ``has_loss`` is learnt when it is traced."""

    def build() -> TrainProgram:
        program: TrainProgram

        def traced(*args: Any) -> Any:
            out = fn(*args)
            program.has_loss = step_outputs(out)[2]  # a Python bool, fixed by fn's code
            if on_nonfinite != "ignore" and not program.has_loss:
                raise ValueError(
                    f"on_nonfinite={on_nonfinite!r} judges each step by its loss, but "
                    f"train_step returns none: return the loss (or a dict with 'loss')."
                )
            return out

        step = nnx_train_step(traced)
        program = TrainProgram(
            step if on_nonfinite == "ignore" else skip_nonfinite(step), on_nonfinite,
            {"train_step": fn},
        )  # fmt: skip
        return program

    return _lookup(_TRAIN, ("nnx_step", _identity_key(fn), on_nonfinite), build)


# The aux key under which outputs_program reports what a stateful fn returns.
OUTPUTS = "outputs"


def outputs_program(fn: Callable) -> TrainProgram:
    """The cached :class:`TrainProgram` of a user's stateful ``fn`` that reports whatever
    ``fn`` returns (in its aux, under ``OUTPUTS``; ``scan_train``'s stateful steps): a
    second call with the same ``fn`` reuses the compiled scan."""

    def build() -> TrainProgram:
        def reporting(*args: Any) -> dict[str, Any]:
            return {OUTPUTS: fn(*args)}

        return TrainProgram(nnx_train_step(reporting), "ignore", {"train_step": fn})

    return _lookup(_TRAIN, (OUTPUTS, _identity_key(fn)), build)


def jit_evaluate(
    metric_fn: Callable, batch_size: int, eval_mode: bool = True, batch_sharding: Any = None
) -> Callable:
    """The cached, jitted ``pure.make_evaluate(metric_fn, ...)``:
    ``evaluate(graphdef, state, data) -> dict``."""
    options = dict(batch_size=batch_size, eval_mode=eval_mode, batch_sharding=batch_sharding)
    key = (_identity_key(metric_fn), *options.items())
    return _lookup(_EVAL, key, lambda: jax.jit(make_evaluate(metric_fn, **options)))


def jit_evaluate_metrics(
    loss_fn: Callable,
    update_metrics: Callable,
    batch_size: int,
    *,
    has_aux: bool,
    with_rngs: bool,
    eval_mode: bool = True,
    batch_sharding: Any = None,
) -> Callable:
    """The cached, jitted ``pure.make_evaluate_metrics(loss_fn, update_metrics, ...)``:
    ``evaluate(graphdef, state, data) -> metrics.compute()``."""
    options = dict(
        batch_size=batch_size, has_aux=has_aux, with_rngs=with_rngs, eval_mode=eval_mode,
        batch_sharding=batch_sharding,
    )  # fmt: skip
    key = ("metrics", _identity_key(loss_fn), _identity_key(update_metrics), *options.items())
    return _lookup(
        _EVAL, key, lambda: jax.jit(make_evaluate_metrics(loss_fn, update_metrics, **options))
    )


def member_metrics(graphdef: Any, with_rngs: bool, what: str) -> Callable:
    """The jitted ``reset`` (stacked state -> stacked state with every member's metrics
    reset) or ``compute`` (-> each member's ``metrics.compute()``) of a population whose
    members carry NNX metrics."""

    def build():
        def one(state):
            node = nnx.merge(graphdef, state)
            metrics = unpack_step_node(node, with_rngs=with_rngs, with_metrics=True).metrics
            if what == "compute":
                return metrics.compute()
            metrics.reset()
            return nnx.state(node)

        return jax.jit(jax.vmap(one))

    return _lookup(_EVAL, ("member_metrics", graphdef, with_rngs, what), build)
