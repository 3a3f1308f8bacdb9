"""The next epoch's order, cut and placed while the device runs an epoch's last call.

When each epoch of a fit is a call of its own (an epoch-end hook, evaluation), placing the
next epoch's indices is host time the next call would otherwise wait for, so ``ArrayEpochs``
places them as soon as the last call of an epoch is dispatched, and only then: not after a
fit's last epoch, not between fused epochs. The references: the plain per-step NNX loop over
the documented order, and the same fit with nothing placed ahead (bitwise: the same arrays,
placed earlier).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import Trainer
from nnxscan.shell._engine.epochs import ArrayEpochs
from nnxscan.shell.callbacks import LambdaCallback

from conftest import MLP, assert_trees_close, epoch_batches, reference_loop, tolerance, xent

TX = optax.adam(1e-2)
BS = 16


@pytest.fixture
def placed(monkeypatch):
    """The epochs placed ahead, in order."""
    epochs = []
    real = ArrayEpochs._place_ahead

    def spy(self, epoch):
        epochs.append(epoch)
        return real(self, epoch)

    monkeypatch.setattr(ArrayEpochs, "_place_ahead", spy)
    return epochs


def _fit(data, hook: bool, epochs: int = 3, loss=xent):
    model = MLP(rngs=nnx.Rngs(0))
    callbacks = [LambdaCallback(on_epoch_end=lambda *_: None)] if hook else []
    trainer = Trainer(model, TX, loss)
    history = trainer.fit(
        data, epochs=epochs, batch_size=BS, seed=7, progress=False, callbacks=callbacks
    )
    return model, history


def test_epochs_of_their_own_calls_place_the_next_order_ahead(data, placed, monkeypatch):
    model, history = _fit(data, hook=True)
    assert placed == [1, 2]  # after epochs 0 and 1; nothing after the fit's last

    ref = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    batches = [b for e in range(3) for b in epoch_batches(data, BS, 7, e)]
    losses = reference_loop(ref, optimizer, xent, batches)
    assert_trees_close(nnx.state(model), nnx.state(ref), **tolerance(1e-5, 1e-6))
    np.testing.assert_allclose(history.losses, np.array(losses), **tolerance(1e-5, 1e-6))

    # Nothing placed ahead: the same arrays placed later, so bitwise the same run.
    monkeypatch.setattr(ArrayEpochs, "PLACE_AHEAD_MAX_ROWS", 0)
    later, later_history = _fit(data, hook=True)
    assert_trees_close(nnx.state(model), nnx.state(later), exact=True)
    np.testing.assert_array_equal(history.losses, later_history.losses)


def fused_xent(model, batch):
    """A loss of its own: no fit before compiled one-epoch calls of it (a later fit would
    run those rather than compile a fused one)."""
    return xent(model, batch)


def test_fused_epochs_and_a_one_epoch_fit_place_nothing_ahead(data, placed, stretch_count):
    _fit(data, hook=False, loss=fused_xent)  # nothing needs the host between epochs
    assert stretch_count() == 1  # one stretch: the three epochs fused
    _fit(data, hook=True, epochs=1)
    assert placed == []
