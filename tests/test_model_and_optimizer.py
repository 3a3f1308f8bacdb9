"""``nnx.ModelAndOptimizer`` (what Flax's own ``wrt`` error tells newcomers to use) wherever
an ``nnx.Optimizer`` is taken: the built-in step, a stateful step, checkpoints and resume.

Each run with an ``nnx.ModelAndOptimizer`` is the same program on the same inputs as the run
with an ``nnx.Optimizer`` (the optimizer's state enters the compiled call as the same optax
pytree), so the two are equal bitwise; the ``nnx.Optimizer`` runs are held to Flax's own loop
in tests/test_shell.py and tests/test_checkpoint_trainer.py.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import Trainer, scan_train

from conftest import MLP, BNDropout, assert_trees_close, epoch_batches, reference_loop, xent

TX = optax.adam(1e-2)
BOTH = [nnx.Optimizer, nnx.ModelAndOptimizer]


def _optimizer(kind, model):
    return kind(model, TX, wrt=nnx.Param)


def _stacked(data, steps=6, batch=8):
    return jax.tree.map(lambda v: v[: steps * batch].reshape(steps, batch, *v.shape[1:]), data)


def _assert_same_run(a, b):
    """Two (model, optimizer) pairs hold the same bits: parameters, batch statistics, RNG
    state, the optax state and the step."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    assert_trees_close(model_a, model_b, exact=True)
    assert_trees_close(opt_a.opt_state, opt_b.opt_state, exact=True)
    assert int(opt_a.step[...]) == int(opt_b.step[...])


def test_scan_train_with_a_model_and_optimizer_is_the_nnx_optimizer_run(data):
    runs = []
    for kind in BOTH:
        model = BNDropout(rngs=nnx.Rngs(0))
        optimizer = _optimizer(kind, model)
        losses = scan_train(model, optimizer, xent, _stacked(data))
        runs.append(((model, optimizer), losses))
    _assert_same_run(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert int(runs[1][0][1].step[...]) == 6

    # Flax's own loop, with ModelAndOptimizer's update(grads): to rounding (another program).
    model = BNDropout(rngs=nnx.Rngs(0))
    optimizer = nnx.ModelAndOptimizer(model, TX)

    @nnx.jit
    def flax_step(optimizer, batch):
        loss, grads = nnx.value_and_grad(xent)(optimizer.model, batch)
        optimizer.update(grads)
        return loss

    stacked = _stacked(data)
    for i in range(6):
        flax_step(optimizer, jax.tree.map(lambda v, i=i: v[i], stacked))
    assert_trees_close(runs[1][0][0], model, rtol=1e-5, atol=1e-6)


def test_fit_checkpoint_and_resume_with_a_model_and_optimizer(tmp_path, data):
    """fit, save, and resume in fresh objects: a ModelAndOptimizer run is the nnx.Optimizer
    run, and a checkpoint of one restores into the other (the same optax state)."""
    runs = []
    for kind in BOTH:
        model = MLP(rngs=nnx.Rngs(0))
        trainer = Trainer(model, _optimizer(kind, model), xent)
        trainer.fit(data, epochs=2, batch_size=16, checkpoint_dir=tmp_path / kind.__name__,
                    progress=False)  # fmt: skip
        runs.append((model, trainer.optimizer))
    _assert_same_run(*runs)
    assert_trees_close(runs[1][1].model, runs[1][0], exact=True)  # .model is the model

    # Resume each kind's checkpoint into the other kind, and train two more epochs.
    resumed = []
    for kind, saved in zip(BOTH, reversed(BOTH), strict=True):
        model = MLP(rngs=nnx.Rngs(1))
        trainer = Trainer(model, _optimizer(kind, model), xent)
        trainer.fit(data, epochs=4, batch_size=16, checkpoint_dir=tmp_path / saved.__name__,
                    resume=True, progress=False)  # fmt: skip
        resumed.append((model, trainer.optimizer))
    _assert_same_run(*resumed)
    assert int(resumed[1][1].step[...]) == 4 * 4

    # Trained straight through, the same: a resume is bitwise the uninterrupted run.
    model = MLP(rngs=nnx.Rngs(0))
    straight = Trainer(model, _optimizer(nnx.ModelAndOptimizer, model), xent)
    straight.fit(data, epochs=4, batch_size=16, progress=False)
    _assert_same_run(resumed[1], (model, straight.optimizer))


def _flax_step(model, optimizer, batch):
    """A user's stateful step as Flax's guides write it for an nnx.Optimizer."""
    loss, grads = nnx.value_and_grad(xent)(model, batch)
    optimizer.update(model, grads)
    return loss


def _model_and_optimizer_step(model, optimizer, batch):
    """The same with ModelAndOptimizer's own update(grads)."""
    loss, grads = nnx.value_and_grad(xent)(model, batch)
    optimizer.update(grads)
    return loss


@pytest.mark.parametrize("front", ["scan_train", pytest.param("Trainer", marks=pytest.mark.slow)])
def test_a_stateful_step_with_a_model_and_optimizer(front, data):
    runs = []
    for kind, fn in zip(BOTH, (_flax_step, _model_and_optimizer_step), strict=True):
        model = BNDropout(rngs=nnx.Rngs(0))
        optimizer = _optimizer(kind, model)
        if front == "scan_train":
            scan_train(model, optimizer, batches=_stacked(data), train_step=fn)
        else:
            trainer = Trainer(model, optimizer, train_step=fn)
            trainer.fit(data, epochs=1, batch_size=8, shuffle=False, progress=False)
        runs.append((model, optimizer))
    _assert_same_run(*runs)
    # And Flax's own per-step loop (another program: to rounding).
    model = BNDropout(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    batches = epoch_batches(data, 8, 0, 0, shuffle=False)[: 6 if front == "scan_train" else None]
    reference_loop(model, optimizer, xent, batches)
    assert_trees_close(runs[1][0], model, rtol=1e-5, atol=1e-6)
