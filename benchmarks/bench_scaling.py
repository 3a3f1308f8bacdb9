"""Scaling out on simulated CPU devices: compile counts and per-step overhead stay flat.

Simulated CPU devices share the same cores, so steps/s across 1 vs 4 of them says nothing
about speed-up; what this shows is that a mesh adds no recompiles and no per-step Python:
the data-parallel ``fit`` is the same one compiled scan per epoch.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/bench_scaling.py
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import numpy as np
import optax
from bench_train import MLP, loss_fn
from flax import nnx
from jax.sharding import Mesh

from nnxscan.shell import Trainer
from nnxscan.shell.callbacks import LambdaCallback

COMPILES = {"n": 0}
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *a, **k: COMPILES.__setitem__("n", COMPILES["n"] + ("backend_compile" in event))
)


def main() -> None:
    steps, batch = 200, 32
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(steps * batch, 64)).astype(np.float32),
        "y": rng.integers(0, 10, steps * batch).astype(np.int32),
    }
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = []
    for label, options in [
        ("1 device", {}),
        (f"mesh of {len(jax.devices())}, data-parallel", {"mesh": mesh}),
        (f"mesh of {len(jax.devices())}, FSDP", {"mesh": mesh, "fsdp_min_size": 1024}),
    ]:
        trainer = Trainer(
            MLP([64, 64, 64, 10], rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, **options
        )
        before = COMPILES["n"]
        calls = []
        counter = LambdaCallback(on_call_end=lambda t, logs, calls=calls: calls.append(1))
        trainer.fit(data, epochs=1, batch_size=batch, progress=False, callbacks=[counter])
        first = COMPILES["n"] - before
        times = []
        for _ in range(5):
            start = time.perf_counter()
            trainer.fit(data, epochs=2, batch_size=batch, progress=False)
            times.append((time.perf_counter() - start) / (2 * steps) * 1e6)
        later = COMPILES["n"] - before - first
        rows.append((label, first, later, len(calls), statistics.median(times)))
    print(
        f"jax {jax.__version__}, {len(jax.devices())} simulated CPU devices, small MLP, b{batch}\n"
    )
    print("| run | compiles (first fit) | compiles (5 more fits) | calls per epoch | µs/step |")
    print("|---|---:|---:|---:|---:|")
    for label, first, later, calls, us in rows:
        print(f"| {label} | {first} | {later} | {calls} | {us:,.0f} |")


if __name__ == "__main__":
    main()
