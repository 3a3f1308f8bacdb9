"""A checkpoint's cost does not grow with the run: the History lives in the run log
(``history.jsonl``) beside the checkpoints, one line appended per save, and a checkpoint
records only where its part of the log ends.

References: a checkpoint of the same model at epoch 10 (its manifest's size), the run's
own History as ``fit`` returned it (what a resume must give back), and a straight run that
was never interrupted (the state, bitwise, and its History).
"""

from __future__ import annotations

import json

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.adapters import _checkpoint_files as files
from nnxscan.adapters.checkpoint import Checkpointer, all_steps, read_log
from nnxscan.shell import History, Trainer
from nnxscan.shell._edges.checkpointing import RunLog
from nnxscan.shell._engine.layout import ONE_MODEL

from conftest import MLP, BNDropout, assert_trees_close, make_data, state_arrays, xent

TX = optax.adam(1e-2)
TINY = make_data(8)  # one step an epoch: many cheap epochs
DATA = make_data(60)  # 7 steps an epoch
BS = 8


def last_manifest(directory) -> bytes:
    return (directory / str(all_steps(directory)[-1]) / files.MANIFEST).read_bytes()


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_the_last_manifest_is_as_large_at_epoch_1000_as_at_epoch_10_and_resume_restores_all(
    tmp_path,
):
    short, long = tmp_path / "short", tmp_path / "long"
    Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent).fit(
        TINY, epochs=10, batch_size=BS, checkpoint_dir=short, checkpoint_every=5, progress=False
    )
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    history = trainer.fit(TINY, epochs=1000, batch_size=BS, checkpoint_dir=long,
                          checkpoint_every=500, progress=False)  # fmt: skip
    # The same model and counters: only the digits of the step and the log's offsets grow
    # (a History inline would add ~150 bytes an epoch: 150 kB here).
    assert abs(len(last_manifest(long)) - len(last_manifest(short))) <= 16
    # The whole History is still there for a resume: bit for bit what fit returned.
    again = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    resumed = again.fit(TINY, epochs=1000, batch_size=BS, checkpoint_dir=long, resume=True,
                        progress=False)  # fmt: skip
    assert again.step == 1000
    np.testing.assert_array_equal(resumed.losses, history.losses)
    assert resumed.epochs == history.epochs


def test_each_save_appends_one_line_of_what_changed(tmp_path):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    history = trainer.fit(DATA, epochs=3, batch_size=BS, checkpoint_dir=tmp_path,
                          checkpoint_every_steps=4, progress=False)  # fmt: skip
    lines = [json.loads(line) for line in (tmp_path / files.LOG).read_text().splitlines()]
    # Saves at the first call boundary at or after steps 4, 8, ..., and at each epoch's end:
    # each line holds the steps trained since the save before, never the ones before.
    assert sum(len(line["losses"]) for line in lines) == 21
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(line["losses"], np.float32) for line in lines]),
        history.losses,
    )
    assert [logs["epoch"] for line in lines for logs in line["epochs"]] == [0, 1, 2]
    assert max(len(line["losses"]) for line in lines) <= 7


