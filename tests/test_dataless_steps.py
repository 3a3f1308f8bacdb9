"""A step that takes no data (its batch is None, what it samples lives in its opt_state):
``fit(None, epochs=E, steps_per_epoch=K)`` against a hand-written ``lax.scan`` of the same
``update``, through cuts, resumes and callbacks."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import Step, init_opt_state, split_wrt
from nnxscan.shell import EarlyStopping, Plan, Trainer

from conftest import ACROSS_PROGRAMS, MLP, assert_trees_close, xent

TX = optax.sgd(0.1)
W = jax.random.normal(jax.random.key(1), (4, 3))


def _init(graphdef, state):
    return {"tx": init_opt_state(TX, state), "key": jax.random.key(0)}


def _update(graphdef, state, opt_state, batch):
    if batch is not None:
        raise AssertionError("a step without data gets batch=None")
    key, sub = jax.random.split(opt_state["key"])
    x = jax.random.normal(sub, (16, 4))
    sampled = {"x": x, "y": jnp.argmax(x @ W, -1)}
    params, rest = split_wrt(state, nnx.Param)
    loss, grads = jax.value_and_grad(lambda p: xent(nnx.merge(graphdef, p, rest), sampled))(params)
    updates, tx_state = TX.update(grads, opt_state["tx"], params)
    new = nnx.merge_state(optax.apply_updates(params, updates), rest)
    return new, {"tx": tx_state, "key": key}, (loss, {"first_x": x[0, 0]})


SAMPLER = Step(_init, _update, has_aux=True)


@pytest.fixture(scope="module")
def reference():
    """150 steps of ``update`` in one hand-written ``lax.scan``."""
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))

    def body(carry, _):
        state, opt_state, (loss, aux) = SAMPLER.update(graphdef, *carry, None)
        return (state, opt_state), (loss, aux)

    run = jax.jit(lambda carry: jax.lax.scan(body, carry, None, length=150))
    (state, opt_state), (losses, aux) = run((state, SAMPLER.init(graphdef, state)))
    return state, opt_state, np.asarray(losses), np.asarray(aux["first_x"])


def test_fit_without_data_trains_what_a_scan_of_update_trains(reference):
    state, opt_state, losses, first_x = reference
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=SAMPLER)
    history = trainer.fit(None, epochs=3, steps_per_epoch=50, progress=False)
    # The hand-written scan is another program than fit's: to rounding (conftest).
    np.testing.assert_allclose(history.losses, losses, **ACROSS_PROGRAMS)
    assert trainer.step == 150 and trainer.epoch == 3
    assert [e["steps"] for e in history.epochs] == [50, 50, 50]
    np.testing.assert_allclose(history.epochs[1]["first_x"], first_x[50:100].mean(), rtol=1e-6)
    assert_trees_close(trainer.model, state)
    np.testing.assert_array_equal(  # the key: integers
        jax.random.key_data(trainer._owner.opt_state["key"]), jax.random.key_data(opt_state["key"])
    )


def test_the_progress_line_shows_the_scalars_the_step_reports(reference, capsys):
    """Off a terminal, fit prints a line per epoch (the first and the last here) with the
    epoch's mean of each scalar the step reports in its aux, as the History logs it."""
    _, _, losses, first_x = reference
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=SAMPLER)
    capsys.readouterr()
    history = trainer.fit(None, epochs=3, steps_per_epoch=50, steps_per_call=25)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["0", "2"]
    for line, epoch in zip(lines, (0, 2), strict=True):
        shown = float(re.search(r"  first_x (\S+)  ", line).group(1))
        want = first_x[50 * epoch : 50 * (epoch + 1)].mean()
        np.testing.assert_allclose(shown, want, rtol=5e-4)  # printed with 4 digits
        assert f"first_x {history.epochs[epoch]['first_x']:.4g}" in line
        assert f"loss {losses[50 * epoch : 50 * (epoch + 1)].mean():.4g}" in line


def test_progress_logs_names_what_the_line_shows(capsys):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=SAMPLER)
    for bad in ("first_x", [1]):
        with pytest.raises(TypeError, match="progress_logs"):
            trainer.fit(None, epochs=1, steps_per_epoch=5, progress_logs=bad)
    assert trainer.step == 0  # nothing ran
    capsys.readouterr()
    with pytest.warns(UserWarning, match=r"\['return'\].*\['first_x'\]"):
        history = trainer.fit(None, epochs=1, steps_per_epoch=5, progress_logs=["return"])
    line = capsys.readouterr().out.strip()
    assert "first_x" not in line and "return" not in line  # named none the step reports
    assert "first_x" in history.epochs[0]  # logged all the same
    again = trainer.fit(None, epochs=1, steps_per_epoch=5, progress_logs=["first_x"])
    line = capsys.readouterr().out.strip()
    assert f"  first_x {again.epochs[0]['first_x']:.4g}  " in line


