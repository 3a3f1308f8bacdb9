"""Conditional and chunked hypernetworks, conv targets, and continual learning.

References: hand-written numpy forwards of the documented formulas, central finite
differences in float64, closed-form gradients, the target module's own forward pass on
``nnx.update``d weights, the initializers' analytic variances, and a hand-written loop of the
pure core (``make_epoch`` over ``epoch_order``) for ``train_tasks``.
"""

from __future__ import annotations

import functools
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

from conftest import float64_checks, tolerance
from hyper_models import MLP, Wide, as_arrays


@nnx.jit
def forward(module, *args):
    """``module(*args)``, compiled (eager calls compile every small op on its own)."""
    return module(*args)


@functools.partial(nnx.jit, static_argnums=1)
def forward_concrete_id(hnet, condition, x):
    """``hnet(condition, x)`` compiled with the id a Python int: the checked, concrete path."""
    return hnet(condition, x)


@nnx.jit
def generate(hnet, *args):
    return hnet.generate(*args)


def make_trunk(din, features, seed, dtype=jnp.float32):
    linear = nnx.Linear(din, features, param_dtype=dtype, rngs=nnx.Rngs(seed))
    return nnx.Sequential(linear, nnx.tanh)


def to_f64(module):
    """The module's floating state cast to float64 (the graph is unchanged)."""
    graphdef, state = nnx.split(module)
    state = jax.tree.map(
        lambda a: np.asarray(a, np.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, state
    )
    return graphdef, state


def directional_fd_check(loss, state, seed=0):
    """The gradient's directional derivative against a central finite difference.

    ``loss`` is jitted; the shifts and the dot product are numpy (float64), so nothing
    compiles eagerly op by op.
    """
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(state)
    leaves = [np.asarray(a) for a in leaves]
    direction = [rng.normal(size=a.shape) for a in leaves]
    grad = jax.jit(jax.grad(loss))(state)
    assert {np.asarray(g).dtype for g in jax.tree.leaves(grad)} == {np.dtype(np.float64)}
    pairs = zip(jax.tree.leaves(grad), direction, strict=True)
    analytic = sum(np.vdot(np.asarray(g), d) for g, d in pairs)
    eps = 1e-6

    def shifted(sign):
        moved = [a + sign * eps * d for a, d in zip(leaves, direction, strict=True)]
        return float(loss(jax.tree.unflatten(treedef, moved)))

    numeric = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
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


def chunked_reference(heads, spec, h, order="units", condition=None, own_order=False):
    """ChunkedHeads' documented formula in numpy, from its Params: ``hyper.ravel`` of the
    generated params. With ``order="units"`` a kernel ``(..., out)`` is read from the flat
    vector as ``(out, ...)`` (each output unit's fan-in contiguous). ``own_order``: the
    heads' own vector instead, every piece as the chunks hold it (no axis moved)."""
    p = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(heads)).items()}
    table = p["chunk_embeddings"] if condition is None else p["chunk_embeddings"][condition]
    pre = h @ p["feature_kernel"] + table @ p["embedding_kernel"]
    hidden = np.tanh(pre + p["hidden_bias"])
    hidden = hidden / np.sqrt(np.mean(hidden**2, axis=-1, keepdims=True) + 1e-6)
    raw = (hidden @ p["out_kernel"] + p["out_bias"]).reshape(-1)[: spec.size]
    pieces, start = [], 0
    for t, leaf in enumerate(spec.leaves):
        piece = raw[start : start + leaf.size] * p["gains"][t] + p["offsets"][t]
        if order == "units" and len(leaf.shape) >= 2 and not own_order:
            piece = np.moveaxis(piece.reshape(leaf.shape[-1], *leaf.shape[:-1]), 0, -1)
        pieces.append(piece.reshape(-1))
        start += leaf.size
    return np.concatenate(pieces)


# -- conditional embeddings ------------------------------------------------------------------


@pytest.fixture(scope="module")
def conditional():
    target = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    return hyper.ConditionalHypernetwork(
        target, make_trunk(4, 16, 1), 16, num_conditions=5, embedding_features=4, rngs=nnx.Rngs(2)
    )


