"""Pretrained starts, generated LoRA of a frozen base, init choices, per-task chunk
embeddings, and the continual-learning regularizer's variants.

References: the target's own weights and forward pass (bitwise, through one compiled
function), copies of the base taken before ``Trainer.fit``, Chang et al.'s closed-form
hyperfan variances (statistically, over many draws), hand-written numpy formulas of the
regularizers and of a softmax regression's per-example gradient.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import hyper
from nnxscan.shell import Trainer

from conftest import ACROSS_PROGRAMS, tolerance
from hyper_models import MLP, as_arrays


def make_trunk(din, features, seed):
    return nnx.Sequential(nnx.Linear(din, features, rngs=nnx.Rngs(seed)), nnx.tanh)


@jax.jit
def run_target(spec, params, x):
    """One compiled function for every comparison: same program, so bitwise is meaningful."""
    return hyper.call(spec, params, x)


def sine_tasks(n=64, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.uniform(-1, 1, (n, 3)).astype(np.float32)
    x = np.broadcast_to(np.linspace(-2, 2, 8, dtype=np.float32)[:, None], (n, 8, 1))
    y = (1 + 0.3 * z[:, None, :1]) * np.sin(x + 0.3 * z[:, None, 1:2]) + 0.1 * z[:, None, 2:]
    return {"z": z, "x": np.ascontiguousarray(x), "y": y.astype(np.float32)}


def family_loss(hnet, batch):
    pred = jax.vmap(hnet)(batch["z"], batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)


# -- pretrained starts (theta = theta0 + delta) -------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 16], ids=["heads", "chunked"])
@pytest.mark.parametrize("pretrained", ["frozen", "trainable"])
def test_a_pretrained_start_generates_the_pretrained_weights_bitwise(pretrained, chunk_size):
    target = MLP(1, 8, 1, rngs=nnx.Rngs(0))
    own = nnx.state(target, nnx.Param)
    hnet = hyper.Hypernetwork(
        target, make_trunk(3, 16, 1), 16, pretrained=pretrained, chunk_size=chunk_size,
        rngs=nnx.Rngs(2),
    )  # fmt: skip
    zs = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    generated = nnx.jit(lambda h, zs: jax.vmap(h.generate)(zs))(hnet, zs)
    for path, value in hyper.spec.variable_leaves(own):
        got = np.asarray(dict(hyper.spec.variable_leaves(generated))[path])
        for row in got:  # every z: theta0 + 0, exactly theta0
            np.testing.assert_array_equal(row, np.asarray(value))
    x = np.linspace(-2, 2, 8, dtype=np.float32)[:, None]
    spec = hyper.ParamSpec.from_module(target)
    pretrained_out = run_target(spec, own, x)
    # The target's own call is another program (eager ops against run_target's jit): equal to
    # float rounding, not bitwise (newer XLA releases differ there in the last bit).
    np.testing.assert_allclose(pretrained_out, np.asarray(target(x)), **ACROSS_PROGRAMS)
    for k in range(len(zs)):
        one = jax.tree.map(lambda a, k=k: a[k], generated)
        np.testing.assert_array_equal(run_target(spec, one, x), pretrained_out)
    base_type = nnx.Param if pretrained == "trainable" else hyper.FrozenParam
    assert all(type(v) is base_type for v in hnet.base)


@pytest.mark.slow
@pytest.mark.parametrize("pretrained", ["frozen", "trainable"])
def test_fit_trains_the_deltas_and_a_frozen_base_stays_bitwise(pretrained):
    target = MLP(1, 8, 1, rngs=nnx.Rngs(0))
    hnet = hyper.Hypernetwork(
        target, make_trunk(3, 16, 1), 16, pretrained=pretrained, rngs=nnx.Rngs(2)
    )
    before = [np.array(v[...]) for v in hnet.base]
    history = Trainer(hnet, optax.adam(1e-2), family_loss).fit(
        sine_tasks(), epochs=5, batch_size=16, progress=False
    )
    assert history.epochs[-1]["loss"] < history.losses[0] / 2
    after = [np.asarray(v[...]) for v in hnet.base]
    same = all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert same == (pretrained == "frozen")


def test_pretrained_and_init_options_are_checked():
    target = MLP(1, 8, 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"pretrained must be one of .*'frozen'.*got 'yes'"):
        hyper.Hypernetwork(target, make_trunk(3, 16, 1), 16, pretrained="yes", rngs=nnx.Rngs(2))
    with pytest.raises(ValueError, match=r"init must be one of .*hyperfan_in.*got 'xavier'"):
        hyper.Hypernetwork(target, make_trunk(3, 16, 1), 16, init="xavier", rngs=nnx.Rngs(2))
    with pytest.raises(TypeError, match=r"freeze_target must be a bool"):
        hyper.Hypernetwork(target, make_trunk(3, 16, 1), 16, freeze_target=1, rngs=nnx.Rngs(2))


# -- generated LoRA adapters of a frozen base -----------------------------------------------------


class LoRANet(nnx.Module):
    """A trained MLP's two Linears, each wrapped in nnx.LoRA (rank 2)."""

    def __init__(self, base: MLP, *, rngs):
        self.hidden = nnx.LoRA(1, 2, 8, base_module=base.hidden, rngs=rngs)
        self.out = nnx.LoRA(8, 2, 1, base_module=base.out, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


@pytest.fixture(scope="module")
def lora_setup():
    base = MLP(1, 8, 1, rngs=nnx.Rngs(0))  # pretrained in nnxscan on one sine
    x = np.linspace(-2, 2, 64, dtype=np.float32)[:, None]
    Trainer(base, optax.adam(1e-2), lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)).fit(
        {"x": x, "y": np.sin(x)}, epochs=20, batch_size=16, progress=False
    )
    return base


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
@pytest.mark.parametrize("freeze", [True, False])
def test_generated_lora_leaves_the_base_bitwise_unchanged_through_fit(lora_setup, freeze):
    net = LoRANet(nnx.clone(lora_setup, arrays=True), rngs=nnx.Rngs(1))
    hnet = hyper.Hypernetwork(
        net, make_trunk(3, 16, 1), 16, wrt=nnx.LoRAParam, freeze_target=freeze,
        rngs=nnx.Rngs(2),
    )  # fmt: skip
    assert [leaf.name for leaf in hnet.spec.leaves] == [
        "hidden/lora_a", "hidden/lora_b", "out/lora_a", "out/lora_b",
    ]  # fmt: skip
    base_before = as_arrays(nnx.state(hnet.target, nnx.Not(hyper.GeneratedSlot)))
    history = Trainer(hnet, optax.adam(1e-2), family_loss).fit(
        sine_tasks(), epochs=3, batch_size=16, progress=False
    )
    assert history.epochs[-1]["loss"] < history.losses[0]  # the adapters learned
    base_after = as_arrays(nnx.state(hnet.target, nnx.Not(hyper.GeneratedSlot)))
    unchanged = jax.tree.leaves(jax.tree.map(np.array_equal, base_before, base_after))
    # frozen: the base is bitwise what it was; not frozen (the control): fit moved it
    assert all(unchanged) if freeze else not all(unchanged)


