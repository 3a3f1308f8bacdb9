"""What a checkpoint directory holds besides the checkpoints, against what a user or a
killed run leaves there: a lock file that is a link, a lock a forked worker inherited, a
step folder that is a link, a disk that fills up.

The references are independent of the code under test: a snapshot of every file (and link)
taken before the call, the same fit on a clean directory, the files a run never touched.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.adapters.checkpoint import (
    Checkpointer,
    CheckpointLockedError,
    all_steps,
    save_checkpoint,
)
from nnxscan.shell import Trainer

from conftest import MLP, make_data, state_arrays, xent

DATA = make_data(32)
BATCH = 8  # 4 steps an epoch
TX = optax.sgd(0.1)


def new_trainer() -> Trainer:
    return Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)


def fit(trainer: Trainer, directory: pathlib.Path, epochs: int = 1, **options):
    return trainer.fit(DATA, epochs=epochs, batch_size=BATCH, seed=0, checkpoint_dir=directory,
                progress=False, **options)  # fmt: skip


def snapshot(root: pathlib.Path) -> dict[str, tuple]:
    """Every entry under ``root``, links not followed: a link's target, a file's bytes."""
    out = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            entry = pathlib.Path(folder, name)
            key = str(entry.relative_to(root))
            if entry.is_symlink():
                out[key] = ("link", os.readlink(entry))
            elif entry.is_dir():
                out[key] = ("dir",)
            elif not entry.is_file():  # a fifo: never opened (that would block)
                out[key] = ("other", entry.lstat().st_mode)
            else:
                out[key] = ("file", entry.read_bytes())
    return out


def assert_untouched(trainer: Trainer, before: list) -> None:
    for a, b in zip(state_arrays(trainer.model), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (trainer.epoch, trainer.step) == (0, 0)


# -- item 4: the lock file is never followed through a link -----------------------------------


@pytest.mark.parametrize("kind", ["link_to_a_file", "dangling_link", "link_to_a_folder",
                                  "hard_link", "fifo"])  # fmt: skip
def test_a_lock_file_that_is_a_link_is_refused_and_nothing_is_written_through_it(
    tmp_path, kind, compile_count
):
    directory, outside = tmp_path / "run", tmp_path / "outside"
    directory.mkdir()
    outside.mkdir()
    users_file = outside / "notes.txt"
    users_file.write_text("the user's own file\n")
    lock = directory / ".nnxscan-lock"
    if kind == "link_to_a_file":
        lock.symlink_to(users_file)
    elif kind == "dangling_link":
        lock.symlink_to(outside / "created_by_nobody")
    elif kind == "link_to_a_folder":
        lock.symlink_to(outside)
    elif kind == "hard_link":
        os.link(users_file, lock)
    else:
        os.mkfifo(lock)
    before = snapshot(tmp_path)
    trainer = new_trainer()
    model_before = state_arrays(trainer.model)
    compiles = compile_count()
    what = {"hard_link": "a hard link", "fifo": "not a regular file"}.get(kind, "a symbolic link")
    with pytest.raises(ValueError, match=rf"lock file {lock} is {what}"):
        fit(trainer, directory)
    assert compile_count() == compiles  # refused before anything compiled
    assert_untouched(trainer, model_before)
    with pytest.raises(ValueError, match=rf"lock file {lock} is {what}"):
        save_checkpoint(directory, 0, {"meta": {"step": 0}})
    assert snapshot(tmp_path) == before  # nothing written, created or removed anywhere
    lock.unlink()  # what the error says to do
    fit(trainer, directory)
    assert all_steps(directory) == [4]
    assert snapshot(outside) == {k[len("outside/") :]: v for k, v in before.items()
                                 if k.startswith("outside/")}  # fmt: skip


# -- item 5: a forked child of a killed run --------------------------------------------------

# The run: takes the directory's lock, starts a worker, reports both pids, then waits to be
# killed. "fork": as a multiprocessing data loader's workers are started (Python's fork
# hooks run); "libc": fork() called from C (a native library's workers; no Python hook runs).
_RUN_WITH_A_WORKER = textwrap.dedent(
    """
    import ctypes, multiprocessing, os, sys, time
    from nnxscan.adapters.checkpoint import Checkpointer

    checkpointer = Checkpointer(sys.argv[1])
    checkpointer.lock()
    if sys.argv[2] == "fork":
        worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
        worker.start()
        child = worker.pid
    else:
        child = ctypes.PyDLL(None).fork()
        if child == 0:
            time.sleep(600)
            os._exit(0)
    print(os.getpid(), child, flush=True)
    time.sleep(600)
    """
)


def _start_run_with_a_worker(directory: pathlib.Path, how: str) -> tuple[int, int]:
    run = subprocess.Popen(
        [sys.executable, "-c", _RUN_WITH_A_WORKER, str(directory), how],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    try:
        parent, child = map(int, run.stdout.readline().split())
    except BaseException:
        run.kill()
        raise
    run.kill()  # SIGKILL: the run dies, its worker lives on
    run.wait(timeout=60)
    assert parent == run.pid
    return parent, child


@pytest.mark.slow  # another Python process and its worker
def test_a_worker_forked_by_a_killed_run_does_not_keep_the_directory_locked(tmp_path):
    directory = tmp_path / "run"
    _, child = _start_run_with_a_worker(directory, "fork")
    try:
        os.kill(child, 0)  # the worker is alive...
        trainer = new_trainer()
        fit(trainer, directory)  # ...and the directory is free: the next run trains
        assert all_steps(directory) == [4]
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.slow  # another Python process and its worker
def test_a_lock_kept_by_a_child_of_a_killed_run_names_that_child(tmp_path):
    """A child forked outside Python (no at-fork hook) keeps its copy of the lock: the error
    names the live process that holds it, and says the recorded one has ended."""
    directory = tmp_path / "run"
    parent, child = _start_run_with_a_worker(directory, "libc")
    try:
        trainer = new_trainer()
        before = state_arrays(trainer.model)
        with pytest.raises(CheckpointLockedError) as error:
            fit(trainer, directory)
        message = str(error.value)
        assert f"held by process {child} (" in message
        assert f"names process {parent}, which has ended" in message
        assert_untouched(trainer, before)
    finally:
        os.kill(child, signal.SIGKILL)
    for _ in range(600):  # the kernel drops the lock once the child is reaped by init
        try:
            with Checkpointer(directory) as checkpointer:
                checkpointer.lock()
            break
        except CheckpointLockedError:
            time.sleep(0.05)
    fit(new_trainer(), directory)
    assert all_steps(directory) == [4]


# -- item 6: a step folder that is a symbolic link --------------------------------------------


def test_an_old_step_folder_that_is_a_link_is_removed_as_a_link(tmp_path):
    """A user keeps checkpoint 4 elsewhere and links it into the run's directory; the run
    resumed to 5 epochs deletes the link (max_to_keep=3), never what it points to, loses no
    save and leaves nothing behind: the same as the same resume on a directory of its own."""
    directory, reference, kept = tmp_path / "run", tmp_path / "reference", tmp_path / "kept"
    for where in (directory, reference):
        fit(new_trainer(), where)
    (directory / "4").rename(kept)
    (directory / "4").symlink_to(kept)
    kept_before = snapshot(kept)

    resumed, straight = new_trainer(), new_trainer()
    history = fit(resumed, directory, epochs=5, resume=True)
    want = fit(straight, reference, epochs=5, resume=True)
    assert all_steps(directory) == all_steps(reference) == [12, 16, 20]
    assert sorted(os.listdir(directory)) == sorted(os.listdir(reference))  # no *-deleting
    assert snapshot(kept) == kept_before  # the link's target is whole
    for a, b in zip(state_arrays(resumed.model), state_arrays(straight.model), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(history.losses, want.losses)


def test_replacing_a_step_that_is_a_link_replaces_the_link(tmp_path):
    directory, kept = tmp_path / "run", tmp_path / "kept"
    save_checkpoint(directory, 3, {"meta": {"step": 3}})
    (directory / "3").rename(kept)
    (directory / "3").symlink_to(kept)
    kept_before = snapshot(kept)
    save_checkpoint(directory, 3, {"meta": {"step": 30}}, replace=True)
    assert not (directory / "3").is_symlink() and all_steps(directory) == [3]
    assert snapshot(kept) == kept_before


def test_a_checkpoint_that_cannot_be_deleted_is_named_and_the_new_one_is_kept(
    tmp_path, monkeypatch
):
    import errno
    import shutil

    from nnxscan.adapters import _checkpoint_files

    directory = tmp_path / "run"
    save_checkpoint(directory, 1, {"meta": {"step": 1}})
    real = shutil.rmtree

    def busy(path, *args, **kwargs):
        if pathlib.Path(path).name.startswith("1."):
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(_checkpoint_files.shutil, "rmtree", busy)
    with pytest.raises(OSError, match=rf"could not delete checkpoint 1 of {directory} ") as error:
        save_checkpoint(directory, 2, {"meta": {"step": 2}}, max_to_keep=1)
    assert error.value.errno == errno.EBUSY
    assert error.value.filename == str(directory / "1")
    assert all_steps(directory) == [2]  # the due save is on disk
    monkeypatch.undo()
    save_checkpoint(directory, 3, {"meta": {"step": 3}}, max_to_keep=1)  # cleans up after
    assert sorted(os.listdir(directory)) == [".nnxscan-lock", "3"]


def test_orbax_storage_removes_an_old_step_that_is_a_link_as_a_link(tmp_path):
    import jax.numpy as jnp

    directory, kept = tmp_path / "run", tmp_path / "kept"
    save_checkpoint(directory, 1, {"state": {"w": jnp.ones(3)}}, storage="orbax")
    (directory / "1").rename(kept)
    (directory / "1").symlink_to(kept)
    kept_before = snapshot(kept)
    for step in (2, 3, 4):  # max_to_keep=3: the link goes with the save of 4
        save_checkpoint(directory, step, {"state": {"w": jnp.ones(3)}}, storage="orbax")
    assert all_steps(directory) == [2, 3, 4]
    assert sorted(os.listdir(directory)) == [".nnxscan-lock", "2", "3", "4"]
    assert snapshot(kept) == kept_before


# -- item 8: a full disk ----------------------------------------------------------------------

# What tensorstore raises when the disk fills up under the model state's orbax item (seen on
# a 256 KiB tmpfs, the step and hashes aside).
_TENSORSTORE_DISK_FULL = (
    'RESOURCE_EXHAUSTED: Error writing "l1.kernel/.zarray" in OCDBT database at local file '
    '"{item}/": Failed writing: "{item}/d/b67a0dffa00fb59f08b2b3a8c659c4fc.__lock": Failed '
    "to write 21948 bytes to file 4: No space left on device [os_error_code='28']"
)


def test_a_full_disk_while_the_state_item_is_written_is_an_oserror_and_loses_nothing(
    tmp_path, monkeypatch
):
    """The state/ item is written once, for the newest checkpoint, as fit ends: when
    tensorstore fails there as on a full disk, fit raises an OSError (ENOSPC) naming the
    directory and the checkpoint; every checkpoint is whole without it (the ones before
    are the files they were, no state.nnxscan-tmp is left), load_model verifies the newest,
    and the weights are bitwise those of a run never interrupted."""
    import errno

    from nnxscan.adapters import _orbax_item
    from nnxscan.shell import load_model

    directory, reference = tmp_path / "run", tmp_path / "reference"
    fit(new_trainer(), directory, epochs=2)
    before = snapshot(directory)
    assert (directory / "8" / "state").is_dir() and not (directory / "4" / "state").exists()
    real = _orbax_item.write_item

    def disk_full(path, *args):
        finish = real(path, *args)

        def failed():
            finish()
            raise ValueError(_TENSORSTORE_DISK_FULL.format(item=path))

        return failed

    monkeypatch.setattr(_orbax_item, "write_item", disk_full)
    resumed = new_trainer()
    with pytest.raises(OSError, match=rf"No space left on device in checkpoint directory "
                       rf"{directory}: the state/ item of checkpoint 16 was not "
                       rf"written \(the checkpoint is whole without it\)") as error:  # fmt: skip
        fit(resumed, directory, epochs=4, resume=True)
    assert error.value.errno == errno.ENOSPC and error.value.filename == str(directory)
    monkeypatch.undo()
    after = snapshot(directory)
    assert all_steps(directory) == [8, 12, 16]
    assert {k: v for k, v in after.items() if k.startswith("8")} == {
        k: v for k, v in before.items() if k.startswith("8")
    }  # checkpoint 8 as it was, its item included
    assert sorted(k for k in after if k.startswith("16")) == [
        "16", "16/arrays.bin", "16/manifest.json"
    ]  # fmt: skip
    straight = new_trainer()
    want = fit(straight, reference, epochs=4)
    for a, b in zip(state_arrays(resumed.model), state_arrays(straight.model), strict=True):
        np.testing.assert_array_equal(a, b)
    loaded = load_model(directory, nnx.eval_shape(lambda: MLP(rngs=nnx.Rngs(0))))
    for a, b in zip(state_arrays(loaded), state_arrays(straight.model), strict=True):
        np.testing.assert_array_equal(a, b)
    history = fit(new_trainer(), directory, epochs=4, resume=True)  # nothing left to train
    np.testing.assert_array_equal(history.losses, want.losses)


_FILL_A_TINY_DISK = textwrap.dedent(
    """
    import errno, sys
    import numpy as np
    from nnxscan.adapters.checkpoint import all_steps, restore_checkpoint, save_checkpoint

    directory, storage = sys.argv[1], sys.argv[2]
    small = {"state": {"w": np.arange(10, dtype=np.float32)}}
    save_checkpoint(directory, 0, small, storage=storage)
    big = np.random.default_rng(0).normal(size=60_000).astype(np.float32)  # 240 kB
    try:
        save_checkpoint(directory, 1, {"state": {"w": big}}, storage=storage)
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
        assert error.filename == directory and directory in str(error), error
    else:
        raise AssertionError("the save of 240 kB on a 256 kB disk succeeded")
    assert all_steps(directory) == [0]
    import os
    left = sorted(os.listdir(directory))  # no half-written save of either storage is left
    assert left == [".nnxscan-lock", "0"], left
    tree, step = restore_checkpoint(directory, small)
    np.testing.assert_array_equal(tree["state"]["w"], small["state"]["w"])
    print("ok", flush=True)
    """
)


def _can_mount_a_tmpfs() -> bool:
    try:
        done = subprocess.run(["unshare", "-r", "-m", "mount", "-t", "tmpfs", "tmpfs", "/mnt"],
                              capture_output=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@pytest.mark.slow  # another process, on a real (tiny) full disk
@pytest.mark.parametrize("storage", ["auto", "orbax"])
def test_a_really_full_disk_is_an_oserror_with_the_earlier_checkpoint_intact(tmp_path, storage):
    if not _can_mount_a_tmpfs():
        pytest.skip("no user namespace here to mount a tiny tmpfs in (unshare -r -m)")
    mount = tmp_path / "tiny"
    mount.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(_FILL_A_TINY_DISK)
    command = (f"mount -t tmpfs -o size=256k tmpfs {mount} && "
               f"exec {sys.executable} {script} {mount / 'run'} {storage}")  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(["unshare", "-r", "-m", "sh", "-c", command], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
