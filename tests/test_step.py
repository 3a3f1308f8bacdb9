"""A step is a value (``nnxscan.pure.Step``), and the built-in step gives optax transforms
their extra arguments: L-BFGS against optax's documented loop, reduce_on_plateau against a
loop that passes ``value=``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import Step, init_opt_state, make_train_step, scan_steps
from nnxscan.shell import Trainer, scan_train

from conftest import MLP, assert_trees_close, xent


class Linear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (3, 1)) * 0.1)
        self.b = nnx.Param(jnp.zeros((1,)))

    def __call__(self, x):
        return x @ self.w[...] + self.b[...]


def _regression(n=64, noise=0.01):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)
    y += noise * rng.normal(size=y.shape).astype(np.float32)
    return {"x": x, "y": y}


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _pure_mse(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _optax_lbfgs_loop(params, batch, steps):
    """optax's documented L-BFGS loop (value_and_grad_from_state, value=, grad=, value_fn=)."""
    opt = optax.lbfgs()

    def f(p):
        return _pure_mse(p, batch)

    value_and_grad = optax.value_and_grad_from_state(f)

    @jax.jit
    def one(carry, _):
        params, state = carry
        value, grad = value_and_grad(params, state=state)
        updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=f)
        return (optax.apply_updates(params, updates), state), value

    (params, _), values = jax.lax.scan(one, (params, opt.init(params)), None, length=steps)
    return params, values


def _as_plain(state):
    return {"w": state["w"][...], "b": state["b"][...]}


def test_make_train_step_is_a_step_value():
    tx = optax.adam(1e-2)
    step = make_train_step(xent, tx)
    assert isinstance(step, Step) and step.has_aux is False
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    assert_trees_close(step.init(graphdef, state), init_opt_state(tx, state), exact=True)
    hash(step)  # a static argument of jax.jit, as an optax transform would be
    batch = {"x": np.ones((8, 4), np.float32), "y": np.zeros(8, np.int32)}
    opt_state = step.init(graphdef, state)

    @jax.jit
    def both(state, opt_state, batch):
        stacked = jax.tree.map(lambda v: v[None], batch)
        return (  # the step called, its update, and the step as scan_steps' argument
            step(graphdef, state, opt_state, batch),
            step.update(graphdef, state, opt_state, batch),
            scan_steps(step, graphdef, state, opt_state, stacked),
        )

    called, updated, scanned = both(state, opt_state, batch)
    # Calling the step runs its update: one computation, traced twice into one program.
    assert_trees_close(called, updated, exact=True)
    # Scanned, the step sits in other code (a slice of the stacked batch): to rounding.
    assert_trees_close(scanned[:2], updated[:2])
    assert make_train_step(xent, tx, has_aux=True).has_aux is True


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_lbfgs_trains_as_optaxs_documented_loop():
    data, steps = _regression(), 12
    step = make_train_step(mse, optax.lbfgs())
    graphdef, state = nnx.split(Linear(nnx.Rngs(0)))
    start = _as_plain(state)
    batches = jax.tree.map(lambda v: np.stack([v] * steps), data)  # full batch each step
    state, _, losses = jax.jit(scan_steps, static_argnums=0)(
        step, graphdef, state, step.init(graphdef, state), batches
    )
    want, values = _optax_lbfgs_loop(start, data, steps)
    assert_trees_close(_as_plain(state), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, values, rtol=1e-5, atol=1e-7)
    assert float(losses[-1]) < 1e-3 < float(losses[0])  # it really converged


@pytest.mark.slow
def test_lbfgs_under_trainer_and_scan_train_equals_optaxs_loop():
    data, steps = _regression(), 8
    want, _ = _optax_lbfgs_loop(_as_plain(nnx.state(Linear(nnx.Rngs(0)))), data, steps)

    model = Linear(nnx.Rngs(0))
    trainer = Trainer(model, optax.lbfgs(), mse)
    trainer.fit(data, epochs=steps, batch_size=len(data["x"]), shuffle=False, progress=False)
    assert_trees_close(_as_plain(nnx.state(model)), want, rtol=1e-5, atol=1e-6)

    model = Linear(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.lbfgs(), wrt=nnx.Param)
    batches = jax.tree.map(lambda v: np.stack([v] * steps), data)
    scan_train(model, optimizer, mse, batches)
    assert_trees_close(_as_plain(nnx.state(model)), want, rtol=1e-5, atol=1e-6)
    assert int(optimizer.step[...]) == steps


def test_reduce_on_plateau_gets_the_loss_as_a_loop_passing_value_does():
    data, steps = _regression(noise=0.5), 40  # noisy batches: the loss stops improving
    tx = optax.chain(
        optax.sgd(0.2),
        optax.contrib.reduce_on_plateau(patience=2, cooldown=0, factor=0.5, rtol=1e-4, atol=0.0),
    )
    step = make_train_step(mse, tx)
    graphdef, state = nnx.split(Linear(nnx.Rngs(0)))
    params = _as_plain(state)
    batches = jax.tree.map(
        lambda v: np.stack([v[i % 4 * 16 : i % 4 * 16 + 16] for i in range(steps)]), data
    )
    state, opt_state, losses = jax.jit(scan_steps, static_argnums=0)(
        step, graphdef, state, step.init(graphdef, state), batches
    )

    # The reference: optax's own loop on plain params, passing value= each step.
    @jax.jit
    def ref_step(params, ref_state, batch):
        value, grad = jax.value_and_grad(_pure_mse)(params, batch)
        updates, ref_state = tx.update(grad, ref_state, params, value=value)
        return optax.apply_updates(params, updates), ref_state, value

    ref_state, values = tx.init(params), []
    for i in range(steps):
        params, ref_state, value = ref_step(
            params, ref_state, jax.tree.map(lambda v, i=i: v[i], batches)
        )
        values.append(value)
    assert_trees_close(_as_plain(state), params, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(losses, values, rtol=1e-6)
    scale = float(opt_state[1].scale)
    assert scale == float(ref_state[1].scale) and scale < 1.0  # the plateau was reached


def test_a_frozen_member_stays_put_when_its_step_updates_the_merged_module_in_place(data):
    """``nnx.merge`` shares the given state's Variables; a step that ``nnx.update``s the
    merged module writes into them. A frozen member must still keep its old state."""
    from nnxscan.pure import MembersState, scan_indexed_steps, stack_states, vmap_members

    tx = optax.sgd(0.5)

    def update(graphdef, state, opt_state, batch):
        model = nnx.merge(graphdef, state)
        grads = nnx.grad(xent)(model, batch)
        nnx.update(
            model, jax.tree.map(lambda p, g: p - 0.5 * g, nnx.state(model, nnx.Param), grads)
        )
        return nnx.state(model), opt_state, xent(model, batch)

    step = Step(lambda g, s: init_opt_state(tx, s), update)
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    states = stack_states([state, state])
    indices = jnp.broadcast_to(jnp.arange(16).reshape(2, 1, 8), (2, 2, 8))  # (steps, N, batch)
    frozen = MembersState((), jnp.array([True, False]))
    run = jax.jit(lambda s: scan_indexed_steps(
        vmap_members(step), graphdef, s, frozen, data, indices))  # fmt: skip
    new_states, _, _ = run(states)
    for old, new in zip(jax.tree.leaves(states), jax.tree.leaves(new_states), strict=True):
        np.testing.assert_array_equal(new[1], old[1])  # frozen: unchanged
    assert any(not np.array_equal(n[0], o[0]) for o, n in
               zip(jax.tree.leaves(states), jax.tree.leaves(new_states), strict=True))  # fmt: skip
