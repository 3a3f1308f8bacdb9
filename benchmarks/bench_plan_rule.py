"""Whole runs of ``fit`` per execution plan, one new process per run: what the plan rule weighs.

For each workload of ``_workloads.py`` named, each repetition runs every variant once, in a
new shuffled order, each in a NEW Python process (``bench_wholerun.py``'s timing with
``--optimizer built``: untimed imports and a tiny warm-up run, then ``whole`` =
``Trainer(...)`` + ``fit`` from empty compilation caches, ``steady`` = the same ``fit``
again, compiled). Medians over the
repetitions, and the median of the per-repetition ratios of each variant to the first one
(paired: the runs of one repetition ran back to back, under the same load).

    python benchmarks/bench_plan_rule.py --workloads mlp_compute,vae --reps 3
    python benchmarks/bench_plan_rule.py --features   # static sizes only, no timing
    python benchmarks/bench_plan_rule.py --per-step --reps 7   # steady ms a step, one process

``--features`` prints, per workload, what a plan rule could read before training: the
run's steps, the batch size, the parameter count and the per-step program's FLOPs (XLA's
cost analysis of the lowered split/merge + ``jax.jit`` step; lowered, not compiled).

``--per-step`` compares the steps alone: in ONE process, each variant's run compiled first,
then the same run again ``--reps`` times, the variants interleaved in shuffled orders;
medians of the steady seconds, in ms a step and paired against the first variant (the
per-step plan against a per-step Flax loop: are its steps slower than the loop's?).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(workload_name: str, variant_name: str) -> None:
    sys.path.insert(0, HERE)
    import bench_wholerun as bw
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    bw.warm_up([variant_name], lambda line: None, "built")
    workload = bw.WORKLOADS[workload_name](False)
    run = bw.run_variant(workload, bw.VARIANTS[variant_name], bw.FreshNodes(workload))
    print(json.dumps({"whole": run.whole, "steady": run.steady, "loss": run.loss}))


def features(workload_name: str) -> str:
    sys.path.insert(0, HERE)
    import bench_wholerun as bw
    import jax
    from flax import nnx

    workload = bw.WORKLOADS[workload_name](False)
    nodes = workload.nodes()
    graphdef, state = nnx.split(nodes)

    def step(state, batch):
        live = nnx.merge(graphdef, state)
        out = workload.train_step(*live, batch)
        return nnx.state(live), out

    batch = next(workload.batches(0))
    cost = jax.jit(step).lower(state, batch).cost_analysis()
    params = sum(x.size for x in jax.tree.leaves(nnx.state(nodes[0], nnx.Param)))
    return (
        f"| {workload_name} | {workload.steps} | {workload.batch_size} | {params:,} | "
        f"{cost['flops'] / 1e6:,.0f} | {workload.steps * cost['flops'] / 1e9:,.1f} |"
    )


def per_step(workload_name: str, variants: list[str], reps: int) -> list[str]:
    """Rows of the ``--per-step`` table for one workload (see the module's docstring)."""
    sys.path.insert(0, HERE)
    import time

    import bench_wholerun as bw
    import jax
    from flax import nnx

    workload = bw.WORKLOADS[workload_name](False)
    fresh, trains = bw.FreshNodes(workload), {}
    for name in variants:
        nodes = fresh()
        train = bw.VARIANTS[name](workload, nodes)
        train()  # compiled here
        trains[name] = (train, nodes)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    shuffler = random.Random(0)
    for _ in range(reps):
        order = list(variants)
        shuffler.shuffle(order)
        for name in order:
            train, nodes = trains[name]
            started = time.perf_counter()
            train()
            jax.block_until_ready(nnx.state(nodes))
            seconds[name].append(time.perf_counter() - started)
    rows = []
    for name in variants:
        pairs = zip(seconds[name], seconds[variants[0]], strict=True)
        ratio = statistics.median(a / b for a, b in pairs)
        ms = 1e3 * statistics.median(seconds[name]) / workload.steps
        rows.append(f"| {workload_name} | {name} | {ms:.3f} | {ratio:.2f}× |")
    return rows


def run_child(workload: str, variant: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", workload, variant],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mlp_compute,cnn_28x28,vae,lm_24,lm_200")
    parser.add_argument("--variants", default="fit_scan,fit_step,split_merge_jit")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "VARIANT"))
    parser.add_argument("--features", action="store_true", help="static sizes, no timing")
    parser.add_argument("--per-step", action="store_true", help="steady steps, one process")
    args = parser.parse_args()
    if args.per_step:
        variants = args.variants.split(",")
        print(f"| workload | variant | steady ms a step | ÷ {variants[0]} (paired) |")
        print("|---|---|---:|---:|")
        for name in args.workloads.split(","):
            print("\n".join(per_step(name, variants, args.reps)), flush=True)
        return
    if args.features:
        print("| workload | steps | batch | parameters | MFLOP per step | GFLOP per run |")
        print("|---|---:|---:|---:|---:|---:|")
        for name in args.workloads.split(","):
            print(features(name), flush=True)
        return
    if args.child:
        child(*args.child)
        return
    workloads, variants = args.workloads.split(","), args.variants.split(",")
    shuffler = random.Random(0)
    runs = {(w, v): [] for w in workloads for v in variants}
    for rep in range(args.reps):
        for w in workloads:
            order = list(variants)
            shuffler.shuffle(order)
            for v in order:
                load = os.getloadavg()[0]
                run = run_child(w, v)
                runs[w, v].append(run)
                print(
                    f"  {w} rep {rep + 1} {v:<16} whole {run['whole']:7.3f} s  steady "
                    f"{run['steady']:7.3f} s  loss {run['loss']:.5g}  load {load:.2f}",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
    base = variants[0]
    print(f"| workload | variant | whole s | steady s | whole − steady s | ÷ {base} (paired) |")
    print("|---|---|---:|---:|---:|---:|")
    for w in workloads:
        for v in variants:
            r = runs[w, v]
            ratio = statistics.median(
                a["whole"] / b["whole"] for a, b in zip(r, runs[w, base], strict=True)
            )
            whole = statistics.median(x["whole"] for x in r)
            steady = statistics.median(x["steady"] for x in r)
            compile_ = statistics.median(x["whole"] - x["steady"] for x in r)
            print(f"| {w} | {v} | {whole:.3f} | {steady:.3f} | {compile_:.3f} | {ratio:.2f}× |")


if __name__ == "__main__":
    main()
