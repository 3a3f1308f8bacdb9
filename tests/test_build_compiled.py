"""build_compiled: a module built in one compiled call has the eagerly built module's values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxscan.pure import build_compiled, hyper

from conftest import ACROSS_PROGRAMS
from hyper_models import MLP


def _build_hypernetworks():
    # Every kind of heads, with the initializers a hypernetwork draws: flax's truncated
    # normals in the target and trunk, the heads' normals, the task embeddings.
    def make(**heads):
        trunk = nnx.Sequential(nnx.Linear(4, 16, rngs=nnx.Rngs(1)), nnx.relu)
        return hyper.ConditionalHypernetwork(
            MLP(3, 8, 2, rngs=nnx.Rngs(0)), trunk, 16, num_conditions=3,
            embedding_features=4, rngs=nnx.Rngs(2), **heads,
        )  # fmt: skip

    return [
        lambda: make(),
        lambda: make(chunk_size=20, chunk_embedding_features=4, chunk_hidden_features=8),
        lambda: make(structured_units=4),
    ]


def _bits(x):
    is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return np.asarray(jax.random.key_data(x) if is_key else x)


@pytest.mark.parametrize("index", [0, 1, 2], ids=["heads", "chunked", "structured"])
@pytest.mark.slow_on_accelerator("eager builds of hypernetworks op by op: 14 s")
def test_a_compiled_build_has_the_eager_builds_values_and_structure(index):
    constructor = _build_hypernetworks()[index]
    eager, compiled = constructor(), build_compiled(constructor)
    # The same initializers, but one fused program against many eager ones: keys and
    # integers exactly, floats to float32 rounding (other programs may differ in the last
    # bit on another CPU or XLA; ACROSS_PROGRAMS in conftest.py).
    eager_def, eager_state = nnx.split(eager)
    compiled_def, compiled_state = nnx.split(compiled)
    assert compiled_def == eager_def
    for a, b in zip(jax.tree.leaves(eager_state), jax.tree.leaves(compiled_state), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        if np.issubdtype(_bits(a).dtype, np.floating):
            np.testing.assert_allclose(_bits(b), _bits(a), **ACROSS_PROGRAMS)
        else:
            np.testing.assert_array_equal(_bits(a), _bits(b))


def test_build_compiled_rejects_what_it_cannot_build():
    with pytest.raises(TypeError, match="callable"):
        build_compiled(3)
    with pytest.raises(TypeError, match=r"nnx\.Module"):
        build_compiled(lambda: 3)
    outside = nnx.Rngs(0)
    with pytest.raises(TypeError, match="Create it inside"):
        build_compiled(lambda: nnx.Linear(2, 2, rngs=outside))


@pytest.mark.slow_on_accelerator("builds compiled twice, option by option: 5.7 s")
def test_build_compiled_falls_back_when_xla_refuses_an_option(monkeypatch):
    # Newer XLA releases refuse the older-fusion-emitter option; the build then compiles
    # with the options it knows, to the same values (here an option no XLA knows).
    from nnxscan.pure import build as build_module

    refused = {**build_module._ONCE, "xla_no_such_option_anywhere": True}
    monkeypatch.setattr(build_module, "_ONCE_WHERE_KNOWN", refused)
    constructor = _build_hypernetworks()[1]
    _assert_built_alike(constructor(), build_compiled(constructor))


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_build_compiled_under_disable_jit_builds_eagerly():
    # As jax.jit(build)() does under disable_jit: the constructor runs op by op (whose
    # float rounding differs from the default eager build's jitted ops in the last bit).
    constructor = _build_hypernetworks()[0]
    with jax.disable_jit():
        built, eager = build_compiled(constructor), constructor()
    _assert_built_alike(eager, built)


def _assert_built_alike(eager, built):
    pairs = zip(jax.tree.leaves(nnx.state(eager)), jax.tree.leaves(nnx.state(built)), strict=True)
    for a, b in pairs:
        if np.issubdtype(_bits(a).dtype, np.floating):
            np.testing.assert_allclose(_bits(b), _bits(a), **ACROSS_PROGRAMS)
        else:
            np.testing.assert_array_equal(_bits(a), _bits(b))


def test_paused_gc_pauses_and_restores_the_collector():
    import gc

    from nnxscan.pure import paused_gc

    gc.enable()  # whatever an earlier test left
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():  # nested: the outer block's pause stands
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError), paused_gc():
        1 / 0  # noqa: B018
    assert gc.isenabled()  # restored when the block raises
    gc.disable()  # a user who turned it off keeps it off
    try:
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Draws(nnx.Module):
    """Draws of every width and kind from one nnx.Rngs (an empty one too), a split and
    fold-ins of every kind of message, and what cannot be merged: draws from a batch of
    keys (vmap), from another generator (rbg), and from threefry made unpartitionable for
    the draw. Every ``rngs.params()`` is a fold-in of the stream's key and its count."""

    def __init__(self, rngs):
        self.u8 = nnx.Variable(jax.random.bits(rngs.params(), (3, 5), np.uint8))
        self.u16 = nnx.Variable(jax.random.bits(rngs.params(), (7,), np.uint16))
        self.u32 = nnx.Variable(jax.random.bits(rngs.params(), (2, 3, 4), np.uint32))
        self.normal = nnx.Param(jax.random.normal(rngs.params(), (6, 5)))
        self.uniform = nnx.Param(jax.random.uniform(rngs.params(), (9,)))
        self.linear = nnx.Linear(5, 4, rngs=rngs)  # flax's truncated normal
        keys = jax.random.split(rngs.params(), 3)
        self.split = nnx.Variable(jax.random.key_data(keys))
        self.batched = nnx.Param(jax.vmap(lambda k: jax.random.normal(k, (2,)))(keys))
        # Messages at the ends of uint32 and a negative int32 (taken modulo 2^32).
        key = rngs.params()
        self.folded = nnx.Variable(jnp.stack([
            jax.random.key_data(jax.random.fold_in(key, m))
            for m in (0, 2**32 - 1, jnp.int32(-5), jnp.uint32(7))
        ]))  # fmt: skip
        self.rbg = nnx.Variable(jax.random.bits(jax.random.key(0, impl="rbg"), (4,)))
        self.grid = nnx.Variable(jax.random.key_data(jax.random.split(rngs.params(), (2, 3))))
        with jax.threefry_partitionable(False):  # the other threefry: its own algorithm
            self.legacy = nnx.Variable(jax.random.bits(rngs.params(), (5,)))
            legacy_keys = jax.random.split(rngs.params(), (2, 3))
            self.legacy_split = nnx.Variable(jax.random.key_data(legacy_keys))
            # Ready in the first round with the fold-ins, and still not merged.
            seed_keys = jax.random.split(jax.random.key(5), (2, 3))
            self.legacy_seed_split = nnx.Variable(jax.random.key_data(seed_keys))
        self.seed_split = nnx.Variable(
            jax.random.key_data(jax.random.split(jax.random.key(6), (2, 3)))
        )
        self.empty = nnx.Param(jax.random.normal(rngs.params(), (0, 3)))


