"""``scan_train``: one compiled scan over many batches, on the user's model and optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscan.pure.checks import abstract_batch, check_batch_size, check_leading_size
from nnxscan.shell._engine.calls import LiveState, plan_calls, run_calls
from nnxscan.shell._engine.engine import Engine
from nnxscan.shell._engine.epochs import ArrayEpochs, EpochStats
from nnxscan.shell._engine.owner import ModelOwner
from nnxscan.shell._engine.placement import Placement, device_of
from nnxscan.shell._engine.plans import Plan, resolve_plan
from nnxscan.shell._engine.programs import train_program
from nnxscan.shell._module_check import check_module

__all__ = ["scan_train"]


def scan_train(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    loss_fn: Callable[..., Any],
    batches: Any,
    *,
    batch_size: int | None = None,
    drop_remainder: bool = True,
    rngs: nnx.Rngs | None = None,
    execution: str | Plan = "auto",
    mesh: jax.sharding.Mesh | None = None,
    data_axis: str | tuple[str, ...] | None = None,
    shardings: Mapping[str, Any] | None = None,
) -> jax.Array:
    """Trains one step per batch, compiled as one scan, on the user's model and optimizer.

    ``model`` and ``optimizer`` (its optax state and ``step`` counter) are updated in place,
    exactly as ``optimizer.update(model, grads)`` in a per-step loop would. A second call with
    the same ``loss_fn``, optimizer and shapes compiles nothing.

    Args:
      model: the ``nnx.Module`` to train.
      optimizer: an ``nnx.Optimizer`` built on ``model`` (its ``tx`` and ``wrt`` are used).
      loss_fn: ``loss_fn(model, batch)`` returning a scalar; ``loss_fn(model, batch, rngs)``
        with ``rngs``.
      batches: without ``batch_size``, a pytree whose leaves share a leading steps axis:
        ``(steps, batch, ...)``. With ``batch_size``, flat data ``(examples, ...)``, cut in
        order into steps of ``batch_size`` examples.
      batch_size: cut flat data into steps of this many examples (no shuffling: the
        examples are used in their order).
      drop_remainder: with ``batch_size``, drop the ``examples % batch_size`` examples that
        do not fill a step; ``False`` trains them as one more, shorter step.
      rngs: call-time ``nnx.Rngs`` passed to ``loss_fn`` and advanced as in a plain loop.
      execution: the plan, as for :class:`Trainer` (``"auto"`` by default).
      mesh, data_axis, shardings: as for :class:`Trainer`: on ``mesh=`` (or the mesh
        ``jax.set_mesh`` put in context) every variable keeps the sharding the model gives
        it (see ``docs/scaling.md``) and each batch is split over the data axes.

    Returns:
      The per-step losses, a ``(steps,)`` device array (not synced to the host).

    Example:
      >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> losses = scan_train(model, optimizer, loss_fn, {"x": xs, "y": ys})  # (steps, B, ..)
      >>> losses = scan_train(model, optimizer, loss_fn, {"x": x, "y": y}, batch_size=32)
    """
    check_module(model)  # first: a Linen model is the cause of a missing optimizer too
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}. For a plain "
            f"optax transform use Trainer or nnxscan.pure.scan_steps."
        )
    num = check_leading_size(batches, "batches")
    if batch_size is None:
        _check_steps_axis(batches)
    else:
        batch_size = check_batch_size(batch_size, num, drop_remainder=drop_remainder)
    explicit = resolve_plan(execution)
    owner = ModelOwner(model, optimizer, rngs=rngs)
    program = train_program(loss_fn, owner.tx, owner.wrt, False, with_rngs=rngs is not None)
    placement = Placement(mesh, data_axis, rules=shardings, tx=owner.tx, wrt=owner.wrt)
    engine = Engine(
        program=program, owner=owner, placement=placement, explicit_plan=explicit,
        members=None, subject=None, loss_fn=loss_fn, has_aux=False,
    )  # fmt: skip
    placement = engine.bind()
    with placement.context():
        return _scan(engine, placement, batches, num, batch_size, drop_remainder)


def _scan(engine, placement, batches, num, batch_size, drop_remainder) -> jax.Array:
    owner, program = engine.owner, engine.program
    _, state, opt_state = owner.read()
    device = device_of(state)
    if batch_size is None:
        placement.check_batch_size(jax.tree.leaves(batches)[0].shape[1])
        batches = placement.put_chunk(batches, device)  # each step's batch split over data
        execution = engine.execution(abstract_batch(batches, drop_leading=True))
        indices = placement.put_data(np.arange(num, dtype=np.int32), device=device)
        calls = plan_calls(execution.plan, batches, indices, num)
    else:
        placement.check_batch_size(batch_size)
        batches = placement.put_data(batches, state)
        execution = engine.execution(abstract_batch(batches, leading=batch_size))
        # The same cut as an unshuffled epoch of Trainer.fit.
        epoch_calls = ArrayEpochs(
            execution.plan, batches, functools.partial(placement.put_data, device=device),
            num_examples=num, batch_size=batch_size, seeds=0, shuffle=False,
            keep_tail=not drop_remainder and num % batch_size > 0,
        )  # fmt: skip
        calls = epoch_calls(0, EpochStats())
    live = LiveState(state, opt_state, owner.writer(), placement, engine.make_runner())
    # No local keeps the owner's arrays: the first call counts who else references them.
    del state, opt_state
    outs = run_calls(program, execution, live, calls)
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs)


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
