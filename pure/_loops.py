"""The one training loop body, and how a call gathered in chunks cuts its steps.

Every compiled training call of nnxscan (``scan_steps``, ``scan_indexed_steps``, so
``make_epoch`` and the shell's calls, a population's included)
runs :func:`scan_batches`' body, so a step trained from a stack of batches and the same step
trained on rows gathered by index compute the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure.batching import shard_batch
from nnxscan.pure.train_step import StepFn


def scan_loop(body: Any, carry: Any, xs: Any, *, unroll: int | bool = 1) -> tuple[Any, Any]:
    """``lax.scan(body, carry, xs, unroll=unroll)``, except that a fully unrolled scan of
    length 1 really has no loop.

    jax 0.10 lowers ``lax.scan(..., unroll=True)`` of length 1 to a ``while`` loop, and on
    the CPU a loop body runs convolution gradients far slower (jax#12868): a one-step call
    must not pay that.
    """
    length = jax.tree.leaves(xs)[0].shape[0]
    full = unroll is True or (not isinstance(unroll, bool) and unroll >= length)
    if length == 1 and full:
        carry, out = body(carry, jax.tree.map(lambda x: x[0], xs))
        return carry, jax.tree.map(lambda y: y[None], out)
    return jax.lax.scan(body, carry, xs, unroll=unroll)


def keep_carry_types(new: Any, old: Any) -> Any:
    """``new`` with each leaf on its ``old`` leaf's sharding where an Explicit mesh makes
    the sharding part of the type and the step changed it (a parameter updated by moments
    sharded otherwise, as in Flax's cookbook, comes out with the moments' sharding): a scan
    carry keeps one type, as the cookbook's loop reshards the model after each step."""

    def keep(x: Any, like: Any) -> Any:
        want = getattr(jax.typeof(like), "sharding", None)
        got = getattr(jax.typeof(x), "sharding", None)
        spec = getattr(want, "spec", None)
        if spec is None or getattr(got, "spec", None) == spec or not _explicit(want):
            return x
        return jax.sharding.reshard(x, spec)

    return jax.tree.map(keep, new, old)


def _explicit(sharding: Any) -> bool:
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def scan_batches(
    step: StepFn,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    opt_state: Any,
    xs: Any,
    batch_of: Callable[[Any], Any],
    *,
    unroll: int | bool = 1,
    batch_sharding: jax.sharding.Sharding | None = None,
) -> tuple[nnx.State, Any, Any]:
    """The one training loop body: ``step`` on ``batch_of(x)`` for each entry ``x`` of ``xs``."""
    body = loop_body(step, graphdef, batch_of, batch_sharding)
    (state, opt_state), outs = scan_loop(body, (state, opt_state), xs, unroll=unroll)
    return state, opt_state, outs


def loop_body(
    step: StepFn,
    graphdef: nnx.GraphDef,
    batch_of: Callable[[Any], Any],
    batch_sharding: jax.sharding.Sharding | None = None,
) -> Callable[[Any, Any], tuple[Any, Any]]:
    """``body((state, opt_state), x) -> ((state, opt_state), out)``: one step on
    ``batch_of(x)``, the body of every training loop."""

    def body(carry, x):
        state, opt_state = carry
        batch = shard_batch(batch_of(x), batch_sharding)
        new = step(graphdef, state, opt_state, batch)
        state, opt_state = keep_carry_types(new[:2], carry)
        return (state, opt_state), new[2]

    return body


def loop_first(body: Callable[[Any, Any], tuple[Any, Any]], carry: Any, xs: Any, count: Any):
    """``body`` over the first ``count`` entries of ``xs`` (a traced count: a while loop with
    that trip count), as ``lax.scan`` runs it over all of them; the outputs of the entries
    not run are zeros. Chunks of one length whose last trains fewer steps then share ONE
    loop body, where a scan of the rest would be a second copy of the step to compile."""
    length = jax.tree.leaves(xs)[0].shape[0]
    first = jax.tree.map(lambda x: x[0], xs)
    shapes = jax.eval_shape(lambda c, x: body(c, x)[1], carry, first)
    outs = jax.tree.map(lambda s: jnp.zeros((length, *s.shape), s.dtype), shapes)

    def one(i, both):
        carry, outs = both
        carry, out = body(
            carry, jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False), xs)
        )
        outs = jax.tree.map(
            lambda buf, y: jax.lax.dynamic_update_index_in_dim(buf, y, i, 0), outs, out
        )
        return carry, outs

    return jax.lax.fori_loop(0, count, one, (carry, outs))
