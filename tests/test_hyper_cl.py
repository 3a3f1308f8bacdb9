"""Conditional and chunked hypernetworks, conv targets, and continual learning.

References: hand-written numpy forwards of the documented formulas, central finite
differences in float64, closed-form gradients, the target module's own forward pass on
``nnx.update``d weights, the initializers' analytic variances, and a hand-written loop of the
pure core (``make_epoch`` over ``epoch_order``) for ``train_tasks``.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import epoch_order, hyper, init_opt_state, make_epoch, make_train_step
from nnxscan.shell import train_tasks

from hyper_models import MLP, as_arrays, mlp_reference


def make_trunk(din, features, seed, dtype=jnp.float32):
    linear = nnx.Linear(din, features, param_dtype=dtype, rngs=nnx.Rngs(seed))
    return nnx.Sequential(linear, nnx.tanh)


def to_f64(module):
    """The module's floating state cast to float64 (the graph is unchanged)."""
    graphdef, state = nnx.split(module)
    state = jax.tree.map(
        lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, state
    )
    return graphdef, state


def directional_fd_check(loss, state, seed=0):
    """The gradient's directional derivative against a central finite difference."""
    rng = np.random.default_rng(seed)
    direction = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), state)
    grad = jax.jit(jax.grad(loss))(state)
    pairs = zip(jax.tree.leaves(grad), jax.tree.leaves(direction), strict=True)
    analytic = sum(jnp.vdot(g, d) for g, d in pairs)
    eps = 1e-6

    def shifted(sign):
        return loss(jax.tree.map(lambda a, d: a + sign * eps * d, state, direction))

    numeric = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
    assert jnp.result_type(analytic) == jnp.float64
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6)
    return grad


class CNN(nnx.Module):
    """Conv 3x3 (1→4) → ReLU → 2x2 average pool → Linear(4·4·4 → 3), on 8x8 images."""

    def __init__(self, *, param_dtype=jnp.float32, rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), param_dtype=param_dtype, rngs=rngs)
        self.out = nnx.Linear(4 * 4 * 4, 3, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        h = nnx.avg_pool(nnx.relu(self.conv(x)), (2, 2), strides=(2, 2))
        return self.out(h.reshape(*h.shape[:-3], -1))


def chunked_reference(heads, spec, h):
    """ChunkedHeads' documented formula in numpy, from its Params: the flat vector."""
    p = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(heads)).items()}
    pre = h @ p["feature_kernel"] + p["chunk_embeddings"] @ p["embedding_kernel"]
    hidden = np.tanh(pre + p["hidden_bias"])
    hidden = hidden / np.sqrt(np.mean(hidden**2, axis=-1, keepdims=True) + 1e-6)
    raw = (hidden @ p["out_kernel"] + p["out_bias"]).reshape(-1)[: spec.size]
    sizes = [leaf.size for leaf in spec.leaves]
    tensor = np.repeat(np.arange(len(sizes)), sizes)
    return raw * p["gains"][tensor] + p["offsets"][tensor]


# -- conditional embeddings ------------------------------------------------------------------


@pytest.fixture(scope="module")
def conditional():
    target = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    return hyper.ConditionalHypernetwork(
        target, make_trunk(4, 16, 1), 16, num_conditions=5, embedding_features=4, rngs=nnx.Rngs(2)
    )


