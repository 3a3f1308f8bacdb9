"""A Population's members are built by one compiled program (``model_fn`` traced once under
a ``jax.vmap`` over the seeds), each member what ``model_fn(nnx.Rngs(seed))`` builds eagerly.

Every reference here is independent of nnxscan's build: each member built eagerly with
``nnx.split(model_fn(nnx.Rngs(seed)))``, its optax state ``init_opt_state(tx, state)`` and
its hyperparameters ``with_hyperparams``.

Bitwise or to a tolerance? The vmapped build draws the same threefry bits (the same keys,
by jax.random.key of a traced int32 seed, test below): keys, RNG counts, integers and
constant leaves (zeros, ones: a broadcast constant) are compared bitwise. A float leaf drawn
by an initialiser goes through float math after the bits (lecun_normal's truncated normal:
erf_inv; a normal: erf_inv too) that XLA compiles as part of ONE fused program instead of
Flax's op-by-op eager programs; on the 2-core AMD EPYC CPU these tests were written on the
MLP, BatchNorm + Dropout and Conv members came out bitwise equal, and an nnx.Embed's normal
init 1 ulp apart. XLA:CPU picks kernels per CPU model (and a TPU has its own erf_inv), so
those leaves are compared to rtol 1e-6, atol 1e-7: a few float32 ulps (eps 1.2e-7) of values
of size ~1, far below any wrong draw (another key or counter gives an unrelated value).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import (
    hyperparam_value,
    init_opt_state,
    make_train_step,
    unstack_states,
    with_hyperparams,
)
from nnxscan.shell import Population, Trainer
from nnxscan.shell._engine import member_build as members_module
from nnxscan.shell._engine.layout import Members
from nnxscan.shell._engine.member_build import build_members

from conftest import ACROSS_PROGRAMS, MLP, BNDropout, SmallCNN, make_data, xent

SEEDS = (0, 1, 7)
RATES = (1e-2, 3e-3, 1e-3)
# Float leaves an initialiser computed: a few float32 ulps (module doc).
FLOATS = dict(rtol=1e-6, atol=1e-7)
TX = optax.adam(1e-2)
INJECTED = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)


class DropoutMLP(nnx.Module):
    """Dropout drawing from call-time Rngs (``loss_fn(model, batch, rngs)``)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.3)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.l2(self.drop(nnx.relu(self.l1(x)), rngs=rngs))


def mlp(rngs: nnx.Rngs) -> nnx.Module:
    return MLP(rngs=rngs)


def counted(model_fn):
    """``model_fn`` that counts its calls (``.calls``): one trace builds every member."""

    def call(rngs):
        call.calls += 1
        return model_fn(rngs)

    call.calls = 0
    return call


def step_of(tx):
    """The built-in step of a loss with ``tx``, as a Population makes it (a build runs its
    ``init`` only)."""
    return make_train_step(lambda model, batch: 0.0, tx)


def bits(x) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def assert_member(stacked, index: int, reference, *, exact: bool = False):
    """Member ``index`` of ``stacked`` against its eager reference, leaf by leaf: the same
    structure, shapes and dtypes; keys, integers and constant leaves bitwise, other floats
    to :data:`FLOATS` (bitwise everywhere with ``exact``: the eager path itself)."""
    assert jax.tree.structure(stacked) == jax.tree.structure(reference)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(reference)]
    leaves = zip(paths, jax.tree.leaves(stacked), jax.tree.leaves(reference), strict=True)
    for path, got, want in leaves:
        got = got[index]
        assert got.shape == want.shape and got.dtype == want.dtype, path
        got, want = bits(got), bits(want)
        constant = want.size == 0 or (want == want.flat[0]).all()
        if exact or not np.issubdtype(want.dtype, np.floating) or constant:
            np.testing.assert_array_equal(got, want, err_msg=path)
        else:
            np.testing.assert_allclose(got, want, **FLOATS, err_msg=path)


def eager(model_fn, seed, tx=TX, **hyperparams):
    """The independent reference: ``(graphdef, state, opt_state)`` of one member."""
    graphdef, state = nnx.split(model_fn(nnx.Rngs(seed)))
    opt_state = init_opt_state(tx, state)
    if hyperparams:
        opt_state = with_hyperparams(opt_state, **hyperparams)
    return graphdef, state, opt_state


def test_a_traced_int32_seed_gives_the_python_ints_key():
    seeds = [0, 1, 7, 12345, 2**31 - 1]
    traced = jax.jit(jax.vmap(lambda s: jax.random.key_data(jax.random.key(s))))(
        np.asarray(seeds, np.int32)
    )
    for seed, data in zip(seeds, np.asarray(traced), strict=True):
        np.testing.assert_array_equal(data, jax.random.key_data(jax.random.key(seed)))


