"""Build an NNX module in one compiled call: every initializer in one program.

Built eagerly, a module's initializers run op by op, and every ``jax.random`` draw or
scaling of a new shape compiles a small program of its own (an MLP of three layers compiles
a dozen; a truncated-normal draw is among the slowest programs XLA:CPU compiles). Traced
under one ``jax.jit`` they compile once, together. The program runs once, so it is compiled
for compile time (LLVM's ``-O1`` instead of ``-O2``): its values are the eager ones to float
rounding (one fused program against many small ones; the same bits on the CPUs tested, which
no one promises across programs), it only compiles sooner.

Its random draws compile as one. Each ``jax.random`` draw is a threefry hash over its own
counters, and XLA:CPU compiles each as a kernel of its own, so the number of draws, not
their sizes, sets most of a build's compile (docs/performance.md). With JAX's
partitionable threefry (the default), a draw's bits are an elementwise hash of its key and
each entry's index, so the draws of scalar threefry keys that are ready together are
computed by one hash over all their keys and indices and cut apart: the same bits, by
construction (``_merged_hashes``). Splits of a scalar key are the same hash, and so is every
key an ``nnx.Rngs`` stream hands out (``fold_in(key, count)``: the hash of one counter
pair), each a rolled hash loop of its own otherwise (a hypernetwork learner's twelve
fold-ins would compile as twelve loops). The constructor is traced
once, to a jaxpr; that jaxpr is then evaluated under ``jax.jit`` with ``jit`` calls inlined
and the ready hashes merged: the keys first, then the draws of those keys. Keys are merged
in that first round only; a key made from a merged one (a chain of splits) runs as an
ordinary op, so a chain costs what it did and its draws still merge.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import flax.errors
import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import Literal, jaxpr_as_fun

try:  # jax internals: without them (another jax), draws compile one by one, as before
    from jax._src.random.prng import UINT_DTYPES, iota_2x32_shape, random_wrap
    from jax._src.random.threefry2x32 import threefry2x32_p, threefry_seed
except ImportError:  # pragma: no cover - depends on the installed jax
    threefry2x32_p = None

__all__ = ["build_compiled", "compile_once", "paused_gc"]

M = TypeVar("M")

# Read by XLA:CPU's backend; other backends ignore it.
_ONCE = {"xla_backend_optimization_level": 1}
# XLA:CPU's older fusion code generator compiles a one-shot program sooner, to the same bits
# on the builds measured (docs/performance.md). Newer XLA releases removed the option and
# refuse it while reading the options, before any compiling, so a refusal is cheap and the
# option is simply tried each time: remembering the answer would be mutable state, which
# the pure core does not keep.
_ONCE_WHERE_KNOWN = {**_ONCE, "xla_cpu_use_fusion_emitters": False}
# The most entries one merged threefry hash covers (its counters and keys: 16 bytes each).
_MERGED_ENTRIES = 2**24


def compile_once(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """``lowered`` compiled for a program that runs once: on the CPU with XLA's options that
    compile it sooner (LLVM's -O1 and, where this XLA still has it, the older fusion code
    generator: the same bits on the builds measured, docs/performance.md); elsewhere as it
    is. What :func:`build_compiled` and a population's build of its members use.

    Example:
      >>> init = compile_once(jax.jit(lambda key: jax.random.normal(key, (4,))).lower(key))
      >>> init(key).shape
      (4,)
    """
    if jax.default_backend() != "cpu":
        return lowered.compile()
    try:
        return lowered.compile(_ONCE_WHERE_KNOWN)
    except jax.errors.JaxRuntimeError as error:
        if "No such compile option" not in str(error):
            raise
    return lowered.compile(_ONCE)


def build_compiled(constructor: Callable[[], M]) -> M:
    """``constructor()``, traced and run as one compiled program.

    The program compiles for compile time (``-O1``), and its threefry keys and draws run
    as one hash over all their counters per round of readiness, each one's own bits (see
    the module doc).

    Args:
      constructor: a function of no arguments that builds and returns an NNX module,
        creating the ``nnx.Rngs`` it draws from itself (an ``nnx.Rngs`` made outside
        cannot be advanced inside the compiled call).

    Returns:
      The module, with the values of ``constructor()`` built eagerly (keys and integers
      exactly, floats to float rounding).

    Raises:
      TypeError: ``constructor`` is not callable, does not return an NNX module, or
        advances an ``nnx.Rngs`` (or sets a Variable) created outside it.

    Example:
      >>> model = build_compiled(lambda: MLP(64, 100, 2, rngs=nnx.Rngs(0)))   # one compile
    """
    if not callable(constructor):
        raise TypeError(f"constructor must be callable, got {type(constructor).__name__}.")
    graphdefs = []

    def build() -> nnx.State:
        module = constructor()
        if not isinstance(module, nnx.Module):
            raise TypeError(f"constructor must return an nnx.Module, got {type(module).__name__}.")
        graphdef, state = nnx.split(module)
        graphdefs.append(graphdef)
        return state

    if jax.config.jax_disable_jit:  # as jax.jit(build)() would: eagerly
        state = build()
        return nnx.merge(graphdefs[-1], state)
    treedefs = []

    def build_leaves() -> list[Any]:
        leaves, treedef = jax.tree.flatten(build())
        treedefs.append(treedef)
        return leaves

    try:
        with paused_gc():
            closed = jax.make_jaxpr(build_leaves)()
            lowered = _lowered_with_merged_hashes(closed)
            if lowered is None:  # nothing to merge, or this jax's internals differ
                lowered = jax.jit(jaxpr_as_fun(closed)).lower()
    except flax.errors.TraceContextError as error:
        raise TypeError(
            "build_compiled: the constructor changes an NNX object created outside it (an "
            "nnx.Rngs advanced by an initializer, say). Create it inside: "
            "build_compiled(lambda: Model(rngs=nnx.Rngs(0)))."
        ) from error
    leaves = compile_once(lowered)()
    return nnx.merge(graphdefs[-1], jax.tree.unflatten(treedefs[-1], leaves))


def _hashed(eqn: Any) -> bool:
    """A threefry hash of one (scalar) key, elementwise in its counters: a draw of bits or
    a split (partitionable), or a fold-in of one scalar message."""
    name = eqn.primitive.name
    if name not in ("random_bits", "random_split", "random_fold_in"):
        return False
    aval = eqn.invars[0].aval
    impl = getattr(aval.dtype, "_impl", None)
    if aval.shape != () or getattr(impl, "name", None) != "threefry2x32":
        return False
    if name == "random_fold_in":  # the same hash whatever the partitionable setting
        return eqn.invars[1].aval.shape == ()
    return _partitionable(eqn) and _entries(eqn) <= _MERGED_ENTRIES


def _partitionable(eqn: Any) -> bool:
    """The op's own threefry setting (a ``with jax.threefry_partitionable(False):`` in the
    constructor), as its lowering reads it: an attribute of the equation's context up to
    jax 0.12.0, one of its recorded configs after (read by entering that context, as the
    lowering does); False where this jax records neither."""
    ctx = eqn.ctx
    if hasattr(ctx, "threefry_partitionable"):
        return ctx.threefry_partitionable is True
    manager = getattr(ctx, "manager", None)
    if manager is None:
        return False
    with manager:
        return jax.config.jax_threefry_partitionable is True


def _entries(eqn: Any) -> int:
    """How many counters a hashed op's hash covers."""
    return 1 if eqn.primitive.name == "random_fold_in" else math.prod(eqn.params["shape"])