def test_conditional_generates_from_the_conditions_own_embedding(conditional):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), jnp.float32)
    linear = conditional.trunk.layers[0]
    heads = conditional.heads
    for c in (0, 3):
        e = conditional.embeddings[...][c]
        h = jnp.tanh(e @ linear.kernel[...] + linear.bias[...])
        by_hand = {"hidden": {}, "out": {}}
        for name, kernel, bias in zip(heads.paths, heads.kernels, heads.biases, strict=True):
            layer, leaf = name.split("/")
            by_hand[layer][leaf] = (h @ kernel[...]).reshape(bias.shape) + bias[...]
        want = mlp_reference(by_hand, x)
        np.testing.assert_allclose(conditional(c, x), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(conditional(jnp.int32(c), x), want, rtol=1e-5, atol=1e-6)
    batched = jax.jit(jax.vmap(conditional, in_axes=(0, None)))(jnp.arange(5), x)
    loop = np.stack([conditional(c, x) for c in range(5)])
    np.testing.assert_allclose(batched, loop, rtol=1e-5, atol=1e-6)
    assert not np.allclose(loop[0], loop[1], atol=1e-3)  # conditions differ


def test_conditional_with_a_free_input_joins_embedding_and_z():
    target = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    hnet = hyper.ConditionalHypernetwork(
        target, make_trunk(6, 16, 1), 16, num_conditions=3, embedding_features=4, z_features=2,
        rngs=nnx.Rngs(2),
    )  # fmt: skip
    z = jnp.array([0.5, -1.0])
    np.testing.assert_array_equal(
        hnet.embed(1, z), np.concatenate([np.asarray(hnet.embeddings[...][1]), z])
    )
    x = jnp.ones((4, 3))
    assert not np.allclose(hnet(1, x, z=z), hnet(1, x, z=-z), atol=1e-4)
    with pytest.raises(ValueError, match=r"z must have shape \(2,\).*got none"):
        hnet(1, x)


def test_conditional_rejects_bad_ids_and_mismatched_trunks(conditional):
    x = jnp.ones((2, 3))
    with pytest.raises(ValueError, match=r"condition 5 is out of range: ids are 0\.\.4"):
        conditional(5, x)
    with pytest.raises(ValueError, match=r"out of range"):
        conditional(-1, x)
    with pytest.raises(TypeError, match=r"integer id.*float"):
        conditional(1.0, x)
    with pytest.raises(ValueError, match=r"one id.*\(2,\).*vmap"):
        conditional(jnp.arange(2), x)
    with pytest.raises(ValueError, match=r"takes no z"):
        conditional(1, x, z=jnp.ones(2))
    # a traced id cannot be checked: out of range (either side) gives NaN, never another task
    traced = jax.jit(lambda c: conditional(c, x))
    assert np.isnan(traced(7)).all() and np.isnan(traced(-1)).all()
    assert np.isfinite(traced(4)).all()
    with pytest.raises(ValueError, match=r"map 3 input features.*trunk_features=16"):
        hyper.ConditionalHypernetwork(
            MLP(3, 8, 2, rngs=nnx.Rngs(0)), make_trunk(4, 16, 1), 16, num_conditions=2,
            embedding_features=3, rngs=nnx.Rngs(2),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"trunk_features=8, but it returns shape \(16,\)"):
        hyper.ConditionalHypernetwork(
            MLP(3, 8, 2, rngs=nnx.Rngs(0)), make_trunk(4, 16, 1), 8, num_conditions=2,
            embedding_features=4, rngs=nnx.Rngs(2),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"num_conditions must be at least 1, got 0"):
        hyper.ConditionalHypernetwork(
            MLP(3, 8, 2, rngs=nnx.Rngs(0)), make_trunk(4, 16, 1), 16, num_conditions=0,
            embedding_features=4, rngs=nnx.Rngs(2),
        )  # fmt: skip


@pytest.mark.parametrize("chunk_size", [None, 7], ids=["heads", "chunked"])
def test_gradients_through_conditional_generation_match_finite_differences(chunk_size):
    with jax.enable_x64(True):
        f64 = jnp.float64
        target = MLP(3, 5, 2, param_dtype=f64, rngs=nnx.Rngs(3))
        hnet = hyper.ConditionalHypernetwork(
            target, make_trunk(5, 6, 1, f64), 6, num_conditions=3, embedding_features=3,
            z_features=2, chunk_size=chunk_size, chunk_embedding_features=3, rngs=nnx.Rngs(4),
        )  # fmt: skip
        graphdef, state = to_f64(hnet)
        rng = np.random.default_rng(1)
        x = jnp.asarray(rng.normal(size=(7, 3)))
        zs = jnp.asarray(rng.normal(size=(2, 2)))

        @jax.jit
        def loss(state):
            net = nnx.merge(graphdef, state)
            y = jax.vmap(lambda c, z: net(c, x, z=z))(jnp.array([2, 0]), zs)
            return jnp.sum(jnp.sin(y) ** 2)

        grad = nnx.to_pure_dict(directional_fd_check(loss, state))
        del grad["target"]  # the generated slots: placeholders, never read by hnet(c, x)
        embedding_grad = np.asarray(grad.pop("embeddings"))
        assert np.all(embedding_grad[1] == 0) and np.any(embedding_grad[0] != 0)
        for path, g in jax.tree_util.tree_leaves_with_path(grad):
            assert np.any(np.asarray(g) != 0), f"zero gradient at {jax.tree_util.keystr(path)}"


# -- chunked generation ----------------------------------------------------------------------


def test_chunked_heads_compute_the_documented_formula():
    target = MLP(3, 8, 2, batchnorm=True, rngs=nnx.Rngs(0))
    spec = hyper.ParamSpec.from_module(target)
    heads = hyper.ChunkedHeads(spec, 5, chunk_size=16, embedding_features=3, rngs=nnx.Rngs(1))
    assert heads.num_chunks == math.ceil(spec.size / 16) and spec.size % 16 != 0
    h = np.random.default_rng(0).normal(size=5)
    # Train the gains and offsets away from their init so the check sees them.
    graphdef, state = nnx.split(heads)
    state["gains"][...] = jnp.linspace(0.1, 1.0, len(spec.leaves))
    state["offsets"][...] = jnp.linspace(-0.5, 0.5, len(spec.leaves))
    heads = nnx.merge(graphdef, state)
    got = hyper.ravel(heads(jnp.asarray(h, jnp.float32)))
    np.testing.assert_allclose(got, chunked_reference(heads, spec, h), rtol=1e-4, atol=1e-5)
    # the generated params run the target as its own weights would
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)), jnp.float32)
    reference = nnx.clone(target, arrays=True)
    params = heads(jnp.asarray(h, jnp.float32))
    nnx.update(reference, params)
    np.testing.assert_allclose(hyper.call(spec, params, x), reference(x), rtol=1e-5, atol=1e-6)


