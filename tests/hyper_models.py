"""Target networks and hand-written references shared by the hypernetwork tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class MLP(nnx.Module):
    """din -> dh -> dout with tanh, optionally BatchNorm (train mode) after the hidden layer."""

    def __init__(self, din, dh, dout, *, batchnorm=False, param_dtype=jnp.float32, rngs):
        self.hidden = nnx.Linear(din, dh, param_dtype=param_dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(dh, rngs=rngs) if batchnorm else None
        self.out = nnx.Linear(dh, dout, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        h = self.hidden(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.out(jnp.tanh(h))


class Wide(nnx.Module):
    """A target whose tensors have three init variances: He, LayerNorm constants, LeCun."""

    def __init__(self, rngs):
        he = nnx.initializers.he_normal()
        self.hidden = nnx.Linear(64, 128, kernel_init=he, rngs=rngs)  # Var = 2/64
        self.norm = nnx.LayerNorm(128, rngs=rngs)  # scale = 1, bias = 0
        self.out = nnx.Linear(128, 32, rngs=rngs)  # lecun_normal: Var = 1/128

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def mlp_reference(p, x):
    """The plain MLP written by hand on a nested dict of arrays."""
    h = jnp.tanh(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
    return h @ p["out"]["kernel"] + p["out"]["bias"]


def as_arrays(state):
    """nnx.State of Variables -> nested dict of numpy arrays (detached from the module)."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(state))