# -- init choices: hyperfan-in and hyperfan-out -------------------------------------------------


class ReLUNet(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(32, 64, rngs=rngs)
        self.out = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


# Chang, Flokas & Lipson's variances of the generated tensors, c = 2, biases generated:
# kernel c / (2 fan_in) (in) or c / fan_out (out); bias c / 2 (in) or c·max(0, 1 - in/out).
CLOSED_FORM = {
    "hyperfan_in": {"hidden/kernel": 2 / (2 * 32), "hidden/bias": 1.0,
                    "out/kernel": 2 / (2 * 64), "out/bias": 1.0},
    "hyperfan_out": {"hidden/kernel": 2 / 64, "hidden/bias": 2 * (1 - 32 / 64),
                     "out/kernel": 2 / 16, "out/bias": 0.0},
}  # fmt: skip


@pytest.mark.parametrize(
    "init", [pytest.param("hyperfan_in", marks=pytest.mark.slow), "hyperfan_out"]
)
@pytest.mark.slow_on_accelerator("many eager draws for the variance")
def test_hyperfan_init_variance_matches_the_closed_form(init):
    spec = hyper.ParamSpec.from_module(ReLUNet(nnx.Rngs(0)))
    d_k, input_variance, draws = 32, 4.0, 24
    rng = np.random.default_rng(0)
    h = rng.normal(scale=np.sqrt(input_variance), size=(draws, 64, d_k)).astype(np.float32)

    @nnx.jit
    def generated(heads, h):
        return jax.vmap(heads)(h)

    samples = {name: [] for name in CLOSED_FORM[init]}
    for seed in range(draws):
        heads = hyper.HyperHeads(
            spec, d_k, input_variance=input_variance, init=init, init_gain=2.0,
            rngs=nnx.Rngs(seed),
        )  # fmt: skip
        params = generated(heads, h[seed])
        for path, value in hyper.spec.variable_leaves(params):
            samples["/".join(path)].append(np.asarray(value, np.float64))
    for name, expected in CLOSED_FORM[init].items():
        values = np.stack(samples[name])
        if expected == 0:  # the closed form is exactly zero: the head is all zeros
            np.testing.assert_array_equal(values, 0.0)
            continue
        # Over 24 draws of the heads x 64 features: the sample variance of a kernel has a
        # relative standard error of a few percent; a bias (16-64 entries) of more.
        rtol = 0.1 if "kernel" in name else 0.25
        np.testing.assert_allclose(np.mean(values**2), expected, rtol=rtol, err_msg=name)

    # The chunked heads carry the same variances in their per-tensor gains, exactly.
    chunked = hyper.ChunkedHeads(spec, d_k, chunk_size=256, init=init, rngs=nnx.Rngs(0))
    expected = [CLOSED_FORM[init][leaf.name] for leaf in spec.leaves]
    np.testing.assert_allclose(chunked.gains[...], np.sqrt(expected), rtol=1e-6)


# -- chunk embeddings per condition -------------------------------------------------------------


def test_per_condition_chunk_embeddings_make_each_condition_its_own_chunks():
    target = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    hnet = hyper.ConditionalHypernetwork(
        target, make_trunk(4, 16, 1), 16, num_conditions=3, embedding_features=4,
        chunk_size=16, chunk_embedding_features=3, rngs=nnx.Rngs(2),
    )  # fmt: skip
    heads = hnet.heads
    assert heads.chunk_embeddings.shape == (3, heads.num_chunks, 3)
    spec = hnet.spec
    generate = nnx.jit(lambda hnet, c: hyper.ravel(hnet.generate(c)))
    trunk_out = nnx.jit(lambda hnet, c: hnet.trunk(hnet.embed(c)))
    for c in range(3):
        h = np.asarray(trunk_out(hnet, c), np.float64)
        reference = _reference_with_table(heads, spec, h, c)
        np.testing.assert_allclose(generate(hnet, c), reference, **tolerance(1e-4, 1e-5))
    # Changing condition 2's chunk embeddings leaves conditions 0 and 1 bitwise as they were.
    before = [np.asarray(generate(hnet, c)) for c in range(3)]
    heads.chunk_embeddings[...] = heads.chunk_embeddings[...].at[2].add(1.0)
    after = [np.asarray(generate(hnet, c)) for c in range(3)]
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert not np.array_equal(after[2], before[2])
    with pytest.raises(ValueError, match=r"call heads\(h, condition=c\)"):
        heads(jnp.ones(16))
    shared = hyper.ChunkedHeads(spec, 16, chunk_size=16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"share one set of chunk embeddings"):
        shared(jnp.ones(16), condition=1)


def _reference_with_table(heads, spec, h, condition):
    from test_hyper_cl import chunked_reference  # the documented formula, in numpy

    return chunked_reference(heads, spec, h, "units", condition)


# -- the regularizer's variants -----------------------------------------------------------------


@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(5, 7)).astype(np.float32)  # what "generate" returns per input
    stored = rng.normal(size=(5, 7)).astype(np.float32)
    importance = rng.uniform(0, 2, size=(5, 7)).astype(np.float32)
    return table, stored, importance