# -- the members are the eager builds ------------------------------------------------------


@pytest.fixture(scope="module")
def swept():
    """An MLP population with per-member learning rates (built once for the module), and
    copies of what the build made: a test that trains it may run first (any test order)."""
    model_fn = counted(lambda rngs: MLP(rngs=rngs))
    pop = Population(
        model_fn, INJECTED, xent, seeds=list(SEEDS), hyperparams={"learning_rate": RATES}
    )
    built = jax.tree.map(np.array, (pop.state, pop.opt_state))
    return pop, model_fn.calls, built


def test_mlp_members_with_adam_are_the_eager_builds():
    model_fn = counted(lambda rngs: MLP(rngs=rngs))
    pop = Population(model_fn, TX, xent, seeds=list(SEEDS))
    assert model_fn.calls == 1  # one trace, not one build per member
    state, opt_state = pop.state, pop.opt_state
    for i, seed in enumerate(SEEDS):
        graphdef, ref_state, ref_opt = eager(mlp, seed)
        assert pop.graphdef == graphdef
        assert_member(state, i, ref_state)
        assert_member(opt_state, i, ref_opt)


def test_per_member_hyperparams_are_written_into_each_members_optax_state(swept):
    _, calls, (state, opt_state) = swept
    assert calls == 2  # the name check's abstract build, then the one trace
    rates = hyperparam_value(opt_state, "learning_rate")
    assert rates.dtype == jnp.float32 and rates.shape == (3,)
    np.testing.assert_array_equal(rates, np.asarray(RATES, np.float32))
    for i, (seed, rate) in enumerate(zip(SEEDS, RATES, strict=True)):
        _, ref_state, ref_opt = eager(mlp, seed, INJECTED, learning_rate=rate)
        assert_member(state, i, ref_state)
        assert_member(opt_state, i, ref_opt)


@pytest.mark.slow_on_accelerator("members built one by one as the reference: 4.2 s")
@pytest.mark.parametrize("model_fn", [BNDropout, SmallCNN], ids=["batchnorm_dropout", "conv"])
def test_batchnorm_dropout_and_conv_members_with_their_rng_state(model_fn):
    pop = Population(lambda rngs: model_fn(rngs=rngs), TX, xent, seeds=list(SEEDS))
    for i, seed in enumerate(SEEDS):
        graphdef, ref_state, ref_opt = eager(lambda r: model_fn(rngs=r), seed)
        assert pop.graphdef == graphdef
        assert_member(pop.state, i, ref_state)
        assert_member(pop.opt_state, i, ref_opt)
    if model_fn is BNDropout:  # the dropout stream's key: each member's own, bitwise
        keys = [bits(k) for k in unstack_states(pop.state["drop"]["rngs"]["key"][...])]
        assert len({k.tobytes() for k in keys}) == len(SEEDS)


@pytest.mark.parametrize("kind", ["per_seed", "shared"])
def test_call_time_rngs_and_metrics_are_in_each_members_node(kind):
    """``rngs(seed)`` (called on the host per member) or one ``nnx.Rngs`` every member
    starts from, and the metrics template's state, in each member's node."""
    rngs = (lambda seed: nnx.Rngs(dropout=100 + seed)) if kind == "per_seed" else nnx.Rngs(5)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    model_fn = counted(lambda r: DropoutMLP(rngs=r))
    owner = build_members(
        model_fn, step_of(TX), SEEDS, {}, Members(len(SEEDS)), rngs=rngs, metrics=metrics
    )
    assert model_fn.calls == 1
    graphdef, state, members_state = owner.read()
    opt_state = members_state.inner  # the members' optax states, as vmap_members' init built
    for i, seed in enumerate(SEEDS):
        member_rngs = rngs(seed) if kind == "per_seed" else rngs
        node = (DropoutMLP(rngs=nnx.Rngs(seed)), member_rngs, metrics)
        ref_graphdef, ref_state = nnx.split(node)
        assert graphdef == ref_graphdef
        assert_member(state, i, ref_state)
        assert_member(opt_state, i, init_opt_state(TX, ref_state))
    assert owner.model_graphdef == nnx.split(DropoutMLP(rngs=nnx.Rngs(0)))[0]
    assert owner.with_rngs and owner.metrics is metrics


# -- what one trace cannot build: one by one, as before --------------------------------------