def numpy_mlp(p, x):
    """The plain MLP written by hand in numpy on a nested dict of arrays."""
    h = np.tanh(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
    return h @ p["out"]["kernel"] + p["out"]["bias"]


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_conditional_generates_from_the_conditions_own_embedding(conditional):
    x = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)
    p = as_arrays(nnx.state(conditional, nnx.Param))
    linear, heads = p["trunk"]["layers"][0], p["heads"]
    want = []
    for c in range(5):
        h = np.tanh(p["embeddings"][c] @ linear["kernel"] + linear["bias"])
        by_hand = {"hidden": {}, "out": {}}
        for i, name in enumerate(conditional.heads.paths):
            layer, leaf = name.split("/")
            bias = heads["biases"][i]
            by_hand[layer][leaf] = (h @ heads["kernels"][i]).reshape(bias.shape) + bias
        want.append(numpy_mlp(by_hand, x))
    for c in (0, 3):  # a Python int (checked, concrete) and a traced int32
        np.testing.assert_allclose(
            forward_concrete_id(conditional, c, x), want[c], rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            forward(conditional, jnp.int32(c), x), want[c], rtol=1e-5, atol=1e-6
        )
    batched = jax.jit(jax.vmap(conditional, in_axes=(0, None)))(jnp.arange(5), x)
    np.testing.assert_allclose(batched, np.stack(want), rtol=1e-5, atol=1e-6)
    assert not np.allclose(want[0], want[1], atol=1e-3)  # conditions differ


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_conditional_with_a_free_input_joins_embedding_and_z():
    target = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    hnet = hyper.ConditionalHypernetwork(
        target, make_trunk(6, 16, 1), 16, num_conditions=3, embedding_features=4, z_features=2,
        rngs=nnx.Rngs(2),
    )  # fmt: skip
    z = np.array([0.5, -1.0], np.float32)
    np.testing.assert_array_equal(
        hnet.embed(1, z), np.concatenate([np.asarray(hnet.embeddings[...][1]), z])
    )
    x = jnp.ones((4, 3))
    with_z = nnx.jit(lambda hnet, z: hnet(1, x, z=z))
    assert not np.allclose(with_z(hnet, z), with_z(hnet, -z), atol=1e-4)
    with pytest.raises(ValueError, match=r"z must have shape \(2,\).*got none"):
        hnet(1, x)
    with pytest.raises(ValueError, match=r"got none\. Pass it by keyword.*z=z"):
        hnet(1, x, z)  # positional: goes to the target, so z is missing
    with pytest.raises(ValueError, match=r"got shape \(3,\)\. For a batch of z, jax\.vmap"):
        hnet(1, x, z=jnp.ones(3))


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


def test_a_bad_id_under_plain_vmap_gives_nan_rows_and_under_grad_nan_gradients(conditional):
    x = jnp.ones((2, 3))
    ids = jnp.array([1, 7, -2, 4])  # vmap traces the ids: no jit needed to get here
    ys = np.asarray(jax.vmap(conditional, in_axes=(0, None))(ids, x))
    assert np.isfinite(ys[[0, 3]]).all() and np.isnan(ys[[1, 2]]).all()
    np.testing.assert_allclose(ys[0], forward(conditional, 1, x), rtol=1e-6, atol=1e-7)

    # One bad id in a batch: every gradient of the shared weights is NaN (as documented).
    graphdef, params, rest = nnx.split(conditional, nnx.Param, ...)

    def loss(params, ids):
        net = nnx.merge(graphdef, params, rest)
        return jnp.mean(jax.vmap(net, in_axes=(0, None))(ids, x) ** 2)

    grad_of = jax.jit(jax.grad(loss))
    grads = grad_of(params, jnp.array([1, 7]))
    shared = as_arrays(nnx.State({"trunk": grads["trunk"], "heads": grads["heads"]}))
    assert all(np.isnan(g).all() for g in jax.tree.leaves(shared))
    good = as_arrays(grad_of(params, jnp.array([1, 4])))
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(good))


def test_param_dtype_reaches_the_heads_and_chunk_options_need_chunk_size():
    for chunk_size in (None, 10):  # dtypes are shapes' business: built abstractly
        hnet = nnx.eval_shape(
            lambda chunk_size=chunk_size: hyper.ConditionalHypernetwork(
                MLP(3, 8, 2, rngs=nnx.Rngs(0)), make_trunk(4, 16, 1), 16, num_conditions=2,
                embedding_features=4, chunk_size=chunk_size, param_dtype=jnp.bfloat16,
                rngs=nnx.Rngs(2),
            )
        )  # fmt: skip
        dtypes = {a.dtype for a in jax.tree.leaves(nnx.state(hnet.heads, nnx.Param))}
        assert dtypes == {jnp.dtype(jnp.bfloat16)}, (chunk_size, dtypes)
        assert nnx.state(hnet, nnx.Param)["embeddings"].get_value().dtype == jnp.bfloat16
        # the target's own dtype is kept: generated params are cast to it
        params = nnx.eval_shape(lambda hnet: hnet.generate(1), hnet)
        assert params["out"]["kernel"].dtype == jnp.float32

    conditional = {"num_conditions": 2, "embedding_features": 4}
    for cls, extra in ((hyper.Hypernetwork, {}), (hyper.ConditionalHypernetwork, conditional)):
        for name in ("chunk_embedding_features", "chunk_hidden_features"):
            with pytest.raises(ValueError, match=rf"^{name} only shape chunked heads.*chunk_size"):
                cls(
                    MLP(3, 8, 2, rngs=nnx.Rngs(0)), make_trunk(4, 16, 1), 16, **{name: 8},
                    **extra, rngs=nnx.Rngs(2),
                )  # fmt: skip


