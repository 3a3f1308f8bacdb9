"""HyperHeads' init and the Hypernetwork module, trained with the core step and the Trainer.

References: the initializers' analytic variances, numpy statistics of the target's own
tensors, a hand-written trunk/heads/MLP forward, and the target module's own forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import hyper, init_opt_state, make_epoch, make_train_step

from hyper_models import MLP, Wide, as_arrays, mlp_reference

OUT_ONLY = nnx.All(nnx.Param, nnx.PathContains("out"))


def make_trunk(din, features, seed):
    return nnx.Sequential(nnx.Linear(din, features, rngs=nnx.Rngs(seed)), nnx.tanh)


def family_data(n, *, k=16, seed=0):
    """Tasks y = a·sin(x + b) + c on a grid of k points; the embedding is (a, b, c)."""
    rng = np.random.default_rng(seed)
    z = rng.uniform([0.5, -1.0, -0.5], [1.5, 1.0, 0.5], size=(n, 3)).astype(np.float32)
    x = np.broadcast_to(np.linspace(-2, 2, k, dtype=np.float32)[:, None], (n, k, 1))
    y = z[:, 0, None, None] * np.sin(x + z[:, 1, None, None]) + z[:, 2, None, None]
    return {"z": z, "x": np.ascontiguousarray(x), "y": y.astype(np.float32)}


def family_loss(model, batch):
    pred = jax.vmap(model)(batch["z"], batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)


# -- HyperHeads init --------------------------------------------------------------------------


def test_spec_measures_the_targets_own_tensors():
    target = Wide(nnx.Rngs(0))
    spec = hyper.ParamSpec.from_module(target)
    stats = {
        leaf.name: (float(m), float(v))
        for leaf, m, v in zip(spec.leaves, spec.init_mean, spec.init_var, strict=True)
    }
    kernel = np.asarray(target.out.kernel[...], np.float64)
    np.testing.assert_allclose(stats["out/kernel"], (kernel.mean(), kernel.var()), rtol=1e-4)
    assert stats["norm/scale"] == (1.0, 0.0)
    assert stats["out/bias"] == (0.0, 0.0)


@pytest.mark.parametrize("input_variance", [1.0, 4.0])
@pytest.mark.slow_on_accelerator("many eager draws for the variance: 13 s")
def test_generated_weights_have_the_target_initializers_variance(input_variance):
    target = Wide(nnx.Rngs(0))
    spec = hyper.ParamSpec.from_module(target)
    heads = hyper.HyperHeads(spec, 64, input_variance=input_variance, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    zs = np.sqrt(input_variance) * rng.normal(size=(256, 64)).astype(np.float32)
    params = nnx.to_pure_dict(jax.jit(jax.vmap(heads))(zs))

    for path, initializer_variance in [("hidden", 2 / 64), ("out", 1 / 128)]:
        ratio = float(jnp.var(params[path]["kernel"])) / initializer_variance
        assert 0.5 < ratio < 2.0, (path, ratio)
        np.testing.assert_array_equal(params[path]["bias"], 0.0)  # flax biases start at 0
    np.testing.assert_array_equal(params["norm"]["scale"], 1.0)
    np.testing.assert_array_equal(params["norm"]["bias"], 0.0)


# -- Hypernetwork ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    return MLP(1, 8, 1, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def hnet(target):
    return hyper.Hypernetwork(target, make_trunk(3, 16, 1), 16, rngs=nnx.Rngs(2))


def test_hypernetwork_runs_the_target_on_weights_from_trunk_and_heads(hnet):
    z = jnp.array([1.0, 0.5, -0.2])
    x = jnp.linspace(-2, 2, 5)[:, None]
    linear = hnet.trunk.layers[0]
    h = jnp.tanh(z @ linear.kernel[...] + linear.bias[...])
    by_hand = {"hidden": {}, "out": {}}
    heads = hnet.heads
    for name, kernel, bias in zip(heads.paths, heads.kernels, heads.biases, strict=True):
        layer, leaf = name.split("/")
        by_hand[layer][leaf] = (h @ kernel[...]).reshape(bias.shape) + bias[...]
    np.testing.assert_allclose(hnet(z, x), mlp_reference(by_hand, x), rtol=1e-5, atol=1e-6)
    assert hnet.spec.size == 1 * 8 + 8 + 8 * 1 + 1


def test_generated_slots_are_neither_params_nor_optimizer_state(target, hnet):
    param_paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(hnet, nnx.Param))]
    assert not any("target" in jax.tree_util.keystr(p) for p in param_paths)
    slots = as_arrays(nnx.state(hnet, hyper.GeneratedSlot))
    jax.tree.map(np.testing.assert_array_equal, slots["target"], as_arrays(nnx.state(target)))

    trunk_size = 3 * 16 + 16
    heads_size = 16 * 25 + 25  # one (16, *shape) kernel and one bias per generated tensor
    opt_state = init_opt_state(optax.adam(1e-3), nnx.state(hnet))
    mu = opt_state[0].mu
    assert sum(leaf.size for leaf in jax.tree.leaves(mu)) == trunk_size + heads_size


def test_hypernetwork_writes_batch_statistics_back_to_its_target():
    target = MLP(3, 8, 2, batchnorm=True, rngs=nnx.Rngs(0))
    hnet = hyper.Hypernetwork(target, make_trunk(4, 8, 1), 8, rngs=nnx.Rngs(2))
    z = jnp.array([0.1, -0.4, 0.3, 1.0])
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), jnp.float32)
    y = hnet(z, x)

    reference = nnx.clone(target, arrays=True)
    nnx.update(reference, hnet.generate(z))
    np.testing.assert_allclose(y, reference(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hnet.target.bn.mean[...], reference.bn.mean[...], rtol=1e-5)
    np.testing.assert_array_equal(target.bn.mean[...], np.zeros(8))  # user's target untouched


def test_core_step_trains_trunk_heads_and_own_hidden_layer_but_not_slots():
    target = MLP(1, 8, 1, rngs=nnx.Rngs(0))
    user_before = as_arrays(nnx.state(target))
    hnet = hyper.Hypernetwork(target, make_trunk(3, 16, 1), 16, wrt=OUT_ONLY, rngs=nnx.Rngs(2))
    before = as_arrays(nnx.state(hnet))
    assert set(before["target"]["hidden"]) == {"kernel", "bias"}

    tx = optax.adam(1e-2)
    graphdef, state = nnx.split(hnet)
    opt_state = init_opt_state(tx, state)
    epoch = jax.jit(make_epoch(make_train_step(family_loss, tx), batch_size=32))
    data = family_data(128)
    losses = []
    for i in range(6):
        state, opt_state, epoch_losses = epoch(graphdef, state, opt_state, data, jax.random.key(i))
        losses.extend(np.asarray(epoch_losses))
    after = as_arrays(state)

    assert losses[-1] < losses[0] / 2
    for trained in (("trunk",), ("heads",), ("target", "hidden")):
        old, new = before, after
        for key in trained:
            old, new = old[key], new[key]
        pairs = zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True)
        assert any(not np.array_equal(a, b) for a, b in pairs), trained
    jax.tree.map(np.testing.assert_array_equal, after["target"]["out"], before["target"]["out"])
    jax.tree.map(np.testing.assert_array_equal, as_arrays(nnx.state(target)), user_before)


@pytest.mark.slow
def test_trainer_learns_a_family_of_functions():
    from nnxscan.shell import Trainer

    target = MLP(1, 8, 1, rngs=nnx.Rngs(0))
    hnet = hyper.Hypernetwork(target, make_trunk(3, 32, 1), 32, rngs=nnx.Rngs(2))
    held_out = family_data(64, seed=1)
    held_out_before = float(family_loss(hnet, held_out))

    trainer = Trainer(hnet, optax.adam(1e-2), family_loss)
    history = trainer.fit(family_data(256), epochs=15, batch_size=32, progress=False)

    assert history.losses[0] >= 5 * history.epochs[-1]["loss"]
    assert held_out_before >= 5 * float(family_loss(hnet, held_out))  # hnet is the live model


@pytest.mark.slow
def test_hypernet_demo_trains_and_writes_a_png(tmp_path):
    from nnxscan.shell.demos.hypernet import run_hypernet_demo

    result = run_hypernet_demo(str(tmp_path), steps=32, seed=0, progress=False)
    assert result["plot"] == str((tmp_path / "nnxscan_demo_hypernet.png").resolve())
    with open(result["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert result["steps"] == 32
    assert result["loss"] < result["initial_loss"]
