"""EarlyStopping's record in ``History.events``: what it holds, that checkpoints keep it,
and that ``History.plot`` marks it.

The reference for each event is worked out by hand from the epoch logs the run produced:
Keras's rule (the first epoch ``patience`` epochs after the best without improving; the
best is the lowest value) and the step counts of the logged epochs.
"""

from __future__ import annotations

import json

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.adapters.checkpoint import Checkpointer
from nnxscan.shell import EarlyStopping, History, Population, Trainer
from nnxscan.shell._edges.checkpointing import RunLog
from nnxscan.shell._engine.layout import ONE_MODEL

from conftest import MLP, make_data, state_arrays, xent

BS, PATIENCE = 8, 2


def eval_xent(model, batch):
    return xent(model, batch)


def _split():
    full = make_data(112)
    return ({k: v[a:b] for k, v in full.items()} for a, b in ((0, 64), (64, 112)))


def _keras_rule(values: list[float], patience: int) -> tuple[int | None, int]:
    """(stopped epoch or None, best epoch) for a monitor to minimize, min_delta 0."""
    best, best_epoch, wait = np.inf, 0, 0
    for epoch, value in enumerate(values):
        wait += 1
        if value < best:
            best, best_epoch, wait = value, epoch, 0
        elif wait >= max(patience, 1) and epoch > 0:
            return epoch, best_epoch
    return None, best_epoch


def _steps_after(history: History, epoch: int) -> int:
    return sum(logs["steps"] for logs in history.epochs[: epoch + 1])


def _expected_events(history, values, member=None) -> list[dict]:
    stopped, best = _keras_rule(values, PATIENCE)
    assert stopped is not None, "the run should stop early"
    extra = {} if member is None else {"member": member}
    events = [{"epoch": stopped, "step": _steps_after(history, stopped),
               "what": "early_stopping_stopped", **extra}]  # fmt: skip
    if best != stopped:
        events.append({"epoch": best, "step": _steps_after(history, best),
                       "what": "restored_best", **extra})  # fmt: skip
    return events


def test_a_trainer_records_the_stop_and_the_restore_and_its_checkpoint_keeps_them(tmp_path):
    data, test = _split()
    stop = EarlyStopping("eval_eval_xent", patience=PATIENCE, verbose=False)
    tx = optax.adam(3e-1)  # shared with the resumed Trainer: its fit reuses the compile
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), tx, xent)
    history = trainer.fit(data, epochs=30, batch_size=BS, eval_data=test, metric_fn=eval_xent,
                          callbacks=[stop], checkpoint_dir=tmp_path, progress=False)  # fmt: skip
    values = [logs["eval_eval_xent"] for logs in history.epochs]
    assert history.events == _expected_events(history, values)
    assert len(history.events) == 2, "the best epoch should not be the last one"

    # Resumed from the checkpoint with nothing left to train: the History comes back from
    # the checkpoint alone, events included, and the model is the restored best one.
    again = Trainer(MLP(rngs=nnx.Rngs(0)), tx, xent)
    resumed = again.fit(data, epochs=trainer.epoch, batch_size=BS, checkpoint_dir=tmp_path,
                        resume=True, progress=False)  # fmt: skip
    assert resumed.events == history.events
    assert history.num_members is None and resumed.num_members is None  # one model's
    for a, b in zip(state_arrays(again.model), state_arrays(trainer.model), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow_on_accelerator("a population stopped, saved and restored")
def test_a_population_records_each_members_stop_and_restore_and_its_checkpoint_keeps_them(
    tmp_path,
):
    data, test = _split()
    rates = [3e-1, 3e-2, 3e-3]
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)

    def build():
        return Population(lambda rngs: MLP(rngs=rngs), tx, xent, seeds=[0, 1, 2],
                          hyperparams={"learning_rate": rates})  # fmt: skip

    pop = build()
    stop = EarlyStopping("eval_eval_xent", patience=PATIENCE, verbose=False)
    history = pop.fit(data, epochs=12, batch_size=BS, eval_data=test, metric_fn=eval_xent,
                      callbacks=[stop], checkpoint_dir=tmp_path, progress=False)  # fmt: skip
    expected = []
    for i in range(3):
        values = [float(logs["eval_eval_xent"][i]) for logs in history.epochs]
        stopped, best = _keras_rule(values, PATIENCE)
        if stopped is None:  # trained to the end: restored only if its best was earlier
            last = len(history.epochs) - 1
            if best != last:
                expected.append({"epoch": best, "step": _steps_after(history, best),
                                 "what": "restored_best", "member": i})  # fmt: skip
            continue
        # A frozen member logs its frozen state's value: the rule's later epochs don't count.
        expected += _expected_events(history, values[: stopped + 1], member=i)
    assert history.events == expected
    stopped = {e["member"] for e in expected if e["what"] == "early_stopping_stopped"}
    assert stopped and stopped != {0, 1, 2}, "some members should stop, some train on"

    again = build()
    resumed = again.fit(data, epochs=pop.epoch, batch_size=BS, checkpoint_dir=tmp_path,
                        resume=True, progress=False)  # fmt: skip
    assert resumed.events == history.events
    # Told by fit, and by the run log a resumed fit reads: 3 members' losses and logs.
    assert history.num_members == resumed.num_members == 3


