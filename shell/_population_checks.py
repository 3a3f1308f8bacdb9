"""Argument checks of ``Population``: all run before anything is built or compiled."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from nnxscan.pure import Step, hyperparam_names
from nnxscan.pure.checks import check_count
from nnxscan.shell._module_check import is_linen
from nnxscan.shell._user_steps import check_pure_step, refuse_loss_options

_MAX_SEED = 2**31 - 1  # as Trainer: the seed enters numpy's generator as an int32


def check_seeds(seeds: Any) -> tuple[int, ...]:
    if isinstance(seeds, str | bytes) or not isinstance(seeds, Sequence | np.ndarray):
        raise TypeError(
            f"seeds must be a list of ints, one per member (e.g. seeds=[0, 1, 2, 3]); got "
            f"{type(seeds).__name__} {seeds!r}."
        )
    if len(seeds) == 0:
        raise ValueError("seeds is empty: give one seed per member, e.g. seeds=[0, 1, 2, 3].")
    return tuple(check_count(s, f"seeds[{i}]", 0, _MAX_SEED) for i, s in enumerate(seeds))


def check_hyperparams(hyperparams: Any, members: int) -> dict[str, tuple]:
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
                f"hyperparams[{name!r}] must be a list of {members} values (one per seed), "
                f"got {type(values).__name__}."
            )
        if len(values) != members:
            raise ValueError(
                f"hyperparams[{name!r}] has {len(values)} values but there are {members} "
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
    for name in hyperparams:
        if name in scheduled:
            raise ValueError(
                f"hyperparams[{name!r}]: {owner} computes {name!r} from a schedule every "
                f"step, so per-member values would have no effect. Pass a number for "
                f"it to inject_hyperparams."
            )
        if name not in settable:
            raise ValueError(
                f"hyperparams[{name!r}]: {name!r} is not a hyperparameter of {owner}; its "
                f"injected hyperparameters are {sorted(settable)}."
            )


def check_user_step(train_step: Any, given: list[str]) -> Step:
    """``Population(model_fn, train_step=S, ...)``: ``S`` must be a pure
    :class:`~nnxscan.pure.Step`, and nothing meant for the built-in step (``given``: the
    names of such options passed) may come with it."""
    refuse_loss_options(given)
    if isinstance(train_step, Step):
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


def mesh_axes(
    mesh: Mesh | None, member_axis: str | None, data_axis: str | None, members: int
) -> tuple[str | None, str | None]:
    """The ``(member_axis, data_axis)`` a population uses on ``mesh``: each when the mesh
    has it. Every other mesh axis, a mesh with neither, and members that do not divide
    over the member axis are refused."""
    if mesh is None:
        return None, None
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    names = tuple(mesh.axis_names)
    if member_axis is not None and member_axis == data_axis:
        raise ValueError(
            f"member_axis and data_axis are both {member_axis!r}: the members spread over one "
            f"mesh axis and each member's batches over another (or none: data_axis=None)."
        )
    used = [axis if axis in names else None for axis in (member_axis, data_axis)]
    if used == [None, None]:
        raise ValueError(
            f"the mesh's axes {names} include neither member_axis={member_axis!r} nor "
            f"data_axis={data_axis!r}: name the mesh axis to spread the members over as "
            f"member_axis= (and the one to split each batch over as data_axis=)."
        )
    other = [name for name in names if name not in used and mesh.shape[name] > 1]
    if other:
        raise ValueError(
            f"mesh axis {other[0]!r} (size {mesh.shape[other[0]]}) is neither member_axis "
            f"{member_axis!r} nor data_axis {data_axis!r}: a population spreads its members "
            f"over one axis and each batch over another; build the mesh from those."
        )
    member_axis, data_axis = used
    if member_axis is not None and members % mesh.shape[member_axis]:
        size = mesh.shape[member_axis]
        raise ValueError(
            f"{members} members do not divide over the {size} devices of mesh axis "
            f"{member_axis!r}: use a multiple of {size} seeds."
        )
    return member_axis, data_axis


def call_model_fn(model_fn: Callable, seed: int) -> nnx.Module:
    model = model_fn(nnx.Rngs(seed))
    if is_linen(model):
        raise TypeError(
            f"model_fn(nnx.Rngs({seed})) returned {type(model).__name__}, a Flax Linen module, "
            f"not an nnx.Module: return it wrapped, e.g. model_fn=lambda rngs: "
            f"nnxscan.adapters.linen.LinenModule({type(model).__name__}(...), sample_x, "
            f"rngs=rngs), which initializes it from an example input and lets model.eval() "
            f"switch its train mode (docs/porting.md, 'A Linen model')."
        )
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model_fn(nnx.Rngs({seed})) returned {type(model).__name__}, not an nnx.Module: "
            f"it must build and return one module, e.g. model_fn=lambda rngs: MLP(rngs=rngs)."
        )
    return model
