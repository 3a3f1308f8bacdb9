"""The shell is a thin layer over the pure contract: one epoch rule, one owner, one counter.

References are independent of the shell: a user's own loop of pure functions (jitted by
hand), numpy's documented generator, and the plain per-step NNX loop.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import epoch_order, init_opt_state, make_epoch, make_train_step, scan_steps
from nnxscan.shell import Trainer, scan_train

from conftest import (
    ACROSS_PROGRAMS,
    MLP,
    BNDropout,
    assert_trees_close,
    epoch_batches,
    make_data,
    reference_loop,
    xent,
)

TX = optax.adam(1e-2)
BS = 8


def assert_to_rounding(got, want):
    np.testing.assert_allclose(got, want, **ACROSS_PROGRAMS)


# -- one epoch rule -------------------------------------------------------------------------


def test_epoch_order_is_numpys_documented_generator():
    want = np.random.default_rng((7, 3)).permutation(50)
    got = epoch_order(7, 3, 50)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(epoch_order(7, 3, 50, shuffle=False), np.arange(50))
    assert not np.array_equal(epoch_order(7, 3, 50), epoch_order(7, 4, 50))


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((-1, 0, 10), ValueError, "seed must be at least 0"),
        ((0, True, 10), TypeError, "epoch must be an int"),
        ((0, 0, 0), ValueError, "num_examples must be at least 1"),
        ((0.5, 0, 10), TypeError, "seed must be an int"),
    ],
)
def test_epoch_order_rejects_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        epoch_order(*args)


def _pure_loop(model_cls, data, epochs, seed, *, drop_remainder=True):
    """The user's own loop: pure step, jitted epoch, the host order fit documents."""
    model = model_cls(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    opt_state = init_opt_state(TX, state)
    step = make_train_step(xent, TX)
    epoch = jax.jit(make_epoch(step, batch_size=BS, drop_remainder=drop_remainder))
    n = len(data["x"])
    losses = []
    for e in range(epochs):
        state, opt_state, out = epoch(graphdef, state, opt_state, data, epoch_order(seed, e, n))
        losses.append(np.asarray(out))
    return state, opt_state, np.concatenate(losses)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
@pytest.mark.parametrize("model_cls", [MLP, BNDropout], ids=["mlp", "batchnorm_dropout"])
def test_a_loop_of_pure_epochs_reproduces_fit_bitwise(data, model_cls):
    model = model_cls(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent, execution="scan")
    # Two fits: the second's epoch was drawn ahead while the first's last call ran.
    first = trainer.fit(data, epochs=2, batch_size=BS, seed=5, progress=False)
    last = trainer.fit(data, epochs=1, batch_size=BS, seed=5, progress=False)
    state, opt_state, losses = _pure_loop(model_cls, data, 3, seed=5)
    # Bitwise on every CPU: fit's calls and make_epoch compile the same loop body (their
    # optimized HLO bodies do the same arithmetic; see conftest's ACROSS_PROGRAMS).
    assert_trees_close(model, state, exact=True)  # params, batch stats, RNG counts and keys
    assert_trees_close(trainer.opt_state, opt_state, exact=True)
    np.testing.assert_array_equal(np.concatenate([first.losses, last.losses]), losses)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_the_next_fit_finds_its_epoch_order_drawn_ahead(data, monkeypatch):
    """While a fit's last call trains, the next epoch's order is drawn (once per distinct
    seed): the next fit draws only the epoch after its own."""
    import nnxscan.shell._engine.epochs as epochs_module
    from nnxscan.shell import Population

    drawn = []
    real = epochs_module.epoch_order

    def counted(seed, epoch, num_examples, **kwargs):
        drawn.append((seed, epoch))
        return real(seed, epoch, num_examples, **kwargs)

    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    population = Population(lambda rngs: MLP(rngs=rngs), TX, xent, seeds=[3, 3, 5])
    for fit, seed in ((trainer.fit, {"seed": 5}), (population.fit, {})):
        fit(data, epochs=2, batch_size=BS, progress=False, **seed)
        monkeypatch.setattr(epochs_module, "epoch_order", counted)
        fit(data, epochs=1, batch_size=BS, progress=False, **seed)
        monkeypatch.setattr(epochs_module, "epoch_order", real)
    assert drawn == [(5, 3), (3, 3), (5, 3)]


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_a_loop_of_pure_epochs_reproduces_fit_with_the_short_batch_kept(data):
    data = {k: v[:60] for k, v in data.items()}  # 60 = 7 batches of 8 + 4
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent, execution="scan")
    history = trainer.fit(
        data, epochs=2, batch_size=BS, seed=1, drop_remainder=False, progress=False
    )
    state, _, losses = _pure_loop(MLP, data, 2, seed=1, drop_remainder=False)
    assert len(losses) == 16
    # The short batch is a step of its own shape outside any loop: each program compiles
    # it in its own entry computation, so to rounding (conftest's ACROSS_PROGRAMS).
    assert_trees_close(model, state)
    np.testing.assert_allclose(history.losses, losses, **ACROSS_PROGRAMS)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
