"""Tensor parallelism from path rules: the byte-level transformer LM of ``bench_wholerun.py``
(an unannotated, third-party-style model) sharded Megatron-style by ``shardings=`` rules
on 8 simulated CPU devices: per-device bytes of the training state, and step time, against
one device.

Simulated CPU devices share this machine's cores, so their step time measures the cost of
partitioning (collectives, smaller kernels), not a speed-up; the per-device state bytes are
what a model that only fits sharded needs. Runs are paired: every configuration once per
round, in a shuffled order, medians over the rounds.

    python benchmarks/bench_sharding.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import optax
from _workloads import ByteLM, next_byte_loss, source_windows
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnxscan.shell import Trainer

# Megatron-style: attention heads and the MLP's hidden units over "model", the projections
# back row-wise, the vocabulary over "model" too. The model's code is not touched.
TENSOR_PARALLEL = {
    r"attention/(query|key|value)/kernel": P(None, "model", None),
    r"attention/(query|key|value)/bias": P("model", None),
    r"attention/out/kernel": P("model", None, None),
    r"mlp_in/kernel": P(None, "model"),
    r"mlp_in/bias": P("model"),
    r"mlp_out/kernel": P("model", None),
    r"token_embedding/embedding": P("model", None),
    r"head/kernel": P(None, "model"),
    r"head/bias": P("model"),
}
BATCH, STEPS = 16, 24


def per_device_bytes(trainer: Trainer) -> int:
    """The most bytes of the training state (parameters and optax state) on any device."""
    per_device: dict = {}
    for leaf in jax.tree.leaves((nnx.state(trainer.model), trainer.opt_state)):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def configurations() -> dict[str, dict]:
    auto = (AxisType.Auto,) * 2
    return {
        "1 device": {},
        "8 devices, data parallel": {
            "mesh": jax.make_mesh((8, 1), ("data", "model"), axis_types=auto)
        },
        "4 devices, tensor parallel (rules)": {
            "mesh": jax.make_mesh(
                (1, 4), ("data", "model"), axis_types=auto, devices=jax.devices()[:4]
            ),
            "shardings": TENSOR_PARALLEL,
        },
        "8 devices, 2 data x 4 tensor (rules)": {
            "mesh": jax.make_mesh((2, 4), ("data", "model"), axis_types=auto),
            "shardings": TENSOR_PARALLEL,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    data = source_windows(STEPS * BATCH)
    trainers, first, steady = {}, {}, {name: [] for name in configurations()}
    for name, options in configurations().items():
        trainer = Trainer(ByteLM(rngs=nnx.Rngs(0)), optax.adam(1e-3), next_byte_loss, **options)
        start = time.perf_counter()
        trainer.fit(data, epochs=1, batch_size=BATCH, progress=False)
        first[name] = time.perf_counter() - start
        trainers[name] = trainer
    order = list(trainers)
    for round_ in range(args.rounds):
        random.Random(round_).shuffle(order)
        for name in order:
            start = time.perf_counter()
            trainers[name].fit(data, epochs=1, batch_size=BATCH, progress=False)
            steady[name].append((time.perf_counter() - start) / STEPS * 1e6)
    one = trainers["1 device"]
    base_bytes, base_us = per_device_bytes(one), statistics.median(steady["1 device"])
    print(
        f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices; byte LM "
        f"(2 layers, width 128, 4 heads), batch {BATCH}, adam, {STEPS} steps an epoch; "
        f"medians of {args.rounds} rounds\n"
    )
    print(
        "| configuration | state bytes per device | ÷ 1 device | first fit (s) | "
        "steady µs/step | ÷ 1 device |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, trainer in trainers.items():
        nbytes, us = per_device_bytes(trainer), statistics.median(steady[name])
        print(
            f"| {name} | {nbytes:,} | {nbytes / base_bytes:.2f} | {first[name]:.2f} | "
            f"{us:,.0f} | {us / base_us:.2f} |"
        )


if __name__ == "__main__":
    main()
