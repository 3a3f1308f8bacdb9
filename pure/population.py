"""Populations: many models of one architecture, trained side by side in one traced function.

A population is N members that share a ``graphdef``: their states are stacked along a new
leading members axis (:func:`stack_states`), and the ONE pure step of
:func:`~nnxscan.pure.make_train_step` is ``jax.vmap``-ed over that axis. Each member keeps
its own parameters, batch statistics, RNG state and optax state, and shuffles the shared
data by its own order. Per-member hyperparameters ride in the optax state of a transform
made with ``optax.inject_hyperparams`` (:func:`with_hyperparams`), so they are data, not
code: one compiled program trains every learning rate of a sweep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnxscan.pure._checks import check_batch_size, check_leading_size
from nnxscan.pure.nonfinite import tree_select
from nnxscan.pure.scan import scan_indexed_steps
from nnxscan.pure.train_step import StepFn

__all__ = ["make_population_epoch", "stack_states", "unstack_states", "with_hyperparams"]


def _paths(tree: Any) -> dict[str, Any]:
    """``{path: leaf}`` of a pytree, paths as readable strings."""
    return {
        jax.tree_util.keystr(path) or "<root>": leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], str]:
    return tuple(np.shape(leaf)), str(leaf.dtype)


def stack_states(states: Sequence[Any]) -> Any:
    """Stacks equally-structured pytrees along a new leading members axis.

    Args:
      states: a non-empty list of pytrees with the same structure, and the same shape and
        dtype at every leaf: ``nnx.split`` states of one architecture, their optax states.
        PRNG key leaves (``nnx.RngKey``) stack like any other.

    Returns:
      One pytree of that structure whose every leaf has a leading axis of ``len(states)``.

    Raises:
      ValueError: the list is empty, or two entries differ in structure (the paths found
        in one but not the other are named) or in a leaf's shape or dtype.

    Example:
      >>> states = [nnx.split(MLP(nnx.Rngs(seed)))[1] for seed in range(4)]
      >>> stacked = stack_states(states)
      >>> stacked["l1"]["kernel"].shape
      (4, 2, 16)
    """
    if not isinstance(states, list | tuple) or not states:
        kind = type(states).__name__
        what = f"an empty {kind}" if isinstance(states, list | tuple) else f"a {kind}"
        raise ValueError(f"stack_states needs a non-empty list of pytrees, got {what}.")
    first = _paths(states[0])
    first_def = jax.tree.structure(states[0])
    for i, state in enumerate(states[1:], start=1):
        if jax.tree.structure(state) != first_def:
            paths = _paths(state)
            only_first = sorted(set(first) - set(paths))[:3]
            only_this = sorted(set(paths) - set(first))[:3]
            raise ValueError(
                f"states[{i}] has a different structure from states[0] (paths only in "
                f"states[0]: {only_first or 'none'}; only in states[{i}]: "
                f"{only_this or 'none'}). Every member must be built by the same code: one "
                f"architecture, one optax transform."
            )
        for path, leaf in _paths(state).items():
            if _shape_dtype(leaf) != _shape_dtype(first[path]):
                raise ValueError(
                    f"states[{i}]{path} has shape/dtype {_shape_dtype(leaf)} but states[0] "
                    f"has {_shape_dtype(first[path])}: members must match leaf for leaf."
                )
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)


def members_of(stacked: Any, what: str = "states") -> int:
    """The size of the leading members axis every leaf of ``stacked`` shares."""
    leaves = _paths(stacked)
    if not leaves:
        raise ValueError(f"{what} has no array leaves, so it holds no members.")
    sizes = {path: (np.shape(leaf)[:1] or (None,))[0] for path, leaf in leaves.items()}
    first_path, size = next(iter(sizes.items()))
    for path, other in sizes.items():
        if other is None or other != size:
            raise ValueError(
                f"{what} is not a stack of members: {what}{first_path} has leading size "
                f"{size} but {what}{path} has shape {tuple(np.shape(leaves[path]))}. Build "
                f"it with stack_states([...])."
            )
    return int(size)


def unstack_states(stacked: Any) -> list[Any]:
    """Splits a stacked pytree (:func:`stack_states`) back into one pytree per member.

    Example:
      >>> states = unstack_states(stacked)
      >>> model_2 = nnx.merge(graphdef, states[2])
    """
    size = members_of(stacked, "stacked")
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(size)]


def _is_injected(node: Any) -> bool:
    """An ``optax.inject_hyperparams`` state: a NamedTuple with a ``hyperparams`` dict."""
    return (
        isinstance(node, tuple)
        and hasattr(node, "_replace")
        and isinstance(getattr(node, "hyperparams", None), dict)
    )


def _injected_states(opt_state: Any) -> list[Any]:
    return [n for n in jax.tree.leaves(opt_state, is_leaf=_is_injected) if _is_injected(n)]


def hyperparam_names(opt_state: Any) -> tuple[set[str], set[str]]:
    """``(settable, scheduled)``: the numeric hyperparameter names ``inject_hyperparams``
    keeps in ``opt_state``, and those among them that a schedule recomputes every step."""
    settable: set[str] = set()
    scheduled: set[str] = set()
    for node in _injected_states(opt_state):
        names = set(node.hyperparams)
        schedules = set(getattr(node, "hyperparams_states", None) or {})
        settable |= names - schedules
        scheduled |= schedules
    return settable, scheduled


def injected_values(opt_state: Any, name: str) -> Any:
    """The value of hyperparameter ``name`` in the first injected state holding it (an
    array with a leading members axis in a stacked state), or None."""
    for node in _injected_states(opt_state):
        if name in node.hyperparams:
            return node.hyperparams[name]
    return None


def with_hyperparams(opt_state: Any, **values: Any) -> Any:
    """A copy of ``opt_state`` with the named ``inject_hyperparams`` values replaced.

    Build the transform with ``optax.inject_hyperparams`` (e.g.
    ``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``): its state then holds its
    numeric hyperparameters, and ``tx.update`` reads them from there. Setting each member's
    value before :func:`stack_states` gives every member its own hyperparameter in one
    compiled program. Each value keeps the dtype of the value it replaces; a name held by
    several injected states (a chain of them) is set in each. Nothing is changed in place.

    Raises:
      ValueError: ``opt_state`` holds no injected hyperparameters, a name is not one of
        them (the existing names are listed), a name is driven by a schedule (setting it
        would have no effect), or a value is not a scalar.

    Example:
      >>> tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
      >>> opt_state = with_hyperparams(init_opt_state(tx, state), learning_rate=3e-4)
      >>> float(opt_state.hyperparams["learning_rate"])
      0.0003
    """
    settable, scheduled = hyperparam_names(opt_state)
    if not settable and not scheduled:
        raise ValueError(
            "this optax state holds no injected hyperparameters: build the transform with "
            "optax.inject_hyperparams, e.g. optax.inject_hyperparams(optax.adam)"
            "(learning_rate=1e-3)."
        )
    for name, value in values.items():
        if name in scheduled:
            raise ValueError(
                f"hyperparameter {name!r} is a schedule, recomputed every step: a value set "
                f"in the state has no effect. Pass a number for it to inject_hyperparams."
            )
        if name not in settable:
            raise ValueError(
                f"{name!r} is not a hyperparameter of this transform; its injected "
                f"hyperparameters are {sorted(settable)}."
            )
        if np.ndim(value) != 0:
            raise ValueError(
                f"hyperparameter {name!r} must be a scalar, got shape {np.shape(value)}."
            )

    def replace(node: Any) -> Any:
        if not _is_injected(node):
            return node
        old = node.hyperparams
        new = {
            k: jnp.asarray(values[k], jnp.result_type(v)) if k in values else v
            for k, v in old.items()
        }
        return node._replace(hyperparams=new)

    return jax.tree.map(replace, opt_state, is_leaf=_is_injected)


def _frozen_aware(step: StepFn, active: jax.Array) -> StepFn:
    """``step`` for ONE member that changes nothing while ``active`` is False: the loss is
    still computed (at the frozen state) and reported."""

    def guarded(graphdef, state, opt_state, batch):
        new_state, new_opt_state, out = step(graphdef, state, opt_state, batch)
        state = tree_select(active, new_state, state)
        return state, tree_select(active, new_opt_state, opt_state), out

    return guarded


def scan_population_steps(
    step: StepFn,
    graphdef: Any,
    states: Any,
    opt_states: Any,
    data: Any,
    indices: jax.Array,
    *,
    active: jax.Array | None = None,
    unroll: int | bool = 1,
    member_axis: str | None = None,
    batch_sharding: jax.sharding.Sharding | None = None,
) -> tuple[Any, Any, Any]:
    """The body every population call runs: ``scan_indexed_steps`` vmapped over the members.

    ``indices`` has shape ``(N, steps, batch)``: member ``i`` trains the batches
    ``indices[i]`` gathered from the shared ``data``. ``active`` (``(N,)`` bool) freezes the
    members where it is False: their state and optax state stay as they are at every step.
    ``member_axis`` names the mesh axis the members are sharded over (``vmap``'s
    ``spmd_axis_name``), so a ``batch_sharding`` of one member's batch becomes a sharding
    of the members' batches over both axes. Returns the outputs with a leading steps axis,
    then members: ``(steps, N, ...)``.
    """

    def member(state, opt_state, idx, alive):
        member_step = step if alive is None else _frozen_aware(step, alive)
        return scan_indexed_steps(
            member_step, graphdef, state, opt_state, data, idx, unroll=unroll,
            batch_sharding=batch_sharding,
        )  # fmt: skip

    in_axes = (0, 0, 0, None if active is None else 0)
    states, opt_states, outs = jax.vmap(member, in_axes=in_axes, spmd_axis_name=member_axis)(
        states, opt_states, indices, active
    )
    return states, opt_states, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), outs)


def population_batches(orders: Any, batch_size: int, *, drop_remainder: bool) -> tuple[Any, Any]:
    """:func:`~nnxscan.pure.epoch.batches_from_order` for each member's order: ``(full,
    tail)`` of shapes ``(N, steps, batch_size)`` and ``(N, 1, rest)`` (``None`` when there
    is no short batch to train)."""
    members, n = orders.shape
    num_full = n // batch_size
    full = orders[:, : num_full * batch_size].reshape(members, num_full, batch_size)
    if drop_remainder or n == num_full * batch_size:
        return full, None
    return full, orders[:, None, num_full * batch_size :]


def make_population_epoch(
    step: StepFn,
    *,
    batch_size: int,
    drop_remainder: bool = True,
    unroll: int | bool = 1,
    member_axis: str | None = None,
    batch_sharding: jax.sharding.Sharding | None = None,
) -> Callable[..., tuple[Any, Any, Any]]:
    """Builds ``epoch(graphdef, states, opt_states, data, orders, active=None)`` that trains
    N members.

    It is :func:`~nnxscan.pure.make_epoch`'s epoch of ``step``, vmapped over the members
    axis of ``states`` and ``opt_states`` (:func:`stack_states`): traced, that is one
    ``lax.scan`` over the steps whose body runs ``step`` vmapped over the members. The data
    is shared, not copied per member: each member gathers its own batch from it by its own
    row of ``orders``. So member ``i`` trains what ``make_epoch`` trains on
    ``(states[i], opt_states[i])`` with order ``orders[i]``.

    Args:
      step: a pure step from :func:`~nnxscan.pure.make_train_step`.
      batch_size, drop_remainder, unroll: as for :func:`~nnxscan.pure.make_epoch`.
      member_axis: on a mesh, the axis the members' leading axis is sharded over
        (``jax.vmap``'s ``spmd_axis_name``).
      batch_sharding: the sharding of ONE member's batch, e.g.
        ``NamedSharding(mesh, P("data"))`` for data parallelism inside every member.

    Returns:
      ``epoch(graphdef, states, opt_states, data, orders, active=None) -> (states,
      opt_states, losses)``. ``orders`` is an int array of shape ``(N, num_examples)``, one
      order per member (``epoch_order(seed_i, epoch, n)``; the same row repeated for a
      shared order). ``active``, a bool array of shape ``(N,)``, freezes the members where
      it is False: they keep their state and optax state at every step (their losses are
      still computed, at the frozen state). ``losses`` has shape ``(steps, N)`` (with
      ``has_aux``, every aux leaf gets the same two leading axes).

    Example:
      >>> epoch = jax.jit(make_population_epoch(step, batch_size=32))
      >>> orders = np.stack([epoch_order(s, 0, n) for s in seeds])
      >>> states, opt_states, losses = epoch(graphdef, states, opt_states, data, orders)
      >>> losses.shape
      (2, 4)
    """
    check_batch_size(batch_size, batch_size, drop_remainder=False)
    options = dict(member_axis=member_axis, batch_sharding=batch_sharding)

    def epoch(graphdef, states, opt_states, data, orders, active=None):
        n = check_leading_size(data, "data")
        check_batch_size(batch_size, n, drop_remainder=drop_remainder)
        members = members_of(states, "states")
        if members_of(opt_states, "opt_states") != members:
            raise ValueError(
                f"states hold {members} members but opt_states hold "
                f"{members_of(opt_states, 'opt_states')}: stack one optax state per member."
            )
        check_orders(orders, members, n)
        if active is not None and tuple(np.shape(active)) != (members,):
            raise ValueError(
                f"active has shape {tuple(np.shape(active))}; pass one bool per member, "
                f"shape ({members},)."
            )
        full, tail = population_batches(
            jnp.asarray(orders, jnp.int32), batch_size, drop_remainder=drop_remainder
        )
        outs = None
        if full.shape[1]:
            states, opt_states, outs = scan_population_steps(
                step, graphdef, states, opt_states, data, full, active=active, unroll=unroll,
                **options,
            )  # fmt: skip
        if tail is not None:
            # One step of its own shape, unrolled (no loop), as make_epoch trains it.
            states, opt_states, out = scan_population_steps(
                step, graphdef, states, opt_states, data, tail, active=active, unroll=True,
                **options,
            )  # fmt: skip
            outs = out if outs is None else jax.tree.map(_concat, outs, out)
        return states, opt_states, outs

    return epoch


def check_orders(orders: Any, members: int, n: int) -> None:
    """``orders`` must be a signed int array of shape ``(members, n)``."""
    dtype = getattr(orders, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.signedinteger):
        raise TypeError(
            f"orders must be a signed integer array of shape ({members}, {n}), e.g. "
            f"np.stack([epoch_order(seed, epoch, {n}) for seed in seeds]); got "
            f"{type(orders).__name__} with dtype {dtype}."
        )
    if tuple(np.shape(orders)) != (members, n):
        raise ValueError(
            f"orders has shape {tuple(np.shape(orders))}, but there are {members} members "
            f"and {n} examples: pass one order per member, shape ({members}, {n})."
        )


def _concat(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.concatenate([a, b], axis=0)


def member_state(stacked: Any, index: int) -> Any:
    """Member ``index`` of a stacked pytree (a new pytree; ``stacked`` is left as it is)."""
    return jax.tree.map(lambda x: x[index], stacked)


def select_members(mask: Any, on_true: Any, on_false: Any) -> Any:
    """Member ``i`` of ``on_true`` where ``mask[i]``, else of ``on_false`` (two stacks of
    one structure; ``mask`` has shape ``(N,)``)."""

    def pick(a: jax.Array, b: jax.Array) -> jax.Array:
        where = jnp.reshape(jnp.asarray(mask, bool), (-1,) + (1,) * (a.ndim - 1))
        return jnp.where(where, a, b)

    return jax.tree.map(pick, on_true, on_false)
