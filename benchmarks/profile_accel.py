"""Where a scanned step's time goes on an accelerator: the profiler's per-op device times of
``bench_accel``'s variants, a population build's host and compile phases, and how far a
population's members drift from their lone ``Trainer.fit`` at each matmul precision.

    python benchmarks/profile_accel.py                       # all three parts
    python benchmarks/profile_accel.py --ops lm,compute --variants floor,scan_train,fit
    python benchmarks/profile_accel.py --parts build,drift --members 1024

``ops``: for each workload, each variant's call of the largest ``n`` is profiled (after two
warm calls) and its XLA ops are summed by name over the call: the top ``--top`` ops by
device time, each with its share of the call and its HLO category, so two variants' op
lists can be put side by side. Only a backend with a device plane (a TPU, a GPU) has op
times; on the CPU this part says so and skips.

``build``: ``Population(...)`` for 1 member and ``--members`` members under ``cProfile``
(the host functions that cost the most, cumulative) with JAX's compile log (trace, lower
and XLA compile times of each program).

``drift``: the population's first three members against their lone ``Trainer.fit`` (each
step's loss, largest relative difference) at JAX's default matmul precision and at
``"highest"``: on a TPU the default multiplies float32 in bfloat16 passes, where a vmapped
and a lone program round differently and training amplifies it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import sys
import time
from collections import defaultdict

import jax
import numpy as np
from flax import nnx

# Python -P (PYTHONSAFEPATH, as the accelerator's set-up sets it) leaves this folder off the path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_accel import TX, WORKLOADS, device_lines, timed, variants, xent
from bench_train import MLP

from nnxscan.shell import Population, Trainer


def op_table(run, top: int) -> list[str]:
    """The ``top`` XLA ops of one call of ``run`` by device time (summed by op name)."""
    timed(run)
    timed(run)
    by_op: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    category: dict[str, str] = {}
    module_ns = 0.0
    for line in device_lines(run, calls=1):
        if line.name == "XLA Modules":
            module_ns += sum(ev.duration_ns for ev in line.events)
        if line.name != "XLA Ops":
            continue
        for ev in line.events:
            by_op[ev.name] += ev.duration_ns
            counts[ev.name] += 1
            if ev.name not in category:
                stats = dict(ev.stats)
                category[ev.name] = str(stats.get("hlo_category", stats.get("category", "")))
    total = sum(by_op.values()) or 1.0
    rows = [
        f"module time {module_ns / 1e3:.0f} µs, ops summed {total / 1e3:.0f} µs",
        "",
        "| op | category | count | µs | share |",
        "|---|---|---:|---:|---:|",
    ]
    for name, ns in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        rows.append(
            f"| {name} | {category.get(name, '')} | {counts[name]} | {ns / 1e3:.1f} "
            f"| {ns / total:.1%} |"
        )
    return rows


def ops_part(workloads: list[str], names: list[str], top: int) -> None:
    if jax.default_backend() == "cpu":
        print("\n(ops: the CPU has no device plane in the profiler; skipped)")
        return
    for workload in workloads:
        n = WORKLOADS[workload][4][-1]
        runs = variants(workload, n)
        for name in names:
            print(f"\n### ops of {workload}, {name}, {n} steps a call\n", flush=True)
            print("\n".join(op_table(runs[name], top)), flush=True)


class _CompileLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Finished" in message:
            self.lines.append(message.split("\n")[0][:160])


def build_part(num_members: int) -> None:
    model_fn = lambda rngs: MLP([64, 128, 128, 10], rngs=rngs)  # noqa: E731
    jax.block_until_ready(
        jax.tree.leaves(Population(model_fn, TX, xent, seeds=range(1))._owner.read()[1])
    )  # Flax's initialisers compiled once in the process, as bench_accel does
    handler = _CompileLog()
    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").addHandler(handler)  # its modules' loggers propagate to it
    try:
        for n in (1, num_members):
            handler.lines.clear()
            profile = cProfile.Profile()
            start = time.perf_counter()
            profile.enable()
            population = Population(model_fn, TX, xent, seeds=range(n))
            jax.block_until_ready(jax.tree.leaves(population._owner.read()[1]))
            profile.disable()
            whole = time.perf_counter() - start
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(25)
            print(f"\n### build of {n} member(s): {whole:.3f} s\n\ncompile log:")
            print("\n".join(f"  {line}" for line in handler.lines) or "  (none)")
            print(out.getvalue(), flush=True)
    finally:
        jax.config.update("jax_log_compiles", False)


def drift_part(num_members: int, epochs: int) -> None:
    from _workloads import digits

    images, labels = digits(1792)
    data = {"x": images.reshape(len(images), -1), "y": labels}
    model_fn = lambda rngs: MLP([64, 128, 128, 10], rngs=rngs)  # noqa: E731
    print(f"\n### drift of members 0-2 from their lone Trainer.fit ({num_members} members)\n")
    print("| matmul precision | largest relative difference, every step's loss |")
    print("|---|---:|")
    for precision in (None, "highest"):
        with jax.default_matmul_precision(precision):
            history = Population(model_fn, TX, xent, seeds=range(num_members)).fit(
                data, epochs=epochs, batch_size=32, progress=False
            )
            gaps = []
            for seed in range(3):
                alone = Trainer(model_fn(nnx.Rngs(seed)), TX, xent).fit(
                    data, epochs=epochs, batch_size=32, seed=seed, progress=False
                )
                ours, theirs = np.asarray(history.losses)[:, seed], np.asarray(alone.losses)
                gaps.append(np.max(np.abs(ours - theirs) / np.maximum(np.abs(theirs), 1e-6)))
        print(f"| {precision or 'default'} | {max(gaps):.2e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="ops,build,drift")
    parser.add_argument("--ops", default="lm,compute", help="workloads whose ops to list")
    parser.add_argument("--variants", default="floor,floor, shuffled,scan_train,fit,nnx.scan")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--members", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    # "floor, shuffled" holds the list's separator: kept whole while splitting
    protected = args.variants.replace("floor, shuffled", "floor_shuffled").split(",")
    names = [v.strip().replace("floor_shuffled", "floor, shuffled") for v in protected]
    print(f"# profile_accel: {jax.devices()}, jax {jax.__version__}")
    parts = args.parts.split(",")
    if "ops" in parts:
        ops_part(args.ops.split(","), names, args.top)
    if "build" in parts:
        build_part(args.members)
    if "drift" in parts:
        drift_part(args.members, args.epochs)


if __name__ == "__main__":
    sys.exit(main())