class Wide(nnx.Module):
    def __init__(self, rngs):
        he = nnx.initializers.he_normal()
        self.hidden = nnx.Linear(64, 128, kernel_init=he, rngs=rngs)  # Var = 2/64
        self.norm = nnx.LayerNorm(128, rngs=rngs)  # scale = 1, bias = 0
        self.out = nnx.Linear(128, 32, rngs=rngs)  # lecun_normal: Var = 1/128

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


@pytest.mark.parametrize(
    ("make_target", "analytic"),
    [
        (lambda: Wide(nnx.Rngs(0)), {"hidden/kernel": 2 / 64, "out/kernel": 1 / 128}),
        (lambda: CNN(rngs=nnx.Rngs(0)), {"conv/kernel": 1 / 9, "out/kernel": 1 / 64}),
    ],
    ids=["mlp", "cnn"],
)
@pytest.mark.parametrize("input_variance", [1.0, 4.0])
def test_chunked_init_gives_each_tensor_the_targets_own_variance(
    make_target, analytic, input_variance
):
    target = make_target()
    spec = hyper.ParamSpec.from_module(target)
    heads = hyper.ChunkedHeads(
        spec, 64, chunk_size=100, input_variance=input_variance, rngs=nnx.Rngs(1)
    )
    zs = np.sqrt(input_variance) * np.random.default_rng(0).normal(size=(256, 64))
    params = jax.jit(jax.vmap(heads))(zs.astype(np.float32))
    own = as_arrays(nnx.state(target, nnx.Param))
    for leaf, value in zip(spec.leaves, jax.tree.leaves(params), strict=True):
        layer, name = leaf.path
        target_value = np.asarray(own[layer][name], np.float64)
        if np.var(target_value) == 0:  # biases, norm scales: exactly the target's value
            np.testing.assert_array_equal(
                np.asarray(value), np.broadcast_to(target_value, value.shape)
            )
            continue
        ratio = float(np.var(np.asarray(value, np.float64))) / float(np.var(target_value))
        assert 0.8 < ratio < 1.25, (leaf.name, ratio)  # the target's own realized variance
        ratio = float(np.var(np.asarray(value, np.float64))) / analytic[leaf.name]
        assert 0.5 < ratio < 2.0, (leaf.name, ratio)  # the initializer's analytic variance


