"""What a short call costs beside its steps: 16-step calls of bench_accel's workloads.

Each variant is a zero-argument call from ``bench_accel.variants`` (the hand-written scan,
the pure core's ``scan_steps``, ``scan_train``, a ``fit`` epoch) plus ``scan_train`` with
its kept set-up turned off (``shell/_engine/kept_setup.py``: every call sets up afresh, as
a first call does). All run in one process, every round in a shuffled order, ``--calls``
calls a round each waited for; the table gives the median ms per call and its ratio to the
hand-written scan's.

    python benchmarks/bench_per_call.py --rounds 15
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import jax
from bench_accel import variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="small")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()

    runs = variants(args.workload, args.steps)
    kept = sys.modules["nnxscan.shell._scan_train"]  # imported by bench_accel
    real = kept._kept_call
    scan_train_run = runs["scan_train"]

    def afresh():
        kept._kept_call = lambda *a, **k: None
        try:
            return scan_train_run()
        finally:
            kept._kept_call = real

    names = ["floor", "scan_steps", "scan_train", "scan_train, set up afresh", "fit"]
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


if __name__ == "__main__":
    main()
