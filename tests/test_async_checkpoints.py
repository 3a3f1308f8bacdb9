"""Asynchronous checkpoints: a save returns once the arrays are on the host and is written
in the background; nothing a checkpoint promises is lost (the next save, the end of fit,
a preemption and an exception wait for it); ``checkpoint_async=False`` opts out.

The references: the tree that was saved (read back bitwise), the synchronous checkpointer, and
a fit without checkpoints (bitwise the same model).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.adapters.checkpoint import Checkpointer, all_steps, restore_checkpoint
from nnxscan.shell import LambdaCallback, Trainer

from conftest import MLP, assert_trees_close, make_data, state_arrays, xent

DATA = make_data(64)  # 8 steps an epoch of 8


def test_a_save_returns_before_its_write_and_survives_its_arrays_being_donated(tmp_path):
    """The device buffers of a saved tree may be deleted (donated to the next compiled
    call) as soon as save returns: what lands on disk is what was saved."""
    import jax
    import jax.numpy as jnp

    saved = {"w": np.arange(12.0, dtype=np.float32).reshape(3, 4), "meta": {"step": 5}}
    live = {"w": jnp.asarray(saved["w"]), "meta": {"step": 5}}
    with Checkpointer(tmp_path, asynchronous=True) as checkpointer:
        path = checkpointer.save(5, live)
        live["w"].delete()  # what donating it to the next call does
        assert checkpointer.latest_step() == 5  # waits for the write in flight
    like = {"w": jax.ShapeDtypeStruct((3, 4), np.float32), "meta": {"step": 0}}
    tree, step = restore_checkpoint(tmp_path, like)
    assert step == 5 and path.name == "5" and tree["meta"]["step"] == 5
    np.testing.assert_array_equal(np.asarray(tree["w"]), saved["w"])


def test_the_next_save_waits_for_the_one_in_flight_and_steps_still_must_increase(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=2) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.save(step, {"x": np.full((2,), step, np.float32)})
        with pytest.raises(ValueError, match="older than the latest checkpoint 3"):
            checkpointer.save(1, {"x": np.zeros((2,), np.float32)})  # deleted by max_to_keep
    assert all_steps(tmp_path) == [2, 3]  # max_to_keep applied once each write finished


# One transform for every Trainer here: the shell caches compiled programs by the
# transform object, so the fits and restores of the same model reuse one compile.
TX = optax.adam(1e-2)


def fit(directory=None, **options):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    history = trainer.fit(DATA, epochs=3, batch_size=8, checkpoint_dir=directory,
                          progress=False, **options)  # fmt: skip
    return trainer, history


def test_every_checkpoint_of_a_fit_is_on_disk_when_fit_returns_and_training_is_unchanged(
    tmp_path,
):
    plain, _ = fit()
    trainer, _ = fit(tmp_path, checkpoint_every_steps=3)
    assert_trees_close(trainer.model, plain.model, exact=True)  # saves change no bit
    # Epoch ends (8, 16, 24) and step saves (every 3 steps at call boundaries); max 3 kept.
    assert all_steps(tmp_path)[-1] == 24
    resumed = Trainer(MLP(rngs=nnx.Rngs(5)), TX, xent)
    assert resumed.restore(tmp_path) == 3
    assert_trees_close(resumed.model, plain.model, exact=True)


def test_an_exception_after_a_save_waits_for_it_before_it_leaves_fit(tmp_path):
    class Boom(Exception):
        pass

    def explode(trainer, epoch):
        if epoch == 2:
            raise Boom

    with pytest.raises(Boom):
        fit(tmp_path, callbacks=[LambdaCallback(on_epoch_begin=explode)])
    # Epoch 1's checkpoint was written in the background; it is whole, and the newest.
    assert all_steps(tmp_path) == [8, 16]
    trainer = Trainer(MLP(rngs=nnx.Rngs(5)), TX, xent)
    assert trainer.restore(tmp_path) == 2


def test_checkpoint_async_false_makes_each_save_durable_before_training_goes_on(tmp_path):
    seen = []

    def look(trainer, epoch):  # the previous epoch's save is on disk already
        seen.append(all_steps(tmp_path))

    trainer, _ = fit(tmp_path, checkpoint_async=False,
                     callbacks=[LambdaCallback(on_epoch_begin=look)])  # fmt: skip
    assert seen == [[], [8], [8, 16]]
    plain, _ = fit()
    for a, b in zip(state_arrays(trainer.model), state_arrays(plain.model), strict=True):
        np.testing.assert_array_equal(a, b)


# -- the save thread's queue: several saves, one wait for the disk --------------------------


def _gated_writes(monkeypatch):
    """Holds the save thread's batches until ``gate`` is set (``taken`` is set once the
    save thread holds its first one); records each batch's steps and whether each carried
    the state/ item."""
    import threading

    from nnxscan.adapters import _checkpoint_files

    taken, gate, batches = threading.Event(), threading.Event(), []
    real = _checkpoint_files.write_many

    def write_many(path, saves, **options):
        batches.append([(save[0], save[4] is not None) for save in saves])
        taken.set()
        assert gate.wait(timeout=60)
        return real(path, saves, **options)

    monkeypatch.setattr(_checkpoint_files, "write_many", write_many)
    return taken, gate, batches


def _save_first(checkpointer, taken) -> None:
    """Saves step 1 and returns once the save thread holds it: later saves queue behind it."""
    checkpointer.save(1, _tree(1))
    assert taken.wait(timeout=60)


def _tree(step: int) -> dict:
    import jax.numpy as jnp

    return {"state": {"w": jnp.full((3,), float(step))}, "meta": {"step": step}}


def test_saves_queued_behind_a_slow_write_are_written_together_and_in_order(tmp_path, monkeypatch):
    """Reference: each save's tree, read back bitwise; the run log's bytes, in order."""
    import jax

    taken, gate, batches = _gated_writes(monkeypatch)
    like = {"state": {"w": jax.ShapeDtypeStruct((3,), np.float32)}, "meta": {"step": 0}}
    with Checkpointer(tmp_path, max_to_keep=5) as checkpointer:
        checkpointer.append_log(b"line 1\n")
        _save_first(checkpointer, taken)
        for step in (2, 3):  # queued behind 1: neither waits
            checkpointer.append_log(b"line %d\n" % step)
            checkpointer.save(step, _tree(step))
        assert checkpointer.newest_step() == 3 and all_steps(tmp_path) == []
        gate.set()
        checkpointer.wait()
        assert all_steps(tmp_path) == [1, 2, 3]
    assert [[s for s, _ in batch] for batch in batches] == [[1], [2, 3]]
    for step in (1, 2, 3):
        tree, _ = restore_checkpoint(tmp_path, like, step=step)
        np.testing.assert_array_equal(tree["state"]["w"], np.full((3,), float(step)))
    assert (tmp_path / "history.jsonl").read_bytes() == b"line 1\nline 2\nline 3\n"


def test_queued_saves_that_max_to_keep_would_delete_at_once_are_not_written(tmp_path, monkeypatch):
    """With max_to_keep=1, of saves 2 and 3 queued together only 3 is written; the run log
    still holds every save's bytes. Reference: the same saves written synchronously."""
    taken, gate, batches = _gated_writes(monkeypatch)
    with Checkpointer(tmp_path / "queued", max_to_keep=1) as checkpointer:
        checkpointer.append_log(b"line 1\n")
        _save_first(checkpointer, taken)
        for step in (2, 3):
            checkpointer.append_log(b"line %d\n" % step)
            checkpointer.save(step, _tree(step))
        gate.set()
    with Checkpointer(tmp_path / "sync", max_to_keep=1, asynchronous=False) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.append_log(b"line %d\n" % step)
            checkpointer.save(step, _tree(step))
    for name in ("queued", "sync"):
        assert all_steps(tmp_path / name) == [3]
        assert (tmp_path / name / "history.jsonl").read_bytes() == b"line 1\nline 2\nline 3\n"
        assert sorted(p.name for p in (tmp_path / name / "3").iterdir()) == [
            "arrays.bin", "manifest.json", "state"
        ]  # fmt: skip
    a, b = (tmp_path / "queued" / "3" / "arrays.bin"), (tmp_path / "sync" / "3" / "arrays.bin")
    assert a.read_bytes() == b.read_bytes()
    # 2 was never written (the synchronous checkpointer wrote each, then deleted it).
    assert [[s for s, _ in batch] for batch in batches] == [[1], [3], [1], [2], [3]]


