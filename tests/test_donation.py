"""Donation never deletes an array that something besides the trained objects references.

``nnx.clone(model)`` shares its arrays with ``model``; so does a teacher whose weights were
loaded into a student, a dict of ``model.kernel[...]``, a callback's snapshot. Each of them
must keep its values and stay usable after ``fit`` / ``scan_train`` (the reference: host
copies taken before, and a plain NNX loop or a twin run for what was trained), while an
array nothing else holds is still donated (its buffer is reused in place).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnxscan.shell._engine.engine as engine_module
from nnxscan.shell import LambdaCallback, Plan, Population, Trainer, scan_train

from conftest import (
    MLP,
    assert_trees_close,
    epoch_batches,
    reference_loop,
    state_arrays,
    xent,
    xent_aux,
)

# One transform for the file: compiled programs are cached by it, so tests reuse them.
TX = optax.adam(1e-2)
B, EPOCHS = 16, 2


def host(tree) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(tree)]


def assert_same_bits(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def reference(data, model_seed: int = 0, seed: int = 0, epochs: int = EPOCHS, wrt=nnx.Param):
    """The plain per-step NNX loop on the batches fit trains (its shuffle rule)."""
    model = MLP(rngs=nnx.Rngs(model_seed))
    optimizer = nnx.Optimizer(model, TX, wrt=wrt)
    for epoch in range(epochs):
        reference_loop(model, optimizer, xent, epoch_batches(data, B, seed, epoch))
    return model


def pointers(model) -> list[int]:
    return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(nnx.state(model))]


@pytest.mark.parametrize("execution", ["auto", "step", Plan("unrolled", 2)])
def test_a_clone_keeps_its_values_and_stays_usable_after_fit(data, execution):
    model = MLP(rngs=nnx.Rngs(0))
    original = nnx.clone(model)  # shares every array with model
    before = state_arrays(original)
    Trainer(model, TX, xent, execution=execution).fit(
        data, epochs=EPOCHS, batch_size=B, progress=False
    )
    assert_same_bits(state_arrays(original), before)
    np.testing.assert_array_equal(original(data["x"]), MLP(rngs=nnx.Rngs(0))(data["x"]))
    assert_trees_close(model, reference(data))
    # Usable: trained the same way, the clone ends exactly where the model did.
    Trainer(original, TX, xent, execution=execution).fit(
        data, epochs=EPOCHS, batch_size=B, progress=False
    )
    assert_same_bits(state_arrays(original), state_arrays(model))


def test_scan_train_keeps_a_clone_of_the_model_and_of_the_optimizer(data):
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    twin, twin_optimizer = nnx.clone(model), nnx.clone(optimizer)
    before = state_arrays(twin) + state_arrays(twin_optimizer)
    batches = epoch_batches(data, B, 0, 0)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *batches)
    losses = scan_train(model, optimizer, xent, stacked)
    assert_same_bits(state_arrays(twin) + state_arrays(twin_optimizer), before)
    # The clones train on as the plain loop does, to where scan_train took the originals.
    ref_losses = reference_loop(twin, twin_optimizer, xent, batches)
    np.testing.assert_allclose(np.asarray(losses), np.asarray(ref_losses), rtol=1e-6)
    assert_trees_close(twin, model)
    assert int(twin_optimizer.step[...]) == int(optimizer.step[...]) == len(batches)


def test_a_teacher_whose_weights_a_student_shares_keeps_them(data):
    """Transfer learning: the student's first layer loaded from the teacher (its arrays,
    not copies) and frozen; the student's head trains."""
    teacher = MLP(rngs=nnx.Rngs(1))
    before = state_arrays(teacher)
    student = MLP(rngs=nnx.Rngs(0))
    nnx.update(student.l1, nnx.state(teacher.l1))
    head_only = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("l1")))
    Trainer(student, TX, xent, wrt=head_only).fit(data, epochs=EPOCHS, batch_size=B, progress=False)
    assert_same_bits(state_arrays(teacher), before)
    np.testing.assert_array_equal(teacher(data["x"]), MLP(rngs=nnx.Rngs(1))(data["x"]))
    assert_same_bits(state_arrays(student.l1), state_arrays(teacher.l1))  # frozen
    expected = MLP(rngs=nnx.Rngs(0))
    nnx.update(expected.l1, nnx.state(MLP(rngs=nnx.Rngs(1)).l1))
    optimizer = nnx.Optimizer(expected, TX, wrt=head_only)
    for epoch in range(EPOCHS):
        reference_loop(expected, optimizer, xent, epoch_batches(data, B, 0, epoch))
    assert_trees_close(student, expected)


def test_a_dict_of_the_models_arrays_stays_live(data):
    model = MLP(rngs=nnx.Rngs(0))
    kept = nnx.to_pure_dict(nnx.state(model))  # the model's own arrays, no copies
    kept["by_hand"] = model.l1.kernel[...]
    before = host(kept)
    trainer = Trainer(model, TX, xent)
    trainer.fit(data, epochs=EPOCHS, batch_size=B, progress=False)
    assert_same_bits(host(kept), before)
    assert_trees_close(model, reference(data))


