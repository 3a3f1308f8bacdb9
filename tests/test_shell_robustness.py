"""The shell never surprises: interrupts, failing callbacks, aliased buffers, odd optimizers.

Each case is checked against the plain per-step NNX loop (conftest.reference_loop).
"""

from __future__ import annotations

import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import LambdaCallback, Trainer, scan_train

from conftest import (
    MLP,
    accuracy,
    assert_trees_close,
    epoch_batches,
    reference_loop,
    state_arrays,
    xent,
)

TX = optax.adam(1e-2)
BS = 8  # 64 examples: 8 steps per epoch


def reference_steps(model_cls, data, steps, *, tx=TX, wrt=nnx.Param, loss_fn=xent):
    """The per-step NNX loop over the first ``steps`` steps of fit's batches."""
    model = model_cls(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)
    batches, epoch = [], 0
    while len(batches) < steps:
        batches += epoch_batches(data, BS, 0, epoch)
        epoch += 1
    reference_loop(model, optimizer, loss_fn, batches[:steps])
    return model, optimizer


def assert_usable(model, data):
    model(data["x"])  # raises "Array has been deleted" if a donated buffer leaked


def test_real_sigint_right_after_a_donating_call_keeps_that_calls_state(
    data, monkeypatch, default_sigint
):
    """The worst moment for Ctrl-C: the call consumed the old state, its result is not kept."""
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    trainer = Trainer(model, optimizer, xent, execution="step")
    program, calls = trainer._engine.program, {"n": 0}
    real_runner = program.runner

    def interrupting_runner(*args, **kwargs):
        real = real_runner(*args, **kwargs)

        def run(*a, **k):
            out = real(*a, **k)
            calls["n"] += 1
            if calls["n"] == 4:
                signal.raise_signal(signal.SIGINT)  # a real signal, after the donation
            return out

        return run

    monkeypatch.setattr(program, "runner", interrupting_runner)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    ref, ref_opt = reference_steps(MLP, data, 4)
    assert trainer.step == 4 and int(optimizer.step[...]) == 4
    assert_trees_close(model, ref)
    assert_trees_close(optimizer, ref_opt)
    assert_usable(model, data)


@pytest.mark.parametrize(("execution", "kept_steps"), [("scan", 8), ("step", 10)])
def test_a_failing_host_callback_leaves_the_last_completed_state(data, execution, kept_steps):
    calls = {"n": 0}

    def data_source(_):
        calls["n"] += 1
        if calls["n"] == 11:
            raise RuntimeError("the data source failed")

    def loss_with_callback(model, batch):
        jax.debug.callback(data_source, batch["x"][0, 0])
        return xent(model, batch)

    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, loss_with_callback, execution=execution)
    with pytest.raises(Exception, match="data source failed"):
        trainer.fit(data, epochs=2, batch_size=BS, progress=False)
    ref, _ = reference_steps(MLP, data, kept_steps)
    assert trainer.step == kept_steps
    assert_trees_close(model, ref)
    assert_usable(model, data)


def test_interrupt_in_the_epochs_host_sync_still_counts_the_epoch(data, monkeypatch):
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    real_get = jax.device_get

    def interrupted_get(x):
        monkeypatch.setattr(jax, "device_get", real_get)
        raise KeyboardInterrupt

    monkeypatch.setattr(jax, "device_get", interrupted_get)
    # An epoch hook keeps one compiled call per epoch (no fusing), so the interrupt lands
    # in epoch 0's sync.
    per_epoch = LambdaCallback(on_epoch_end=lambda t, e, logs: None)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(data, epochs=3, batch_size=BS, progress=False, callbacks=[per_epoch])
    assert (trainer.epoch, trainer.step) == (1, 8)
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)  # epoch 1's shuffle, not 0's
    ref, _ = reference_steps(MLP, data, 16)
    assert_trees_close(model, ref)


