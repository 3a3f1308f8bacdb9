"""The two storages of nnxscan.adapters.checkpoint: nnxscan's own files (a tree one process
holds whole) and orbax (arrays sharded over devices or processes, or ``storage="orbax"``).

The references: the tree that was saved (read back bitwise, dtype by dtype), the same tree
saved through orbax, and a directory listing read by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnxscan.adapters import _checkpoint_files, _checkpoint_packing
from nnxscan.adapters._checkpoint_lock import LOCK
from nnxscan.adapters.checkpoint import (
    Checkpointer,
    CorruptCheckpointError,
    all_steps,
    restore_checkpoint,
    save_checkpoint,
)


def every_kind(step: int) -> dict:
    """Leaves of every dtype a model holds, bfloat16 and PRNG keys included, on the device
    and on the host, plus Python counters."""
    rng = np.random.default_rng(step)
    return {
        "f32": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32),
        "bf16": jnp.asarray(rng.normal(size=(7,)), jnp.bfloat16),
        "f16_host": rng.normal(size=(2, 2)).astype(np.float16),
        "i8": jnp.asarray(rng.integers(-100, 100, (9,)), jnp.int8),
        "u32": jnp.asarray(rng.integers(0, 2**31, (4,)), jnp.uint32),
        "flag": jnp.asarray(rng.random(5) < 0.5),
        "scalar": np.float64(step + 0.25),
        "empty": jnp.zeros((0, 3), jnp.float32),
        "key": jax.random.key(step),
        "raw_key": jax.random.PRNGKey(step),
        "meta": {"step": step, "lr": 0.1 * step, "done": False, "tag": f"s{step}"},
    }


def host(tree: dict) -> dict:
    """Every leaf by path as numpy (keys as their raw bits) or as the Python value."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = ("key", str(jax.random.key_impl(leaf)), np.asarray(jax.random.key_data(leaf)))
        elif isinstance(leaf, jax.Array | np.ndarray | np.generic):
            leaf = np.asarray(leaf)
        out[jax.tree_util.keystr(path)] = leaf
    return out


def assert_same(got: dict, want: dict) -> None:
    got, want = host(got), host(want)
    assert list(got) == list(want)
    for path, expected in want.items():
        actual = got[path]
        if isinstance(expected, tuple):
            assert actual[:2] == expected[:2], path
            actual, expected = actual[2], expected[2]
        if isinstance(expected, np.ndarray):
            assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
            np.testing.assert_array_equal(actual, expected, err_msg=path, strict=True)
        else:
            assert type(actual) is type(expected) and actual == expected, path


def test_a_tree_held_whole_is_written_as_own_files_and_reads_back_bitwise(tmp_path):
    saved = every_kind(3)
    where = save_checkpoint(tmp_path, 3, saved)
    assert _checkpoint_files.storage_of(where) == "files"
    assert sorted(p.name for p in where.iterdir()) == ["arrays.bin", "manifest.json"]
    tree, step = restore_checkpoint(tmp_path, every_kind(0))
    assert step == 3
    assert_same(tree, saved)
    assert isinstance(tree["f16_host"], np.ndarray) and isinstance(tree["scalar"], np.float64)
    tree["f16_host"][0, 0] = 1.0  # restored numpy leaves are the caller's to write


def test_both_storages_restore_the_same_bits(tmp_path):
    saved = every_kind(4)
    save_checkpoint(tmp_path / "own", 4, saved)
    save_checkpoint(tmp_path / "orbax", 4, saved, storage="orbax")
    assert _checkpoint_files.storage_of(tmp_path / "orbax" / "4") == "orbax"
    own, _ = restore_checkpoint(tmp_path / "own", every_kind(0))
    through_orbax, _ = restore_checkpoint(tmp_path / "orbax", every_kind(0))
    assert_same(own, saved)
    assert_same(through_orbax, saved)


def with_optimizer(step: int) -> dict:
    """A model state and an optimizer state beside it: an int32 counter (a dtype the model
    state has none of) and float32 moments (packed with the model's float32 arrays)."""
    state = every_kind(step)
    moments = {"f32": state["f32"] * 2, "bf16": state["bf16"] * 2}
    return {
        "state": state,
        "opt_state": {"count": jnp.asarray(step, jnp.int32), "mu": moments, "nu": moments},
        "meta": {"epoch": step},
    }


