"""What a checkpoint's manifest may say, checked whole before anything is read or written.

A checkpoint directory may come from anywhere (a colleague, a download, a disk that flipped a
bit), so its manifest is untrusted input: every record is validated against a fixed schema
before a byte of ``arrays.bin`` is read, before anything is allocated from a size it states
and before anything reaches a model. The rules:

- the format name and a version this nnxscan knows (1 to :data:`VERSION`);
- each leaf: a string path (unique), a known kind, a shape of non-negative ints, a dtype
  from :data:`DTYPES` (never ``object``), a known PRNG implementation for keys, a Python
  value of its kind's type for Python leaves;
- a packed leaf names a buffer the manifest lists, starts at a non-negative element offset,
  and its elements (``data_shape``: the shape, plus the key data's trailing axis for keys)
  lie inside that buffer; the buffer's dtype is the leaf's (a key's data is uint32);
- each buffer: a non-negative byte offset and element count whose bytes lie inside
  ``arrays.bin`` (the only file buffers are read from), a dtype from :data:`DTYPES`, and
  (version 4) a crc32 of its bytes, checked when it is read; in orbax's storage (version
  5) each packed buffer (an orbax array of ``arrays/``) carries its crc32 too;
- (orbax's storage, version 6) each array orbax writes shard by shard lists its distinct
  shards: blocks inside it (a ``[start, stop)`` per axis) that tile it, each with the
  crc32 of its bytes (``_checkpoint_shards.py``).

Every refusal is a :class:`CorruptCheckpointError` (a ValueError) naming the checkpoint
directory, the step, the leaf path or buffer, and what is wrong.

The manifest file itself carries a crc32 of its JSON text (:func:`dumps_checked`): a
flipped bit anywhere in it is caught before it is parsed into records. Orbax's storage
writes the same text (orbax's ``JsonSave`` writes ``json.dumps`` of the record, which is
:func:`dumps_checked`'s text when the record's first member is its crc32:
:func:`with_crc32`) since version 5; its manifests of version 4 and before carry none.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import zlib
from typing import Any

import jax.numpy as jnp
import numpy as np

FORMAT = "nnxscan.checkpoint"
# 2: small arrays packed into one buffer per dtype; 3: own files storage; 4: crc32s of the
# manifest and of every buffer (and the model state as an orbax item, beside); 5: the same
# crc32s in orbax's storage (its manifest, and its packed buffers); 6: and of each shard of
# the arrays orbax writes shard by shard ("shards": _checkpoint_shards.py).
VERSION = 6
PYTHON_KINDS = {"bool": bool, "int": int, "float": float, "str": str}
ARRAY_KINDS = ("array", "key")
# The key implementations jax ships, with the trailing shape of their raw key data.
KEY_DATA_SHAPES = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}
_DTYPE_NAMES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bfloat16", "int4", "uint4",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz", "float8_e4m3fnuz", "float8_e5m2fnuz",
)  # fmt: skip


def _known_dtypes() -> frozenset[str]:
    known = set()
    for name in _DTYPE_NAMES:
        try:
            known.add(jnp.dtype(name).name)
        except TypeError:  # an older ml_dtypes without this float8 variant
            continue
    return frozenset(known)


#: The dtypes a checkpoint may hold (and a reader may allocate).
DTYPES = _known_dtypes()

DATA = "arrays.bin"


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files are damaged, incomplete or not what nnxscan writes.

    Raised (with the checkpoint directory, the step, the leaf or file, and what is wrong)
    before anything it holds is read into a model. ``fit(resume=True)`` and
    ``Trainer.restore()`` without a step skip such a checkpoint, with a warning, and restore
    the newest good one; a template that does not fit a checkpoint is a plain ValueError,
    never skipped (an older checkpoint would not fit either).
    """


