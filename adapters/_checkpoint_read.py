"""Reading a checkpoint back: what it holds, checked against a template and the manifest's
own rules, then its buffers and leaves rebuilt in the template's structure.

Nothing is read into a model here: the caller gets a new tree. Every check that can fail
runs before any buffer is read (the manifest, whole) or allocated (sizes come from the
validated manifest and the files' sizes); a buffer whose bytes do not match their crc32 is
refused as it is read, before any leaf is rebuilt.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, NamedTuple

import jax
import numpy as np

from nnxscan.adapters import _checkpoint_files as _files
from nnxscan.adapters import _checkpoint_manifest as _manifest
from nnxscan.adapters import _checkpoint_shards as _shards
from nnxscan.adapters._checkpoint_manifest import (
    ARRAY_KINDS,
    PYTHON_KINDS,
    CorruptCheckpointError,
    Leaf,
)
from nnxscan.adapters._extras import require_extra

_OPT_STATE = "['opt_state']"
# Where orbax's JsonSave writes the manifest item of orbax's storage.
ORBAX_MANIFEST = "manifest/metadata"
_STATE = "['state']"


def orbax() -> Any:
    # orbax-checkpoint is a flax dependency; the extra pins the version tested.
    return require_extra("orbax.checkpoint", "checkpoint", needed_by="nnxscan checkpoints")


def _entry(path: str) -> str:
    """The top-level entry of a leaf path: ``"['state']"`` of ``"['state']['l']['kernel']"``."""
    return path[: path.index("]") + 1] if "]" in path else path


def template_of(like: dict[str, Any], pairs: list[tuple[str, Any]], wanted: list[Leaf]) -> Any:
    return Template(
        pairs, wanted, {jax.tree_util.keystr((jax.tree_util.DictKey(k),)) for k in like}
    )


def check_fits(
    saved: list[Leaf], wanted: list[Leaf], where: pathlib.Path, entries: set[str]
) -> None:
    """Raises ValueError naming the first leaf where the checkpoint and template differ.

    The model's leaves are named first: a model of other sizes changes its optimizer
    state's shapes too, and the model is the cause. When only the optimizer state
    (``['opt_state']``) differs, the message says the optimizer differs and how."""
    by_path = {record.path: record for record in saved}
    # ``entries``: the template's top-level entries (``"['state']"``...). A saved entry the
    # template leaves out (the optimizer state, when only the model is restored) is not
    # read, so it cannot differ.
    problems = []
    for want in wanted:
        have = by_path.get(want.path)
        if have is None:
            problems.append(
                (want.path, f"missing in checkpoint ({_owner(want)} has {want.describe()})")
            )
        elif not have.fits(want):
            problems.append(
                (want.path, f"the checkpoint has {have.describe()}, {_owner(want)} has "
                 f"{want.describe()}")
            )  # fmt: skip
    wanted_paths = {want.path for want in wanted}
    problems += [
        (have.path, f"not in {_owner(have)} (the checkpoint has {have.describe()})")
        for have in saved
        if have.path not in wanted_paths and _entry(have.path) in entries
    ]
    if not problems:
        return
    problems.sort(key=lambda problem: problem[0].startswith(_OPT_STATE))  # stable
    first = f"{problems[0][0]}: {problems[0][1]}"
    more = f" ({len(problems) - 1} more leaves differ)" if len(problems) > 1 else ""
    if problems[0][0].startswith(_OPT_STATE):
        raise ValueError(
            f"checkpoint {where} was saved with another optimizer: its optimizer state holds "
            f"{_optimizer_structure(saved, wanted, saved)}, the optimizer given here holds "
            f"{_optimizer_structure(saved, wanted, wanted)} (the model's variables fit; first "
            f"difference at {first}{more}). Resume with the optax transform the checkpoint "
            f"was saved with (the same transforms, chained in the same order); to go on with "
            f"another optimizer, restore with the saved one, then build the new one on the "
            f"restored model."
        )
    raise ValueError(
        f"checkpoint {where} does not fit the template at {first}{more}. Restore "
        f"into a template built like the saved model (same layer sizes and variables), "
        f"or pick another checkpoint with step=."
    )


def _owner(leaf: Leaf) -> str:
    """Who holds a template leaf, in a message."""
    return "this optimizer" if leaf.path.startswith(_OPT_STATE) else "the model"


def _optimizer_structure(saved: list[Leaf], wanted: list[Leaf], side: list[Leaf]) -> str:
    """The optimizer state's leaves of one side, each parameter tree shortened to ``[...]``:
    ``"[0].count, [0].mu[...], [0].nu[...]"`` for Adam, ``"no arrays"`` for plain SGD."""
    params = {
        leaf.path[len(_STATE) :] for leaf in (*saved, *wanted) if leaf.path.startswith(_STATE)
    }
    names: dict[str, None] = {}
    for leaf in side:
        if not leaf.path.startswith(_OPT_STATE):
            continue
        name = leaf.path[len(_OPT_STATE) :]
        # The longest tail that is a model variable's path: the per-parameter part.
        tails = [tail for tail in params if tail and name.endswith(tail)]
        if tails:
            name = name[: -len(max(tails, key=len))] + "[...]"
        names[name] = None
    if not names:
        return "no arrays"
    listed = list(names)
    shown = ", ".join(listed[:6]) + (f", ... ({len(listed)} in all)" if len(listed) > 6 else "")
    return shown


def _default_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _restore_args(ocp: Any, saved: Leaf, template: Any) -> Any:
    if saved.kind == "key":
        # Key bits go to the default device; the rebuilt key is then placed like the template.
        return ocp.ArrayRestoreArgs(sharding=_default_sharding())
    if isinstance(template, np.ndarray | np.generic):
        return ocp.RestoreArgs(restore_type=np.ndarray)
    return ocp.ArrayRestoreArgs(sharding=getattr(template, "sharding", None) or _default_sharding())


def _unpack(saved: Leaf, template: Any, buffers: dict[str, Any]) -> Any:
    """A buffered array's elements, reshaped and placed as the template's leaf (keys: their
    raw data, placed; wrapped by the caller)."""
    shape = saved.data_shape
    size = int(np.prod(shape, dtype=np.int64))
    value = np.asarray(buffers[saved.buffer][saved.offset : saved.offset + size]).reshape(shape)
    if saved.kind != "key" and isinstance(template, np.ndarray | np.generic):
        return value
    return jax.device_put(value, getattr(template, "sharding", None) or _default_sharding())


def _rebuild_leaf(saved: Leaf, template: Any, arrays: dict[str, Any]) -> Any:
    if saved.kind in PYTHON_KINDS:
        return PYTHON_KINDS[saved.kind](saved.value)
    if saved.buffer:
        data = _unpack(saved, template, arrays)
        if saved.kind == "key":
            return jax.random.wrap_key_data(data, impl=saved.impl)
        return data[()] if isinstance(template, np.generic) else data
    data = arrays[saved.name]
    if saved.kind == "key":
        sharding = getattr(template, "sharding", None)
        if sharding is not None:
            # A typed key cannot be put on a mesh spanning processes; its raw data can.
            data = jax.device_put(np.asarray(jax.device_get(data)), sharding)
        return jax.random.wrap_key_data(data, impl=saved.impl)
    if isinstance(template, np.generic):
        return np.asarray(data)[()]
    return data


class Template(NamedTuple):
    """What a restore reads into: the template's (path, leaf) pairs, their records, and its
    top-level entries as paths (``"['state']"``): the saved tree's others are not read."""

    pairs: list[tuple[str, Any]]
    wanted: list[Leaf]
    entries: set[str]


