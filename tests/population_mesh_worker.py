"""Run with 4 simulated CPU devices: a population on a (members x data) mesh and on one
device, for tests/test_population_fit.py."""

from __future__ import annotations

import sys

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from nnxscan.shell import Population

from conftest import MLP, make_data, state_arrays, xent


def model_fn(rngs: nnx.Rngs) -> nnx.Module:
    return MLP(rngs=rngs)


def main(out: str) -> None:
    assert jax.device_count() == 4, jax.devices()
    data = make_data()
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    options = dict(seeds=[0, 1, 2, 3], hyperparams={"learning_rate": [1e-2, 3e-3, 1e-3, 3e-2]})
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("members", "data"))
    results = {}
    for name, extra in (("single", {}), ("mesh", {"mesh": mesh})):
        pop = Population(model_fn, tx, xent, **options, **extra)
        history = pop.fit(data, epochs=3, batch_size=8)
        results[f"{name}_losses"] = history.losses
        results[f"{name}_state"] = np.concatenate([a.ravel() for a in state_arrays(pop.state)])
        if name == "mesh":
            kernel = jax.tree.leaves(pop._members.leaves)[0]
            results["spec"] = str(tuple(kernel.sharding.spec))
    errors = []
    for bad in (
        dict(seeds=[0, 1, 2], mesh=mesh),  # 3 members over 2 devices
        dict(seeds=[0, 1], mesh=Mesh(np.array(jax.devices()).reshape(2, 2), ("members", "x"))),
    ):
        try:
            Population(model_fn, tx, xent, **bad)
        except ValueError as error:
            errors.append(f"ValueError: {error}")
    results["errors"] = "\n".join(errors)
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1])
