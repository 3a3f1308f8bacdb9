"""Trainer's on_nonfinite policies and accumulate, against the per-step NNX loop."""

from __future__ import annotations

import warnings

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import NonFiniteLossWarning, Population, Trainer

from conftest import MLP, assert_trees_close, epoch_batches, make_data, reference_loop, xent

TX = optax.adam(1e-2)
BS = 8


@pytest.fixture(scope="module")
def poisoned():
    d = make_data()
    d["x"] = d["x"].copy()
    d["x"][13, 2] = np.nan  # one bad example: the batch holding it goes bad each epoch
    return d


def has_nan(batch):
    return bool(np.isnan(batch["x"]).any())


def test_skip_trains_every_finite_batch_and_counts_the_skipped(poisoned):
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    good = [b for e in range(2) for b in epoch_batches(poisoned, BS, 0, e) if not has_nan(b)]
    reference_loop(ref, ref_opt, xent, good)

    model = MLP(rngs=nnx.Rngs(0))
    history = Trainer(model, TX, xent, on_nonfinite="skip").fit(
        poisoned, epochs=2, batch_size=BS, progress=False
    )
    assert [e["skipped_steps"] for e in history.epochs] == [1, 1]
    assert np.isnan(history.losses).sum() == 2 and np.isfinite(history.epochs[1]["loss"])
    assert_trees_close(model, ref)


def test_stop_raises_naming_the_step_with_the_model_just_before_it(poisoned):
    batches = [b for e in range(2) for b in epoch_batches(poisoned, BS, 0, e)]
    bad = next(i for i, b in enumerate(batches) if has_nan(b))
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    reference_loop(ref, ref_opt, xent, batches[:bad])

    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    trainer = Trainer(model, optimizer, xent, on_nonfinite="stop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(FloatingPointError, match=rf"epoch 0, global step {bad}\b"):
            trainer.fit(poisoned, epochs=2, batch_size=BS, progress=False)
    assert not [w for w in caught if issubclass(w.category, NonFiniteLossWarning)]
    assert trainer.step == bad == int(optimizer.step[...]) and trainer.epoch == 0
    assert_trees_close(model, ref)
    assert_trees_close(optimizer, ref_opt)
    assert np.isfinite(np.asarray(model(poisoned["x"][:4]))).all()


def nonfinite_warnings(fit) -> list[warnings.WarningMessage]:
    """The NonFiniteLossWarnings ``fit()`` issues (every one recorded, none filtered)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit()
    return [w for w in caught if issubclass(w.category, NonFiniteLossWarning)]


def test_ignore_lets_the_nan_through_like_the_plain_loop_and_warns_once_with_the_count(
    poisoned,
):
    # The plain loop on the same batches: how many of its losses are not finite.
    batches = [b for e in range(2) for b in epoch_batches(poisoned, BS, 0, e)]
    ref = MLP(rngs=nnx.Rngs(0))
    ref_losses = np.asarray(
        reference_loop(ref, nnx.Optimizer(ref, TX, wrt=nnx.Param), xent, batches)
    )
    bad = int((~np.isfinite(ref_losses)).sum())
    assert 0 < bad < len(batches), "the NaN should appear after the first step"

    model = MLP(rngs=nnx.Rngs(0))
    out = []
    caught = nonfinite_warnings(
        lambda: out.append(
            Trainer(model, TX, xent).fit(poisoned, epochs=2, batch_size=BS, progress=False)
        )
    )
    assert np.isnan(out[0].epochs[0]["loss"])
    assert np.isnan(np.asarray(model.l1.kernel[...])).any()
    assert len(caught) == 1, "one warning after fit, not one per epoch"
    (warning,) = caught
    message = str(warning.message)
    assert f"{bad} of the {len(batches)} training steps" in message
    assert 'on_nonfinite="skip"' in message and 'on_nonfinite="stop"' in message
    assert warning.filename == __file__  # the user's line, not nnxscan's


def test_a_population_warns_with_each_members_count(poisoned):
    batches = [b for e in range(2) for b in epoch_batches(poisoned, BS, 0, e)]
    counts = []
    for seed in (0, 1):
        ref = MLP(rngs=nnx.Rngs(seed))
        losses = reference_loop(ref, nnx.Optimizer(ref, TX, wrt=nnx.Param), xent, batches)
        counts.append(int((~np.isfinite(np.asarray(losses))).sum()))
    pop = Population(lambda rngs: MLP(rngs=rngs), TX, xent, seeds=[0, 1])
    caught = nonfinite_warnings(
        lambda: pop.fit(poisoned, epochs=2, batch_size=BS, shared_order=True, progress=False)
    )
    (warning,) = caught
    assert f"member 0: {counts[0]}, member 1: {counts[1]}" in str(warning.message)
    assert warning.filename == __file__


@pytest.mark.parametrize("policy", ["ignore", "skip"])
def test_no_warning_on_a_clean_run_nor_under_skip(poisoned, policy):
    data = poisoned if policy == "skip" else make_data()
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent, on_nonfinite=policy)
    caught = nonfinite_warnings(lambda: trainer.fit(data, epochs=2, batch_size=BS, progress=False))
    assert caught == []


def test_trainer_accumulate_equals_whole_batch_steps():
    d = make_data()
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    reference_loop(ref, ref_opt, xent, epoch_batches(d, 16, 0, 0))
    model = MLP(rngs=nnx.Rngs(0))
    Trainer(model, TX, xent, accumulate=4).fit(d, epochs=1, batch_size=16, progress=False)
    assert_trees_close(model, ref, rtol=1e-4, atol=1e-6)


def test_bad_policy_arguments():
    with pytest.raises(ValueError, match="on_nonfinite='panic'"):
        Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent, on_nonfinite="panic")
    with pytest.raises(ValueError, match="accumulate"):
        Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent, accumulate=0)