def _generate(table):
    return lambda i: {"w": jnp.asarray(table)[i]}


def test_fisher_weighted_regularizer_is_the_hand_written_formula(rows):
    table, stored, importance = rows
    where = np.array([True, True, False, True, False])
    got = jax.jit(
        lambda s, f: hyper.output_regularizer(
            _generate(table), jnp.arange(5), s, 0.3, where=jnp.asarray(where), importance=f
        )
    )(stored, importance)
    per_row = np.sum(importance * (table - stored).astype(np.float64) ** 2, axis=1)
    np.testing.assert_allclose(got, 0.3 * per_row[where].mean(), rtol=1e-6)


def test_sampled_regularizer_is_the_formula_over_a_uniform_subset_of_earlier_tasks(rows):
    table, stored, _ = rows
    where = np.array([True, True, False, True, True])  # four earlier tasks count
    per_row = np.sum((table - stored).astype(np.float64) ** 2, axis=1)

    @jax.jit
    def sampled(key, sample_where):
        return hyper.output_regularizer(
            _generate(table), jnp.arange(5), jnp.asarray(stored), 1.0,
            where=sample_where, sample=2, key=key,
        )  # fmt: skip

    subsets = {s: per_row[list(s)].mean() for s in itertools.combinations(np.flatnonzero(where), 2)}
    counts = dict.fromkeys(subsets, 0)
    for k in range(400):
        value = float(sampled(jax.random.key(k), jnp.asarray(where)))
        match = [s for s, v in subsets.items() if np.isclose(value, v, rtol=1e-5)]
        assert len(match) == 1, value  # the mean over one pair of counted rows, never row 2
        counts[match[0]] += 1
    # Uniform over the 6 pairs: 400/6 = 66.7 each (binomial sd 7.5).
    assert all(40 < c < 95 for c in counts.values()), counts
    # With at most `sample` rows that count, every one of them, as without sampling.
    two = np.array([False, True, False, False, True])
    np.testing.assert_allclose(
        sampled(jax.random.key(0), jnp.asarray(two)), per_row[two].mean(), rtol=1e-6
    )
    with pytest.raises(ValueError, match=r"sample and key go together"):
        hyper.output_regularizer(_generate(table), jnp.arange(5), stored, 1.0, sample=2)
    with pytest.raises(ValueError, match=r"importance has shape \(5, 3\).*\(5, 7\)"):
        hyper.output_regularizer(
            _generate(table), jnp.arange(5), stored, 1.0, importance=np.ones((5, 3))
        )


