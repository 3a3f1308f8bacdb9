"""Compile time: flat in the steps per call, and paid once across processes with the cache.

Two measurements, each on the small digits MLP and the byte-level LM of ``_workloads.py``:

1. ``fit`` with the scan plan and 10 vs 10,000 steps per compiled call: XLA compile time
   (JAX's ``backend_compile`` events) of the first fit, from empty caches. A scan is a loop,
   so its compile should not grow with its length.
2. The same training script run as two fresh processes with
   ``nnxscan.shell.enable_compilation_cache(dir)``: the second process's compile time and
   whole run, against the first's and against a process without the cache.

    python benchmarks/bench_compile.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent

# One process: build a workload, fit it once, print compile and whole-run seconds as JSON.
CHILD = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, {root!r})
    import jax
    compile_s = [0.0]
    def on_duration(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compile_s[0] += seconds
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    from _workloads import WORKLOADS
    from nnxscan.shell import Plan, Trainer, enable_compilation_cache
    workload_name, steps_per_call, epochs, cache = sys.argv[1:5]
    if cache != "-":
        enable_compilation_cache(cache)
    workload = WORKLOADS[workload_name](False)
    nodes = workload.nodes()
    start = time.perf_counter()
    trainer = Trainer(nodes[0], nodes[1], workload.loss_fn, execution="scan",
                      **workload.trainer_options(nodes))
    trainer.fit(workload.data, epochs=int(epochs), batch_size=workload.batch_size,
                steps_per_call=int(steps_per_call), progress=False)
    print(json.dumps({{"compile": compile_s[0], "whole": time.perf_counter() - start}}))
    """
).format(root=str(ROOT))


def run_child(workload: str, steps_per_call: int, epochs: int, cache: str = "-") -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, workload, str(steps_per_call), str(epochs), cache],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def flat_in_length(workload: str, epochs: int, reps: int) -> list[str]:
    """Compile seconds of the first fit with 10 and with 10,000 steps per call."""
    rows = []
    short, long = [], []
    for _ in range(reps):
        short.append(run_child(workload, 10, epochs)["compile"])
        long.append(run_child(workload, 10_000, epochs)["compile"])
    a, b = statistics.median(short), statistics.median(long)
    rows.append(f"| {workload} | {a:.2f} | {b:.2f} | {b / a:.2f}× |")
    return rows


def second_process(workload: str, epochs: int, reps: int) -> list[str]:
    """Compile and whole-run seconds: no cache, first process, second process."""
    cold, first, second = [], [], []
    for _ in range(reps):
        cold.append(run_child(workload, 10_000, epochs))
        with tempfile.TemporaryDirectory() as cache:
            first.append(run_child(workload, 10_000, epochs, cache))
            second.append(run_child(workload, 10_000, epochs, cache))

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return [
        f"| {workload} | {name} | {med(runs, 'compile'):.2f} | {med(runs, 'whole'):.2f} |"
        for name, runs in (("no cache", cold), ("cache, 1st process", first),
                           ("cache, 2nd process", second))
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    cases = {"mlp_digits": 30, "lm_200": 1}
    print("Compile seconds of the first fit (scan plan), by steps per compiled call\n")
    print("| workload | 10 steps/call | 10,000 steps/call | ratio |\n|---|---:|---:|---:|")
    for name, epochs in cases.items():
        print("\n".join(flat_in_length(name, epochs, args.reps)), flush=True)
    print("\nA second process with the persistent compilation cache\n")
    print("| workload | process | compile s | whole fit s |\n|---|---|---:|---:|")
    for name, epochs in cases.items():
        print("\n".join(second_process(name, epochs, args.reps)), flush=True)


if __name__ == "__main__":
    main()
