"""JAX's threefry random-number hash as straight-line code: the same bits, compiled and run
sooner on the CPU.

``jax.random`` draws with the threefry-2x32 hash. JAX lowers it as a straight line of 20
rounds on GPUs, but on the CPU as a loop of 5 iterations of 4 rounds (to spare an older
XLA:CPU the compile of the long line). Today's XLA:CPU does the opposite: it compiles each
such loop as a program of its own, which costs a compile of its own and keeps XLA from
fusing the rounds with the code around them (docs/performance.md measures both). A
training step with dropout draws through several of them.

:func:`unrolled_threefry` rewrites a traced function's draws into the hash's integer
arithmetic, unrolled, before any lowering sees them. It is integer arithmetic, so the
random bits are exactly JAX's (tested against ``jax.random`` for every kind of draw); the
program around them is another program, which XLA fuses on its own terms. The steps nnxscan
builds (:func:`nnxscan.pure.make_train_step`, :func:`nnxscan.pure.nnx_train_step`) apply it
on the CPU, so every program of such a step -- ``fit``'s loop, your ``make_epoch``, the step
jitted on its own -- draws through the unrolled hash, and ``fit`` and your loop of the same
step still compile the same program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p, threefry_prng_impl

from nnxscan.pure.conv_dimensions import _rewriting, _traced_eqns

__all__ = ["unrolled_threefry"]

F = TypeVar("F", bound=Callable[..., Any])

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def unrolled_threefry(fn: F) -> F:
    """Wraps ``fn`` so its ``jax.random`` draws compute JAX's threefry hash unrolled.

    The returned function has ``fn``'s signature and results. Each call traces ``fn`` and
    evaluates its jaxpr with every draw on a threefry key (``random_bits``, ``split``,
    ``fold_in``, at any depth of nested jaxprs: ``jax.jit``, ``lax.scan`` bodies,
    ``jax.checkpoint``, ``custom_jvp``/``custom_vjp`` functions) rewritten as JAX computes it,
    with the hash's 20 rounds written out instead of JAX's CPU loop. The bits drawn are
    JAX's, exactly; the program around them may fuse differently, so other values agree to
    float rounding with the unwrapped function's (and bitwise with any other program built
    from the wrapped one). Draws with an explicit sharding, on other PRNG implementations, or
    made by a transform applied outside the wrapper are left as they are.

    It is a pure function transform: it works under ``jax.jit``, ``jax.vmap``, ``jax.grad``
    and inside ``lax.scan``. Array leaves of the arguments are traced; other leaves (an
    ``nnx.GraphDef``, Python numbers) are passed to ``fn`` as static values. Each call
    traces ``fn``: call it under ``jax.jit`` (called eagerly it compiles ``fn`` every time).

    Args:
      fn: any function that draws with ``jax.random`` (a loss, a model's forward, a whole
        training step).

    Returns:
      ``fn`` with its draws unrolled: the same signature, the same random bits.

    Example:
      >>> noisy = unrolled_threefry(lambda key, x: x + jax.random.normal(key, x.shape))
      >>> y = jax.jit(noisy)(jax.random.key(0), jnp.zeros(3))  # the same bits as unwrapped
    """
    if not callable(fn):
        raise TypeError(f"unrolled_threefry takes a function, got {type(fn).__name__}.")
    return _rewriting(fn, _draw_rule, nested=True)  # type: ignore[return-value]


def _unrolled_on_cpu(fn: F) -> F:
    """``fn``, through :func:`unrolled_threefry` when it is traced (under ``jax.jit``, a
    scan, vmap or grad) and JAX's default backend is the CPU (the only one whose lowering of
    the hash is a loop), decided when it is called. Called eagerly, on concrete arrays, it
    is ``fn`` itself: there is no program to lower, and a rewrite would compile one per
    call."""
    unrolled = unrolled_threefry(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
        use = unrolled if traced and jax.default_backend() == "cpu" else fn
        return use(*args, **kwargs)

    return call  # type: ignore[return-value]


def _rounds(x: list, rotations: tuple[int, ...]) -> list:
    for r in rotations:
        x0 = x[0] + x[1]
        x1 = (x[1] << np.uint32(r)) | (x[1] >> np.uint32(32 - r))
        x = [x0, x0 ^ x1]
    return x


def _hash(key1: Any, key2: Any, x1: Any, x2: Any) -> tuple[Any, Any]:
    """Threefry-2x32 with 20 rounds, as JAX computes ``threefry2x32_p`` (its key schedule,
    rotations and injection constants), written out."""
    keys = (key1, key2, key1 ^ key2 ^ _PARITY)
    x = [x1 + keys[0], x2 + keys[1]]
    for i in range(5):
        x = _rounds(x, _ROTATIONS[i % 2])
        x = [x[0] + keys[(i + 1) % 3], x[1] + keys[(i + 2) % 3] + np.uint32(i + 1)]
    return x[0], x[1]


def _unrolled_hash(key1: Any, key2: Any, x1: Any, x2: Any) -> tuple[Any, Any]:
    shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in (key1, key2, x1, x2)))
    args = (jnp.broadcast_to(a, shape) for a in (key1, key2, x1, x2))
    return _hash(*args)


def _hash_rule(eqn: Any) -> list[Any] | None:
    if eqn.primitive is threefry2x32_p:
        return _traced_eqns(eqn, _unrolled_hash)
    return None


# The draws' own expansions (JAX's, key by key), with the hash rewritten inside them.
def _expansions() -> dict[str, Callable[..., Callable[..., Any]]] | None:
    try:
        from jax._src.random import prng  # the impls behind the draw primitives
    except ImportError:
        return None
    try:
        bits_base, split_base = prng.random_bits_impl_base, prng.random_split_impl_base
        fold_in_base = prng.random_fold_in_impl_base
    except AttributeError:
        return None

    def bits(ndim: int, params: dict) -> Callable[..., Any]:
        def expand(keys: Any) -> Any:
            data = jax.random.key_data(keys)
            return bits_base(threefry_prng_impl, data, ndim, **params)

        return expand

    def split(ndim: int, params: dict) -> Callable[..., Any]:
        def expand(keys: Any) -> Any:
            data = split_base(threefry_prng_impl, jax.random.key_data(keys), ndim, **params)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(keys))

        return expand

    def fold_in(shape: tuple, params: dict) -> Callable[..., Any]:
        def expand(keys: Any, msgs: Any) -> Any:
            data = fold_in_base(threefry_prng_impl, jax.random.key_data(keys), msgs, shape)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(keys))

        return expand

    return {"random_bits": bits, "random_split": split, "random_fold_in": fold_in}


_EXPANSIONS = _expansions()


def _draw_rule(eqn: Any) -> list[Any] | None:
    if eqn.primitive is threefry2x32_p:  # a draw on raw key data (jax.extend's hash)
        return _hash_rule(eqn)
    name = eqn.primitive.name
    if _EXPANSIONS is None or name not in _EXPANSIONS:
        return None
    key = eqn.invars[0].aval
    if getattr(key.dtype, "_impl", None) is not threefry_prng_impl:
        return None
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    if eqn.params.get("out_sharding") is not None or any(map(_sharded, avals)):
        return None  # its shardings name the draw's own axes
    params = {k: v for k, v in eqn.params.items() if k != "out_sharding"}
    first = key.shape if name == "random_fold_in" else key.ndim
    try:
        expand = _rewriting(_EXPANSIONS[name](first, params), _hash_rule)
        # Under the draw's own recorded settings (a `jax.threefry_partitionable` block
        # around it picks the algorithm), as JAX's lowering of it would be.
        with eqn.ctx.manager:
            return _traced_eqns(eqn, expand)
    except (TypeError, ValueError):  # another JAX's expansions: keep JAX's own draw
        return None


def _sharded(aval: Any) -> bool:
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    return spec is not None and any(p is not None for p in spec)
