"""Populations against separate single-model runs: each member is what Trainer trains alone."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import (
    epoch_order,
    init_opt_state,
    make_epoch,
    make_train_step,
    stack_states,
    unstack_states,
    vmap_members,
    with_hyperparams,
)
from nnxscan.shell import Population, Trainer

from conftest import (
    MLP,
    BNDropout,
    accuracy,
    assert_trees_close,
    make_data,
    state_arrays,
    xent,
    xent_aux,
)

# One optimizer object per configuration: the shell caches its compiled programs by the
# optimizer, so the reference Trainer of each member reuses them (optax transforms hold no
# state: sharing one changes nothing that is trained).
TX = optax.adam(1e-2)
BS = 8
SEEDS = [0, 1, 2]
RATES = [1e-2, 3e-3, 1e-3]


@functools.cache
def injected_adam(learning_rate: float = 1e-3) -> optax.GradientTransformation:
    return optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate)


def bn_dropout(rngs: nnx.Rngs) -> nnx.Module:
    return BNDropout(rngs=rngs)


def mlp(rngs: nnx.Rngs) -> nnx.Module:
    return MLP(rngs=rngs)


def largest_relative_difference(a, b) -> float:
    """max |a - b| / max |b| per array leaf (RNG keys by their data), the largest over leaves:
    rounding differences measured against the size of what they perturb."""
    worst = 0.0
    for x, y in zip(state_arrays(a), state_arrays(b), strict=True):
        d = np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)), initial=0.0)
        worst = max(worst, float(d / max(np.max(np.abs(y), initial=0.0), 1e-30)))
    return worst


# -- pure helpers -----------------------------------------------------------------------------


def test_stack_and_unstack_round_trip_and_name_mismatches():
    states = [nnx.split(BNDropout(rngs=nnx.Rngs(s)))[1] for s in SEEDS]
    stacked = stack_states(states)
    assert stacked["l1"]["kernel"].shape == (3, 4, 8)
    for one, back in zip(states, unstack_states(stacked), strict=True):
        assert_trees_close(one, back, exact=True)
    other = nnx.split(BNDropout(hidden=6, rngs=nnx.Rngs(0)))[1]
    with pytest.raises(ValueError, match=r"states\[1\].*shape/dtype"):
        stack_states([states[0], other])
    with pytest.raises(ValueError, match="structure"):
        stack_states([states[0], nnx.split(MLP(rngs=nnx.Rngs(0)))[1]])
    with pytest.raises(ValueError, match="non-empty list"):
        stack_states([])


def test_with_hyperparams_returns_a_new_state_and_names_what_exists():
    state = nnx.split(MLP(rngs=nnx.Rngs(0)))[1]
    opt_state = init_opt_state(injected_adam(1e-3), state)
    changed = with_hyperparams(opt_state, learning_rate=0.5, b1=0.8)
    assert float(changed.hyperparams["learning_rate"]) == 0.5
    assert float(changed.hyperparams["b1"]) == np.float32(0.8)
    assert changed.hyperparams["learning_rate"].dtype == jnp.float32
    assert float(opt_state.hyperparams["learning_rate"]) == np.float32(1e-3)  # untouched
    with pytest.raises(ValueError, match=r"'lr'.*\['b1', 'b2', 'eps', 'eps_root', 'learning_rate'"):
        with_hyperparams(opt_state, lr=0.1)
    with pytest.raises(ValueError, match="inject_hyperparams"):
        with_hyperparams(init_opt_state(optax.adam(1e-3), state), learning_rate=0.1)
    scheduled = optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(1.0, 0.0, 9)
    )
    with pytest.raises(ValueError, match="schedule"):
        with_hyperparams(init_opt_state(scheduled, state), learning_rate=0.1)


@pytest.mark.slow
def test_the_members_epoch_equals_make_epoch_per_member(data):
    """``make_epoch`` of ``vmap_members(step)``, member by member, against ``make_epoch`` of
    the step on that member alone (its own order, its own learning rate)."""
    tx = injected_adam()
    step = make_train_step(xent, tx)
    splits = [nnx.split(BNDropout(rngs=nnx.Rngs(s))) for s in SEEDS]
    graphdef = splits[0][0]
    states = [s for _, s in splits]
    opts = [
        with_hyperparams(init_opt_state(tx, s), learning_rate=r)
        for s, r in zip(states, RATES, strict=True)
    ]
    members = vmap_members(step, hyperparams={"learning_rate": RATES})
    start = members.init(graphdef, stack_states(states))
    assert_trees_close(start.inner, stack_states(opts), exact=True)  # = with_hyperparams
    orders = np.stack([epoch_order(s, 0, 64) for s in SEEDS])
    epoch = jax.jit(make_epoch(members, batch_size=BS, num_members=3), static_argnums=0)
    s_all, o_all, losses = epoch(graphdef, stack_states(states), start, data, orders)
    assert losses.shape == (64 // BS, 3)
    one_epoch = jax.jit(make_epoch(step, batch_size=BS), static_argnums=0)
    for i in range(3):
        s_one, o_one, l_one = one_epoch(graphdef, states[i], opts[i], data, orders[i])
        # vmapped, XLA may order a reduction otherwise: equal to rounding.
        np.testing.assert_allclose(losses[:, i], l_one, rtol=1e-5, atol=1e-6)
        assert_trees_close(unstack_states(s_all)[i], s_one)
        assert_trees_close(unstack_states(o_all.inner)[i], o_one)
    with pytest.raises(ValueError, match=r"order has shape \(3, 63\)"):
        epoch(graphdef, stack_states(states), start, data, orders[:, :63])
    with pytest.raises(ValueError, match=r"order has shape \(2, 64\).*shape \(3, 64\)"):
        epoch(graphdef, stack_states(states), start, data, orders[:2])
    # An epoch built for 2 members, on the states of 3: the members' step says so.
    two = jax.jit(make_epoch(members, batch_size=BS, num_members=2), static_argnums=0)
    with pytest.raises(ValueError, match=r"batch\['x'\] has 2 members.*3 members"):
        two(graphdef, stack_states(states), start, data, orders[:2])

    # active=False freezes a member at every step: its state, RNG counts and optax state
    # stay bitwise; the others train as without the mask.
    frozen = start._replace(active=np.array([True, False, True]))
    s_mask, o_mask, l_mask = epoch(graphdef, stack_states(states), frozen, data, orders)
    assert_trees_close(unstack_states(s_mask)[1], states[1], exact=True)
    assert_trees_close(unstack_states(o_mask.inner)[1], opts[1], exact=True)
    for i in (0, 2):
        np.testing.assert_allclose(l_mask[:, i], losses[:, i], rtol=1e-6, atol=1e-7)
        assert_trees_close(unstack_states(s_mask)[i], unstack_states(s_all)[i])
    with pytest.raises(ValueError, match=r"active has shape \(2,\).*3 members"):
        epoch(graphdef, stack_states(states), start._replace(active=frozen.active[:2]), data,
              orders)  # fmt: skip


# -- the shell: each member is a Trainer run alone --------------------------------------------


@pytest.mark.slow
def test_each_member_equals_its_own_trainer_run(data):
    """BatchNorm + Dropout, per-member seeds, shuffles and learning rates, 320 Adam steps."""
    epochs = 40
    pop = Population(
        bn_dropout, injected_adam(), xent, seeds=SEEDS, hyperparams={"learning_rate": RATES}
    )
    history = pop.fit(data, epochs=epochs, batch_size=BS)
    steps = epochs * (64 // BS)
    assert history.losses.shape == (steps, 3)
    assert (pop.epoch, pop.step) == (epochs, steps)
    last = history.epochs[-1]
    assert last["loss"].shape == (3,) and last["steps"] == 64 // BS
    np.testing.assert_allclose(last["learning_rate"], RATES, rtol=1e-6)
    opt_states = unstack_states(pop.opt_state)
    worst = 0.0
    for i, (seed, rate) in enumerate(zip(SEEDS, RATES, strict=True)):
        model = BNDropout(rngs=nnx.Rngs(seed))
        trainer = Trainer(model, injected_adam(rate), xent)
        alone = trainer.fit(data, epochs=epochs, batch_size=BS, seed=seed, progress=False)
        np.testing.assert_allclose(history.losses[:, i], alone.losses, rtol=1e-5, atol=1e-6)
        member = pop.member(i)
        assert_trees_close(member, model)  # RNG keys compared by their data
        assert_trees_close(opt_states[i], trainer.opt_state)
        worst = max(worst, largest_relative_difference(member, model))
    assert worst < 1e-5, worst


def test_shared_order_equals_trainer_runs_with_the_first_seed(data, compile_count):
    pop = Population(mlp, TX, xent, seeds=[3, 5])
    first = pop.fit(data, epochs=2, batch_size=BS, shared_order=True)
    before = compile_count()
    # The same shapes, the same fused stretch of 2 epochs: nothing new to compile.
    second = pop.fit(data, epochs=2, batch_size=BS, shared_order=True)
    assert compile_count() == before, "a second fit of the same shapes recompiled"
    assert [e["epoch"] for e in first.epochs + second.epochs] == [0, 1, 2, 3]
    losses = np.concatenate([first.losses, second.losses])
    for i, seed in enumerate([3, 5]):
        model = MLP(rngs=nnx.Rngs(seed))
        alone = Trainer(model, TX, xent).fit(data, epochs=4, batch_size=BS, seed=3, progress=False)
        np.testing.assert_allclose(losses[:, i], alone.losses, rtol=1e-5, atol=1e-6)
        assert_trees_close(pop.member(i), model)


def test_per_member_learning_rates_scale_the_first_adam_step(data):
    """Adam's first update is lr * g / (|g| + eps): every parameter moves by about its
    member's learning rate. Same seed for both members, so only the rate differs."""
    rates = [0.0, 1e-3, 1e-2]
    pop = Population(
        mlp, injected_adam(), xent, seeds=[0, 0, 0], hyperparams={"learning_rate": rates}
    )
    start = unstack_states(pop.state)
    pop.fit(data, epochs=1, batch_size=64)  # one step on the whole data set
    for i, rate in enumerate(rates):
        moved = np.abs(pop.member(i).l1.kernel[...] - start[i]["l1"]["kernel"][...])
        if rate == 0.0:
            assert moved.max() == 0.0
        else:
            np.testing.assert_allclose(moved, rate, rtol=1e-2)