@pytest.mark.parametrize("num_examples", [BS, 5 * BS], ids=["one_step_epochs", "five_steps"])
def test_unshuffled_fit_is_bitwise_make_epoch_and_scan_steps(data, num_examples):
    """``fit(shuffle=False)`` = ``make_epoch(shuffle=False)`` (no order) = ``scan_steps`` on
    the stored batches, bitwise: every path scans the same stack of batches with the same
    loop body. With one-step epochs only to rounding: a scan of one step is no loop (XLA
    inlines it), while fit fuses the three epochs into a loop: two programs."""
    data = {k: v[:num_examples] for k, v in data.items()}
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent, execution="scan")
    history = trainer.fit(data, epochs=3, batch_size=BS, shuffle=False, progress=False)

    step = make_train_step(xent, TX)
    graphdef, start = nnx.split(MLP(rngs=nnx.Rngs(0)))
    epoch = jax.jit(make_epoch(step, batch_size=BS, shuffle=False))
    scan = jax.jit(scan_steps, static_argnums=0)
    batches = jax.tree.map(lambda *b: np.stack(b), *epoch_batches(data, BS, 0, 0, shuffle=False))
    by_epoch = by_scan = (start, init_opt_state(TX, start))
    epoch_losses, scan_losses = [], []
    for _ in range(3):
        *by_epoch, out = epoch(graphdef, *by_epoch, data, None)
        *by_scan, out_scan = scan(step, graphdef, *by_scan, batches)
        epoch_losses.append(out)
        scan_losses.append(out_scan)
    exact = num_examples > BS
    assert_trees_close(by_epoch, by_scan, exact=exact)
    assert_trees_close(model, by_epoch[0], exact=exact)
    assert_trees_close(trainer.opt_state, by_epoch[1], exact=exact)
    close = np.testing.assert_array_equal if exact else assert_to_rounding
    close(history.losses, np.concatenate(epoch_losses))
    close(np.concatenate(scan_losses), np.concatenate(epoch_losses))