def test_the_newest_save_still_queued_at_close_gets_its_state_item_in_the_same_write(
    tmp_path, monkeypatch
):
    """The state/ item goes into the queued newest checkpoint before its rename (not added
    afterwards); Flax's own restore of it is what was saved."""
    import jax
    import orbax.checkpoint as ocp

    from nnxscan.adapters import _checkpoint_files

    taken, gate, batches = _gated_writes(monkeypatch)
    added = []
    monkeypatch.setattr(_checkpoint_files, "add_item", lambda *args: added.append(args))
    checkpointer = Checkpointer(tmp_path)
    _save_first(checkpointer, taken)
    checkpointer.save(2, _tree(2))
    gate.set()
    checkpointer.close()
    assert batches == [[(1, False)], [(2, True)]] and added == []
    assert not (tmp_path / "1" / "state").exists()
    abstract = {"w": jax.ShapeDtypeStruct((3,), np.float32)}
    restored = ocp.StandardCheckpointer().restore(tmp_path.resolve() / "2" / "state", abstract)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((3,), 2.0))


def test_a_full_disk_while_a_queued_item_is_written_keeps_the_checkpoint_whole(
    tmp_path, monkeypatch
):
    import errno

    from nnxscan.adapters import _orbax_item

    taken, gate, _ = _gated_writes(monkeypatch)
    real = _orbax_item.write_item

    def disk_full(path, *args):
        finish = real(path, *args)

        def failed():
            finish()
            raise ValueError(f"RESOURCE_EXHAUSTED: \"{path}\": No space left [os_error_code='28']")

        return failed

    monkeypatch.setattr(_orbax_item, "write_item", disk_full)
    checkpointer = Checkpointer(tmp_path)
    _save_first(checkpointer, taken)
    checkpointer.save(2, _tree(2))
    gate.set()
    with pytest.raises(OSError, match=r"the state/ item of checkpoint 2 was not written \(the "
                       r"checkpoint is whole without it\)") as error:  # fmt: skip
        checkpointer.close()
    assert error.value.errno == errno.ENOSPC
    assert all_steps(tmp_path) == [1, 2]
    assert sorted(p.name for p in (tmp_path / "2").iterdir()) == ["arrays.bin", "manifest.json"]
    tree, _ = restore_checkpoint(tmp_path, _tree(0))
    np.testing.assert_array_equal(np.asarray(tree["state"]["w"]), np.full((3,), 2.0))


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_saves_of_a_checkpointer_never_closed_are_written_before_the_process_exits(tmp_path):
    """Reference: the saved arrays, read back bitwise in this process."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        from nnxscan.adapters.checkpoint import Checkpointer

        checkpointer = Checkpointer(sys.argv[1], max_to_keep=5)
        for step in (1, 2, 3):
            checkpointer.save(step, {"w": np.arange(1000.0) + step})
        """
    )  # and no close()
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert all_steps(tmp_path) == [1, 2, 3]
    for step in (1, 2, 3):
        tree, _ = restore_checkpoint(tmp_path, {"w": np.zeros(1000)}, step=step)
        np.testing.assert_array_equal(tree["w"], np.arange(1000.0) + step)
