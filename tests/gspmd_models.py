"""The models of Flax's guide "Scale up on multiple devices" (docs_nnx/guides/flax_gspmd.md),
as the guide writes them (smaller: depth 32), and the guide's training step ported to
``nnx.jit``: the reference every sharding test compares nnxscan to. Imported by the
sharding workers (run as scripts); not collected by pytest.

The guide's own ``@jax.jit def train_step(model, optimizer, x, y)`` drops the optimizer's
update under flax 0.12.8 (a ``jax.jit`` argument's mutations are discarded: after its loop
``optimizer.step`` is still 0); the same function under ``nnx.jit`` updates it.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

DEPTH, LAYERS = 32, 2
# The guide's logical names and their mapping to the mesh.
SHARDING_RULES = (("batch", "data"), ("hidden", "model"), ("embed", None))


class DotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth, depth, kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
            use_bias=False, rngs=rngs,
        )  # fmt: skip
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), sharding=("model", None))

    def __call__(self, x: jax.Array):
        y = jax.nn.relu(self.dot1(x))
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        return jnp.dot(y, self.w2[...])


class MultiDotReluDot(nnx.Module):
    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
        def create_sublayers(r):
            return DotReluDot(depth, r)

        self.layers = create_sublayers(rngs.fork(split=num_layers))

    def __call__(self, x):
        x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), x, self.layers)
        return x


class LogicalDotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth, depth, kernel_init=nnx.with_partitioning(init_fn, ("embed", "hidden")),
            use_bias=False, rngs=rngs,
        )  # fmt: skip
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), sharding=("hidden", "embed"))

    def __call__(self, x: jax.Array):
        y = jax.nn.relu(self.dot1(x))
        y = jax.lax.with_sharding_constraint(y, P("data", None))
        return jnp.dot(y, self.w2[...])


class LogicalMultiDotReluDot(nnx.Module):
    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
        def create_sublayers(r):
            return LogicalDotReluDot(depth, r)

        self.layers = create_sublayers(rngs.fork(split=num_layers))

    def __call__(self, x):
        x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), x, self.layers)
        return x


class ExplicitDotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth, depth, kernel_init=partial(init_fn, out_sharding=P(None, "model")),
            use_bias=False, rngs=rngs,
        )  # fmt: skip
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth), out_sharding=P("model", None)))
        self.b2 = nnx.Param(jnp.zeros((depth,), out_sharding=P(None)))

    def __call__(self, x: jax.Array):
        y = jax.nn.relu(self.dot1(x))
        z = jnp.dot(y, self.w2[...], out_sharding=P("data", None))
        return z + self.b2


class ExplicitMultiDotReluDot(nnx.Module):
    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
        @partial(jax.vmap, spmd_axis_name=None)
        def create_sublayers(r):
            return ExplicitDotReluDot(depth, r)

        self.layers = create_sublayers(rngs.fork(split=num_layers))

    def __call__(self, x):
        x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), x, self.layers)
        return x


def guide_train_step(model, optimizer, x, y):
    """The guide's step, unchanged but for ``nnx.jit`` (see the module docstring)."""

    def loss_fn(model):
        y_pred = model(x)
        return jnp.mean((y_pred - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


guide_step = nnx.jit(guide_train_step)


def mse(model, batch):
    """The guide's loss as nnxscan takes it: ``loss_fn(model, batch)``."""
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