def test_compression_ratio_counts_the_hypernetworks_params_over_the_targets():
    target = MLP(64, 256, 10, rngs=nnx.Rngs(0))  # 19,210 generated scalars
    size = 64 * 256 + 256 + 256 * 10 + 10
    d_in, d_k, chunk, d_c, d_m = 8, 32, 256, 16, 32
    hnet = hyper.ConditionalHypernetwork(
        target, make_trunk(d_in, d_k, 1), d_k, num_conditions=10, embedding_features=d_in,
        chunk_size=chunk, chunk_embedding_features=d_c, chunk_hidden_features=d_m,
        rngs=nnx.Rngs(2),
    )  # fmt: skip
    chunks = math.ceil(size / chunk)
    by_hand = (
        10 * d_in  # condition embeddings
        + d_in * d_k + d_k  # trunk
        + chunks * d_c + d_k * d_m + d_c * d_m + d_m  # chunk embeddings, hidden layer
        + d_m * chunk + chunk  # shared output layer
        + 2 * 4  # a gain and an offset per generated tensor
    )  # fmt: skip
    assert hnet.compression_ratio == pytest.approx(by_hand / size)
    assert hnet.compression_ratio < 1
    small = MLP(3, 8, 2, rngs=nnx.Rngs(0))  # 50 scalars; one (d_k, n_t) head + bias each
    unchunked = hyper.Hypernetwork(small, make_trunk(d_in, d_k, 1), d_k, rngs=nnx.Rngs(2))
    trunk = d_in * d_k + d_k
    assert unchunked.compression_ratio == pytest.approx((trunk + d_k * 50 + 50) / 50)


def test_chunked_heads_reject_bad_sizes():
    spec = hyper.ParamSpec.from_module(MLP(3, 8, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=rf"chunk_size=100 is larger than the {spec.size}"):
        hyper.ChunkedHeads(spec, 4, chunk_size=100, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"chunk_size must be at least 1, got 0"):
        hyper.ChunkedHeads(spec, 4, chunk_size=0, rngs=nnx.Rngs(1))
    heads = hyper.ChunkedHeads(spec, 4, chunk_size=8, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"last axis of size 4, got shape \(5,\)"):
        heads(jnp.ones(5))


# -- conv targets ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 64], ids=["heads", "chunked"])
def test_generated_cnn_runs_like_the_cnn_with_those_weights_and_learns(chunk_size):
    target = CNN(rngs=nnx.Rngs(0))
    hnet = hyper.Hypernetwork(
        target, make_trunk(3, 16, 1), 16, chunk_size=chunk_size, rngs=nnx.Rngs(2)
    )
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(5, 8, 8, 1)), jnp.float32)
    z = jnp.array([0.3, -1.0, 0.5])
    params = hnet.generate(z)
    assert params["conv"]["kernel"].shape == (3, 3, 1, 4)
    reference = nnx.clone(target, arrays=True)
    nnx.update(reference, params)
    np.testing.assert_allclose(hnet(z, x), reference(x), rtol=1e-5, atol=1e-5)

    labels = jnp.asarray(rng.integers(0, 3, size=5))

    def loss(hnet, z, x):
        logits = hnet(z, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    graphdef, state = nnx.split(hnet, nnx.Param, ...)[0:2]
    rest = nnx.state(hnet, nnx.Not(nnx.Param))

    def loss_of(params):
        return loss(nnx.merge(graphdef, params, rest), z, x)

    before = float(loss_of(state))
    step = jax.jit(lambda p: jax.tree.map(lambda a, g: a - 0.05 * g, p, jax.grad(loss_of)(p)))
    for _ in range(10):
        state = step(state)
    assert float(loss_of(state)) < before / 2


# -- the continual-learning regularizer ------------------------------------------------------


def table_generate(table):
    """A 'hypernetwork' that looks its output up: generate(i) = {'w': table[i]}."""
    return lambda i: {"w": table[i]}


def test_regularizer_is_zero_without_drift_and_its_value_is_the_formula():
    table = jnp.asarray(np.random.default_rng(0).normal(size=(4, 6)), jnp.float32)
    stored = hyper.snapshot_generated(table_generate(table), jnp.arange(3))
    np.testing.assert_array_equal(stored, table[:3])
    assert float(hyper.output_regularizer(table_generate(table), jnp.arange(3), stored, 0.3)) == 0
    none = hyper.snapshot_generated(table_generate(table), jnp.arange(0))
    assert none.shape == (0, 6)
    assert float(hyper.output_regularizer(table_generate(table), jnp.arange(0), none, 0.3)) == 0

    drifted = table + 0.1 * jnp.arange(6.0)
    got = hyper.output_regularizer(table_generate(drifted), jnp.arange(3), stored, 0.3)
    diff = np.asarray(drifted[:3] - stored, np.float64)
    np.testing.assert_allclose(got, 0.3 * np.mean(np.sum(diff**2, axis=1)), rtol=1e-6)


def test_regularizer_gradient_is_the_closed_form_and_pulls_back_to_the_stored_weights():
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)
    stored = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)
    beta, n = 0.4, 3

    def reg(table):
        return hyper.output_regularizer(table_generate(table), jnp.arange(n), stored, beta)

    grad = jax.grad(reg)(table)
    closed_form = np.zeros((5, 7))
    closed_form[:n] = 2 * beta * (np.asarray(table[:n]) - np.asarray(stored)) / n
    np.testing.assert_allclose(grad, closed_form, rtol=1e-5, atol=1e-7)  # rows >= n: zero


