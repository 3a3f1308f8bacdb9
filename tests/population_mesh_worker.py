"""Run with 4 simulated CPU devices: a population on a (members x data) mesh and on one
device, for tests/test_population_fit.py."""

from __future__ import annotations

import sys

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from nnxscan.shell import Population, Trainer

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
    runs = (("single", {}), ("mesh", {"mesh": mesh}), ("fsdp", {"mesh": mesh, "fsdp_min_size": 32}))
    for name, extra in runs:
        pop = Population(model_fn, tx, xent, **options, **extra)
        history = pop.fit(data, epochs=3, batch_size=8)
        results[f"{name}_losses"] = history.losses
        results[f"{name}_state"] = np.concatenate([a.ravel() for a in state_arrays(pop.state)])
        if name != "single":
            kernel = pop.state["l1"]["kernel"][...]  # a copy keeps the sharding
            results[f"{name}_spec"] = str(tuple(kernel.sharding.spec))
            # No device holds more than its share of the sharded kernel (FSDP: a half).
            shard = kernel.addressable_shards[0].data
            results[f"{name}_shard"] = np.asarray(shard.shape)
        if name == "mesh":
            # A frozen member stays bitwise on the mesh; member(i) trains with a plain Trainer.
            results["frozen_before"] = state_arrays(pop.member(2))[0]
            pop.freeze(2)
            pop.fit(data, epochs=1, batch_size=8)
            results["frozen_after"] = state_arrays(pop.member(2))[0]
            model, alone = pop.member(0), pop.member(0)
            adam = optax.adam(1e-3)  # one transform: the second fit reuses the first's compile
            Trainer(model, adam, xent).fit(data, epochs=1, batch_size=8, progress=False)
            alone = nnx.merge(*nnx.split(alone))  # the same values, built again
            Trainer(alone, adam, xent).fit(data, epochs=1, batch_size=8, progress=False)
            results["member_trained"] = state_arrays(model)[0]
            results["alone_trained"] = state_arrays(alone)[0]
    errors = []
    odd = {k: v[:63] for k, v in data.items()}
    for bad in (
        lambda: Population(model_fn, tx, xent, seeds=[0, 1, 2], mesh=mesh),
        lambda: Population(model_fn, tx, xent, seeds=[0, 1], mesh=mesh, data_axis="members"),
        lambda: Population(model_fn, tx, xent, seeds=[0, 1], mesh=mesh).fit(
            odd, epochs=1, batch_size=8, drop_remainder=False
        ),
    ):
        try:
            bad()
            errors.append("no error")
        except ValueError as error:
            errors.append(f"ValueError: {error}".replace("\n", " "))
    results["errors"] = "\n".join(errors)
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1])
