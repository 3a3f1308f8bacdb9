"""The options of ``Trainer``, ``Population`` and ``scan_train``: declared, defaulted and
checked once, for every front door.

Each front door takes its keyword options as ``**options: Unpack[<its>Arguments]``, as
``fit`` takes :class:`~nnxscan.shell.FitArguments`. An option shared by several front doors
is declared once, in the base they share; a new one is one entry here and one in
:data:`DEFAULTS`. A name a front door does not take is a ``TypeError`` that says what to do
(the learning rate is the optimizer's; ``epochs`` is ``fit``'s; another front door's
option; a close misspelling), the same from every front door.

Which kind of step a front door was given is decided here once (:func:`step_kind`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypedDict

from flax import nnx
from jax.sharding import Mesh

from nnxscan.pure import Step
from nnxscan.shell._engine.options import FIT_DEFAULTS
from nnxscan.shell._engine.plans import Plan


class _EveryDoor(TypedDict, total=False):
    """What every front door takes (docs/training.md, "Trainer's arguments")."""

    train_step: Step | Callable[..., Any] | None  # a user's step instead of a loss
    execution: str | Plan  # "auto", "scan", "unrolled", "step" or a Plan
    mesh: Mesh | None  # train on a mesh (docs/scaling.md)
    data_axis: str | tuple[str, ...] | None  # the mesh axes a batch is split over
    shardings: Mapping[str, Any] | None  # path rules {regex: PartitionSpec}
    rngs: nnx.Rngs | Callable[[int], nnx.Rngs] | None  # call-time Rngs the loss receives


class _Extras(TypedDict, total=False):
    extras: Sequence[Any]  # the further NNX objects a stateful train_step mutates


class _FitEngine(_EveryDoor, total=False):
    """What ``Trainer`` and ``Population`` take besides: the step built from a loss, its
    non-finite policy, the FSDP rule."""

    wrt: nnx.filterlib.Filter  # the trained variables
    has_aux: bool  # the loss returns (loss, aux)
    on_nonfinite: str  # "ignore", "skip" or "stop"
    accumulate: int  # micro-batches per step
    fsdp_min_size: int | None  # shard variables of at least this many entries
    metrics: nnx.Metric | None  # NNX metrics updated inside the step
    update_metrics: Callable[[Any, Any, Any, Any], Any] | None


class TrainerArguments(_FitEngine, _Extras, total=False):
    """``Trainer``'s keyword options (docs/training.md, "Trainer's arguments")."""


class _Seeds(TypedDict):  # total: required (``Required[]`` is lost to postponed annotations)
    seeds: Sequence[int]  # one per member


class PopulationArguments(_FitEngine, _Seeds, total=False):
    """``Population``'s keyword options (docs/populations.md, "Population's arguments")."""

    hyperparams: Mapping[str, Sequence[Any]] | None  # {name: one value per member}
    member_axis: str  # the mesh axis the members are sharded over


class ScanTrainArguments(_EveryDoor, _Extras, total=False):
    """``scan_train``'s keyword options (its docstring describes each)."""

    opt_state: Any  # a pure Step's state to start from
    batch_size: int | None  # cut flat data into steps of this many examples
    drop_remainder: bool  # drop the examples that do not fill a step


#: Every option's default (what a front door uses when it is left out); ``seeds`` has none.
DEFAULTS: dict[str, Any] = {
    "train_step": None,
    "execution": "auto",
    "mesh": None,
    "data_axis": None,
    "shardings": None,
    "rngs": None,
    "extras": (),
    "wrt": nnx.Param,
    "has_aux": False,
    "on_nonfinite": "ignore",
    "accumulate": 1,
    "fsdp_min_size": None,
    "metrics": None,
    "update_metrics": None,
    "hyperparams": None,
    "member_axis": "members",
    "opt_state": None,
    "batch_size": None,
    "drop_remainder": True,
}
DOORS: dict[str, type] = {
    "Trainer": TrainerArguments,
    "Population": PopulationArguments,
    "scan_train": ScanTrainArguments,
}
assert set(DEFAULTS) | {"seeds"} == {n for d in DOORS.values() for n in d.__annotations__}