@pytest.mark.parametrize("chunk_size", [None, 7], ids=["heads", "chunked"])
@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_gradients_through_conditional_generation_match_finite_differences(chunk_size):
    with float64_checks():
        f64 = jnp.float64
        target = MLP(3, 5, 2, param_dtype=f64, rngs=nnx.Rngs(3))
        hnet = hyper.ConditionalHypernetwork(
            target, make_trunk(5, 6, 1, f64), 6, num_conditions=3, embedding_features=3,
            z_features=2, chunk_size=chunk_size, rngs=nnx.Rngs(4),
            **({} if chunk_size is None else {"chunk_embedding_features": 3}),
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


@pytest.mark.parametrize("order", ["units", "ravel"])
def test_chunked_heads_compute_the_documented_formula(order):
    target = MLP(3, 8, 2, batchnorm=True, rngs=nnx.Rngs(0))
    spec = hyper.ParamSpec.from_module(target)
    heads = hyper.ChunkedHeads(
        spec, 5, chunk_size=16, embedding_features=3, order=order, rngs=nnx.Rngs(1)
    )
    assert heads.num_chunks == math.ceil(spec.size / 16) and spec.size % 16 != 0
    h = np.random.default_rng(0).normal(size=5)
    # Train the gains and offsets away from their init so the check sees them.
    graphdef, state = nnx.split(heads)
    state["gains"][...] = np.linspace(0.1, 1.0, len(spec.leaves), dtype=np.float32)
    state["offsets"][...] = np.linspace(-0.5, 0.5, len(spec.leaves), dtype=np.float32)
    heads = nnx.merge(graphdef, state)
    params = forward(heads, h.astype(np.float32))
    got = hyper.ravel(params)
    np.testing.assert_allclose(got, chunked_reference(heads, spec, h, order), rtol=1e-4, atol=1e-5)
    # the generated params run the target as its own weights would
    x = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    reference = nnx.clone(target, arrays=True)
    nnx.update(reference, params)
    np.testing.assert_allclose(
        jax.jit(hyper.call)(spec, params, x), forward(reference, x), rtol=1e-5, atol=1e-6
    )


@functools.partial(jax.jit, static_argnums=0)
def generate_per_draw(graphdef, states, hs):
    """For each stacked draw of the heads: its params and raw vector for every ``h``."""

    def one(state):
        heads = nnx.merge(graphdef, state)
        return jax.vmap(heads)(hs), jax.vmap(heads.flat)(hs)

    return jax.vmap(one)(states)


@pytest.mark.parametrize(
    ("make_target", "analytic"),
    [
        (lambda: Wide(nnx.Rngs(0)), {"hidden/kernel": 2 / 64, "out/kernel": 1 / 128}),
        (lambda: CNN(rngs=nnx.Rngs(0)), {"conv/kernel": 1 / 9, "out/kernel": 1 / 64}),
    ],
    ids=["mlp", "cnn"],
)
@pytest.mark.slow  # the chunked heads' shapes and gradients stay in the fast lane
def test_chunked_init_gives_each_tensor_the_targets_own_variance(make_target, analytic):
    """The init matches each tensor's variance in expectation over the heads' draw.

    One draw's ratio has a spread (all of a tensor's entries share the draw's output
    columns and chunk terms ``c_i · W_c``, the same for every ``h``): over 40 draws the
    36-entry conv kernel ranged 0.68-1.45. So: the exact identities the init is built on
    for every draw, and the variance ratio averaged over 16 draws with a tight bound.
    """
    target = make_target()
    spec = hyper.ParamSpec.from_module(target)
    own = as_arrays(nnx.state(target, nnx.Param))
    targets = [np.asarray(own[leaf.path[0]][leaf.path[1]], np.float64) for leaf in spec.leaves]
    # spec.init_var is the target's own realized variance (and init_mean its mean)
    np.testing.assert_allclose(spec.init_var, [np.var(t) for t in targets], rtol=1e-5)
    np.testing.assert_allclose(spec.init_mean, [np.mean(t) for t in targets], atol=1e-6)
    draws = 16
    all_heads = [
        hyper.ChunkedHeads(spec, 64, chunk_size=100, rngs=nnx.Rngs(s)) for s in range(draws)
    ]
    constant = np.asarray(spec.init_var) == 0
    for heads in all_heads:  # exact, for every draw
        np.testing.assert_array_equal(heads.gains[...], np.sqrt(spec.init_var))
        np.testing.assert_array_equal(
            heads.offsets[...], np.where(constant, spec.init_mean, 0.0).astype(np.float32)
        )
    graphdef = nnx.graphdef(all_heads[0])
    states = jax.tree.map(lambda *a: np.stack(a), *(nnx.state(h) for h in all_heads))
    hs = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    params, raw = generate_per_draw(graphdef, states, hs)
    # Raw entries have unit variance (the identity the gains build on).
    raw_var = np.var(np.asarray(raw, np.float64), axis=(1, 2))
    assert 0.95 < raw_var.mean() < 1.05, raw_var
    for leaf, value, target_value in zip(
        spec.leaves, jax.tree.leaves(params), targets, strict=True
    ):
        value = np.asarray(value, np.float64).reshape(draws, -1)  # over h and entries
        if np.var(target_value) == 0:  # biases, norm scales: exactly the target's value
            np.testing.assert_array_equal(
                value.reshape(-1, leaf.size),
                np.broadcast_to(target_value.reshape(-1), (value.size // leaf.size, leaf.size)),
            )
            continue
        ratios = np.var(value, axis=1) / np.var(target_value)
        assert 0.9 < ratios.mean() < 1.1, (leaf.name, ratios)  # the target's own variance
        ratio = np.mean(np.var(value, axis=1)) / analytic[leaf.name]
        assert 0.5 < ratio < 2.0, (leaf.name, ratio)  # the initializer's analytic variance

    # Whatever input_variance, features of that variance give the same raw entries: the
    # feature kernel is scaled by 1/sqrt(input_variance), the rest of the draw is the same.
    scaled = hyper.ChunkedHeads(spec, 64, chunk_size=100, input_variance=4.0, rngs=nnx.Rngs(0))
    _, raw_scaled = generate_per_draw(
        graphdef, jax.tree.map(lambda a: a[None], nnx.state(scaled)), 2 * hs
    )
    np.testing.assert_allclose(raw_scaled[0], raw[0], rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_compression_ratio_counts_the_hypernetworks_params_over_the_targets():
    target = MLP(64, 256, 10, rngs=nnx.Rngs(0))  # 19,210 generated scalars
    size = 64 * 256 + 256 + 256 * 10 + 10
    d_in, d_k, chunk, d_c, d_m = 8, 32, 256, 16, 32
    # Shapes are all a parameter count needs: build abstractly (nothing is drawn).
    hnet = nnx.eval_shape(
        lambda: hyper.ConditionalHypernetwork(
            target, make_trunk(d_in, d_k, 1), d_k, num_conditions=10, embedding_features=d_in,
            chunk_size=chunk, chunk_embedding_features=d_c, chunk_hidden_features=d_m,
            rngs=nnx.Rngs(2),
        )
    )  # fmt: skip
    chunks = math.ceil(size / chunk)
    by_hand = (
        10 * d_in  # condition embeddings
        + d_in * d_k + d_k  # trunk
        + 10 * chunks * d_c  # chunk embeddings: one set per condition (the default)
        + d_k * d_m + d_c * d_m + d_m  # hidden layer
        + d_m * chunk + chunk  # shared output layer
        + 2 * 4  # a gain and an offset per generated tensor
    )  # fmt: skip
    assert hnet.compression_ratio == pytest.approx(by_hand / size)
    shared = nnx.eval_shape(
        lambda: hyper.ConditionalHypernetwork(
            target, make_trunk(d_in, d_k, 1), d_k, num_conditions=10, embedding_features=d_in,
            chunk_size=chunk, chunk_embedding_features=d_c, chunk_hidden_features=d_m,
            chunk_embeddings="shared", rngs=nnx.Rngs(2),
        )
    )  # fmt: skip
    per_condition_extra = 9 * chunks * d_c
    assert shared.compression_ratio == pytest.approx((by_hand - per_condition_extra) / size)
    assert shared.compression_ratio < 1
    small = MLP(3, 8, 2, rngs=nnx.Rngs(0))  # 50 scalars; one (d_k, n_t) head + bias each
    unchunked = nnx.eval_shape(
        lambda: hyper.Hypernetwork(small, make_trunk(d_in, d_k, 1), d_k, rngs=nnx.Rngs(2))
    )
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


# -- the heads' own vector ---------------------------------------------------------------------


HEADS_KINDS = {
    "per_tensor": {},
    "chunked_units": {"chunk_size": 16},
    "chunked_ravel": "ravel",
    "structured": {"structured_units": 3},
    "chunked_pretrained": {"chunk_size": 16, "pretrained": "trainable"},
}


def vector_hnet(kind, z_features=0):
    options = HEADS_KINDS[kind]
    if options == "ravel":  # ChunkedHeads' other order, swapped in as the heads
        hnet = vector_hnet("chunked_units", z_features)
        hnet.heads = hyper.ChunkedHeads(
            hnet.spec, 16, chunk_size=16, embedding_features=16, num_conditions=4,
            order="ravel", rngs=nnx.Rngs(5),
        )  # fmt: skip
        return hnet
    hnet = hyper.ConditionalHypernetwork(
        MLP(3, 8, 2, rngs=nnx.Rngs(0)), make_trunk(4 + z_features, 16, 1), 16,
        num_conditions=4, embedding_features=4, z_features=z_features, rngs=nnx.Rngs(2),
        **options,
    )  # fmt: skip
    # Move every head Param off its init (zero deltas, unit gains) so nothing checked is
    # trivially zero or one.
    graphdef, params, rest = nnx.split(hnet, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(3)
    moved = [a + 0.1 * rng.normal(size=a.shape).astype(a.dtype) for a in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, moved), rest)


@nnx.jit
def vectors_and_params(hnet, condition):
    """What the vector API gives, and what it must agree with, in one compiled call: the
    bitwise checks compare outputs computed by the same operations on the same shapes within
    one program (concatenating and cutting are exact); an output XLA may recompute in
    another fusion is compared to float rounding."""
    v = hnet.generate_vector(condition)
    return {
        "vector": v,
        "params_of": hnet.params_of(v),
        "generate": hnet.generate(condition),
        "vector_of": hnet.heads.vector_of(hnet.heads(*heads_args(hnet, condition))),
        "heads_vector": hnet.heads.vector(*heads_args(hnet, condition)),
        "all": hnet.generate_vectors(),
        "vmapped": jax.vmap(hnet.generate_vector)(jnp.arange(hnet.num_conditions)),
    }


def heads_args(hnet, condition):
    h = hnet.trunk(hnet.embed(condition))
    return (h,) if getattr(hnet.heads, "num_conditions", None) is None else (h, condition)


def assert_bitwise(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
@pytest.mark.parametrize("kind", list(HEADS_KINDS))
def test_the_heads_vector_holds_the_generated_params_in_the_heads_own_order(kind):
    hnet = vector_hnet(kind)
    got = vectors_and_params(hnet, jnp.int32(2))
    # The vector stands for exactly the params generate() gives, and nothing else.
    assert_bitwise(got["params_of"], got["generate"])
    assert got["vector"].shape == (hnet.spec.size,)
    ravelled = np.asarray(hyper.ravel(got["generate"]))
    # The same values in another order: to float rounding, since XLA may compute the vector
    # output in another fusion than the one params_of and generate share (jax 0.12.1 does,
    # one ulp apart on 2 of 50 entries).
    np.testing.assert_allclose(
        np.sort(np.asarray(got["vector"])), np.sort(ravelled), rtol=1e-6, atol=1e-7
    )
    # Every condition at once, without looking ids up: the vmapped single calls, bitwise.
    assert_bitwise(got["all"], got["vmapped"])
    np.testing.assert_allclose(got["all"][2], got["vector"], rtol=1e-6, atol=1e-7)
    if "pretrained" not in kind:  # the heads' own vector and its inverse (θ0 aside)
        assert_bitwise(got["heads_vector"], got["vector"])
        assert_bitwise(got["vector_of"], got["vector"])
    # The documented order: hyper.ravel's (row-major) for one head per tensor and chunked
    # "ravel"; a kernel output unit by output unit for chunked "units"; for structured
    # heads layer after layer, unit after unit, each unit's bias entry and kernel column
    # (the layer's tensors in spec order: bias, kernel).
    generated = {k: np.asarray(v) for k, v in nnx.to_flat_state(got["generate"])}
    if kind == "structured":
        want = [
            np.concatenate([generated[(layer, "bias")][:, None], generated[(layer, "kernel")].T], 1)
            for layer in ("hidden", "out")
        ]
    else:
        by_units = kind in ("chunked_units", "chunked_pretrained")
        want = [(x.T if by_units and x.ndim == 2 else x) for x in generated.values()]
    np.testing.assert_allclose(
        got["vector"], np.concatenate([w.reshape(-1) for w in want]), rtol=1e-6, atol=1e-7
    )


def test_the_chunked_vector_is_the_documented_formula_with_no_axis_moved():
    hnet = vector_hnet("chunked_units")
    h = np.asarray(nnx.jit(lambda m: m.trunk(m.embed(1)))(hnet), np.float64)
    want = chunked_reference(hnet.heads, hnet.spec, h, condition=1, own_order=True)
    got = nnx.jit(lambda m: m.generate_vector(1))(hnet)
    np.testing.assert_allclose(got, want, **tolerance(1e-5, 1e-6))


def test_generate_vectors_takes_a_shared_or_per_condition_z():
    hnet = vector_hnet("structured", z_features=2)
    zs = np.random.default_rng(0).normal(size=(4, 2)).astype(np.float32)
    per_condition, shared, vmapped = nnx.jit(
        lambda m, zs: (
            m.generate_vectors(zs),
            m.generate_vectors(zs[1]),
            jax.vmap(lambda c, z: m.generate_vector(c, z))(jnp.arange(4), zs),
        )
    )(hnet, zs)
    assert_bitwise(per_condition, vmapped)
    np.testing.assert_allclose(
        shared[3], nnx.jit(lambda m, z: m.generate_vector(3, z))(hnet, zs[1]), rtol=1e-6,
        atol=1e-7,
    )  # fmt: skip
    for bad in (None, zs[:, :1], np.zeros((3, 2), np.float32)):
        with pytest.raises(ValueError, match="z must have shape"):
            hnet.generate_vectors(bad)
    with pytest.raises(ValueError, match="takes no z"):
        vector_hnet("chunked_units").generate_vectors(zs)


def _host(x):
    is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return np.asarray(jax.random.key_data(x) if is_key else x)


@pytest.mark.parametrize("layer", ["dropout", "batchnorm"])
def test_generate_vectors_names_a_trunk_that_updates_its_own_state(layer):
    # jax.vmap cannot update the trunk's state (a Dropout's stream, a BatchNorm's
    # statistics): a ValueError that says what to do, nothing changed; in evaluation mode
    # (a view) it runs, each row the vmapped generate_vector's.
    rngs = nnx.Rngs(0)
    stateful = nnx.Dropout(0.5, rngs=rngs) if layer == "dropout" else nnx.BatchNorm(16, rngs=rngs)
    trunk = nnx.Sequential(nnx.Linear(4, 16, rngs=rngs), stateful)
    hnet = hyper.ConditionalHypernetwork(
        MLP(3, 8, 2, rngs=nnx.Rngs(1)), trunk, 16, num_conditions=3, embedding_features=4,
        rngs=nnx.Rngs(2),
    )  # fmt: skip
    before = jax.tree.map(_host, nnx.state(hnet))
    held = (
        "trunk/layers/1/mean (BatchStat)" if layer == "batchnorm" else "trunk/layers/1/rngs/count"
    )
    with pytest.raises(ValueError, match=r"generate_vectors runs the trunk.*nnx\.view") as error:
        hnet.generate_vectors()
    assert held in str(error.value)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(_host, nnx.state(hnet)), before)
    # The loop the message suggests runs, one condition at a time (updating the state).
    rows = jnp.stack([hnet.generate_vector(c) for c in range(3)])
    assert rows.shape == (3, hnet.spec.size) and np.all(np.isfinite(rows))
    mode = {"deterministic": True} if layer == "dropout" else {"use_running_average": True}
    view = nnx.view(hnet, **mode)
    assert_bitwise(view.generate_vectors(), jax.vmap(view.generate_vector)(jnp.arange(3)))


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_the_regularizer_on_vectors_is_the_one_on_ravelled_params():
    # Any fixed order of the entries on both sides gives the same squared distance: the
    # demo's loss regularizes generate_vectors() rows against snapshots taken the same way.
    hnet = vector_hnet("chunked_units")
    stored_tree = jax.vmap(hnet.generate)(jnp.arange(4))
    stored_vec = hnet.generate_vectors()
    graphdef, params, rest = nnx.split(hnet, nnx.Param, ...)
    moved = jax.tree.map(lambda a: a * 1.05, params)
    where = jnp.arange(4) < 3

    def by_vectors(p):
        m = nnx.merge(graphdef, p, rest)
        now = m.generate_vectors()
        return hyper.output_regularizer(lambda v: {"v": v}, now, stored_vec, 0.1, where=where)

    def by_ravel(p):
        m = nnx.merge(graphdef, p, rest)
        now = hyper.generated_vectors(m.generate, jnp.arange(4))
        stored = jax.vmap(hyper.ravel)(stored_tree)
        return hyper.output_regularizer(lambda v: {"v": v}, now, stored, 0.1, where=where)

    (a, ga), (b, gb) = (jax.jit(jax.value_and_grad(f))(moved) for f in (by_vectors, by_ravel))
    assert float(a) > 0
    np.testing.assert_allclose(a, b, rtol=1e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-8), ga, gb)


def test_the_vector_api_rejects_wrong_sizes_and_structures():
    hnet = vector_hnet("chunked_units")
    with pytest.raises(ValueError, match=f"last axis of {hnet.spec.size}"):
        hnet.params_of(jnp.zeros(hnet.spec.size - 1))
    with pytest.raises(ValueError, match="expects the 4 generated tensors"):
        hnet.heads.vector_of([jnp.zeros(3)])
    params = nnx.jit(lambda m: m.generate(0))(hnet)
    leaves, treedef = jax.tree.flatten(params)
    with pytest.raises(ValueError, match="must end in shape"):
        hnet.heads.vector_of(jax.tree.unflatten(treedef, [x[..., :1] for x in leaves]))


# -- conv targets ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [None, 64], ids=["heads", "chunked"])
def test_generated_cnn_runs_like_the_cnn_with_those_weights_and_learns(chunk_size):
    target = CNN(rngs=nnx.Rngs(0))
    hnet = hyper.Hypernetwork(
        target, make_trunk(3, 16, 1), 16, chunk_size=chunk_size, rngs=nnx.Rngs(2)
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 8, 8, 1)).astype(np.float32)
    z = np.array([0.3, -1.0, 0.5], np.float32)
    params = generate(hnet, z)
    assert params["conv"]["kernel"].shape == (3, 3, 1, 4)
    reference = nnx.clone(target, arrays=True)
    nnx.update(reference, params)
    np.testing.assert_allclose(forward(hnet, z, x), forward(reference, x), rtol=1e-5, atol=1e-5)

    labels = jnp.asarray(rng.integers(0, 3, size=5))

    def loss(hnet, z, x):
        logits = hnet(z, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    graphdef, state = nnx.split(hnet, nnx.Param, ...)[0:2]
    rest = nnx.state(hnet, nnx.Not(nnx.Param))

    @jax.jit
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


@pytest.mark.slow
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
    shifts = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
        jax.tree.leaves(moved), jax.tree.leaves(params), strict=True)]  # fmt: skip
    assert max(shifts) < 1e-6

    # Drift: perturb every hypernetwork weight, then follow the regularizer's gradient.
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda a: (a + 0.05 * rng.normal(size=a.shape)).astype(np.float32), params
    )
    distances = []  # mean squared distance to the stored weights, = reg / beta
    for _ in range(4):
        params, value = step(params)
        distances.append(float(value) / 0.5)
    assert distances[0] > 0
    assert all(b < a for a, b in itertools.pairwise(distances)), distances


