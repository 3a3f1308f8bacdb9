"""A Population of the user's own step (``Population(model_fn, train_step=S, seeds=...)``):
each member against that member trained alone by ``Trainer(model, train_step=S)`` or a
plain Python loop over ``S.update``; resume against an uninterrupted run; the bad
arguments refused before anything compiles."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import Step, nnx_train_step, unstack_states
from nnxscan.shell import EarlyStopping, Population, Trainer

from conftest import MLP, accuracy, assert_trees_close, epoch_batches, state_arrays, xent, xent_aux

BS = 8
SEEDS = [0, 1, 2]
B1, B2, EPS, LR, WD = 0.9, 0.999, 1e-8, 1e-2, 1e-3


def mlp(rngs: nnx.Rngs) -> nnx.Module:
    return MLP(rngs=rngs)


# -- the user's steps -------------------------------------------------------------------------


def _adamw_init(graphdef, state):
    params = nnx.state(nnx.merge(graphdef, state), nnx.Param)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}


def _adamw_update(graphdef, state, opt, batch):
    """Adam with decoupled weight decay, written out by hand (no optax), with an aux."""
    model = nnx.merge(graphdef, state)
    (loss, aux), grads = nnx.value_and_grad(xent_aux, has_aux=True)(model, batch)
    params = nnx.state(model, nnx.Param)
    t = opt["t"] + 1
    m = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, opt["m"], grads)
    v = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, opt["v"], grads)
    c1, c2 = 1 - B1 ** t.astype(jnp.float32), 1 - B2 ** t.astype(jnp.float32)
    new = jax.tree.map(
        lambda p, m, v: p - LR * ((m / c1) / (jnp.sqrt(v / c2) + EPS) + WD * p), params, m, v
    )
    nnx.update(model, new)
    return nnx.state(model), {"m": m, "v": v, "t": t}, (loss, aux)


ADAMW = Step(_adamw_init, _adamw_update, has_aux=True)


@functools.cache
def two_tx_step(rate: float = 1e-2, momentum: float = 0.9) -> Step:
    """Two optax states: Adam on the first layer, SGD with momentum on the second, each
    made with inject_hyperparams (so ``learning_rate`` is in both, ``momentum`` in one)."""
    body = optax.inject_hyperparams(optax.adam)(learning_rate=rate)
    head = optax.inject_hyperparams(optax.sgd)(learning_rate=rate, momentum=momentum)

    def init(graphdef, state):
        model = nnx.merge(graphdef, state)
        return {
            "body": body.init(nnx.state(model.l1, nnx.Param)),
            "head": head.init(nnx.state(model.l2, nnx.Param)),
        }

    def update(graphdef, state, opt, batch):
        model = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(xent)(model, batch)
        new_opt = {}
        for name, layer, tx in (("body", "l1", body), ("head", "l2", head)):
            params = nnx.state(getattr(model, layer), nnx.Param)
            updates, new_opt[name] = tx.update(grads[layer], opt[name], params)
            nnx.update(getattr(model, layer), optax.apply_updates(params, updates))
        return nnx.state(model), new_opt, loss

    return Step(init, update)


def trainer_run(seed, data, epochs, step=ADAMW, on_nonfinite="ignore", **fit_options):
    """Member ``seed`` trained alone: the reference of every test."""
    trainer = Trainer(MLP(rngs=nnx.Rngs(seed)), train_step=step, on_nonfinite=on_nonfinite)
    history = trainer.fit(data, epochs=epochs, batch_size=BS, seed=seed, progress=False,
                          **fit_options)  # fmt: skip
    return trainer, history


# -- each member = that member trained alone ---------------------------------------------------


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_members_equal_each_trained_alone_by_a_trainer(data):
    pop = Population(mlp, train_step=ADAMW, seeds=SEEDS)
    assert pop.train_step is ADAMW and pop.tx is None and pop.has_aux
    history = pop.fit(data, epochs=2, batch_size=BS, eval_data=data, metric_fn=accuracy)
    assert history.losses.shape == (16, 3)
    scores = pop.evaluate(data, accuracy, batch_size=16)["accuracy"]
    alone_scores = []
    for i, seed in enumerate(SEEDS):
        trainer, alone = trainer_run(seed, data, 2, eval_data=data, metric_fn=accuracy)
        np.testing.assert_allclose(history.losses[:, i], alone.losses, rtol=1e-5, atol=1e-6)
        for ours, theirs in zip(history.epochs, alone.epochs, strict=True):
            for key in ("loss", "acc", "eval_accuracy"):  # aux leaf means, evaluation
                np.testing.assert_allclose(ours[key][i], theirs[key], rtol=1e-5, atol=1e-6)
        assert_trees_close(pop.member(i), trainer.model)
        assert_trees_close(unstack_states(pop.opt_state)[i], trainer.opt_state)
        assert int(unstack_states(pop.opt_state)[i]["t"]) == 16
        alone_scores.append(trainer.evaluate(data, accuracy, batch_size=16)["accuracy"])
    np.testing.assert_allclose(scores, alone_scores, rtol=1e-6)
    assert pop.best("accuracy", mode="max") == int(np.argmax(alone_scores))


@pytest.mark.slow
def test_a_stream_trains_every_member_as_a_trainer_on_that_stream(data):
    batches = epoch_batches(data, BS, seed=7, epoch=0)
    pop = Population(mlp, train_step=ADAMW, seeds=SEEDS)
    history = pop.fit(batches, epochs=2, steps_per_call=3)
    for i, seed in enumerate(SEEDS):
        trainer = Trainer(MLP(rngs=nnx.Rngs(seed)), train_step=ADAMW)
        alone = trainer.fit(batches, epochs=2, steps_per_call=3, progress=False)
        np.testing.assert_allclose(history.losses[:, i], alone.losses, rtol=1e-5, atol=1e-6)
        assert_trees_close(pop.member(i), trainer.model)


def test_hyperparams_go_into_the_steps_injected_optax_states(data):
    """Member i = the same step built with member i's values as its own constants."""
    rates, momenta = [1e-2, 3e-3, 3e-2], [0.9, 0.5, 0.0]
    pop = Population(
        mlp, train_step=two_tx_step(), seeds=SEEDS,
        hyperparams={"learning_rate": rates, "momentum": momenta},
    )  # fmt: skip
    history = pop.fit(data, epochs=2, batch_size=BS)
    np.testing.assert_allclose(history.epochs[-1]["learning_rate"], rates, rtol=1e-6)
    for i, seed in enumerate(SEEDS):
        trainer, alone = trainer_run(seed, data, 2, step=two_tx_step(rates[i], momenta[i]))
        np.testing.assert_allclose(history.losses[:, i], alone.losses, rtol=1e-5, atol=1e-6)
        assert_trees_close(pop.member(i), trainer.model)


