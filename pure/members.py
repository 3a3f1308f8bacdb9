"""Members as a step transform: the step of N models trained side by side.

optax wraps a transformation and returns one (``apply_if_finite``, ``MultiSteps``), with a
named state that holds the inner one. :func:`vmap_members` does the same for a training
step: it takes the :class:`~nnxscan.pure.Step` of ONE model and returns the ``Step`` of N
members whose states are stacked on a leading axis (:func:`~nnxscan.pure.stack_states`).
Its ``update`` is the inner ``update`` under ``jax.vmap``, and its state
(:class:`MembersState`) holds the members' inner states and the mask of the members that
still train. Every loop that runs a step — :func:`~nnxscan.pure.scan_steps`,
:func:`~nnxscan.pure.scan_indexed_steps`, :func:`~nnxscan.pure.make_epoch`, the shell —
runs a population as it runs one model: a batch simply has a leading members axis. How an
epoch orders N members (a key or an order per member, cut steps first) beside one model's
is here too (``_epoch_orders``), so ``make_epoch`` is told its members, never asks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure import _members, checks
from nnxscan.pure.nonfinite import _fresh_nodes, tree_select
from nnxscan.pure.step import Step

__all__ = ["MembersState", "vmap_members"]


class MembersState(NamedTuple):
    """The state of :func:`vmap_members`' step.

    Attributes:
      inner: the members' inner step states (``opt_state``), stacked: every leaf has a
        leading members axis ``(N, ...)``.
      active: ``(N,)`` bool; a member where it is False is frozen: its model state and inner
        state stay as they are at every step (its loss is still computed, at that state, and
        reported). Set it to stop members (per-member early stopping), or to restore some.

    Example:
      >>> opt_state = members.init(graphdef, states)
      >>> opt_state = opt_state._replace(active=jnp.array([True, False, True]))  # freeze 1
      >>> optax_states = opt_state.inner  # every member's, stacked
    """

    inner: Any
    active: jax.Array


def vmap_members(
    step: Step,
    *,
    shared_batch: bool = False,
    member_axis: str | None = None,
    hyperparams: Mapping[str, Sequence[float]] | None = None,
) -> Step:
    """The :class:`~nnxscan.pure.Step` of N members, each trained by ``step``.

    ``init(graphdef, states)`` takes the members' model states stacked on a leading axis
    (:func:`~nnxscan.pure.stack_states` of one ``nnx.split`` per seed) and returns a
    :class:`MembersState`: ``step.init`` of each member (vmapped), every member active, and
    each member's ``hyperparams`` written into its ``optax.inject_hyperparams`` states.
    ``update(graphdef, states, members_state, batch)`` trains each member on its own batch:
    every batch leaf has a leading members axis ``(N, batch, ...)`` (or, with
    ``shared_batch``, all members train the same batch). It returns the members' losses
    (and aux) with a leading members axis, ``(N,)``. Member ``i`` trains exactly what
    ``step`` trains alone on ``(states[i], inner[i], batch[i])``, up to the rounding a
    vmapped program may change.

    Guards compose in either order, as optax's wrappers do:
    ``vmap_members(halt_after_nonfinite(step))`` halts each member at its own first
    non-finite loss (the others train on); ``skip_nonfinite(vmap_members(step))`` skips the
    step of every member when any member's is not finite.

    Args:
      step: the step of ONE member (:func:`~nnxscan.pure.make_train_step`, or your own).
      shared_batch: every member trains the same batch (no members axis on it).
      member_axis: the mesh axis the members are sharded over (``jax.vmap``'s
        ``spmd_axis_name``): a batch sharding inside ``step`` then shards over both.
      hyperparams: per-member values of the inner state's injected hyperparameters
        (``optax.inject_hyperparams``), e.g. ``{"learning_rate": [1e-3, 3e-4]}``: one
        value per member, written by ``init``.

    Returns:
      A ``Step`` (``has_aux`` as ``step``'s).

    Raises:
      ValueError: (at ``init``) a hyperparameter's values are not one per member, or the
        inner state has no such injected hyperparameter.

    Example:
      >>> members = vmap_members(make_train_step(loss_fn, tx))
      >>> graphdef, _ = nnx.split(model_fn(0))
      >>> states = stack_states([nnx.split(model_fn(s))[1] for s in range(4)])
      >>> opt_state = members.init(graphdef, states)
      >>> states, opt_state, losses = members(graphdef, states, opt_state, batches_of_4)
      >>> losses.shape
      (4,)
    """
    values = {name: tuple(map(float, v)) for name, v in (hyperparams or {}).items()}

    def init(graphdef: nnx.GraphDef, states: nnx.State) -> MembersState:
        size = _members.num_members_of(states, "states")
        inner = jax.vmap(lambda state: step.init(graphdef, state))(states)
        for name, given in values.items():
            if len(given) != size:
                raise ValueError(
                    f"hyperparams[{name!r}] has {len(given)} values for {size} members: give "
                    f"one per member."
                )
        if values:
            inner = _members.replace_hyperparams(inner, values)
        return MembersState(inner, jnp.ones((size,), bool))

    def update(graphdef: nnx.GraphDef, states: nnx.State, opt_state: MembersState, batch: Any):
        _check_members(states, opt_state, None if shared_batch else batch)

        def member(state, inner, member_batch, alive):
            new_state, new_inner, out = step.update(
                graphdef, *_fresh_nodes(state, inner), member_batch
            )
            return tree_select(alive, new_state, state), tree_select(alive, new_inner, inner), out

        in_axes = (0, 0, None if shared_batch else 0, 0)
        states, inner, outs = jax.vmap(member, in_axes=in_axes, spmd_axis_name=member_axis)(
            states, opt_state.inner, batch, opt_state.active
        )
        return states, MembersState(inner, opt_state.active), outs

    return Step(init, update, bool(step.has_aux))


def _check_members(states: Any, opt_state: Any, batch: Any) -> None:
    """The members' states, mask and batch (unless shared) agree on N: a ValueError naming
    the leaf otherwise, at trace time (``jax.vmap``'s own error names no leaf)."""
    if not isinstance(opt_state, MembersState):
        raise TypeError(
            f"the members' step takes the MembersState its init returns, got "
            f"{type(opt_state).__name__}: opt_state = members.init(graphdef, states)."
        )
    size = _members.num_members_of(states, "states")
    if tuple(jnp.shape(opt_state.active)) != (size,):
        raise ValueError(
            f"active has shape {tuple(jnp.shape(opt_state.active))} but the states hold "
            f"{size} members: one bool per member, shape ({size},)."
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != size:
            have = jnp.shape(leaf)[0] if jnp.ndim(leaf) else "no"
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} has {have} members on its leading axis "
                f"where the states hold {size} members: give each member its batch, shape "
                f"({size}, batch, ...), or build the step with shared_batch=True."
            )


# -- an epoch's orders: one model's, or one per member -------------------------------------


class _ModelOrders:
    """An epoch of ONE model (``make_epoch(num_members=None)``): one key or one ``(n,)`` order;
    each step's batch has no members axis (one model's, or the batch every member of a
    ``shared_batch`` step trains)."""

    lead: tuple[int, ...] = ()
    keys_text = (
        "one key, e.g. jax.random.key(0) (for one key per member, build the epoch with "
        "make_epoch(..., num_members=N))"
    )

    def orders_text(self, n: int) -> str:
        return (
            f"an order of shape ({n},), e.g. epoch_order(seed, epoch, {n}) (for one order per "
            f"member, (N, {n}), build the epoch with make_epoch(..., num_members=N))"
        )

    def permutation(self, key: Any, n: int) -> jax.Array:
        return jax.random.permutation(key, n).astype(jnp.int32)

    def stored(self, n: int) -> jax.Array:
        return jnp.arange(n, dtype=jnp.int32)

    def steps_first(self, cut: jax.Array) -> jax.Array:
        return cut

    def batch_numbers(self, full: jax.Array, batch_size: int) -> tuple[jax.Array, int | None]:
        # The stored order's batch k is rows k*B .. k*B+B-1: sliced by its number, no gather.
        return jnp.arange(full.shape[0], dtype=jnp.int32), batch_size


class _MemberOrders:
    """An epoch of ``num_members`` members (``make_epoch(num_members=N)``): N keys or an
    ``(N, n)`` order array, one per member; each step's batch has a leading members axis
    ``(N, batch, ...)``, member ``i``'s rows in member ``i``'s order."""

    def __init__(self, num_members: int):
        self.lead = (num_members,)
        count = self.lead[0]
        self.keys_text = f"{count} keys, one per member, e.g. jax.random.split(key, {count})"

    def orders_text(self, n: int) -> str:
        count = self.lead[0]
        return (
            f"one order per member, shape ({count}, {n}), e.g. np.stack([epoch_order(s, "
            f"epoch, {n}) for s in seeds])"
        )

    def permutation(self, keys: Any, n: int) -> jax.Array:
        return jax.vmap(lambda key: jax.random.permutation(key, n))(keys).astype(jnp.int32)

    def stored(self, n: int) -> jax.Array:
        return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (*self.lead, n))

    def steps_first(self, cut: jax.Array) -> jax.Array:
        return jnp.swapaxes(cut, 0, 1)  # (N, steps, batch) -> (steps, N, batch)

    def batch_numbers(self, full: jax.Array, batch_size: int) -> tuple[jax.Array, int | None]:
        # Vmapped over members, slicing a batch by number would be a gather per step: the
        # members gather their (stored-order) batches as a shuffled epoch does.
        return full, None