def _plain_jit(eqn: Any) -> bool:
    """A ``jit`` call with no shardings or compiler options of its own: safe to inline."""
    if eqn.primitive.name not in ("jit", "pjit"):
        return False
    shardings = [*eqn.params.get("in_shardings", ()), *eqn.params.get("out_shardings", ())]
    unspecified = all(type(s).__name__ == "UnspecifiedValue" for s in shardings)
    return unspecified and not eqn.params.get("compiler_options_kvs")


def _inlined(closed: Any) -> tuple[list[tuple[Any, list, list]], dict, list]:
    """The jaxpr's equations with every ``jit`` call inlined, over fresh references:
    ``(ops, constants, outputs)``, an op ``(eqn, input refs, output refs)``."""
    ops: list[tuple[Any, list, list]] = []
    constants: dict = {}
    fresh = itertools.count()

    def visit(jaxpr: Any, consts: Any, inputs: list) -> list:
        refs = [next(fresh) for _ in jaxpr.constvars]
        constants.update(zip(refs, consts, strict=True))
        env = dict(zip([*jaxpr.invars, *jaxpr.constvars], [*inputs, *refs], strict=True))

        def read(atom: Any) -> Any:
            if isinstance(atom, Literal):
                ref = next(fresh)
                constants.update({ref: atom.val})
                return ref
            return env[atom]

        for eqn in jaxpr.eqns:
            refs = [read(atom) for atom in eqn.invars]
            if _plain_jit(eqn):
                inner = eqn.params["jaxpr"]
                outs = visit(inner.jaxpr, inner.consts, refs)
            else:
                outs = [next(fresh) for _ in eqn.outvars]
                ops.append((eqn, refs, outs))
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(atom) for atom in jaxpr.outvars]

    outputs = visit(closed.jaxpr, closed.consts, [])
    return ops, constants, outputs


