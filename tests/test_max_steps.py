"""``fit(max_steps=K)``: K steps of the plain loop, ending mid-epoch, resumable there.

References: the plain per-step NNX loop over the documented shuffle rule's batches (another
program: to float32 rounding), and for a resume, the same fit run straight (the same loop
body: bitwise, see ``ACROSS_PROGRAMS`` in conftest).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import Population, Trainer

from conftest import (
    ACROSS_PROGRAMS,
    MLP,
    assert_trees_close,
    epoch_batches,
    make_data,
    reference_loop,
    state_arrays,
    xent,
)

DATA = make_data(64)
BS = 8  # 8 steps an epoch
TX = optax.adam(1e-2)


def plain_loop(seed: int, steps: int):
    model = MLP(rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    batches = [b for e in range(steps // 8 + 1) for b in epoch_batches(DATA, BS, seed, e)]
    losses = reference_loop(model, optimizer, xent, batches[:steps])
    return model, np.asarray(losses)


def test_max_steps_alone_trains_that_many_steps_of_the_plain_loop():
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    history = trainer.fit(DATA, max_steps=19, batch_size=BS, progress=False)
    assert (trainer.step, trainer.epoch) == (19, 2)  # two epochs and 3 steps of the third
    assert len(history.losses) == 19 and len(history.epochs) == 3
    assert history.epochs[-1]["stopped"] and history.epochs[-1]["steps"] == 3
    model, losses = plain_loop(0, 19)
    np.testing.assert_allclose(history.losses, losses, **ACROSS_PROGRAMS)
    assert_trees_close(trainer.model, model, **ACROSS_PROGRAMS)


def test_epochs_and_max_steps_end_at_whichever_comes_first():
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    trainer.fit(DATA, epochs=1, max_steps=50, batch_size=BS, progress=False)
    assert (trainer.step, trainer.epoch) == (8, 1)
    trainer.fit(DATA, epochs=5, max_steps=4, batch_size=BS, progress=False)  # 4 MORE steps
    assert trainer.step == 12 and trainer.epoch == 1


def test_a_run_ended_by_max_steps_resumes_inside_its_epoch(tmp_path):
    options = dict(batch_size=BS, checkpoint_dir=tmp_path / "run", progress=False)
    first = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    first.fit(DATA, max_steps=11, resume=True, **options)
    assert first.step == 11
    resumed = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    history = resumed.fit(DATA, max_steps=21, resume=True, **options)  # the whole run's 21
    straight = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    want = straight.fit(DATA, max_steps=21, batch_size=BS, progress=False)
    assert resumed.step == 21
    for a, b in zip(state_arrays(resumed.model), state_arrays(straight.model), strict=True):
        np.testing.assert_array_equal(a, b)  # the same loop body on the same batches
    np.testing.assert_array_equal(history.losses, want.losses)
    again = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    assert len(again.fit(DATA, max_steps=21, resume=True, **options).losses) == 21
    assert again.step == 21  # finished: a rerun trains nothing


def test_a_population_trains_max_steps_per_member():
    population = Population(lambda rngs: MLP(rngs=rngs), TX, xent, seeds=[0, 1])
    history = population.fit(DATA, max_steps=11, batch_size=BS, progress=False)
    assert population.step == 11 and history.losses.shape == (11, 2)
    for i, seed in enumerate((0, 1)):
        model, losses = plain_loop(seed, 11)
        np.testing.assert_allclose(history.losses[:, i], losses, **ACROSS_PROGRAMS)
        assert_trees_close(population.member(i), model, **ACROSS_PROGRAMS)


def test_without_epochs_or_max_steps_or_with_a_stream_fit_says_what_to_pass():
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    with pytest.raises(TypeError, match="epochs=, max_steps=, or both"):
        trainer.fit(DATA, batch_size=BS, progress=False)
    stream = [{k: v[:BS] for k, v in DATA.items()}] * 3
    with pytest.raises(ValueError, match=r"a stream's epochs .* pass epochs="):
        trainer.fit(stream, max_steps=5, progress=False)
    with pytest.raises((TypeError, ValueError), match="max_steps"):
        trainer.fit(DATA, max_steps=-1, batch_size=BS, progress=False)
    assert trainer.step == 0
