"""What a short call costs beside its steps: 16-step calls of bench_accel's workloads.

Each variant is a zero-argument call from ``bench_accel.variants`` (the hand-written scan,
the pure core's ``scan_steps``, ``scan_train``, a ``fit`` epoch) plus ``scan_train`` with
its kept set-up turned off (``shell/_engine/kept_setup.py``: every call sets up afresh, as
a first call does). All run in one process, every round in a shuffled order, ``--calls``
calls a round each waited for; the table gives the median ms per call and its ratio to the
hand-written scan's. Also the floor over a shuffled epoch (its batches gathered in the
program, as ``fit``'s are) and the marginal cost of an epoch inside a fit of several, each
epoch its own call (an epoch-end hook): ``(fit of 9 epochs - fit of 1) / 8``.

    python benchmarks/bench_per_call.py --rounds 15
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import time

import jax
import numpy as np
from bench_accel import TX, WORKLOADS, variants

from nnxscan.shell import Trainer
from nnxscan.shell.callbacks import LambdaCallback

EPOCHS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="small")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()

    runs = variants(args.workload, args.steps)
    build, loss, batch, make, _, _ = WORKLOADS[args.workload]
    flat = jax.device_put(make(args.steps * batch, np.random.default_rng(0)), jax.devices()[0])
    kept = sys.modules["nnxscan.shell._scan_train"]  # imported by bench_accel
    real = kept._kept_call
    scan_train_run = runs["scan_train"]

    def afresh():
        kept._kept_call = lambda *a, **k: None
        try:
            return scan_train_run()
        finally:
            kept._kept_call = real

    # An epoch inside a fit of several (the Keras way: one fit, many epochs): the marginal
    # cost of an epoch, (fit of 1 + EPOCHS epochs - fit of 1) / EPOCHS, each epoch its own
    # call (an epoch-end hook makes every epoch come back to the host).
    fit_of = {}
    for epochs in (1, 1 + EPOCHS):
        trainer = Trainer(build(), TX, loss)
        hook = LambdaCallback(on_epoch_end=lambda *_: None)
        fit_of[epochs] = functools.partial(
            trainer.fit, flat, epochs=epochs, batch_size=batch, progress=False, callbacks=[hook]
        )
    runs["fit, 1 epoch + hook"] = lambda: fit_of[1]().losses
    runs[f"fit, {1 + EPOCHS} epochs + hook"] = lambda: fit_of[1 + EPOCHS]().losses
    names = ["floor", "floor, shuffled", "scan_steps", "scan_train", "scan_train, set up afresh",
             "fit", "fit, 1 epoch + hook", f"fit, {1 + EPOCHS} epochs + hook"]  # fmt: skip
    runs["scan_train, set up afresh"] = afresh
    for name in names:
        for _ in range(5):
            jax.block_until_ready(runs[name]())
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[:]
        random.Random(r).shuffle(order)
        for name in order:
            run = runs[name]
            start = time.perf_counter()
            for _ in range(args.calls):
                jax.block_until_ready(run())
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    floor = statistics.median(times["floor"])
    print(
        f"{args.workload}, {args.steps}-step calls on {jax.default_backend()}; "
        f"load average {os.getloadavg()[0]:.1f}; medians of {args.rounds} rounds\n"
    )
    print("| variant | ms per call | ÷ hand-written scan |\n|---|---:|---:|")
    for name in names:
        median = statistics.median(times[name])
        print(f"| {name} | {median:.3f} | {median / floor:.2f}× |")
    epoch = (
        statistics.median(times[f"fit, {1 + EPOCHS} epochs + hook"])
        - statistics.median(times["fit, 1 epoch + hook"])
    ) / EPOCHS
    shuffled = statistics.median(times["floor, shuffled"])
    print(
        f"| an epoch inside a fit (marginal) | {epoch:.3f} | {epoch / floor:.2f}× "
        f"({epoch / shuffled:.2f}× the shuffled floor's call) |"
    )


if __name__ == "__main__":
    main()