def indexed_epoch(din: int):
    """An MLP's pure step and state, random data of ``din`` features and one epoch's
    ``(8, BS)`` index in the order ``fit`` uses."""
    data = make_data(din=din)
    step = make_train_step(xent, TX)
    graphdef, state = nnx.split(MLP(din, rngs=nnx.Rngs(0)))
    opt_state = init_opt_state(TX, state)
    order = epoch_order(3, 0, len(data["x"])).reshape(-1, BS)  # 8 steps: the rule fit uses
    return data, step, graphdef, state, opt_state, order


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
@pytest.mark.parametrize("din", [4, 40], ids=["narrow_rows", "rows_gathered_as_bytes"])
def test_epochs_over_the_gather_budget_run_in_chunks_bitwise(din):
    """An epoch whose batches exceed the gather budget runs as chunks of steps, each
    gathered once (a chunk that reads half the data or more through bytes, where the rows
    allow it): bitwise the epoch gathered whole, the chunks' steps being the same loop body
    (a short last chunk too: it runs the same loop body; to rounding against the per-step
    reference: other programs)."""
    from nnxscan.pure import batching, scan_indexed_steps

    data, step, graphdef, state, opt_state, order = indexed_epoch(din)
    per_step = batching._batch_bytes(data, BS)

    def run(budget):
        return jax.jit(
            lambda s, o: scan_indexed_steps(step, graphdef, s, o, data, order, gather_budget=budget)
        )(state, opt_state)

    whole = run(10 * per_step)
    jaxpr = str(
        jax.make_jaxpr(
            lambda s, o: scan_indexed_steps(
                step, graphdef, s, o, data, order, gather_budget=5 * per_step
            )
        )(state, opt_state)
    )
    assert ("bitcast_convert_type" in jaxpr) == (din == 40 and jax.default_backend() == "cpu")
    # Chunks of 4 (half the data each: through bytes), of 2 (8 = 4 x 2), of 1 (at least one).
    for budget in (5 * per_step, 3 * per_step, 1):
        assert_trees_close(run(budget), whole, exact=True)
    first7 = order[:7]  # 7 steps in chunks of at most 3: no divisor in [2, 3], a rest of 1
    whole7 = jax.jit(
        lambda s, o: scan_indexed_steps(step, graphdef, s, o, data, first7, gather_budget=10**9)
    )(state, opt_state)

    def chunked(s, o):
        return scan_indexed_steps(step, graphdef, s, o, data, first7, gather_budget=3 * per_step)

    chunked7 = jax.jit(chunked)(state, opt_state)
    # The chunks of 3, 3 and 1 steps run ONE loop body (the step once in the program, as in
    # the whole call's): the same body in a loop, bitwise.
    assert_trees_close(chunked7, whole7, exact=True)
    assert str(jax.make_jaxpr(chunked)(state, opt_state)).count("dot_general") == str(
        jax.make_jaxpr(
            lambda s, o: scan_indexed_steps(step, graphdef, s, o, data, first7, gather_budget=10**9)
        )(state, opt_state)
    ).count("dot_general")
    model = MLP(din, rngs=nnx.Rngs(0))  # the plain per-step NNX loop on the same batches
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    reference_loop(model, optimizer, xent, epoch_batches(data, BS, 3, 0))
    assert_trees_close(model, whole[0])


