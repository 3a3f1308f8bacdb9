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


def mlp_reference(p, x):
    """The plain MLP written by hand on a nested dict of arrays."""
    h = jnp.tanh(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
    return h @ p["out"]["kernel"] + p["out"]["bias"]


def as_arrays(state):
    """nnx.State of Variables -> nested dict of numpy arrays (detached from the module)."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(state))
