"""The checks every front door makes of a user's functions, written once.

``Trainer``, ``scan_train`` and ``Population`` take ``train_step=``: a pure
:class:`~nnxscan.pure.Step`, or a stateful NNX function ``fn(model, [optimizer], *extras,
batch)``; or a ``loss_fn``. Each checks it here, before anything is read from the user's
objects or compiled.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from flax import nnx

from nnxscan.pure import Step
from nnxscan.pure.checks import check_no_captured_nnx, globals_loaded

#: The global names each code object loads, read once: a code object never changes, and
#: disassembling it again at every ``scan_train`` call would cost the host at every call.
_names = functools.lru_cache(maxsize=1024)(globals_loaded)


def refuse_loss_options(given: list[str], *, extras: bool = True) -> None:
    """Options meant for the step built from a loss have no effect on a user's step
    (``extras``: whether the front door takes ``extras=``, which the advice then names)."""
    if given:
        stateful = "; a stateful step takes its nnx.Rngs and metrics in extras=(...)"
        raise TypeError(
            f"train_step= replaces the step built from a loss, so {', '.join(given)} "
            f"{'has' if len(given) == 1 else 'have'} no effect: leave "
            f"{'it' if len(given) == 1 else 'them'} out (your step computes its loss, "
            f"gradients and metrics itself{stateful if extras else ''})."
        )


def check_pure_step(step: Step, optimizer: Any, extras: tuple, call: str) -> None:
    """A pure Step carries its optimizer state itself: no optimizer, no extras."""
    if optimizer is not None or extras:
        raise TypeError(
            f"a pure Step carries its optimizer state itself (its init makes it): call "
            f"{call} without an optimizer or extras. A stateful NNX function "
            f"fn(model, optimizer, *extras, batch) takes them."
        )
    check_no_captured_nnx(step.update, "train_step.update", names=_names)


def check_stateful_step(fn: Any, model: Any, optimizer: Any, extras: tuple, front: str) -> None:
    """A stateful ``fn(model, [optimizer], *extras, batch)``: callable so, with an
    ``nnx.Optimizer`` (if any) and NNX objects as extras, capturing none (a captured
    object that is one of these arguments is told apart: the fix is to use the argument)."""
    if not callable(fn):
        raise TypeError(
            f"train_step must be a nnxscan.pure.Step or a function fn(model, optimizer, "
            f"*extras, batch), got {type(fn).__name__}."
        )
    if optimizer is not None and not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"with a stateful train_step, the second argument is the nnx.Optimizer it "
            f"receives, got {type(optimizer).__name__}. Build one: "
            f"nnx.Optimizer(model, tx, wrt=nnx.Param)."
        )
    if (
        optimizer is not None
        and getattr(optimizer, "model", None) is model
        and not nnx.set_graph_mode.current_value()
    ):
        raise TypeError(
            f"in Flax's tree mode (nnx.set_graph_mode(False), NNX_GRAPH_MODE=false) objects "
            f"cannot share Variables, and this {type(optimizer).__name__} holds the model "
            f"that {front} also passes to your step. Pass an optimizer that does not hold "
            f"it: nnx.Optimizer(model, tx, wrt=nnx.Param), whose update(model, grads) your "
            f"step calls; or run in graph mode (with nnx.set_graph_mode(True): ...). A "
            f"step built from a loss takes either optimizer."
        )
    for i, extra in enumerate(extras):
        if not isinstance(extra, nnx.Pytree | nnx.Variable):
            raise TypeError(
                f"extras[{i}] is a {type(extra).__name__}; extras are the NNX objects your "
                f"train_step mutates (nnx.Metric, nnx.Rngs, modules, optimizers). Pass "
                f"constants through the batch or a closure."
            )
    names = ["model"] + (["optimizer"] if optimizer is not None else [])
    names += [f"extras[{i}]" for i in range(len(extras))]
    _check_arity(fn, names, front)
    objects = [model] + ([optimizer] if optimizer is not None else []) + list(extras)
    arguments = dict(zip(parameter_names(fn, names), objects, strict=True))
    check_no_captured_nnx(fn, "train_step", arguments=arguments, names=_names)


def parameter_names(fn: Callable, names: list[str]) -> list[str]:
    """The names ``fn``'s own signature gives its first ``len(names)`` positional
    parameters (what the user reads in their code), else ``names``."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return names
    positional = [
        p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return positional[: len(names)] if len(positional) >= len(names) else names


def _check_arity(fn: Callable, names: list[str], front: str) -> None:
    """``fn`` is called as ``fn(*objects, batch)``: a mismatch is said now, not mid-trace."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an object without one: let it run
        return
    try:
        signature.bind(*names, "batch")
    except TypeError:
        call = ", ".join([*names, "batch"])
        raise TypeError(
            f"train_step{signature} cannot be called as train_step({call}), which is how "
            f"{front} calls it: the NNX objects it mutates (the model, the optimizer given, "
            f"then each of extras), then the batch. Pass the optimizer (and extras) your "
            f"function takes, or take the ones you pass."
        ) from None


def check_loss_fn(loss_fn: Any, model: Any = None, rngs: Any = None) -> None:
    """``loss_fn(model, batch[, rngs])`` is callable and captures no NNX object."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    arguments = None
    if model is not None:
        names = parameter_names(
            loss_fn, ["model", "batch"] + (["rngs"] if rngs is not None else [])
        )
        arguments = {names[0]: model} | ({names[2]: rngs} if rngs is not None else {})
    check_no_captured_nnx(loss_fn, "loss_fn", arguments=arguments, names=_names)


def user_step_owner(
    model: Any,
    optimizer: Any,
    train_step: Any,
    extras: tuple,
    *,
    kind: str,
    pure_call: str,
    stateful_front: str,
    init: Callable | None = None,
) -> Any:
    """The owner of a user's step (``Trainer``'s and ``scan_train``'s one way of taking it: a pure
    ``Step``, or a stateful NNX function, as ``kind`` says: ``_construction.step_kind``),
    after its checks."""
    from nnxscan.shell._engine.owner import ModelOwner

    if kind == "pure":
        check_pure_step(train_step, optimizer, extras, pure_call)
        step = train_step if init is None else train_step._replace(init=init)
        return ModelOwner.of_step(model, step)
    check_stateful_step(train_step, model, optimizer, extras, stateful_front)
    return ModelOwner.of_step(model, optimizer=optimizer, extras=extras)