def _matched(saved: list[Leaf], template: Template, where: pathlib.Path) -> list[tuple[Leaf, Any]]:
    """Each template leaf with the saved record of its path (after checking they fit)."""
    check_fits(saved, template.wanted, where, template.entries)
    by_path = {record.path: record for record in saved}
    return [(by_path[path], leaf) for path, leaf in template.pairs]


def _read_files(where: pathlib.Path, template: Template) -> tuple:
    try:
        raw, checked = _files.read_manifest(where)
    except (OSError, ValueError) as error:
        raise CorruptCheckpointError(
            f"checkpoint {where.parent} step {where.name}: its manifest {_files.MANIFEST} "
            f"cannot be read: {error}."
        ) from None
    records, buffers = _manifest.validate(raw, where, _files.data_size(where), checked=checked)
    matched = _matched(records, template, where)
    names = {record.buffer for record, _ in matched if record.buffer}
    try:
        return matched, _files.read_buffers(where, buffers, names)
    except (OSError, ValueError) as error:
        raise CorruptCheckpointError(
            f"checkpoint {where.parent} step {where.name}: {error}."
        ) from None


def _read_orbax(where: pathlib.Path, template: Template) -> tuple:
    ocp = orbax()
    step = int(where.name)
    options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    # create=False: reading must not create the directory, nor write anything into it.
    # The manifest's text, read as written (orbax's JsonSave: json.dumps of the record),
    # its crc32 checked before it is parsed.
    manifest_file = where / ORBAX_MANIFEST
    try:
        raw, checked = _files.read_manifest(where, manifest_file)
    except (OSError, ValueError) as error:
        raise CorruptCheckpointError(
            f"checkpoint {where.parent} step {step}: its manifest {manifest_file} cannot be "
            f"read: {error}."
        ) from None
    records, buffers = _manifest.validate(raw, where, checked=checked)
    with ocp.CheckpointManager(where.parent, options=options) as manager:
        matched = _matched(records, template, where)
        restore_args = {
            record.name: _restore_args(ocp, record, leaf)
            for record, leaf in matched
            if record.kind in ARRAY_KINDS and not record.buffer
        }
        for buffer in {record.buffer for record, _ in matched if record.buffer}:
            restore_args[buffer] = ocp.RestoreArgs(restore_type=np.ndarray)
        arrays = {}
        if restore_args:
            item = _partial_restore(ocp, records, buffers, restore_args)
            try:
                arrays = manager.restore(step, args=ocp.args.Composite(arrays=item))["arrays"]
                arrays = {name: arrays[name] for name in restore_args}
            except (ValueError, OSError, KeyError, FileNotFoundError) as error:
                # The manifest was valid and the template fits: what orbax (tensorstore)
                # cannot read is damaged ("DATA_LOSS: ... checksum verification failed").
                said = str(error).split(" [tensorstore_spec=")[0]
                raise CorruptCheckpointError(
                    f"checkpoint {where.parent} step {step}: its arrays in {where / 'arrays'} "
                    f"(orbax's item) cannot be read: {type(error).__name__}: {said}."
                ) from None
    _check_shards(where, matched, arrays)
    for name, held in buffers.items():
        if name not in arrays:
            continue
        host = np.asarray(arrays[name]).reshape(-1)
        stored_in = f"{where / 'arrays'} (orbax's item)"
        try:
            _manifest.check_buffer_read(
                name, stored_in, host.size, held["size"], "elements", host, held.get("crc32")
            )
        except ValueError as error:
            raise CorruptCheckpointError(
                f"checkpoint {where.parent} step {step}: {error}."
            ) from None
    return matched, arrays


