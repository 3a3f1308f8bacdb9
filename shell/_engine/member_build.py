"""Building a population's members: every member in ONE compiled program (``model_fn`` traced
once under a ``jax.vmap`` over the seeds), or one by one on the host where a trace cannot stand
for every member. Both give the :class:`~nnxscan.shell._engine.members.StackedOwner` the fit
engine trains.
"""

from __future__ import annotations

import math
from typing import Any

import flax.errors
import jax
import numpy as np
from flax import nnx
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun, subjaxprs

from nnxscan.pure import (
    MembersState,
    Step,
    compile_once,
    paused_gc,
    stack_states,
    vmap_members,
)
from nnxscan.pure.step_node import step_node
from nnxscan.pure.threefry import unrolled_threefry
from nnxscan.shell._engine.layout import Members
from nnxscan.shell._engine.members import StackedOwner
from nnxscan.shell._engine.owner import split_plain
from nnxscan.shell._module_check import call_model_fn


def build_members(
    model_fn: Any,
    step: Step,
    seeds: tuple[int, ...],
    hyperparams: dict[str, tuple],
    layout: Members,
    *,
    rngs: Any = None,
    metrics: nnx.Metric | None = None,
    one_by_one: bool = False,
) -> StackedOwner:
    """Builds every member (``model_fn(nnx.Rngs(seed))``, its node with call-time Rngs and
    metrics, its opt_state ``step.init(graphdef, state)`` on its own split, with its
    hyperparameters: ``vmap_members(step, hyperparams=...).init`` of the stacked states)
    and stacks them in an owner. ``step`` is the one the members train with (its update
    runs in the fit's program, vmapped by the run's layout).

    All members are built by ONE compiled program, ``model_fn`` traced once under a
    ``jax.vmap`` over the seeds (what population libraries do, and Flax's vmapped
    constructors): building 1,024 members costs about what building one does, where
    building them one by one on the host costs a model's eager construction per member.
    The result is the one-by-one build's: member ``i``'s key is ``jax.random.key`` of
    ``seeds[i]`` (the same key data for a traced int32 as for the Python int, so the same
    threefry bits), its Rngs, metrics and optax states the same functions of it. Keys and
    integers come out bitwise equal; floats are those of one fused program instead of
    Flax's op-by-op initialisers (bitwise equal on the CPUs checked, which no one promises
    across programs: see :func:`nnxscan.pure.build_compiled`).

    The members are built one by one instead, eagerly on the host (:func:`_one_by_one`,
    which gives a model_fn's own errors their own messages, and checks that every member
    has the same structure; ``one_by_one=True`` asks for it, as tests and benchmarks do to
    compare) where one trace cannot stand for every member:

    - ``model_fn`` cannot be traced: it reads a value on the host (``np.asarray``,
      ``float``, ``int`` of an array, Python control flow on one; a structure that depends
      on the seed can only come from such a read), or changes an NNX object created
      outside it (a closed-over ``nnx.Rngs`` it draws from). Only JAX's and Flax's
      tracing errors are taken for that (:data:`_UNTRACEABLE`); any other error is the
      model's own and is raised as it is.
    - a seed outside int32 (a traced seed is int32; the shell's seeds always fit), or
      ``jax.disable_jit()`` (debugging: everything runs eagerly).

    A traced ``model_fn`` runs once, not once per member: a side effect in it (a print, a
    draw from numpy's global generator, which is not a function of its Rngs) happens once,
    and what it gives is every member's. Call-time ``rngs(seed)`` is called on the host,
    once per member (a function of a Python int: ``nnx.Rngs(100 + seed)`` cannot take a
    traced one), and its states go into the program as data.
    """
    # The one path for per-member hyperparameters: the members wrapper's own init.
    members_step = vmap_members(step, hyperparams=hyperparams)
    built = None if one_by_one else _in_one_program(model_fn, members_step, seeds, rngs, metrics)
    if built is None:
        built = _one_by_one(model_fn, members_step, seeds, rngs, metrics)
    graphdef, model_graphdef, state, members_state = built
    return StackedOwner(
        graphdef, state, members_state,
        layout=layout, model_graphdef=model_graphdef, seeds=seeds, hyperparams=hyperparams,
        with_rngs=rngs is not None, metrics=metrics,
    )  # fmt: skip