def _epoch_orders(num_members: int | None) -> _ModelOrders | _MemberOrders:
    """How :func:`~nnxscan.pure.make_epoch` orders an epoch of one model (``None``) or of
    ``num_members`` members (the step of :func:`vmap_members`): the one place an epoch
    asks which (its shapes never say).

    Example:
      >>> _epoch_orders(3).lead, _epoch_orders(None).lead
      ((3,), ())
    """
    if num_members is None:
        return _ModelOrders()
    return _MemberOrders(checks.check_count(num_members, "num_members", 1))


def _epoch_orders_given(key_or_order: Any) -> _ModelOrders | _MemberOrders:
    """An epoch built without ``num_members`` (``make_epoch``'s form before it had one, which
    callers keep using): told by what each call is given, as it always was. ``N`` keys or
    an ``(N, n)`` order array are N members' own (a :func:`vmap_members` step's, whatever
    guards wrap it); one key, one ``(n,)`` order or none, one model's (or one for all
    members: a ``shared_batch`` step's). Any other shape is refused by the one model's
    check, which names ``num_members``. Only ``num_members=N`` has a shape checked against
    what the epoch was built for.

    Example:
      >>> _epoch_orders_given(jax.random.split(jax.random.key(0), 3)).lead
      (3,)
    """
    if key_or_order is None:
        return _ModelOrders()
    shape = tuple(jnp.shape(key_or_order))
    dtype = getattr(key_or_order, "dtype", None)
    typed_key = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    lead = shape if typed_key else shape[:-1]  # a raw key's data, an order's examples
    return _MemberOrders(lead[0]) if len(lead) == 1 else _ModelOrders()