def test_a_template_of_some_entries_restores_them_alone_from_both_storages(tmp_path):
    """A template of the model state alone (what load_model restores) reads it alone, from
    orbax's storage as from the own files, bitwise; so does one of the optimizer state
    alone. orbax's reader refused the first as damaged (its packed buffers asked of orbax
    were not all the saved ones), and with fallback=True every checkpoint was skipped."""
    saved = with_optimizer(6)
    save_checkpoint(tmp_path / "own", 6, saved)
    save_checkpoint(tmp_path / "orbax", 6, saved, storage="orbax")
    for like in ({"state": every_kind(0)}, {"opt_state": with_optimizer(0)["opt_state"]}):
        want = {entry: saved[entry] for entry in like}
        own, _ = restore_checkpoint(tmp_path / "own", like)
        through_orbax, step = restore_checkpoint(tmp_path / "orbax", like, fallback=True)
        assert step == 6
        assert_same(own, want)
        assert_same(through_orbax, want)
        assert_same(through_orbax, own)


def test_a_template_of_some_entries_still_finds_another_checkpoints_orbax_arrays(tmp_path):
    import shutil

    save_checkpoint(tmp_path, 1, with_optimizer(1), storage="orbax")
    save_checkpoint(tmp_path, 2, with_optimizer(2), storage="orbax")
    shutil.rmtree(tmp_path / "2" / "arrays")
    shutil.copytree(tmp_path / "1" / "arrays", tmp_path / "2" / "arrays")
    like = {"state": every_kind(0)}
    with pytest.raises(CorruptCheckpointError, match=rf"step 2: buffer 'pack_\w+' in "
                       rf"{tmp_path / '2' / 'arrays'} \(orbax's item\): its bytes do not "
                       r"match their crc32"):  # fmt: skip
        restore_checkpoint(tmp_path, like, step=2)
    with pytest.warns(UserWarning, match="skipped checkpoint 2"):
        tree, step = restore_checkpoint(tmp_path, like, fallback=True)
    assert step == 1
    assert_same(tree, {"state": with_optimizer(1)["state"]})
    shutil.rmtree(tmp_path / "2" / "arrays")  # what orbax cannot read at all
    with pytest.raises(CorruptCheckpointError, match=r"step 2: its arrays .* cannot be read"):
        restore_checkpoint(tmp_path, like, step=2)


def test_one_directory_may_hold_both_and_max_to_keep_counts_both(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=3, storage="orbax") as checkpointer:
        for step in (1, 2):
            checkpointer.save(step, every_kind(step))
    with Checkpointer(tmp_path, max_to_keep=3) as checkpointer:
        checkpointer.save(3, every_kind(3))
        checkpointer.save(4, every_kind(4))  # deletes orbax's step 1
        assert checkpointer.latest_step() == 4
    assert all_steps(tmp_path) == [2, 3, 4]
    listing = sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK)
    assert listing == ["2", "3", "4"], listing  # nothing half-deleted or temporary left
    for step in (2, 3, 4):
        tree, got = restore_checkpoint(tmp_path, every_kind(0), step=step)
        assert got == step
        assert_same(tree, every_kind(step))
    with Checkpointer(tmp_path, max_to_keep=3, storage="orbax") as checkpointer:
        checkpointer.save(5, every_kind(5))  # orbax deletes our step 2
    assert all_steps(tmp_path) == [3, 4, 5]


def test_a_failed_background_write_raises_at_the_next_wait_and_lists_nothing(tmp_path, monkeypatch):
    def broken_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, every_kind(1))
        checkpointer.wait()
        monkeypatch.setattr(_checkpoint_files, "write_many", broken_disk)
        checkpointer.save(2, every_kind(2))  # returns: the write fails in the background
        with pytest.raises(OSError, match="No space left"):
            checkpointer.wait()
        assert checkpointer.newest_step() == 1  # the failed save is not counted as saved
        monkeypatch.undo()
        checkpointer.save(2, every_kind(2))  # the same step again, now that the disk works
    assert all_steps(tmp_path) == [1, 2]
    assert_same(restore_checkpoint(tmp_path, every_kind(0))[0], every_kind(2))


def test_a_truncated_data_file_raises_naming_it(tmp_path):
    where = save_checkpoint(tmp_path, 1, every_kind(1))
    data = where / "arrays.bin"
    data.write_bytes(data.read_bytes()[:16])
    with pytest.raises(CorruptCheckpointError, match=r"arrays\.bin, which holds 16 bytes"):
        restore_checkpoint(tmp_path, every_kind(0))


