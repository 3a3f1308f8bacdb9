"""Build an NNX module in one compiled call: every initializer in one program.

Built eagerly, a module's initializers run op by op, and every ``jax.random`` draw or
scaling of a new shape compiles a small program of its own (an MLP of three layers compiles
a dozen; a truncated-normal draw is among the slowest programs XLA:CPU compiles). Traced
under one ``jax.jit`` they compile once, together. The program runs once, so it is compiled
for compile time (LLVM's ``-O1`` instead of ``-O2``): its values are the eager ones to float
rounding (one fused program against many small ones; the same bits on the CPUs tested, which
no one promises across programs), it only compiles sooner.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import TypeVar

import flax.errors
import jax
from flax import nnx

__all__ = ["build_compiled", "paused_gc"]

M = TypeVar("M")

# Read by XLA:CPU's backend; other backends ignore it.
_ONCE = {"xla_backend_optimization_level": 1}
# XLA:CPU's older fusion code generator compiles a one-shot program ~20% sooner, to the same
# bits on the builds measured (docs/performance.md); XLA releases after jax 0.10 removed the
# option and refuse it as the options are read, before compiling (~2 ms), so it is simply
# tried each time (no memo: the pure core keeps no mutable state).
_ONCE_WHERE_KNOWN = {**_ONCE, "xla_cpu_use_fusion_emitters": False}


def _compile_once(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """``lowered`` compiled for compile time, with the options this XLA knows."""
    try:
        return lowered.compile(_ONCE_WHERE_KNOWN)
    except jax.errors.JaxRuntimeError as error:
        if "No such compile option" not in str(error):
            raise
    return lowered.compile(_ONCE)


def build_compiled(constructor: Callable[[], M]) -> M:
    """``constructor()``, traced and run as one compiled program.

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
    try:
        with paused_gc():
            lowered = jax.jit(build).lower()
    except flax.errors.TraceContextError as error:
        raise TypeError(
            "build_compiled: the constructor changes an NNX object created outside it (an "
            "nnx.Rngs advanced by an initializer, say). Create it inside: "
            "build_compiled(lambda: Model(rngs=nnx.Rngs(0)))."
        ) from error
    return nnx.merge(graphdefs[-1], _compile_once(lowered)())


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
