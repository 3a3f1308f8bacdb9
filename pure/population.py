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

from nnxscan.pure import _members, batching, checks
from nnxscan.pure.scan import scan_member_steps
from nnxscan.pure.train_step import StepFn

__all__ = [
    "hyperparam_names",
    "hyperparam_value",
    "make_population_epoch",
    "member_state",
    "select_members",
    "stack_states",
    "unstack_states",
    "with_hyperparams",
]


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
    first = _members.leaf_paths(states[0])
    first_def = jax.tree.structure(states[0])
    for i, state in enumerate(states[1:], start=1):
        if jax.tree.structure(state) != first_def:
            paths = _members.leaf_paths(state)
            only_first = sorted(set(first) - set(paths))[:3]
            only_this = sorted(set(paths) - set(first))[:3]
            raise ValueError(
                f"states[{i}] has a different structure from states[0] (paths only in "
                f"states[0]: {only_first or 'none'}; only in states[{i}]: "
                f"{only_this or 'none'}). Every member must be built by the same code: one "
                f"architecture, one optax transform."
            )
        for path, leaf in _members.leaf_paths(state).items():
            if _members.shape_dtype(leaf) != _members.shape_dtype(first[path]):
                raise ValueError(
                    f"states[{i}]{path} has shape/dtype {_members.shape_dtype(leaf)} but "
                    f"states[0] has {_members.shape_dtype(first[path])}: members must match "
                    f"leaf for leaf."
                )
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)


def unstack_states(stacked: Any) -> list[Any]:
    """Splits a stacked pytree (:func:`stack_states`) back into one pytree per member.

    Example:
      >>> states = unstack_states(stacked)
      >>> model_2 = nnx.merge(graphdef, states[2])
    """
    size = _members.members_of(stacked, "stacked")
    return [member_state(stacked, i) for i in range(size)]


def member_state(stacked: Any, index: int | jax.Array) -> Any:
    """Member ``index`` of a stacked pytree (a new pytree; ``stacked`` is left as it is).

    Works under ``jax.jit`` with a traced ``index`` (one compiled program for every
    member), where :func:`unstack_states` splits every member on the host.

    Args:
      stacked: a pytree whose leaves share a leading members axis (:func:`stack_states`).
      index: the member, an int or a scalar int array.

    Returns:
      The member's pytree: each leaf ``x`` becomes ``x[index]``.

    Example:
      >>> best = int(jnp.argmin(val_losses))
      >>> model = nnx.merge(graphdef, member_state(stacked, best))
    """
    return jax.tree.map(lambda x: x[index], stacked)


def select_members(mask: Any, on_true: Any, on_false: Any) -> Any:
    """Member ``i`` of ``on_true`` where ``mask[i]``, else of ``on_false``.

    The per-member ``where``: keep the improved members' weights, roll back the members
    whose step went wrong, restore only the members a checkpoint should.

    Args:
      mask: bools of shape ``(N,)``.
      on_true, on_false: two stacks of the same structure, leaves ``(N, ...)``.

    Returns:
      A stack of that structure, each member taken from one of the two.

    Example:
      >>> improved = val_losses < best_losses  # (N,)
      >>> best_states = select_members(improved, states, best_states)
    """

    def pick(a: jax.Array, b: jax.Array) -> jax.Array:
        where = jnp.reshape(jnp.asarray(mask, bool), (-1,) + (1,) * (a.ndim - 1))
        return jnp.where(where, a, b)

    return jax.tree.map(pick, on_true, on_false)


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
        if not _members.is_injected(node):
            return node
        old = node.hyperparams
        new = {
            k: jnp.asarray(values[k], jnp.result_type(v)) if k in values else v
            for k, v in old.items()
        }
        return node._replace(hyperparams=new)

    return jax.tree.map(replace, opt_state, is_leaf=_members.is_injected)


def hyperparam_names(opt_state: Any) -> tuple[set[str], set[str]]:
    """The numeric hyperparameters ``optax.inject_hyperparams`` keeps in ``opt_state``.

    Args:
      opt_state: an optax state, one member's or stacked; injected states anywhere in it
        (a chain, ``optax.multi_transform``) are found.

    Returns:
      ``(settable, scheduled)``: the names :func:`with_hyperparams` can set, and the names
      a schedule recomputes every step (setting those would have no effect).

    Example:
      >>> tx = optax.inject_hyperparams(optax.adam)(
      ...     learning_rate=optax.linear_schedule(1e-3, 0.0, 100), b1=0.9)
      >>> settable, scheduled = hyperparam_names(init_opt_state(tx, state))
      >>> sorted(settable), sorted(scheduled)
      (['b1', 'b2', 'eps', 'eps_root'], ['learning_rate'])
    """
    settable: set[str] = set()
    scheduled: set[str] = set()
    for node in _members.injected_states(opt_state):
        names = set(node.hyperparams)
        schedules = set(getattr(node, "hyperparams_states", None) or {})
        settable |= names - schedules
        scheduled |= schedules
    return settable, scheduled


def hyperparam_value(opt_state: Any, name: str) -> Any:
    """The value of hyperparameter ``name`` that ``optax.inject_hyperparams`` keeps.

    Args:
      opt_state: an optax state, one member's or stacked.
      name: a hyperparameter's name, e.g. ``"learning_rate"`` (scheduled ones included:
        their state holds the value of the last step).

    Returns:
      The value in the first injected state holding ``name``: a scalar array, or ``(N,)``
      in a stacked state; None where no injected state holds it.

    Example:
      >>> opt_states = stack_states([with_hyperparams(opt_state, learning_rate=lr)
      ...                            for lr in (1e-3, 3e-4)])
      >>> hyperparam_value(opt_states, "learning_rate")
      Array([0.001 , 0.0003], dtype=float32)
    """
    for node in _members.injected_states(opt_state):
        if name in node.hyperparams:
            return node.hyperparams[name]
    return None


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
    is shared: each member gathers its own batches from it once, by its own row of
    ``orders`` (the members' copies together stay under the gather budget, in chunks of
    steps if need be). So member ``i`` trains what ``make_epoch`` trains on
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
    checks.check_batch_size(batch_size, batch_size, drop_remainder=False)
    options = dict(member_axis=member_axis, batch_sharding=batch_sharding)

    def epoch(graphdef, states, opt_states, data, orders, active=None):
        n = checks.check_leading_size(data, "data")
        checks.check_batch_size(batch_size, n, drop_remainder=drop_remainder)
        members = _members.members_of(states, "states")
        if _members.members_of(opt_states, "opt_states") != members:
            raise ValueError(
                f"states hold {members} members but opt_states hold "
                f"{_members.members_of(opt_states, 'opt_states')}: stack one optax state per "
                f"member."
            )
        _members.check_orders(orders, members, n)
        if active is not None and tuple(np.shape(active)) != (members,):
            raise ValueError(
                f"active has shape {tuple(np.shape(active))}; pass one bool per member, "
                f"shape ({members},)."
            )
        full, tail = batching.cut_batches(
            jnp.asarray(orders, jnp.int32), batch_size, drop_remainder=drop_remainder
        )

        def scan(carry, idx, unroll):
            states, opt_states, outs = scan_member_steps(
                step, graphdef, *carry, data, idx, active=active, unroll=unroll, **options
            )
            return (states, opt_states), outs

        (states, opt_states), outs = batching.full_then_tail(
            scan, (states, opt_states), full, tail, unroll=unroll, steps_axis=1
        )
        return states, opt_states, outs

    return epoch