def test_regularizer_on_a_hypernetwork_pulls_its_generated_weights_back():
    hnet = hyper.ConditionalHypernetwork(
        MLP(3, 8, 2, rngs=nnx.Rngs(0)), make_trunk(4, 16, 1), 16, num_conditions=4,
        embedding_features=4, chunk_size=10, rngs=nnx.Rngs(2),
    )  # fmt: skip
    earlier = jnp.arange(3)
    graphdef, params, rest = nnx.split(hnet, nnx.Param, ...)
    stored = jax.jit(
        lambda p: hyper.snapshot_generated(nnx.merge(graphdef, p, rest).generate, earlier)
    )(params)

    def reg(params):
        net = nnx.merge(graphdef, params, rest)
        return hyper.output_regularizer(net.generate, earlier, stored, 0.5)

    @jax.jit
    def step(params):  # one gradient step on the regularizer alone; its value before it
        value, grads = jax.value_and_grad(reg)(params)
        return jax.tree.map(lambda a, g: a - 0.02 * g, params, grads), value

    # Undrifted: nothing to pull back (zero up to the rounding between two compiled forwards).
    moved, value = step(params)
    assert float(value) < 1e-9
    shifts = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), moved, params)
    assert max(jax.tree.leaves(shifts)) < 1e-6

    # Drift: perturb every hypernetwork weight, then follow the regularizer's gradient.
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape), params)
    distances = []  # mean squared distance to the stored weights, = reg / beta
    for _ in range(4):
        params, value = step(params)
        distances.append(float(value) / 0.5)
    assert distances[0] > 0
    assert all(b < a for a, b in itertools.pairwise(distances)), distances


def test_regularizer_rejects_a_mismatched_snapshot_and_a_negative_beta():
    table = jnp.zeros((4, 6))
    stored = jnp.zeros((2, 6))
    with pytest.raises(ValueError, match=r"stored has shape \(2, 6\), but 3 inputs"):
        hyper.output_regularizer(table_generate(table), jnp.arange(3), stored, 0.1)
    with pytest.raises(ValueError, match=r"length 6, but stored rows have length 5"):
        hyper.output_regularizer(table_generate(table), jnp.arange(2), jnp.zeros((2, 5)), 0.1)
    with pytest.raises(ValueError, match=r"beta must be >= 0, got -0\.1"):
        hyper.output_regularizer(table_generate(table), jnp.arange(2), stored, -0.1)
    with pytest.raises(ValueError, match=r"leading axis.*not a scalar"):
        hyper.snapshot_generated(table_generate(table), jnp.int32(1))


# -- train_tasks ------------------------------------------------------------------------------


def toy_tasks(num_tasks=3, n_train=48, n_test=20, seed=0):
    """Task k: which side of a task-specific random hyperplane a 4-D point lies on."""
    rng = np.random.default_rng(seed)
    tasks = []
    for _ in range(num_tasks):
        w = rng.normal(size=4)
        pair = []
        for n in (n_train, n_test):
            x = rng.normal(size=(n, 4)).astype(np.float32)
            pair.append({"x": x, "y": (x @ w > 0).astype(np.int32)})
        tasks.append(tuple(pair))
    return tasks


