"""init_opt_state against optax's own eager ``tx.init``: every leaf's bits, dtype, weak type
and placement, whether its constants were made on the host (nothing compiled) or the init
fell back to ``tx.init``."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import init_opt_state

TRANSFORMS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(3e-4, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "injected": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, b1=0.8),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4)),
    "masked": lambda: optax.masked(
        optax.adam(1e-3), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    ),
    # Inits that are not constants (the fallback): a copy of the params, a count of params.
    "ema_of_params": lambda: optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.array, p), optax.identity().update
    ),
    "from_values": lambda: optax.GradientTransformation(
        lambda p: jax.tree.map(lambda x: x * 0 + 1, p), optax.identity().update
    ),
}


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32):
        self.a = nnx.Linear(3, 5, rngs=rngs, param_dtype=dtype)
        self.b = nnx.Linear(5, 7, rngs=rngs, param_dtype=dtype)


def _assert_same(expected, got):
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        assert (b.shape, b.dtype, b.weak_type) == (a.shape, a.dtype, a.weak_type)
        assert np.asarray(b).tobytes() == np.asarray(a).tobytes()  # bitwise
        assert (b.sharding, b.committed) == (a.sharding, a.committed)


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_state_is_optaxs_eager_init_bit_for_bit_and_placed_alike(name, dtype):
    state = nnx.state(Net(nnx.Rngs(0), dtype))
    tx = TRANSFORMS[name]()
    _assert_same(tx.init(nnx.state(Net(nnx.Rngs(0), dtype), nnx.Param)), init_opt_state(tx, state))


def test_params_committed_to_the_device_get_moments_committed_there_and_a_free_count():
    state = jax.device_put(nnx.state(Net(nnx.Rngs(0))), jax.devices()[0])
    tx = optax.adam(1e-3)
    expected = tx.init(jax.device_put(nnx.state(Net(nnx.Rngs(0)), nnx.Param), jax.devices()[0]))
    got = init_opt_state(tx, state)
    _assert_same(expected, got)
    assert got[0].mu["a"]["kernel"].committed and not got[0].count.committed


def test_a_scalar_param_falls_back_where_its_moment_is_a_literal():
    # zeros_like of a committed scalar is committed; traced, it is a literal like the count.
    class WithScalar(Net):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.temperature = nnx.Param(jnp.ones(()))

    tx = optax.adam(1e-3)
    for put in (lambda x: x, lambda x: jax.device_put(x, jax.devices()[0])):
        state = put(nnx.state(WithScalar(nnx.Rngs(0))))
        _assert_same(tx.init(nnx.split_state(state, nnx.Param, ...)[0]), init_opt_state(tx, state))


def test_constant_inits_compile_nothing(compile_count):
    # Shapes no other test uses, so an eager init would compile a program per shape.
    model = nnx.Sequential(
        nnx.Linear(11, 13, rngs=nnx.Rngs(0)), nnx.Linear(13, 17, rngs=nnx.Rngs(1))
    )
    state = nnx.state(model)
    jax.block_until_ready(state)
    before = compile_count()
    opt_state = init_opt_state(optax.adam(1e-3), state)
    # The host path is the CPU's (pure/_host_init.py): on an accelerator a host copy is no
    # cheaper than a program, so there the init is ``tx.init`` itself, compiles and all.
    if jax.default_backend() == "cpu":
        assert compile_count() == before
    _assert_same(optax.adam(1e-3).init(nnx.state(model, nnx.Param)), opt_state)


def test_inside_a_trace_it_is_tx_init():
    state = nnx.state(Net(nnx.Rngs(0)))
    tx = optax.adam(1e-3)
    traced = jax.jit(lambda s: init_opt_state(tx, s))(state)
    eager = jax.jit(lambda s: tx.init(nnx.split_state(s, nnx.Param, ...)[0]))(state)
    _assert_same(eager, traced)


@pytest.mark.slow  # its own process: 4 simulated devices
def test_sharded_and_other_device_params_are_placed_as_tx_init_places_them(tmp_path):
    script = textwrap.dedent(
        """
        import jax, numpy as np, optax
        from flax import nnx
        from jax.sharding import NamedSharding, PartitionSpec as P
        from nnxscan.pure import init_opt_state

        mesh = jax.make_mesh((4,), ("model",))
        rngs = nnx.Rngs(0)
        model = nnx.Sequential(nnx.Linear(8, 12, rngs=rngs), nnx.Linear(12, 4, rngs=rngs))
        state = nnx.state(model)
        placements = {
            "sharded": lambda x: jax.device_put(
                x, NamedSharding(mesh, P(None, "model") if x.ndim == 2 else P("model"))),
            "replicated": lambda x: jax.device_put(x, NamedSharding(mesh, P())),
            "device 2": lambda x: jax.device_put(x, jax.devices()[2]),
        }
        for name, put in placements.items():
            placed = jax.tree.map(put, state)
            for tx in (optax.adam(1e-3), optax.sgd(0.1, momentum=0.9)):
                expected = tx.init(nnx.split_state(placed, nnx.Param, ...)[0])
                got = init_opt_state(tx, placed)
                assert jax.tree.structure(got) == jax.tree.structure(expected)
                for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
                    assert b.sharding == a.sharding and b.committed == a.committed, name
                    assert np.asarray(b).tobytes() == np.asarray(a).tobytes(), name
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
        cwd=pathlib.Path(__file__).parent,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_an_init_that_draws_a_key_runs_tx_init():
    tx = optax.GradientTransformation(
        lambda p: (jax.random.key(3), jax.tree.map(jnp.zeros_like, p)), optax.identity().update
    )
    state = nnx.state(Net(nnx.Rngs(0)))
    key, zeros = init_opt_state(tx, state)
    expected_key, expected_zeros = tx.init(nnx.state(Net(nnx.Rngs(0)), nnx.Param))
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(expected_key))
    _assert_same(expected_zeros, zeros)
