"""Many small models at once: one Population against N separate trainings.

N members of the digits MLP (``_workloads.mlp_digits``: 64→128→128→10, batch 32), each with
its own seed (initialization and data order), trained for E epochs, whole run with compile
included (from empty compilation caches):

  population   ``nnxscan.shell.Population(model_fn, tx, loss_fn, seeds=...)``: one compiled
               call per epoch trains all N members (the pure step vmapped over members)
  trainers     N ``Trainer.fit`` runs one after another with one optax transform (the
               program compiles once and is reused by the next members)
  nnx_jit      N of the Flax tutorial's per-step ``nnx.jit`` loops one after another

Reported per N: seconds per variant and the ratios. Medians over ``--reps`` repetitions in a
shuffled order.

With ``--devices K`` (K simulated CPU devices, set before JAX starts) it instead compares a
population on one device with the same population whose members are sharded over a
``("members",)`` mesh of the K devices (``Population(..., mesh=mesh)``).

    python benchmarks/bench_population.py --sizes 1,4,16,64 --epochs 5 --reps 3
    python benchmarks/bench_population.py --devices 4 --sizes 4,16,64
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

if "--devices" in sys.argv:  # must be set before JAX starts
    _count = sys.argv[sys.argv.index("--devices") + 1]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={_count}"

import jax
import numpy as np
import optax
from _workloads import MLP, cross_entropy, digits, plain_train_step
from flax import nnx
from jax.sharding import Mesh

from nnxscan.pure import epoch_order
from nnxscan.shell import Population, Trainer

BATCH = 32
SIZES = (64, 128, 128, 10)


def mlp(rngs: nnx.Rngs) -> MLP:
    return MLP(SIZES, rngs=rngs)


def data_set() -> dict:
    images, labels = digits(1408)
    return {"x": images.reshape(len(images), -1), "y": labels}


def population(data: dict, n: int, epochs: int, mesh: Mesh | None = None) -> float:
    start = time.perf_counter()
    members = Population(mlp, optax.adam(1e-3), cross_entropy,
                         seeds=list(range(n)), mesh=mesh)  # fmt: skip
    history = members.fit(data, epochs=epochs, batch_size=BATCH)
    jax.block_until_ready(history.losses)
    return time.perf_counter() - start


def trainers(data: dict, n: int, epochs: int) -> float:
    start = time.perf_counter()
    tx = optax.adam(1e-3)  # one transform: every member reuses the first one's program
    for seed in range(n):
        trainer = Trainer(mlp(nnx.Rngs(seed)), tx, cross_entropy)
        trainer.fit(data, epochs=epochs, batch_size=BATCH, seed=seed, progress=False)
    return time.perf_counter() - start


def nnx_jit(data: dict, n: int, epochs: int) -> float:
    start = time.perf_counter()
    step = nnx.jit(plain_train_step(cross_entropy))
    examples = len(data["y"])
    for seed in range(n):
        model = mlp(nnx.Rngs(seed))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        for epoch in range(epochs):
            order = epoch_order(seed, epoch, examples)
            for i in range(examples // BATCH):
                idx = order[i * BATCH : (i + 1) * BATCH]
                loss = step(model, optimizer, {k: v[idx] for k, v in data.items()})
        jax.block_until_ready(loss)
    return time.perf_counter() - start


VARIANTS = {"population": population, "trainers": trainers, "nnx_jit": nnx_jit}


def sharded(data: dict, sizes: list[int], epochs: int, reps: int) -> None:
    """One device against the members sharded over every device of a ("members",) mesh."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("members",))
    variants = {
        "one": lambda n: population(data, n, epochs),
        "mesh": lambda n: population(data, n, epochs, mesh),
    }
    rng = random.Random(0)
    print(f"digits MLP, {epochs} epochs, {len(devices)} simulated {devices[0].platform} "
          f"devices; whole run with compile, medians of {reps}\n")  # fmt: skip
    print(f"| members | one device s | members over {len(devices)} devices s | "
          f"one ÷ sharded |\n|---:|---:|---:|---:|")  # fmt: skip
    for n in sizes:
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(reps):
            for name in rng.sample(list(variants), len(variants)):
                jax.clear_caches()
                times[name].append(variants[name](n))
        one, mesh_s = (statistics.median(times[k]) for k in ("one", "mesh"))
        print(f"| {n} | {one:.2f} | {mesh_s:.2f} | {one / mesh_s:.2f}× |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    data = data_set()
    if args.devices > 1:
        sharded(data, [int(s) for s in args.sizes.split(",")], args.epochs, args.reps)
        return
    rng = random.Random(0)
    print(f"digits MLP, {args.epochs} epochs × {len(data['y']) // BATCH} steps, batch {BATCH}; "
          f"whole run with compile, medians of {args.reps}\n")  # fmt: skip
    print("| members | population s | N × Trainer.fit s | N × nnx.jit loop s | "
          "N × Trainer.fit ÷ population | N × nnx.jit ÷ population |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (int(s) for s in args.sizes.split(",")):
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.reps):
            for name in rng.sample(list(VARIANTS), len(VARIANTS)):
                jax.clear_caches()
                times[name].append(VARIANTS[name](data, n, args.epochs))
        med = {name: statistics.median(values) for name, values in times.items()}
        print(f"| {n} | {med['population']:.2f} | {med['trainers']:.2f} | {med['nnx_jit']:.2f} | "
              f"{med['trainers'] / med['population']:.2f}× | "
              f"{med['nnx_jit'] / med['population']:.2f}× |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