def test_masked_regularizer_counts_only_the_rows_masked_in():
    rng = np.random.default_rng(2)
    table = jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)
    stored = jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)
    ids, beta = jnp.arange(5), 0.4

    @jax.jit
    def reg(table, where):
        return hyper.output_regularizer(table_generate(table), ids, stored, beta, where=where)

    grad_of = jax.jit(jax.grad(reg))
    diff = np.asarray(table, np.float64) - np.asarray(stored, np.float64)
    for mask in ([True, False, True, True, False], [True] * 5, [False, False, False, True, False]):
        mask = np.array(mask)
        got = reg(table, mask)
        want = beta * np.mean(np.sum(diff[mask] ** 2, axis=1))  # the mean over rows masked in
        np.testing.assert_allclose(got, want, rtol=1e-5)
        grad = np.asarray(grad_of(table, mask))
        closed_form = np.where(mask[:, None], 2 * beta * diff / mask.sum(), 0.0)
        np.testing.assert_allclose(grad, closed_form, rtol=1e-5, atol=1e-7)
        assert (grad[~mask] == 0).all()  # masked-out rows: exactly nothing
    # the same as the unmasked regularizer on just the rows masked in
    kept = jnp.array([0, 2, 3])
    plain = hyper.output_regularizer(table_generate(table), kept, stored[kept], beta)
    np.testing.assert_allclose(reg(table, np.isin(np.arange(5), kept)), plain, rtol=1e-6)
    # masked-out rows contribute nothing, whatever they hold (even inf)
    mask = jnp.array([True, True, False, False, False])
    wild = table.at[3].set(jnp.inf)
    np.testing.assert_array_equal(reg(wild, mask), reg(table, mask))
    # no row masked in: zero, and a zero gradient
    none = jnp.zeros(5, bool)
    assert float(reg(table, none)) == 0
    assert not np.asarray(grad_of(table, none)).any()
    # the mask may be traced: one compiled function for every count of earlier tasks
    by_count = jax.jit(lambda table, t: reg(table, ids < t))
    for t in range(6):
        want = beta * np.mean(np.sum(diff[:t] ** 2, axis=1)) if t else 0.0
        np.testing.assert_allclose(by_count(table, t), want, rtol=1e-5)
    with pytest.raises(TypeError, match=r"where must be a boolean mask.*int32"):
        reg(table, np.ones(5, np.int32))
    with pytest.raises(ValueError, match=r"where must have shape \(5,\).*got \(4,\)"):
        reg(table, np.ones(4, bool))


