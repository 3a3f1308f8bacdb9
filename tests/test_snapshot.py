"""The owner's cheap re-split (shell/_engine/snapshot.py): what it gives is exactly what
``nnx.split`` gives (the reference), before and after every kind of change a user may make
between calls, and it keeps nothing alive."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import Trainer
from nnxscan.shell._engine.snapshot import GraphSnapshot, remember, retrace

from conftest import MLP, BNDropout, make_data, xent


def _variables(state):
    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def assert_split_of(found, node):
    """``found`` is what ``nnx.split(node)`` gives now: an equal graphdef and a State of the
    very same Variable objects, in the same order."""
    graphdef, state = nnx.split(node)
    assert found is not None
    assert found[0] == graphdef
    assert jax.tree.structure(found[1]) == jax.tree.structure(state)
    got, want = _variables(found[1]), _variables(state)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want, strict=True))


def _model_and_optimizer():
    model = MLP(rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


CHANGES = {
    "a new value": lambda m, o: m.l1.kernel.set_value(m.l1.kernel[...] + 1),
    "an equal plain attribute set anew": lambda m, o: setattr(m.l1, "use_bias", True),
}
STRUCTURAL = {
    "a replaced submodule": lambda m, o: setattr(m, "l1", nnx.Linear(4, 8, rngs=nnx.Rngs(5))),
    "a new attribute": lambda m, o: setattr(m, "extra", nnx.Param(jnp.ones(3))),
    "changed metadata": lambda m, o: m.l1.kernel.set_metadata(tag="x"),
    "a replaced Variable": lambda m, o: setattr(m.l1, "bias", nnx.Param(jnp.zeros(8))),
    "another Variable type": lambda m, o: setattr(m.l1, "bias", nnx.BatchStat(jnp.zeros(8))),
    "a changed plain attribute": lambda m, o: setattr(m.l1, "in_features", 5),
    "a replaced optimizer moment": lambda m, o: (
        o.opt_state[0].mu["l1"].__setitem__("kernel", nnx.OptVariable(jnp.zeros((4, 8))))
    ),
    "a new optimizer step Variable": lambda m, o: setattr(o, "step", nnx.OptState(jnp.uint32(3))),
}


@pytest.mark.parametrize("change", list(CHANGES) + list(STRUCTURAL))
def test_a_retrace_is_what_nnx_split_gives_after_any_change(change):
    """Followed exactly when ``nnx.split`` would give the same graphdef (a new value, an
    equal plain attribute, a Variable replaced by one of the same type and metadata), and
    then it gives nnx.split's state; given up otherwise (the owner splits again)."""
    model, optimizer = _model_and_optimizer()
    node = (model, optimizer)
    snapshot = GraphSnapshot(node, *nnx.split(node))
    assert snapshot.followable
    assert_split_of(snapshot.split(node), node)
    (CHANGES | STRUCTURAL)[change](model, optimizer)
    found = snapshot.split(node)
    if found is not None:  # followed only where it is nnx.split's answer
        assert_split_of(found, node)
    if nnx.split(node)[0] != snapshot.graphdef:
        assert found is None
    if change in ("a replaced Variable", "a replaced optimizer moment") or change in CHANGES:
        assert found is not None  # these keep the graphdef: the cheap path must hold them


def test_weights_tied_after_the_snapshot_are_not_followed():
    """``m.b = m.a`` after the snapshot: one Variable in two places, so nnx.split gives
    another graphdef with fewer leaves (the tied weights train as one)."""

    class Two(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(2, 2, rngs=nnx.Rngs(1))

    model = Two()
    snapshot = GraphSnapshot(model, *nnx.split(model))
    model.b.kernel = model.a.kernel
    assert nnx.split(model)[0] != snapshot.graphdef and snapshot.split(model) is None


def test_a_model_holding_itself_through_a_static_attribute_is_freed():
    """A bound method kept as an attribute makes the graphdef hold the model: such a model
    is not remembered (a snapshot would keep it alive), and is freed when dropped."""

    class Holder(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.act = self.relu  # a static attribute that refers to the module

        def relu(self, x):
            return nnx.relu(x)

    first = Holder()
    assert not GraphSnapshot(first, *nnx.split(first)).followable
    remember(first, *nnx.split(first))
    assert retrace(first) is None
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None


def test_lists_dicts_shared_modules_and_rngs_are_followed():
    class Tied(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.b = self.a  # shared
            self.blocks = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(1)) for _ in range(2)])
            self.named = nnx.Dict(x=nnx.Linear(2, 2, rngs=nnx.Rngs(2)))

    model = Tied()
    node = (model, nnx.Rngs(0, dropout=1), nnx.MultiMetric(loss=nnx.metrics.Average("loss")))
    snapshot = GraphSnapshot(node, *nnx.split(node))
    assert_split_of(snapshot.split(node), node)
    model.blocks.append(nnx.Linear(2, 2, rngs=nnx.Rngs(3)))
    assert snapshot.split(node) is None
    snapshot = GraphSnapshot(node, *nnx.split(node))
    model.b = nnx.Linear(2, 2, rngs=nnx.Rngs(4))  # no longer shared
    assert snapshot.split(node) is None
    attention = nnx.MultiHeadAttention(2, 4, decode=False, rngs=nnx.Rngs(0))  # FrozenDicts
    snapshot = GraphSnapshot(attention, *nnx.split(attention))
    assert snapshot.followable
    assert_split_of(snapshot.split(attention), attention)
    bn = BNDropout(rngs=nnx.Rngs(0))
    snapshot = GraphSnapshot(bn, *nnx.split(bn))
    assert_split_of(snapshot.split(bn), bn)
    bn.eval()  # use_running_average / deterministic flip: another graphdef
    assert snapshot.split(bn) is None


def test_hijax_variables_are_never_followed():
    with nnx.var_defaults(hijax=True):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    snapshot = GraphSnapshot(model, *nnx.split(model))
    assert not snapshot.followable and snapshot.split(model) is None


def test_a_remembered_snapshot_keeps_no_model_alive():
    model, optimizer = _model_and_optimizer()
    node = (model, optimizer)
    remember(node, *nnx.split(node))
    assert_split_of(retrace(node), node)
    kernel = weakref.ref(model.l1.kernel[...])
    gone = weakref.ref(model)
    del model, optimizer, node
    gc.collect()
    assert gone() is None and kernel() is None


def test_fit_trains_a_layer_replaced_between_fits():
    """A layer the user replaces between two fits is the one the second fit trains and
    writes back; the old layer, no longer in the model, is left as the first fit left it."""
    data = make_data()
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, optax.adam(1e-2), xent)
    trainer.fit(data, epochs=1, batch_size=8, progress=False)
    old = model.l1
    old_kernel = np.asarray(old.kernel[...])
    model.l1 = nnx.Linear(4, 8, rngs=nnx.Rngs(7))
    start = np.asarray(model.l1.kernel[...])
    trainer.fit(data, epochs=1, batch_size=8, progress=False)
    np.testing.assert_array_equal(np.asarray(old.kernel[...]), old_kernel)
    assert not np.allclose(np.asarray(model.l1.kernel[...]), start)
    _, state = nnx.split(model)
    np.testing.assert_array_equal(np.asarray(state["l1"]["kernel"][...]), model.l1.kernel[...])