def _one_by_one(
    model_fn: Any, members_step: Step, seeds: tuple[int, ...], rngs: Any, metrics: Any
) -> tuple[nnx.GraphDef, nnx.GraphDef, Any, MembersState]:
    """:func:`_in_one_program`'s parts, each member built eagerly on the host, one after
    another (the path for a ``model_fn`` that cannot be traced; its cost grows with the
    members)."""
    graphdef, model_graphdef, states = None, None, []
    for i, seed in enumerate(seeds):
        model = call_model_fn(model_fn, seed)
        member_rngs = _member_rngs(rngs, seed)
        member_graphdef, state = split_plain(step_node(model, member_rngs, metrics))
        if graphdef is None:
            graphdef, model_graphdef = member_graphdef, nnx.split(model)[0]
        elif member_graphdef != graphdef:
            raise ValueError(
                f"model_fn built member {i} (seed {seed}) with a different structure from "
                f"member 0 (seed {seeds[0]}): every member must be the same architecture; "
                f"only the seed may change."
            )
        states.append(state)
    states = stack_states(states)
    return graphdef, model_graphdef, states, members_step.init(graphdef, states)


def _member_rngs(rngs: Any, seed: int) -> nnx.Rngs | None:
    """A member's call-time Rngs: the one given (every member starts from it), or
    ``rngs(seed)``."""
    member_rngs = rngs(seed) if callable(rngs) and not isinstance(rngs, nnx.Rngs) else rngs
    if member_rngs is not None and not isinstance(member_rngs, nnx.Rngs):
        raise TypeError(f"rngs(seed) must return an nnx.Rngs, got {type(member_rngs).__name__}.")
    return member_rngs


#: The errors that say a ``model_fn`` cannot be traced (it needs a value a trace does not
#: have, or mutates an NNX object from outside the trace). Each is raised while tracing,
#: before anything is compiled or built, and only then does the build go one by one.
_UNTRACEABLE = (
    jax.errors.ConcretizationTypeError,  # float(x), x.item(), shapes from values
    jax.errors.TracerBoolConversionError,  # `if x:` (a ConcretizationTypeError too)
    jax.errors.TracerIntegerConversionError,  # int(x), x as an index of a list
    jax.errors.TracerArrayConversionError,  # np.asarray(x)
    jax.errors.NonConcreteBooleanIndexError,  # x[x > 0]
    jax.errors.UnexpectedTracerError,  # a traced value kept past its trace
    flax.errors.TraceContextError,  # a closed-over nnx.Rngs drawn from, a Variable set
    # A transform JAX cannot batch: a hijax Variable created under vmap (flax 0.12.8:
    # "Batching rule for 'new_variable' not implemented"). A model's own
    # NotImplementedError is raised again, as it is, by the one-by-one build.
    NotImplementedError,
)
_INT32 = (-(2**31), 2**31 - 1)
# From this many random entries drawn (all members'), a CPU build draws them through JAX's
# threefry hash unrolled (nnxscan.pure.threefry: the same bits). XLA:CPU runs the unrolled
# hash several times faster per entry than JAX's loop of it, but traces and compiles it
# longer, so it pays only where many entries are drawn: 2**24 lies between the builds that
# ran sooner rolled and those that ran sooner unrolled (docs/performance.md, "Populations:
# members built in one program"). The entries are read off the traced build.
_UNROLL_FROM = 2**24