def test_the_run_log_keeps_events_and_an_inline_run_without_them_reads_as_none(tmp_path):
    history = History()
    history._append(np.ones(4, np.float32), {"epoch": 0, "steps": 4, "loss": 1.0})
    history.events.append({"epoch": 0, "step": 4, "what": "early_stopping_stopped", "member": 2})
    with Checkpointer(tmp_path) as checkpointer:
        where = RunLog(checkpointer).record(history, np.zeros(0, np.float32))
    back, partial, *_ = RunLog.read(tmp_path, where, ONE_MODEL)
    assert back.events == history.events and partial.size == 0
    # A checkpoint written before the run log held its History inline, maybe without events.
    old = {"epochs": history.epochs, "losses": [1.0] * 4, "partial": []}
    assert RunLog.read(tmp_path, json.dumps(old), ONE_MODEL)[0].events == []
    assert History().events == [] and History().events is not History().events


def test_no_events_without_a_stop_and_none_for_an_unchanged_model():
    data, test = _split()
    stop = EarlyStopping("eval_eval_xent", patience=50, verbose=False)
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), optax.sgd(1e-2), xent)
    history = trainer.fit(data, epochs=3, batch_size=BS, eval_data=test, metric_fn=eval_xent,
                          callbacks=[stop], progress=False)  # fmt: skip
    values = [logs["eval_eval_xent"] for logs in history.epochs]
    assert np.argmin(values) == 2, "a slow, steady descent: the last epoch is the best"
    assert history.events == []


@pytest.fixture
def saved_figures(monkeypatch):
    """The matplotlib Figures ``savefig`` is called on, as they are when written."""
    figure = pytest.importorskip("matplotlib.figure")
    saved, original = [], figure.Figure.savefig

    def savefig(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(figure.Figure, "savefig", savefig)
    return saved


def _event_lines(ax) -> list:
    return [line for line in ax.get_lines() if line.get_linestyle() in ("--", ":")]


def test_plot_marks_the_stop_and_the_restore_with_a_labelled_line(tmp_path, saved_figures):
    history = History()
    for epoch in range(6):
        logs = {"epoch": epoch, "steps": 10, "loss": 1.0 / (epoch + 1)}
        if epoch % 2:
            logs["eval_loss"] = 2.0 / (epoch + 1)
        history._append(np.linspace(2, 1, 10) / (epoch + 1), logs)
    history.events += [
        {"epoch": 5, "step": 60, "what": "early_stopping_stopped"},
        {"epoch": 1, "step": 20, "what": "restored_best"},
        {"epoch": 99, "step": 990, "what": "restored_best"},  # not an epoch of this run
        {"epoch": 2, "step": 30, "what": "another_callbacks_event"},
    ]
    history.plot(tmp_path / "events.png")
    (fig,) = saved_figures
    top, bottom = fig.axes
    lines = {line.get_label(): line for line in _event_lines(top)}
    assert set(lines) == {"early stopping: stopped (epoch 5)", "restored best (epoch 1)"}
    # Each at the last step of its epoch (10 steps per epoch), vertical.
    assert list(lines["early stopping: stopped (epoch 5)"].get_xdata()) == [60.0, 60.0]
    assert list(lines["restored best (epoch 1)"].get_xdata()) == [20.0, 20.0]
    assert sorted(line.get_xdata()[0] for line in _event_lines(bottom)) == [20.0, 60.0]
    legend = [text.get_text() for text in top.get_legend().get_texts()]
    assert "early stopping: stopped (epoch 5)" in legend and "restored best (epoch 1)" in legend


def test_a_populations_plot_marks_each_members_events_in_its_colour(tmp_path, saved_figures):
    colors = pytest.importorskip("matplotlib.colors")
    history = History(losses=np.zeros((0, 3), np.float32))
    for epoch in range(4):
        history._append(np.ones((5, 3)) / (epoch + 1),
                        {"epoch": epoch, "steps": 5, "loss": np.ones(3)})  # fmt: skip
    history.events += [
        {"epoch": 2, "step": 15, "what": "early_stopping_stopped", "member": 1},
        {"epoch": 0, "step": 5, "what": "restored_best", "member": 1},
        {"epoch": 3, "step": 20, "what": "early_stopping_stopped", "member": 2},
    ]
    history.plot(tmp_path / "population.png")
    (ax,) = saved_figures[0].axes
    lines = _event_lines(ax)
    marks = sorted((line.get_xdata()[0], line.get_linestyle(), colors.to_hex(line.get_color()))
                   for line in lines)  # fmt: skip
    assert marks == [(5.0, ":", "#ff7f0e"), (15.0, "--", "#ff7f0e"), (20.0, "--", "#2ca02c")]
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert sum("early stopping: stopped" in text for text in legend) == 1
    assert sum("restored best" in text for text in legend) == 1
