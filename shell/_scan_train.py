"""``scan_train``: one compiled scan over many batches, on the user's model and optimizer.

Three kinds of step run in that scan: the one built from a ``loss_fn`` (the default), a
stateful NNX ``train_step`` function that mutates its objects (Flax's tutorial style), and a
pure :class:`~nnxscan.pure.Step` whose ``opt_state`` the caller holds between calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscan.pure import Step
from nnxscan.pure.checks import abstract_batch, check_batch_size, check_leading_size
from nnxscan.shell._construction import (
    ScanTrainArguments,
    construction_options,
    loss_options_given,
    step_kind,
)
from nnxscan.shell._engine.calls import LiveState, plan_calls, run_calls
from nnxscan.shell._engine.engine import Engine
from nnxscan.shell._engine.epochs import ArrayEpochs
from nnxscan.shell._engine.kept_setup import (
    batch_key,
    call_key,
    forget,
    keep_after_call,
    kept,
)
from nnxscan.shell._engine.owner import ModelOwner
from nnxscan.shell._engine.placement import Placement, device_of
from nnxscan.shell._engine.plans import resolve_plan
from nnxscan.shell._engine.programs import (
    OUTPUTS,
    TrainProgram,
    outputs_program,
    step_program,
    train_program,
)
from nnxscan.shell._engine.schedule import one_epoch
from nnxscan.shell._module_check import check_module
from nnxscan.shell._tracebacks import at_the_call
from nnxscan.shell._user_steps import check_loss_fn, refuse_loss_options, user_step_owner


@at_the_call
def scan_train(
    model: nnx.Module,
    optimizer: nnx.Optimizer | None = None,
    loss_fn: Callable[..., Any] | None = None,
    batches: Any = None,
    **options: Unpack[ScanTrainArguments],
) -> Any:
    """Trains one step per batch, compiled as one scan, on the user's model and optimizer.

    The step is one of three:

    - ``scan_train(model, optimizer, loss_fn, batches)``: the step built from the loss.
      ``model`` and ``optimizer`` (its optax state and ``step`` counter) are updated in
      place, exactly as ``optimizer.update(model, grads)`` in a per-step loop would.
      Returns the per-step losses.
    - ``scan_train(model, optimizer, batches=xs, train_step=fn, extras=(...))``: your own
      stateful NNX step, unchanged: ``fn(model, optimizer, *extras, batch)`` (without an
      optimizer, ``fn(model, *extras, batch)``) mutates its objects (``nnx.value_and_grad``
      then ``optimizer.update(model, grads)``, ``metrics.update(...)``, ``nnx.Rngs``
      draws), as in Flax's tutorials; it may be ``@nnx.jit``-decorated. Every object is
      written back after the call. Returns what ``fn`` returns, stacked: each leaf gains a
      leading steps axis (``None`` when ``fn`` returns nothing).
    - ``scan_train(model, batches=xs, train_step=S, opt_state=...)``: a pure
      :class:`~nnxscan.pure.Step`. The model is written back; the step's ``opt_state``
      (whatever ``S`` carries besides the model) is NOT kept anywhere by nnxscan: it is
      passed in and handed back. ``opt_state=None`` starts from ``S.init(graphdef,
      state)``; pass the returned one to the next call to go on. Returns ``(outs,
      opt_state)``, where ``outs`` is ``S.update``'s loss (or ``(loss, aux)``) per step.
      The ``opt_state`` you pass is never donated: it stays valid after the call.

    A second call with the same step (the same ``loss_fn`` and optimizer, the same ``fn``
    or ``S`` object) and shapes compiles nothing. Bad arguments raise before anything
    compiles, and a call that raises leaves every object as it was before it.

    Args:
      model: the ``nnx.Module`` to train.
      optimizer: an ``nnx.Optimizer`` built on ``model`` (its ``tx`` and ``wrt`` are used);
        with ``train_step=fn``, the optimizer ``fn`` receives (or None); none with a Step.
      loss_fn: ``loss_fn(model, batch)`` returning a scalar; ``loss_fn(model, batch, rngs)``
        with ``rngs``. Not with ``train_step``.
      batches: without ``batch_size``, a pytree whose leaves share a leading steps axis:
        ``(steps, batch, ...)``. With ``batch_size``, flat data ``(examples, ...)``, cut in
        order into steps of ``batch_size`` examples.
      train_step: your own step instead of ``loss_fn``: a stateful NNX function (see
        above) or a :class:`~nnxscan.pure.Step`.
      extras: with a stateful ``train_step``, the further NNX objects it takes and mutates
        (``nnx.Metric``, ``nnx.Rngs``, a teacher module...), passed after the optimizer.
      opt_state: with a Step, the state to start from (``None``: ``S.init``'s); it must
        have the structure, shapes and dtypes ``S.init`` gives.
      batch_size: cut flat data into steps of this many examples (no shuffling: the
        examples are used in their order).
      drop_remainder: with ``batch_size``, drop the ``examples % batch_size`` examples that
        do not fill a step; ``False`` trains them as one more, shorter step.
      rngs: call-time ``nnx.Rngs`` passed to ``loss_fn`` and advanced as in a plain loop
        (a ``train_step`` takes its ``nnx.Rngs`` in ``extras``).
      execution: the plan, as for :class:`Trainer` (``"auto"`` by default).
      mesh, data_axis, shardings: as for :class:`Trainer`: on ``mesh=`` (or the mesh
        ``jax.set_mesh`` put in context) every variable keeps the sharding the model gives
        it (see ``docs/scaling.md``) and each batch is split over the data axes.

    Returns:
      With ``loss_fn``: the per-step losses, a ``(steps,)`` device array (not synced to the
      host). With a stateful ``train_step``: ``fn``'s outputs stacked along a leading
      steps axis. With a Step: ``(outs, opt_state)``.

    Example:
      >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> losses = scan_train(model, optimizer, loss_fn, {"x": xs, "y": ys})  # (steps, B, ..)
      >>> losses = scan_train(model, optimizer, loss_fn, {"x": x, "y": y}, batch_size=32)
      >>> def train_step(model, optimizer, batch):  # your own step, as written for Flax
      ...     loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> losses = scan_train(model, optimizer, batches={"x": xs, "y": ys}, train_step=train_step)
      >>> step = make_train_step(loss_fn, optax.adam(1e-3))  # a pure Step
      >>> losses, opt_state = scan_train(model, batches=stacked, train_step=step)
      >>> more, opt_state = scan_train(model, batches=stacked, train_step=step, opt_state=opt_state)
    """
    check_module(model)  # first: a Linen model is the cause of a missing optimizer too
    o = construction_options("scan_train", options)
    train_step, opt_state, rngs = o["train_step"], o["opt_state"], o["rngs"]
    batch_size, drop_remainder, extras = o["batch_size"], o["drop_remainder"], o["extras"]
    kind = step_kind(train_step)
    if batches is None:
        raise TypeError(
            "scan_train needs batches: scan_train(model, optimizer, loss_fn, batches), or "
            "scan_train(model, optimizer, batches=xs, train_step=fn)."
        )
    if kind == "loss":
        _check_builtin(optimizer, loss_fn, extras)
        check_loss_fn(loss_fn, model, rngs)
    if opt_state is not None and kind != "pure":
        raise TypeError(
            "opt_state= goes with a pure Step (train_step=step); an nnx.Optimizer and a "
            "stateful train_step keep every state in their objects, updated in place."
        )
    num = check_leading_size(batches, "batches")
    if batch_size is None:
        _check_steps_axis(batches)
    else:
        batch_size = check_batch_size(batch_size, num, drop_remainder=drop_remainder)
    explicit = resolve_plan(o["execution"])
    keep_key = None
    if kind == "loss" and batch_size is None:
        # The same objects, loss and options as a call before: its set-up is reused.
        keep_key = call_key(loss_fn, rngs, explicit, o["mesh"], o["data_axis"], o["shardings"])
        outs = _kept_call(keep_key, model, optimizer, rngs, batches, num)
        if outs is not None:
            return outs
    if kind != "loss":  # after the data's checks: a Step's init runs here
        owner, program, finish = _user_step(model, optimizer, loss_fn, kind, o)
    else:
        owner = ModelOwner(model, optimizer, rngs=rngs, hold_reads=True)
        program = train_program(loss_fn, owner.tx, owner.wrt, False, with_rngs=rngs is not None)
        finish = _losses_only
    placement = Placement(
        o["mesh"], o["data_axis"], rules=o["shardings"], tx=owner.tx, wrt=owner.wrt
    )
    engine = Engine(
        program=program, owner=owner, placement=placement, explicit_plan=explicit,
        trainer=None, loss_fn=loss_fn,
    )  # fmt: skip
    placement = engine.bind()
    # One walk of the objects serves set-up's reads (released before the first call).
    with placement.context(), owner.reads_held():
        try:
            outs, kept_parts = _scan(engine, placement, batches, num, batch_size, drop_remainder)
        except BaseException as error:
            if optimizer is not None:
                forget(optimizer)
            if finish is _outputs_and_opt_state and owner.step > 0:  # some steps trained
                _keep_opt_state(error, owner)
            raise
    if keep_key is not None:
        keep_after_call(keep_key, owner, program, placement, kept_parts)
    return finish(outs, owner)


def _kept_call(key: tuple, model, optimizer, rngs, batches: Any, num: int) -> Any:
    """The call on the set-up a call before kept (``kept_setup.py``), or None when there is
    none to reuse (the objects changed, a new batch shape): then the full set-up runs."""
    setup = kept(key, optimizer)
    if setup is None:
        return None
    variables = setup.variables(model, optimizer, rngs)
    if variables is None:
        return None
    with setup.placement.context():
        placed = setup.placement.put_chunk(batches, setup.device)
        execution = setup.executions.get(batch_key(placed))
        if execution is None or execution.donate != setup.donate:
            return None
        try:
            outs = setup.run(variables, optimizer, execution, placed, num)
        except BaseException:
            forget(optimizer)
            raise
    return _stacked(outs)


def _stacked(outs: list) -> Any:
    """The calls' outputs as one: each leaf stacked over every step."""
    if len(outs) == 1:
        return outs[0]
    return jax.tree.map(lambda *calls: jnp.concatenate(calls), *outs)


def _scan(engine, placement, batches, num, batch_size, drop_remainder) -> tuple[Any, tuple]:
    """Runs the calls; returns the step's outputs, each leaf stacked over every step, and
    what a kept set-up takes (``kept_setup.keep_after_call``)."""
    owner, program = engine.owner, engine.program
    _, state, opt_state = owner.read()
    device = device_of(state)
    if batch_size is None:
        placement.check_batch_size(jax.tree.leaves(batches)[0].shape[1])
        batches = placement.put_chunk(batches, device)  # each step's batch split over data
        execution = engine.execution(abstract_batch(batches, drop_leading=True), owner.layout)
        calls = plan_calls(execution.plan, batches, None, num)  # the stacked batches in order
    else:
        placement.check_batch_size(batch_size)
        batches = placement.put_data(batches, state)
        execution = engine.execution(abstract_batch(batches, leading=batch_size), owner.layout)
        # The same cut as an unshuffled epoch of Trainer.fit.
        epoch_calls = ArrayEpochs(
            batches, functools.partial(placement.put_data, device=device),
            num_examples=num, batch_size=batch_size, seeds=(0,), shuffle=False,
            keep_tail=not drop_remainder and num % batch_size > 0,
        )  # fmt: skip
        calls = epoch_calls(one_epoch(epoch_calls, execution.plan))
    live = LiveState(
        state, opt_state, owner.make_write_back(), placement, engine.make_runner(owner.layout)
    )
    owner.release_reads()
    # No local keeps the owner's arrays: the first call counts who else references them.
    del state, opt_state
    outs = run_calls(program, execution, live, calls)
    return _stacked(outs), (live, device, execution, batches)


def _check_steps_axis(batches: Any) -> None:
    """Stacked batches need a steps axis AND a batch axis: flat data is a likely mistake."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(batches):
        if np.ndim(leaf) < 2:
            raise ValueError(
                f"batches leaf {jax.tree_util.keystr(path)} has shape {tuple(np.shape(leaf))}, "
                f"but scan_train expects stacked batches (steps, batch, ...): every leaf needs "
                f"a steps axis and a batch axis. For flat data (examples, ...), pass "
                f"batch_size=B to cut it into steps of B examples."
            )


# -- the three kinds of step --------------------------------------------------------------


def _check_builtin(optimizer: Any, loss_fn: Any, extras: Sequence[Any]) -> None:
    """The step built from a loss needs an nnx.Optimizer and a loss, and nothing else."""
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}. For a plain "
            f"optax transform use Trainer or nnxscan.pure.scan_steps."
        )
    if loss_fn is None:
        raise TypeError(
            "scan_train needs a loss_fn, scan_train(model, optimizer, loss_fn, batches), or "
            "your own step: scan_train(model, optimizer, batches=xs, train_step=fn) with a "
            "stateful NNX fn(model, optimizer, batch), or scan_train(model, batches=xs, "
            "train_step=step) with a nnxscan.pure.Step."
        )
    if extras:
        raise TypeError(
            "extras= goes with a stateful train_step=fn (the NNX objects it mutates); a "
            "loss_fn takes call-time rngs= instead."
        )


def _user_step(
    model: nnx.Module, optimizer: Any, loss_fn: Any, kind: str, options: dict[str, Any]
) -> tuple[ModelOwner, TrainProgram, Callable[[Any, ModelOwner], Any]]:
    """The owner, program and result of ``scan_train(..., train_step=...)`` (a step of
    ``kind``; ``options``: scan_train's, checked), after every check (nothing is read from
    or written to the user's objects before they pass)."""
    refuse_loss_options(["loss_fn"] * (loss_fn is not None) + loss_options_given(options))
    train_step, opt_state = options["train_step"], options["opt_state"]
    # The owner's opt_state is the caller's, when given, not init's.
    init = None if opt_state is None else _given(train_step, model, opt_state)
    owner = user_step_owner(
        model, optimizer, train_step, tuple(options["extras"]), kind=kind, init=init,
        stateful_front="scan_train", pure_call="scan_train(model, batches=xs, train_step=step)",
    )  # fmt: skip
    if kind == "pure":
        return owner, step_program(train_step), _outputs_and_opt_state
    return owner, outputs_program(train_step), _stateful_outputs


def _given(step: Step, model: nnx.Module, opt_state: Any) -> Callable[..., Any]:
    """An ``init`` that returns the caller's ``opt_state``, once checked against the structure,
    shapes and dtypes ``step.init`` gives (traced only, nothing computed)."""
    graphdef, state = nnx.split(model)
    expected = jax.eval_shape(lambda state: step.init(graphdef, state), state)
    if jax.tree.structure(opt_state) != jax.tree.structure(expected):
        got, want = _paths(opt_state), _paths(expected)
        first = next((p for p in got if p not in want), None) or next(
            (p for p in want if p not in got), "its tree's node types"
        )
        raise ValueError(
            f"opt_state does not have the structure train_step.init gives: a "
            f"{type(opt_state).__name__} of {len(got)} leaves where init gives a "
            f"{type(expected).__name__} of {len(want)}; they differ at {first}. Pass the "
            f"opt_state a previous scan_train with this step returned, or None to start "
            f"from train_step.init."
        )
    paths = jax.tree_util.tree_leaves_with_path(opt_state)
    for (path, leaf), want in zip(paths, jax.tree.leaves(expected), strict=True):
        got = (tuple(np.shape(leaf)), jnp.result_type(leaf))
        if got != (want.shape, want.dtype):
            raise ValueError(
                f"opt_state leaf {jax.tree_util.keystr(path)} has shape {got[0]} and dtype "
                f"{got[1]}, but train_step.init gives {want.shape} {want.dtype}. Pass the "
                f"opt_state a previous scan_train with this step returned, or None."
            )
    fresh = jax.tree.map(lambda x: jax.device_put(x, may_alias=False), opt_state)
    return lambda graphdef, state: fresh


def _paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _keep_opt_state(error: BaseException, owner: ModelOwner) -> None:
    """A Step's call stopped after some compiled calls (Ctrl-C, a failing call): the model
    holds the last completed state, and the exception the opt_state that goes with it."""
    try:
        error.opt_state = owner.opt_state  # type: ignore[attr-defined]
    except AttributeError:  # an exception type with __slots__: nothing to attach to
        return
    error.add_note(
        "scan_train: the model holds the state of the last completed compiled call; the "
        "step's opt_state that goes with it is this exception's .opt_state."
    )


def _losses_only(outs: Any, owner: ModelOwner) -> Any:
    return outs


def _stateful_outputs(outs: Any, owner: ModelOwner) -> Any:
    _, aux = outs  # the NaN placeholder losses of a step that reports no loss, then fn's
    return aux[OUTPUTS]


def _outputs_and_opt_state(outs: Any, owner: ModelOwner) -> tuple[Any, Any]:
    return outs, owner.opt_state
