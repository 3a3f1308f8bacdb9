"""What glibc's malloc costs XLA:CPU between compiled calls, and the environment that avoids it.

XLA:CPU allocates a program's temporary buffer (its peak live intermediates: ~37 MB for the
byte LM of ``_workloads.py``) on every call and frees it at the end. glibc serves blocks
above its mmap threshold (dynamic, at most 32 MB on 64-bit Linux) with a fresh ``mmap``
and returns them with ``munmap``, so every call page-faults its temporaries in again
(~9,500 faults here) and the kernel zeroes them. One call of many steps pays that once;
a fit whose epochs are kept apart (an epoch callback, evaluation, a checkpoint every
epoch) pays it per epoch, and the per-step plan per step.

This runs the LM's ``fit`` with its epochs fused (one call) and kept apart by an empty
epoch callback (one call per epoch), in child processes started with the default
environment and with ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` raised
(glibc keeps freed blocks for reuse), child pairs interleaved; medians of the warm fits,
and the minor page faults per fit.

    python benchmarks/bench_host_memory.py --rounds 3 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

TUNED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
VARIANTS = ("fused", "epoch callback")


def child(reps: int) -> None:
    """Prints ``{variant: [(seconds, minor faults), ...]}`` of warm fits, as JSON."""
    import jax
    from _workloads import WORKLOADS

    from nnxscan.shell import LambdaCallback, Trainer

    workload = WORKLOADS["lm_24"](False)
    data = jax.tree.map(lambda a: a[: 8 * workload.batch_size], workload.data)
    nodes = workload.nodes()
    trainer = Trainer(nodes[0], nodes[1], workload.loss_fn, **workload.trainer_options(nodes))
    options = {"fused": {}, "epoch callback": {"callbacks": [LambdaCallback(on_epoch_end=_no)]}}

    def fit(variant: str) -> tuple[float, int]:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        trainer.fit(data, epochs=4, batch_size=workload.batch_size, progress=False,
                    **options[variant])  # fmt: skip
        seconds = time.perf_counter() - start
        return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    for variant in VARIANTS:  # compiled outside the timing
        fit(variant)
    out: dict[str, list] = {variant: [] for variant in VARIANTS}
    for rep in range(reps):
        for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            out[variant].append(fit(variant))
    print(json.dumps(out))


def _no(*args) -> None:
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.reps)
    here = os.path.dirname(os.path.abspath(__file__))
    envs = {"default": {}, "MALLOC_*_THRESHOLD_=1 GiB": TUNED}
    results: dict[str, dict[str, list]] = {name: {v: [] for v in VARIANTS} for name in envs}
    for round_ in range(args.rounds):
        for name in envs if round_ % 2 == 0 else list(envs)[::-1]:
            env = {k: v for k, v in os.environ.items() if k not in TUNED} | envs[name]
            command = [sys.executable, os.path.abspath(__file__), "--child", "--reps",
                       str(args.reps)]  # fmt: skip
            line = subprocess.run(command, env=env, cwd=here, check=True, capture_output=True,
                                  text=True).stdout.strip().splitlines()[-1]  # fmt: skip
            for variant, runs in json.loads(line).items():
                results[name][variant] += runs
    print("| environment | fused fit s | faults | epoch callback fit s | faults | ÷ fused |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        (fused, fused_faults), (apart, apart_faults) = (
            (statistics.median(s for s, _ in runs[v]), statistics.median(f for _, f in runs[v]))
            for v in VARIANTS
        )
        print(f"| {name} | {fused:.3f} | {fused_faults:,.0f} | {apart:.3f} | "
              f"{apart_faults:,.0f} | {apart / fused:.3f}x |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