def orthogonal_mlp(rngs: nnx.Rngs) -> MLP:
    """Orthogonal rows for the first layer, by a QR decomposition on the host with numpy:
    reads a parameter's values, which a trace does not have."""
    model = MLP(rngs=rngs)
    q, _ = np.linalg.qr(np.asarray(model.l1.kernel[...]).T)
    model.l1.kernel[...] = jnp.asarray(q.T)
    return model


PRETRAINED = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)


def pretrained_mlp(rngs: nnx.Rngs) -> MLP:
    """Loads numpy weights into the first layer: traceable (they are constants)."""
    model = MLP(rngs=rngs)
    model.l1.kernel[...] = jnp.asarray(PRETRAINED)
    return model


def test_a_model_fn_that_reads_values_on_the_host_is_built_one_by_one():
    model_fn = counted(orthogonal_mlp)
    owner = build_members(model_fn, step_of(TX), SEEDS, {}, Members(len(SEEDS)))
    assert model_fn.calls == 1 + len(SEEDS)  # the trace that failed, then each member
    _, state, members_state = owner.read()
    opt_state = members_state.inner
    for i, seed in enumerate(SEEDS):
        _, ref_state, ref_opt = eager(orthogonal_mlp, seed)
        assert_member(state, i, ref_state, exact=True)  # the same eager ops
        assert_member(opt_state, i, ref_opt, exact=True)
    # Loading numpy weights is traceable: one trace, the weights every member's.
    model_fn = counted(pretrained_mlp)
    _, state, _ = build_members(model_fn, step_of(TX), SEEDS, {}, Members(len(SEEDS))).read()
    assert model_fn.calls == 1
    for i, seed in enumerate(SEEDS):
        assert_member(state, i, eager(pretrained_mlp, seed)[1])
        np.testing.assert_array_equal(state["l1"]["kernel"][i], PRETRAINED)


def test_a_closed_over_rngs_drawn_from_is_built_one_by_one():
    """Each member advances the shared stream, as it does eagerly."""
    shared = nnx.Rngs(3)
    model_fn = counted(lambda rngs: MLP(rngs=shared))
    _, state, _ = build_members(model_fn, step_of(TX), SEEDS, {}, Members(len(SEEDS))).read()
    assert model_fn.calls == 1 + len(SEEDS)
    expected = nnx.Rngs(3)
    for i in range(len(SEEDS)):
        np.testing.assert_array_equal(state["l1"]["kernel"][i], MLP(rngs=expected).l1.kernel[...])


def test_hijax_variables_which_vmap_cannot_batch_are_built_one_by_one():
    """flax 0.12.8 has no batching rule for creating a hijax Variable of a batched value
    (every Variable, under ``nnx.var_defaults(hijax=True)``: Population itself builds
    under plain defaults, so this is build_members called in such a context)."""
    model_fn = counted(mlp)
    with nnx.var_defaults(hijax=True):
        owner = build_members(model_fn, step_of(TX), SEEDS, {}, Members(len(SEEDS)))
        references = [nnx.with_vars(MLP(rngs=nnx.Rngs(seed)), hijax=False) for seed in SEEDS]
    assert model_fn.calls >= len(SEEDS)  # each member (the trace fails making its Rngs)
    for i, reference in enumerate(references):
        assert_member(owner.read()[1], i, nnx.split(reference)[1], exact=True)


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_a_seed_dependent_structure_still_names_the_member():
    """A width drawn per member (a random architecture search) is a read of a value on
    the host: the trace fails, and the one-by-one build names the member that differs."""

    def random_width(rngs):
        return MLP(hidden=int(jax.random.randint(rngs.params(), (), 4, 12)), rngs=rngs)

    with pytest.raises(ValueError, match=r"model_fn built member \d \(seed \d\) with a different"):
        Population(random_width, TX, xent, seeds=list(range(6)))


def test_a_model_fns_own_error_is_raised_with_its_own_message():
    calls = []

    def broken(rngs):
        calls.append(1)
        raise ValueError("this checkpoint has 3 layers, the config says 4")

    with pytest.raises(ValueError, match="3 layers, the config says 4"):
        build_members(broken, step_of(TX), SEEDS, {}, Members(len(SEEDS)))
    assert len(calls) == 1  # raised from the trace, not retried member by member
    with pytest.raises(TypeError, match=r"returned int, not an nnx\.Module"):
        build_members(lambda rngs: 3, step_of(TX), SEEDS, {}, Members(len(SEEDS)))


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_seeds_outside_int32_and_disable_jit_are_built_one_by_one():
    model_fn = counted(lambda rngs: MLP(rngs=rngs))
    seeds = (1, 2**31)
    _, state, _ = build_members(model_fn, step_of(TX), seeds, {}, Members(len(seeds))).read()
    assert model_fn.calls == len(seeds)  # no trace
    for i, seed in enumerate(seeds):
        assert_member(state, i, eager(mlp, seed)[1], exact=True)
    model_fn.calls = 0
    with jax.disable_jit():  # debugging: everything eagerly, as before
        build_members(model_fn, step_of(TX), SEEDS, {}, Members(len(SEEDS)))
    assert model_fn.calls == len(SEEDS)