def test_regularizer_rejects_a_mismatched_snapshot_and_a_negative_beta():
    table = jnp.zeros((4, 6))
    stored = jnp.zeros((2, 6))
    with pytest.raises(ValueError, match=r"stored has shape \(2, 6\), but 3 inputs"):
        hyper.output_regularizer(table_generate(table), jnp.arange(3), stored, 0.1)
    with pytest.raises(ValueError, match=r"length 6, but stored rows have length 5"):
        hyper.output_regularizer(table_generate(table), jnp.arange(2), jnp.zeros((2, 5)), 0.1)
    with pytest.raises(ValueError, match=r"beta must be >= 0, got -0\.1"):
        hyper.output_regularizer(table_generate(table), jnp.arange(2), stored, -0.1)
    # any concrete beta is checked: numpy scalars, jax arrays, NaN
    for negative in (np.float32(-1), jnp.float32(-1), jnp.array(-0.5), np.array(-2), np.nan):
        with pytest.raises(ValueError, match=r"beta must be >= 0, got"):
            hyper.output_regularizer(table_generate(table), jnp.arange(2), stored, negative)
    for wrong in (None, "x", True, jnp.array(True), 1j, [0.1]):
        with pytest.raises(TypeError, match=r"beta must be a real number >= 0"):
            hyper.output_regularizer(table_generate(table), jnp.arange(2), stored, wrong)
    with pytest.raises(ValueError, match=r"beta must be a scalar >= 0, got shape \(1,\)"):
        hyper.output_regularizer(table_generate(table), jnp.arange(2), stored, jnp.ones(1))
    for fine in (np.float32(0.1), jnp.float32(0.1), np.int64(0), 0):
        value = hyper.output_regularizer(table_generate(table), jnp.arange(2), stored, fine)
        assert float(value) == 0
    # a traced beta (a schedule) is checked for its shape only
    traced = jax.jit(
        lambda b: hyper.output_regularizer(table_generate(table + 1), jnp.arange(2), stored, b)
    )
    np.testing.assert_allclose(traced(0.5), 0.5 * 6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"leading axis.*not a scalar"):
        hyper.snapshot_generated(table_generate(table), jnp.int32(1))