@dataclasses.dataclass(frozen=True)
class Leaf:
    """What one leaf is, as the manifest records it (the saved side) or a template has it."""

    path: str
    kind: str  # "array", "key", or a key of PYTHON_KINDS
    shape: tuple[int, ...] = ()
    dtype: str = ""
    impl: str = ""  # PRNG implementation name, for keys
    name: str = ""  # the array's name in an orbax item, for arrays sharded over devices
    value: Any = None  # the value itself, for Python leaves
    buffer: str = ""  # the buffer of its elements (chosen by _checkpoint_packing._packing)
    offset: int = 0  # where in that buffer its elements start
    data_shape: tuple[int, ...] = ()  # the elements' shape (a key's raw data: + the impl's)
    # A sharded array's distinct shards: ((start, stop) per axis, crc32) (orbax's storage).
    shards: tuple[tuple[tuple[tuple[int, int], ...], str], ...] = ()

    def describe(self) -> str:
        if self.kind == "array":
            return f"shape {self.shape} {self.dtype}"
        if self.kind == "key":
            return f"shape {self.shape} {self.dtype} (PRNG keys)"
        return f"a Python {self.kind}"

    def fits(self, other: Leaf) -> bool:
        if self.kind in ARRAY_KINDS:
            return (self.kind, self.shape, self.dtype) == (other.kind, other.shape, other.dtype)
        return self.kind == other.kind

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"path": self.path, "kind": self.kind}
        if self.kind in ARRAY_KINDS:
            record.update(shape=list(self.shape), dtype=self.dtype, name=self.name)
            if self.kind == "key":
                record["impl"] = self.impl
            if self.buffer:
                record.update(
                    buffer=self.buffer, offset=self.offset, data_shape=list(self.data_shape)
                )
        else:
            record["value"] = self.value
        return record


# -- checked JSON ---------------------------------------------------------------------------

_CRC_PREFIX = b'{"crc32": "'
_CRC_END = len(_CRC_PREFIX) + 8  # then '", ' and the rest of the object


def dumps_checked(record: dict[str, Any]) -> bytes:
    """``record`` as JSON whose first member is the crc32 of the rest of the text.

    Still one plain JSON object (any JSON reader reads it; the crc is one more member);
    :func:`loads_checked` verifies it. The text without the crc member is
    ``json.dumps(record)``, so checking costs one crc32 of the bytes, no re-serialization.
    """
    body = json.dumps(record).encode()
    if body == b"{}":
        return b'{"crc32": "%08x"}' % zlib.crc32(body)
    return b'{"crc32": "%08x", ' % zlib.crc32(body) + body[1:]


def buffer_crc32(buffer: Any) -> str:
    """The crc32 a manifest records for a buffer: of its raw bytes, in C order, as eight
    hex digits (both storages, written and checked alike)."""
    return f"{zlib.crc32(np.ascontiguousarray(buffer).reshape(-1).view(np.uint8)):08x}"


def check_buffer_read(
    name: str, stored_in: str, got: int, want: int, unit: str, data: Any, crc: str | None
) -> None:
    """A buffer read back whole (``got`` of its ``want`` ``unit``) with the bytes its crc32
    (when the manifest has one) says, in either storage.

    Raises:
      ValueError: naming the buffer, where it is stored, and what is wrong.
    """
    if got < want:
        raise ValueError(
            f"buffer {name!r}: {stored_in} ended after {got} of its {want} {unit} (truncated)"
        )
    if crc is not None and buffer_crc32(data) != crc:
        raise ValueError(
            f"buffer {name!r} in {stored_in}: its bytes do not match their crc32 (damaged on disk)"
        )