def test_fisher_diagonal_is_the_mean_squared_per_example_gradient():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 3)).astype(np.float32)
    y = rng.integers(0, 4, size=6)
    params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": np.zeros(4, np.float32)}

    def log_likelihood(p, example):
        return jax.nn.log_softmax(example["x"] @ p["w"] + p["b"])[example["y"]]

    got = jax.jit(hyper.fisher_diagonal, static_argnums=0)(log_likelihood, params, {"x": x, "y": y})
    # Softmax regression by hand: d log p_y / d logits = onehot(y) - softmax.
    logits = x.astype(np.float64) @ params["w"]
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    delta = np.eye(4)[y] - p
    np.testing.assert_allclose(got["b"], np.mean(delta**2, axis=0), rtol=1e-5)
    grad_w = x[:, :, None] * delta[:, None, :]
    np.testing.assert_allclose(got["w"], np.mean(grad_w**2, axis=0), rtol=1e-5, atol=1e-7)


# -- structured chunks ---------------------------------------------------------------------------


def structured_reference(heads, spec, h):
    """StructuredHeads' documented formula in numpy: a dict path -> generated tensor."""
    p = nnx.to_pure_dict(nnx.state(heads))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    hidden = np.tanh(h @ p["feature_kernel"] + p["chunk_embeddings"] @ p["embedding_kernel"]
                     + p["hidden_bias"])  # fmt: skip
    hidden = hidden / np.sqrt(np.mean(hidden**2, axis=-1, keepdims=True) + 1e-6)
    out, first = {}, 0
    for g, (n, per_chunk, chunks, tensors) in enumerate(heads.layers):
        sizes = [int(np.prod(spec.leaves[t].shape[:-1])) for t in tensors]
        raw = hidden[first : first + chunks] @ p["out_kernels"][g] + p["out_biases"][g]
        raw = raw.reshape(chunks * per_chunk, sum(sizes))[:n]  # one row per output unit
        start = 0
        for t, size in zip(tensors, sizes, strict=True):
            leaf = spec.leaves[t]
            unit_rows = raw[:, start : start + size] * p["gains"][t] + p["offsets"][t]
            # row j is unit j's fan-in: kernel[..., j]
            out[leaf.name] = np.moveaxis(unit_rows.reshape(n, *leaf.shape[:-1]), 0, -1)
            start += size
        first += chunks
    return out


