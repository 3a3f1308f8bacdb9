"""Streaming speed: device-resident arrays vs the same batches from a Python iterator.

For each model, in one process and interleaved (every method once per round, shuffled
order), one epoch of the same batches with ``Trainer.fit``:

  arrays            the whole data set on the device (shuffle=False), one scan per epoch
  stream            a Python list of numpy batches, chunks of K=100, prefetch on
  stream, no prefetch   the same, chunks prepared in the training thread
  slow stream       an iterator that spends ~0.5 ms of host time per batch (sleeps, like I/O)
  slow, no prefetch the same without prefetch

and, for the slow iterator, the host time alone (iterating it, no training) and the
device time alone (the arrays row), so the table shows whether prefetch brings the epoch
close to max(host, device) instead of their sum.

    python benchmarks/bench_streaming.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import jax
import numpy as np
import optax
from bench_train import MLP, loss_fn
from flax import nnx

from nnxscan.shell import Trainer

HOST_COST_S = 0.0005
K = 100


def slow(batches):
    def stream():
        for batch in batches:
            time.sleep(HOST_COST_S)  # a loader doing I/O or decoding
            yield batch

    return stream


def case(sizes, batch, steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], len(x)).astype(np.int32)
    arrays = {"x": x, "y": y}
    batches = [{"x": x[i * batch : (i + 1) * batch], "y": y[i * batch : (i + 1) * batch]}
               for i in range(steps)]  # fmt: skip
    device_arrays = jax.device_put(arrays)
    tx = optax.adam(1e-3)

    def trainer():
        return Trainer(MLP(sizes, rngs=nnx.Rngs(0)), tx, loss_fn)

    runs = {
        "arrays (device-resident)": (trainer(), lambda: device_arrays, {"batch_size": batch}),
        "stream, prefetch": (trainer(), lambda: batches, {}),
        "stream, no prefetch": (trainer(), lambda: batches, {"prefetch": False}),
        "slow stream, prefetch": (trainer(), lambda: slow(batches), {}),
        "slow stream, no prefetch": (trainer(), lambda: slow(batches), {"prefetch": False}),
    }

    def timed(label):
        t, data, kwargs = runs[label]
        start = time.perf_counter()
        t.fit(data(), epochs=1, shuffle=False, steps_per_call=K, progress=False, **kwargs)
        return time.perf_counter() - start

    def host_only():
        start = time.perf_counter()
        for _ in slow(batches)():
            pass
        return time.perf_counter() - start

    methods = {label: (lambda label=label: timed(label)) for label in runs}
    methods["slow iterator alone (host time)"] = host_only
    return methods


def bench(methods, steps, reps):
    for run in methods.values():
        run()
    times = {k: [] for k in methods}
    order, shuffler = list(methods), random.Random(0)
    for _ in range(reps):
        shuffler.shuffle(order)
        for label in order:
            times[label].append(methods[label]())
    return {k: statistics.median(v) * 1e6 / steps for k, v in times.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    cases = [
        ("small MLP 64→64→64→10, batch 32", [64, 64, 64, 10], 32, 1000),
        ("compute-bound MLP 784→512→512→10, batch 128", [784, 512, 512, 10], 128, 1000),
    ]
    for title, sizes, batch, steps in cases:
        result = bench(case(sizes, batch, steps), steps, args.reps)
        device = result["arrays (device-resident)"]
        host = result["slow iterator alone (host time)"]
        print(f"**{title}**, {steps} steps/epoch, K={K}, host cost {HOST_COST_S * 1e3} ms/batch\n")
        print("| method | median µs/step |\n|---|---:|")
        for label, us in result.items():
            print(f"| {label} | {us:,.0f} |")
        print(f"| *max(host, device)* | *{max(host, device):,.0f}* |")
        print(f"| *host + device* | *{host + device:,.0f}* |\n", flush=True)


if __name__ == "__main__":
    main()
