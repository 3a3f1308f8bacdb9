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

from collections.abc import Callable
from typing import TypeVar

import flax.errors
import jax
from flax import nnx

__all__ = ["build_compiled"]

M = TypeVar("M")

# Read by XLA:CPU's backend; other backends ignore it.
_ONCE = {"xla_backend_optimization_level": 1}


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

    try:
        state = jax.jit(build, compiler_options=_ONCE)()
    except flax.errors.TraceContextError as error:
        raise TypeError(
            "build_compiled: the constructor changes an NNX object created outside it (an "
            "nnx.Rngs advanced by an initializer, say). Create it inside: "
            "build_compiled(lambda: Model(rngs=nnx.Rngs(0)))."
        ) from error
    return nnx.merge(graphdefs[-1], state)
