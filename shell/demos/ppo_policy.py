"""The policy of ``nnxscan demo ppo``: PureJaxRL's actor-critic as an ``nnx.Module``, and the
categorical distribution over its logits (distrax's ``Categorical`` does not import on jax 0.10,
so its three methods are written here with ``jax.random.categorical`` and ``log_softmax``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "ActorCritic",
    "RunKey",
    "action_entropy",
    "action_log_prob",
    "orthogonal",
    "orthogonal_kernels",
    "sample_action",
]


def orthogonal(scale: float = 1.0) -> nnx.initializers.Initializer:
    """``nnx.initializers.orthogonal(scale)`` for 2-D kernels, computed without LAPACK.

    The same matrix: ``jax.random.normal(key, (max(shape), min(shape)))``, the ``Q`` of its
    QR decomposition with signs that make ``R``'s diagonal positive, transposed when the
    kernel is wide, times ``scale`` (equal to nnx's up to rounding). The QR is Householder
    reflections in plain XLA ops because jaxlib 0.10's batched LAPACK kernels can deadlock
    XLA:CPU's thread pool: under ``jax.vmap`` over seeds, each layer's QR occupies a pool
    thread and waits for batch chunks queued behind the others (seen here on 2 cores).

    Example:
      >>> kernel = orthogonal(2**0.5)(jax.random.key(0), (4, 64))
    """

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return orthogonal_kernels([key], [shape], [scale], dtype)[0]

    return init


def orthogonal_kernels(
    keys: Sequence[jax.Array],
    shapes: Sequence[tuple[int, ...]],
    scales: Sequence[float],
    dtype: Any = jnp.float32,
) -> list[jax.Array]:
    """``orthogonal(scale)(key, shape)`` for several kernels at once, in ONE loop: each
    Gaussian matrix is zero-padded to a common square (Householder reflections of the zero
    part are the identity, so its ``Q`` keeps the small one's in its corner) and the
    reflections run vmapped. One loop compiles in a fraction of one loop per layer.

    Example:
      >>> k1, k2 = orthogonal_kernels(jax.random.split(key, 2), [(4, 64), (64, 2)], [1.0, 0.01])
    """
    for shape in shapes:
        if len(shape) != 2:
            raise ValueError(f"orthogonal() initializes 2-D kernels, got shape {shape}.")
    # One compiled program (built once per shapes): run eagerly, its few hundred small ops
    # would each be dispatched (and compiled) alone (docs/performance.md).
    shapes = tuple(tuple(int(n) for n in shape) for shape in shapes)
    return list(_orthogonal_kernels(list(keys), shapes, tuple(scales), dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _orthogonal_kernels(
    keys: list[jax.Array],
    shapes: tuple[tuple[int, int], ...],
    scales: tuple[float, ...],
    dtype: Any,
) -> list[jax.Array]:
    size = max(max(shape) for shape in shapes)
    padded = []
    for tall in _gaussians(keys, [(max(shape), min(shape)) for shape in shapes], dtype):
        padded.append(jnp.zeros((size, size), dtype).at[: tall.shape[0], : tall.shape[1]].set(tall))
    q = jax.vmap(_orthonormal_columns, in_axes=(0, None))(
        jnp.stack(padded), max(min(shape) for shape in shapes)
    )
    kernels = []
    for qi, (rows, cols), scale in zip(q, shapes, scales, strict=True):
        tall = qi[: max(rows, cols), : min(rows, cols)]
        kernels.append(jnp.asarray(scale, dtype) * (tall.T if rows < cols else tall))
    return kernels


def _gaussians(
    keys: Sequence[jax.Array], shapes: Sequence[tuple[int, ...]], dtype: Any
) -> list[jax.Array]:
    """``[jax.random.normal(key, shape, dtype) for key, shape in ...]``, bitwise, drawn in ONE
    vmapped call: with jax's default partitionable threefry each element's bits hash its
    flat index, so a shape's draw is the first ``prod(shape)`` elements of a longer flat
    draw from the same key. Each separate ``normal`` is its own threefry and ``erf_inv`` in
    the program, and six of them lengthen the PPO run's compile (docs/performance.md)."""
    if not jax.config.jax_threefry_partitionable:  # the counters then depend on the shape
        return [jax.random.normal(k, shape, dtype) for k, shape in zip(keys, shapes, strict=True)]
    sizes = [int(np.prod(shape)) for shape in shapes]
    flat = jax.vmap(lambda key: jax.random.normal(key, (max(sizes),), dtype))(jnp.stack(keys))
    return [row[:size].reshape(shape) for row, size, shape in zip(flat, sizes, shapes, strict=True)]


def _orthonormal_columns(a: jax.Array, columns: int) -> jax.Array:
    """The ``Q`` of ``a = Q R`` (``R`` with a non-negative diagonal) by Householder
    reflections ``H_j = I - 2 v v^T`` of the first ``columns`` columns: ``Q = H_0 H_1 ...``."""
    n = a.shape[0]
    rows = jnp.arange(n)

    def reflect(j, carry):
        r, q = carry
        x = jnp.where(rows >= j, r[:, j], 0.0)
        norm = jnp.sqrt(jnp.sum(x * x))
        v = x.at[j].add(jnp.where(x[j] >= 0, norm, -norm))
        v = v / jnp.maximum(jnp.sqrt(jnp.sum(v * v)), jnp.finfo(a.dtype).tiny)
        r = r - 2.0 * jnp.outer(v, v @ r)
        q = q - 2.0 * jnp.outer(q @ v, v)
        return r, q

    r, q = jax.lax.fori_loop(0, columns, reflect, (a, jnp.eye(n, dtype=a.dtype)))
    return q * jnp.sign(jnp.diagonal(r))[None, :]


class RunKey(nnx.Variable):
    """The key a PPO run starts from, held by the policy it trains: drawn from the
    ``nnx.Rngs`` the policy is built with, so ``model_fn(nnx.Rngs(seed))`` fixes the whole
    run (the environments' resets, the actions sampled, the minibatch orders), and each
    member of a ``Population`` is its seed's run. The step reads it once, at ``init``; it
    never changes (the run's key then lives in the step's ``opt_state``) and is no ``Param``
    (no optimizer touches it)."""


class ActorCritic(nnx.Module):
    """PureJaxRL's actor-critic: separate tanh towers ``obs→64→64→actions`` and
    ``obs→64→64→1``, orthogonal kernels (scale √2, last layers 0.01 and 1; see
    :func:`orthogonal`), zero biases; and ``run_key``, the :class:`RunKey` a PPO run from
    this policy starts from (``rngs.run()``, drawn after the weights' keys: the weights are
    those of the towers alone).

    Example:
      >>> logits, value = ActorCritic(4, 2, rngs=nnx.Rngs(0))(jnp.zeros(4))
    """

    def __init__(self, obs_size: int, num_actions: int, *, hidden: int = 64, rngs: nnx.Rngs):
        # Each layer draws its kernel's key as with kernel_init=orthogonal(scale) (the same
        # weights, to rounding, as nnx.initializers.orthogonal), then all six kernels are
        # orthogonalized in one loop.
        keys = []

        def zeros(shape, dtype):
            # Put from the host, not computed: built eagerly (the shell's Trainer), each
            # jnp.zeros of a new shape is an XLA program compiled alone. Inside a traced
            # run they are constants either way.
            return jax.device_put(np.zeros(shape, dtype))

        def dense(fan_in: int, fan_out: int) -> nnx.Linear:
            def record_key(key, shape, dtype):
                keys.append(key)
                return zeros(shape, dtype)

            return nnx.Linear(
                fan_in, fan_out, rngs=rngs, kernel_init=record_key,
                bias_init=lambda key, shape, dtype: zeros(shape, dtype),
            )  # fmt: skip

        self.actor = nnx.Sequential(
            dense(obs_size, hidden), nnx.tanh,
            dense(hidden, hidden), nnx.tanh,
            dense(hidden, num_actions),
        )  # fmt: skip
        self.critic = nnx.Sequential(
            dense(obs_size, hidden), nnx.tanh,
            dense(hidden, hidden), nnx.tanh,
            dense(hidden, 1),
        )  # fmt: skip
        layers = [*self.actor.layers[::2], *self.critic.layers[::2]]
        root2 = float(np.sqrt(2))
        scales = [root2, root2, 0.01, root2, root2, 1.0]
        shapes = [layer.kernel.shape for layer in layers]
        for layer, kernel in zip(layers, orthogonal_kernels(keys, shapes, scales), strict=True):
            layer.kernel[...] = kernel
        self.run_key = RunKey(rngs.run())

    def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(logits (..., actions), value (...))``."""
        return self.actor(obs), self.critic(obs)[..., 0]


# -- the categorical distribution over the logits ---------------------------------------------


def sample_action(key: jax.Array, logits: jax.Array) -> jax.Array:
    """One action per row of ``logits``, drawn with probabilities ``softmax(logits)``."""
    return jax.random.categorical(key, logits)


def action_log_prob(logits: jax.Array, action: jax.Array) -> jax.Array:
    """``log softmax(logits)[action]`` per row."""
    log_probs = jax.nn.log_softmax(logits)
    return jnp.take_along_axis(log_probs, action[..., None].astype(jnp.int32), axis=-1)[..., 0]


def action_entropy(logits: jax.Array) -> jax.Array:
    """The entropy ``-Σ p log p`` of ``softmax(logits)`` per row."""
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