def _lowered_with_merged_hashes(closed: Any) -> jax.stages.Lowered | None:
    """The build's jaxpr lowered with its ready threefry hashes merged; None where there
    are fewer than two to merge, the jaxpr has effects, or this jax lacks the internals."""
    if threefry2x32_p is None or closed.effects:
        return None
    try:
        ops, constants, outputs = _inlined(closed)
    except Exception:  # a jaxpr this reading does not know: compile it as it is
        return None
    if sum(_hashed(eqn) for eqn, _, _ in ops) < 2:
        return None

    def run() -> list:
        values = dict(constants)
        pending = ops
        # Keys (fold-ins, splits) are merged in the first round of hashes only: the keys an
        # nnx.Rngs hands out are all ready then. After it they run as ordinary ops, so a
        # chain of splits (`key, sub = split(key)`) runs through at once, and its draws
        # then merge, instead of taking a round (and a hash) per link.
        first_round = True

        def held(eqn: Any) -> bool:
            return _hashed(eqn) and (first_round or eqn.primitive.name == "random_bits")

        while pending:
            # Everything that can run without another hash, in order; then the hashes
            # that are ready, together.
            progressed = True
            while progressed:
                progressed, waiting = False, []
                for op in pending:
                    eqn, refs, outs = op
                    if held(eqn) or not all(r in values for r in refs):
                        waiting.append(op)
                        continue
                    params = eqn.primitive.get_bind_params(eqn.params)
                    with eqn.ctx.manager:
                        result = eqn.primitive.bind(*(values[r] for r in refs), **params)
                    results = result if eqn.primitive.multiple_results else [result]
                    values.update(zip(outs, results, strict=True))
                    progressed = True
                pending = waiting
            ready = [op for op in pending if all(r in values for r in op[1])]
            if not ready:
                break  # unreachable for a well-formed jaxpr: everything left waits on itself
            # Hashes of at most _MERGED_ENTRIES entries each: the saving is in the number of
            # kernels, and one hash over a whole large model would hold all its counters.
            group, size = [], 0
            for op in ready:
                entries = _entries(op[0])
                if group and size + entries > _MERGED_ENTRIES:
                    values.update(_merged_hashes(group, values))
                    group, size = [], 0
                group.append(op)
                size += entries
            values.update(_merged_hashes(group, values))
            # By identity: an op's equation is a record, and comparing two would compare
            # their params.
            merged = {id(op) for op in ready}
            pending = [op for op in pending if id(op) not in merged]
            first_round = False
        return [values[r] for r in outputs]

    try:
        return jax.jit(run).lower()
    except Exception:  # our reading of this jax's internals: compile it as it is
        return None