@pytest.mark.parametrize("din", [4, 40, 2048], ids=["narrow", "as_bytes", "wide"])
def test_steps_per_gather_is_the_longest_call_with_one_loop(din):
    """``steps_per_gather`` promises the longest call that ``scan_indexed_steps`` runs as
    ONE loop of steps (its batches gathered at once); one step more runs an outer loop of
    chunks around it; None: every call is one loop (big batches of wide rows gather per
    step). Checked on the program's own loops (its jaxpr)."""
    from nnxscan.pure import batching, scan_indexed_steps

    data, step, graphdef, state, opt_state, order = indexed_epoch(din)
    per_step = batching._batch_bytes(data, BS)
    budget = 3 * per_step + 1

    def loops(steps):
        jaxpr = jax.make_jaxpr(
            lambda s, o: scan_indexed_steps(
                step, graphdef, s, o, data, order[:steps], gather_budget=budget
            )
        )(state, opt_state)
        return str(jaxpr).count("scan[") + str(jaxpr).count("while[")

    most = batching.steps_per_gather(data, BS, budget)
    if din == 2048:  # 8 rows of 8 KiB: LOOP_GATHER_BYTES a step
        assert most is None and loops(8) == 1
        return
    assert most == 3
    assert loops(most) == 1 and loops(most + 1) == 2  # chunks of 2: a loop in a loop
    assert batching.steps_per_gather(data, BS) == batching._gather_budget(data) // per_step


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_big_batches_of_wide_rows_over_the_budget_gather_in_the_loop_bitwise():
    """A call over the gather budget whose batches take ``LOOP_GATHER_BYTES`` or more of
    rows too wide to gather as bytes gathers each step's batch inside the ONE loop (no
    outer loop of chunks for XLA to compile): bitwise the call gathered whole, whose steps
    run the same step on the same rows; to rounding against the per-step NNX loop (other
    programs)."""
    from nnxscan.pure import batching, scan_indexed_steps

    din = batching.LOOP_GATHER_BYTES // (4 * BS)  # a batch of float32 rows: 64 KiB
    data, step, graphdef, state, opt_state, order = indexed_epoch(din)
    per_step = batching._batch_bytes(data, BS)
    assert per_step >= batching.LOOP_GATHER_BYTES

    def call(budget):
        return lambda s, o: scan_indexed_steps(
            step, graphdef, s, o, data, order, gather_budget=budget
        )

    whole = jax.jit(call(10**9))(state, opt_state)
    for budget in (3 * per_step, 1):  # over the budget: no chunks, a gather per step
        jaxpr = jax.make_jaxpr(call(budget))(state, opt_state)
        loops = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("scan", "while")]
        assert len(loops) == 1 and "gather" in str(loops[0].params["jaxpr"])
        assert_trees_close(jax.jit(call(budget))(state, opt_state), whole, exact=True)
    model = MLP(din, rngs=nnx.Rngs(0))  # the plain per-step NNX loop on the same batches
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    reference_loop(model, optimizer, xent, epoch_batches(data, BS, 3, 0))
    assert_trees_close(model, whole[0])


def test_batch_numbers_slice_the_stored_rows_bitwise_and_gather_no_examples(data):
    """``batch_rows``: batch numbers (any order, repeated) train bit for bit what the
    ``(steps, batch)`` index of the same stored rows trains, and the program gathers no
    examples: it holds exactly the gathers of ``scan_steps`` on the batches stacked."""
    from nnxscan.pure import scan_indexed_steps

    step = make_train_step(xent, TX)
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    opt_state = init_opt_state(TX, state)
    numbers = np.array([2, 0, 7, 7, 3], np.int32)
    rows = (numbers[:, None] * BS + np.arange(BS)).astype(np.int32)  # the same batches

    def by_numbers(s, o):
        return scan_indexed_steps(step, graphdef, s, o, data, numbers, batch_rows=BS)

    def by_index(s, o):
        return scan_indexed_steps(step, graphdef, s, o, data, rows)

    def stacked(s, o):
        return scan_steps(step, graphdef, s, o, jax.tree.map(lambda v: v[rows], data))

    assert_trees_close(jax.jit(by_numbers)(state, opt_state), jax.jit(by_index)(state, opt_state),
                       exact=True)  # fmt: skip

    def gathers(fn):
        return str(jax.make_jaxpr(fn)(state, opt_state)).count("gather[")

    # The loss's own take_along_axis gathers in each; the index adds the examples' gather.
    # (The CPU's rule. On a TPU batch numbers gather their batches before the loop, as any
    # index does there: tests/test_accelerator_paths.py checks that program.)
    from nnxscan.pure import batching

    if batching.slices_in_loop():
        assert gathers(by_numbers) == gathers(stacked) < gathers(by_index)
    with pytest.raises(ValueError, match=r"batch_rows takes a \(steps,\) index.*\(5, 8\)"):
        scan_indexed_steps(step, graphdef, state, opt_state, data, rows, batch_rows=BS)
    with pytest.raises(ValueError, match=r"batch numbers must lie in \[0, 8\).*got 0\.\.8"):
        scan_indexed_steps(step, graphdef, state, opt_state, data, np.array([0, 8]), batch_rows=BS)