def with_crc32(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with a first member ``crc32``: ``json.dumps`` of it (what orbax's
    ``JsonSave`` writes) is :func:`dumps_checked`'s text, which :func:`loads_checked`
    verifies."""
    return {"crc32": f"{zlib.crc32(json.dumps(record).encode()):08x}", **record}


def loads_checked(raw: bytes) -> tuple[Any, bool]:
    """Parses ``raw``; returns ``(record, checked)``. ``checked`` is False for text that
    carries no crc (written before version 4). Raises ValueError for text that does not
    parse, or whose crc does not match (a flipped bit, a torn write)."""
    if raw.startswith(_CRC_PREFIX) and raw[_CRC_END : _CRC_END + 3] == b'", ':
        expected = raw[len(_CRC_PREFIX) : _CRC_END]
        body = b"{" + raw[_CRC_END + 3 :]
        if b"%08x" % zlib.crc32(body) != expected:
            raise ValueError("its crc32 does not match its bytes (damaged or torn)")
        record = json.loads(body)
        return record, True
    try:
        return json.loads(raw), False
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"it is not valid JSON ({error.msg} at byte {error.pos})") from None


# -- the manifest -------------------------------------------------------------------------


#: The run's counters every checkpoint's meta holds as non-negative ints, attributes of
#: every owner of the shell: a new one is added here, and nowhere else.
COUNTERS = ("epoch", "step", "epoch_step")


def check_meta_ints(
    meta: dict[str, Any], names: tuple[str, ...] = COUNTERS, where: str = ""
) -> None:
    """A restored checkpoint's counters must be non-negative ints (a corrupted or crafted one raises
    before anything is written, and changes nothing); ``where``: the checkpoint, for the message."""
    for name in names:
        value = meta[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CorruptCheckpointError(
                f"{where or 'checkpoint'}: leaf ['meta']['{name}'] is {value!r}, not a "
                f"non-negative int: the checkpoint is damaged or was not written by nnxscan."
            )


class _Refusal:
    """Builds the errors of one manifest's validation: each names where and what."""

    def __init__(self, where: pathlib.Path):
        self.where = where

    def __call__(self, what: str, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"checkpoint {self.where.parent} step {self.where.name}: {what}: {problem}."
        )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape(value: Any) -> bool:
    return isinstance(value, list) and all(_count(n) for n in value)


def _elements(shape: tuple[int, ...]) -> int:
    size = 1
    for n in shape:
        size *= n
    return size


def validate(
    raw: Any,
    where: pathlib.Path,
    data_size: int | bool | None = False,
    *,
    checked: bool = True,
) -> tuple[list[Leaf], dict[str, dict[str, Any]]]:
    """Validates a whole manifest; returns its leaf records and its buffers.

    Args:
      raw: the parsed manifest.
      where: the step's directory (named in errors).
      data_size: the size in bytes of ``arrays.bin`` (None if missing), for nnxscan's
        own files storage: every buffer must lie inside it. False for orbax's storage,
        whose packed buffers are orbax arrays (their sizes are checked on read).
      checked: the manifest carried a matching crc32 (required from version 4 in own
        files, from version 5 in orbax's storage).

    Raises:
      CorruptCheckpointError: the first thing wrong, named.
    """
    refuse = _Refusal(where)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise refuse("manifest", "it was not written by nnxscan.adapters.checkpoint")
    version = raw.get("version")
    if not _count(version) or version < 1:
        raise refuse("manifest", f"format version {version!r} is not a version number")
    if version > VERSION:
        raise CorruptCheckpointError(
            f"checkpoint {where} has format version {version}, newer than this nnxscan "
            f"reads ({VERSION}): upgrade nnxscan"
        )
    own_files = data_size is not False
    if not checked and (version >= 5 or (version >= 4 and own_files)):
        raise refuse("manifest", f"version {version} manifests carry a crc32, this one has none")
    leaves = raw.get("leaves")
    if not isinstance(leaves, list):
        raise refuse("manifest", "it has no list of leaves")
    declared = raw.get("buffers")
    if declared is None and not own_files and version < 4:
        declared = _legacy_orbax_buffers(leaves)
    buffers = _validate_buffers(declared or {}, version, refuse, data_size)
    records, seen = [], set()
    for index, entry in enumerate(leaves):
        record = _validate_leaf(entry, index, buffers, refuse, packed_only=own_files)
        if record.path in seen:
            raise refuse(f"leaf {record.path}", "it is listed twice")
        seen.add(record.path)
        records.append(record)
    _refuse_overlaps(records, refuse)
    if not own_files and version >= 6:
        records = _validate_shards(raw.get("shards"), records, refuse)
    return records, buffers