@pytest.mark.parametrize("execution", ["auto", "step"])
def test_snapshots_a_callback_keeps_every_epoch_stay_live(data, execution):
    """A callback that keeps the model's arrays each epoch (no copy): every snapshot still
    holds the values it saw, as a host copy taken at the same moment shows."""
    model = MLP(rngs=nnx.Rngs(0))
    snapshots, copies = [], []

    def keep(trainer, epoch, logs):
        snapshots.append(nnx.to_pure_dict(nnx.state(trainer.model)))
        copies.append(host(snapshots[-1]))

    callback = LambdaCallback(on_epoch_end=keep)
    Trainer(model, TX, xent, execution=execution).fit(
        data, epochs=3, batch_size=B, progress=False, callbacks=[callback]
    )
    assert len(snapshots) == 3
    for snapshot, copy in zip(snapshots, copies, strict=True):
        assert_same_bits(host(snapshot), copy)
    assert not np.array_equal(copies[0][0], copies[1][0])  # each epoch's own values
    assert_same_bits(copies[-1], host(nnx.to_pure_dict(nnx.state(model))))
    assert_trees_close(model, reference(data, epochs=3))


def test_one_array_in_two_variables_and_held_by_the_user(data):
    """The carry holds one array twice (two Variables over it) and the user holds it too:
    both Variables train on their own, the user's array stays as it was."""

    class Tied(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            shared = nnx.initializers.lecun_normal()(rngs.params(), (4, 3))
            self.a, self.b = nnx.Param(shared), nnx.Param(shared)

        def __call__(self, x):
            return x @ self.a[...] + 2 * (x @ self.b[...])

    model = Tied(nnx.Rngs(0))
    held = model.a[...]
    before = np.array(held)
    Trainer(model, TX, xent).fit(data, epochs=1, batch_size=B, progress=False)
    np.testing.assert_array_equal(np.asarray(held), before)
    expected = Tied(nnx.Rngs(0))
    reference_loop(expected, nnx.Optimizer(expected, TX, wrt=nnx.Param), xent,
                   epoch_batches(data, B, 0, 0))  # fmt: skip
    assert_trees_close(model, expected)


def test_a_population_built_from_shared_initial_weights_leaves_them_intact(data):
    base = MLP(rngs=nnx.Rngs(0))
    before = state_arrays(base)
    population = Population(lambda rngs: base, TX, xent, seeds=[0, 1])
    history = population.fit(data, epochs=EPOCHS, batch_size=B, progress=False)
    assert_same_bits(state_arrays(base), before)
    np.testing.assert_array_equal(base(data["x"]), MLP(rngs=nnx.Rngs(0))(data["x"]))
    for i, seed in enumerate([0, 1]):
        alone = nnx.clone(base)  # shares base's arrays too
        losses = (
            Trainer(alone, TX, xent)
            .fit(data, epochs=EPOCHS, batch_size=B, seed=seed, progress=False)
            .losses
        )
        np.testing.assert_allclose(history.losses[:, i], losses, rtol=1e-5, atol=1e-6)
        assert_trees_close(population.member(i), alone)
    assert_same_bits(state_arrays(base), before)


def test_arrays_nothing_else_holds_are_still_donated(data, monkeypatch):
    """Donated buffers are reused in place (the same addresses after fit); a clone's
    shared ones are copied first (new addresses). Donation forced on every backend: a TPU
    keeps a carry this small (``calls.donates_carry``, tests/test_donation_rule.py)."""
    monkeypatch.setattr(engine_module, "donates_carry", lambda carry, backend=None: True)
    for make in (lambda m: TX, lambda m: nnx.Optimizer(m, TX, wrt=nnx.Param)):
        model = MLP(rngs=nnx.Rngs(0))
        trainer = Trainer(model, make(model), xent)
        trainer.fit(data, epochs=1, batch_size=B, progress=False)  # commits the arrays
        before = pointers(model)
        trainer.fit(data, epochs=EPOCHS, batch_size=B, progress=False)
        assert pointers(model) == before
        clone = nnx.clone(model)
        trainer.fit(data, epochs=EPOCHS, batch_size=B, progress=False)
        assert not set(pointers(model)) & set(before)
        assert pointers(clone) == before  # the clone's arrays are untouched
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *epoch_batches(data, B, 0, 0))
    scan_train(model, optimizer, xent, stacked)
    before = pointers(model)
    scan_train(model, optimizer, xent, stacked)
    assert pointers(model) == before


def update_loss(metrics, loss, aux, batch):
    metrics.update(loss=loss)


def test_with_training_metrics_a_clone_and_snapshots_stay_live(data):
    """Training metrics are reset between epochs (the carry is read from the model again):
    a clone and per-epoch snapshots still keep their arrays, and the model trains as the
    same fit with nothing shared does."""

    def run(share: bool):
        model = MLP(rngs=nnx.Rngs(0))
        original = nnx.clone(model) if share else None
        snapshots, copies = [], []

        def keep(trainer, epoch, logs):
            if share:
                snapshots.append(nnx.to_pure_dict(nnx.state(trainer.model)))
                copies.append(host(snapshots[-1]))

        trainer = Trainer(
            model, TX, xent_aux, has_aux=True, metrics=nnx.metrics.Average("loss"),
            update_metrics=update_loss,
        )  # fmt: skip
        history = trainer.fit(data, epochs=3, batch_size=B, progress=False,
                              callbacks=[LambdaCallback(on_epoch_end=keep)])  # fmt: skip
        return model, original, snapshots, copies, history

    model, original, snapshots, copies, history = run(share=True)
    plain, _, _, _, plain_history = run(share=False)
    assert_same_bits(state_arrays(original), state_arrays(MLP(rngs=nnx.Rngs(0))))
    for snapshot, copy in zip(snapshots, copies, strict=True):
        assert_same_bits(host(snapshot), copy)
    assert_same_bits(state_arrays(model), state_arrays(plain))
    np.testing.assert_array_equal(history.losses, plain_history.losses)
    assert [e["train_loss"] for e in history.epochs] == [
        e["train_loss"] for e in plain_history.epochs
    ]
