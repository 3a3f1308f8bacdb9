"""``scan_train`` called again on the same objects reuses the last call's set-up
(shell/_engine/kept_setup.py): the same results as a call set up afresh, whatever the user
did to the objects in between, and nothing of theirs kept alive.

The reference is ``scan_steps`` (the pure core's scan of the same step: the same loop body,
so bitwise, see conftest) run from a copy of the objects' state taken before each call, and
the set-up made afresh (the kept one forgotten) for the same calls.
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnxscan.shell._engine.kept_setup as kept_setup
import nnxscan.shell._scan_train as scan_train_module
from nnxscan.adapters.nnx_optimizer import optax_state_from_optimizer
from nnxscan.pure import make_train_step, scan_steps
from nnxscan.shell import scan_train

from conftest import MLP, assert_trees_close, make_data, state_arrays, xent

TX = optax.adam(1e-2)
STEPS, BS = 4, 8


def _batches(seed: int) -> dict:
    data = make_data(n=STEPS * BS, seed=seed)
    return jax.tree.map(lambda a: a.reshape(STEPS, BS, *a.shape[1:]), data)


@pytest.fixture
def reused(monkeypatch):
    """``reused()``: how many scan_train calls since the test began ran on a kept set-up."""
    hits = []
    real = scan_train_module._kept_call

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        hits.append(out is not None)
        return out

    monkeypatch.setattr(scan_train_module, "_kept_call", counted)
    return lambda: sum(hits)


def _by_hand(model, optimizer, batches):
    """The pure core from copies of the objects' current state: (losses, state, opt_state)."""
    step = make_train_step(xent, optimizer.tx)
    graphdef, state = nnx.split(model)
    opt_state = optax_state_from_optimizer(optimizer, nnx.state(model, nnx.Param))
    state, opt_state = jax.tree.map(jnp.copy, (state, opt_state))
    run = jax.jit(lambda s, o, b: scan_steps(step, graphdef, s, o, b))
    state, opt_state, losses = run(state, opt_state, batches)
    return losses, state, opt_state


def _is_var(x):
    return isinstance(x, nnx.Variable)


def _objects():
    model = MLP(rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def test_calls_on_a_kept_set_up_train_what_the_pure_core_trains(reused):
    model, optimizer = _objects()
    for call in range(3):
        batches = _batches(call)
        want_losses, want_state, _ = _by_hand(model, optimizer, batches)
        losses = scan_train(model, optimizer, xent, batches)
        np.testing.assert_array_equal(losses, want_losses)
        assert_trees_close(nnx.state(model), want_state, exact=True)
    assert reused() == 2  # the first call set up; the next two reused it
    assert int(optimizer.step.get_value()) == 3 * STEPS


def test_what_the_user_changes_between_calls_is_what_the_next_call_trains(reused):
    model, optimizer = _objects()
    scan_train(model, optimizer, xent, _batches(0))
    # New weights put in (the same shapes and placement), and the step counter moved.
    other, _ = _objects()
    device = jax.devices()[0]  # committed, as a compiled call's outputs are
    nnx.update(model, jax.tree.map(lambda x: jax.device_put(x * 0.5, device), nnx.state(other)))
    optimizer.step.set_value(jnp.asarray(100, jnp.uint32))
    kernel = model.l1.kernel.get_value()  # held by the user across the call
    held = np.array(kernel)
    want_losses, want_state, _ = _by_hand(model, optimizer, _batches(1))
    losses = scan_train(model, optimizer, xent, _batches(1))
    assert reused() == 1
    np.testing.assert_array_equal(losses, want_losses)
    assert_trees_close(nnx.state(model), want_state, exact=True)
    assert int(optimizer.step.get_value()) == 100 + STEPS
    np.testing.assert_array_equal(np.asarray(kernel), held)  # not donated away


def test_a_changed_graph_or_batch_shape_sets_up_anew(reused):
    model, optimizer = _objects()
    scan_train(model, optimizer, xent, _batches(0))
    half = jax.tree.map(lambda a: a[:, : BS // 2], _batches(1))  # another batch shape
    want_losses, want_state, _ = _by_hand(model, optimizer, half)
    np.testing.assert_array_equal(scan_train(model, optimizer, xent, half), want_losses)
    assert_trees_close(nnx.state(model), want_state, exact=True)
    assert reused() == 0
    # A new layer object in place of the old one: another graph (the optimizer's state
    # still fits it), so the kept set-up does not hold.
    model.l2 = nnx.Linear(8, 3, rngs=nnx.Rngs(5))
    want_losses, want_state, _ = _by_hand(model, optimizer, _batches(2))
    np.testing.assert_array_equal(scan_train(model, optimizer, xent, _batches(2)), want_losses)
    assert_trees_close(nnx.state(model), want_state, exact=True)
    assert reused() == 0

    # Another loss: set up anew too.
    def other_loss(model, batch):
        return xent(model, batch) * 2.0

    scan_train(model, optimizer, other_loss, _batches(3))
    assert reused() == 0
    scan_train(model, optimizer, other_loss, _batches(3))
    assert reused() == 1


def test_a_kept_set_up_keeps_no_model_alive():
    model, optimizer = _objects()
    for call in range(2):
        scan_train(model, optimizer, xent, _batches(call))
    kernel = weakref.ref(model.l1)
    opt = weakref.ref(optimizer)
    arrays = [
        weakref.ref(v.get_raw_value()) for v in jax.tree.leaves(nnx.state(model), is_leaf=_is_var)
    ]
    assert kept_setup._KEPT
    del model, optimizer
    gc.collect()
    assert kernel() is None and opt() is None
    assert all(a() is None for a in arrays)  # their device buffers are freed


def test_a_failed_call_leaves_the_objects_and_the_next_call_sets_up(reused):
    model, optimizer = _objects()
    scan_train(model, optimizer, xent, _batches(0))
    before = state_arrays(model)

    def failing(model, batch):
        raise RuntimeError("in the loss")

    with pytest.raises(RuntimeError, match="in the loss"):
        scan_train(model, optimizer, failing, _batches(1))
    assert_trees_close(state_arrays(model), before, exact=True)
    want_losses, _, _ = _by_hand(model, optimizer, _batches(1))
    np.testing.assert_array_equal(scan_train(model, optimizer, xent, _batches(1)), want_losses)