def _validate_shards(shards: Any, records: list[Leaf], refuse: _Refusal) -> list[Leaf]:
    """Each array orbax wrote shard by shard lists its shards' blocks and crc32s: blocks
    inside the array that tile it (no element twice, none left out), 8 hex digits each."""
    if not isinstance(shards, dict):
        raise refuse("manifest", "it has no crc32s of its sharded arrays")
    sharded = {record.name: record for record in records if record.name}
    unknown = sorted(set(shards) - set(sharded))
    if unknown:
        raise refuse("manifest", f"it lists shards of {unknown[0]!r}, which no leaf names")
    out = []
    for record in records:
        if not record.name:
            out.append(record)
            continue
        what = f"leaf {record.path}"
        shape = record.shape + (KEY_DATA_SHAPES[record.impl] if record.kind == "key" else ())
        entry = shards.get(record.name)
        if not isinstance(entry, list) or not entry:
            raise refuse(what, f"its shards ({record.name}) carry no crc32s")
        held = []
        for item in entry:
            block, crc = item if isinstance(item, list) and len(item) == 2 else (None, None)
            ok = isinstance(block, list) and len(block) == len(shape)
            ok = ok and all(
                isinstance(b, list) and len(b) == 2 and _count(b[0]) and _count(b[1])
                and b[0] <= b[1] <= n for b, n in zip(block, shape, strict=False)
            )  # fmt: skip
            if not ok:
                raise refuse(what, f"shard {item!r} is not a block of shape {list(shape)}")
            if not (isinstance(crc, str) and re.fullmatch(r"[0-9a-f]{8}", crc)):
                raise refuse(what, f"the crc32 {crc!r} of a shard is not 8 hex digits")
            held.append((tuple((b[0], b[1]) for b in block), crc))
        _refuse_untiled(held, shape, what, refuse)
        out.append(dataclasses.replace(record, shards=tuple(held)))
    return out


def _refuse_untiled(held: list, shape: tuple[int, ...], what: str, refuse: _Refusal) -> None:
    """The blocks cover the array exactly once: disjoint, their sizes summing to its own."""
    sizes = [_elements(tuple(b1 - b0 for b0, b1 in block)) for block, _ in held]
    for i, (a, _) in enumerate(held):
        for b, _ in held[:i]:
            if all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b, strict=True)):
                raise refuse(what, f"its shards {list(a)} and {list(b)} overlap")
    if sum(sizes) != _elements(shape):
        raise refuse(what, f"its shards hold {sum(sizes)} of its {_elements(shape)} elements")


def _refuse_overlaps(records: list[Leaf], refuse: _Refusal) -> None:
    """Leaves share no element of a buffer: nnxscan packs them one after another, so a
    leaf whose elements lie inside another's (a crafted offset) would load that other
    leaf's values silently."""
    by_buffer: dict[str, list[tuple[int, int, str]]] = {}
    for record in records:
        if record.buffer:
            end = record.offset + _elements(record.data_shape)
            by_buffer.setdefault(record.buffer, []).append((record.offset, end, record.path))
    for buffer, spans in by_buffer.items():
        reached, holder = 0, ""  # the furthest element the leaves so far hold, and whose
        for start, end, path in sorted(spans):
            if start < min(end, reached):
                raise refuse(
                    f"leaf {path}",
                    f"its elements [{start}, {end}) overlap those of leaf {holder} (up to "
                    f"{reached}) in buffer {buffer!r}",
                )
            if end > reached:
                reached, holder = end, path


def _legacy_orbax_buffers(leaves: list) -> dict[str, dict[str, Any]]:
    """The packed buffers a manifest of orbax's storage before version 4 implies (it did not
    list them): ``pack_<dtype>`` of the dtype in its name, as long as its leaves reach. The
    arrays orbax reads back are checked against these sizes."""
    buffers: dict[str, dict[str, Any]] = {}
    for entry in leaves:
        pack = entry.get("pack") if isinstance(entry, dict) else None
        if not isinstance(pack, str) or not pack.startswith("pack_"):
            continue
        shape = entry.get("data_shape")
        offset = entry.get("offset")
        end = offset + _elements(tuple(shape)) if _shape(shape) and _count(offset) else 0
        held = buffers.setdefault(pack, {"dtype": pack[len("pack_") :], "size": 0})
        held["size"] = max(held["size"], end)
    return buffers