def _merged_hashes(hashed: list[tuple[Any, list, list]], values: dict) -> dict:
    """Each hashed op's result, by its output reference, from one ``threefry2x32`` over
    every op's keys and counters, each op's counters and output as JAX computes them:

    - ``random_bits`` (partitionable): counters ``iota_2x32_shape(shape)``, the two halves
      combined by bit width;
    - ``random_split`` (partitionable): the same counters, the halves stacked as keys;
    - ``random_fold_in``: the counter pair ``threefry_seed(uint32(msg))``, the two words
      the new key (``threefry_2x32(key, threefry_seed(msg))`` on a pair of counters)."""
    k1, k2, c1, c2, sizes = [], [], [], [], []
    for eqn, refs, _ in hashed:
        key = jax.random.key_data(values[refs[0]])
        if eqn.primitive.name == "random_fold_in":
            pair = threefry_seed(jnp.asarray(values[refs[1]], jnp.uint32))
            hi, lo = pair[:1], pair[1:]
        else:
            hi, lo = iota_2x32_shape(eqn.params["shape"])
        size = _entries(eqn)
        k1.append(jnp.broadcast_to(key[0], (size,)))
        k2.append(jnp.broadcast_to(key[1], (size,)))
        c1.append(hi.reshape(-1))
        c2.append(lo.reshape(-1))
        sizes.append(size)
    bits1, bits2 = threefry2x32_p.bind(*(jnp.concatenate(x) for x in (k1, k2, c1, c2)))
    cut = list(itertools.accumulate(sizes))[:-1]
    out = {}
    pieces = zip(hashed, jnp.split(bits1, cut), jnp.split(bits2, cut), strict=True)
    for (eqn, _, outs), b1, b2 in pieces:
        impl = eqn.invars[0].aval.dtype._impl
        if eqn.primitive.name == "random_fold_in":
            result = random_wrap(jnp.concatenate([b1, b2]), impl=impl)
        elif eqn.primitive.name == "random_split":
            shape = eqn.params["shape"]
            data = jnp.stack([b1.reshape(shape), b2.reshape(shape)], axis=len(shape))
            result = random_wrap(data, impl=impl)
        else:
            result = _bits_of(b1.reshape(eqn.params["shape"]), b2.reshape(eqn.params["shape"]),
                              eqn.params["bit_width"])  # fmt: skip
        out.update({outs[0]: result})
    return out


def _bits_of(b1: jax.Array, b2: jax.Array, width: int) -> jax.Array:
    """A partitionable draw's bits of ``width`` from its two hash words."""
    dtype = UINT_DTYPES[width]
    if width == 64:
        return jax.lax.shift_left(b1.astype(dtype), jnp.asarray(32, dtype)) | b2.astype(dtype)
    if width == 32:
        return b1 ^ b2
    return (b1 ^ b2).astype(dtype)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """CPython's cyclic garbage collector paused for the block (and restored as it was).

    Tracing and lowering a program allocate hundreds of thousands of short-lived Python
    objects, and each full collection they trigger walks every object the process holds
    (jax's, flax's, the user's): a third of a hypernetwork learner's step trace
    (docs/performance.md). Reference counting still frees what it can; cycles made in
    the block wait for the next collection after it. ``Trainer.fit``, ``evaluate`` and
    :func:`build_compiled` trace under it; use it around your own first call of a big
    ``jax.jit`` function. Nothing computed changes.

    The collector is one per process: a block entered while another thread has it paused
    leaves it as it is, and the first block to end turns it back on (never off for good;
    at worst a trace on the other thread runs with collections again).

    Example:
      >>> with paused_gc():
      ...     compiled = jax.jit(step).lower(state, opt_state, batch).compile()
    """
    if not gc.isenabled():  # the user's choice, or an enclosing pause: left as it is
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
