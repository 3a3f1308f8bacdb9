"""What preemption safety costs: a checkpoint every epoch, the time per save, and a resume.

On the digits MLP of ``_workloads.py`` (and the byte-level LM, a model 30x larger):

- a checkpoint every epoch: ``fit(checkpoint_every=1)`` with asynchronous saves (the
  default: a save returns once the arrays are on the host) and with synchronous ones
  (``checkpoint_async=False``), against the same ``fit`` without checkpoints (epochs fused
  when nothing needs the host); warm runs, interleaved, medians, ratios;

- per save: ``fit`` with ``checkpoint_every_steps=k`` against the same ``fit`` without
  checkpoints (interleaved, medians), the difference divided by the number of saves;
- resume: ``fit(..., resume=True)`` of a finished run (restore, nothing left to train),
  i.e. what a restarted process pays before it trains again, besides compiling.

    python benchmarks/bench_checkpoint.py --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import jax
from _workloads import WORKLOADS

from nnxscan.adapters.checkpoint import all_steps
from nnxscan.shell import LambdaCallback, Trainer


def timed_fit(workload, every: int, **fit) -> tuple[float, Trainer]:
    """Seconds of a warm fit whose calls are ``every`` steps long, one epoch at a time (an
    epoch hook keeps epochs apart, as checkpoints do)."""
    nodes = workload.nodes()
    trainer = Trainer(nodes[0], nodes[1], workload.loss_fn, **workload.trainer_options(nodes))
    options = dict(steps_per_call=every, callbacks=[LambdaCallback(on_epoch_end=_nothing)])
    # Compile outside the timing: what a save costs is measured on a warm run.
    trainer.fit(workload.data, epochs=1, batch_size=workload.batch_size, progress=False,
                **options)  # fmt: skip
    start = time.perf_counter()
    trainer.fit(workload.data, epochs=workload.epochs, batch_size=workload.batch_size,
                progress=False, **options, **fit)  # fmt: skip
    return time.perf_counter() - start, trainer


def _nothing(*args) -> None:
    pass


def per_save(name: str, every: int, reps: int) -> str:
    workload = WORKLOADS[name](False)
    plain, saving, saves = [], [], 0
    for _ in range(reps):
        plain.append(timed_fit(workload, every)[0])
        with tempfile.TemporaryDirectory() as folder:
            options = dict(checkpoint_every_steps=every, checkpoint_every=10**6)
            seconds, _ = timed_fit(workload, every, checkpoint_dir=folder, **options)
            saving.append(seconds)
            saves = (workload.steps) // every
    extra = statistics.median(saving) - statistics.median(plain)
    return (
        f"| {name} | {workload.steps} | {every} | {statistics.median(plain):.3f} | "
        f"{statistics.median(saving):.3f} | {saves} | {1000 * extra / max(saves, 1):.1f} |"
    )


def resume_cost(name: str, reps: int) -> str:
    workload = WORKLOADS[name](False)
    costs = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as folder:
            nodes = workload.nodes()
            trainer = Trainer(nodes[0], nodes[1], workload.loss_fn)
            trainer.fit(workload.data, epochs=1, batch_size=workload.batch_size,
                        progress=False, checkpoint_dir=folder)  # fmt: skip
            assert all_steps(folder)
            nodes = workload.nodes()
            again = Trainer(nodes[0], nodes[1], workload.loss_fn)
            start = time.perf_counter()
            again.fit(workload.data, epochs=1, batch_size=workload.batch_size,
                      progress=False, checkpoint_dir=folder, resume=True)  # fmt: skip
            costs.append(time.perf_counter() - start)
    return f"| {name} | {1000 * statistics.median(costs):.0f} |"


def every_epoch(name: str, epochs: int, steps_per_epoch: int | None, reps: int) -> str:
    """``fit`` with a checkpoint every epoch (async and sync) ÷ the same fit without."""
    workload = WORKLOADS[name](False)
    data = workload.data
    if steps_per_epoch is not None:
        data = jax.tree.map(lambda a: a[: steps_per_epoch * workload.batch_size], data)
    steps = len(jax.tree.leaves(data)[0]) // workload.batch_size
    nodes = workload.nodes()
    trainer = Trainer(nodes[0], nodes[1], workload.loss_fn, **workload.trainer_options(nodes))
    fit = dict(batch_size=workload.batch_size, progress=False)
    times: dict[str, list[float]] = {"none": [], "async": [], "sync": []}
    for variant in times:  # compile every program first: saves are measured warm
        with tempfile.TemporaryDirectory() as folder:
            options = {} if variant == "none" else dict(checkpoint_dir=folder)
            trainer.fit(data, epochs=epochs, **fit, **options,
                        **({"checkpoint_async": False} if variant == "sync" else {}))  # fmt: skip
    for rep in range(reps):
        order = list(times) if rep % 2 == 0 else list(reversed(times))
        for variant in order:
            with tempfile.TemporaryDirectory() as folder:
                options = {} if variant == "none" else dict(checkpoint_dir=folder)
                if variant == "sync":
                    options["checkpoint_async"] = False
                start = time.perf_counter()
                trainer.fit(data, epochs=epochs, **fit, **options)
                times[variant].append(time.perf_counter() - start)
    none, asynchronous, synchronous = (statistics.median(times[v]) for v in times)
    return (
        f"| {name} | {epochs} x {steps} | {none:.3f} | "
        f"{synchronous:.3f} | {synchronous / none:.2f}x | {asynchronous:.3f} | "
        f"{asynchronous / none:.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(
        "| workload | epochs x steps | fit s, no checkpoints | every epoch, sync s | ÷ none | "
        "every epoch, async s | ÷ none |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, epochs, steps in (("lm_24", 4, 8), ("mlp_digits", 10, None)):
        print(every_epoch(name, epochs, steps, args.reps), flush=True)
    print()
    print("| workload | steps | save every | fit s | fit with saves s | saves | ms per save |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, every in (("mlp_digits", 100), ("lm_200", 50)):
        print(per_save(name, every, args.reps), flush=True)
    print("\n| workload | resume (restore) ms |\n|---|---:|")
    for name in ("mlp_digits", "lm_200"):
        print(resume_cost(name, args.reps), flush=True)


if __name__ == "__main__":
    sys.exit(main())
