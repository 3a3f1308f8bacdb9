"""Metric writers: driven directly with scripted logs, read back with independent readers."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import types

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.adapters.writers import CSVWriter, JSONLinesWriter, TensorBoardWriter, TextLogger

NAN = float("nan")


def _logs(epoch: int, loss: float, **extra) -> dict:
    return {"epoch": epoch, "loss": loss, "steps": 4, "steps_per_sec": 1000.0 + epoch,
            "wall_time": 0.004, **extra}  # fmt: skip


# eval_accuracy every other epoch (first at epoch 1), skipped_steps from epoch 2 on, a NaN
# loss at epoch 1 and a value whose shortest repr has many digits.
SCRIPT = [
    _logs(0, 1.5),
    _logs(1, NAN, eval_accuracy=0.5),
    _logs(2, 0.1 + 0.2, skipped_steps=1),
    _logs(3, 0.125, eval_accuracy=0.75, skipped_steps=0),
]
COLUMNS = ["epoch", "loss", "steps", "steps_per_sec", "wall_time", "eval_accuracy",
           "skipped_steps"]  # fmt: skip


def _drive(callback, script=SCRIPT, steps_per_epoch: int = 4, after_each=None):
    trainer = types.SimpleNamespace(step=0, epoch=0)
    for logs in script:
        trainer.step += steps_per_epoch
        callback.on_epoch_end(trainer, logs["epoch"], dict(logs))
        trainer.epoch = logs["epoch"] + 1
        if after_each is not None:
            after_each(logs["epoch"])
    if hasattr(callback, "on_train_end"):
        callback.on_train_end(trainer, types.SimpleNamespace(epochs=list(script)))
    return trainer


def _read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def _same(cell: str, value) -> bool:
    if value is None:
        return cell == ""
    return math.isnan(value) if cell == "nan" else float(cell) == value


# -- CSV ------------------------------------------------------------------------------------------


def test_csv_one_row_per_epoch_with_union_of_keys_and_durable_rows(tmp_path):
    path = tmp_path / "sub" / "logs.csv"

    def check_on_disk(epoch):
        # After every epoch the file alone is a complete CSV holding every row so far.
        header, rows = _read_csv(path)
        seen = list(dict.fromkeys(k for logs in SCRIPT[: epoch + 1] for k in logs))
        assert header == seen
        assert len(rows) == epoch + 1
        assert all(None not in row for row in rows), "a row is longer than the header"

    _drive(CSVWriter(path), after_each=check_on_disk)
    header, rows = _read_csv(path)
    assert header == COLUMNS
    assert len(rows) == len(SCRIPT)
    for row, logs in zip(rows, SCRIPT, strict=True):
        for key in COLUMNS:
            assert _same(row[key], logs.get(key)), (key, row[key], logs.get(key))
    assert rows[1]["loss"] == "nan"
    assert rows[0]["eval_accuracy"] == "" and rows[2]["eval_accuracy"] == ""
    assert rows[0]["skipped_steps"] == "" and rows[2]["skipped_steps"] == "1"
    assert not [p for p in path.parent.iterdir() if p.name != "logs.csv"], "temp file left"


def test_csv_replaces_by_default_and_appends_on_request(tmp_path):
    path = tmp_path / "logs.csv"
    path.write_text("old,stuff\n1,2\n")
    _drive(CSVWriter(path), script=SCRIPT[:1])
    header, rows = _read_csv(path)
    assert header == list(SCRIPT[0]) and len(rows) == 1

    _drive(CSVWriter(path, append=True), script=SCRIPT[1:])
    header, rows = _read_csv(path)
    assert header == COLUMNS
    assert [row["epoch"] for row in rows] == ["0", "1", "2", "3"]
    assert rows[0]["eval_accuracy"] == "" and rows[3]["eval_accuracy"] == "0.75"


def test_csv_writer_reused_across_fit_calls_continues_the_file(tmp_path):
    path = tmp_path / "logs.csv"
    writer = CSVWriter(path)
    _drive(writer, script=SCRIPT[:2])
    _drive(writer, script=SCRIPT[2:])
    assert len(_read_csv(path)[1]) == 4


# -- JSON lines -----------------------------------------------------------------------------------


def _strict_loads(line: str) -> dict:
    def reject(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=reject)


def test_jsonl_one_object_per_epoch_with_exactly_its_keys(tmp_path):
    path = tmp_path / "logs.jsonl"
    lines_after = []
    _drive(
        JSONLinesWriter(path),
        script=[*SCRIPT, _logs(4, math.inf), _logs(5, -math.inf)],
        after_each=lambda epoch: lines_after.append(len(path.read_text().splitlines())),
    )
    assert lines_after == [1, 2, 3, 4, 5, 6], "each line is on disk when its epoch ends"
    records = [_strict_loads(line) for line in path.read_text().splitlines()]
    for record, logs in zip(records, SCRIPT, strict=False):
        assert list(record) == list(logs)
        for key, value in logs.items():
            if isinstance(value, float) and math.isnan(value):
                assert record[key] == "NaN"
            else:
                assert record[key] == value and type(record[key]) is type(value)
    assert "eval_accuracy" not in records[0] and "eval_accuracy" not in records[2]
    assert records[4]["loss"] == "Infinity" and records[5]["loss"] == "-Infinity"
    assert math.isnan(float(records[1]["loss"])) and float(records[4]["loss"]) == math.inf


def test_jsonl_replaces_by_default_and_appends_on_request(tmp_path):
    path = tmp_path / "logs.jsonl"
    path.write_text('{"old": 1}\n')
    _drive(JSONLinesWriter(path), script=SCRIPT[:1])
    assert [_strict_loads(s)["epoch"] for s in path.read_text().splitlines()] == [0]
    _drive(JSONLinesWriter(path, append=True), script=SCRIPT[1:])
    assert [_strict_loads(s)["epoch"] for s in path.read_text().splitlines()] == [0, 1, 2, 3]


def _regression() -> dict:
    """A small linear regression's data set (for ``_mse``): the real fits' data."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return {"x": x, "y": (x @ rng.normal(size=(4, 2))).astype(np.float32)}