def test_an_unshuffled_fit_keeping_its_short_batch_slices_then_gathers_bitwise(data):
    """``fit(shuffle=False, drop_remainder=False)``: full batches sliced, the short one
    gathered; ``make_epoch`` given the stored order as an index (all gathered) trains the
    same (to rounding: the short batch's step is outside any loop, compiled in each
    program's own entry computation)."""
    data = {k: v[:23] for k, v in data.items()}  # 2 batches of 8 and a short one of 7
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent, execution="scan")
    history = trainer.fit(
        data, epochs=2, batch_size=BS, shuffle=False, drop_remainder=False, progress=False
    )
    step = make_train_step(xent, TX)
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    epoch = jax.jit(make_epoch(step, batch_size=BS, drop_remainder=False))
    carry, losses = (state, init_opt_state(TX, state)), []
    for _ in range(2):
        *carry, out = epoch(graphdef, *carry, data, np.arange(23, dtype=np.int32))
        losses.append(out)
    assert_trees_close(model, carry[0])
    np.testing.assert_allclose(history.losses, np.concatenate(losses), **ACROSS_PROGRAMS)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_an_unshuffled_population_fit_is_bitwise_its_pure_epochs(data):
    """``Population.fit(shuffle=False)`` = a loop of ``make_epoch`` of the members' step
    (``vmap_members``) over every member's stored order."""
    from nnxscan.pure import stack_states, vmap_members
    from nnxscan.shell import Population

    population = Population(lambda rngs: MLP(rngs=rngs), TX, xent, seeds=[3, 5])
    history = population.fit(data, epochs=2, batch_size=BS, shuffle=False, progress=False)

    step = make_train_step(xent, TX)
    graphdef, states = nnx.split(MLP(rngs=nnx.Rngs(3)))
    states = stack_states([states, nnx.split(MLP(rngs=nnx.Rngs(5)))[1]])
    members = vmap_members(step)
    opt_states = members.init(graphdef, states)
    epoch = jax.jit(make_epoch(members, batch_size=BS, num_members=2))
    orders = np.stack([epoch_order(seed, 0, len(data["x"]), shuffle=False) for seed in (3, 5)])
    losses = []
    for _ in range(2):
        states, opt_states, out = epoch(graphdef, states, opt_states, data, orders)
        losses.append(out)
    assert_trees_close(population.state, states, exact=True)
    assert_trees_close(population.opt_state, opt_states.inner, exact=True)
    np.testing.assert_array_equal(np.asarray(history.losses), np.concatenate(losses))


_SPECIALS = np.array([1.5, np.nan, -0.0, np.inf, -np.inf, 1e-40], np.float32)


@pytest.mark.parametrize(
    ("leaf", "as_bytes"),
    [
        (np.arange(6 * 40, dtype=np.float32).reshape(6, 40), True),
        (np.resize(_SPECIALS, (6, 32)), True),  # NaN, -0.0, infinities, subnormals
        (np.arange(6 * 64, dtype=np.int16).reshape(6, 64) - 100, True),
        (np.arange(6 * 64, dtype=np.float16).reshape(6, 8, 8), True),
        (np.arange(24, dtype=np.float32).reshape(6, 4), False),  # 16 B rows: as they are
        (np.arange(6, dtype=np.uint8), False),
        (np.array([True, False, True, True, False, False]), False),
        (np.arange(6 * 200, dtype=np.float32).reshape(6, 200), False),  # 200 elements a row
    ],
)
def test_take_rows_is_numpy_indexing_bitwise(leaf, as_bytes):
    """Rows gathered through a byte view of the data (faster on XLA:CPU) are numpy's own
    fancy indexing, bit for bit: NaN payloads, -0.0 and subnormals included."""
    from nnxscan.pure.batching import _gathers_as_bytes, take_rows

    assert _gathers_as_bytes(leaf) == (as_bytes and jax.default_backend() == "cpu")
    indices = np.array([[5, 0, 3], [3, 3, 1]])
    want = leaf[indices]
    for got in (take_rows(leaf, indices), jax.jit(take_rows)(leaf, indices)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8)
        )


