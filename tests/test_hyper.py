"""nnxscan.pure.hyper: ParamSpec, ravel/unravel and call, against independent references.

References are the target's own forward pass, a hand-written jnp forward, Python loops and
central finite differences; never the code's own output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxscan.pure import hyper

from hyper_models import MLP, as_arrays, mlp_reference

OUT_ONLY = nnx.All(nnx.Param, nnx.PathContains("out"))


@pytest.fixture(scope="module")
def bn_target():
    return MLP(3, 8, 2, batchnorm=True, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def bn_spec(bn_target):
    return hyper.ParamSpec.from_module(bn_target, wrt=nnx.Param)


@pytest.fixture(scope="module")
def target():
    return MLP(3, 8, 2, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def spec(target):
    return hyper.ParamSpec.from_module(target)


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(7), (5, 3))


# -- ParamSpec, ravel, unravel --------------------------------------------------------------


def test_size_counts_the_generated_parameters(bn_spec, spec):
    # hidden 3*8+8, BatchNorm scale+bias 8+8, out 8*2+2
    assert bn_spec.size == 3 * 8 + 8 + 8 + 8 + 8 * 2 + 2
    assert spec.size == 3 * 8 + 8 + 8 * 2 + 2
    assert [leaf.name for leaf in spec.leaves] == [
        "hidden/bias",
        "hidden/kernel",
        "out/bias",
        "out/kernel",
    ]


def test_ravel_unravel_round_trip_bitwise(bn_target, bn_spec):
    params = nnx.state(bn_target, nnx.Param)
    flat = hyper.ravel(params)
    m = bn_target
    in_path_order = [m.bn.bias, m.bn.scale, m.hidden.bias, m.hidden.kernel, m.out.bias]
    in_path_order.append(m.out.kernel)
    by_hand = np.concatenate([np.ravel(np.asarray(v[...])) for v in in_path_order])
    assert flat.shape == (bn_spec.size,)
    np.testing.assert_array_equal(np.asarray(flat), by_hand)

    back = bn_spec.unravel(flat)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for got, want in zip(
        jax.tree.leaves(back, is_leaf=lambda v: isinstance(v, nnx.Variable)),
        jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nnx.Variable)),
        strict=True,
    ):
        assert type(got) is nnx.Param
        assert got[...].dtype == want[...].dtype
        np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want[...]))

    v = jax.random.normal(jax.random.key(3), (bn_spec.size,))
    np.testing.assert_array_equal(np.asarray(hyper.ravel(bn_spec.unravel(v))), np.asarray(v))
    # A numpy vector is cut into numpy arrays, as slicing it would.
    host = bn_spec.unravel(np.asarray(v))
    leaves = jax.tree.leaves(host)
    assert all(isinstance(x, np.ndarray) for x in leaves)
    np.testing.assert_array_equal(np.concatenate([x.ravel() for x in leaves]), np.asarray(v))
    # The gradient through the cut is the cotangents put back in place (one concatenation).
    weights = jax.random.normal(jax.random.key(4), (bn_spec.size,))
    grad = jax.grad(lambda f: sum(jnp.sum(x * w) for x, w in zip(
        jax.tree.leaves(bn_spec.unravel(f)), jax.tree.leaves(bn_spec.unravel(weights)),
        strict=True)))(v)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(weights))


def test_spec_is_a_plain_pytree_that_passes_through_jit(spec, target, x):
    leaves, treedef = jax.tree.flatten(spec)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert isinstance(rebuilt, hyper.ParamSpec) and rebuilt.leaves == spec.leaves

    own = nnx.state(target, nnx.Param)
    y = jax.jit(hyper.call)(spec, own, x)
    np.testing.assert_allclose(y, mlp_reference(as_arrays(own), x), rtol=1e-6, atol=1e-6)


# -- call ------------------------------------------------------------------------------------


def test_call_with_own_params_equals_target(bn_target, bn_spec, x):
    before = as_arrays(nnx.state(bn_target))
    y = hyper.call(bn_spec, nnx.state(bn_target, nnx.Param), x)
    reference = nnx.clone(bn_target, arrays=True)(x)  # train-mode BatchNorm mutates its copy
    np.testing.assert_allclose(y, reference, rtol=1e-6, atol=1e-6)
    jax.tree.map(np.testing.assert_array_equal, as_arrays(nnx.state(bn_target)), before)


def test_other_params_give_another_function_and_leave_target_untouched(bn_target, bn_spec, x):
    before = as_arrays(nnx.state(bn_target))
    own = hyper.ravel(nnx.state(bn_target, nnx.Param))
    other = bn_spec.unravel(0.5 * own + 0.1)
    y = hyper.call(bn_spec, other, x)

    reference_model = nnx.clone(bn_target, arrays=True)
    nnx.update(reference_model, other)
    np.testing.assert_allclose(y, reference_model(x), rtol=1e-6, atol=1e-6)
    assert not np.allclose(y, nnx.clone(bn_target, arrays=True)(x), atol=1e-3)
    jax.tree.map(np.testing.assert_array_equal, as_arrays(nnx.state(bn_target)), before)


def test_partial_generation_uses_the_targets_own_hidden_layer(target, x):
    spec = hyper.ParamSpec.from_module(target, wrt=OUT_ONLY)
    assert spec.size == 8 * 2 + 2
    k1, k2 = jax.random.split(jax.random.key(11))
    kernel = jax.random.normal(k1, (8, 2))
    bias = jax.random.normal(k2, (2,))
    y = hyper.call(spec, {"out": {"kernel": kernel, "bias": bias}}, x)
    hidden = jnp.tanh(x @ target.hidden.kernel[...] + target.hidden.bias[...])
    np.testing.assert_allclose(y, hidden @ kernel + bias, rtol=1e-5, atol=1e-6)


def test_call_with_state_moves_batch_stats_like_the_target(bn_target, bn_spec, x):
    own = nnx.state(bn_target, nnx.Param)
    y, new_spec = hyper.call_with_state(bn_spec, own, x)
    reference = nnx.clone(bn_target, arrays=True)
    np.testing.assert_allclose(y, reference(x), rtol=1e-6, atol=1e-6)
    new_rest = nnx.to_pure_dict(new_spec.rest)
    np.testing.assert_allclose(new_rest["bn"]["mean"], reference.bn.mean[...], rtol=1e-6)
    np.testing.assert_allclose(new_rest["bn"]["var"], reference.bn.var[...], rtol=1e-6)
    # the input spec is unchanged: a fresh BatchNorm's running mean is zero
    np.testing.assert_array_equal(nnx.to_pure_dict(bn_spec.rest)["bn"]["mean"], np.zeros(8))


# -- transforms --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heads(spec):
    return hyper.HyperHeads(spec, 4, rngs=nnx.Rngs(2))


def test_vmap_over_8_embeddings_equals_a_python_loop(spec, heads, x):
    zs = jax.random.normal(jax.random.key(5), (8, 4))
    batched = jax.jit(jax.vmap(lambda z: hyper.call(spec, heads(z), x)))(zs)
    loop = [mlp_reference(nnx.to_pure_dict(heads(z)), x) for z in zs]
    assert batched.shape == (8, 5, 2)
    np.testing.assert_allclose(batched, np.stack(loop), rtol=1e-5, atol=1e-6)


def test_scan_over_generated_networks_equals_a_python_loop(spec, target, x):
    own = hyper.ravel(nnx.state(target, nnx.Param))
    flats = jnp.stack([own, 2.0 * own, own - 0.3])

    def body(total, flat):
        y = hyper.call(spec, spec.unravel(flat), x)
        return total + jnp.sum(y), y

    total, ys = jax.lax.scan(body, 0.0, flats)
    loop = [mlp_reference(nnx.to_pure_dict(spec.unravel(f)), x) for f in flats]
    np.testing.assert_allclose(ys, np.stack(loop), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(total, sum(float(jnp.sum(y)) for y in loop), rtol=1e-5)


def test_gradients_reach_every_head_leaf(spec, heads, x):
    graphdef, state = nnx.split(heads)
    z = jnp.array([0.3, -1.0, 0.5, 2.0])

    def loss(state):
        params = nnx.merge(graphdef, state)(z)
        return jnp.mean((hyper.call(spec, params, x) - 1.0) ** 2)

    grads = jax.jit(jax.grad(loss))(state)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.any(np.asarray(g) != 0), f"zero gradient at {jax.tree_util.keystr(path)}"


@pytest.mark.slow
def test_directional_derivative_matches_central_finite_differences():
    with jax.enable_x64(True):
        f64 = jnp.float64
        target = MLP(3, 6, 2, param_dtype=f64, rngs=nnx.Rngs(3))
        spec = hyper.ParamSpec.from_module(target)
        heads = hyper.HyperHeads(spec, 4, param_dtype=f64, rngs=nnx.Rngs(4))
        graphdef, state = nnx.split(heads)
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(7, 3)))
        z = jnp.asarray(rng.normal(size=(4,)))

        @jax.jit
        def loss(state):
            y = hyper.call(spec, nnx.merge(graphdef, state)(z), x)
            return jnp.sum(jnp.sin(y) ** 2)

        direction = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), state)
        grad = jax.jit(jax.grad(loss))(state)
        pairs = zip(jax.tree.leaves(grad), jax.tree.leaves(direction), strict=True)
        analytic = sum(jnp.vdot(g, d) for g, d in pairs)
        eps = 1e-6

        def shifted(sign):
            return loss(jax.tree.map(lambda a, d: a + sign * eps * d, state, direction))

        numeric = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
        assert jnp.result_type(analytic) == f64
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6)


# -- errors: raised before compiling, naming paths and shapes ------------------------------


def test_params_missing_a_leaf_raise_naming_path_and_shapes(spec, x):
    params = {"hidden": {"kernel": jnp.zeros((3, 8)), "bias": jnp.zeros(8)}}
    params["out"] = {"kernel": jnp.zeros((8, 2))}
    with pytest.raises(ValueError, match=r"out/bias.*\(2,\).*no leaf"):
        hyper.call(spec, params, x)


def test_params_with_a_wrong_shape_raise_naming_path_and_both_shapes(spec, target, x):
    params = nnx.to_pure_dict(nnx.state(target, nnx.Param))
    params["out"]["kernel"] = jnp.zeros((8, 3))
    with pytest.raises(ValueError, match=r"out/kernel has shape \(8, 3\).*expects \(8, 2\)"):
        hyper.call(spec, params, x)
    # under jit the same error comes at trace time, before XLA compiles anything
    with pytest.raises(ValueError, match=r"out/kernel"):
        jax.jit(hyper.call)(spec, params, x)


def test_params_with_an_extra_leaf_raise(spec, target, x):
    params = nnx.to_pure_dict(nnx.state(target, nnx.Param))
    params["extra"] = {"w": jnp.zeros((4,))}
    with pytest.raises(ValueError, match=r"extra/w \(shape \(4,\)\).*does not generate"):
        hyper.call(spec, params, x)


def test_batched_params_raise_with_a_vmap_hint(spec, heads, x):
    with pytest.raises(ValueError, match=r"hidden/bias has shape \(2, 8\).*expects \(8,\).*vmap"):
        hyper.call(spec, heads(jnp.ones((2, 4))), x)


def test_unravel_of_a_wrong_length_raises_with_both_lengths(spec):
    with pytest.raises(ValueError, match=rf"length {spec.size}.*got length {spec.size - 1}"):
        spec.unravel(jnp.zeros(spec.size - 1))
    with pytest.raises(ValueError, match=r"1-D.*vmap"):
        spec.unravel(jnp.zeros((2, spec.size)))


def test_wrt_that_selects_nothing_raises(target):
    with pytest.raises(ValueError, match="selects no variable"):
        hyper.ParamSpec.from_module(target, wrt=nnx.BatchStat)
    with pytest.raises(ValueError, match="selects no variable"):
        hyper.ParamSpec.from_module(target, wrt=nnx.PathContains("nonexistent"))


def test_wrt_that_selects_a_non_float_variable_raises():
    class WithRngs(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

    with pytest.raises(ValueError, match="floating"):
        hyper.ParamSpec.from_module(WithRngs(), wrt=nnx.RngState)


def test_from_module_rejects_a_non_module():
    with pytest.raises(TypeError, match=r"nnx\.Module"):
        hyper.ParamSpec.from_module({"kernel": jnp.zeros(3)})


def test_heads_reject_features_of_the_wrong_size(heads):
    with pytest.raises(ValueError, match=r"size 4.*\(5,\)"):
        heads(jnp.ones(5))
