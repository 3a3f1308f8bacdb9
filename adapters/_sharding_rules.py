"""The rules that give one leaf of a carry its ``PartitionSpec``, on plain pytrees: path
rules, the FSDP rule, annotations read as ``nnx.get_partition_spec`` reads them (Flax's
``flax.core.spmd`` stays behind this edge), and which optax leaf belongs to which
parameter. The shell's placement applies them in order (docs/scaling.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import NamedSharding, PartitionSpec

from nnxscan.pure import split_wrt


def fsdp_spec(shape: tuple[int, ...], axis_size: int, axis: Any, min_size: int) -> PartitionSpec:
    """The FSDP rule: shard the largest dimension that ``axis_size`` divides over ``axis``.

    Arrays with fewer than ``min_size`` elements, and those with no such dimension, stay
    replicated. Parameters and their optax moments share a shape, so they shard alike.

    Example:
      >>> fsdp_spec((784, 512), 4, "data", 2**16)
      PartitionSpec('data', None)
    """
    if int(np.prod(shape, dtype=np.int64)) < min_size:
        return PartitionSpec()
    candidates = [d for d in range(len(shape)) if shape[d] % axis_size == 0 and shape[d] > 1]
    if not candidates:
        return PartitionSpec()
    dim = max(candidates, key=lambda d: (shape[d], -d))
    return PartitionSpec(*[axis if d == dim else None for d in range(len(shape))])


def spec_names(spec: PartitionSpec) -> list[str]:
    names = []
    for entry in spec:
        if entry is None:
            continue
        names += list(entry) if isinstance(entry, tuple) else [entry]
    return names


def leaf_path(path: tuple) -> str:
    """A variable's path as ``layers/dot1/kernel`` (what path rules match); an optax leaf's
    as ``nnx.state(optimizer)`` spells it after ``opt_state/``: ``0/mu/layers/dot1/kernel``."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def check_rules(rules: Any) -> tuple[tuple[re.Pattern, PartitionSpec], ...]:
    """``shardings={regex: spec}`` as compiled patterns and PartitionSpecs (checked now)."""
    if rules is None:
        return ()
    if not isinstance(rules, Mapping):
        raise TypeError(
            f"shardings must map a regular expression on variable paths (e.g. "
            f"r'attn/.*/kernel') to a PartitionSpec, got {type(rules).__name__}."
        )
    checked = []
    for pattern, spec in rules.items():
        try:
            compiled = re.compile(pattern)
        except (re.error, TypeError) as error:
            message = f"shardings: {pattern!r} is not a regular expression: {error}"
            raise ValueError(message) from None
        if isinstance(spec, tuple | list) or spec is None:
            spec = PartitionSpec(*(spec or ()))
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"shardings[{pattern!r}] must be a PartitionSpec (or a tuple of axis names), "
                f"got {type(spec).__name__}."
            )
        checked.append((compiled, spec))
    return tuple(checked)


class _Index:
    """A parameter's position, as a leaf (what ``tree_map_params`` carries to its moments)."""

    __slots__ = ("i",)

    def __init__(self, i: int | None):
        self.i = i


def is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def same_spec(a: PartitionSpec, b: PartitionSpec | None) -> bool:
    """Two specs that shard alike (trailing ``None`` entries say nothing)."""
    if b is None:
        return False
    a, b = list(a), list(b)
    while a and a[-1] is None:
        a.pop()
    while b and b[-1] is None:
        b.pop()
    return a == b


def annotated_spec(annotation: Any, metadata: dict) -> PartitionSpec:
    """An annotation's PartitionSpec, logical names mapped as ``nnx.get_partition_spec``
    maps ``out_sharding`` (the context's ``nnx.logical_axis_rules``, the variable's own)."""
    if core_spmd.get_logical_axis_rules() or "sharding_rules" in metadata:
        rules = core_spmd.composite_rules(
            core_spmd.get_logical_axis_rules(), metadata.get("sharding_rules", ())
        )
        return PartitionSpec(*core_spmd.from_sharding_rules(annotation, rules))
    return PartitionSpec(*annotation)


def replicated_on_one(sharding: NamedSharding) -> bool:
    """A NamedSharding that shards nothing (``P()``) says no more than "unannotated"."""
    return not spec_names(sharding.spec)


def parameters_of(tx: Any, wrt: Any, state: Any, opt_state: Any) -> list[int | None]:
    """For each leaf of ``opt_state`` (``tx``'s state for the ``wrt`` part of ``state``), the
    index of its parameter among ``state``'s leaves (a moment), or None (a counter; or
    every leaf when the transform does not say: ``tx`` None, or not mappable). A wrapper's
    state around ``tx``'s (a NamedTuple whose ``inner`` is it: ``MembersState``) maps its
    ``inner``; its own fields are no parameter's."""
    count = len(jax.tree.leaves(opt_state))
    if tx is None:
        return [None] * count
    fields = getattr(opt_state, "_fields", ())
    if fields and fields[0] == "inner":
        inner = parameters_of(tx, wrt, state, opt_state.inner)
        return inner + [None] * (count - len(inner))
    treedef = jax.tree.structure(state)
    indices = jax.tree.unflatten(treedef, [_Index(i) for i in range(treedef.num_leaves)])
    params, _ = split_wrt(indices, wrt)
    try:
        mapped = optax.tree_utils.tree_map_params(
            tx, lambda _, index: index, opt_state, params,
            transform_non_params=lambda leaf: jax.tree.map(lambda _: _Index(None), leaf),
            is_leaf=lambda x: isinstance(x, _Index),
        )  # fmt: skip
    except Exception:
        return [None] * count
    found = jax.tree.leaves(mapped, is_leaf=lambda x: isinstance(x, _Index))
    if len(found) != count or not all(isinstance(x, _Index) for x in found):
        return [None] * count
    return [x.i for x in found]
