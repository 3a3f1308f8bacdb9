"""Run a target network with given (generated) parameters, as a pure function.

Assigning generated weights into a live module (``target.out.kernel = w``, or
``nnx.update(target, ...)`` inside a traced function) either raises ``TraceContextError`` or
cuts the gradient. Here the target is rebuilt from its graphdef instead: ``nnx.merge`` of
the spec's graphdef, the given params and the spec's non-generated state, inside whatever
trace is running. Nothing outside the call is mutated, and gradients flow into ``params``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from nnxscan.pure.hyper.spec import ParamSpec, check_params

__all__ = ["call", "call_with_state"]


def call(spec: ParamSpec, params: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Runs the spec's target on ``*args, **kwargs`` with ``params`` as its generated variables.

    A pure function of ``(spec, params, args)``: differentiable in ``params``, usable under
    ``jit``, ``grad``, ``vmap`` and ``scan``, and it never mutates the target or the spec.
    Variables the spec does not generate come from ``spec.rest``; changes the forward pass
    makes to them (batch statistics, RNG counts) are discarded. Use :func:`call_with_state`
    to keep them, e.g. so that Dropout draws a new mask on every call.

    Args:
      spec: from :meth:`ParamSpec.from_module`.
      params: the generated variables: an ``nnx.State`` (or nested dict) with the spec's
        paths and shapes, e.g. from :class:`HyperHeads` or :meth:`ParamSpec.unravel`.
      *args, **kwargs: the target's call arguments.

    Returns:
      Whatever ``target(*args, **kwargs)`` returns.

    Raises:
      ValueError: ``params`` does not match the spec (before anything is traced).

    Example:
      >>> spec = hyper.ParamSpec.from_module(mlp)
      >>> y = hyper.call(spec, nnx.state(mlp, nnx.Param), x)      # == mlp(x)
      >>> ys = jax.vmap(lambda z: hyper.call(spec, heads(z), x))(zs)  # one net per z
    """
    out, _ = call_with_state(spec, params, *args, **kwargs)
    return out


def call_with_state(
    spec: ParamSpec, params: Any, /, *args: Any, **kwargs: Any
) -> tuple[Any, ParamSpec]:
    """Like :func:`call`, but also returns the spec with the target's updated own state.

    The returned spec's ``rest`` holds the non-generated variables as the forward pass left
    them (moved batch statistics, advanced RNG counts); carry it to the next call.

    Returns:
      ``(output, new_spec)``.

    Example:
      >>> y, spec = hyper.call_with_state(spec, params, x)   # BatchNorm stats move
    """
    params = check_params(spec, params)
    # copy=True gives the forward pass fresh Variables, so mutations (BatchNorm stats, RNG
    # counts) never reach spec.rest's Variables, and Dropout works under grad (flax#5050).
    model = nnx.merge(spec.graphdef, params, spec.rest, copy=True)
    out = model(*args, **kwargs)
    generated = set(spec.paths)
    _, rest = nnx.split_state(nnx.state(model), lambda path, _: tuple(path) in generated, ...)
    return out, dataclasses.replace(spec, rest=rest)