def test_chunks_divide_the_call_when_they_can():
    """A call's chunks are one loop when a divisor of its steps lies in [most/2, most]
    (a rest would be a second loop of the step, compiled again)."""
    from nnxscan.pure.batching import _chunk_steps

    for steps, most in [(1320, 503), (96, 10), (2000, 504), (1319, 503), (7, 3), (5, 1)]:
        size = _chunk_steps(steps, most)
        assert 1 <= size <= most
        divisors = [d for d in range(max((most + 1) // 2, 2), most + 1) if steps % d == 0]
        assert size == (max(divisors) if divisors else most)


def test_make_epoch_checks_the_order_before_tracing(data):
    step = make_train_step(xent, TX)
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    opt_state = init_opt_state(TX, state)
    epoch = make_epoch(step, batch_size=BS)
    with pytest.raises(ValueError, match=r"shape \(10,\).*64 examples.*epoch_order"):
        epoch(graphdef, state, opt_state, data, epoch_order(0, 0, 10))
    with pytest.raises(TypeError, match=r"PRNG key.*or a signed integer order"):
        epoch(graphdef, state, opt_state, data, np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="needs a PRNG key or an order"):
        epoch(graphdef, state, opt_state, data, None)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_make_epoch_still_shuffles_on_the_device_with_a_key(data):
    """A typed key and a legacy uint32 key are keys, not orders: both permute the same."""
    step = make_train_step(xent, TX)
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    opt_state = init_opt_state(TX, state)
    epoch = jax.jit(make_epoch(step, batch_size=BS))
    order = np.asarray(jax.random.permutation(jax.random.key(3), 64), np.int32)
    by_order = epoch(graphdef, state, opt_state, data, order)
    by_key = epoch(graphdef, state, opt_state, data, jax.random.key(3))
    by_legacy = epoch(graphdef, state, opt_state, data, jax.random.PRNGKey(3))
    for other in (by_key, by_legacy):
        np.testing.assert_array_equal(np.asarray(other[2]), np.asarray(by_order[2]))


# -- one owner, one step counter --------------------------------------------------------------


def _stepped_optimizer(data, steps):
    """A model and nnx.Optimizer the user already trained ``steps`` steps in their own loop."""
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    reference_loop(model, optimizer, xent, epoch_batches(data, BS, 99, 0)[:steps])
    return model, optimizer


def test_the_optimizers_step_is_the_one_counter_through_fit(data):
    model, optimizer = _stepped_optimizer(data, 5)
    trainer = Trainer(model, optimizer, xent)
    assert trainer.step == 5
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    assert trainer.step == 13 and int(optimizer.step[...]) == 13
    # The user steps the optimizer in their own loop between fits: the trainer follows.
    reference_loop(model, optimizer, xent, epoch_batches(data, BS, 98, 0)[:2])
    assert trainer.step == 15
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    assert trainer.step == 23 == int(optimizer.step[...])


def test_scan_train_advances_the_optimizers_step(data):
    model, optimizer = _stepped_optimizer(data, 3)
    batches = epoch_batches(data, BS, 0, 0)[:4]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *batches)
    scan_train(model, optimizer, xent, stacked)
    assert int(optimizer.step[...]) == 7


def test_save_and_restore_keep_the_optimizers_step_exactly(data, tmp_path):
    model, optimizer = _stepped_optimizer(data, 5)
    trainer = Trainer(model, optimizer, xent)
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    path = trainer.save(tmp_path)
    assert path.name == "13"  # checkpoints are numbered by the one counter

    fresh = MLP(rngs=nnx.Rngs(1))
    fresh_opt = nnx.Optimizer(fresh, TX, wrt=nnx.Param)
    restored = Trainer(fresh, fresh_opt, xent)
    assert restored.restore(tmp_path) == 1
    assert restored.step == 13 == int(fresh_opt.step[...])
    assert_trees_close(fresh, model, exact=True)
    assert_trees_close(restored.opt_state, trainer.opt_state, exact=True)
    # Both go on identically from there.
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    restored.fit(data, epochs=1, batch_size=BS, progress=False)
    assert restored.step == trainer.step == 21
    assert_trees_close(fresh, model, exact=True)


def test_without_an_optimizer_the_trainer_counts_and_checkpoints_keep_it(data, tmp_path):
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    trainer.fit(data, epochs=2, batch_size=BS, progress=False)
    assert (trainer.step, trainer.epoch) == (16, 2)
    trainer.save(tmp_path)
    restored = Trainer(MLP(rngs=nnx.Rngs(1)), TX, xent)
    restored.restore(tmp_path)
    assert (restored.step, restored.epoch, restored.seed) == (16, 2, 0)


def test_counters_are_read_only_views_of_the_owner(data):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    for name in ("step", "epoch", "seed", "model", "optimizer", "opt_state"):
        with pytest.raises(AttributeError):
            setattr(trainer, name, 0)


# -- what the review of the reshape found ----------------------------------------------------


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_a_stop_at_the_first_step_of_a_call_leaves_the_objects_readable(data):
    """The halted call trained 0 steps but consumed the donated buffers: its output (the
    state before the bad step) must still be written back."""
    bad = {k: v.copy() for k, v in data.items()}
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    trainer = Trainer(model, optimizer, xent, on_nonfinite="stop", execution="scan")
    order = epoch_order(0, 0, 64)
    bad["x"][order[4 * BS]] = np.nan  # the first example of step 4: a call boundary
    with pytest.raises(FloatingPointError, match="global step 4"):
        trainer.fit(bad, epochs=1, batch_size=BS, steps_per_call=4, progress=False)
    assert trainer.step == 4 == int(optimizer.step[...])
    ref = MLP(rngs=nnx.Rngs(0))
    reference_loop(ref, nnx.Optimizer(ref, TX, wrt=nnx.Param), xent,
                   epoch_batches(data, BS, 0, 0)[:4])  # fmt: skip
    assert_trees_close(model, ref)  # readable, and at the state before the bad step
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)  # and trainable again


def test_call_hooks_see_the_trained_model_under_the_step_plan(data):
    seen = []

    def look(trainer, logs):
        kernel = np.asarray(nnx.state(trainer.model)["l1"]["kernel"][...])  # not deleted
        seen.append((logs["step"], trainer.step, float(kernel.sum())))

    from nnxscan.shell import LambdaCallback

    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent, execution="step")
    trainer.fit(data, epochs=1, batch_size=BS, progress=False,
                callbacks=[LambdaCallback(on_call_end=look)])  # fmt: skip
    assert [s[:2] for s in seen] == [(i, i) for i in range(1, 9)]
    assert len({s[2] for s in seen}) == 8  # the model moved every step


