"""EarlyStopping against Keras's own test cases (keras/src/callbacks/early_stopping_test.py).

Keras is not a dependency: each of its cases is written out here as the sequence of
monitored values it feeds the callback and what Keras asserts (the epoch it stops at, how
many epochs ran, the epoch whose weights it restores). Keras's ``val_`` prefix is
nnxscan's ``eval_``; Keras's "not stopped"/"no best" 0 is None here. The callback is
driven directly, as Keras's tests drive theirs, with a fake trainer whose model holds
the epoch index in its weights (Keras's ``DummyModel.set_weight_to_epoch``). Cases marked
"derived" come from Keras's code (``early_stopping.py``, ``monitor_callback.py``), not
its tests; the last tests run the real Trainer.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import EarlyStopping, LambdaCallback, Trainer

from conftest import MLP, accuracy, xent

NAN, INF = math.nan, math.inf


class FakeTrainer(SimpleNamespace):
    """What a callback may touch: ``model``, ``step``, ``stop_training``, ``load_state``."""

    def __init__(self):
        super().__init__(model=nnx.Linear(1, 1, rngs=nnx.Rngs(0)), step=0, stop_training=False)
        self.loaded = []

    def load_state(self, state):
        self.loaded.append(state)
        nnx.update(self.model, state)

    def set_weights_to_epoch(self, epoch):
        self.model.kernel[...] = jnp.full((1, 1), float(epoch))

    @property
    def weights_epoch(self) -> int:
        return int(self.model.kernel[0, 0])


def drive(stop, values, *, monitor=None, other_stops_at=None, trainer=None, start=0):
    """Keras's test loop: per epoch, train (step += 1, weights := epoch), call
    ``on_epoch_end`` with ``{monitor: value}``, break once ``stop_training`` is set; then
    ``on_train_end``. ``None`` in ``values`` leaves the monitor out of that epoch's logs.
    Returns (epochs trained, trainer)."""
    trainer = trainer or FakeTrainer()
    monitor = monitor or stop.monitor
    trainer.stop_training = False
    stop.on_train_begin(trainer)
    trained = 0
    for epoch, value in enumerate(values, start=start):
        trained += 1
        trainer.step += 1
        trainer.set_weights_to_epoch(epoch)
        logs = {"epoch": epoch, "loss": 1.0}
        if value is not None:
            logs[monitor] = value
        stop.on_epoch_end(trainer, epoch, logs)
        if epoch == other_stops_at:
            trainer.stop_training = True
        if trainer.stop_training:
            break
    stop.on_train_end(trainer, None)
    return trained, trainer


# -- Keras: test_early_stopping (mode="auto") ---------------------------------------------------


@pytest.mark.parametrize(
    "mode, monitor, expected",
    [
        ("max", "eval_mse", "max"),
        ("min", "eval_loss", "min"),
        ("auto", "eval_mse", "min"),
        ("auto", "loss", "min"),
        ("auto", "acc", "max"),
        ("auto", "eval_accuracy", "max"),
        ("auto", "hinge", "min"),
        ("auto", "f1_score", "max"),
    ],
)
def test_keras_mode_cases(mode, monitor, expected):
    assert EarlyStopping(monitor, mode=mode).mode == expected


KERAS_METRIC_DIRECTIONS = {  # every built-in Keras metric's name and its `_direction`
    "max": [
        "accuracy", "acc", "binary_accuracy", "categorical_accuracy",
        "sparse_categorical_accuracy", "top_k_categorical_accuracy",
        "sparse_top_k_categorical_accuracy", "precision", "recall",
        "sensitivity_at_specificity", "specificity_at_sensitivity", "precision_at_recall",
        "recall_at_precision", "auc", "pearson_correlation", "concordance_correlation",
        "fbeta_score", "f1_score", "iou", "binary_iou", "mean_iou", "one_hot_iou",
        "one_hot_mean_iou", "cosine_similarity", "r2_score",
    ],
    "min": [
        "loss", "hinge", "squared_hinge", "categorical_hinge", "binary_crossentropy",
        "categorical_crossentropy", "sparse_categorical_crossentropy", "mean_squared_error",
        "mean_absolute_error", "mean_absolute_percentage_error",
        "mean_squared_logarithmic_error", "root_mean_squared_error", "logcosh",
        "kl_divergence", "poisson", "mse", "mae", "mape", "msle", "bce",
    ],
}  # fmt: skip


@pytest.mark.parametrize("expected", ["max", "min"])
def test_auto_mode_gives_every_keras_metric_name_its_keras_direction(expected):
    for name in KERAS_METRIC_DIRECTIONS[expected]:
        assert EarlyStopping(name).mode == expected, name
        assert EarlyStopping(f"eval_{name}").mode == expected, name


def test_auto_mode_reads_the_words_of_user_metric_names():
    for name in ("eval_top5_acc", "eval_macro_f1", "eval_val_auc", "eval_token_accuracy"):
        assert EarlyStopping(name).mode == "max", name
    for name in ("eval_xent", "eval_nll", "eval_recon_error", "train_loss"):
        assert EarlyStopping(name).mode == "min", name


def test_keras_unknown_monitor_raises_value_error():
    """Keras: monitor="unknown" raises ValueError (it cannot tell min from max)."""
    stop = EarlyStopping("unknown", patience=0)
    with pytest.raises(ValueError, match="mode='min' or mode='max'"):
        drive(stop, [1.0, 2.0])
    # And when the key is not even logged, the error names the keys there are.
    with pytest.raises(ValueError, match=r"no such key.*keys: epoch, loss"):
        drive(EarlyStopping("unknown"), [1.0], monitor="other")


# -- Keras: test_early_stopping_patience --------------------------------------------------------


@pytest.mark.parametrize("patience", [0, 1, 2, 3])
def test_keras_patience_cases(patience):
    losses = [10.0, 9.0, 8.0, 9.0, 8.9, 8.8, 8.7, 8.6, 8.5]
    stop = EarlyStopping("loss", patience=patience)
    drive(stop, losses)
    assert stop.stopped_epoch == max(patience, 1) + 2
    assert (stop.best, stop.best_epoch) == (8.0, 2)


# -- Keras: test_early_stopping_reuse, test_state_reset_across_fit_calls ------------------------


def test_keras_reuse_across_fits_starts_fresh():
    values = [0.5, 0.4, 0.45, 0.46, 0.47, 0.48, 0.3]
    stop = EarlyStopping("mse", patience=3)
    trained1, trainer = drive(stop, values)
    trained2, _ = drive(stop, values, trainer=trainer, start=trained1)
    assert trained1 == trained2 == 5 >= 3  # the second fit did not compare against the first
    assert stop.stopped_epoch == 5 + 4 and stop.best_epoch == 5 + 1


def test_keras_state_reset_across_fit_calls():
    stop = EarlyStopping("loss", patience=3)
    trainer = FakeTrainer()
    stop.on_train_begin(trainer)
    stop.best, stop.wait, stop.stopped_epoch, stop.best_epoch = 0.1, 3, 5, 5
    stop._best_state = object()
    stop.on_train_begin(trainer)
    assert (stop.best, stop.wait, stop.stopped_epoch, stop.best_epoch) == (None, 0, None, None)
    assert stop._best_state is None


# -- Keras: test_early_stopping_with_baseline ---------------------------------------------------


def test_keras_baseline_case():
    """Keras trains with baseline=0.6 and asserts at least `patience` epochs ran; these
    values never beat the baseline, so it stops after exactly `patience` epochs."""
    stop = EarlyStopping("mse", patience=3, baseline=0.6)
    trained, _ = drive(stop, [0.9, 0.95, 0.97, 0.99, 1.0, 1.1])
    assert trained == 3 and stop.stopped_epoch == 2 and stop.best_epoch == 0


# -- Keras: test_early_stopping_final_weights_when_restoring_model_weights ----------------------


def test_keras_restores_the_best_weights():
    stop = EarlyStopping("eval_loss", patience=2, restore_best_weights=True)
    trained, trainer = drive(stop, [0.2, 0.15, 0.1, 0.11, 0.12])
    assert (trained, stop.stopped_epoch, stop.best_epoch) == (5, 4, 2)
    assert trainer.weights_epoch == 2 and len(trainer.loaded) == 1


def test_keras_restores_the_best_weights_when_no_epoch_beats_the_baseline():
    stop = EarlyStopping("eval_loss", patience=5, baseline=0.5, restore_best_weights=True)
    trained, trainer = drive(stop, [0.9, 0.8, 0.7, 0.71, 0.72, 0.73])
    assert trained == 5 and stop.stopped_epoch == 4
    assert trainer.weights_epoch == 2


def test_keras_restores_the_best_weights_when_another_callback_stops():
    stop = EarlyStopping("eval_loss", patience=5, baseline=0.5, restore_best_weights=True)
    trained, trainer = drive(stop, [0.9, 0.8, 0.7, 0.71, 0.72, 0.73], other_stops_at=3)
    assert trained == 4 and stop.stopped_epoch is None
    assert trainer.weights_epoch == 2


# -- Keras: test_early_stopping_with_start_from_epoch -------------------------------------------


@pytest.mark.parametrize("patience, stopped", [(3, 5), (0, 3)])
def test_keras_start_from_epoch_cases(patience, stopped):
    """Keras asserts at least patience + start_from_epoch (patience 3) and at least
    start_from_epoch (patience 0) epochs ran; with values that only get worse the run
    stops exactly `max(patience, 1)` epochs after the first monitored one (epoch 2)."""
    stop = EarlyStopping("mse", patience=patience, start_from_epoch=2)
    trained, _ = drive(stop, [0.1, 0.2, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert stop.best_epoch == 2 and stop.stopped_epoch == stopped
    assert trained == stopped + 1 >= patience + 2


# -- derived from Keras's code ------------------------------------------------------------------


@pytest.mark.parametrize("min_delta", [0.05, -0.05])  # Keras takes abs(min_delta)
def test_derived_min_delta_in_min_and_max_mode(min_delta):
    # min: 0.97 is not 0.05 below 1.0; 0.9 is.
    stop = EarlyStopping("eval_loss", patience=2, min_delta=min_delta)
    drive(stop, [1.0, 0.97, 0.9, 0.86, 0.88])
    assert (stop.best_epoch, stop.best, stop.stopped_epoch) == (2, 0.9, 4)
    # max: the mirror image.
    stop = EarlyStopping("eval_accuracy", patience=2, min_delta=min_delta)
    drive(stop, [0.5, 0.53, 0.6, 0.64, 0.62])
    assert (stop.best_epoch, stop.best, stop.stopped_epoch) == (2, 0.6, 4)


def test_derived_baseline_with_min_delta_and_the_improving_epochs_quirk():
    # An epoch that beats the best but not the baseline neither resets the count nor stops
    # training (Keras returns early from it); the first epoch that does not improve does.
    stop = EarlyStopping("eval_loss", patience=2, baseline=0.5, min_delta=0.01)
    trained, _ = drive(stop, [0.9, 0.8, 0.7, 0.6, 0.505, 0.506])
    assert (trained, stop.stopped_epoch, stop.best_epoch, stop.wait) == (6, 5, 4, 6)
    # 0.48 beats the baseline (by more than 0.01): the count restarts there.
    stop = EarlyStopping("eval_loss", patience=2, baseline=0.5, min_delta=0.01)
    drive(stop, [0.9, 0.48, 0.485, 0.6, 0.3])
    assert (stop.stopped_epoch, stop.best_epoch) == (3, 1)


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_values_are_no_improvement(bad):
    """(Keras would make a NaN first value the best, and -inf in min mode improves on
    anything; here a non-finite value is never an improvement nor restored.)"""
    stop = EarlyStopping("eval_loss", patience=2)
    trained, trainer = drive(stop, [0.5, 0.4, bad, bad, bad, bad])
    assert (trained, stop.stopped_epoch, stop.best_epoch, stop.best) == (4, 3, 1, 0.4)
    assert trainer.weights_epoch == 1
    # From the first epoch on: stops after `patience` epochs, restores nothing.
    stop = EarlyStopping("eval_loss", patience=2)
    trained, trainer = drive(stop, [bad] * 6)
    assert (trained, stop.stopped_epoch, stop.best) == (2, 1, None)
    assert trainer.loaded == []


def test_sparse_eval_epochs_are_skipped_and_restore_happens_without_a_stop():
    stop = EarlyStopping("eval_loss", patience=2)
    trained, trainer = drive(stop, [None, 0.8, None, 0.4, None, 0.5, None])
    assert trained == 7 and stop.stopped_epoch is None and stop.wait == 1
    assert stop.best_epoch == 3 and trainer.weights_epoch == 3  # Keras restores when not stopped


def test_a_missing_monitor_raises_on_the_first_epoch_that_logs_eval_keys():
    stop = EarlyStopping("eval_los")
    trainer = FakeTrainer()
    stop.on_train_begin(trainer)
    stop.on_epoch_end(trainer, 0, {"epoch": 0, "loss": 1.0})  # no eval this epoch: fine
    with pytest.raises(ValueError, match=r"monitor='eval_los'.*keys: epoch, eval_loss, loss"):
        stop.on_epoch_end(trainer, 1, {"epoch": 1, "loss": 1.0, "eval_loss": 0.5})
    # A monitor without the eval_ prefix is checked on the first epoch.
    stop = EarlyStopping("los", mode="min")
    stop.on_train_begin(trainer)
    with pytest.raises(ValueError, match="no such key"):
        stop.on_epoch_end(trainer, 0, {"epoch": 0, "loss": 1.0})


def test_an_eval_monitor_never_logged_warns_at_train_end():
    with pytest.warns(UserWarning, match="no epoch of this fit logged any eval_"):
        drive(EarlyStopping("eval_loss"), [None, None])


def test_the_warning_of_a_fit_without_evaluation_points_at_the_fit_call(data):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), optax.adam(1e-2), xent)
    with pytest.warns(UserWarning, match="no epoch of this fit logged any eval_") as said:
        trainer.fit(data, epochs=1, batch_size=16, callbacks=[EarlyStopping()], progress=False)
    assert said[0].filename == __file__  # the user's line, not nnxscan's


def test_no_restore_when_disabled_or_when_the_model_is_at_the_best_epoch():
    stop = EarlyStopping("eval_loss", patience=2, restore_best=False)
    _, trainer = drive(stop, [0.2, 0.1, 0.3, 0.4])
    assert stop.best_epoch == 1 and trainer.loaded == [] and trainer.weights_epoch == 3
    stop = EarlyStopping("eval_loss", patience=2, restore_best=True)
    _, trainer = drive(stop, [0.3, 0.2, 0.1])
    assert stop.best_epoch == 2 and trainer.loaded == []


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="mode"):
        EarlyStopping(mode="up")
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(patience=-1)
    with pytest.raises(ValueError, match="start_from_epoch"):
        EarlyStopping(start_from_epoch=1.5)


def test_it_says_when_it_stops_and_restores(capsys):
    drive(EarlyStopping("eval_loss", patience=2), [0.2, 0.123, 0.3, 0.4])
    assert capsys.readouterr().out.splitlines() == [
        "EarlyStopping: stopped at epoch 3: eval_loss did not improve for 2 epochs "
        "(best 0.123 at epoch 1)",
        "EarlyStopping: restored the model from epoch 1 (eval_loss 0.123)",
    ]
    drive(EarlyStopping("eval_loss", patience=2, verbose=False), [0.2, 0.123, 0.3, 0.4])
    assert capsys.readouterr().out == ""


# -- end to end, with the real Trainer ----------------------------------------------------------


class Seen(nnx.Variable):
    """Training steps the model has taken: its loss_fn counts them (not a Param)."""


class CountingMLP(MLP):
    def __init__(self, *, rngs):
        super().__init__(rngs=rngs)
        self.seen = Seen(jnp.zeros((), jnp.int32))


def counting_xent(model, batch):
    model.seen[...] += 1
    return xent(model, batch)


BS, STEPS_PER_EPOCH = 8, 8  # 64 examples


def eval_loss_nan_from_epoch_2(model, batch):
    """The held-out loss, NaN once the model has trained more than 2 epochs."""
    loss = xent(model, batch)
    return {"loss": jnp.where(model.seen[...] > 2 * STEPS_PER_EPOCH, jnp.nan, loss)}


def test_a_nan_eval_loss_stops_fit_after_patience_and_restores_the_best(data):
    snapshots = {}
    keep = LambdaCallback(
        on_epoch_end=lambda t, e, logs: snapshots.update({e: np.array(t.model.l1.kernel[...])})
    )
    trainer = Trainer(CountingMLP(rngs=nnx.Rngs(0)), optax.adam(1e-2), counting_xent)
    stop = EarlyStopping("eval_loss", patience=2, verbose=False)
    history = trainer.fit(
        data, epochs=10, batch_size=BS, eval_data=data, metric_fn=eval_loss_nan_from_epoch_2,
        callbacks=[keep, stop], progress=False,
    )  # fmt: skip
    logged = [e["eval_loss"] for e in history.epochs]
    assert all(math.isfinite(v) for v in logged[:2]) and all(math.isnan(v) for v in logged[2:])
    assert (stop.stopped_epoch, trainer.epoch) == (3, 4)  # NaN at 2 and 3: patience spent
    assert stop.best_epoch == int(np.argmin(logged[:2]))
    np.testing.assert_array_equal(trainer.model.l1.kernel[...], snapshots[stop.best_epoch])


def test_a_typo_in_the_monitor_raises_after_the_first_evaluated_epoch(data):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), optax.adam(1e-2), xent)
    with pytest.raises(ValueError, match=r"monitor='eval_acuracy'.*eval_accuracy"):
        trainer.fit(
            data, epochs=10, batch_size=BS, eval_data=data, metric_fn=accuracy, eval_every=2,
            callbacks=[EarlyStopping("eval_acuracy")], progress=False,
        )  # fmt: skip
    assert trainer.epoch == 2  # epoch 0 logged no eval_* key; epoch 1 did