@pytest.mark.parametrize("asynchronous", [True, False])
def test_leftovers_of_a_killed_process_are_never_listed_and_are_cleaned(tmp_path, asynchronous):
    save_checkpoint(tmp_path, 1, every_kind(1))
    for leftover in ("2.nnxscan-tmp", "0.nnxscan-deleting", "3.orbax-checkpoint-tmp-99"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "arrays.bin").write_bytes(b"half")
    assert all_steps(tmp_path) == [1]
    with Checkpointer(tmp_path, asynchronous=asynchronous) as checkpointer:
        checkpointer.save(2, every_kind(2))
    # Ours are gone; orbax's temporary folder is orbax's to clean.
    listing = sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK)
    assert listing == ["1", "2", "3.orbax-checkpoint-tmp-99"]
    assert_same(restore_checkpoint(tmp_path, every_kind(0))[0], every_kind(2))


def test_storage_must_be_known():
    with pytest.raises(ValueError, match="storage must be one of"):
        Checkpointer("anywhere", storage="zarr")


def test_a_save_reusing_a_known_packing_writes_what_a_fresh_packing_writes(tmp_path, monkeypatch):
    """Saves of a structure seen before reuse its packing (paths, packs, offsets); the
    reference is the same tree saved with no packing known. Trees that differ from a known
    one only in a leaf's dtype, shape, Python type or placement get their own packing."""

    def variants(step: int) -> list[dict]:
        tree = every_kind(step)
        return [
            tree,
            {**tree, "f32": tree["f32"].astype(jnp.float16)},  # dtype
            {**tree, "i8": tree["i8"][:4]},  # shape
            {**tree, "meta": {**tree["meta"], "step": float(step)}},  # Python type
            {**tree, "u32": np.asarray(tree["u32"])},  # numpy instead of a device array
        ]

    monkeypatch.setattr(_checkpoint_packing, "_PACKINGS", [])  # whatever other tests saved before
    built = []
    packing = _checkpoint_packing._packing
    monkeypatch.setattr(
        _checkpoint_packing, "_packing", lambda *args: built.append(1) or packing(*args)
    )
    for step in (1, 2, 3):  # every variant's packing is known after step 1
        for index, tree in enumerate(variants(step)):
            before = len(built)
            save_checkpoint(tmp_path / f"cached{index}", step, tree)
            assert len(built) - before == (step == 1), (step, index)
            with monkeypatch.context() as patched:
                patched.setattr(_checkpoint_packing, "_PACKINGS", [])  # nothing known
                save_checkpoint(tmp_path / f"fresh{index}", step, tree)
            cached = (tmp_path / f"cached{index}" / str(step)).iterdir()
            for file in sorted(cached):
                fresh = tmp_path / f"fresh{index}" / str(step) / file.name
                assert file.read_bytes() == fresh.read_bytes(), (index, file.name)
            restored, _ = restore_checkpoint(tmp_path / f"cached{index}", tree, step=step)
            assert_same(restored, tree)


# -- crc32s in orbax's storage (version 5) ------------------------------------------------------


def _files_of(root) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_orbax_storage_manifest_and_packed_buffers_carry_crc32s(tmp_path):
    import json
    import zlib

    saved = every_kind(5)
    where = save_checkpoint(tmp_path, 5, saved, storage="orbax")
    text = (where / "manifest" / "metadata").read_bytes()
    record = json.loads(text)
    assert record["version"] == 6
    body = json.dumps({k: v for k, v in record.items() if k != "crc32"}).encode()
    assert record["crc32"] == f"{zlib.crc32(body):08x}"  # of the rest of the text, as written
    assert record["buffers"] and all("crc32" in b for b in record["buffers"].values())
    # Reference: each packed buffer as orbax's own PyTree restore reads it.
    import orbax.checkpoint as ocp

    arrays = ocp.PyTreeCheckpointer().restore(where / "arrays")
    for name, entry in record["buffers"].items():
        assert f"{zlib.crc32(np.asarray(arrays[name]).tobytes()):08x}" == entry["crc32"]
    assert_same(restore_checkpoint(tmp_path, every_kind(0))[0], saved)


