"""The caches of compiled programs: keys that hash once, kept most recent first.

A compiled function rebuilt from a fresh closure on every call recompiles every time, so
``programs.py`` keeps its programs in small ordered caches, keyed by what they close over.
Keys hold graphdefs, whose hash walks the whole graph: a key hashes once, and a graphdef's
hash is remembered by identity (the owner's reads give the same graphdef object call after
call: ``snapshot.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from flax import nnx

#: The most programs (or graphdef hashes) a cache keeps.
MAX_CACHED = 32


def identity_key(obj: Any) -> Hashable:
    """``obj`` itself as a key when it hashes, else its identity (a function object that
    defines ``__eq__`` without ``__hash__``, say)."""
    try:
        hash(obj)
        return obj
    except TypeError:
        return ("id", id(obj))


class _HashOnce:
    """A cache key that hashes once: hashing a GraphDef walks the whole graph."""

    __slots__ = ("hash", "key")

    def __init__(self, key: Hashable):
        try:
            self.hash = hash(tuple(map(_hash_of, key))) if type(key) is tuple else _hash_of(key)
        except TypeError:
            # A Variable with dict metadata (nnx.Param(x, info={...})) makes a treedef or
            # graphdef unhashable; its repr is deterministic and says the same.
            key = ("repr", repr(key))
            self.hash = hash(key)
        self.key = key

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HashOnce) and self.hash == other.hash and self.key == other.key


# Hashes of the graphdefs looked up lately, by identity: the owner's reads give the same
# graphdef object call after call (shell/_engine/snapshot.py), and hashing one walks its
# whole graph, more than once per call: a host cost that grows with the model.
_GRAPHDEF_HASHES: OrderedDict[int, tuple[Any, int]] = OrderedDict()


def _hash_of(x: Any) -> int:
    if not isinstance(x, nnx.GraphDef):
        return hash(x)
    known = _GRAPHDEF_HASHES.get(id(x))
    if known is not None and known[0] is x:
        _GRAPHDEF_HASHES.move_to_end(id(x))
        return known[1]
    value = hash(x)
    _GRAPHDEF_HASHES[id(x)] = (x, value)  # holding x keeps its id from being reused
    if len(_GRAPHDEF_HASHES) > MAX_CACHED:
        _GRAPHDEF_HASHES.popitem(last=False)
    return value


def lookup(cache: OrderedDict, key: Hashable, build: Callable[[], Any]) -> Any:
    """``cache[key]``, built by ``build()`` on a miss; the most recent :data:`MAX_CACHED`
    entries are kept."""
    key = _HashOnce(key)
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
        return value
    value = cache[key] = build()
    if len(cache) > MAX_CACHED:
        cache.popitem(last=False)
    return value