def _mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def test_a_resumed_run_continues_its_files_as_the_uninterrupted_runs(tmp_path):
    # A run cut after 2 epochs, whose killed process also logged a third past its last
    # checkpoint; resumed (a new process would build new writers) to 4 epochs. The files
    # must hold the uninterrupted run's 4 epochs, the third once and as the resumed run
    # trained it. The reference: one uninterrupted run writing its own files.
    from nnxscan.shell import Trainer

    data = _regression()

    def fit(name, epochs, **options):
        trainer = Trainer(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.adam(1e-2), _mse)
        files = tmp_path / f"{name}.csv", tmp_path / f"{name}.jsonl"
        writers = [CSVWriter(files[0]), JSONLinesWriter(files[1])]
        trainer.fit(data, epochs=epochs, batch_size=16, progress=False, callbacks=writers,
                    **options)  # fmt: skip
        return files

    whole = fit("whole", 4)
    cut = fit("cut", 2, checkpoint_dir=tmp_path / "ckpt")
    with cut[0].open("a") as f:
        f.write("2,9.9,4,1.0,0.1\n")  # logged by the killed process past its checkpoint
    with cut[1].open("a") as f:
        f.write('{"epoch": 2, "loss": 9.9}\n{"epoch": 3, "lo')  # and a torn line
    resumed = fit("cut", 4, checkpoint_dir=tmp_path / "ckpt", resume=True)

    timings = ("steps_per_sec", "wall_time", "compile_time")  # differ between any two runs

    def without_speed(rows):
        return [{k: v for k, v in row.items() if k not in timings} for row in rows]

    assert without_speed(_read_csv(resumed[0])[1]) == without_speed(_read_csv(whole[0])[1])
    lines = [without_speed([_strict_loads(s) for s in f.read_text().splitlines()])
             for f in (resumed[1], whole[1])]  # fmt: skip
    assert lines[0] == lines[1] and [line["epoch"] for line in lines[0]] == [0, 1, 2, 3]