def test_a_flipped_bit_in_the_orbax_manifest_is_refused_naming_the_file(tmp_path):
    saved = every_kind(1)
    save_checkpoint(tmp_path, 1, saved, storage="orbax")
    save_checkpoint(tmp_path, 2, every_kind(2), storage="orbax")
    manifest = tmp_path / "2" / "manifest" / "metadata"
    text = bytearray(manifest.read_bytes())
    text[text.index(b'"value": 0.2}') + 11] ^= 1  # lr 0.2 -> 0.3: still valid JSON
    manifest.write_bytes(bytes(text))
    before = _files_of(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=rf"step 2: its manifest {manifest} cannot "
                       r"be read: its crc32 does not match"):  # fmt: skip
        restore_checkpoint(tmp_path, every_kind(0), step=2)
    with pytest.warns(UserWarning, match="skipped checkpoint 2"):
        tree, step = restore_checkpoint(tmp_path, every_kind(0), fallback=True)
    assert step == 1
    assert_same(tree, saved)
    assert _files_of(tmp_path) == before  # the failed restores wrote nothing


def test_another_checkpoints_orbax_arrays_are_refused_naming_the_buffer(tmp_path):
    """A copied-in arrays/ item (the same shapes, other values) loaded silently before the
    packed buffers carried crc32s."""
    import shutil

    save_checkpoint(tmp_path, 1, every_kind(1), storage="orbax")
    save_checkpoint(tmp_path, 2, every_kind(2), storage="orbax")
    shutil.rmtree(tmp_path / "2" / "arrays")
    shutil.copytree(tmp_path / "1" / "arrays", tmp_path / "2" / "arrays")
    before = _files_of(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=rf"step 2: buffer 'pack_\w+' in "
                       rf"{tmp_path / '2' / 'arrays'} \(orbax's item\): its bytes do not "
                       r"match their crc32"):  # fmt: skip
        restore_checkpoint(tmp_path, every_kind(0), step=2)
    assert _files_of(tmp_path) == before


def test_orbax_checkpoints_without_checksums_still_restore_and_a_stripped_v5_is_refused(
    tmp_path,
):
    """Version 4 and before wrote no crc32s in orbax's storage: read unchecked, as the own
    files of version 3 are. A version 5 manifest without its crc32 is damaged."""
    import json

    saved = every_kind(3)
    save_checkpoint(tmp_path, 3, saved, storage="orbax")
    manifest = tmp_path / "3" / "manifest" / "metadata"
    record = json.loads(manifest.read_bytes())
    del record["crc32"]
    manifest.write_text(json.dumps(record))
    with pytest.raises(CorruptCheckpointError, match="version 6 manifests carry a crc32"):
        restore_checkpoint(tmp_path, every_kind(0))
    manifest.write_text(json.dumps({**record, "version": 5}))
    with pytest.raises(CorruptCheckpointError, match="version 5 manifests carry a crc32"):
        restore_checkpoint(tmp_path, every_kind(0))
    record["version"] = 4
    for entry in record["buffers"].values():
        del entry["crc32"]
    manifest.write_text(json.dumps(record))
    assert_same(restore_checkpoint(tmp_path, every_kind(0))[0], saved)


def test_asynchronous_saves_sync_each_rename_with_the_next_save_or_close(tmp_path, monkeypatch):
    """Every checkpoint's files are fsync'ed before its rename; an asynchronous save's
    rename reaches the disk with the directory's fsync of the next save, or of close()
    (a synchronous save's before it returns). Reference: the order of the calls."""
    import os

    events = []
    fsync, rename = _checkpoint_files._fsync, os.rename
    monkeypatch.setattr(_checkpoint_files, "_fsync", lambda p: (events.append(("fsync", p)),
                                                                fsync(p))[1])  # fmt: skip
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", b)), rename(a, b))[1])
    directory = tmp_path.resolve()
    with Checkpointer(directory, max_to_keep=5) as checkpointer:
        for step in (1, 2):
            checkpointer.save(step, {"w": np.arange(3.0) + step})
            checkpointer.wait()
    renamed = [i for i, e in enumerate(events) if e == ("rename", directory / "1")]
    synced = [i for i, e in enumerate(events) if e == ("fsync", directory)]
    assert (
        renamed
        and synced
        and min(s for s in synced if s > renamed[0]) < events.index(("rename", directory / "2"))
    )  # the next save's fsyncs carry the first rename
    last = events.index(("rename", directory / "2"))
    assert any(i > last for i in synced)  # close() carries the last one
    for step in (1, 2):
        files = {directory / f"{step}.nnxscan-tmp" / n for n in ("arrays.bin", "manifest.json")}
        at = events.index(("rename", directory / str(step)))
        assert files <= {p for kind, p in events[:at] if kind == "fsync"}
    events.clear()
    save_checkpoint(directory, 3, {"w": np.arange(3.0)})  # synchronous: synced on return
    at = events.index(("rename", directory / "3"))
    assert ("fsync", directory) in events[at:]
