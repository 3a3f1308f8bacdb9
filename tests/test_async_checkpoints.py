"""Asynchronous checkpoints: a save returns once the arrays are on the host and is written
in the background; nothing a checkpoint promises is lost (the next save, the end of fit,
a preemption and an exception wait for it); ``checkpoint_async=False`` opts out.

The references: the tree that was saved (read back bitwise), the synchronous writer, and
a fit without checkpoints (bitwise the same model).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.adapters.checkpoint import Checkpointer, all_steps, restore_checkpoint
from nnxscan.shell import LambdaCallback, Trainer

from conftest import MLP, assert_trees_close, make_data, state_arrays, xent

DATA = make_data(64)  # 8 steps an epoch of 8


def test_a_save_returns_before_its_write_and_survives_its_arrays_being_donated(tmp_path):
    """The device buffers of a saved tree may be deleted (donated to the next compiled
    call) as soon as save returns: what lands on disk is what was saved."""
    import jax
    import jax.numpy as jnp

    saved = {"w": np.arange(12.0, dtype=np.float32).reshape(3, 4), "meta": {"step": 5}}
    live = {"w": jnp.asarray(saved["w"]), "meta": {"step": 5}}
    with Checkpointer(tmp_path, asynchronous=True) as checkpointer:
        path = checkpointer.save(5, live)
        live["w"].delete()  # what donating it to the next call does
        assert checkpointer.latest_step() == 5  # waits for the write in flight
    like = {"w": jax.ShapeDtypeStruct((3, 4), np.float32), "meta": {"step": 0}}
    tree, step = restore_checkpoint(tmp_path, like)
    assert step == 5 and path.name == "5" and tree["meta"]["step"] == 5
    np.testing.assert_array_equal(np.asarray(tree["w"]), saved["w"])


def test_the_next_save_waits_for_the_one_in_flight_and_steps_still_must_increase(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=2) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.save(step, {"x": np.full((2,), step, np.float32)})
        with pytest.raises(ValueError, match="older than the latest checkpoint 3"):
            checkpointer.save(1, {"x": np.zeros((2,), np.float32)})  # deleted by max_to_keep
    assert all_steps(tmp_path) == [2, 3]  # max_to_keep applied once each write finished


# One transform for every Trainer here: the shell caches compiled programs by the
# transform object, so the fits and restores of the same model reuse one compile.
TX = optax.adam(1e-2)


def fit(directory=None, **options):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    history = trainer.fit(DATA, epochs=3, batch_size=8, checkpoint_dir=directory,
                          progress=False, **options)  # fmt: skip
    return trainer, history


def test_every_checkpoint_of_a_fit_is_on_disk_when_fit_returns_and_training_is_unchanged(
    tmp_path,
):
    plain, _ = fit()
    trainer, _ = fit(tmp_path, checkpoint_every_steps=3)
    assert_trees_close(trainer.model, plain.model, exact=True)  # saves change no bit
    # Epoch ends (8, 16, 24) and step saves (every 3 steps at call boundaries); max 3 kept.
    assert all_steps(tmp_path)[-1] == 24
    resumed = Trainer(MLP(rngs=nnx.Rngs(5)), TX, xent)
    assert resumed.restore(tmp_path) == 3
    assert_trees_close(resumed.model, plain.model, exact=True)


def test_an_exception_after_a_save_waits_for_it_before_it_leaves_fit(tmp_path):
    class Boom(Exception):
        pass

    def explode(trainer, epoch):
        if epoch == 2:
            raise Boom

    with pytest.raises(Boom):
        fit(tmp_path, callbacks=[LambdaCallback(on_epoch_begin=explode)])
    # Epoch 1's checkpoint was written in the background; it is whole, and the newest.
    assert all_steps(tmp_path) == [8, 16]
    trainer = Trainer(MLP(rngs=nnx.Rngs(5)), TX, xent)
    assert trainer.restore(tmp_path) == 2


def test_checkpoint_async_false_makes_each_save_durable_before_training_goes_on(tmp_path):
    seen = []

    def look(trainer, epoch):  # the previous epoch's save is on disk already
        seen.append(all_steps(tmp_path))

    trainer, _ = fit(tmp_path, checkpoint_async=False,
                     callbacks=[LambdaCallback(on_epoch_begin=look)])  # fmt: skip
    assert seen == [[], [8], [8, 16]]
    plain, _ = fit()
    for a, b in zip(state_arrays(trainer.model), state_arrays(plain.model), strict=True):
        np.testing.assert_array_equal(a, b)