def test_saving_after_early_stopping_restored_the_best_epoch_keeps_the_best(data, tmp_path):
    from nnxscan.shell import EarlyStopping

    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, optax.sgd(5.0), xent)  # diverges after a few epochs
    stop = EarlyStopping("loss", patience=1, verbose=False)
    trainer.fit(data, epochs=8, batch_size=BS, progress=False, checkpoint_dir=tmp_path,
                callbacks=[stop])  # fmt: skip
    assert stop.best_epoch < trainer.epoch - 1  # it did rewind past the last checkpoint
    best = [np.array(x) for x in jax.tree.leaves(nnx.state(model))]
    trainer.save(tmp_path)
    fresh = Trainer(MLP(rngs=nnx.Rngs(1)), optax.sgd(5.0), xent)
    fresh.restore(tmp_path)
    for a, b in zip(best, jax.tree.leaves(nnx.state(fresh.model)), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


# -- fused epochs: the same steps, fewer host round trips ---------------------------------------


def test_fused_epochs_train_bitwise_what_separate_epochs_train(data):
    from nnxscan.shell import LambdaCallback

    per_epoch = LambdaCallback(on_epoch_end=lambda t, e, logs: None)  # forbids fusing
    separate, fused, halves = (MLP(rngs=nnx.Rngs(0)) for _ in range(3))
    h_sep = Trainer(separate, TX, xent).fit(
        data, epochs=4, batch_size=BS, progress=False, callbacks=[per_epoch]
    )
    h_fused = Trainer(fused, TX, xent).fit(data, epochs=4, batch_size=BS, progress=False)
    t = Trainer(halves, TX, xent)
    t.fit(data, epochs=2, batch_size=BS, progress=False)
    t.fit(data, epochs=2, batch_size=BS, progress=False)
    assert_trees_close(fused, separate, exact=True)
    assert_trees_close(halves, separate, exact=True)
    np.testing.assert_array_equal(h_fused.losses, h_sep.losses)
    assert [e["epoch"] for e in h_fused.epochs] == [0, 1, 2, 3]
    assert all(e["steps"] == 8 for e in h_fused.epochs)
    for a, b in zip(h_fused.epochs, h_sep.epochs, strict=True):
        assert a["loss"] == b["loss"]


def test_fused_groups_end_where_evaluation_runs(data, compile_count):
    from nnxscan.shell import LambdaCallback

    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    begun = []
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)  # compiles
    before = compile_count()
    history = trainer.fit(
        data, epochs=6, batch_size=BS, progress=False, eval_data=data,
        metric_fn=accuracy_metric, eval_every=2,
        callbacks=[LambdaCallback(on_train_begin=lambda t: begun.append(t.epoch))],
    )  # fmt: skip
    assert begun == [1]
    # Evaluation runs after global epochs 1, 3, 5 (every 2nd, counted across fits).
    assert [("eval_accuracy_metric" in e) for e in history.epochs] == [
        True, False, True, False, True, False,
    ]  # fmt: skip
    # Groups: epoch 1 alone, then 2-3, 4-5 fused, then 6: one new program for the pairs,
    # one for the evaluation, none per epoch.
    assert compile_count() - before <= 2