def _partial_restore(
    ocp: Any, records: list[Leaf], buffers: dict[str, Any], restore_args: dict[str, Any]
) -> Any:
    """orbax's restore of the ``arrays/`` item reading only ``restore_args``'s arrays.

    The item holds every packed buffer and every array written on its own; orbax requires
    the restore's structure to be the saved one, key for key. A template of some entries
    (the model state alone) needs some of them: the rest, named from the manifest, are
    orbax's placeholders (not read). A key the manifest names and the item lacks, or the
    other way round, is still a structure error (a damaged checkpoint)."""
    saved = [*buffers, *(r.name for r in records if r.kind in ARRAY_KINDS and not r.buffer)]
    skipped = dict.fromkeys(saved, ocp.PLACEHOLDER)
    return ocp.args.PyTreeRestore(
        item={**skipped, **restore_args},  # its other leaves give the structure only
        restore_args={**dict.fromkeys(saved, ocp.RestoreArgs()), **restore_args},
    )


def _check_shards(where: pathlib.Path, matched: list, arrays: dict[str, Any]) -> None:
    """Each sharded array read against its shards' crc32s (manifest version 6); every
    process agrees before any raises (see _checkpoint_shards.py)."""
    bad = None
    for record, _ in matched:
        if record.shards and record.name in arrays:
            block = _shards.damaged(arrays[record.name], record.shards)
            if block is not None:
                bad = (record, block)
                break
    if not _shards.agree(bad is not None):
        return
    what = "a shard another process holds" if bad is None else (
        f"leaf {bad[0].path} ({bad[0].name} in {where / 'arrays'}, orbax's item): its shard "
        f"{[list(b) for b in bad[1]]}"
    )  # fmt: skip
    raise CorruptCheckpointError(
        f"checkpoint {where.parent} step {where.name}: {what} does not match its crc32 "
        f"(damaged on disk, or another checkpoint's arrays)."
    )


