"""Argument checks of ``Population``: all run before anything is built or compiled."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnxscan.pure import Step, hyperparam_names, with_hyperparams
from nnxscan.pure.checks import check_count, check_transform
from nnxscan.shell._front_door import check_seed
from nnxscan.shell._metric_direction import metric_direction
from nnxscan.shell._module_check import call_model_fn
from nnxscan.shell._user_steps import check_pure_step


def check_model_fn(model_fn: Any) -> None:
    if not callable(model_fn):
        raise TypeError(
            f"model_fn must be callable as model_fn(rngs) -> nnx.Module, got "
            f"{type(model_fn).__name__}."
        )


def check_member_rngs(rngs: Any) -> None:
    """Call-time Rngs: one every member starts from, or ``rngs(seed)`` for each."""
    if rngs is not None and not (isinstance(rngs, nnx.Rngs) or callable(rngs)):
        raise TypeError(
            f"rngs must be an nnx.Rngs or a function seed -> nnx.Rngs, got {type(rngs).__name__}."
        )


def check_seeds(seeds: Any) -> tuple[int, ...]:
    if isinstance(seeds, str | bytes) or not isinstance(seeds, Sequence | np.ndarray):
        raise TypeError(
            f"seeds must be a list of ints, one per member (e.g. seeds=[0, 1, 2, 3]); got "
            f"{type(seeds).__name__} {seeds!r}."
        )
    if len(seeds) == 0:
        raise ValueError("seeds is empty: give one seed per member, e.g. seeds=[0, 1, 2, 3].")
    return tuple(check_seed(s, f"seeds[{i}]") for i, s in enumerate(seeds))


def check_hyperparams(hyperparams: Any, num_members: int) -> dict[str, tuple]:
    """``{name: N values}`` after checking the form (the names are checked against tx)."""
    if hyperparams is None:
        return {}
    if not isinstance(hyperparams, Mapping):
        raise TypeError(
            f"hyperparams must map names to one value per member, e.g. "
            f"{{'learning_rate': [1e-3, 3e-3]}}; got {type(hyperparams).__name__}."
        )
    checked = {}
    for name, values in hyperparams.items():
        if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
            raise TypeError(
                f"hyperparams[{name!r}] must be a list of {num_members} values (one per seed), "
                f"got {type(values).__name__}."
            )
        if len(values) != num_members:
            raise ValueError(
                f"hyperparams[{name!r}] has {len(values)} values but there are {num_members} "
                f"seeds: give exactly one value per member."
            )
        for i, value in enumerate(values):
            if np.ndim(value) != 0 or not np.issubdtype(np.asarray(value).dtype, np.number):
                raise ValueError(f"hyperparams[{name!r}][{i}] must be a number, got {value!r}.")
        checked[name] = tuple(values)
    return checked


def check_hyperparam_names(
    model_fn: Callable, init_opt: Callable, seed: int, hyperparams: dict, step: bool = False
) -> None:
    """Traces one member and its opt_state ``init_opt(graphdef, state)`` (shapes only,
    nothing compiles) to check the hyperparameter names against what it injects: the
    optax state of ``tx``, or the opt_state of a user's step (``step``) with the
    ``optax.inject_hyperparams`` states found anywhere in it."""
    if not hyperparams:
        return
    abstract = nnx.eval_shape(lambda: call_model_fn(model_fn, seed))
    graphdef, abstract_state = nnx.split(abstract)
    abstract_opt = jax.eval_shape(lambda s: init_opt(graphdef, s), abstract_state)
    settable, scheduled = hyperparam_names(abstract_opt)
    owner = "train_step.init's opt_state" if step else "tx"
    if not settable and not scheduled:
        if step:
            raise ValueError(
                f"hyperparams={sorted(hyperparams)} are set in the optax states that "
                f"optax.inject_hyperparams makes, and train_step.init's opt_state holds "
                f"none: build the step's transform(s) with it, e.g. "
                f"optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), so that "
                f"update reads each member's values from its opt_state; or build one "
                f"Step per setting and one Population each."
            )
        raise ValueError(
            f"hyperparams={sorted(hyperparams)} needs a tx made with "
            f"optax.inject_hyperparams, e.g. optax.inject_hyperparams(optax.adam)"
            f"(learning_rate=1e-3); this tx holds no injected hyperparameters."
        )
    try:  # the name rules are pure's (with_hyperparams), checked on shapes only
        jax.eval_shape(
            lambda o: with_hyperparams(o, **dict.fromkeys(hyperparams, 0.0)), abstract_opt
        )
    except ValueError as e:
        raise ValueError(f"hyperparams ({owner}): {e}") from None


def check_step_of_members(train_step: Any, kind: str) -> Step:
    """``Population(model_fn, train_step=S, ...)``: ``S`` must be a pure
    :class:`~nnxscan.pure.Step` (a population has no objects a stateful step could mutate);
    ``kind``: which step it is (``_construction.step_kind``)."""
    if kind == "pure":
        check_pure_step(train_step, None, (), "Population(model_fn, train_step=step, seeds=...)")
        return train_step
    if callable(train_step):
        raise TypeError(
            f"Population(train_step=...) takes a nnxscan.pure.Step (each member's opt_state "
            f"is step.init(graphdef, member_state)), got the function "
            f"{getattr(train_step, '__name__', type(train_step).__name__)!r}. A stateful NNX "
            f"step fn(model, optimizer, ..., batch) mutates objects a population does not "
            f"hold (it builds its members from model_fn, with no optimizer): write it as a "
            f"Step whose opt_state carries the optax state (docs/populations.md, 'A "
            f"population of your own step'); nnxscan.pure.nnx_train_step(fn) converts a fn "
            f"that takes the model alone, fn(model, batch). To train one model with fn "
            f"as written: Trainer(model, optimizer, train_step=fn)."
        )
    raise TypeError(f"train_step must be a nnxscan.pure.Step, got {type(train_step).__name__}.")


def member_optimizer(kind: str, train_step: Any, tx: Any, wrt: Any) -> tuple[Any, Any]:
    """``(tx, wrt)`` of the members' step, after checking it: a user's ``Step`` (it has
    none: ``(None, None)``) or the built-in step's; ``kind``: which step was given
    (``_construction.step_kind``)."""
    if kind != "loss":
        check_step_of_members(train_step, kind)
        return None, None
    return check_transform(tx), wrt


def check_member_indices(members: Any, num_members: int) -> list[int]:
    """``freeze``'s and ``unfreeze``'s members: an index or a sequence of them."""
    indices = [members] if isinstance(members, int | np.integer) else list(members)
    return [check_count(i, "member index", 0, num_members - 1) for i in indices]


def check_where(where: Any, num_members: int) -> Any:
    """``load_state``'s mask: one bool per member, or None (every member)."""
    if where is not None and np.shape(where) != (num_members,):
        raise ValueError(
            f"where must be one bool per member, shape ({num_members},); got shape "
            f"{np.shape(where)}."
        )
    return where


