"""``unrolled_threefry``: a function's draws rewritten into JAX's threefry hash, unrolled.
The reference for every draw is ``jax.random`` itself (the same function, unwrapped): the
bits must be equal; the rewritten program must have no loop left for the hash; and the
steps nnxscan builds (so ``fit``) must apply it on the CPU when traced, not when called
eagerly."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import epoch_order, init_opt_state, make_epoch, make_train_step
from nnxscan.pure.threefry import unrolled_threefry
from nnxscan.shell import Trainer


def draws(key, x):
    """Every kind of draw a step makes: masks, noise, integers, permutations, narrow bits,
    splits into a grid of keys, folds."""
    k1, k2, k3 = jax.random.split(key, 3)
    mask = jax.random.bernoulli(jax.random.fold_in(k1, 7), 0.3, x.shape)
    return {
        "mask": mask,
        "masked": jnp.where(mask, x, 0.0),
        "noise": jax.random.normal(k2, (5, 3)),
        "ints": jax.random.randint(k3, (4,), 0, 1000),
        "order": jax.random.permutation(k3, 9),
        "bytes": jax.random.bits(k2, (3,), dtype=jnp.uint8),
        "halves": jax.random.bits(k1, (2,), dtype=jnp.uint16),
        "grid": jax.random.key_data(jax.random.split(k1, (2, 2))),
        "folded": jax.random.key_data(
            jax.vmap(lambda m: jax.random.fold_in(k3, m))(jnp.arange(3, dtype=jnp.uint32))
        ),
    }


def raw_key_draws(seed, x):
    """Old-style raw ``uint32`` keys (``jax.random.PRNGKey``)."""
    key = jax.random.PRNGKey(seed)
    return jax.random.uniform(jax.random.split(key)[1], x.shape) * x


def scanned(keys, x):
    def body(total, key):
        out = draws(key, x)
        return total + out["noise"].sum(), out

    return jax.lax.scan(body, 0.0, keys)


def assert_same(a, b):
    """Bits, keys, integers, masks and what they select: exactly. Values computed from the
    bits in floating point (a normal draw's inverse error function): to float rounding,
    since the two programs may fuse that arithmetic differently on another CPU."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(x, y)


X = jnp.arange(24.0).reshape(4, 6)
KEYS = jax.random.split(jax.random.key(3), 4)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
@pytest.mark.parametrize(
    "fn, args",
    [
        (draws, (jax.random.key(3), X)),
        (raw_key_draws, (jnp.uint32(5), X)),
        (scanned, (KEYS, X)),
        (jax.vmap(draws, in_axes=(0, None)), (KEYS, X)),
    ],
    ids=["draws", "raw_keys", "in_a_scan", "vmapped"],
)
def test_the_bits_are_jax_random_s(fn, args):
    expected = jax.jit(fn)(*args)
    assert_same(jax.jit(unrolled_threefry(fn))(*args), expected)
    assert_same(unrolled_threefry(fn)(*args), expected)  # unjitted too


def test_composes_with_vmap_and_grad():
    def loss(w, key):
        return jnp.sum(jax.random.normal(key, (3,)) * w**2)

    w, keys = jnp.arange(3.0), jax.random.split(jax.random.key(0), 5)
    expected = jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, keys)
    assert_same(jax.vmap(jax.grad(unrolled_threefry(loss)), in_axes=(None, 0))(w, keys), expected)
    assert_same(jax.jit(unrolled_threefry(jax.vmap(jax.grad(loss), (None, 0))))(w, keys), expected)


def test_no_loop_is_left_for_the_hash():
    key = jax.random.key(0)
    plain = jax.jit(lambda k: jax.random.bits(k, (8,))).lower(key).as_text()
    rewritten = jax.jit(unrolled_threefry(lambda k: jax.random.bits(k, (8,)))).lower(key)
    jaxpr = str(jax.make_jaxpr(unrolled_threefry(lambda k: jax.random.bits(k, (8,))))(key))
    assert "random_bits" not in jaxpr and "threefry2x32" not in jaxpr
    assert "stablehlo.while" not in rewritten.as_text()
    if jax.default_backend() == "cpu":  # where JAX lowers the hash as a loop
        assert "stablehlo.while" in plain


def test_rejects_what_is_not_a_function():
    with pytest.raises(TypeError, match="takes a function"):
        unrolled_threefry(3)


class Dropped(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(6, 3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.linear(self.dropout(x))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def dropout_data():
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(40, 6)).astype(np.float32),
        "y": rng.normal(size=(40, 3)).astype(np.float32),
    }


