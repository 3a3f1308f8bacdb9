"""crc32s of the arrays orbax's storage writes shard by shard (``leaf_00000``...).

The slow cases run ``checkpoint_shards_worker.py`` once, on 4 simulated CPU devices, and
assert what it recorded against its references: each shard's crc32 computed with zlib from
the saved arrays, orbax's own restore of the same (damaged) files, a snapshot of the files
before the restores, and the same fit never interrupted. The fast cases hand crafted
manifests to the validator.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from nnxscan.adapters import _checkpoint_manifest as manifest
from nnxscan.adapters.checkpoint import CorruptCheckpointError

WORKER = pathlib.Path(__file__).with_name("checkpoint_shards_worker.py")


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    run = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=WORKER.parent)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # a 4-device subprocess
def test_each_shard_carries_the_crc32_of_its_bytes(seen):
    assert seen["version"] == 6
    assert seen["shards"] == seen["expected_shards"]  # blocks from the sharding, zlib's crc32
    assert seen["intact"] and seen["intact_other_mesh"] and seen["intact_one_device"]


@pytest.mark.slow
def test_a_flipped_bit_in_a_shard_is_refused_naming_the_leaf_and_a_restore_falls_back(seen):
    assert seen["orbax_loads_it_silently"]  # orbax's own restore returns the other value
    for key in ("flipped_error", "flipped_error_other_mesh"):
        assert "step 2: leaf ['w'] (leaf_" in seen[key], seen[key]
        assert "its shard [[32, 64], [16, 32]] does not match its crc32" in seen[key]
        assert "Restore another" not in seen[key]  # restore_checkpoint's advice is a note
    assert seen["fallback_step"] == 1 and seen["fallback_same"]
    assert len(seen["fallback_warnings"]) == 1
    assert "skipped checkpoint 2" in seen["fallback_warnings"][0]
    assert "Restore another" not in seen["fallback_warnings"][0]  # it restored another
    assert seen["restores_wrote_nothing"]


@pytest.mark.slow
def test_another_checkpoints_arrays_are_refused(seen):
    assert seen["orbax_loads_swapped"]  # orbax loads step 1's values as step 2's
    assert "step 2: leaf " in seen["swapped_error"]
    assert "does not match its crc32" in seen["swapped_error"]


@pytest.mark.slow
def test_a_sharded_fit_resumes_past_a_damaged_checkpoint_as_the_uninterrupted_run(seen):
    assert seen["kernel_spec"] == "P(None, 'data')"  # the kernel is sharded: leaf_ arrays
    assert len(seen["fit_warnings"]) == 1, seen["fit_warnings"]
    assert f"skipped checkpoint {seen['newest']}" in seen["fit_warnings"][0]
    assert (
        "leaf " in seen["fit_warnings"][0] and "does not match its crc32" in seen["fit_warnings"][0]
    )
    assert "Restore another" not in seen["fit_warnings"][0]  # it restored another
    assert seen["fit_same"]  # bitwise the 3 epochs straight
    assert seen["set_aside"] == [f"{seen['newest']}.nnxscan-corrupt"]


@pytest.mark.slow
def test_load_model_loads_the_model_state_alone_of_a_sharded_fit(seen):
    """Its sharded arrays (leaf_...) and packed buffers that the model state leaves out
    (the optimizer's moments and int32 counter) unread: refused as damaged before."""
    assert seen["load_error"] == ""
    assert seen["loaded_same"]  # bitwise the 3 epochs straight


def _sharded(shards) -> dict:
    """An orbax-storage manifest of one array of shape (4, 6) sharded as ``shards``."""
    leaf = {"path": "['w']", "kind": "array", "shape": [4, 6], "dtype": "float32",
            "name": "leaf_00000"}  # fmt: skip
    record = {"format": manifest.FORMAT, "version": 6, "leaves": [leaf], "buffers": {}}
    if shards is not None:
        record["shards"] = {"leaf_00000": shards}
    return record


CRC = "0123abcd"


def test_a_manifest_whose_shards_tile_the_array_is_accepted(tmp_path):
    shards = [[[[0, 2], [0, 6]], CRC], [[[2, 4], [0, 6]], CRC]]
    records, _ = manifest.validate(_sharded(shards), tmp_path / "3")
    assert records[0].shards == ((((0, 2), (0, 6)), CRC), (((2, 4), (0, 6)), CRC))


@pytest.mark.parametrize(
    "shards, problem",
    [
        (None, "carry no crc32s"),
        ([], "carry no crc32s"),
        ([[[[0, 4], [0, 6]], "xyz"]], "is not 8 hex digits"),
        ([[[[0, 5], [0, 6]], CRC]], "is not a block of shape"),
        ([[[[0, 4]], CRC]], "is not a block of shape"),
        ([[[[0, 3], [0, 6]], CRC], [[[2, 4], [0, 6]], CRC]], "overlap"),
        ([[[[0, 2], [0, 6]], CRC]], "hold 12 of its 24 elements"),
    ],
)
def test_a_crafted_list_of_shards_is_refused(tmp_path, shards, problem):
    record = _sharded(shards)
    if shards is None:
        record["shards"] = {}
    with pytest.raises(CorruptCheckpointError, match=rf"leaf \['w'\]: .*{problem}"):
        manifest.validate(record, tmp_path / "3")


def test_a_version_6_manifest_without_shards_is_refused_and_version_5_reads_unchecked(tmp_path):
    with pytest.raises(CorruptCheckpointError, match="no crc32s of its sharded arrays"):
        manifest.validate(_sharded(None), tmp_path / "3")
    old = {**_sharded(None), "version": 5}
    records, _ = manifest.validate(old, tmp_path / "3")
    assert records[0].name == "leaf_00000" and records[0].shards == ()
    unknown = _sharded([[[[0, 4], [0, 6]], CRC]])
    unknown["shards"]["leaf_00001"] = []
    with pytest.raises(CorruptCheckpointError, match="shards of 'leaf_00001', which no leaf"):
        manifest.validate(unknown, tmp_path / "3")
