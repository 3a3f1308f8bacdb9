"""Checkpoints nnxscan can trust: damage is caught, crafted manifests are refused, a damaged
newest checkpoint is skipped, one run per directory, and Flax's own code loads them.

The references are independent of the reader: the model's live arrays at each epoch's end
(copied by a callback while the checkpoints were written), the uninterrupted run, a copy of
the model taken before a call that must fail, and orbax's own ``StandardCheckpointer``.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.adapters import _checkpoint_manifest
from nnxscan.adapters.checkpoint import (
    Checkpointer,
    CheckpointLockedError,
    CorruptCheckpointError,
    all_steps,
    restore_checkpoint,
    save_checkpoint,
)
from nnxscan.adapters.writers import JSONLinesWriter
from nnxscan.shell import LambdaCallback, Trainer, load_model

from conftest import BNDropout, make_data, state_arrays, xent

DATA = make_data(64)
BATCH = 16  # 4 steps an epoch: checkpoints 4, 8 and 12
TX = optax.adam(1e-2)
KERNEL = "['state']['l1']['kernel']"  # (4, 8) float32
MU = "['opt_state'][0].mu['l1']['kernel']"  # Adam's first moment of it, in arrays.bin
KEY = "['state']['drop']['rngs']['key']"  # Dropout's PRNG key


def new_trainer(seed: int = 0) -> Trainer:
    return Trainer(BNDropout(rngs=nnx.Rngs(seed)), TX, xent)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-epoch run with a checkpoint every epoch, resumed after each epoch, and the
    model's arrays at each epoch's end as the training process held them (the reference
    the checkpoints must match)."""
    directory = tmp_path_factory.mktemp("trusted") / "run"
    trainer = new_trainer()
    at_epoch = {}

    def keep(trainer, epoch, logs):
        at_epoch[trainer.step] = state_arrays(trainer.model)

    for epochs in (1, 2, 3):  # three fits: each leaves its newest checkpoint a state/ item
        trainer.fit(DATA, epochs=epochs, batch_size=BATCH, seed=0, checkpoint_dir=directory,
                    callbacks=[LambdaCallback(on_epoch_end=keep)], progress=False,
                    resume=True)  # fmt: skip
    assert all_steps(directory) == [4, 8, 12]
    assert all((directory / str(step) / "state").is_dir() for step in (4, 8, 12))
    return directory, at_epoch


@pytest.fixture
def copy(run, tmp_path):
    """A fresh copy of the run's directory to damage."""
    target = tmp_path / "run"
    shutil.copytree(run[0], target)
    (target / ".nnxscan-lock").unlink(missing_ok=True)
    return target