def test_fit_draws_what_the_per_step_nnx_loop_draws(dropout_data):
    """``fit`` (its loop's draws rewritten) against the plain per-step loop under
    ``nnx.jit`` (JAX's own draws): another program, so to float rounding; the dropout masks
    must be the same ones, or the parameters would be far apart."""
    model = Dropped(nnx.Rngs(0))
    Trainer(model, optax.sgd(0.1), mse).fit(
        dropout_data, epochs=1, batch_size=8, shuffle=False, progress=False
    )
    reference = Dropped(nnx.Rngs(0))
    optimizer = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        optimizer.update(model, nnx.grad(mse)(model, batch))

    for i in range(5):
        step(reference, optimizer, {k: v[8 * i : 8 * i + 8] for k, v in dropout_data.items()})
    got, want = nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_loop_of_pure_epochs_is_fit_bitwise_with_dropout(dropout_data):
    """The contract with draws in the step: ``jax.jit(make_epoch(...))`` of the user's own
    compiles the same loop body as ``fit`` (both rewrite the draws), so the same bits."""
    tx = optax.adam(1e-2)
    model = Dropped(nnx.Rngs(0))
    Trainer(model, tx, mse).fit(dropout_data, epochs=2, batch_size=8, seed=4, progress=False)
    graphdef, state = nnx.split(Dropped(nnx.Rngs(0)))
    opt_state = init_opt_state(tx, state)
    epoch = jax.jit(make_epoch(make_train_step(mse, tx), batch_size=8))
    for e in range(2):
        state, opt_state, _ = epoch(graphdef, state, opt_state, dropout_data, epoch_order(4, e, 40))
    got = jax.tree.leaves(nnx.state(model, nnx.Param))
    want = jax.tree.leaves(nnx.state(nnx.merge(graphdef, state), nnx.Param))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise on every CPU: the same program


def test_an_eager_call_of_a_built_step_compiles_nothing_new():
    """Called outside any trace, the step is the plain function: a rewrite there would
    lower and compile the whole step on every call."""
    tx = optax.sgd(0.1)
    step = make_train_step(mse, tx)
    graphdef, state = nnx.split(Dropped(nnx.Rngs(0)))
    batch = {"x": np.ones((8, 6), np.float32), "y": np.zeros((8, 3), np.float32)}
    opt_state = init_opt_state(tx, state)
    step.update(graphdef, state, opt_state, batch)  # op-by-op compiles happen once
    before = jax.config.jax_log_compiles
    compiled = []
    logger = logging.getLogger("jax")
    handler = logging.Handler()
    handler.emit = lambda record: compiled.append(record.getMessage())
    logger.addHandler(handler)
    try:
        jax.config.update("jax_log_compiles", True)
        step.update(graphdef, state, opt_state, batch)
    finally:
        jax.config.update("jax_log_compiles", before)
        logger.removeHandler(handler)
    assert not [m for m in compiled if "Compiling" in m], compiled


@pytest.mark.parametrize("partitionable", [False, True])
def test_a_local_threefry_partitionable_setting_is_kept(partitionable):
    """A draw traced under ``jax.threefry_partitionable(...)`` is expanded with that
    algorithm, as JAX's own lowering of it reads the setting recorded on the equation."""

    def fn(key):
        with jax.threefry_partitionable(partitionable):
            k1, k2 = jax.random.split(key)
            return jax.random.bits(k1, (5, 3)), jax.random.key_data(jax.random.fold_in(k2, 9))

    assert_same(jax.jit(unrolled_threefry(fn))(jax.random.key(7)), jax.jit(fn)(jax.random.key(7)))


def test_split_fold_in_and_scanned_draws_leave_no_loop():
    text = jax.jit(unrolled_threefry(scanned)).lower(KEYS, X).as_text()
    assert text.count("stablehlo.while") == 1  # the scan's own loop only


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the steps rewrite on the CPU only")
def test_built_steps_draw_unrolled_when_jitted(dropout_data):
    tx = optax.sgd(0.1)
    graphdef, state = nnx.split(Dropped(nnx.Rngs(0)))
    batch = {k: v[:8] for k, v in dropout_data.items()}
    step = make_train_step(mse, tx)
    lowered = jax.jit(step.update, static_argnums=0).lower(
        graphdef, state, init_opt_state(tx, state), batch
    )
    assert "stablehlo.while" not in lowered.as_text()
