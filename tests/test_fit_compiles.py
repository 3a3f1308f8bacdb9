"""What a second fit compiles (docs/training.md): nothing with the same shapes and epochs;
one program per new count of fused epochs; nothing when epochs are not fused."""

from __future__ import annotations

import numpy as np
import optax
from flax import nnx

from nnxscan.shell import LambdaCallback, Trainer

from conftest import MLP, state_arrays, xent

TX = optax.adam(1e-2)


def test_fused_epochs_compile_once_per_epoch_count(data, compile_count):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    trainer.fit(data, epochs=1, batch_size=16, progress=False)  # the one-epoch call
    new = []
    for epochs in (1, 5, 5, 3, 7, 3):
        before = compile_count()
        trainer.fit(data, epochs=epochs, batch_size=16, progress=False)
        new.append(compile_count() - before)
    # One fused call of epochs x 4 steps: a count not trained before is one new program.
    assert new == [0, 1, 0, 1, 1, 0]


def test_epochs_that_are_not_fused_compile_nothing_for_another_count(data, compile_count):
    fused = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    apart = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    seen = []
    callback = LambdaCallback(on_epoch_end=lambda t, epoch, logs: seen.append(epoch))
    apart.fit(data, epochs=1, batch_size=16, progress=False, callbacks=[callback])
    before = compile_count()
    for epochs in (5, 3, 7):
        apart.fit(data, epochs=epochs, batch_size=16, progress=False, callbacks=[callback])
    assert compile_count() == before  # every epoch is the same call
    assert seen == list(range(16))
    for epochs in (1, 5, 3, 7):
        fused.fit(data, epochs=epochs, batch_size=16, progress=False)
    for a, b in zip(state_arrays(fused.model), state_arrays(apart.model), strict=True):
        np.testing.assert_array_equal(a, b)  # fused or not, the same bits
