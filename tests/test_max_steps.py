"""``fit(max_steps=K)``: K steps of the plain loop, ending mid-epoch, resumable there, for a
data set, a step without data and a stream, for a Trainer and a Population.

References: the plain per-step NNX loop over the documented shuffle rule's batches, or a
hand-written ``lax.scan`` of a step without data (other programs: to float32 rounding), and
for a resume, the same fit run straight (the same loop body: bitwise, see
``ACROSS_PROGRAMS`` in conftest).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import Step, init_opt_state, split_wrt
from nnxscan.shell import LambdaCallback, Population, Trainer

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


@pytest.mark.slow_on_accelerator("a trainer per member as the reference")
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


def test_max_steps_fuses_the_whole_epochs_it_reaches_and_trains_the_same_bits(stretch_count):
    """Nothing needs the host between epochs: the two whole epochs run as one stretch, the
    third (cut at step 19) alone; bitwise what epoch-by-epoch calls train (the same loop
    body), and the same steps as the plain loop."""
    fused = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    history = fused.fit(DATA, max_steps=19, batch_size=BS, progress=False)
    assert stretch_count() == 2 and (fused.step, fused.epoch) == (19, 2)
    per_epoch = LambdaCallback(on_epoch_end=lambda t, e, logs: None)  # forbids fusing
    separate = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    want = separate.fit(DATA, max_steps=19, batch_size=BS, progress=False, callbacks=[per_epoch])
    assert stretch_count() == 2 + 3
    for a, b in zip(state_arrays(fused.model), state_arrays(separate.model), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(history.losses, want.losses)
    assert [e["steps"] for e in history.epochs] == [8, 8, 3] and history.epochs[2]["stopped"]


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_the_progress_total_is_the_calls_fit_makes(monkeypatch, tmp_path):
    """Calls of 3 steps, a budget that ends inside an epoch, a resume inside another: the
    bar's total counts the calls made, not whole epochs'."""
    import nnxscan.shell._engine.fit as fit_module

    bars = []

    class Counted(fit_module.RunProgress):
        def __init__(self, calls, *args, **kwargs):
            super().__init__(calls, *args, **kwargs)
            bars.append([calls, 0])

        def call_done(self, *args, **kwargs):
            bars[-1][1] += 1
            super().call_done(*args, **kwargs)

    monkeypatch.setattr(fit_module, "RunProgress", Counted)
    options = dict(batch_size=BS, steps_per_call=3, checkpoint_dir=tmp_path, progress=False)
    Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent).fit(DATA, max_steps=11, resume=True, **options)
    Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent).fit(DATA, max_steps=21, resume=True, **options)
    Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent).fit(DATA, max_steps=19, batch_size=BS,
                                                  steps_per_call=3, progress=False)  # fmt: skip
    # To step 11: epoch 0 in calls of 3, 3, 2, then 3 steps of epoch 1; after the resume,
    # epoch 1's last 5 steps (3, 2) and 5 of epoch 2 (3, 2); straight, epochs 0-1 fused (16
    # steps: 6 calls), then 3 steps of epoch 2.
    assert bars == [[4, 4], [4, 4], [7, 7]]


@pytest.mark.slow_on_accelerator("population runs cut, resumed and whole: 4.8 s")
def test_a_population_resumed_inside_an_epoch_ends_where_one_run_ends(tmp_path):
    options = dict(batch_size=BS, checkpoint_dir=tmp_path, resume=True, progress=False)

    def population():
        return Population(lambda rngs: MLP(rngs=rngs), TX, xent, seeds=[0, 1])

    first = population()
    first.fit(DATA, max_steps=5, **options)
    resumed = population()
    history = resumed.fit(DATA, max_steps=13, **options)  # across the end of epoch 0
    straight = population()
    want = straight.fit(DATA, max_steps=13, batch_size=BS, progress=False)
    assert (resumed.step, resumed.epoch) == (13, 1)
    for i in range(2):
        for a, b in zip(state_arrays(resumed.member(i)), state_arrays(straight.member(i)),
                        strict=True):  # fmt: skip
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(history.losses, want.losses)
    for i, seed in enumerate((0, 1)):  # and each member is its own plain loop
        model, losses = plain_loop(seed, 13)
        np.testing.assert_allclose(history.losses[:, i], losses, **ACROSS_PROGRAMS)
        assert_trees_close(resumed.member(i), model, **ACROSS_PROGRAMS)


def test_a_stream_ends_at_max_steps_inside_an_epoch_and_the_next_fit_goes_on_there():
    batches = epoch_batches(DATA, BS, 0, 0)[:4]  # an epoch of 4 batches, the same each time
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    history = trainer.fit(lambda: iter(batches), epochs=3, max_steps=6, progress=False)
    assert (trainer.step, trainer.epoch) == (6, 1) and len(history.losses) == 6
    assert history.epochs[-1]["stopped"] and history.epochs[-1]["steps"] == 2
    rest = trainer.fit(lambda: iter(batches), epochs=1, progress=False)  # the epoch's rest
    assert (trainer.step, trainer.epoch) == (8, 2) and len(rest.losses) == 2
    model = MLP(rngs=nnx.Rngs(0))
    losses = reference_loop(model, nnx.Optimizer(model, TX, wrt=nnx.Param), xent, batches * 2)
    got = np.concatenate([history.losses, rest.losses])
    np.testing.assert_allclose(got, losses, **ACROSS_PROGRAMS)
    assert_trees_close(trainer.model, model, **ACROSS_PROGRAMS)
    exact = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)  # a budget that ends with an epoch
    history = exact.fit(lambda: iter(batches), epochs=3, max_steps=8, progress=False)
    assert (exact.step, exact.epoch) == (8, 2) and not history.epochs[-1].get("stopped")


# -- a step without data ------------------------------------------------------------------------

SGD = optax.sgd(0.1)
W = jax.random.normal(jax.random.key(1), (4, 3))


def _init(graphdef, state):
    return {"tx": init_opt_state(SGD, state), "key": jax.random.key(0)}


def _update(graphdef, state, opt_state, batch):
    """Samples its own batch from the key it carries (its batch is None)."""
    key, sub = jax.random.split(opt_state["key"])
    x = jax.random.normal(sub, (16, 4))
    params, rest = split_wrt(state, nnx.Param)
    sampled = {"x": x, "y": jnp.argmax(x @ W, -1)}
    loss, grads = jax.value_and_grad(lambda p: xent(nnx.merge(graphdef, p, rest), sampled))(params)
    updates, tx_state = SGD.update(grads, opt_state["tx"], params)
    return (
        nnx.merge_state(optax.apply_updates(params, updates), rest),
        {"tx": tx_state, "key": key},
        loss,
    )


SAMPLER = Step(_init, _update)


def scanned(seed: int, steps: int):
    """``steps`` steps of ``update`` in one hand-written ``lax.scan`` from ``MLP(seed)``."""
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(seed)))

    def body(carry, _):
        state, opt_state, loss = SAMPLER.update(graphdef, *carry, None)
        return (state, opt_state), loss

    run = jax.jit(lambda carry: jax.lax.scan(body, carry, None, length=steps))
    (state, _), losses = run((state, SAMPLER.init(graphdef, state)))
    return state, np.asarray(losses)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_a_step_without_data_trains_max_steps_and_resumes_inside_its_epoch(tmp_path):
    options = dict(steps_per_epoch=10, steps_per_call=4, progress=False)
    saved = dict(checkpoint_dir=tmp_path, resume=True, **options)
    first = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=SAMPLER)
    first.fit(None, max_steps=13, **saved)
    assert (first.step, first.epoch) == (13, 1)
    resumed = Trainer(MLP(rngs=nnx.Rngs(5)), train_step=SAMPLER)  # restored: its init is gone
    history = resumed.fit(None, max_steps=23, **saved)
    straight = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=SAMPLER)
    want = straight.fit(None, max_steps=23, **options)
    assert (resumed.step, resumed.epoch) == (straight.step, straight.epoch) == (23, 2)
    assert want.epochs[-1]["stopped"] and [e["steps"] for e in want.epochs] == [10, 10, 3]
    assert_trees_close(resumed.model, straight.model, exact=True)  # the same loop body
    np.testing.assert_array_equal(history.losses, want.losses)
    state, losses = scanned(0, 23)
    np.testing.assert_allclose(want.losses, losses, **ACROSS_PROGRAMS)
    assert_trees_close(straight.model, state, **ACROSS_PROGRAMS)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_a_population_of_a_step_without_data_trains_max_steps_per_member():
    population = Population(lambda rngs: MLP(rngs=rngs), train_step=SAMPLER, seeds=[0, 1])
    history = population.fit(None, max_steps=13, steps_per_epoch=10, progress=False)
    assert (population.step, population.epoch) == (13, 1) and history.losses.shape == (13, 2)
    for i, seed in enumerate((0, 1)):
        state, losses = scanned(seed, 13)
        np.testing.assert_allclose(history.losses[:, i], losses, **ACROSS_PROGRAMS)
        assert_trees_close(population.member(i), state, **ACROSS_PROGRAMS)