def _in_one_program(
    model_fn: Any,
    members_step: Step,
    seeds: tuple[int, ...],
    rngs: Any,
    metrics: Any,
) -> tuple[nnx.GraphDef, nnx.GraphDef, Any, MembersState] | None:
    """``(graphdef, model_graphdef, stacked state, members_step.init of it)`` built by one
    compiled program, or None where the members must be built one by one (see
    :func:`build_members`)."""
    if not seeds or jax.config.jax_disable_jit:
        return None
    if not all(_INT32[0] <= seed <= _INT32[1] for seed in seeds):
        return None
    shared_rngs, rngs_graphdef, rngs_state = rngs, None, None
    if callable(rngs) and not isinstance(rngs, nnx.Rngs):
        made = [split_plain(_member_rngs(rngs, seed)) for seed in seeds]
        rngs_graphdef = made[0][0]
        same = all(g == rngs_graphdef for g, _ in made)
        rngs_state = _stacked_on_host([s for _, s in made]) if same else None
        if rngs_state is None:
            return None  # one by one: its structure check names the member
    graphdefs: list[tuple[nnx.GraphDef, nnx.GraphDef]] = []

    def build_one(seed: jax.Array, member_rngs_state: Any) -> Any:
        model = call_model_fn(model_fn, seeds[0], nnx.Rngs(jax.random.key(seed)))
        member_rngs = (
            shared_rngs if rngs_graphdef is None else nnx.merge(rngs_graphdef, member_rngs_state)
        )
        graphdef, state = split_plain(step_node(model, member_rngs, metrics))
        graphdefs.append((graphdef, nnx.split(model)[0]))
        return state

    def build_all(seed_array: Any, rngs_state: Any) -> tuple[Any, MembersState]:
        # One vmap over every member, on every backend: a loop over chunks of members
        # (`lax.map(batch_size=)`, each chunk vmapped), which would bound the compile's
        # growth with N on a TPU, builds there several times slower than one vmap
        # (docs/performance.md, "Tried and not kept").
        states = jax.vmap(build_one)(seed_array, rngs_state)
        return states, members_step.init(graphdefs[-1][0], states)

    # The seeds in the dtype jax gives a Python int (int32, or int64 with jax_enable_x64).
    seed_array = np.asarray(seeds, jax.dtypes.canonicalize_dtype(np.int64))
    try:
        with paused_gc():
            closed, shapes = jax.make_jaxpr(build_all, return_shape=True)(seed_array, rngs_state)
    except _UNTRACEABLE:
        return None
    graphdef, model_graphdef = graphdefs[-1]
    # The build's constants (weights a model_fn loads, a shared template's state) are
    # arguments of the program, not constants embedded in it: a pretrained model would
    # otherwise be compiled into the program's text.
    try:
        run = jaxpr_as_fun(_constants_as_arguments(closed))
    except (AttributeError, TypeError):  # another jax's jaxpr: its constants stay embedded
        run, consts = jaxpr_as_fun(closed), []
    else:
        consts = list(closed.consts)
    if jax.default_backend() == "cpu" and _drawn_entries(closed.jaxpr) >= _UNROLL_FROM:
        run = unrolled_threefry(run)
    treedef = jax.tree.structure(shapes)

    def program(consts: list, seed_array: Any, rngs_state: Any) -> Any:
        return jax.tree.unflatten(treedef, run(*consts, *jax.tree.leaves((seed_array, rngs_state))))

    args = (consts, seed_array, rngs_state)
    with paused_gc():
        lowered = jax.jit(program).lower(*args)
    try:
        # The build runs once, so its compile is most of what it costs: compiled for a
        # program run once (pure.compile_once: on the CPU about 10x sooner for 1,024 small
        # MLPs and their Adam states, and no slower to run; docs/performance.md).
        state, members_state = compile_once(lowered)(*args)
    except jax.errors.JaxRuntimeError as error:
        # Every member's initialiser temporaries at once may not fit where one member's
        # did (a large model, many members): build them one at a time then.
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        return None
    return graphdef, model_graphdef, state, members_state


def _stacked_on_host(states: list) -> Any:
    """``stack_states(states)`` of small states made on the host (call-time Rngs: a key and
    a count a stream), in one transfer and numpy: states this small stack there many times
    sooner than by ``jnp.stack`` on the device (docs/performance.md). None where two
    members' leaves differ in shape or dtype."""
    leaves = [jax.tree.leaves(state) for state in states]
    first = leaves[0]
    avals = [(x.shape, x.dtype) for x in first]
    if any([(x.shape, x.dtype) for x in member] != avals for member in leaves):
        return None
    is_key = [jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in first]
    data = [
        [jax.random.key_data(x) if k else x for x, k in zip(m, is_key, strict=True)] for m in leaves
    ]
    columns = [np.stack(column) for column in zip(*jax.device_get(data), strict=True)]
    stacked = [
        jax.random.wrap_key_data(c, impl=jax.random.key_impl(x)) if k else c
        for c, x, k in zip(columns, first, is_key, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(states[0]), stacked)


def _drawn_entries(jaxpr: Any) -> int:
    """How many random entries ``jaxpr`` draws (its ``random_bits``, at any depth)."""
    entries = sum(
        math.prod(eqn.outvars[0].aval.shape)
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "random_bits"
    )
    return entries + sum(_drawn_entries(inner) for inner in subjaxprs(jaxpr))


def _constants_as_arguments(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with its constants taken as its first arguments instead."""
    jaxpr = closed.jaxpr
    info = jaxpr.debug_info
    names = info.arg_names
    if names is not None:
        names = (*(f"constants[{i}]" for i in range(len(jaxpr.constvars))), *names)
    hoisted = jaxpr.replace(
        constvars=[],
        invars=[*jaxpr.constvars, *jaxpr.invars],
        debug_info=info._replace(arg_names=names),
    )
    return ClosedJaxpr(hoisted, [])