def test_a_step_converted_from_a_stateful_fn_of_the_model_alone_trains(data):
    @nnx.jit
    def sgd(model, batch):  # mutates the model alone: a population can carry it
        loss, grads = nnx.value_and_grad(xent)(model, batch)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
        return loss

    step = nnx_train_step(sgd)
    pop = Population(mlp, train_step=step, seeds=[0, 1])
    history = pop.fit(data, epochs=1, batch_size=BS)
    for i in range(2):
        model = MLP(rngs=nnx.Rngs(i))
        losses = [float(sgd(model, b)) for b in epoch_batches(data, BS, i, 0)]
        np.testing.assert_allclose(history.losses[:, i], losses, rtol=1e-5, atol=1e-6)
        assert_trees_close(pop.member(i), model)


# -- resume, non-finite policies, callbacks ----------------------------------------------------


@pytest.mark.slow
def test_resume_after_a_cut_equals_the_uninterrupted_run_bitwise(data, tmp_path):
    def make():
        return Population(
            mlp, train_step=two_tx_step(), seeds=SEEDS,
            hyperparams={"learning_rate": [1e-2, 3e-3, 1e-3]},
        )  # fmt: skip

    straight = make()
    straight.freeze(2)
    full = straight.fit(data, epochs=3, batch_size=BS)
    first = make()
    first.freeze(2)
    # Cut inside epoch 1: a save every 5 steps, and the run stops after the call past 10.
    first.fit(data, epochs=3, batch_size=BS, checkpoint_dir=tmp_path, checkpoint_every_steps=5,
              callbacks=[_StopAfter(10)])  # fmt: skip
    assert 8 < first.step < 16 and first.epoch == 1
    resumed = make()
    history = resumed.fit(data, epochs=3, batch_size=BS, checkpoint_dir=tmp_path, resume=True)
    assert (resumed.epoch, resumed.step) == (3, 24) and resumed.active.tolist() == [1, 1, 0]
    # Bitwise: every call (5, 3, 2 steps before the cut; 6, 8 after it; whole epochs
    # straight) scans the same loop body (conftest's ACROSS_PROGRAMS says why that holds).
    for tree in ("state", "opt_state"):  # both optax states, every member, bitwise
        ours, theirs = state_arrays(getattr(resumed, tree)), state_arrays(getattr(straight, tree))
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(history.losses, full.losses)
    other = Population(
        mlp, train_step=two_tx_step(), seeds=SEEDS,
        hyperparams={"learning_rate": [0.5, 0.5, 0.5]},
    )  # fmt: skip
    with pytest.raises(ValueError, match="learning_rate="):
        other.restore(tmp_path)