# -- TensorBoard ----------------------------------------------------------------------------------


def _read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    acc = event_accumulator.EventAccumulator(str(logdir))
    acc.Reload()
    return {
        tag: [(event.step, event.value) for event in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def test_tensorboard_scalars_per_numeric_key_at_the_global_step(tmp_path):
    pytest.importorskip("tensorboardX")
    script = [
        _logs(0, 1.5, note="not a number"),
        _logs(1, NAN),
        _logs(2, 0.25, eval_accuracy=0.75),
    ]
    writer = TensorBoardWriter(tmp_path / "tb")
    _drive(writer, script=script, steps_per_epoch=10)
    scalars = _read_scalars(tmp_path / "tb")
    numeric = [k for k in dict.fromkeys(k for logs in script for k in logs) if k != "note"]
    assert set(scalars) == {f"epoch/{k}" for k in numeric}
    steps, losses = zip(*scalars["epoch/loss"], strict=True)
    assert steps == (10, 20, 30)
    assert losses[0] == 1.5 and math.isnan(losses[1]) and losses[2] == 0.25
    assert scalars["epoch/eval_accuracy"] == [(30, 0.75)]
    assert [v for _, v in scalars["epoch/epoch"]] == [0, 1, 2]
    np.testing.assert_allclose(
        [v for _, v in scalars["epoch/steps_per_sec"]], [1000.0, 1001.0, 1002.0]
    )


def test_tensorboard_without_tensorboardx_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"pip install 'nnxscan\[tensorboard\]'"):
        TensorBoardWriter(tmp_path)
    assert not list(tmp_path.iterdir()), "nothing is written before the extra is found"


# -- text -----------------------------------------------------------------------------------------


def test_text_logger_line_format():
    stream = io.StringIO()
    logs = {"epoch": 3, "loss": 0.1234, "eval_accuracy": 0.97, "learning_rate": 1e-4,
            "skipped_steps": 1234, "steps": 100, "steps_per_sec": 12345.4,
            "wall_time": 0.008}  # fmt: skip
    TextLogger(stream).on_epoch_end(None, 3, logs)
    TextLogger(stream).on_epoch_end(None, 4, {"epoch": 4, "loss": NAN, "steps_per_sec": 9.6})
    assert stream.getvalue().splitlines() == [
        "epoch 3  loss 0.1234  eval_accuracy 0.9700  learning_rate 1.000e-04  "
        "skipped_steps 1,234  12,345 steps/s",
        "epoch 4  loss nan  10 steps/s",
    ]


def test_text_logger_line_of_members():
    # Ten members' losses: their spread (computed here by hand), not ten numbers; three
    # members' shown each; a per-class array of one model shown as it is.
    losses = np.arange(10, dtype=np.float64) / 8
    line = TextLogger().format_line({"epoch": 0, "loss": losses}, num_members=10)
    assert line == "epoch 0  loss min 0.0000 median 0.5625 max 1.1250"
    line = TextLogger().format_line({"loss": losses[:3]}, num_members=3)
    assert line == "loss [0.0000 0.1250 0.2500]"
    assert TextLogger().format_line({"hits": losses[:9]}) == (
        "hits [0.0000 0.1250 0.2500 0.3750 0.5000 0.6250 0.7500 0.8750 ...]"
    )


def test_text_logger_every_n_epochs_and_always_the_last(tmp_path, capsys):
    script = [_logs(e, 1.0 / (e + 1)) for e in range(5)]
    _drive(TextLogger(every=2), script=script)  # default: sys.stdout, as captured now
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["epoch 1", "epoch 3", "epoch 4"]

    path = tmp_path / "log.txt"
    _drive(TextLogger(path, every=1), script=script[:2])
    _drive(TextLogger(str(path)), script=script[2:3])
    assert [line.split("  ")[1] for line in path.read_text().splitlines()] == [
        "loss 1.0000",
        "loss 0.5000",
        "loss 0.3333",
    ]
    with pytest.raises(ValueError, match="every"):
        TextLogger(every=0)


# -- end to end with the real Trainer -------------------------------------------------------------


def test_writers_in_a_real_fit(tmp_path):
    from nnxscan.shell import Trainer

    data = _regression()

    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    callbacks = [CSVWriter(tmp_path / "a.csv"), JSONLinesWriter(tmp_path / "a.jsonl")]
    have_tb = _importable("tensorboardX")
    if have_tb:
        callbacks.append(TensorBoardWriter(tmp_path / "tb"))
    history = Trainer(model, optax.adam(1e-2), _mse).fit(
        data, epochs=3, batch_size=8, callbacks=callbacks, progress=False
    )
    _, rows = _read_csv(tmp_path / "a.csv")
    records = [_strict_loads(s) for s in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(rows) == len(records) == 3
    for row, record, logs in zip(rows, records, history.epochs, strict=True):
        assert float(row["loss"]) == logs["loss"] == record["loss"]
        assert int(row["epoch"]) == record["epoch"] == logs["epoch"]
    if have_tb:
        steps = [step for step, _ in _read_scalars(tmp_path / "tb")["epoch/loss"]]
        assert steps == [8, 16, 24]  # 64 examples / batch 8 = 8 steps an epoch


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


# -- what a writer reads of the object training runs ------------------------------------------


class _Subject:
    """A stand-in for the Trainer or Population writers receive: the four plain values
    docs/architecture.md says writers read, and nothing else (any other attribute raises)."""

    ALLOWED = frozenset({"step", "num_members", "seeds", "hyperparams"})

    def __init__(self, num_members: int | None):
        self.step, self.num_members = 0, num_members
        self.seeds = None if num_members is None else list(range(num_members))
        self.hyperparams = None if num_members is None else {"lr": [0.1] * num_members}

    def __getattribute__(self, name: str):
        if name.startswith("__") or name in _Subject.ALLOWED:
            return object.__getattribute__(self, name)
        raise AttributeError(f"a writer read {name!r} of the Trainer")


@pytest.mark.parametrize("members", [None, 2])
def test_writers_read_only_the_step_and_the_members_of_the_trainer(tmp_path, members):
    logs = [_logs(e, 0.5) if members is None else _logs(e, np.array([0.5, 0.25])) for e in (0, 1)]
    writers = [
        CSVWriter(tmp_path / f"{members}.csv"),
        JSONLinesWriter(tmp_path / f"{members}.jsonl"),
        TextLogger(io.StringIO()),
        TensorBoardWriter(tmp_path / f"tb{members}"),
    ]
    for writer in writers:
        subject = _Subject(members)
        if hasattr(writer, "on_train_begin"):
            writer.on_train_begin(subject)
        for entry in logs:
            subject.step += 4
            writer.on_epoch_end(subject, entry["epoch"], dict(entry))
        if hasattr(writer, "on_train_end"):
            writer.on_train_end(subject, types.SimpleNamespace(epochs=logs))


def test_csv_spreads_every_axis_of_a_members_per_class_metric(tmp_path):
    """A population's metric per class, ``(N, C)``, gets a column per member and class,
    ``key/member/class``; its per-member loss ``key/member``; the run's own logs stay one
    column each (the writer names elements by their index, whatever the axes hold)."""
    hits = np.array([[0.25, 0.5, 0.125], [0.75, 0.0, 1.0]], np.float32)  # 2 members, 3 classes
    writer = CSVWriter(tmp_path / "logs.csv")
    _drive(writer, [_logs(0, np.array([1.5, 0.5]), eval_hits=hits)])
    with (tmp_path / "logs.csv").open(newline="") as f:
        (row,) = list(csv.DictReader(f))
    expected = {"epoch": "0", "loss/0": "1.5", "loss/1": "0.5", "steps": "4",
                "steps_per_sec": "1000.0", "wall_time": "0.004"}  # fmt: skip
    expected |= {f"eval_hits/{m}/{c}": str(float(hits[m, c])) for m in range(2) for c in range(3)}
    assert row == expected and list(row) == list(expected)
