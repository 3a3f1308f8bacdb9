"""Non-finite guard and gradient accumulation against hand-written references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import (
    HaltState,
    halt_after_nonfinite,
    init_opt_state,
    make_train_step,
    scan_steps,
)

from conftest import MLP, BNDropout, assert_trees_close, make_data, reference_loop, xent

TX = optax.adam(1e-2)
STEPS, BS = 6, 8
BAD = 2  # the step whose batch holds a NaN


def stacked(data, steps=STEPS, bs=BS):
    return {k: v[: steps * bs].reshape(steps, bs, *v.shape[1:]) for k, v in data.items()}


def unstack(batches, keep=lambda i: True):
    return [{k: v[i] for k, v in batches.items()} for i in range(len(batches["x"])) if keep(i)]


@pytest.fixture(scope="module")
def poisoned():
    batches = stacked(make_data())
    batches["x"] = batches["x"].copy()
    batches["x"][BAD, 0, 0] = np.nan
    return batches


scan_jit = jax.jit(scan_steps, static_argnums=0)


def test_skip_nonfinite_skips_exactly_the_bad_step(poisoned):
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    ref_losses = reference_loop(ref, ref_opt, xent, unstack(poisoned, lambda i: i != BAD))

    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    step = make_train_step(xent, TX, skip_nonfinite=True)
    state, opt_state, losses = scan_jit(step, graphdef, state, init_opt_state(TX, state), poisoned)
    assert np.isnan(losses[BAD])
    np.testing.assert_allclose(np.delete(losses, BAD), np.array(ref_losses), rtol=1e-5)
    assert_trees_close(state, nnx.state(ref))
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(ref_opt.opt_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)  # adam's count skipped too


def test_without_the_guard_a_nan_poisons_everything(poisoned):
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    step = make_train_step(xent, TX)
    state, _, losses = scan_jit(step, graphdef, state, init_opt_state(TX, state), poisoned)
    assert np.isnan(losses[BAD:]).all()  # the reference point the guard is measured against


def test_skip_keeps_batch_statistics_finite_and_rng_moving(poisoned):
    graphdef, state = nnx.split(BNDropout(rngs=nnx.Rngs(0)))
    step = make_train_step(xent, TX, skip_nonfinite=True)
    state, _, losses = scan_jit(step, graphdef, state, init_opt_state(TX, state), poisoned)
    assert np.isnan(losses[BAD]) and np.isfinite(np.delete(losses, BAD)).all()
    assert (
        np.isfinite(state["bn"]["mean"][...]).all() and np.isfinite(state["bn"]["var"][...]).all()
    )
    assert int(state["drop"]["rngs"]["count"][...]) == STEPS


@pytest.mark.parametrize("n", [2, 4])
def test_accumulation_equals_one_step_on_the_whole_batch(n):
    batches = stacked(make_data(), steps=4, bs=16)
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    ref_losses = reference_loop(ref, ref_opt, xent, unstack(batches))

    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    step = make_train_step(xent, TX, accumulate=n)
    state, _, losses = scan_jit(step, graphdef, state, init_opt_state(TX, state), batches)
    np.testing.assert_allclose(losses, np.array(ref_losses), rtol=1e-5, atol=1e-6)
    assert_trees_close(state, nnx.state(ref), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_a_bad_micro_batch_is_dropped_and_never_poisons_later_steps():
    n, mb = 4, 4  # 4 micro-batches of 4 per step
    batches = stacked(make_data(), steps=4, bs=n * mb)
    batches["x"] = batches["x"].copy()
    batches["x"][1, mb + 1, 0] = np.inf  # step 1, micro-batch 1

    # Reference: by hand, average the gradients of the finite micro-batches, one adam update.
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    ref_losses = []
    for i, batch in enumerate(unstack(batches)):
        micro = [{k: v[j * mb : (j + 1) * mb] for k, v in batch.items()} for j in range(n)]
        if i == 1:
            micro = micro[:1] + micro[2:]
        pairs = [nnx.value_and_grad(xent)(ref, b) for b in micro]
        grads = jax.tree.map(lambda *g: sum(g) / len(g), *[g for _, g in pairs])
        ref_opt.update(ref, grads)
        ref_losses.append(np.mean([float(v) for v, _ in pairs]))

    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    step = make_train_step(xent, TX, accumulate=n, skip_nonfinite=True)
    state, _, losses = scan_jit(step, graphdef, state, init_opt_state(TX, state), batches)
    np.testing.assert_allclose(losses, np.array(ref_losses), rtol=1e-5, atol=1e-6)
    assert_trees_close(state, nnx.state(ref), rtol=1e-4, atol=1e-6)


def test_multisteps_over_apply_if_finite_is_the_trap_we_avoid():
    """optax.MultiSteps(apply_if_finite(...)) keeps the NaN: updates stop for good."""
    params = {"w": jnp.ones(2)}
    tx = optax.MultiSteps(optax.apply_if_finite(optax.sgd(0.1), 10), every_k_schedule=2)
    opt_state = tx.init(params)
    for g in [jnp.array([jnp.nan, 1.0])] + [jnp.ones(2)] * 5:
        updates, opt_state = tx.update({"w": g}, opt_state, params)
        params = optax.apply_updates(params, updates)
    # Six micro-batches, five of them fine: yet not one update was applied.
    np.testing.assert_array_equal(params["w"], [1.0, 1.0])
    assert np.isnan(opt_state.acc_grads["w"][0])


def test_accumulate_needs_a_divisible_batch():
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    step = make_train_step(xent, TX, accumulate=3)
    batch = {k: v[:8] for k, v in make_data().items()}
    with pytest.raises(ValueError, match=r"accumulate=3.*\['x'\].*\(8, 4\)"):
        step(graphdef, state, init_opt_state(TX, state), batch)
    with pytest.raises(ValueError, match="accumulate"):
        make_train_step(xent, TX, accumulate=0)


def test_halt_after_nonfinite_stops_before_the_bad_step(poisoned):
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    reference_loop(ref, ref_opt, xent, unstack(poisoned)[:BAD])

    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    halting = halt_after_nonfinite(make_train_step(xent, TX, skip_nonfinite=True))
    carry = HaltState(init_opt_state(TX, state), jnp.bool_(False))
    state, halt, losses = scan_jit(halting, graphdef, state, carry, poisoned)
    assert bool(halt.halted) and np.isnan(losses[BAD:]).all() and np.isfinite(losses[:BAD]).all()
    assert_trees_close(state, nnx.state(ref))
