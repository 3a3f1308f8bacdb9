"""SIGTERM as a preemption notice (issue 58 items 1-3): nothing starts after the signal,
an epoch whose steps all ran before it is ended by the resumed run, and NNX training
metrics carry their partial sums across a mid-epoch resume.

The signal is real (``os.kill`` of this process) and sent at a chosen point: a callback, or
a host callback inside the evaluation's program. The reference is the same run never
interrupted, with the same calls and hooks (so its programs are the same): weights
bitwise, Histories equal but for timing.
"""

from __future__ import annotations

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.adapters.checkpoint import all_steps
from nnxscan.shell import LambdaCallback, Preempted, Trainer

from conftest import MLP, BNDropout, assert_trees_close, make_data, xent

TX = optax.adam(1e-2)
BS = 8
DATA = make_data(64)  # 8 steps an epoch
EVAL = make_data(16, seed=1)
TIMING = {"wall_time", "steps_per_sec", "compile_time"}


def without_timing(history) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in TIMING} for e in history.epochs]


def same_history(got, want) -> None:
    np.testing.assert_array_equal(got.losses, want.losses)
    assert without_timing(got) == without_timing(want)


class Signaller:
    """Sends SIGTERM to this process once, at the ``at``-th evaluation (counted from 1)
    or from a hook; records the epochs ``on_epoch_end`` saw."""

    def __init__(self, *, evaluation: int | None = None, hook: str | None = None, at=None):
        self.evaluation, self.hook, self.at = evaluation, hook, at
        self.evaluations, self.ended, self.sent = 0, [], []

    def send(self, where) -> None:
        if not self.sent:
            self.sent.append(where)
            os.kill(os.getpid(), signal.SIGTERM)

    def metric_fn(self, model, batch):
        def counted():
            self.evaluations += 1
            if self.evaluations == self.evaluation:
                self.send(("evaluation", self.evaluations))

        jax.debug.callback(counted)
        return {"acc": jnp.mean(model(batch["x"]).argmax(-1) == batch["y"])}

    def callbacks(self) -> list:
        def on_epoch_begin(trainer, epoch):
            if self.hook == "on_epoch_begin" and epoch == self.at:
                self.send(("on_epoch_begin", epoch))

        def on_epoch_end(trainer, epoch, logs):
            self.ended.append(epoch)
            if self.hook == "on_epoch_end" and epoch == self.at:
                self.send(("on_epoch_end", epoch))

        def on_call_end(trainer, logs):
            if self.hook == "on_call_end" and logs["step"] == self.at:
                self.send(("on_call_end", logs["step"]))

        return [LambdaCallback(on_epoch_begin=on_epoch_begin, on_epoch_end=on_epoch_end,
                               on_call_end=on_call_end)]  # fmt: skip


def fit_bn(signaller: Signaller, directory=None, **fit):
    trainer = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
    if directory is not None:
        fit.update(checkpoint_dir=directory, resume=True)
    fit.setdefault("epochs", 4)
    history = trainer.fit(
        DATA, batch_size=BS, progress=False, eval_data=EVAL,
        metric_fn=signaller.metric_fn, eval_batch_size=16, callbacks=signaller.callbacks(),
        **fit,
    )  # fmt: skip
    return trainer, history