def _validate_buffers(
    buffers: Any, version: int, refuse: _Refusal, data_size: int | bool | None
) -> dict[str, dict[str, Any]]:
    if not isinstance(buffers, dict):
        raise refuse("manifest", "its buffers are not a mapping")
    out = {}
    for name, entry in buffers.items():
        what = f"buffer {name!r}"
        if not isinstance(entry, dict):
            raise refuse(what, "its record is not a mapping")
        dtype, size = entry.get("dtype"), entry.get("size")
        if dtype not in DTYPES:
            raise refuse(what, f"dtype {dtype!r} is not one a checkpoint holds")
        if not _count(size):
            raise refuse(what, f"element count {size!r} is not a non-negative int")
        record = {"dtype": dtype, "size": size}
        if data_size is not False:  # nnxscan's own files: a byte range of arrays.bin
            if "file" in entry and entry["file"] != DATA:
                raise refuse(what, f"file {entry['file']!r} is not the checkpoint's {DATA}")
            offset = entry.get("offset")
            if not _count(offset):
                raise refuse(what, f"byte offset {offset!r} is not a non-negative int")
            nbytes = size * jnp.dtype(dtype).itemsize
            if data_size is None:
                raise refuse(what, f"its file {DATA} is missing")
            if offset + nbytes > data_size:
                raise refuse(
                    what,
                    f"it needs bytes [{offset}, {offset + nbytes}) of {DATA}, which holds "
                    f"{data_size} bytes (truncated?)",
                )
            record.update(offset=offset, nbytes=nbytes)
        crc = entry.get("crc32")
        if version >= (4 if data_size is not False else 5):
            if not (isinstance(crc, str) and re.fullmatch(r"[0-9a-f]{8}", crc)):
                raise refuse(what, f"crc32 {crc!r} is not 8 hex digits")
            record["crc32"] = crc
        out[name] = record
    return out


def _validate_leaf(
    entry: Any,
    index: int,
    buffers: dict[str, dict[str, Any]],
    refuse: _Refusal,
    packed_only: bool,
) -> Leaf:
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        raise refuse(f"leaf #{index}", "its record has no path")
    path, kind = entry["path"], entry.get("kind")
    what = f"leaf {path}"
    if kind in PYTHON_KINDS:
        value = entry.get("value")
        # bool is an int; an int is not a float (JSON writes 1.0 as 1.0, so a float comes
        # back a float; an int written as a float would be another value's type).
        if type(value) is not PYTHON_KINDS[kind]:
            raise refuse(what, f"value {value!r} is not a Python {kind}")
        return Leaf(path, kind, value=value)
    if kind not in ARRAY_KINDS:
        raise refuse(what, f"kind {kind!r} is unknown")
    shape, dtype = entry.get("shape"), entry.get("dtype")
    if not _shape(shape):
        raise refuse(what, f"shape {shape!r} is not a list of non-negative ints")
    shape = tuple(shape)
    impl = entry.get("impl", "")
    if kind == "key":
        if impl not in KEY_DATA_SHAPES:
            raise refuse(what, f"PRNG implementation {impl!r} is unknown")
        if not isinstance(dtype, str) or not dtype.startswith("key<"):
            raise refuse(what, f"dtype {dtype!r} is not a PRNG key dtype")
        data_dtype, wanted = "uint32", shape + KEY_DATA_SHAPES[impl]
    else:
        if dtype not in DTYPES:
            raise refuse(what, f"dtype {dtype!r} is not one a checkpoint holds")
        data_dtype, wanted = dtype, shape
    name = entry.get("name", "")
    buffer = entry.get("buffer", entry.get("pack", ""))  # "pack": versions 2 and 3
    if not isinstance(name, str) or not isinstance(buffer, str):
        raise refuse(what, "its array name or buffer is not a string")
    if not buffer:
        if packed_only or not re.fullmatch(r"leaf_\d{5}", name):
            raise refuse(what, "it names no buffer holding its elements")
        return Leaf(path, kind, shape, dtype, impl, name)
    data_shape, offset = entry.get("data_shape"), entry.get("offset")
    if not _shape(data_shape) or tuple(data_shape) != wanted:
        raise refuse(what, f"data_shape {data_shape!r} is not {list(wanted)}")
    if not _count(offset):
        raise refuse(what, f"element offset {offset!r} is not a non-negative int")
    held = buffers.get(buffer)
    if held is None:
        raise refuse(what, f"its buffer {buffer!r} is not among the manifest's buffers")
    if held["dtype"] != data_dtype:
        raise refuse(what, f"its buffer {buffer!r} holds {held['dtype']}, not {data_dtype}")
    end = offset + _elements(wanted)
    if end > held["size"]:
        raise refuse(
            what,
            f"its elements [{offset}, {end}) lie outside buffer {buffer!r} of "
            f"{held['size']} elements",
        )
    return Leaf(path, kind, shape, dtype, impl, name, None, buffer, offset, wanted)