# -- train_tasks ------------------------------------------------------------------------------


def toy_tasks(num_tasks=3, n_train=48, n_test=20, seed=0):
    """Task k: which side of a task-specific random hyperplane a 4-D point lies on."""
    rng = np.random.default_rng(seed)
    tasks = []
    for k in range(num_tasks):
        w = rng.normal(size=4)
        pair = []
        for n in (n_train, n_test):
            x = rng.normal(size=(n, 4)).astype(np.float32)
            task = np.full(n, k, np.int32)  # the task id rides with the batch
            pair.append({"x": x, "y": (x @ w > 0).astype(np.int32), "task": task})
        tasks.append(tuple(pair))
    return tasks


class Learner(nnx.Module):
    """A conditional hypernetwork plus its snapshot of every task, as (untrained) state."""

    def __init__(self, hnet):
        self.hnet = hnet
        self.stored = nnx.Variable(jnp.zeros((hnet.num_conditions, hnet.spec.size)))
        self.num_earlier = nnx.Variable(jnp.zeros((), jnp.int32))


def build_learner():
    return Learner(
        hyper.ConditionalHypernetwork(
            MLP(4, 8, 2, rngs=nnx.Rngs(0)), make_trunk(3, 8, 1), 8, num_conditions=2,
            embedding_features=3, rngs=nnx.Rngs(2),
        )
    )  # fmt: skip