class Tied(nnx.Module):
    """Two Variables hold one buffer: a buffer can be donated only once."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)
        self.scale = nnx.Param(jnp.ones(8))
        self.frozen_scale = nnx.Variable(self.scale[...])

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)) * self.scale[...] * self.frozen_scale[...])


def test_variables_sharing_a_buffer_train_like_the_nnx_loop(data):
    ref, _ = reference_steps(Tied, data, 16)
    model = Tied(rngs=nnx.Rngs(0))
    Trainer(model, TX, xent).fit(data, epochs=2, batch_size=BS, progress=False)
    assert_trees_close(model, ref)


def test_optax_state_that_references_the_params_trains_like_the_nnx_loop(data):
    tx = optax.contrib.mechanize(optax.adam(1e-2))  # its state keeps params_ref = params
    ref, ref_opt = reference_steps(MLP, data, 16, tx=tx)
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    Trainer(model, optimizer, xent).fit(data, epochs=2, batch_size=BS, progress=False)
    assert_trees_close(model, ref, rtol=1e-4, atol=1e-6)
    assert_trees_close(optimizer, ref_opt, rtol=1e-4, atol=1e-6)


def test_multisteps_optimizer_trains_like_the_nnx_loop(data):
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    ref, ref_opt = reference_steps(MLP, data, 8, tx=tx)
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    batches = {k: np.stack([b[k] for b in epoch_batches(data, BS, 0, 0)]) for k in data}
    scan_train(model, optimizer, xent, batches)
    assert_trees_close(model, ref)
    assert_trees_close(optimizer, ref_opt)


def test_optimizer_with_a_subset_wrt(data):
    wrt = nnx.All(nnx.Param, nnx.PathContains("l2"))
    ref, ref_opt = reference_steps(MLP, data, 16, wrt=wrt)
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=wrt)
    Trainer(model, optimizer, xent).fit(data, epochs=2, batch_size=BS, progress=False)
    assert_trees_close(model, ref)
    assert_trees_close(optimizer, ref_opt)


class Tagged(MLP):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.gain = nnx.Param(jnp.ones(3), info={"tag": "dict metadata is unhashable"})

    def __call__(self, x):
        return super().__call__(x) * self.gain[...]


def test_variables_with_dict_metadata(data, compile_count):
    ref, _ = reference_steps(Tagged, data, 16)
    model = Tagged(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    compiled = compile_count()
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    assert compile_count() == compiled
    assert_trees_close(model, ref)


def test_committed_or_numpy_data_compile_once(data, compile_count):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    trainer.evaluate(data, accuracy, batch_size=BS)
    committed = jax.device_put(data, jax.devices()[0])
    uncommitted = jax.tree.map(jnp.asarray, data)  # (jnp.asarray itself compiles a copy)
    compiled = compile_count()
    trainer.fit(committed, epochs=1, batch_size=BS, progress=False)
    trainer.fit(uncommitted, epochs=1, batch_size=BS, progress=False)
    trainer.evaluate(committed, accuracy, batch_size=BS)
    assert compile_count() == compiled


def test_a_forward_pass_that_adds_a_variable_is_a_clear_error(data):
    class Sows(MLP):
        def __call__(self, x):
            y = super().__call__(x)
            self.last = nnx.Intermediate(y)  # a new variable each call
            return y

    model = Sows(rngs=nnx.Rngs(0))
    before = state_arrays(model)
    for execution in ["scan", "step"]:
        with pytest.raises(ValueError, match=r"added: \[\"\['last'\]"):
            Trainer(model, TX, xent, execution=execution).fit(
                data, epochs=1, batch_size=BS, progress=False
            )
    for a, b in zip(before, state_arrays(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_aux_keys_never_shadow_fits_own_logs(data):
    def loss_fn(model, batch):
        loss = xent(model, batch)
        return loss, {"loss": 2 * loss, "steps": jnp.float32(1.0), "acc": accuracy(model, batch)}

    history = Trainer(MLP(rngs=nnx.Rngs(0)), TX, loss_fn, has_aux=True).fit(
        data, epochs=1, batch_size=BS, progress=False
    )
    logs = history.epochs[0]
    assert logs["loss"] == pytest.approx(float(np.mean(history.losses)), rel=1e-6)
    assert logs["aux/loss"] == pytest.approx(2 * logs["loss"], rel=1e-5)
    assert logs["steps"] == 8 and logs["aux/steps"] == 1.0 and "acc" in logs


def test_has_aux_with_a_scalar_loss_says_what_to_do(data):
    with pytest.raises(ValueError, match="has_aux=False"):
        Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent, has_aux=True).fit(
            data, epochs=1, batch_size=BS, progress=False
        )


def test_seed_out_of_range(data):
    with pytest.raises(ValueError, match="seed must be at most"):
        Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent).fit(
            data, epochs=1, batch_size=BS, seed=2**31, progress=False
        )