@pytest.mark.parametrize("units", [1, 3])
def test_structured_chunks_reassemble_to_the_targets_shapes(units):
    target = MLP(3, 8, 2, batchnorm=True, rngs=nnx.Rngs(0))  # two Linears and a BatchNorm
    spec = hyper.ParamSpec.from_module(target)
    heads = hyper.StructuredHeads(spec, 5, units=units, embedding_features=3, rngs=nnx.Rngs(1))
    # layers: hidden (8 units: kernel (3, 8), bias), bn (8 units: scale, bias), out (2 units)
    assert [(n, sorted(spec.leaves[t].name for t in ts)) for n, _, _, ts in heads.layers] == [
        (8, ["bn/bias", "bn/scale"]), (8, ["hidden/bias", "hidden/kernel"]),
        (2, ["out/bias", "out/kernel"]),
    ]  # fmt: skip
    graphdef, state = nnx.split(heads)
    state["gains"][...] = np.linspace(0.1, 1.0, len(spec.leaves), dtype=np.float32)
    state["offsets"][...] = np.linspace(-0.5, 0.5, len(spec.leaves), dtype=np.float32)
    heads = nnx.merge(graphdef, state)
    h = np.random.default_rng(0).normal(size=5)
    generate = nnx.jit(lambda heads, h: heads(h))
    params = generate(heads, h.astype(np.float32))
    reference = structured_reference(heads, spec, h)
    for path, value in hyper.spec.variable_leaves(params):
        name = "/".join(path)
        assert value.shape == dict((leaf.name, leaf.shape) for leaf in spec.leaves)[name]
        np.testing.assert_allclose(value, reference[name], **tolerance(1e-4, 1e-5), err_msg=name)
    # Chunk k of the hidden layer is its units k·units.. only: kernel columns and bias entries.
    first_hidden = heads.layers[0][2]  # the bn layer's chunks come first
    k = 1
    heads.chunk_embeddings[...] = heads.chunk_embeddings[...].at[first_hidden + k].add(1.0)
    moved = generate(heads, h.astype(np.float32))
    cols = np.zeros(8, bool)
    cols[k * units : (k + 1) * units] = True
    for path, value in hyper.spec.variable_leaves(moved):
        before = np.asarray(dict(hyper.spec.variable_leaves(params))[path])
        changed = np.any(np.asarray(value) != before, axis=tuple(range(before.ndim - 1)))
        expect = cols if path[0] == "hidden" else np.zeros_like(changed)
        np.testing.assert_array_equal(changed, expect, err_msg=str(path))
    # and the generated params run the target as its own weights would
    x = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    own = nnx.clone(target, arrays=True)
    nnx.update(own, params)
    np.testing.assert_allclose(
        run_target(spec, params, x), nnx.jit(lambda m, x: m(x))(own, x), rtol=1e-5, atol=1e-6
    )


def test_structured_heads_in_a_conditional_hypernetwork_and_option_checks():
    target = MLP(3, 8, 2, rngs=nnx.Rngs(0))
    hnet = hyper.ConditionalHypernetwork(
        target, make_trunk(4, 16, 1), 16, num_conditions=3, embedding_features=4,
        structured_units=2, rngs=nnx.Rngs(2),
    )  # fmt: skip
    assert hnet.heads.chunk_embeddings.shape == (3, 4 + 1, 8)  # hidden: 4 chunks, out: 1
    ys = nnx.jit(lambda h, x: jax.vmap(h, in_axes=(0, None))(jnp.arange(3), x))(
        hnet, np.ones((5, 3), np.float32)
    )
    assert ys.shape == (3, 5, 2) and np.all(np.isfinite(ys))
    with pytest.raises(ValueError, match=r"chunk_size and structured_units choose two kinds"):
        hyper.Hypernetwork(
            target, make_trunk(3, 16, 1), 16, chunk_size=8, structured_units=2, rngs=nnx.Rngs(2)
        )