def test_aux_logs_and_a_kept_short_batch_match_trainer(data):
    pop = Population(mlp, TX, xent_aux, seeds=[4, 7], has_aux=True)
    history = pop.fit(data, epochs=2, batch_size=10, drop_remainder=False)
    assert history.losses.shape == (14, 2)  # 6 full batches + one of 4, twice
    assert history.epochs[-1]["acc"].shape == (2,)
    model = MLP(rngs=nnx.Rngs(7))
    alone = Trainer(model, TX, xent_aux, has_aux=True).fit(
        data, epochs=2, batch_size=10, seed=7, drop_remainder=False, progress=False
    )
    np.testing.assert_allclose(history.losses[:, 1], alone.losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.epochs[-1]["acc"][1], alone.epochs[-1]["acc"], rtol=1e-5)
    assert_trees_close(pop.member(1), model)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_evaluate_equals_each_members_trainer_evaluate(data):
    pop = Population(bn_dropout, TX, xent, seeds=SEEDS)
    history = pop.fit(data, epochs=2, batch_size=BS)

    def metrics(model, batch):
        return {"accuracy": accuracy(model, batch), "xent": xent(model, batch)}

    test = make_data(50, seed=1)
    values = pop.evaluate(test, metrics, batch_size=20)  # 2 batches of 20 + one of 10
    assert set(values) == {"accuracy", "xent"} and values["xent"].shape == (3,)
    for i in range(3):
        alone = Trainer(pop.member(i), TX, xent).evaluate(test, metrics, batch_size=20)
        for name, value in alone.items():
            np.testing.assert_allclose(values[name][i], value, rtol=1e-5, atol=1e-6)
    assert pop.best("xent") == int(np.argmin(values["xent"]))
    assert pop.best(values["accuracy"], mode="max") == int(np.argmax(values["accuracy"]))
    assert pop.best("loss") == int(np.argmin(history.epochs[-1]["loss"]))
    # mode="auto" (the default) reads the name as EarlyStopping does: accuracy is maximized.
    assert pop.best("accuracy") == int(np.argmax(values["accuracy"]))
    assert pop.best("accuracy", mode="min") == int(np.argmin(values["accuracy"]))
    with pytest.raises(ValueError, match=r"values given directly.*mode='min' or mode='max'"):
        pop.best(values["accuracy"])