def build_cl_hypernetwork():
    return hyper.ConditionalHypernetwork(
        MLP(4, 8, 2, rngs=nnx.Rngs(0)), make_trunk(3, 8, 1), 8, num_conditions=2,
        embedding_features=3, rngs=nnx.Rngs(2),
    )  # fmt: skip


def regularized_losses(t, hnet):
    earlier = jnp.arange(t)
    stored = hyper.snapshot_generated(hnet.generate, earlier)

    def loss_fn(hnet, batch):
        logits = hnet(t, batch["x"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return ce + hyper.output_regularizer(hnet.generate, earlier, stored, 0.1)

    return loss_fn


def task_accuracy(j):
    def accuracy(hnet, batch):
        return jnp.mean(hnet(j, batch["x"]).argmax(-1) == batch["y"])

    return accuracy


def test_train_tasks_accuracy_matrix_is_what_a_hand_written_loop_computes():
    tasks, tx, epochs, batch_size, seed = toy_tasks(2), optax.adam(1e-2), 3, 16, 5
    hnet = build_cl_hypernetwork()
    acc = train_tasks(
        hnet, tx, tasks, regularized_losses, task_accuracy, epochs=epochs,
        batch_size=batch_size, seed=seed, progress=False,
    )  # fmt: skip

    # The reference: the pure core by hand, a fresh optimizer state per task, accuracy in numpy.
    graphdef, state = nnx.split(build_cl_hypernetwork())
    predict = jax.jit(lambda state, j, x: nnx.merge(graphdef, state)(j, x))
    want = np.full((2, 2), np.nan)
    for t, (train, _) in enumerate(tasks):
        loss_fn = regularized_losses(t, nnx.merge(graphdef, state))
        epoch = jax.jit(make_epoch(make_train_step(loss_fn, tx), batch_size=batch_size))
        opt_state = init_opt_state(tx, state)
        for e in range(epochs):
            order = epoch_order(seed + t, e, len(train["y"]))
            state, opt_state, _ = epoch(graphdef, state, opt_state, train, order)
        for j in range(t + 1):
            test = tasks[j][1]
            logits = np.asarray(predict(state, j, test["x"]))
            want[t, j] = np.mean(logits.argmax(-1) == test["y"])

    np.testing.assert_allclose(acc, want, rtol=0, atol=1e-6)  # NaN above the diagonal too
    assert np.isnan(acc[0, 1]) and not np.isnan(acc[np.tril_indices(2)]).any()
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        as_arrays(nnx.state(hnet, nnx.Param)),
        as_arrays(nnx.state(nnx.merge(graphdef, state), nnx.Param)),
    )


def test_train_tasks_checks_every_task_before_training_any():
    tasks = toy_tasks(2)
    tasks[1] = (tasks[1][0], {"x": np.zeros((5, 4), np.float32), "y": np.zeros(4, np.int32)})
    hnet = build_cl_hypernetwork()
    before = as_arrays(nnx.state(hnet))
    with pytest.raises(ValueError, match=r"tasks\[1\] test data"):
        train_tasks(
            hnet, optax.adam(1e-2), tasks, regularized_losses, task_accuracy, epochs=1,
            batch_size=16, progress=False,
        )  # fmt: skip
    jax.tree.map(np.testing.assert_array_equal, as_arrays(nnx.state(hnet)), before)
    with pytest.raises(ValueError, match=r"batch_size 64 is larger than the number of examples 48"):
        train_tasks(
            hnet, optax.adam(1e-2), toy_tasks(2), regularized_losses, task_accuracy, epochs=1,
            batch_size=64, progress=False,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"tasks\[0\] must be a \(train_data, test_data\) pair"):
        train_tasks(
            hnet, optax.adam(1e-2), [tasks[0][0]], regularized_losses, task_accuracy,
            epochs=1, batch_size=16, progress=False,
        )  # fmt: skip
    with pytest.raises(TypeError, match=r"tx must be an optax"):
        train_tasks(hnet, "adam", tasks, regularized_losses, task_accuracy, epochs=1, batch_size=16)