#: The options of the step built from a loss: a user's ``train_step`` computes its loss,
#: gradients and metrics itself, so with one they have no effect and are refused.
LOSS_STEP_OPTIONS = ("wrt", "has_aux", "accumulate", "rngs", "metrics", "update_metrics")

#: How the optimizer is passed to each front door, for a learning rate given as an option.
_OPTIMIZER = {
    "Trainer": "Trainer(model, optax.adam(1e-3), loss_fn)",
    "Population": "Population(model_fn, optax.adam(1e-3), loss_fn, seeds=[...])",
    "scan_train": (
        "scan_train(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), loss_fn, batches)"
    ),
}
_LEARNING_RATE = {"learning_rate", "lr", "step_size", "momentum", "weight_decay"}
_POSITIONAL = {
    "Trainer": ("model", "tx_or_optimizer", "optimizer", "tx", "loss_fn", "loss"),
    "Population": ("model_fn", "tx", "optimizer", "loss_fn", "loss"),
    "scan_train": ("model", "optimizer", "tx", "loss_fn", "loss", "batches"),
}


def construction_options(door: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` of front door ``door`` (``"Trainer"``, ``"Population"`` or
    ``"scan_train"``) with every default filled in, after refusing what it does not take.

    Raises:
      TypeError: an option ``door`` does not take (saying what to do instead), or a
        required one left out.

    Example:
      >>> construction_options("Trainer", {"has_aux": True})["execution"]
      'auto'
    """
    declared = DOORS[door]
    unknown = sorted(set(options) - set(declared.__annotations__))
    if unknown:
        raise TypeError(_hint(door, unknown[0], declared))
    missing = sorted(declared.__required_keys__ - set(options))
    if missing:
        raise TypeError(f"{door} needs {missing[0]}=: {_OPTIMIZER[door]}.")
    names = declared.__annotations__
    return {**{n: DEFAULTS[n] for n in names if n in DEFAULTS}, **options}


def _hint(door: str, name: str, declared: type) -> str:
    said = f"{door}() got an unexpected keyword argument {name!r}"
    if name in _LEARNING_RATE:
        what = "learning rate" if name in ("learning_rate", "lr", "step_size") else name
        return (
            f"{said}: the {what} is the optimizer's. Pass an optimizer built with it, "
            f"e.g. optax.adam(1e-3) (or optax.inject_hyperparams(optax.adam)(learning_rate="
            f"1e-3) to change it later): {_OPTIMIZER[door]}."
        )
    if name in _POSITIONAL[door]:
        return f"{said}: pass it by position, {_OPTIMIZER[door]}."
    fit_names = {*FIT_DEFAULTS, "epochs"} | ({"seed"} if door == "Trainer" else set())
    if name in fit_names and door == "scan_train":
        return (
            f"{said}: {name} is an option of fit: Trainer(model, optimizer, loss_fn).fit(data, "
            f"{name}=...) trains epochs of a data set; scan_train trains the batches given."
        )
    if name in fit_names:
        return (
            f"{said}: {name} is an option of fit, not of {door}: "
            f"{door.lower()}.fit(data, {name}=...)."
        )
    others = [d for d, args in DOORS.items() if d != door and name in args.__annotations__]
    if others:
        return f"{said}: {name} is an option of {' and '.join(others)}, not of {door}."
    close = difflib.get_close_matches(name, list(declared.__annotations__), n=2)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"{said}.{hint}"


def loss_options_given(options: dict[str, Any]) -> list[str]:
    """The options of the step built from a loss that ``options`` sets to other than their
    defaults (what a user's ``train_step`` refuses)."""
    return [
        name
        for name in LOSS_STEP_OPTIONS
        if name in options and _differs(options[name], DEFAULTS[name])
    ]


def _differs(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return bool(value) != default
    if isinstance(default, int | str):
        return not (type(value) is type(default) and value == default)
    return value is not default


def step_kind(train_step: Any) -> Literal["loss", "pure", "stateful"]:
    """Which step a front door runs: the one built from a loss (no ``train_step``), a pure
    :class:`~nnxscan.pure.Step`, or a stateful NNX function. Decided here, once.

    Example:
      >>> step_kind(None), step_kind(make_train_step(loss_fn, tx)), step_kind(train_fn)
      ('loss', 'pure', 'stateful')
    """
    if train_step is None:
        return "loss"
    return "pure" if isinstance(train_step, Step) else "stateful"