@pytest.mark.parametrize(
    ("send", "saved_at"),
    [
        (dict(evaluation=2), 16),  # epoch 1's evaluation: then its hooks and save, no call
        (dict(hook="on_epoch_end", at=0), 8),  # between epochs: epoch 1 never starts
        (dict(hook="on_epoch_begin", at=1), 8),  # before epoch 1's first call
        # The last epoch's hook: fit saves and raises (the signal is not absorbed); the
        # rerun trains nothing and returns the History.
        (dict(hook="on_epoch_end", at=3), 32),
    ],
    ids=["during_evaluation", "on_epoch_end", "on_epoch_begin", "last_epochs_hook"],
)
def test_a_signal_between_calls_starts_no_other_call_before_the_save(tmp_path, send, saved_at):
    # One call an epoch, a checkpoint every 2 epochs (the case).
    ref = Signaller()
    straight, want = fit_bn(ref, steps_per_call=8)
    first = Signaller(**send)
    with pytest.raises(Preempted, match=f"at step {saved_at} ") as error:
        fit_bn(first, tmp_path, steps_per_call=8, checkpoint_every=2)
    assert first.sent, "the signal was never sent"
    carried = error.value.history  # the epochs logged before the save
    assert [e["epoch"] for e in carried.epochs] == list(range(saved_at // 8))
    assert all("eval_acc" in e for e in carried.epochs)
    assert all_steps(tmp_path)[-1] == saved_at
    second = Signaller()
    resumed, history = fit_bn(second, tmp_path, steps_per_call=8, checkpoint_every=2)
    assert first.ended + second.ended == [0, 1, 2, 3]  # every epoch's hook, once
    same_history(history, want)
    assert_trees_close(resumed.model, straight.model, exact=True)


def test_a_signal_in_the_call_that_ends_an_epoch_leaves_its_end_to_the_resumed_run(tmp_path):
    # Two calls an epoch; the signal comes as the call ending epoch 1 (step 16) returns.
    ref = Signaller()
    straight, want = fit_bn(ref, steps_per_call=4)
    first = Signaller(hook="on_call_end", at=16)
    with pytest.raises(Preempted, match="at step 16 ") as error:
        fit_bn(first, tmp_path, steps_per_call=4, checkpoint_every=2)
    assert first.sent == [("on_call_end", 16)]
    # Epoch 1 is trained, neither evaluated nor ended: its evaluation never started.
    assert [e["epoch"] for e in error.value.history.epochs] == [0]
    assert first.evaluations == 1 and first.ended == [0]
    second = Signaller()
    resumed, history = fit_bn(second, tmp_path, steps_per_call=4, checkpoint_every=2)
    assert first.ended + second.ended == [0, 1, 2, 3]
    same_history(history, want)  # epoch 1's eval_acc, its train loss of all 8 steps
    assert_trees_close(resumed.model, straight.model, exact=True)
    # The resumed run ended epoch 1 and saved it over the checkpoint that left it unended.
    trainer = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
    assert trainer.restore(tmp_path, step=16) == 2 and trainer.step == 16


def test_an_epoch_that_ends_the_budget_is_ended_by_the_resume_too(tmp_path):
    # max_steps is spent by the preempted call: the resume still evaluates and ends epoch 1.
    fit = dict(epochs=None, max_steps=16, steps_per_call=4)
    straight, want = fit_bn(Signaller(), **fit)
    first = Signaller(hook="on_call_end", at=16)
    with pytest.raises(Preempted, match="at step 16 "):
        fit_bn(first, tmp_path, **fit)
    second = Signaller()
    resumed, history = fit_bn(second, tmp_path, **fit)
    assert first.ended + second.ended == [0, 1]
    same_history(history, want)
    assert_trees_close(resumed.model, straight.model, exact=True)
    again = Signaller()
    _, rerun = fit_bn(again, tmp_path, **fit)  # the run is over: nothing runs again
    assert again.ended == [] and again.evaluations == 0
    same_history(rerun, want)


def update_loss(metrics, loss, aux, batch):
    metrics.update(loss=loss)


def xent_aux(model, batch):
    return xent(model, batch), {}


def fit_with_metrics(directory=None, callbacks=()):
    trainer = Trainer(
        MLP(rngs=nnx.Rngs(0)), TX, xent_aux, has_aux=True,
        metrics=nnx.metrics.Average("loss"), update_metrics=update_loss,
    )  # fmt: skip
    fit = {} if directory is None else dict(checkpoint_dir=directory, resume=True)
    history = trainer.fit(DATA, epochs=3, batch_size=BS, progress=False, steps_per_call=3,
                          callbacks=list(callbacks), **fit)  # fmt: skip
    return trainer, history


def same_calls() -> LambdaCallback:
    """An ``on_call_end`` hook that does nothing: the reference then runs the calls the
    interrupted run does (a hook keeps epochs apart and writes back after every call)."""
    return LambdaCallback(on_call_end=lambda trainer, logs: None)


def sigterm_at(step: int) -> LambdaCallback:
    sent = []

    def maybe_send(trainer, logs):
        if logs["step"] >= step and not sent:
            sent.append(logs["step"])
            os.kill(os.getpid(), signal.SIGTERM)

    return LambdaCallback(on_call_end=maybe_send)


@pytest.mark.parametrize("at", [11, 16], ids=["mid_epoch", "epoch_end"])
def test_a_mid_epoch_resume_keeps_the_metrics_partial_sums(tmp_path, at):
    straight, want = fit_with_metrics(callbacks=[same_calls()])
    with pytest.raises(Preempted, match=f"at step {at} "):  # calls end at 3, 6, 8, 11, 14, 16
        fit_with_metrics(tmp_path, [sigterm_at(at)])
    resumed, history = fit_with_metrics(tmp_path)
    # train_loss of epoch 1 averages all its 8 steps, 3 (or 8) trained before the resume.
    assert [e["train_loss"] for e in history.epochs] == [e["train_loss"] for e in want.epochs]
    same_history(history, want)
    assert_trees_close(resumed.model, straight.model, exact=True)


def gan_style_step(model, optimizer, metrics, batch):
    """A stateful step that feeds a MultiMetric two losses (as a GAN's g and d losses)."""

    def losses(model):
        logits = model(batch["x"])
        g = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return g, jnp.mean(logits**2)

    (g_loss, d_loss), grads = nnx.value_and_grad(losses, has_aux=True)(model)
    optimizer.update(model, grads)
    metrics.update(g_loss=g_loss, d_loss=d_loss)


def fit_gan_style(directory=None, callbacks=()):
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    metrics = nnx.MultiMetric(
        g_loss=nnx.metrics.Average("g_loss"), d_loss=nnx.metrics.Average("d_loss")
    )
    trainer = Trainer(model, optimizer, train_step=gan_style_step, extras=(metrics,))
    fit = {} if directory is None else dict(checkpoint_dir=directory, resume=True)
    history = trainer.fit(DATA, epochs=3, batch_size=BS, progress=False, steps_per_call=3,
                          callbacks=list(callbacks), **fit)  # fmt: skip
    return trainer, history


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_a_mid_epoch_resume_keeps_a_stateful_steps_multimetric(tmp_path):
    straight, want = fit_gan_style(callbacks=[same_calls()])
    with pytest.raises(Preempted, match="at step 11 "):
        fit_gan_style(tmp_path, [sigterm_at(11)])
    resumed, history = fit_gan_style(tmp_path)
    got = [(e["train_g_loss"], e["train_d_loss"]) for e in history.epochs]
    assert got == [(e["train_g_loss"], e["train_d_loss"]) for e in want.epochs]
    same_history(history, want)
    assert_trees_close(resumed.model, straight.model, exact=True)