def check_best(metric: Any, mode: Any, latest: dict, num_members: int) -> tuple[np.ndarray, str]:
    """``best``'s values (one per member, given, or found by name in ``latest``) and its
    mode, ``"auto"`` read off the name."""
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode={mode!r}; use 'min', 'max' or 'auto'.")
    name = metric if isinstance(metric, str) else None
    if isinstance(metric, str):
        if metric not in latest:
            raise ValueError(
                f"no values named {metric!r} yet; known: {sorted(latest) or 'none'} (from "
                f"the latest evaluate() and the latest epoch's logs). Pass the values "
                f"themselves, or run evaluate(...) first."
            )
        metric = latest[metric]
    values = np.asarray(metric, np.float64)
    if values.shape != (num_members,):
        raise ValueError(
            f"best needs one value per member, shape ({num_members},); got shape {values.shape}."
        )
    if np.isnan(values).all():
        raise ValueError("every member's value is NaN: there is no best member.")
    if mode == "auto":
        mode = None if name is None else metric_direction(name)
        if mode is None:
            said = "values given directly" if name is None else f"the name {name!r}"
            raise ValueError(
                f"best: mode='auto' cannot tell from {said} whether the best is the lowest "
                f"or the highest; pass mode='min' or mode='max'."
            )
    return values, mode