def flip_bit(path: pathlib.Path, byte: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[byte] ^= 1 << bit
    path.write_bytes(bytes(data))


def manifest_of(step_dir: pathlib.Path) -> dict:
    record, checked = _checkpoint_manifest.loads_checked((step_dir / "manifest.json").read_bytes())
    assert checked
    return record


def rewrite_manifest(step_dir: pathlib.Path, edit) -> None:
    """Edits the manifest and writes it back WITH a matching crc32: what a crafted
    checkpoint (someone who read this code) looks like."""
    record = manifest_of(step_dir)
    edit(record)
    (step_dir / "manifest.json").write_bytes(_checkpoint_manifest.dumps_checked(record))


def leaf(record: dict, path: str) -> dict:
    return next(entry for entry in record["leaves"] if entry["path"] == path)


def flip_kernel_bit(step_dir: pathlib.Path) -> None:
    """A low mantissa bit of the kernel's second float, in arrays.bin."""
    record = manifest_of(step_dir)
    kernel = leaf(record, KERNEL)
    byte = record["buffers"][kernel["buffer"]]["offset"] + 4 * (kernel["offset"] + 1)
    flip_bit(step_dir / "arrays.bin", byte, 1)


def assert_untouched(trainer: Trainer, before: list) -> None:
    for a, b in zip(state_arrays(trainer.model), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (trainer.epoch, trainer.step) == (0, 0)


# -- integrity: what was written is what is read, or nothing is ---------------------------------


def test_an_intact_checkpoint_restores_the_arrays_training_held(run, tmp_path):
    directory, at_epoch = run
    trainer = new_trainer(seed=7)
    assert trainer.restore(directory, step=8) == 2
    for got, want in zip(state_arrays(trainer.model), at_epoch[8], strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "damage",
    ["weight_mantissa_bit", "every_7th_byte_of_arrays_bin", "truncated_arrays_bin",
     "manifest_bit", "truncated_manifest", "deleted_manifest", "emptied_step_dir",
     "deleted_arrays_bin"],
)  # fmt: skip
def test_damage_is_refused_naming_the_checkpoint_and_changes_nothing(copy, damage):
    step = copy / "12"
    if damage == "weight_mantissa_bit":
        flip_kernel_bit(step)
    elif damage == "every_7th_byte_of_arrays_bin":
        data = bytearray((step / "arrays.bin").read_bytes())
        for i in range(0, len(data), 7):
            data[i] ^= 0xFF
        (step / "arrays.bin").write_bytes(bytes(data))
    elif damage == "truncated_arrays_bin":
        (step / "arrays.bin").write_bytes((step / "arrays.bin").read_bytes()[:40])
    elif damage == "manifest_bit":
        flip_bit(step / "manifest.json", 300, 1)
    elif damage == "truncated_manifest":
        (step / "manifest.json").write_bytes((step / "manifest.json").read_bytes()[:1366])
    elif damage == "deleted_manifest":
        (step / "manifest.json").unlink()
    elif damage == "emptied_step_dir":
        shutil.rmtree(step)
        step.mkdir()
    elif damage == "deleted_arrays_bin":
        (step / "arrays.bin").unlink()
    trainer = new_trainer(seed=7)
    before = state_arrays(trainer.model)
    with pytest.raises(CorruptCheckpointError, match=rf"{copy} step 12"):
        trainer.restore(copy, step=12)
    assert_untouched(trainer, before)


def test_every_buffer_and_the_manifest_carry_a_crc32_of_their_bytes(run):
    import zlib

    step = run[0] / "12"
    record = manifest_of(step)
    assert record["version"] == 6 and record["buffers"]
    data = (step / "arrays.bin").read_bytes()
    for entry in record["buffers"].values():
        nbytes = entry["size"] * np.dtype(jax.numpy.dtype(entry["dtype"])).itemsize
        piece = data[entry["offset"] : entry["offset"] + nbytes]
        assert f"{zlib.crc32(piece):08x}" == entry["crc32"]


# -- crafted manifests: validated whole, before anything is read or written ---------------------


def _set_leaf(path: str, **fields):
    return lambda record: leaf(record, path).update(fields)


def _set_buffer(**fields):
    """Edits the first buffer of arrays.bin."""

    def edit(record):
        next(iter(record["buffers"].values())).update(fields)

    return edit


def _listed_twice(record):
    record["leaves"].append(dict(leaf(record, KERNEL)))


CRAFTED = {
    "transposed_data_shape": (_set_leaf(KERNEL, data_shape=[8, 4]), "data_shape"),
    "negative_data_shape": (_set_leaf(KERNEL, data_shape=[-1]), "data_shape"),
    "huge_data_shape": (_set_leaf(KERNEL, data_shape=[10**9, 10**9]), "data_shape"),
    "negative_leaf_offset": (_set_leaf(MU, offset=-40), "offset"),
    "leaf_offset_past_its_buffer": (_set_leaf(MU, offset=10**6), "outside buffer"),
    "negative_buffer_offset": (_set_buffer(offset=-64), "byte offset"),
    "huge_buffer": (_set_buffer(size=10**12), "which holds"),
    "object_dtype_leaf": (_set_leaf(KERNEL, dtype="object"), "dtype 'object'"),
    "object_dtype_buffer": (_set_buffer(dtype="object"), "dtype 'object'"),
    "buffer_file_outside": (_set_buffer(file="../../x"), "not the checkpoint's arrays.bin"),
    "buffer_file_absolute": (_set_buffer(file="/etc/passwd"), "not the checkpoint's arrays"),
    "leaf_names_a_missing_buffer": (_set_leaf(KERNEL, buffer="../../x"), "not among"),
    "unknown_version": (lambda r: r.update(version=99), "newer than this nnxscan"),
    "other_format": (lambda r: r.update(format="pickle"), "not written by nnxscan"),
    "unknown_kind": (_set_leaf(KERNEL, kind="pickle"), "kind 'pickle'"),
    "unknown_key_impl": (_set_leaf(KEY, impl="evil"), "PRNG implementation"),
    "counter_of_another_type": (_set_leaf("['meta']['epoch']", value="3"), "not a Python int"),
    "negative_epoch": (_set_leaf("['meta']['epoch']", value=-5), r"\['epoch'\] is -5"),
    "negative_step": (_set_leaf("['meta']['step']", value=-5), r"\['step'\] is -5"),
    "leaf_listed_twice": (_listed_twice, "listed twice"),
    "leaf_offset_inside_another_leaf": (
        lambda r: leaf(r, MU).update(offset=leaf(r, KERNEL)["offset"] + 1),
        "overlap",
    ),
    "wrong_crc": (_set_buffer(crc32="00000000"), "crc32"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_manifest_is_refused_before_anything_changes(copy, case, tmp_path):
    edit, message = CRAFTED[case]
    rewrite_manifest(copy / "12", edit)
    trainer = new_trainer(seed=7)
    before = state_arrays(trainer.model)
    with pytest.raises(CorruptCheckpointError, match=message) as error:
        trainer.restore(copy, step=12)
    if case != "unknown_version":
        assert f"{copy} step 12" in str(error.value)
    assert_untouched(trainer, before)
    assert not (tmp_path.parent / "x").exists() and not (copy.parent / "x").exists()


def test_a_sharded_storage_manifest_whose_leaf_overlaps_another_is_refused(tmp_path):
    """orbax's storage (what sharded arrays are written through) validates its manifest by
    the same rules: a crafted element offset inside another leaf's elements loaded that
    leaf's values silently before. Reference: the arrays saved."""
    model = BNDropout(rngs=nnx.Rngs(3))
    save_checkpoint(tmp_path, 5, {"state": nnx.state(model)}, storage="orbax")
    metadata = tmp_path / "5" / "manifest" / "metadata"
    record = json.loads(metadata.read_text())
    kernel, bias = (leaf(record, f"['state']['{n}']") for n in ("l1']['kernel", "l2']['bias"))
    assert kernel["buffer"] == bias["buffer"]
    bias["offset"] = kernel["offset"] + 1
    del record["crc32"]  # crafted: written back with a matching crc32
    metadata.write_bytes(_checkpoint_manifest.dumps_checked(record))
    like = {"state": nnx.split(nnx.eval_shape(lambda: BNDropout(rngs=nnx.Rngs(0))))[1]}
    bias_path, kernel_path = (re.escape(str(p)) for p in (bias["path"], kernel["path"]))
    overlap = rf"step 5: leaf {bias_path}: its elements .* overlap those of leaf {kernel_path}"
    with pytest.raises(CorruptCheckpointError, match=overlap):
        restore_checkpoint(tmp_path, like)


def test_a_checkpoint_without_checksums_from_an_older_nnxscan_still_restores(copy, run):
    """Version 3 wrote no crc32s: its checkpoints are read (unchecked), not refused."""

    def as_version_3(record):
        record["version"] = 3
        for entry in record["buffers"].values():
            del entry["crc32"]

    rewrite_manifest(copy / "8", as_version_3)
    text = json.dumps(manifest_of(copy / "8"))  # v3 manifests are plain JSON
    (copy / "8" / "manifest.json").write_text(text)
    trainer = new_trainer(seed=7)
    trainer.restore(copy, step=8)
    for got, want in zip(state_arrays(trainer.model), run[1][8], strict=True):
        np.testing.assert_array_equal(got, want)


# -- fallback: the newest GOOD checkpoint ------------------------------------------------------


def test_restore_without_a_step_skips_a_damaged_newest_one_and_warns(copy, run):
    flip_kernel_bit(copy / "12")
    trainer = new_trainer(seed=7)
    with pytest.warns(UserWarning, match=r"skipped checkpoint 12 .* restored 8.*crc32"):
        assert trainer.restore(copy) == 2
    for got, want in zip(state_arrays(trainer.model), run[1][8], strict=True):
        np.testing.assert_array_equal(got, want)
    assert all_steps(copy) == [4, 8, 12]  # restore() only reads: nothing moved or deleted


def as_orbax_storage(directory: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """The run's checkpoints written again through orbax (``storage="orbax"``, what arrays
    sharded over devices are written through), with its run log: the same trees, read by
    the other storage's reader."""
    like = new_trainer()._owner.checkpoint_tree()
    for step in all_steps(directory):
        tree, _ = restore_checkpoint(directory, like, step=step)
        save_checkpoint(target, step, tree, storage="orbax")
    shutil.copy(directory / "history.jsonl", target / "history.jsonl")
    return target


@pytest.mark.parametrize("storage", ["files", "orbax"])
def test_each_damage_message_gives_advice_only_where_it_is_true(copy, tmp_path, storage):
    """Skipped for an older one: the warning says so and advises nothing. Asked for by step:
    the error says how to get the newest good one instead. Read through the adapter: the
    advice names its own call, as a note (newest_good quotes the message of what it skips).
    In both storages: a flipped bit in the own files' arrays.bin; orbax's ``arrays/`` item
    gone (what orbax cannot read)."""
    if storage == "files":
        flip_kernel_bit(copy / "12")
        damage = "crc32"
    else:
        copy = as_orbax_storage(copy, tmp_path / "orbax")
        shutil.rmtree(copy / "12" / "arrays")
        damage = "(orbax's item) cannot be read"
    with pytest.warns(UserWarning) as warned:
        new_trainer(seed=7).restore(copy)
    (message,) = [str(w.message) for w in warned if "skipped" in str(w.message)]
    assert "restored 8, the newest good one" in message and damage in message
    assert "Restore another" not in message and "skip a damaged" not in message
    for call, fallback in [
        (lambda t: t.restore(copy, step=12), "restore() without step="),
        (lambda t: t.fit(DATA, epochs=3, batch_size=BATCH, checkpoint_dir=copy, resume=12,
                         progress=False), "fit(resume=True)"),
    ]:  # fmt: skip
        with pytest.raises(CorruptCheckpointError) as raised:
            call(new_trainer(seed=7))
        text = str(raised.value)
        assert text.startswith(f"checkpoint {copy.resolve()} step 12") and damage in text
        assert text.count("Restore another") == 1 and "skip a damaged" not in text
        assert text.endswith(
            f"Restore another checkpoint: {fallback} skips a damaged one and restores the "
            f"newest good one."
        )
    like = {"state": nnx.state(new_trainer().model)}
    with pytest.raises(CorruptCheckpointError) as raised:
        restore_checkpoint(copy, like, step=12)
    assert "Restore another" not in str(raised.value)
    assert (
        "fallback=True" in raised.value.__notes__[0] and "all_steps(" in raised.value.__notes__[0]
    )
    with pytest.raises(CorruptCheckpointError) as raised:
        restore_checkpoint(copy, like)  # the newest, without fallback
    assert raised.value.__notes__[0].startswith(
        "restore_checkpoint(directory, like, fallback=True)"
    )
    with pytest.warns(UserWarning, match="skipped checkpoint 12"):
        assert restore_checkpoint(copy, like, fallback=True)[1] == 8


def test_resume_skips_a_damaged_newest_checkpoint_and_ends_as_the_uninterrupted_run(copy, run):
    flip_kernel_bit(copy / "12")
    trainer = new_trainer(seed=7)
    with pytest.warns(UserWarning, match="skipped checkpoint 12"):
        history = trainer.fit(DATA, epochs=3, batch_size=BATCH, checkpoint_dir=copy,
                              resume=True, progress=False)  # fmt: skip
    assert (trainer.epoch, trainer.step) == (3, 12)
    for got, want in zip(state_arrays(trainer.model), run[1][12], strict=True):
        np.testing.assert_array_equal(got, want)  # the same program on the same inputs
    assert len(history.epochs) == 3 and len(history.losses) == 12
    assert all_steps(copy) == [4, 8, 12]  # 12 anew; the damaged one kept aside:
    assert (copy / "12.nnxscan-corrupt" / "manifest.json").is_file()


def test_resume_from_a_chosen_step_moves_newer_checkpoints_aside(copy, run):
    trainer = new_trainer(seed=7)
    with pytest.warns(UserWarning, match="moved aside to 12.nnxscan-superseded"):
        trainer.fit(DATA, epochs=3, batch_size=BATCH, checkpoint_dir=copy, resume=4,
                    progress=False)  # fmt: skip
    for got, want in zip(state_arrays(trainer.model), run[1][12], strict=True):
        np.testing.assert_array_equal(got, want)
    assert all_steps(copy) == [4, 8, 12]
    assert sorted(p.name for p in copy.glob("*.nnxscan-superseded")) == [
        "12.nnxscan-superseded", "8.nnxscan-superseded"]  # fmt: skip


def test_when_every_checkpoint_is_damaged_nothing_changes(copy):
    for step in (4, 8, 12):
        flip_kernel_bit(copy / str(step))
    trainer = new_trainer(seed=7)
    before = state_arrays(trainer.model)
    with pytest.raises(CorruptCheckpointError, match=r"every checkpoint .* \[4, 8, 12\]"):
        trainer.fit(DATA, epochs=3, batch_size=BATCH, checkpoint_dir=copy, resume=True,
                    progress=False)  # fmt: skip
    assert_untouched(trainer, before)
    assert all_steps(copy) == [4, 8, 12]


# -- the run log: torn or interleaved lines ----------------------------------------------------


def _log_range(step_dir: pathlib.Path) -> tuple[int, int]:
    run = json.loads(leaf(manifest_of(step_dir), "['meta']['run']")["value"])
    return run["start"], run["end"]


@pytest.mark.parametrize("how", ["torn", "interleaved"])
def test_a_damaged_run_log_falls_back_to_the_checkpoint_whose_lines_are_whole(copy, run, how):
    log = copy / "history.jsonl"
    raw = log.read_bytes()
    lines = raw.splitlines(keepends=True)
    assert len(lines) == 3  # one line a save
    if how == "torn":  # the last line cut short, and a line of another run after it
        log.write_bytes(b"".join(lines[:2]) + lines[2][:20] + b'{"losses": []}\n')
    else:  # another run's line (whole, its crc right) where this run's third line was
        log.write_bytes(b"".join(lines[:2]) + lines[1] + lines[2])
    trainer = new_trainer(seed=7)
    with pytest.warns(UserWarning, match=r"skipped checkpoint 12 .*run log"):
        history = trainer.fit(DATA, epochs=3, batch_size=BATCH, checkpoint_dir=copy,
                              resume=True, progress=False)  # fmt: skip
    for got, want in zip(state_arrays(trainer.model), run[1][12], strict=True):
        np.testing.assert_array_equal(got, want)
    assert len(history.epochs) == 3
    start, end = _log_range(copy / "12")  # the new checkpoint's lines follow 8's, whole
    assert start == 0 and log.stat().st_size == end


# -- one run per directory --------------------------------------------------------------------


def test_a_second_run_in_a_directory_is_refused_before_it_trains(tmp_path):
    import os

    directory = tmp_path / "busy"
    with Checkpointer(directory) as holder:
        holder.lock()
        trainer = new_trainer()
        before = state_arrays(trainer.model)
        with pytest.raises(CheckpointLockedError, match=rf"{directory} is in use .*{os.getpid()}"):
            trainer.fit(DATA, epochs=1, batch_size=BATCH, checkpoint_dir=directory,
                        progress=False)  # fmt: skip
        assert_untouched(trainer, before)
    trainer.fit(DATA, epochs=1, batch_size=BATCH, checkpoint_dir=directory, progress=False)
    assert all_steps(directory) == [4]  # the lock went with the first run


_HOLD_THE_LOCK = textwrap.dedent(
    """
    import sys
    from nnxscan.adapters.checkpoint import Checkpointer
    checkpointer = Checkpointer(sys.argv[1])
    checkpointer.lock()
    print("locked", flush=True)
    sys.stdin.readline()
    """
)


@pytest.mark.slow  # a second Python process
def test_a_second_process_gets_the_holders_process_id(tmp_path):
    directory = tmp_path / "busy"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_THE_LOCK, str(directory)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        trainer = new_trainer()
        with pytest.raises(CheckpointLockedError, match=rf"process {holder.pid} on "):
            trainer.fit(DATA, epochs=1, batch_size=BATCH, checkpoint_dir=directory,
                        progress=False)  # fmt: skip
    finally:
        holder.communicate("\n", timeout=60)
    trainer.fit(DATA, epochs=1, batch_size=BATCH, checkpoint_dir=directory, progress=False)


# -- checks before training --------------------------------------------------------------------


@pytest.mark.parametrize("where", ["a_file", "under_a_file"])
def test_a_checkpoint_dir_that_cannot_be_a_directory_is_refused_before_compiling(
    tmp_path, where, compile_count
):
    (tmp_path / "a_file").write_text("not a folder")
    directory = tmp_path / "a_file" if where == "a_file" else tmp_path / "a_file" / "run"
    trainer = new_trainer()
    before = state_arrays(trainer.model)
    compiles = compile_count()
    with pytest.raises(ValueError, match="is a file"):
        trainer.fit(DATA, epochs=1, batch_size=BATCH, checkpoint_dir=directory, progress=False)
    assert compile_count() == compiles
    assert_untouched(trainer, before)


# -- the History: exact, or refused ------------------------------------------------------------


def test_logs_of_every_kind_come_back_from_a_resume_as_they_were(tmp_path):
    def log_things(trainer, epoch, logs):
        logs.update(f32=np.float32(0.1 * epoch), i16=np.arange(3, dtype=np.int16) * epoch,
                    bf16=jax.numpy.full((2,), epoch, jax.numpy.bfloat16), pair=(epoch, "a"),
                    nested={"x": [np.float64(epoch), None, True]}, text="s" * epoch,
                    nan=float("nan"))  # fmt: skip

    options = dict(batch_size=BATCH, checkpoint_dir=tmp_path / "run", progress=False,
                   callbacks=[LambdaCallback(on_epoch_end=log_things)])  # fmt: skip
    history = new_trainer().fit(DATA, epochs=2, **options)
    resumed = new_trainer().fit(DATA, epochs=2, resume=True, **options)  # nothing left
    assert len(resumed.epochs) == len(history.epochs) == 2
    for got, want in zip(resumed.epochs, history.epochs, strict=True):
        assert list(got) == list(want)
        for key, value in want.items():
            assert type(got[key]) is type(value), key
            if isinstance(value, np.ndarray | np.generic | jax.Array):
                assert got[key].dtype == value.dtype, key
                np.testing.assert_array_equal(got[key], value, strict=True)
            elif key == "nan":
                assert np.isnan(got[key])
            else:
                assert got[key] == value, key


def test_a_log_the_run_log_cannot_keep_exactly_is_refused_at_the_first_epoch(tmp_path):
    class Tag:
        pass

    def log_a_set(trainer, epoch, logs):
        logs["classes"] = {1, 2}

    trainer = new_trainer()
    with pytest.raises(TypeError, match=r"History.epochs\[0\]\['classes'\] is a set") as error:
        trainer.fit(DATA, epochs=3, batch_size=BATCH, checkpoint_dir=tmp_path / "run",
                    checkpoint_every=5, callbacks=[LambdaCallback(on_epoch_end=log_a_set)],
                    progress=False)  # fmt: skip
    assert trainer.epoch == 1  # refused at the end of the first epoch, not at a later save
    assert len(error.value.history.epochs) == 1
    with pytest.raises(TypeError, match=r"log 'tag' of epoch 0 is a Tag"):
        JSONLinesWriter(tmp_path / "logs.jsonl").on_epoch_end(trainer, 0, {"tag": Tag()})


# -- where Flax users load ---------------------------------------------------------------------


def test_flax_guide_restore_code_loads_the_model_of_an_nnxscan_checkpoint(run):
    """docs_nnx/guides/checkpointing.md, "Restore checkpoints", as written there."""
    import orbax.checkpoint as ocp

    directory, at_epoch = run
    ckpt_dir = directory / "12"
    checkpointer = ocp.StandardCheckpointer()
    abstract_model = nnx.eval_shape(lambda: BNDropout(rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract_model)
    state_restored = checkpointer.restore(ckpt_dir / "state", abstract_state)
    model = nnx.merge(graphdef, state_restored)
    for got, want in zip(state_arrays(model), at_epoch[12], strict=True):
        np.testing.assert_array_equal(got, want)
    key = model.drop.rngs.key[...]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)  # a typed key, as saved


def test_only_the_newest_checkpoint_a_fit_leaves_carries_the_state_item(tmp_path):
    """One state/ item a fit, added to its newest checkpoint as it ends (not one a save):
    Flax's restore of it gives the weights of a fit without checkpoints, bitwise, and the
    older checkpoints, without an item, still load through load_model (verified)."""
    import orbax.checkpoint as ocp

    directory = tmp_path / "run"
    trainer, straight = new_trainer(), new_trainer()
    trainer.fit(DATA, epochs=3, batch_size=BATCH, seed=0, checkpoint_dir=directory,
                progress=False)  # fmt: skip
    straight.fit(DATA, epochs=3, batch_size=BATCH, seed=0, progress=False)
    assert all_steps(directory) == [4, 8, 12]
    assert [(directory / str(s) / "state").exists() for s in (4, 8, 12)] == [0, 0, 1]
    abstract_model = nnx.eval_shape(lambda: BNDropout(rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract_model)
    flax_loaded = ocp.StandardCheckpointer().restore(directory / "12" / "state", abstract_state)
    want = state_arrays(straight.model)
    for got, expected in zip(state_arrays(nnx.merge(graphdef, flax_loaded)), want, strict=True):
        np.testing.assert_array_equal(got, expected)
    older = load_model(directory, abstract_model, step=8)  # no item: arrays.bin, verified
    assert len(state_arrays(older)) == len(want)


def test_load_model_loads_a_fit_whose_checkpoints_orbax_wrote(run, tmp_path, monkeypatch):
    """A fit's checkpoints written through orbax (``storage="orbax"``, what a sharded
    Trainer's are), each with its state/ item: load_model, which reads the model state
    alone, gives the weights the training process held, bitwise. It refused every such
    checkpoint as damaged: the optimizer's int32 counter, left unread, was a packed buffer
    orbax's reader did not name."""
    from nnxscan.adapters import _checkpoint_files
    from nnxscan.shell._edges import checkpointing

    def through_orbax(directory, *, max_to_keep=3, asynchronous=True):
        return Checkpointer(directory, max_to_keep=max_to_keep, asynchronous=asynchronous,
                            storage="orbax")  # fmt: skip

    monkeypatch.setattr(checkpointing, "open_checkpointer", through_orbax)
    directory = tmp_path / "run"
    new_trainer().fit(DATA, epochs=3, batch_size=BATCH, seed=0, checkpoint_dir=directory,
                      progress=False)  # fmt: skip
    assert all_steps(directory) == [4, 8, 12]
    assert {_checkpoint_files.storage_of(directory / str(s)) for s in (4, 8, 12)} == {"orbax"}
    abstract_model = nnx.eval_shape(lambda: BNDropout(rngs=nnx.Rngs(0)))
    for step in (None, 8):
        loaded = load_model(directory, abstract_model, step=step)
        want = run[1][12 if step is None else step]
        for got, expected in zip(state_arrays(loaded), want, strict=True):
            np.testing.assert_array_equal(got, expected, strict=True)


def test_a_kill_while_the_item_is_added_leaves_a_checkpoint_that_loads_and_resumes(copy):
    """What a process killed while close() writes the item leaves: the newest checkpoint
    whole, no state/, a partial state.nnxscan-tmp. load_model verifies and loads it (the
    partial item ignored); a resume trains on from it bitwise as a run never interrupted,
    removes the leftover and gives its own newest checkpoint the item."""
    import orbax.checkpoint as ocp

    newest = copy / "12"
    partial = newest / "state.nnxscan-tmp"
    (newest / "state").rename(partial)
    (partial / "_METADATA").unlink()  # killed before the metadata files were written
    abstract_model = nnx.eval_shape(lambda: BNDropout(rngs=nnx.Rngs(0)))
    straight = new_trainer()
    straight.fit(DATA, epochs=3, batch_size=BATCH, seed=0, progress=False)
    loaded = load_model(copy, abstract_model)  # step 12, no warning
    for got, want in zip(state_arrays(loaded), state_arrays(straight.model), strict=True):
        np.testing.assert_array_equal(got, want)
    resumed = new_trainer()
    resumed.fit(DATA, epochs=4, batch_size=BATCH, checkpoint_dir=copy, resume=True,
                progress=False)  # fmt: skip
    straight.fit(DATA, epochs=1, batch_size=BATCH, progress=False)  # its 4th epoch
    for got, want in zip(state_arrays(resumed.model), state_arrays(straight.model), strict=True):
        np.testing.assert_array_equal(got, want)
    assert all_steps(copy) == [8, 12, 16] and not partial.exists()
    abstract_state = nnx.split(abstract_model)[1]
    flax_loaded = ocp.StandardCheckpointer().restore(copy / "16" / "state", abstract_state)
    for got, want in zip(state_arrays(flax_loaded), state_arrays(straight.model), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_resume_that_trains_nothing_adds_the_item_a_kill_left_out(copy):
    """A run killed while its item was added, rerun when nothing is left to train: the
    rerun gives the newest checkpoint its state/ item, and Flax's own restore of it is the
    model a run never interrupted ends with."""
    import orbax.checkpoint as ocp

    newest = copy / "12"
    (newest / "state").rename(newest / "state.nnxscan-tmp")  # the kill's leftover
    before = {name: (newest / name).read_bytes() for name in ("arrays.bin", "manifest.json")}
    rerun = new_trainer()
    rerun.fit(DATA, epochs=3, batch_size=BATCH, checkpoint_dir=copy, resume=True,
              progress=False)  # fmt: skip
    assert rerun.step == 12 and all_steps(copy)[-1] == 12
    assert {name: (newest / name).read_bytes() for name in before} == before  # not rewritten
    assert sorted(p.name for p in newest.iterdir()) == ["arrays.bin", "manifest.json", "state"]
    straight = new_trainer()
    straight.fit(DATA, epochs=3, batch_size=BATCH, seed=0, progress=False)
    abstract = nnx.split(nnx.eval_shape(lambda: BNDropout(rngs=nnx.Rngs(0))))[1]
    flax_loaded = ocp.StandardCheckpointer().restore(newest / "state", abstract)
    for got, want in zip(state_arrays(flax_loaded), state_arrays(straight.model), strict=True):
        np.testing.assert_array_equal(got, want)


def _flip_in_item(item: pathlib.Path, value: np.ndarray) -> None:
    """Flips a low mantissa bit of ``value``'s second element where the item's store keeps
    its bytes (the item is uncompressed: its chunk is in one of the store's data files)."""
    raw = value.tobytes()
    hits = [f for f in (item / "d").iterdir() if raw in f.read_bytes()]
    assert len(hits) == 1
    flip_bit(hits[0], hits[0].read_bytes().index(raw) + 4, 1)


@pytest.mark.parametrize("damage", ["flipped_weight_bit", "another_checkpoints_item",
                                    "link_to_another_item"])  # fmt: skip
def test_flax_restore_of_the_item_checks_nothing_and_load_model_refuses(copy, run, damage):
    """What docs/checkpoints.md says: Flax's restore of ``<step>/state`` loads whatever is
    there; ``load_model`` checks that the item holds the checkpoint's verified arrays,
    refuses checkpoint 12 and falls back to 8. Reference: the arrays training held."""
    import orbax.checkpoint as ocp

    _, at_epoch = run
    item = copy / "12" / "state"
    abstract_model = nnx.eval_shape(lambda: BNDropout(rngs=nnx.Rngs(0)))
    abstract_state = nnx.split(abstract_model)[1]
    if damage == "flipped_weight_bit":
        kernel = ocp.StandardCheckpointer().restore(item, abstract_state)["l1"]["kernel"][...]
        _flip_in_item(item, np.asarray(kernel))
    else:
        shutil.rmtree(item)
        if damage == "another_checkpoints_item":
            shutil.copytree(copy / "8" / "state", item)
        else:
            item.symlink_to(copy / "8" / "state")
    flax_loaded = state_arrays(ocp.StandardCheckpointer().restore(item, abstract_state))
    differing = [
        int(np.sum(a != b)) for a, b in zip(flax_loaded, at_epoch[12], strict=True)
    ]  # silently other weights: one bit of one kernel, or another step's
    assert sum(differing) == 1 if damage == "flipped_weight_bit" else sum(differing) > 1
    with pytest.raises(CorruptCheckpointError, match=r"step 12: its state/ item") as error:
        load_model(copy, abstract_model, step=12)
    reason = {"flipped_weight_bit": "holds other values at ['l1']['kernel']",
              "another_checkpoints_item": "holds other values at ['",
              "link_to_another_item": "is a symbolic link"}[damage]  # fmt: skip
    assert reason in str(error.value)
    with pytest.warns(UserWarning, match="skipped checkpoint 12"):
        model = load_model(copy, abstract_model)  # the newest whose item is whole: 8
    for got, want in zip(state_arrays(model), at_epoch[8], strict=True):
        np.testing.assert_array_equal(got, want)


def test_load_model_restores_the_model_alone_into_an_abstract_one(run):
    directory, at_epoch = run
    model = load_model(directory, nnx.eval_shape(lambda: BNDropout(rngs=nnx.Rngs(0))))
    for got, want in zip(state_arrays(model), at_epoch[12], strict=True):
        np.testing.assert_array_equal(got, want)
    model.eval()
    assert model(DATA["x"][:4]).shape == (4, 3)
    with pytest.raises(ValueError, match=r"\['state'\]\['l1'\]\['kernel'\]"):
        load_model(directory, nnx.eval_shape(lambda: BNDropout(5, rngs=nnx.Rngs(0))))


def test_the_item_is_what_orbax_itself_writes_for_the_same_state(tmp_path):
    """Our own orbax item against orbax's own StandardCheckpointer (its default layout: an
    OCDBT store of zarr v2 arrays): the same metadata files, the same keys in the store,
    the same zarr metadata but the compressor; and orbax restores both alike."""
    import orbax.checkpoint as ocp
    import tensorstore

    class Many(nnx.Module):  # int keys (a list), a bfloat16 Param, keys, batch statistics
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)])
            self.bn = nnx.BatchNorm(2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.half = nnx.Param(jax.numpy.ones((2, 3), jax.numpy.bfloat16))
            self.flag = nnx.Variable(jax.numpy.array([True, False]))

    state = nnx.state(Many(nnx.Rngs(0)))
    ours = save_checkpoint(tmp_path / "ours", 0, {"state": state}) / "state"
    theirs = tmp_path / "theirs"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(theirs, state)
    checkpointer.wait_until_finished()
    for name in ("_METADATA", "_sharding", "array_metadatas/process_0"):
        assert json.loads((ours / name).read_text()) == json.loads((theirs / name).read_text())

    def store(item):
        spec = {"driver": "ocdbt", "base": f"file://{item}/"}
        kv = tensorstore.KvStore.open(spec).result()
        return {key.decode(): kv[key] for key in kv.list().result()}

    ours_kv, theirs_kv = store(ours), store(theirs)
    assert sorted(ours_kv) == sorted(theirs_kv)
    for key in (k for k in theirs_kv if k.endswith(".zarray")):
        assert json.loads(ours_kv[key]) == {**json.loads(theirs_kv[key]), "compressor": None}
    abstract = nnx.split(nnx.eval_shape(lambda: Many(nnx.Rngs(1))))[1]
    restored = [ocp.StandardCheckpointer().restore(d, abstract) for d in (ours, theirs)]
    for a, b, want in zip(*map(state_arrays, restored), state_arrays(state), strict=True):
        np.testing.assert_array_equal(a, want, strict=True)
        np.testing.assert_array_equal(b, want, strict=True)


def test_orbax_storage_writes_the_same_state_item(tmp_path):
    import orbax.checkpoint as ocp

    model = BNDropout(rngs=nnx.Rngs(3))
    where = save_checkpoint(tmp_path, 5, {"state": nnx.state(model)}, storage="orbax")
    abstract = nnx.split(nnx.eval_shape(lambda: BNDropout(rngs=nnx.Rngs(0))))[1]
    restored = ocp.StandardCheckpointer().restore(where / "state", abstract)
    for got, want in zip(state_arrays(restored), state_arrays(model), strict=True):
        np.testing.assert_array_equal(got, want)
    # and nnxscan reads its own manifest of that storage, validated as the files one
    tree, _ = restore_checkpoint(tmp_path, {"state": abstract})
    for got, want in zip(state_arrays(tree["state"]), state_arrays(model), strict=True):
        np.testing.assert_array_equal(got, want)