class _StopAfter:
    def __init__(self, step: int):
        self.step = step

    def on_call_end(self, pop, logs):
        if pop.step >= self.step:
            pop.stop_training = True


def _poisoned(data):
    poisoned = {k: v.copy() for k, v in data.items()}
    poisoned["x"][5, 0] = np.nan
    return poisoned


@functools.cache
def _jitted_update():
    return jax.jit(ADAMW.update, static_argnums=0)


def _loop(seed, data, epochs, policy):
    """The plain loop of one member over its own batches: a batch holding a NaN is skipped
    (``"skip"``), or ends the run (``"stop"``). Returns the model and the losses (NaN for a
    step not taken)."""
    model = MLP(rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    opt, losses = ADAMW.init(graphdef, state), []
    for e in range(epochs):
        for batch in epoch_batches(data, BS, seed, e):
            if np.isnan(batch["x"]).any():
                losses.append(np.nan)
                if policy == "stop":
                    return nnx.merge(graphdef, state), losses
                continue
            state, opt, (loss, _) = _jitted_update()(graphdef, state, opt, batch)
            losses.append(float(loss))
    return nnx.merge(graphdef, state), losses


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_skip_nonfinite_equals_a_loop_that_skips_the_poisoned_batches(data):
    poisoned = _poisoned(data)
    pop = Population(mlp, train_step=ADAMW, seeds=SEEDS, on_nonfinite="skip")
    history = pop.fit(poisoned, epochs=2, batch_size=BS)
    for i, seed in enumerate(SEEDS):
        model, losses = _loop(seed, poisoned, 2, "skip")
        np.testing.assert_allclose(history.losses[:, i], losses, rtol=1e-5, atol=1e-6)
        assert_trees_close(pop.member(i), model)
    assert history.epochs[0]["skipped_steps"].tolist() == [1, 1, 1]
    assert history.epochs[1]["skipped_steps"].tolist() == [1, 1, 1]
    # One model alone skips alike: the guard keeps the state the step was given, though
    # the step's nnx.merge + nnx.update wrote into that state's Variables while tracing.
    trainer, alone = trainer_run(SEEDS[1], poisoned, 2, on_nonfinite="skip")
    model, losses = _loop(SEEDS[1], poisoned, 2, "skip")
    np.testing.assert_allclose(alone.losses, losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(trainer.model, model)


def test_stop_nonfinite_freezes_each_member_before_its_poisoned_batch(data):
    poisoned = _poisoned(data)
    pop = Population(mlp, train_step=ADAMW, seeds=SEEDS, on_nonfinite="stop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = pop.fit(poisoned, epochs=2, batch_size=BS)
    said = sorted(str(w.message) for w in caught if w.category is RuntimeWarning)
    assert [m.split(":")[0] for m in said] == ["member 0", "member 1", "member 2"]
    assert not pop.active.any()
    for i, seed in enumerate(SEEDS):
        model, losses = _loop(seed, poisoned, 2, "stop")
        assert f"global step {len(losses) - 1} " in said[i]
        np.testing.assert_allclose(history.losses[: len(losses), i], losses, rtol=1e-5, atol=1e-6)
        assert_trees_close(pop.member(i), model)


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_early_stopping_stops_each_member_as_its_own_trainer(data):
    def make_stop():
        return EarlyStopping("eval_accuracy", patience=1, mode="max", verbose=False)

    stop = make_stop()
    pop = Population(mlp, train_step=ADAMW, seeds=SEEDS)
    history = pop.fit(data, epochs=6, batch_size=BS, eval_data=data, metric_fn=accuracy,
                      callbacks=[stop])  # fmt: skip
    for i, seed in enumerate(SEEDS):
        alone_stop = make_stop()
        trainer, alone = trainer_run(
            seed, data, 6, eval_data=data, metric_fn=accuracy, callbacks=[alone_stop]
        )
        expected = -1 if alone_stop.stopped_epoch is None else alone_stop.stopped_epoch
        assert stop.stopped_epoch[i] == expected
        assert stop.best_epoch[i] == alone_stop.best_epoch
        ran = len(alone.epochs)
        evals = [e["eval_accuracy"][i] for e in history.epochs[:ran]]
        np.testing.assert_allclose(evals, [e["eval_accuracy"] for e in alone.epochs], rtol=1e-6)
        assert_trees_close(pop.member(i), trainer.model)
    assert len(set(stop.stopped_epoch.tolist())) > 1, "members should stop at different epochs"


# -- refusals ---------------------------------------------------------------------------------


def test_bad_arguments_are_refused_before_anything_compiles(data, compile_count):
    with pytest.raises(TypeError, match="tx, loss_fn, has_aux have no effect") as refused:
        Population(mlp, optax.adam(1e-3), xent, train_step=ADAMW, seeds=SEEDS, has_aux=True)
    assert "extras" not in str(refused.value)  # a Population takes none: no advice to
    with pytest.raises(TypeError, match=r"extras=\(\.\.\.\)"):  # a Trainer's advice has it
        Trainer(mlp(nnx.Rngs(0)), train_step=ADAMW, has_aux=True)
    for options, name in (
        (dict(accumulate=2), "accumulate"),
        (dict(wrt=nnx.BatchStat), "wrt"),
        (dict(rngs=nnx.Rngs(0)), "rngs"),
        (dict(metrics=nnx.metrics.Average(), update_metrics=lambda *a: None),
         "metrics, update_metrics"),
    ):  # fmt: skip
        with pytest.raises(TypeError, match=f"train_step= replaces .* so {name} ha"):
            Population(mlp, train_step=ADAMW, seeds=SEEDS, **options)

    def stateful(model, optimizer, batch):
        return None

    with pytest.raises(TypeError, match=r"takes a nnxscan.pure.Step.*nnx_train_step\(fn\)"):
        Population(mlp, train_step=stateful, seeds=SEEDS)
    with pytest.raises(TypeError, match=r"must be a nnxscan\.pure\.Step, got int"):
        Population(mlp, train_step=3, seeds=SEEDS)
    with pytest.raises(TypeError, match="needs an optax transform and a loss"):
        Population(mlp, seeds=SEEDS)
    with pytest.raises(ValueError, match="holds none: build the step's transform"):
        Population(mlp, train_step=ADAMW, seeds=SEEDS, hyperparams={"learning_rate": [1] * 3})
    with pytest.raises(
        ValueError, match=r"train_step\.init's opt_state.*'weight_decay' is not a hyperparameter"
    ):
        Population(
            mlp, train_step=two_tx_step(), seeds=SEEDS, hyperparams={"weight_decay": [0] * 3}
        )
    assert compile_count() == 0
    pop = Population(mlp, train_step=ADAMW, seeds=SEEDS)
    built = compile_count()  # building the members may run eager ops
    with pytest.raises(ValueError, match="needs a metric_fn"):
        pop.evaluate(data, batch_size=16)
    with pytest.raises(ValueError, match="needs a metric_fn"):
        pop.fit(data, epochs=1, batch_size=BS, eval_data=data)
    assert compile_count() == built and pop.step == 0