@nnx.jit
def snapshot_all(hnet):
    return hyper.snapshot_generated(hnet.generate, jnp.arange(hnet.num_conditions))


def regularized_loss(learner, batch):
    """One loss for every task: the task id from the batch, earlier tasks by the mask."""
    hnet = learner.hnet
    logits = hnet(batch["task"][0], batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    ids = jnp.arange(hnet.num_conditions)
    earlier = ids < learner.num_earlier[...]
    return ce + hyper.output_regularizer(
        hnet.generate, ids, learner.stored[...], 0.1, where=earlier
    )


def regularized_losses(t, learner):
    learner.stored[...] = snapshot_all(learner.hnet)
    learner.num_earlier[...] = jnp.int32(t)
    return regularized_loss


def task_accuracy(learner, batch):
    return jnp.mean(learner.hnet(batch["task"][0], batch["x"]).argmax(-1) == batch["y"])


@pytest.mark.slow  # long training; train_tasks' other tests stay fast
def test_train_tasks_accuracy_matrix_is_what_a_hand_written_loop_computes():
    tasks, tx, epochs, batch_size, seed = toy_tasks(2), optax.adam(1e-2), 3, 16, 5
    learner = build_learner()
    acc = train_tasks(
        learner, tx, tasks, regularized_losses, lambda j: task_accuracy, epochs=epochs,
        batch_size=batch_size, seed=seed, progress=False,
    )  # fmt: skip

    # The reference: the pure core by hand, a fresh optimizer state per task, accuracy in numpy.
    graphdef, state = nnx.split(build_learner())
    predict = jax.jit(lambda state, j, x: nnx.merge(graphdef, state).hnet(j, x))
    epoch = jax.jit(make_epoch(make_train_step(regularized_loss, tx), batch_size=batch_size))
    want = np.full((2, 2), np.nan)
    for t, (train, _) in enumerate(tasks):
        model = nnx.merge(graphdef, state)
        assert regularized_losses(t, model) is regularized_loss  # writes the snapshot
        graphdef, state = nnx.split(model)
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
        as_arrays(nnx.state(learner)),
        as_arrays(nnx.state(nnx.merge(graphdef, state))),
    )
    # task 1 trained against the snapshot taken after task 0
    assert int(learner.num_earlier[...]) == 1


