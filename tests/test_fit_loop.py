"""fit's loop as Keras/Lightning users expect it: eval, callbacks, early stopping, LR logs."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import Step, make_train_step
from nnxscan.shell import Trainer
from nnxscan.shell.callbacks import EarlyStopping, LambdaCallback

from conftest import MLP, accuracy, assert_trees_close, epoch_batches, reference_loop, xent

TX = optax.adam(1e-2)
BS = 8


def host_state(model):
    return jax.tree.map(lambda x: np.array(jax.random.key_data(x) if jnp.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x), nnx.state(model))  # fmt: skip


def test_hooks_run_in_order_with_plain_python_logs(data):
    events = []
    hooks = LambdaCallback(
        on_train_begin=lambda t: events.append("train_begin"),
        on_epoch_begin=lambda t, e: events.append(f"epoch_begin {e}"),
        on_call_end=lambda t, logs: events.append(f"call {logs['epoch']} {logs['step']}"),
        on_epoch_end=lambda t, e, logs: events.append(f"epoch_end {e}"),
        on_train_end=lambda t, h: events.append(f"train_end {len(h.epochs)}"),
    )
    Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent).fit(
        data, epochs=2, batch_size=BS, steps_per_call=4, callbacks=[hooks], progress=False
    )
    assert events == [
        "train_begin",
        "epoch_begin 0", "call 0 4", "call 0 8", "epoch_end 0",
        "epoch_begin 1", "call 1 12", "call 1 16", "epoch_end 1",
        "train_end 2",
    ]  # fmt: skip


def test_stop_training_in_a_call_hook_ends_after_that_call_with_the_model_synced(data):
    def stop_at_12(trainer, logs):
        trainer.stop_training = logs["step"] == 12

    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    history = trainer.fit(
        data, epochs=5, batch_size=BS, steps_per_call=4, progress=False,
        callbacks=[LambdaCallback(on_call_end=stop_at_12)],
    )  # fmt: skip
    assert trainer.step == 12 and trainer.epoch == 1  # epoch 1 was cut short
    assert history.epochs[1]["stopped"] and history.epochs[1]["steps"] == 4
    ref = MLP(rngs=nnx.Rngs(0))
    batches = epoch_batches(data, BS, 0, 0) + epoch_batches(data, BS, 0, 1)[:4]
    reference_loop(ref, nnx.Optimizer(ref, TX, wrt=nnx.Param), xent, batches)
    assert_trees_close(model, ref)


def test_eval_during_fit_logs_eval_metrics_every_n_epochs(data):
    held_out = {k: v[:24] for k, v in data.items()}
    expected = {}

    def independent_accuracy(trainer, epoch, logs):
        trainer.model.eval()
        pred = np.asarray(trainer.model(held_out["x"])).argmax(-1)
        trainer.model.train()
        expected[epoch] = float(np.mean(pred == held_out["y"]))

    history = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent).fit(
        data, epochs=4, batch_size=BS, eval_data=held_out, metric_fn=accuracy, eval_every=2,
        eval_batch_size=5, callbacks=[LambdaCallback(on_epoch_end=independent_accuracy)],
        progress=False,
    )  # fmt: skip
    logged = {e["epoch"]: e.get("eval_accuracy") for e in history.epochs}
    assert logged[0] is None and logged[2] is None
    for epoch in (1, 3):
        assert logged[epoch] == pytest.approx(expected[epoch], abs=1e-6)


def test_eval_arguments_are_checked_before_training(data):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    with pytest.raises(ValueError, match="eval_data and a metric_fn"):
        trainer.fit(data, epochs=1, batch_size=BS, eval_data=data, progress=False)
    with pytest.raises(ValueError, match="eval_data"):
        bad = {"x": data["x"], "y": data["y"][:3]}
        trainer.fit(
            data, epochs=1, batch_size=BS, eval_data=bad, metric_fn=accuracy, progress=False
        )
    assert trainer.step == 0


def test_early_stopping_stops_at_the_right_epoch_and_restores_the_best_bitwise(data):
    script = [0.9, 0.7, 0.5, 0.6, 0.55, 0.58, 0.3]  # best at epoch 2, then worse ones
    snapshots = {}

    def scripted(trainer, epoch, logs):
        logs["eval_loss"] = script[epoch]
        snapshots[epoch] = host_state(trainer.model)

    stop = EarlyStopping("eval_loss", patience=2)
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    trainer.fit(
        data, epochs=len(script), batch_size=BS, progress=False,
        callbacks=[LambdaCallback(on_epoch_end=scripted), stop],
    )  # fmt: skip
    # patience=2 (Keras's meaning): two epochs without improvement, 3 and 4, then stop.
    assert (stop.best_epoch, stop.stopped_epoch, trainer.epoch) == (2, 4, 5)
    for a, b in zip(jax.tree.leaves(snapshots[2]), jax.tree.leaves(host_state(model)), strict=True):
        np.testing.assert_array_equal(a, b)
    model(data["x"])  # the restored buffers are live, not donated


def test_early_stopping_restores_the_best_even_when_eval_is_sparse(data):
    """eval every 2 epochs, best at epoch 3, training ends at epoch 4: rewind to 3."""
    snapshots = {}
    script = {1: 0.8, 3: 0.4}

    def scripted(trainer, epoch, logs):
        if epoch in script:
            logs["eval_loss"] = script[epoch]
        snapshots[epoch] = host_state(trainer.model)

    model = MLP(rngs=nnx.Rngs(0))
    stop = EarlyStopping("eval_loss", patience=5)
    Trainer(model, TX, xent).fit(
        data, epochs=5, batch_size=BS, progress=False,
        callbacks=[LambdaCallback(on_epoch_end=scripted), stop],
    )  # fmt: skip
    assert stop.best_epoch == 3 and stop.stopped_epoch is None
    for a, b in zip(jax.tree.leaves(snapshots[3]), jax.tree.leaves(host_state(model)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_stop_training_set_before_any_call_trains_nothing(data):
    for hook in ("on_train_begin", "on_epoch_begin"):
        trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)

        def stop(t, *args):
            t.stop_training = True

        trainer.fit(data, epochs=3, batch_size=BS, callbacks=[LambdaCallback(**{hook: stop})],
                    progress=False)  # fmt: skip
        assert trainer.step == 0, hook


def test_early_stopping_mode_auto_and_validation():
    assert EarlyStopping("eval_accuracy").mode == "max"
    assert EarlyStopping("loss").mode == "min"
    with pytest.raises(ValueError, match="mode"):
        EarlyStopping(mode="up")


def test_learning_rate_of_an_injected_schedule_is_logged(data):
    schedule = optax.linear_schedule(1e-2, 1e-3, transition_steps=16)
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
    history = Trainer(MLP(rngs=nnx.Rngs(0)), tx, xent).fit(
        data, epochs=2, batch_size=BS, progress=False
    )
    # The state holds the rate of the last update: the schedule at count = steps - 1.
    for epoch, logs in enumerate(history.epochs):
        steps_done = 8 * (epoch + 1)
        assert logs["learning_rate"] == pytest.approx(float(schedule(steps_done - 1)), rel=1e-6)


class _Coefficients(NamedTuple):
    hyperparams: dict  # the shape of an optax.inject_hyperparams state


def test_a_steps_own_hyperparameter_state_is_not_logged_as_the_learning_rate(data, stretch_count):
    # Populations set it like an injected rate, but a step may scale what it holds (the PPO
    # demo anneals its base rate): only optax's own states give the rate of the last update.
    # Without a logged rate, nothing needs the host between the epochs: they fuse.
    inner = make_train_step(xent, TX)

    def init(graphdef, state):
        return inner.init(graphdef, state), _Coefficients({"learning_rate": jnp.float32(0.5)})

    def update(graphdef, state, opt_state, batch):
        state, tx_state, loss = inner(graphdef, state, opt_state[0], batch)
        return state, (tx_state, opt_state[1]), loss

    model = MLP(rngs=nnx.Rngs(0))
    history = Trainer(model, train_step=Step(init, update)).fit(
        data, epochs=2, batch_size=BS, seed=3, progress=False
    )
    assert all("learning_rate" not in logs for logs in history.epochs)
    assert stretch_count() == 1
    reference = MLP(rngs=nnx.Rngs(0))
    Trainer(reference, TX, xent).fit(data, epochs=2, batch_size=BS, seed=3, progress=False)
    assert_trees_close(model, reference)  # another step's program: to rounding (conftest)


def test_no_host_sync_per_step_only_one_per_epoch(data, monkeypatch):
    gets = {"n": 0}
    real_get = jax.device_get

    def counted_get(x):
        gets["n"] += 1
        return real_get(x)

    monkeypatch.setattr(jax, "device_get", counted_get)
    # Shapes no other test trained (a later fit runs calls of a stretch length compiled
    # before, by any fit of these shapes, when it divides its epochs), and compiled outside
    # the count: the three-epoch call too.
    trainer = Trainer(MLP(hidden=29, rngs=nnx.Rngs(0)), TX, xent)
    trainer.fit(data, epochs=3, batch_size=BS, steps_per_call=1, progress=False)
    gets["n"] = 0
    epoch_hook = LambdaCallback(on_epoch_end=lambda t, e, logs: None)
    with jax.transfer_guard_device_to_host("disallow"):  # no implicit transfer anywhere
        trainer.fit(data, epochs=3, batch_size=BS, steps_per_call=1, progress=False,
                    callbacks=[epoch_hook])  # fmt: skip
    assert gets["n"] == 3  # one explicit read per epoch (its losses), for 24 steps
    gets["n"] = 0
    with jax.transfer_guard_device_to_host("disallow"):
        trainer.fit(data, epochs=3, batch_size=BS, steps_per_call=1, progress=False)
    assert gets["n"] == 1  # nothing needs the host between epochs: one read for all three


def test_steps_per_sec_is_the_steady_rate_with_the_compile_logged_apart(data, capsys):
    """The first fit's first epoch compiles: its compile_time is logged on its own and
    left out of steps_per_sec (steps / (wall_time - compile_time)); a second fit of the
    same program compiles nothing and logs 0."""
    trainer = Trainer(MLP(rngs=nnx.Rngs(7)), optax.sgd(0.05), xent)  # a program of its own
    apart = LambdaCallback(on_epoch_end=lambda *args: None)  # one call per epoch, not fused
    first = trainer.fit(data, epochs=2, batch_size=8, callbacks=[apart])
    again = trainer.fit(data, epochs=1, batch_size=8, progress=False)
    compiled = [logs["compile_time"] for logs in first.epochs + again.epochs]
    assert compiled[0] > 0 and compiled[1:] == [0.0, 0.0]
    for logs in first.epochs + again.epochs:
        running = logs["wall_time"] - logs["compile_time"]
        assert logs["steps_per_sec"] == pytest.approx(logs["steps"] / running)
    assert f"after a {compiled[0]:.1f} s compile" in capsys.readouterr().out


@pytest.mark.parametrize("with_optimizer", [True, False])
@pytest.mark.parametrize("carry_kind", ["same structure", "pure dict"])
def test_the_write_back_puts_a_carry_into_the_users_variables_as_nnx_update_does(
    with_optimizer, carry_kind, monkeypatch
):
    """The owner's write-back swaps the carry's leaves into the user's own Variables (a carry of
    the structure it read); any other carry goes through nnx.update. The reference: fresh
    objects updated by nnx.update with the same carry."""
    from nnxscan.adapters.nnx_optimizer import optimizer_state_builder
    from nnxscan.shell._engine.owner import ModelOwner

    def objects():
        model = MLP(rngs=nnx.Rngs(0))
        return model, (nnx.Optimizer(model, TX, wrt=nnx.Param) if with_optimizer else TX)

    model, tx = objects()
    owner = ModelOwner(model, tx)
    kernel = model.l1.kernel  # the user's Variable object, kept by the write
    _, state, opt_state = owner.read()
    state, opt_state = jax.tree.map(lambda x: x + 1, (state, opt_state))
    if carry_kind == "pure dict":
        state = nnx.to_pure_dict(state)
    leaves, treedef = jax.tree.flatten((state, opt_state))
    write = owner.make_write_back()
    if carry_kind == "same structure":  # written by swapping values, no graph walk
        monkeypatch.setattr(nnx, "update", lambda *args: pytest.fail("nnx.update called"))
    write(leaves, treedef, 3)
    write(leaves, treedef, 2)  # the second write takes the checked path again
    monkeypatch.undo()

    ref_model, ref_tx = objects()
    nnx.update(ref_model, state)
    if with_optimizer:
        nnx.update(ref_tx, optimizer_state_builder(ref_tx)(opt_state, jnp.uint32(5)))
    assert model.l1.kernel is kernel
    assert_trees_close(host_state(model), host_state(ref_model), exact=True)
    if with_optimizer:
        assert int(tx.step.get_value()) == 5 and owner.step == 5
        assert_trees_close(nnx.state(tx), nnx.state(ref_tx), exact=True)
    else:
        assert owner.step == 5
        assert_trees_close(owner.opt_state, opt_state, exact=True)
