"""One model or members: everything that differs between them, in one place.

The engine and its edges are written once. Where training one model and training a
population's members differ (log shapes and values, the runner's step, a step's batch and
its indices, the members axis of the shardings, the non-finite "stop" policy, frozen
members, evaluation, what callbacks are told), they ask the run's layout, one of two small
classes behind the :class:`Layout` protocol, and never which of the two they hold. The
owner declares its own (``owner.layout``); a fit refines it with what its data looks like
(``for_run``). docs/architecture.md tables what each says and who asks.

Both are frozen dataclasses: equal layouts are equal keys of the compiled runners' cache.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from nnxscan.pure import MembersState, Step, vmap_members
from nnxscan.pure.batching import cut_batches
from nnxscan.pure.checks import abstract_batch, check_leading_size
from nnxscan.shell._edges.warn import warn

#: What a fit's data is: a data set of arrays, a stream of batches, or none (a step that
#: takes no batch).
DataKind = Literal["arrays", "stream", "none"]


class Layout(Protocol):
    """What the engine asks of one model or of members (docs/architecture.md tables who
    asks what). ``num_members``: None or N, what callbacks and writers are told; ``shape``:
    a value per model, ``()`` or ``(N,)`` (a per-step log is ``(steps, *shape)``);
    ``data_lead``: the data's leading axes before the examples (a stream batch's before
    its batch axis), ``(N,)`` when each member has its own data. ``wrap`` and ``gathered``
    run traced; the rest on the host.
    """

    num_members: int | None
    shape: tuple[int, ...]
    data_lead: tuple[int, ...]

    def for_run(self, data: DataKind, member_batches: bool, member_axis: str | None) -> Layout: ...
    # Logs: the mean over steps (``skipping``: NaN steps left out); a value (a statistic
    # reduced over steps, an evaluation or NNX metric: one model's float, an array metric
    # stays an array, of ``dtype``; None keeps the value's) and a count, as logs hold them;
    # a value and the epoch's loss as the progress line shows them. A value's leading
    # ``shape`` is the layout's (members); what follows is the log's own (a metric per
    # class): ``log_shape`` (the same function on both layouts).
    def step_mean(self, values: np.ndarray, skipping: bool) -> Any: ...
    def log_shape(self, value: Any, *, steps: int = 0) -> tuple[int, ...]: ...
    def value(self, x: Any, dtype: Any = np.float32) -> Any: ...
    def count(self, x: Any) -> Any: ...
    def nonfinite_steps(self, counts: Any, steps: int) -> str: ...
    def shown(self, name: str, value: Any) -> str | None: ...
    def loss_text(self, loss: Any) -> str: ...
    # ``on_nonfinite="stop"``: how many of a halted call's ``length`` steps count (members it
    # halted: given to ``freeze``).
    def halted_steps(
        self, halted: Any, losses: Any, length: int, first: int, epoch: int, freeze: Callable
    ) -> int: ...
    # The runner's step around one model's: its ``init(graphdef, (state, held))`` builds the
    # call's carry from the one the owner holds; the carry one model's step takes, of the
    # owner's (its shapes: ``execution`` traces one model's step); each step's data.
    def wrap(self, step: Step) -> Step: ...
    def model_carry(self, carry: tuple[Any, Any]) -> tuple[Any, Any]: ...
    def gathered(self, data: Any, indices: Any) -> tuple[Any, Any]: ...
    def evaluate(self, evaluate: Callable) -> Callable: ...
    def members_axis(self, mesh: Any, name: str | None) -> str | None: ...
    def batch_spec(self, member_axis: str | None) -> tuple: ...
    # The data: a data set's examples (each member's; checked) with one step's batch shapes,
    # read once on the host before it is placed (the shapes' dtypes are JAX's canonical
    # ones, those the placed data will have); a stream's first batch as one model trains
    # it; the orders (one per seed) cut into indices with the core's cut, steps first
    # (``(steps, batch)``, ``(steps, N, batch)``); the stored order's batches by number.
    def data_shapes(self, data: Any, batch_size: int) -> tuple[int, Any]: ...
    def first_batch(self, batch: Any) -> Any: ...
    def cut(self, orders: list[np.ndarray], batch_size: int, drop: bool) -> tuple[Any, Any]: ...
    def batch_numbers(self, indices: np.ndarray, batch_size: int) -> tuple[np.ndarray, Any]: ...


def _log_shape(layout: Layout, value: Any, *, steps: int = 0) -> tuple[int, ...]:
    """``layout.log_shape(value, steps=)``: a log's own shape, ``value``'s after its
    ``steps`` leading step axes and the layout's members axes (``layout.shape``: none for
    one model, ``(N,)`` for members, which ``vmap_members`` gives every leaf of a member's
    outputs). ``()`` is one number per model (per step), ``(C,)`` a metric per class: the
    one place a log's own axes are told from the layout's, which say one model or members.

    Example:
      >>> Members(3).log_shape(np.zeros((16, 3)), steps=1), ONE_MODEL.log_shape(np.zeros(5))
      ((), (5,))
    """
    return tuple(np.shape(value))[steps + len(layout.shape) :]


@dataclasses.dataclass(frozen=True)
class OneModel:
    """The layout of one model: a value per model is a scalar; the step runs as it is."""

    num_members: ClassVar[None] = None
    shape: ClassVar[tuple[int, ...]] = ()
    data_lead: ClassVar[tuple[int, ...]] = ()

    def for_run(self, data: DataKind, member_batches: bool, member_axis: str | None) -> OneModel:
        return self

    log_shape = _log_shape

    def step_mean(self, values: np.ndarray, skipping: bool) -> Any:
        if not skipping:
            return np.mean(values, axis=0)
        finite = np.isfinite(values)
        return np.mean(values[finite]) if finite.any() else np.float32(np.nan)

    def value(self, x: Any, dtype: Any = np.float32) -> Any:
        return float(x) if self.log_shape(x) == () else np.asarray(x, dtype)

    def count(self, x: Any) -> int:
        return int(x)

    def nonfinite_steps(self, counts: Any, steps: int) -> str:
        return f"{int(counts)} of the {steps} training steps"

    def shown(self, name: str, value: Any) -> str | None:
        number = _finite_median(value)
        median = "" if self.log_shape(value) == () else "median "  # a metric per class
        return None if number is None else f"{name} {median}{number:.4g}"

    def loss_text(self, loss: Any) -> str:
        return f"loss {float(loss):.4g}"

    def halted_steps(
        self, halted: Any, losses: Any, length: int, first: int, epoch: int, freeze: Callable
    ) -> int:
        # The steps before the first non-finite one count; fit then raises.
        return int(np.argmax(np.isnan(np.asarray(losses))))

    def wrap(self, step: Step) -> Step:
        return step

    def model_carry(self, carry: tuple[Any, Any]) -> tuple[Any, Any]:
        return carry

    def gathered(self, data: Any, indices: Any) -> tuple[Any, Any]:
        return data, indices

    def evaluate(self, evaluate: Callable) -> Callable:
        return evaluate

    def members_axis(self, mesh: Any, name: str | None) -> None:
        return None

    def batch_spec(self, member_axis: str | None) -> tuple:
        return ()

    def data_shapes(self, data: Any, batch_size: int) -> tuple[int, Any]:
        return check_leading_size(data, "data"), abstract_batch(data, leading=batch_size)

    def first_batch(self, batch: Any) -> Any:
        return batch

    def cut(self, orders: list[np.ndarray], batch_size: int, drop: bool) -> tuple[Any, Any]:
        (order,) = orders
        return cut_batches(order, batch_size, drop_remainder=drop)

    def batch_numbers(self, indices: np.ndarray, batch_size: int) -> tuple[np.ndarray, Any]:
        # Batch k of the stored order is rows k*B .. k*B+B-1: its first index / B.
        return indices[..., 0] // batch_size, batch_size


#: The layout of every one-model owner (layouts are values: any ``OneModel()`` equals it).
ONE_MODEL = OneModel()


#: How each step's batch reaches N members: ``"shared"``, one batch for all (no data, or a
#: stream shared by the members); ``"gathered"``, each member's own batch gathered by its
#: own order from the shared data set; ``"own data"``, each member's own data set, every
#: leaf ``(N, n, ...)``; ``"own batches"``, a stream whose every batch is ``(N, batch, ...)``.
MemberBatches = Literal["shared", "gathered", "own data", "own batches"]


@dataclasses.dataclass(frozen=True)
class Members:
    """The layout of ``num_members`` members stacked on a leading axis and trained by
    :func:`~nnxscan.pure.vmap_members` of the step of one, sharded over ``member_axis``
    (or not); ``batches`` says how each step's batch reaches them (:data:`MemberBatches`)."""

    num_members: int
    member_axis: str | None = None
    batches: MemberBatches = "shared"

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_members,)

    @property
    def data_lead(self) -> tuple[int, ...]:
        return self.shape if self.batches in ("own data", "own batches") else ()

    @property
    def _shared_batch(self) -> bool:
        return self.batches == "shared"

    def for_run(self, data: DataKind, member_batches: bool, member_axis: str | None) -> Members:
        batches: MemberBatches = "shared"
        if data == "arrays":
            batches = "own data" if member_batches else "gathered"
        elif data == "stream" and member_batches:
            batches = "own batches"
        return dataclasses.replace(self, member_axis=member_axis, batches=batches)

    log_shape = _log_shape

    def step_mean(self, values: np.ndarray, skipping: bool) -> Any:
        if not skipping:
            return np.mean(values, axis=0)
        finite = np.isfinite(values)
        counts = finite.sum(axis=0)
        sums = np.where(finite, values, 0).sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan).astype(values.dtype)

    def value(self, x: Any, dtype: Any = np.float32) -> np.ndarray:
        return np.asarray(x, dtype)  # (N, ...): never a float, whatever the log's own shape

    def count(self, x: Any) -> np.ndarray:
        return np.asarray(x).astype(np.int64)

    def nonfinite_steps(self, counts: Any, steps: int) -> str:
        per = ", ".join(f"member {m}: {int(n)}" for m, n in enumerate(counts) if n)
        return f"some of the {steps} training steps ({per})"

    def shown(self, name: str, value: Any) -> str | None:
        number = _finite_median(value)
        return None if number is None else f"{name} median {number:.4g}"

    def loss_text(self, loss: Any) -> str:
        loss = np.asarray(loss, np.float64)
        low, mid, high = (
            np.nanpercentile(loss, [0, 50, 100]) if np.isfinite(loss).any() else [np.nan] * 3
        )
        return f"loss median {mid:.4g} [{low:.4g}, {high:.4g}] of {loss.size} members"

    def halted_steps(
        self, halted: Any, losses: Any, length: int, first: int, epoch: int, freeze: Callable
    ) -> int:
        # Each member that halted in the call is frozen at the state before its first
        # non-finite step, with a warning naming that step; the others go on, and the
        # call's steps all count. (A frozen member never halts: its step is not applied.)
        losses = np.asarray(losses)
        halted = np.flatnonzero(np.asarray(halted, bool))
        for index in halted:
            step = first + int(np.argmax(np.isnan(losses[:, index])))
            warn(
                f"member {index}: non-finite loss at global step {step} (epoch "
                f"{epoch}); on_nonfinite='stop' froze it at the state before that "
                f"step. The other members go on.",
                RuntimeWarning,
            )
        freeze(halted)
        return length

    def wrap(self, step: Step) -> Step:
        members_step = vmap_members(
            step, shared_batch=self._shared_batch, member_axis=self.member_axis
        )

        def init(graphdef: Any, held: tuple[Any, MembersState]) -> MembersState:
            # The call's carry from the members' state the owner holds: the inner wrappers'
            # states (a halt's) built around each member's held one, and its mask kept.
            state, members_state = held
            built = members_step.init(graphdef, (state, members_state.inner))
            return built._replace(active=members_state.active)

        return Step(init, members_step.update, members_step.has_aux)

    def model_carry(self, carry: tuple[Any, MembersState]) -> tuple[Any, Any]:
        state, members_state = carry
        return state, members_state.inner

    def gathered(self, data: Any, indices: Any) -> tuple[Any, Any]:
        if self.batches != "own data":
            return data, indices
        # Each member's own data (N, n, ...) as one data set (N * n, ...) (a reshape, no
        # copy), and the members' indices (steps, N, batch) shifted into it: member i's
        # row r is row i * n + r.
        count, n = jax.tree.leaves(data)[0].shape[:2]
        data = jax.tree.map(lambda x: x.reshape(count * n, *x.shape[2:]), data)
        offsets = (jnp.arange(count, dtype=indices.dtype) * n).reshape(1, count, 1)
        return data, indices + offsets

    def evaluate(self, evaluate: Callable) -> Callable:
        return _vmapped_evaluate(evaluate)

    def members_axis(self, mesh: Any, name: str | None) -> str | None:
        if name not in mesh.axis_names:
            return None
        size = mesh.shape[name]
        if self.num_members % size:
            raise ValueError(
                f"{self.num_members} members do not divide over the {size} devices of mesh "
                f"axis {name!r}: use a multiple of {size} seeds."
            )
        return name

    def batch_spec(self, member_axis: str | None) -> tuple:
        return () if self._shared_batch else (member_axis,)

    def data_shapes(self, data: Any, batch_size: int) -> tuple[int, Any]:
        if not self.data_lead:
            return check_leading_size(data, "data"), abstract_batch(data, leading=batch_size)
        if check_leading_size(data, "data") != self.num_members:
            raise ValueError(
                f"with member_batches=True every data leaf needs a leading members axis of "
                f"{self.num_members}: (members, examples, ...)."
            )
        examples = check_leading_size(jax.tree.map(lambda x: x[0], data), "data[member]")
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0], batch_size, *x.shape[2:]), x.dtype),
            abstract_batch(data),
        )
        return examples, batch

    def first_batch(self, batch: Any) -> Any:
        if not self.data_lead:
            return batch
        if check_leading_size(batch, "batch 0") != self.num_members:
            raise ValueError(
                f"with member_batches=True every batch needs a leading members axis of "
                f"{self.num_members}: (members, batch, ...)."
            )
        return jax.tree.map(lambda x: x[0], batch)

    def cut(self, orders: list[np.ndarray], batch_size: int, drop: bool) -> tuple[Any, Any]:
        full, tail = cut_batches(np.stack(orders), batch_size, drop_remainder=drop)
        # Steps first, as make_epoch scans them: (N, steps, batch) -> (steps, N, batch).
        return np.swapaxes(full, 0, 1), None if tail is None else np.swapaxes(tail, 0, 1)

    def batch_numbers(self, indices: np.ndarray, batch_size: int) -> tuple[np.ndarray, Any]:
        # Vmapped over members, slicing a batch by number would be a gather per step:
        # the members gather their (stored-order) batches as a shuffled epoch does.
        return indices, None


def _finite_median(values: Any) -> float | None:
    """One number for the progress line: a model's value, or the members' median, of the
    finite ones (None when none is)."""
    values = np.ravel(np.asarray(values, np.float64))
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if finite.size else None


@functools.lru_cache(maxsize=32)
def _vmapped_evaluate(evaluate: Callable) -> Callable:
    """``evaluate(graphdef, state, data)`` vmapped over a population's stacked states (the data
    shared): every value gains a leading members axis."""

    def run(graphdef: Any, states: Any, data: Any) -> Any:
        return jax.vmap(lambda state: evaluate(graphdef, state, data))(states)

    return jax.jit(run)