def read(where: pathlib.Path, template: Template) -> tuple[list, dict[str, Any]]:
    """The saved records matched with the template's leaves, and the arrays they need."""
    storage = _files.storage_of(where)
    if storage is None:
        raise CorruptCheckpointError(
            f"checkpoint {where.parent} step {where.name} holds no manifest (neither "
            f"{_files.MANIFEST} nor orbax's manifest/): deleted, emptied, or not a "
            f"checkpoint."
        )
    if storage == "files":
        return _read_files(where, template)
    return _read_orbax(where, template)


def rebuild(matched: list, arrays: dict[str, Any]) -> list:
    return [_rebuild_leaf(record, leaf, arrays) for record, leaf in matched]


def check_item(where: pathlib.Path, state: Any) -> None:
    """Refuses a checkpoint whose ``state/`` item — what Flax's own
    ``StandardCheckpointer().restore(<step>/state, ...)`` reads, and checks nothing of —
    does not hold exactly ``state``: the model state just read from the checkpoint and
    verified (crc32s, manifest). Nothing to check when the checkpoint has no item.

    Raises:
      CorruptCheckpointError: the item is a symbolic link, cannot be read, or holds other
        values (a flipped bit, another run's item), naming the first differing leaf.
    """
    item = where / _files.ITEM
    if not os.path.lexists(item):
        return

    def refuse(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"checkpoint {where.parent} step {where.name}: its {_files.ITEM}/ item, what "
            f"Flax's StandardCheckpointer restores (without any check), {what}: Flax's code "
            f"would load other weights than the checkpoint's verified ones."
        )

    if item.is_symlink():
        raise refuse(f"is a symbolic link (to {os.readlink(item)})")
    ocp = orbax()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    checkpointer = ocp.StandardCheckpointer()
    try:
        restored = checkpointer.restore(item, abstract)
    except Exception as error:  # orbax raises many kinds for a damaged or foreign item
        raise refuse(f"cannot be read ({type(error).__name__}: {error})") from None
    finally:
        checkpointer.close()
    want = jax.tree_util.tree_flatten_with_path(state)[0]
    got = jax.tree.leaves(restored)
    if len(got) != len(want):
        raise refuse(f"holds {len(got)} arrays where the model state has {len(want)}")
    for (path, a), b in zip(want, got, strict=True):
        a, b = _raw_bytes(a), _raw_bytes(b)
        if a.shape != b.shape or not np.array_equal(a, b):
            raise refuse(f"holds other values at {jax.tree_util.keystr(path)}")


def _raw_bytes(array: Any) -> np.ndarray:
    """An array's bytes (a PRNG key's raw data), to compare bitwise (NaNs included)."""
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        array = jax.random.key_data(array)
    host = np.ascontiguousarray(np.asarray(array))
    return host.view(np.uint8).reshape(*host.shape, host.dtype.itemsize)