def test_train_tasks_checks_every_task_and_metric_before_training_any():
    tasks = toy_tasks(2)
    learner = build_learner()
    before = as_arrays(nnx.state(learner))
    fit = dict(epochs=1, batch_size=16, progress=False)
    metric = lambda j: task_accuracy  # noqa: E731

    def unchanged():
        jax.tree.map(np.testing.assert_array_equal, as_arrays(nnx.state(learner)), before)

    bad = list(tasks)
    bad[1] = (tasks[1][0], {"x": np.zeros((5, 4), np.float32), "y": np.zeros(4, np.int32)})
    with pytest.raises(ValueError, match=r"tasks\[1\] test data"):
        train_tasks(learner, optax.adam(1e-2), bad, regularized_losses, metric, **fit)
    unchanged()
    with pytest.raises(ValueError, match=r"batch_size 64 is larger than the number of examples 48"):
        train_tasks(
            learner,
            optax.adam(1e-2),
            tasks,
            regularized_losses,
            metric,
            **{**fit, "batch_size": 64},
        )
    with pytest.raises(ValueError, match=r"tasks\[0\] must be a \(train_data, test_data\) pair"):
        train_tasks(learner, optax.adam(1e-2), [tasks[0][0]], regularized_losses, metric, **fit)
    with pytest.raises(TypeError, match=r"tx must be an optax"):
        train_tasks(learner, "adam", tasks, regularized_losses, metric, **fit)
    # a numpy array of tasks: our message, not numpy's "truth value ... is ambiguous"
    with pytest.raises(ValueError, match=r"sequence \(a list\) of \(train_data, test_data\).*"
                       r"got ndarray"):  # fmt: skip
        train_tasks(learner, optax.adam(1e-2), np.zeros((2, 2)), regularized_losses, metric, **fit)
    with pytest.raises(ValueError, match=r"non-empty.*got an empty one"):
        train_tasks(learner, optax.adam(1e-2), [], regularized_losses, metric, **fit)

    # Metrics are traced on each task's test batch (shapes only) before task 0 trains.
    def dict_metric(j):
        return lambda m, batch: {"acc": task_accuracy(m, batch), "n": jnp.float32(j)}

    def per_example_metric(j):
        return lambda m, batch: m.hnet(batch["task"][0], batch["x"]).argmax(-1) == batch["y"]

    def late_dict_metric(j):  # only task 1's metric is wrong
        return task_accuracy if j == 0 else dict_metric(j)

    calls = []

    def counting_losses(t, model):
        calls.append(t)
        return regularized_losses(t, model)

    for make, message in (
        (dict_metric, r"metric_for_task\(0\) must return one scalar.*\['acc', 'n'\]"),
        (late_dict_metric, r"metric_for_task\(1\) must return one scalar"),
        (per_example_metric, r"metric_for_task\(0\) on task 0's test data.*must be a scalar"
                             r".*got shape \(20,\)"),
        (lambda j: "accuracy", r"metric_for_task\(0\) must return a callable, got str"),
    ):  # fmt: skip
        with pytest.raises((ValueError, TypeError), match=message):
            train_tasks(learner, optax.adam(1e-2), tasks, counting_losses, make, **fit)
        unchanged()
    assert calls == []  # no task started


@pytest.mark.slow
def test_train_tasks_names_each_task_above_its_progress(capsys):
    tasks = toy_tasks(2)
    fit = dict(epochs=2, batch_size=16)
    train_tasks(build_learner(), optax.adam(1e-2), tasks, regularized_losses,
                lambda j: task_accuracy, progress=True, **fit)  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("task ")]
    assert [lines[i] for i in headers] == ["task 1 of 2", "task 2 of 2"]
    assert headers[0] == 0, "nothing is printed before the first task's line"
    for start, end in zip(headers, [*headers[1:], len(lines)], strict=True):
        assert [line.split("  ")[0] for line in lines[start + 1 : end]] == ["epoch 0", "epoch 1"]
    train_tasks(build_learner(), optax.adam(1e-2), tasks, regularized_losses,
                lambda j: task_accuracy, progress=False, label="quiet", **fit)  # fmt: skip
    assert "quiet" not in capsys.readouterr().out
    with pytest.raises(TypeError, match="label must be a str"):
        train_tasks(build_learner(), optax.adam(1e-2), tasks, regularized_losses,
                    lambda j: task_accuracy, label=3, **fit)  # fmt: skip