def truncated_by_a_kill(monkeypatch, at: str, calls: int = 3):
    """Makes the ``calls``-th save die like a killed process: half-way through its log
    append, or after the append and before its checkpoint is written."""
    count = [0]
    append, write = files.append_log, files.write_many

    class Killed(BaseException):
        pass

    def dying_append(path, data, **options):
        count[0] += 1
        if at == "mid_append" and count[0] == calls:
            with open(path / files.LOG, "ab") as file:
                file.write(data[: len(data) // 2])
            raise Killed
        return append(path, data, **options)

    def dying_write(path, saves, **options):
        if at == "before_checkpoint" and count[0] == calls - 1:
            (_, _, _, log, _) = saves[-1]  # synchronous saves: one a write
            files.append_log(path, log)  # this save's append (counted), then the kill
            raise Killed
        return write(path, saves, **options)

    monkeypatch.setattr(files, "append_log", dying_append)
    monkeypatch.setattr(files, "write_many", dying_write)
    return Killed


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
@pytest.mark.parametrize(
    "at", [pytest.param("mid_append", marks=pytest.mark.slow), "before_checkpoint"]
)
def test_a_kill_while_the_log_is_written_leaves_a_resumable_directory(tmp_path, monkeypatch, at):
    ref = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
    ref_history = ref.fit(DATA, epochs=3, batch_size=BS, steps_per_call=3, progress=False)

    def run():
        trainer = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
        history = trainer.fit(DATA, epochs=3, batch_size=BS, checkpoint_dir=tmp_path,
                              checkpoint_every_steps=3, resume=True, progress=False,
                              checkpoint_async=False)  # fmt: skip
        return trainer, history

    killed = truncated_by_a_kill(monkeypatch, at)
    with pytest.raises(killed):
        run()
    saved = all_steps(tmp_path)
    assert saved == [3, 6], "two saves finished before the third was killed"
    # The killed save left bytes in the log past the end the newest checkpoint recorded.
    assert (tmp_path / files.LOG).stat().st_size > recorded_end(tmp_path / "6")
    monkeypatch.undo()
    trainer, history = run()  # the same command again
    assert (trainer.step, trainer.epoch) == (21, 3)
    assert_trees_close(trainer.model, ref.model, exact=True)
    # Once more: nothing left to train, the History comes from the log alone.
    done = run()[1]
    for got in (history, done):
        np.testing.assert_allclose(got.losses, ref_history.losses, rtol=1e-6)
        timing = {"wall_time", "steps_per_sec", "compile_time", "loss"}
        assert [{k: v for k, v in e.items() if k not in timing} for e in got.epochs] == [
            {k: v for k, v in e.items() if k not in timing} for e in ref_history.epochs
        ]
    np.testing.assert_array_equal(done.losses, history.losses)
    # What the killed save appended was cut off: the log parses line by line.
    lines = (tmp_path / files.LOG).read_text().splitlines()
    assert all(json.loads(line) for line in lines)


def recorded_end(checkpoint) -> int:
    manifest = json.loads((checkpoint / files.MANIFEST).read_text())
    (run,) = [leaf["value"] for leaf in manifest["leaves"] if leaf["path"] == "['meta']['run']"]
    return json.loads(run)["end"]


def test_a_missing_log_raises_before_anything_changes(tmp_path):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    trainer.fit(DATA, epochs=1, batch_size=BS, checkpoint_dir=tmp_path, progress=False)
    (tmp_path / files.LOG).unlink()
    fresh = Trainer(MLP(rngs=nnx.Rngs(1)), TX, xent)
    before = state_arrays(fresh.model)
    with pytest.raises(ValueError, match=r"history\.jsonl is missing.*without resume=True"):
        fresh.fit(DATA, epochs=2, batch_size=BS, checkpoint_dir=tmp_path, resume=True,
                  progress=False)  # fmt: skip
    assert fresh.step == 0
    for a, b in zip(before, state_arrays(fresh.model), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("storage", ["auto", "orbax"])
def test_the_log_is_on_disk_before_the_checkpoint_that_names_it_in_both_storages(tmp_path, storage):
    history = History()
    log_of = {}
    with Checkpointer(tmp_path, max_to_keep=2, storage=storage) as checkpointer:
        run_log = RunLog(checkpointer)
        for epoch in range(4):
            losses = np.full(3, epoch, np.float32)
            history._append(losses, {"epoch": epoch, "steps": 3, "loss": float(epoch)})
            where = run_log.record(history, np.zeros(0, np.float32))
            checkpointer.save(3 * (epoch + 1), {"meta": {"run": where}})
            log_of[3 * (epoch + 1)] = where
    assert all_steps(tmp_path) == [9, 12]  # max_to_keep deletes checkpoints, never the log
    for step in (9, 12):
        back, partial, where, partial_aux = RunLog.read(tmp_path, log_of[step], ONE_MODEL)
        n = step // 3
        np.testing.assert_array_equal(back.losses, history.losses[: 3 * n])
        assert back.epochs == history.epochs[:n] and partial.size == 0 and partial_aux == {}
    assert read_log(tmp_path, 0, 0) == b""
    with pytest.raises(ValueError, match="holds"):
        read_log(tmp_path, 0, 10**9)