def accuracy_metric(model, batch):
    return (model(batch["x"]).argmax(-1) == batch["y"]).mean()


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_a_ctrl_c_between_fused_calls_counts_the_finished_epochs_and_the_next_fit_goes_on(
    data, monkeypatch
):
    """Three fused epochs of 8 steps run as 12 calls of 2 (``steps_per_call=2``, no hooks);
    a Ctrl-C lands in the 6th call (after it, 12 steps: epoch 0 and half of epoch 1). The
    trainer then counts epoch 1 at step 4 (it counted epoch 0 at step 12, and the next fit
    recursed without end), the error's History holds epoch 0, and the next fit trains the
    rest of epoch 1: bitwise a user's loop of two make_epoch calls."""
    import contextlib

    from nnxscan.shell._engine import calls

    entered = [0]

    @contextlib.contextmanager
    def ctrl_c_in_the_sixth_call():
        entered[0] += 1
        yield lambda: entered[0] == 6

    monkeypatch.setattr(calls, "held_interrupts", ctrl_c_in_the_sixth_call)
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent, execution="scan")
    options = dict(batch_size=BS, seed=5, steps_per_call=2, progress=False)
    with pytest.raises(KeyboardInterrupt) as caught:
        trainer.fit(data, epochs=3, **options)
    assert (trainer.step, trainer.epoch) == (12, 1)
    state, opt_state, want = _pure_loop(MLP, data, 2, seed=5)
    assert len(caught.value.history.epochs) == 1
    np.testing.assert_array_equal(caught.value.history.losses, want[:8])
    history = trainer.fit(data, epochs=1, **options)  # the rest of epoch 1
    assert (trainer.step, trainer.epoch) == (16, 2)
    assert_trees_close(model, state, exact=True)
    assert_trees_close(trainer.opt_state, opt_state, exact=True)
    np.testing.assert_array_equal(history.losses, want[12:])