@pytest.fixture
def merged(monkeypatch):
    """The size of every merged hash a build runs, in order."""
    from nnxscan.pure import build as build_module

    sizes = []
    real = build_module._merged_hashes
    monkeypatch.setattr(
        build_module,
        "_merged_hashes",
        lambda ops, values: sizes.append(len(ops)) or real(ops, values),
    )
    return sizes


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_a_builds_draws_are_one_hash_with_each_draws_own_bits(merged):
    constructor = lambda: _Draws(nnx.Rngs(0))  # noqa: E731
    eager, built = constructor(), build_compiled(constructor)
    # Keys and integer draws are the eager ones exactly (their own programs, one by one);
    # the float ones to float rounding. The hashes ran as two: the thirteen fold-ins of the
    # stream's key and the partitionable split of a seed key (all ready at once), then the
    # seven partitionable scalar-key draws; the keys made from those keys (the splits, the
    # fold-ins of the twelfth) and the unpartitionable split ran on their own.
    exact = ("u8", "u16", "u32", "rbg", "legacy", "split", "folded", "grid", "legacy_split",
             "legacy_seed_split", "seed_split")  # fmt: skip
    for name in exact:
        np.testing.assert_array_equal(getattr(built, name)[...], getattr(eager, name)[...])
    _assert_built_alike(eager, built)
    assert merged == [14, 7]
    # With x64 on, 64-bit draws come out of the same hash too.
    with jax.enable_x64(True):
        wide = lambda: nnx.Variable(jax.random.bits(jax.random.key(3), (5,), np.uint64))  # noqa: E731
        both = lambda: _Pair(wide(), nnx.Variable(jax.random.bits(jax.random.key(4), (3,))))  # noqa: E731
        np.testing.assert_array_equal(build_compiled(both).a[...], both().a[...])
    assert merged == [14, 7, 2]


class _Chain(nnx.Module):
    """``key, sub = split(key)`` twenty times, a draw of each ``sub``."""

    def __init__(self):
        key, draws = jax.random.key(0), []
        for _ in range(20):
            key, sub = jax.random.split(key)
            draws.append(jax.random.bits(sub, (3,)))
        self.draws = nnx.Variable(jnp.stack(draws))
        self.key = nnx.Variable(jax.random.key_data(key))


@pytest.mark.slow_on_accelerator("eager builds op by op as the reference: 16 s")
def test_a_chain_of_splits_runs_through_and_its_draws_merge(merged):
    # Keys merge in the first round only: the chain's first split, then the other
    # nineteen as ordinary ops, then all twenty draws in one hash (a round per link
    # would compile twenty hashes).
    eager, built = _Chain(), build_compiled(_Chain)
    np.testing.assert_array_equal(built.draws[...], eager.draws[...])
    np.testing.assert_array_equal(built.key[...], eager.key[...])
    assert merged == [1, 20]


class _Pair(nnx.Module):
    def __init__(self, a, b):
        self.a, self.b = a, b