def test_calls_of_a_few_steps_and_cuts_then_resumes_end_where_one_run_ends(reference, tmp_path):
    """Cut twice inside the second epoch (at steps 70 and 90, saved there), resumed each
    time: the model, the losses and every epoch's logs, the aux means of the cut epoch
    too, are those of the uninterrupted fit (bitwise: the same calls of 10 steps) and of
    the hand-written scan (to rounding: another program)."""
    state, _, losses, first_x = reference

    class Cut:
        def __init__(self, at):
            self.at = at

        def on_call_end(self, trainer, logs):
            if trainer.step >= self.at:
                trainer.stop_training = True

    fit = dict(epochs=3, steps_per_epoch=50, steps_per_call=10, progress=False,
               checkpoint_dir=tmp_path, checkpoint_every_steps=10, resume=True)  # fmt: skip
    for seed, cut in [(0, 70), (3, 90)]:
        trainer = Trainer(MLP(rngs=nnx.Rngs(seed)), train_step=SAMPLER)
        trainer.fit(None, callbacks=[Cut(cut)], **fit)
        assert trainer.step == cut
    again = Trainer(MLP(rngs=nnx.Rngs(5)), train_step=SAMPLER)
    history = again.fit(None, **fit)
    assert again.step == 150
    straight = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=SAMPLER)
    straight_history = straight.fit(None, **{**fit, "checkpoint_dir": tmp_path / "straight"})
    assert_trees_close(again.model, straight.model, exact=True)
    np.testing.assert_array_equal(history.losses, straight_history.losses)
    for logs, straight_logs in zip(history.epochs, straight_history.epochs, strict=True):
        assert (logs["loss"], logs["first_x"]) == (straight_logs["loss"], straight_logs["first_x"])
    assert_trees_close(again.model, state)
    np.testing.assert_allclose(history.losses, losses, **ACROSS_PROGRAMS)
    for epoch, logs in enumerate(history.epochs):
        steps = slice(50 * epoch, 50 * (epoch + 1))
        assert logs["steps"] == 50 and logs["epoch"] == epoch
        assert logs["loss"] == pytest.approx(float(losses[steps].mean()), rel=1e-5)
        assert logs["first_x"] == pytest.approx(float(first_x[steps].mean()), rel=1e-6), epoch


def test_early_stopping_watches_a_scalar_the_step_reports():
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=SAMPLER)
    stop = EarlyStopping(monitor="loss", patience=0, min_delta=10.0, mode="min")
    history = trainer.fit(None, epochs=5, steps_per_epoch=20, callbacks=[stop], progress=False)
    assert len(history.epochs) == 2  # the second epoch does not improve by 10


def test_data_none_needs_steps_per_epoch_and_steps_per_epoch_needs_no_data(data):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=SAMPLER)
    before = [np.array(x) for x in jax.tree.leaves(nnx.state(trainer.model))]
    with pytest.raises(ValueError, match="steps_per_epoch=K"):
        trainer.fit(None, epochs=1)
    with pytest.raises(ValueError, match="steps_per_epoch is for data=None"):
        trainer.fit(data, epochs=1, batch_size=8, steps_per_epoch=3)
    with pytest.raises(ValueError, match="batch_size has no meaning"):
        trainer.fit(None, epochs=1, steps_per_epoch=3, batch_size=8)
    after = jax.tree.leaves(nnx.state(trainer.model))
    assert trainer.step == 0 and all(
        np.array_equal(a, b) for a, b in zip(before, after, strict=True)
    )


def test_plan_for_without_data_is_the_plan_of_a_step_that_takes_no_batch():
    # "auto" scans; an explicit plan is kept: plan_for(None, ...) asks for no data set.
    assert Trainer(MLP(rngs=nnx.Rngs(0)), train_step=SAMPLER).plan_for(None, 1) == Plan("scan")
    stepped = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=SAMPLER, execution="step")
    assert stepped.plan_for(None, 1).kind == "step"


def test_the_step_is_traced_once_even_with_weakly_typed_state():
    """The plan probe's trace is the compiled call's: a weakly typed leaf in the opt_state
    (an environment's ``time = 0`` counter) is probed as weak, so jit's cache hits."""
    traces = []

    def init(graphdef, state):
        return {**_init(graphdef, state), "time": jnp.asarray(0)}  # weakly typed

    def update(graphdef, state, opt_state, batch):
        traces.append(1)
        rest = {k: v for k, v in opt_state.items() if k != "time"}
        state, rest, out = _update(graphdef, state, rest, batch)
        return state, {**rest, "time": opt_state["time"] + 1}, out

    step = Step(init, update, has_aux=True)
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=step)
    assert trainer._owner.opt_state["time"].weak_type
    trainer.fit(None, epochs=2, steps_per_epoch=3, progress=False)
    assert len(traces) == 1 and int(trainer._owner.opt_state["time"]) == 6
