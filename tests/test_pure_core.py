"""The pure core against the plain per-step NNX loop and hand-written JAX loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import (
    init_opt_state,
    make_epoch,
    make_eval_step,
    make_evaluate,
    make_train_step,
    scan_steps,
)

from conftest import (
    MLP,
    BNDropout,
    assert_trees_close,
    make_data,
    reference_loop,
    state_arrays,
    xent,
    xent_aux,
)

TX = optax.adam(1e-2)
STEPS, BATCH = 6, 8


def stacked(data, steps=STEPS, batch=BATCH):
    return {k: v[: steps * batch].reshape(steps, batch, *v.shape[1:]) for k, v in data.items()}


def unstack(batches):
    steps = len(batches["x"])
    return [{k: v[i] for k, v in batches.items()} for i in range(steps)]


scan_jit = jax.jit(scan_steps, static_argnums=0)


@pytest.mark.parametrize("model_cls", [MLP, BNDropout])
def test_scan_steps_equals_per_step_nnx_loop(model_cls, data):
    batches = stacked(data)
    ref = model_cls(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    ref_losses = reference_loop(ref, ref_opt, xent, unstack(batches))

    model = model_cls(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    step = make_train_step(xent, TX)
    state, opt_state, losses = scan_jit(step, graphdef, state, init_opt_state(TX, state), batches)

    np.testing.assert_allclose(losses, np.array(ref_losses), rtol=1e-5, atol=1e-6)
    # Whole state: params, batch statistics, RNG counts and keys.
    assert_trees_close(state, nnx.state(ref))
    # optax state equals the nnx.Optimizer's, leaf by leaf.
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(ref_opt.opt_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_dropout_draws_a_new_mask_every_step():
    model = BNDropout(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    step = make_train_step(xent, optax.sgd(0.0))  # no learning: only the mask changes
    same = stacked(make_data(8), steps=1)
    batches = jax.tree.map(lambda x: jnp.concatenate([x, x]), same)
    state, _, losses = scan_jit(
        step, graphdef, state, init_opt_state(optax.sgd(0.0), state), batches
    )
    assert losses[0] != losses[1]
    assert int(state["drop"]["rngs"]["count"][...]) == 2


def test_subset_wrt_trains_only_the_selection(data):
    wrt = nnx.All(nnx.Param, nnx.PathContains("l2"))
    batches = stacked(data)
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=wrt)
    ref_losses = reference_loop(ref, ref_opt, xent, unstack(batches))

    model = MLP(rngs=nnx.Rngs(0))
    before = state_arrays(model.l1)
    graphdef, state = nnx.split(model)
    step = make_train_step(xent, TX, wrt=wrt)
    state, _, losses = scan_jit(step, graphdef, state, init_opt_state(TX, state, wrt), batches)
    np.testing.assert_allclose(losses, np.array(ref_losses), rtol=1e-5, atol=1e-6)
    nnx.update(model, state)
    for a, b in zip(before, state_arrays(model.l1), strict=True):
        np.testing.assert_array_equal(a, b)
    assert_trees_close(model, ref)


def test_has_aux_returns_loss_and_aux(data):
    model = MLP(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    step = jax.jit(make_train_step(xent_aux, TX, has_aux=True).update)
    batch = {k: v[:BATCH] for k, v in data.items()}
    _, _, (loss, aux) = step(graphdef, state, init_opt_state(TX, state), batch)
    np.testing.assert_allclose(loss, xent(model, batch), rtol=1e-6)
    np.testing.assert_allclose(aux["acc"], xent_aux(model, batch)[1]["acc"])


def test_step_inside_user_fori_loop_equals_scan_steps(data):
    batches = jax.tree.map(jnp.asarray, stacked(data))
    model = BNDropout(rngs=nnx.Rngs(1))
    graphdef, state0 = nnx.split(model)
    step = make_train_step(xent, TX)
    opt0 = init_opt_state(TX, state0)

    @jax.jit
    def fori(state, opt_state):
        def body(i, carry):
            batch = jax.tree.map(lambda x: x[i], batches)
            s, o, _ = step(graphdef, *carry, batch)
            return s, o

        return jax.lax.fori_loop(0, STEPS, body, (state, opt_state))

    s_fori, _ = fori(state0, opt0)
    s_scan, _, _ = scan_jit(step, graphdef, state0, opt0, batches)
    assert_trees_close(s_fori, s_scan)


@pytest.mark.slow
def test_vmap_over_stacked_models_equals_separate_runs(data):
    batches = stacked(data)
    step = make_train_step(xent, TX)
    splits = [nnx.split(BNDropout(rngs=nnx.Rngs(seed))) for seed in range(4)]
    graphdef = splits[0][0]
    states = [s for _, s in splits]
    opts = [init_opt_state(TX, s) for s in states]
    stack = lambda *xs: jnp.stack(xs)  # noqa: E731
    train_many = jax.jit(
        jax.vmap(lambda s, o: scan_steps(step, graphdef, s, o, batches), in_axes=(0, 0))
    )
    s_many, _, l_many = train_many(jax.tree.map(stack, *states), jax.tree.map(stack, *opts))
    for i in range(4):
        s_one, _, l_one = scan_jit(step, graphdef, states[i], opts[i], batches)
        np.testing.assert_allclose(l_many[i], l_one, rtol=1e-5, atol=1e-6)
        assert_trees_close(jax.tree.map(lambda x, i=i: x[i], s_many), s_one)


@pytest.mark.slow
def test_step_under_user_scan_with_grad_of_final_loss(data):
    """The step composes with jax.grad: differentiate a two-step unrolled loss w.r.t. the data."""
    model = MLP(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    step = make_train_step(xent, optax.sgd(0.1))
    opt = init_opt_state(optax.sgd(0.1), state)
    batch = {k: v[:BATCH] for k, v in data.items()}

    def after_one_step(x):
        s, _, _ = step(graphdef, state, opt, {"x": x, "y": batch["y"]})
        return xent(nnx.merge(graphdef, s), batch)

    x = jnp.asarray(batch["x"])
    g = jax.grad(after_one_step)(x)
    d = jax.random.normal(jax.random.key(3), x.shape)
    eps = 1e-2
    fd = (after_one_step(x + eps * d) - after_one_step(x - eps * d)) / (2 * eps)
    np.testing.assert_allclose(jnp.vdot(g, d), fd, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("length", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_fully_unrolled_scan_steps_leave_no_loop(data, length):
    """jax lowers a length-1 unroll=True scan to a while loop; ours must not (jax#12868)."""
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    step = make_train_step(xent, TX)
    opt = init_opt_state(TX, state)
    batches = stacked(data, steps=length)
    run = jax.jit(lambda s, o, b: scan_steps(step, graphdef, s, o, b, unroll=True))
    assert "while" not in run.lower(state, opt, batches).as_text()
    _, _, unrolled = run(state, opt, batches)
    _, _, looped = scan_jit(step, graphdef, state, opt, batches)
    np.testing.assert_allclose(unrolled, looped, rtol=1e-6)


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_make_epoch_equals_per_step_loop_on_the_same_permutation(data, drop_remainder):
    n, bs = 37, 8  # 4 full batches and a tail of 5
    d = {k: v[:n] for k, v in data.items()}
    key = jax.random.key(7)
    order = np.asarray(jax.random.permutation(key, n))
    cuts = [order[i : i + bs] for i in range(0, n, bs)]
    if drop_remainder:
        cuts = [c for c in cuts if len(c) == bs]
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    ref_losses = reference_loop(ref, ref_opt, xent, [{k: v[c] for k, v in d.items()} for c in cuts])

    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    epoch = jax.jit(
        make_epoch(make_train_step(xent, TX), batch_size=bs, drop_remainder=drop_remainder)
    )
    state, _, losses = epoch(graphdef, state, init_opt_state(TX, state), d, key)
    assert losses.shape == (len(cuts),)
    np.testing.assert_allclose(losses, np.array(ref_losses), rtol=1e-5, atol=1e-6)
    assert_trees_close(state, nnx.state(ref))


def test_make_epoch_without_shuffle_keeps_order(data):
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    n = len(data["x"]) // BATCH
    in_order = [{k: v[i * BATCH : (i + 1) * BATCH] for k, v in data.items()} for i in range(n)]
    ref_losses = reference_loop(ref, ref_opt, xent, in_order)

    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    epoch = jax.jit(make_epoch(make_train_step(xent, TX), batch_size=BATCH, shuffle=False))
    state, _, losses = epoch(graphdef, state, init_opt_state(TX, state), data, None)
    np.testing.assert_allclose(losses, np.array(ref_losses), rtol=1e-5, atol=1e-6)
    assert_trees_close(state, nnx.state(ref))


def test_evaluate_counts_every_example_including_the_ragged_tail():
    d = make_data(n=23)
    model = BNDropout(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def metrics(m, b):
        pred = m(b["x"]).argmax(-1)
        return {"acc": jnp.mean(pred == b["y"]), "mean_x0": jnp.mean(b["x"][:, 0])}

    out = jax.jit(make_evaluate(metrics, batch_size=5))(graphdef, state, d)
    model.eval()
    pred = np.asarray(model(d["x"]).argmax(-1))
    np.testing.assert_allclose(out["acc"], np.mean(pred == d["y"]), rtol=1e-6)
    np.testing.assert_allclose(out["mean_x0"], d["x"][:, 0].mean(), rtol=1e-5)


def test_eval_step_changes_no_state_and_names_a_scalar_metric(data):
    model = BNDropout(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    before = state_arrays(state)

    def acc(m, b):
        return jnp.mean(m(b["x"]).argmax(-1) == b["y"])

    out = jax.jit(make_eval_step(acc))(graphdef, state, data)
    assert set(out) == {"acc"}
    for a, b in zip(before, state_arrays(state), strict=True):
        np.testing.assert_array_equal(a, b)


# -- bad input ------------------------------------------------------------------------------


def _split():
    return nnx.split(MLP(rngs=nnx.Rngs(0)))


def test_non_scalar_loss_is_a_clear_error(data):
    graphdef, state = _split()
    step = make_train_step(lambda m, b: m(b["x"]), TX)
    with pytest.raises(ValueError, match="scalar"):
        step(graphdef, state, init_opt_state(TX, state), data)


def test_tuple_loss_without_has_aux_is_a_clear_error(data):
    graphdef, state = _split()
    step = make_train_step(xent_aux, TX)
    with pytest.raises(ValueError, match="has_aux=True"):
        step(graphdef, state, init_opt_state(TX, state), data)


def test_tx_must_be_an_optax_transform():
    with pytest.raises(TypeError, match="GradientTransformation"):
        make_train_step(xent, "adam")
    model = MLP(rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"nnx\.Optimizer"):
        make_train_step(xent, nnx.Optimizer(model, TX, wrt=nnx.Param))


def test_wrt_selecting_nothing_is_a_clear_error():
    _, state = _split()
    with pytest.raises(ValueError, match="selects no variable"):
        init_opt_state(TX, state, wrt=nnx.BatchStat)


def test_the_pieces_of_a_split_by_several_filters_are_a_clear_error(data):
    # nnx.split(model, filter, ...) gives a state per filter; the step takes one state.
    graphdef, params, rest = nnx.split(MLP(rngs=nnx.Rngs(0)), nnx.Param, ...)
    step = make_train_step(xent, TX)
    with pytest.raises(TypeError, match=r"one nnx\.State.*tuple of 2 pieces.*merge_state"):
        step.init(graphdef, (params, rest))
    with pytest.raises(TypeError, match=r"one nnx\.State.*merge_state"):
        step.update(graphdef, (params, rest), None, data)
    merged = nnx.merge_state(params, rest)  # what the message says works
    jax.tree.leaves(step.update(graphdef, merged, step.init(graphdef, merged), data))


def test_leading_sizes_that_differ_name_both_sizes():
    graphdef, state = _split()
    epoch = make_epoch(make_train_step(xent, TX), batch_size=4)
    bad = {"x": np.zeros((10, 4), np.float32), "y": np.zeros(9, np.int32)}
    with pytest.raises(ValueError, match=r"\['x'\].*10.*\['y'\].*9"):
        epoch(graphdef, state, init_opt_state(TX, state), bad, jax.random.key(0))
    with pytest.raises(ValueError, match="batches"):
        scan_steps(make_train_step(xent, TX), graphdef, state, init_opt_state(TX, state), bad)


@pytest.mark.parametrize(
    ("data", "batch_size", "error", "pattern"),
    [
        ({"x": np.zeros((0, 4), np.float32)}, 4, ValueError, "empty"),
        ({}, 4, ValueError, "empty"),
        ({"x": np.zeros((10, 4), np.float32)}, 0, ValueError, "at least 1, got 0"),
        ({"x": np.zeros((10, 4), np.float32)}, 11, ValueError, "11.*10"),
        ({"x": np.zeros((10, 4), np.float32), "tag": "cats"}, 4, TypeError, r"\['tag'\].*str"),
    ],
)
def test_bad_epoch_inputs(data, batch_size, error, pattern):
    graphdef, state = _split()
    with pytest.raises(error, match=pattern):
        epoch = make_epoch(make_train_step(xent, TX), batch_size=batch_size)
        epoch(graphdef, state, init_opt_state(TX, state), data, jax.random.key(0))