# -- one program; the same training ----------------------------------------------------------


@pytest.mark.slow_on_accelerator("a population built from cleared caches")
def test_building_members_compiles_one_program(compile_count, monkeypatch):
    from nnxscan.pure import build

    # Options every XLA takes: a newer one refuses the older fusion emitter's, and that
    # refused attempt is reported as a compile of its own.
    monkeypatch.setattr(build, "_ONCE_WHERE_KNOWN", build._ONCE)
    model_fn = counted(lambda rngs: MLP(din=5, rngs=rngs))  # shapes no other test built
    tx = optax.adam(1e-3)
    build_members(model_fn, step_of(tx), (0, 1), {}, Members(2))  # anything eager compiles here
    model_fn.calls = 0
    before = compile_count()
    owner = build_members(model_fn, step_of(tx), tuple(range(16)), {}, Members(16))
    assert compile_count() - before == 1  # the build program (not 16 builds)
    assert model_fn.calls == 1
    assert owner.read()[1]["l1"]["kernel"].shape == (16, 5, 8)


def test_an_xla_that_refuses_the_compile_options_builds_with_those_it_knows(monkeypatch):
    from nnxscan.pure import build

    monkeypatch.setitem(build._ONCE_WHERE_KNOWN, "xla_no_such_option_here", True)
    _, state, _ = build_members(
        lambda r: MLP(hidden=6, rngs=r), step_of(TX), (0, 1), {}, Members(2)
    ).read()
    for i, seed in enumerate((0, 1)):
        assert_member(state, i, eager(lambda r: MLP(hidden=6, rngs=r), seed)[1])


def test_a_build_drawing_many_entries_draws_them_through_the_unrolled_hash(monkeypatch):
    """Past ``_UNROLL_FROM`` entries (here: any) a CPU build's draws go through
    ``unrolled_threefry``: the same bits, so the same members."""
    wrapped = []
    real = members_module.unrolled_threefry
    monkeypatch.setattr(members_module, "_UNROLL_FROM", 0)
    monkeypatch.setattr(
        members_module, "unrolled_threefry", lambda fn: wrapped.append(fn) or real(fn)
    )
    owner = build_members(
        lambda r: BNDropout(hidden=6, rngs=r), step_of(TX), SEEDS, {}, Members(len(SEEDS))
    )
    assert len(wrapped) == (jax.default_backend() == "cpu")
    for i, seed in enumerate(SEEDS):
        _, ref_state, ref_opt = eager(lambda r: BNDropout(hidden=6, rngs=r), seed)
        assert_member(owner.read()[1], i, ref_state)
        assert_member(owner.read()[2].inner, i, ref_opt)


def test_the_one_by_one_build_and_the_traced_build_agree():
    """The path kept for what cannot be traced gives the same owner (graphdefs, counters,
    states) as the traced one."""
    args = (lambda r: BNDropout(rngs=r), step_of(INJECTED), SEEDS, {"learning_rate": RATES},
            Members(len(SEEDS)))  # fmt: skip
    traced, eager_owner = build_members(*args), build_members(*args, one_by_one=True)
    assert traced.graphdef == eager_owner.graphdef
    assert traced.model_graphdef == eager_owner.model_graphdef
    assert (traced.seeds, traced.hyperparams) == (eager_owner.seeds, eager_owner.hyperparams)
    for tree in (1, 2):
        stacked, reference = traced.read()[tree], eager_owner.read()[tree]
        for i in range(len(SEEDS)):
            assert_member(stacked, i, jax.tree.map(lambda x, i=i: x[i], reference))


def test_training_is_each_members_trainer_run(swept):
    pop, _, _ = swept
    data = make_data()
    history = pop.fit(data, epochs=2, batch_size=8, progress=False)
    for i, (seed, rate) in enumerate(zip(SEEDS, RATES, strict=True)):
        tx = optax.inject_hyperparams(optax.adam)(learning_rate=rate)
        alone = Trainer(MLP(rngs=nnx.Rngs(seed)), tx, xent).fit(
            data, epochs=2, batch_size=8, seed=seed, progress=False
        )
        np.testing.assert_allclose(history.losses[:, i], alone.losses, **ACROSS_PROGRAMS)