@pytest.mark.slow
def test_member_is_a_fresh_module_that_trains_further(data):
    pop = Population(bn_dropout, TX, xent, seeds=[0, 1])
    pop.fit(data, epochs=1, batch_size=BS)
    kept = pop.state
    model = pop.member(1)
    assert model is not pop.member(1)
    history = Trainer(model, TX, xent).fit(data, epochs=2, batch_size=BS, progress=False)
    assert np.isfinite(history.losses).all() and history.losses.shape == (16,)
    assert not np.allclose(model.l2.kernel[...], kept["l2"]["kernel"][1])
    assert_trees_close(pop.state, kept, exact=True)  # the population did not move
    pop.fit(data, epochs=1, batch_size=BS)  # donates the population's buffers ...
    assert np.isfinite(np.asarray(kept["l2"]["kernel"])).all()  # ... not the copy handed out


def test_errors_are_raised_before_anything_compiles(data, compile_count):
    before = compile_count()
    cases = [
        (dict(seeds=[]), ValueError, "seeds is empty"),
        (dict(seeds=3), TypeError, "list of ints"),
        (dict(seeds=[0, -1]), ValueError, r"seeds\[1\] must be at least 0"),
        (dict(seeds=[0, True]), TypeError, r"seeds\[1\] must be an int"),
        (
            dict(seeds=[0, 1], hyperparams={"learning_rate": [1e-3]}),
            ValueError,
            r"has 1 values but there are 2 seeds",
        ),
        (
            dict(seeds=[0, 1], hyperparams={"lr": [1e-3, 1e-2]}),
            ValueError,
            r"'lr' is not a hyperparameter.*'learning_rate'",
        ),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            Population(mlp, injected_adam(), xent, **kwargs)
    with pytest.raises(ValueError, match="inject_hyperparams"):
        Population(mlp, optax.adam(1e-3), xent, seeds=[0, 1], hyperparams={"b1": [0.8, 0.9]})
    with pytest.raises(TypeError, match=r"returned int, not an nnx\.Module"):
        Population(lambda rngs: 3, optax.adam(1e-3), xent, seeds=[0])
    assert compile_count() == before

    pop = Population(mlp, optax.adam(1e-3), xent, seeds=[0, 1])
    kept = pop.state
    before = compile_count()
    with pytest.raises(ValueError, match="batch_size 65 is larger"):
        pop.fit(data, epochs=1, batch_size=65)
    with pytest.raises(ValueError, match="leading size"):
        pop.fit({"x": data["x"], "y": data["y"][:10]}, epochs=1, batch_size=BS)
    with pytest.raises(TypeError, match="epochs must be an int"):
        pop.fit(data, epochs=1.0, batch_size=BS)
    with pytest.raises(ValueError, match="index must be at most 1"):
        pop.member(2)
    with pytest.raises(ValueError, match="mode="):
        pop.best([0.1, 0.2], mode="lowest")
    with pytest.raises(ValueError, match=r"no values named 'accuracy'"):
        pop.best("accuracy")
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        pop.best([0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="mode='min' or mode='max'"):
        pop.best([0.1, 0.2])
    assert compile_count() == before
    assert (pop.epoch, pop.step) == (0, 0)
    assert_trees_close(pop.state, kept, exact=True)
