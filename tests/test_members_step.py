"""Members as a step transform: ``vmap_members(step)`` is the step of N models, and the
guards compose around or inside it in either order.

References: each member trained ALONE by the inner step (a plain Python loop of jitted
single-member steps), and, for the guards, the same loops with the rule written out by hand
(freeze this member / every member from its first non-finite loss). Vmapped, XLA may order a
reduction otherwise, so member-vs-alone comparisons are to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import (
    HaltState,
    MembersState,
    Step,
    epoch_order,
    halt_after_nonfinite,
    hyperparam_value,
    init_opt_state,
    make_epoch,
    make_train_step,
    member_state,
    scan_steps,
    skip_nonfinite,
    stack_states,
    vmap_members,
    with_hyperparams,
)

from conftest import MLP, assert_trees_close, make_data, xent

N, STEPS, BS = 3, 4, 8
TX = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
STEP = make_train_step(xent, TX)


def setup():
    splits = [nnx.split(MLP(rngs=nnx.Rngs(seed))) for seed in range(N)]
    return splits[0][0], [state for _, state in splits]


def member_batches(poison: tuple[int, int] | None = None) -> dict:
    """``(steps, N, batch, ...)``: every member its own batches; ``poison=(step, member)``
    puts a NaN in that one batch."""
    data = make_data(STEPS * N * BS)
    batches = {k: v.reshape(STEPS, N, BS, *v.shape[1:]).copy() for k, v in data.items()}
    if poison is not None:
        batches["x"][poison][0, 0] = np.nan
    return batches


one_step = jax.jit(STEP.update, static_argnums=0)


def alone(graphdef, state, opt_state, batches, member, held=()):
    """Member ``member`` trained by the inner step alone, step by step on the host; at the
    steps in ``held`` nothing changes and the loss is NaN (what a guard does)."""
    losses = []
    for t in range(STEPS):
        batch = {k: v[t, member] for k, v in batches.items()}
        new_state, new_opt, loss = one_step(graphdef, state, opt_state, batch)
        if t in held:
            losses.append(np.nan)
            continue
        state, opt_state = new_state, new_opt
        losses.append(float(loss))
    return state, opt_state, np.array(losses)


scan = jax.jit(scan_steps, static_argnums=0)


def test_each_member_trains_what_it_trains_alone():
    graphdef, states = setup()
    members = vmap_members(STEP)
    start = members.init(graphdef, stack_states(states))
    assert isinstance(start, MembersState) and start.active.shape == (N,)
    batches = member_batches()
    trained, opt, losses = scan(members, graphdef, stack_states(states), start, batches)
    assert losses.shape == (STEPS, N)
    for i in range(N):
        s_i, o_i, l_i = alone(graphdef, states[i], init_opt_state(TX, states[i]), batches, i)
        np.testing.assert_allclose(losses[:, i], l_i, rtol=1e-5, atol=1e-6)
        assert_trees_close(member_state(trained, i), s_i)
        assert_trees_close(member_state(opt.inner, i), o_i)


def test_a_shared_batch_trains_every_member_on_it():
    graphdef, states = setup()
    members = vmap_members(STEP, shared_batch=True)
    batches = jax.tree.map(lambda x: x[:, 0], member_batches())  # (steps, batch, ...)
    start = members.init(graphdef, stack_states(states))
    trained, _, losses = scan(members, graphdef, stack_states(states), start, batches)
    per_member = jax.tree.map(lambda x: np.broadcast_to(x[:, None], (STEPS, N, *x.shape[1:])),
                              batches)  # fmt: skip
    for i in range(N):
        s_i, _, l_i = alone(graphdef, states[i], init_opt_state(TX, states[i]), per_member, i)
        np.testing.assert_allclose(losses[:, i], l_i, rtol=1e-5, atol=1e-6)
        assert_trees_close(member_state(trained, i), s_i)


def test_hyperparams_are_written_per_member_by_init():
    graphdef, states = setup()
    rates = [0.1, 0.03, 0.01]
    members = vmap_members(STEP, hyperparams={"learning_rate": rates})
    start = members.init(graphdef, stack_states(states))
    np.testing.assert_allclose(hyperparam_value(start.inner, "learning_rate"), rates)
    by_hand = stack_states(
        [
            with_hyperparams(init_opt_state(TX, s), learning_rate=r)
            for s, r in zip(states, rates, strict=True)
        ]
    )
    assert_trees_close(start.inner, by_hand, exact=True)
    with pytest.raises(ValueError, match=r"hyperparams\['learning_rate'\] has 2 values for 3"):
        vmap_members(STEP, hyperparams={"learning_rate": rates[:2]}).init(
            graphdef, stack_states(states)
        )
    with pytest.raises(ValueError, match="'b1' is not a hyperparameter"):
        vmap_members(STEP, hyperparams={"b1": rates}).init(graphdef, stack_states(states))


def test_bad_members_input_is_refused_naming_the_leaf():
    graphdef, states = setup()
    members = vmap_members(STEP)
    start = members.init(graphdef, stack_states(states))
    two = jax.tree.map(lambda x: x[0, :2], member_batches())
    with pytest.raises(ValueError, match=r"batch\['x'\] has 2 members .* 3 members"):
        members(graphdef, stack_states(states), start, two)
    with pytest.raises(TypeError, match="MembersState"):
        members(graphdef, stack_states(states), start.inner, two)


@pytest.mark.parametrize(
    ("composition", "held"),
    [
        ("halt_inside", {1: range(1, STEPS)}),  # member 1 halts at its NaN, the rest train
        ("halt_around", dict.fromkeys(range(N), range(1, STEPS))),  # every member halts
        ("skip_inside", {1: (1,)}),  # member 1's step 1 is skipped
        ("skip_around", dict.fromkeys(range(N), (1,))),  # every member's step 1 is skipped
    ],
)
def test_guards_compose_in_either_order(composition, held):
    """Member 1's batch at step 1 is poisoned. A guard inside the members holds member 1
    alone; around them (the population's step as one) it holds every member."""
    graphdef, states = setup()
    batches = member_batches(poison=(1, 1))
    guard = halt_after_nonfinite if composition.startswith("halt") else skip_nonfinite
    inside = composition.endswith("inside")
    step = vmap_members(guard(STEP)) if inside else guard(vmap_members(STEP))
    start = step.init(graphdef, stack_states(states))
    if composition == "halt_inside":
        assert isinstance(start.inner, HaltState) and start.inner.halted.shape == (N,)
    trained, _, losses = scan(step, graphdef, stack_states(states), start, batches)
    for i in range(N):
        opt_i = init_opt_state(TX, states[i])
        s_i, _, l_i = alone(graphdef, states[i], opt_i, batches, i, held.get(i, ()))
        np.testing.assert_allclose(losses[:, i], l_i, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert_trees_close(member_state(trained, i), s_i)


def test_a_guard_of_a_plain_function_is_a_step_whose_init_says_what_to_do():
    def update(graphdef, state, opt_state, batch):
        return state, opt_state, jnp.float32(0)

    guarded = halt_after_nonfinite(update)
    assert isinstance(guarded, Step)
    with pytest.raises(TypeError, match=r"wrap a nnxscan\.pure\.Step"):
        guarded.init(None, None)


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_make_epoch_gives_each_member_its_own_order_from_orders_or_keys():
    graphdef, states = setup()
    data = make_data(32)
    members = vmap_members(STEP)
    start = members.init(graphdef, stack_states(states))
    epoch = jax.jit(make_epoch(members, batch_size=BS, num_members=N), static_argnums=0)
    single = jax.jit(make_epoch(STEP, batch_size=BS), static_argnums=0)
    orders = np.stack([epoch_order(seed, 0, 32) for seed in range(N)])
    keys = jax.random.split(jax.random.key(0), N)
    for order_or_keys, per_member in ((orders, list(orders)), (keys, list(keys))):
        trained, _, losses = epoch(graphdef, stack_states(states), start, data, order_or_keys)
        assert losses.shape == (32 // BS, N)
        for i in range(N):
            s_i, _, l_i = single(graphdef, states[i], init_opt_state(TX, states[i]), data,
                                 per_member[i])  # fmt: skip
            np.testing.assert_allclose(losses[:, i], l_i, rtol=1e-5, atol=1e-6)
            assert_trees_close(member_state(trained, i), s_i)


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_a_members_epoch_built_without_num_members_takes_the_members_orders_as_before():
    """``make_epoch(vmap_members(step), ...)`` without ``num_members`` (its form before the
    argument existed) trains what the epoch told ``num_members=N`` trains, bitwise, from N
    orders or N keys, a guard around the members step too; one order is every member's (a
    shared batch)."""
    graphdef, states = setup()
    data, stacked = make_data(32), stack_states(states)
    members = vmap_members(STEP)
    start = members.init(graphdef, stacked)
    told = jax.jit(make_epoch(members, batch_size=BS, num_members=N), static_argnums=0)
    untold = jax.jit(make_epoch(members, batch_size=BS), static_argnums=0)
    orders = np.stack([epoch_order(seed, 0, 32) for seed in range(N)])
    keys = jax.random.split(jax.random.key(0), N)
    for given in (orders, keys):
        assert_trees_close(
            untold(graphdef, stacked, start, data, given),
            told(graphdef, stacked, start, data, given),
            exact=True,
        )
    guarded = halt_after_nonfinite(members)  # its state is the guard's, not a MembersState
    guarded_start = guarded.init(graphdef, stacked)
    for num_members in (None, N):
        epoch = make_epoch(guarded, batch_size=BS, num_members=num_members)
        trained, _, losses = jax.jit(epoch, static_argnums=0)(
            graphdef, stacked, guarded_start, data, orders
        )
        assert losses.shape == (32 // BS, N)
        # The guard's program is another program than the bare members step's: to rounding.
        assert_trees_close(trained, told(graphdef, stacked, start, data, orders)[0])
    shared = make_epoch(vmap_members(STEP, shared_batch=True), batch_size=BS)
    _, _, losses = jax.jit(shared, static_argnums=0)(graphdef, stacked, start, data, orders[0])
    assert losses.shape == (32 // BS, N)


def test_make_epoch_is_told_its_members_and_says_what_to_pass_otherwise():
    """An epoch told its number of members (``num_members=``) takes one order or key per
    member and refuses one for all, saying what it takes; a one-model epoch refuses orders
    or keys of another rank. Unshuffled with no order, every member trains the stored
    order (gathered, as an explicit ``arange`` order per member is)."""
    graphdef, states = setup()
    data, stacked = make_data(32), stack_states(states)
    members = vmap_members(STEP)
    start = members.init(graphdef, stacked)
    one, one_opt = make_epoch(STEP, batch_size=BS), init_opt_state(TX, states[0])
    orders = np.stack([epoch_order(seed, 0, 32) for seed in range(N)])
    keys = jax.random.split(jax.random.key(0), N)
    with pytest.raises(ValueError, match=r"order has shape \(1, 3, 32\).*num_members=N"):
        one(graphdef, states[0], one_opt, data, orders[None])
    with pytest.raises(ValueError, match=r"keys have shape \(1, 3\).*num_members=N"):
        one(graphdef, states[0], one_opt, data, keys[None])
    epoch = make_epoch(members, batch_size=BS, num_members=N)
    with pytest.raises(ValueError, match=r"order has shape \(32,\).*shape \(3, 32\)"):
        epoch(graphdef, stacked, start, data, orders[0])
    with pytest.raises(ValueError, match=r"keys have shape \(\): pass 3 keys"):
        epoch(graphdef, stacked, start, data, keys[0])
    with pytest.raises(ValueError, match="num_members"):
        make_epoch(members, batch_size=BS, num_members=0)
    stored = make_epoch(members, batch_size=BS, shuffle=False, num_members=N)
    arange = np.tile(np.arange(32, dtype=np.int32), (N, 1))
    assert_trees_close(
        jax.jit(stored, static_argnums=0)(graphdef, stacked, start, data, None),
        jax.jit(epoch, static_argnums=0)(graphdef, stacked, start, data, arange),
        exact=True,
    )
