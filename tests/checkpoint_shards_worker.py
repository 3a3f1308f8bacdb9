"""Run with 4 simulated CPU devices by tests/test_checkpoint_shards.py (not collected by
pytest): ``python checkpoint_shards_worker.py OUT.json``. Saves arrays sharded over the
devices (orbax's storage writes them shard by shard), damages them on disk, and records for
the tests what nnxscan's restore did, next to the references: the saved arrays (the
crc32 of each shard's bytes computed here with zlib), orbax's own restore of the same
files, a snapshot of the files, and the same fit never interrupted.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tempfile
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscan.adapters.checkpoint import (
    CorruptCheckpointError,
    restore_checkpoint,
    save_checkpoint,
)
from nnxscan.shell import Trainer, load_model

MESH = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))


def tree(seed: int) -> dict:
    """Arrays sharded every way a model's are: over both axes, over one (replicated over
    the other), PRNG keys; plus a counter (no packed buffer: arrays/ holds the shards only)."""
    rng = np.random.default_rng(seed)

    def put(array, spec):
        return jax.device_put(array, NamedSharding(MESH, spec))

    # w: random bits, which zstd (orbax's compression) stores as they are, so that a test
    # can find a shard's bytes on disk and flip one of them.
    return {
        "w": put(jnp.asarray(rng.integers(0, 2**32, (64, 32), dtype=np.uint32)), P("a", "b")),
        "v": put(jnp.asarray(rng.normal(size=(256,)), jnp.float32), P("b")),
        "keys": put(jax.random.split(jax.random.key(seed), 4), P("a")),
        "meta": {"step": seed},
    }


def host(tree: dict) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array):
            out[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def same(a: dict, b: dict) -> bool:
    a, b = host(a), host(b)
    return list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)


def files(root: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def flip_a_bit_of(step_dir: pathlib.Path, data: np.ndarray) -> str:
    """Flips one bit inside ``data``'s bytes where the checkpoint stores them (orbax writes
    chunks uncompressed); returns the file's path. Raises when they are nowhere."""
    needle = np.ascontiguousarray(data).tobytes()
    for file in sorted((step_dir / "arrays").rglob("*")):
        if file.is_file():
            raw = bytearray(file.read_bytes())
            at = raw.find(needle)
            if at >= 0:
                raw[at + len(needle) // 2] ^= 0x10
                file.write_bytes(bytes(raw))
                return str(file)
    raise AssertionError(f"the bytes of the shard are in no file of {step_dir}")


def expect_corrupt(run) -> str:
    try:
        run()
    except CorruptCheckpointError as error:
        return str(error)
    return ""


def adapter_cases(root: pathlib.Path) -> dict:
    out: dict = {}
    saved = {1: tree(1), 2: tree(2)}
    directory = root / "adapter"
    for step, value in saved.items():
        save_checkpoint(directory, step, value)
    manifest = json.loads((directory / "2" / "manifest" / "metadata").read_bytes())
    out["version"] = manifest["version"]
    # Reference: each distinct shard's block, from the sharding, and its crc32 by zlib.
    leaves = {r["path"]: r["name"] for r in manifest["leaves"] if r.get("name")}
    expected = {}
    for path, array in host(saved[2]).items():
        leaf = {"['w']": saved[2]["w"], "['v']": saved[2]["v"]}.get(path)
        leaf = jax.random.key_data(saved[2]["keys"]) if leaf is None else leaf
        blocks = []
        for index in leaf.sharding.devices_indices_map(leaf.shape).values():
            block = [list(s.indices(n)[:2]) for s, n in zip(index, leaf.shape, strict=True)]
            entry = [block, f"{zlib.crc32(np.ascontiguousarray(array[index]).tobytes()):08x}"]
            if entry not in blocks:
                blocks.append(entry)
        expected[leaves[path]] = blocks
    out["shards"], out["expected_shards"] = manifest["shards"], expected
    out["intact"] = same(restore_checkpoint(directory, tree(0))[0], saved[2])
    # Onto another layout: one device, and both axes swapped; every block still checked.
    other = jax.tree.map(
        lambda x: (
            jax.device_put(x, NamedSharding(MESH, P(*reversed(x.sharding.spec))))
            if isinstance(x, jax.Array) and x.ndim == 2
            else x
        ),
        tree(0),
    )
    out["intact_other_mesh"] = same(restore_checkpoint(directory, other)[0], saved[2])
    single = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]) if isinstance(
        x, jax.Array) else x, tree(0))  # fmt: skip
    out["intact_one_device"] = same(restore_checkpoint(directory, single)[0], saved[2])

    # A flipped bit in one shard of w (its block [32:64, 16:32]).
    flipped = root / "flipped"
    shutil.copytree(directory, flipped)
    out["flipped_file"] = flip_a_bit_of(flipped / "2", host(saved[2])["['w']"][32:, 16:])
    import orbax.checkpoint as ocp

    by_orbax = ocp.PyTreeCheckpointer().restore(flipped / "2" / "arrays")
    out["orbax_loads_it_silently"] = not np.array_equal(
        np.asarray(by_orbax[leaves["['w']"]]), host(saved[2])["['w']"]
    )
    before = files(flipped)
    out["flipped_error"] = expect_corrupt(lambda: restore_checkpoint(flipped, tree(0), step=2))
    out["flipped_error_other_mesh"] = expect_corrupt(
        lambda: restore_checkpoint(flipped, other, step=2)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored, step = restore_checkpoint(flipped, tree(0), fallback=True)
    out["fallback_step"], out["fallback_same"] = step, same(restored, saved[1])
    out["fallback_warnings"] = [str(w.message) for w in caught]
    out["restores_wrote_nothing"] = files(flipped) == before

    # Another checkpoint's arrays/ copied in: the same shapes, other values.
    swapped = root / "swapped"
    shutil.copytree(directory, swapped)
    shutil.rmtree(swapped / "2" / "arrays")
    shutil.copytree(directory / "1" / "arrays", swapped / "2" / "arrays")
    by_orbax = ocp.PyTreeCheckpointer().restore(swapped / "2" / "arrays")
    out["orbax_loads_swapped"] = np.array_equal(
        np.asarray(by_orbax[leaves["['w']"]]), host(saved[1])["['w']"]
    )
    out["swapped_error"] = expect_corrupt(lambda: restore_checkpoint(swapped, tree(0), step=2))
    return out


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


TX = optax.adam(1e-2)  # one transform: the runs share compiled programs


def fit_cases(root: pathlib.Path) -> dict:
    """A FSDP-sharded fit whose newest checkpoint holds the arrays of the one before:
    resume=True skips it, and ends bitwise where the same fit never interrupted ends."""
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(64, 8)).astype(np.float32),
            "y": rng.integers(0, 3, 64).astype(np.int32)}  # fmt: skip
    fit = dict(batch_size=8, seed=1, progress=False)
    mesh = Mesh(np.array(jax.devices()), ("data",))

    def trainer():
        return Trainer(MLP(nnx.Rngs(0)), TX, loss_fn, mesh=mesh, fsdp_min_size=100)

    straight = trainer()
    straight.fit(data, epochs=3, **fit)
    directory = root / "fit"
    first = trainer()
    first.fit(data, epochs=2, checkpoint_dir=directory, **fit)
    kernel = first.model.l1.kernel[...]
    newest = max(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    out = {"kernel_spec": str(kernel.sharding.spec), "newest": newest}
    # Another checkpoint's arrays (of the epoch before) in the newest one's place.
    older = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())[-2]
    shutil.rmtree(directory / str(newest) / "arrays")
    shutil.copytree(directory / str(older) / "arrays", directory / str(newest) / "arrays")
    resumed = trainer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(data, epochs=3, checkpoint_dir=directory, resume=True, **fit)
    out["fit_warnings"] = [str(w.message) for w in caught]
    out["fit_same"] = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
            jax.tree.leaves(nnx.state(straight.model)),
            jax.tree.leaves(nnx.state(resumed.model)),
            strict=True,
        )
    )
    out["set_aside"] = sorted(p.name for p in directory.iterdir() if "corrupt" in p.name)
    # The model state alone (the optimizer's sharded moments and int32 counter unread),
    # onto the default device, from the newest checkpoint: the resumed fit's last.
    loaded = []
    out["load_error"] = expect_corrupt(
        lambda: loaded.append(load_model(directory, nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))))
    )
    out["loaded_same"] = bool(loaded) and all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
            jax.tree.leaves(nnx.state(straight.model)),
            jax.tree.leaves(nnx.state(loaded[0])),
            strict=True,
        )
    )
    return out


def main(out: str) -> None:
    assert len(jax.devices()) == 4, jax.devices()
    root = pathlib.Path(tempfile.mkdtemp())
    result = {**adapter_cases(root), **fit_cases(root)}
    pathlib.Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
