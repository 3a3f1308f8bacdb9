"""What XLA spends compiling ``Trainer.fit``'s program, part by part.

``bench_phases.py`` shows that ``fit``'s whole-run gap to the best Flax loop is XLA compiling
its program. This compiles, for each workload without NNX metrics (the MLPs, the VAE, the
LMs), programs built from the same pure step (``nnxscan.pure.make_train_step``) that add one
part at a time, and ``Trainer.fit``'s own program:

  one step                    ``jax.jit`` of one step (the per-step loops' program)
  scan of stacked batches     ``scan_steps`` over batches stacked outside (``nnx.scan``'s way)
  gather all, then scan       the call's batches gathered in the program, then scanned
  gather as bytes, then scan  the same through the byte view (``take_batch(as_bytes=True)``)
  scan_indexed_steps          what ``fit`` runs (one gather, or chunks of gathers)
  + conv rewrite              the same under ``canonical_conv_dimensions`` (``fit`` on the CPU)
  gather per step in the loop ``x[idx]`` inside the loop body
  Trainer.fit's program       captured from a ``fit`` of the whole run

Each program is lowered once; XLA compiles each module ``--reps`` times from empty caches,
in shuffled orders, and the medians are printed: XLA's compile alone, the same module every
time, so less noisy than whole runs.

    python benchmarks/bench_compile_parts.py --workloads mlp_digits,vae --reps 7
    python benchmarks/bench_compile_parts.py --workloads mlp_compute --run   # + run times

``--run`` also runs each compiled program (but ``fit``'s) once per repetition on the same
inputs, interleaved, and prints the medians: what a part costs the steps, not the compile.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from _workloads import WORKLOADS, Workload
from flax import nnx
from jax._src.interpreters import pxla

from nnxscan.pure import (
    canonical_conv_dimensions,
    init_opt_state,
    make_train_step,
    scan_indexed_steps,
    scan_steps,
)
from nnxscan.pure.batching import take_batch
from nnxscan.shell import Trainer

PLAIN = ("mlp_digits", "mlp_compute", "vae", "lm_24", "lm_200")


class Captured:
    """Captures the inputs of every XLA compile, to compile a module again on its own."""

    def __init__(self) -> None:
        self.compile = pxla._cached_compilation
        self.calls: list[tuple] = []

        def capturing(*args: Any) -> Any:
            self.calls.append(args)
            return self.compile(*args)

        capturing.cache_clear = self.compile.cache_clear  # jax.clear_caches calls it
        pxla._cached_compilation = capturing

    def largest(self, run: Callable[[], Any]) -> tuple:
        """The inputs of the largest module ``run()`` compiled."""
        self.calls.clear()
        run()
        return max(self.calls, key=lambda args: len(str(args[0])))

    def seconds(self, args: tuple) -> float:
        self.compile.cache_clear()
        started = time.perf_counter()
        self.compile(*args)
        return time.perf_counter() - started


def programs(workload: Workload) -> dict[str, tuple[Callable, tuple]]:
    """``{part: (jitted function, its arguments)}`` for the workload's whole run."""
    model, optimizer = workload.nodes()[:2]
    step = make_train_step(workload.loss_fn, optimizer.tx)
    graphdef, state = nnx.split(model)
    opt_state = init_opt_state(optimizer.tx, state)
    data = jax.device_put(workload.data)
    indices = np.concatenate([workload.batch_indices(e) for e in range(workload.epochs)])
    stacked = jax.tree.map(lambda a: a[indices], workload.data)
    one = jax.tree.map(lambda a: a[indices[0]], workload.data)

    def one_step(s, o, batch):
        return step(graphdef, s, o, batch)

    def scan_stacked(s, o, batches):
        return scan_steps(step, graphdef, s, o, batches)

    def gather_then_scan(s, o, d, i, as_bytes=False):
        return scan_steps(step, graphdef, s, o, take_batch(d, i, as_bytes=as_bytes))

    def indexed(s, o, d, i):
        return scan_indexed_steps(step, graphdef, s, o, d, i)

    def gather_in_loop(s, o, d, i):
        def body(carry, idx):
            s, o, loss = step(graphdef, *carry, jax.tree.map(lambda a: a[idx], d))
            return (s, o), loss

        return jax.lax.scan(body, (s, o), i)

    def jit(fn: Callable) -> Callable:
        return jax.jit(fn, donate_argnums=(0, 1))

    gathered = (state, opt_state, data, indices)
    as_bytes = functools.partial(gather_then_scan, as_bytes=True)
    return {
        "one step": (jit(one_step), (state, opt_state, one)),
        "scan of stacked batches": (jit(scan_stacked), (state, opt_state, stacked)),
        "gather all, then scan": (jit(gather_then_scan), gathered),
        "gather as bytes, then scan": (jit(as_bytes), gathered),
        "scan_indexed_steps": (jit(indexed), gathered),
        "+ conv rewrite": (jit(canonical_conv_dimensions(indexed)), gathered),
        "gather per step in the loop": (jit(gather_in_loop), gathered),
    }


def measure(workload: Workload, captured: Captured, reps: int, shuffler) -> dict[str, float]:
    modules = {
        part: captured.largest(lambda fn=fn, args=args: fn.lower(*args).compile())
        for part, (fn, args) in programs(workload).items()
    }
    model, optimizer = workload.nodes()[:2]
    trainer = Trainer(model, optimizer, workload.loss_fn)
    fit = functools.partial(
        trainer.fit, workload.data, epochs=workload.epochs, batch_size=workload.batch_size
    )
    modules["Trainer.fit's program"] = captured.largest(lambda: fit(progress=False))
    times: dict[str, list[float]] = {part: [] for part in modules}
    order = list(modules)
    for _ in range(reps):
        shuffler.shuffle(order)
        for part in order:
            times[part].append(captured.seconds(modules[part]))
    return {part: statistics.median(t) for part, t in times.items()}


def run_times(workload: Workload, reps: int, shuffler) -> dict[str, float]:
    """Seconds of one run of each part's compiled program (medians, interleaved)."""
    parts = programs(workload)
    compiled = {part: fn.lower(*args).compile() for part, (fn, args) in parts.items()}
    times: dict[str, list[float]] = {part: [] for part in parts}
    order = list(parts)
    for _ in range(reps):
        shuffler.shuffle(order)
        for part in order:
            args = parts[part][1]
            carry = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), args[:2]))
            started = time.perf_counter()
            jax.block_until_ready(compiled[part](*carry, *args[2:]))
            times[part].append(time.perf_counter() - started)
    return {part: statistics.median(t) for part, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(PLAIN[:4]), help=", ".join(PLAIN))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--run", action="store_true", help="also time one run of each")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    captured, shuffler, rows = Captured(), random.Random(0), []
    for name in args.workloads.split(","):
        if name not in PLAIN:
            raise SystemExit(f"{name!r}: choose from {', '.join(PLAIN)} (no NNX metrics)")
        rows.append((name, measure(WORKLOADS[name](False), captured, args.reps, shuffler)))
    parts = list(rows[0][1])
    print(f"XLA compile alone, medians of {args.reps}, s\n")
    print("| workload | " + " | ".join(parts) + " |")
    print("|---|" + "---:|" * len(parts))
    for name, result in rows:
        print(f"| {name} | " + " | ".join(f"{result[p]:.3f}" for p in parts) + " |")
    if args.run:
        print(f"\nOne run of the compiled program, medians of {args.reps}, s\n")
        runs = [(name, run_times(WORKLOADS[name](False), args.reps, shuffler)) for name, _ in rows]
        parts = list(runs[0][1])
        print("| workload | " + " | ".join(parts) + " |")
        print("|---|" + "---:|" * len(parts))
        for name, result in runs:
            print(f"| {name} | " + " | ".join(f"{result[p]:.3f}" for p in parts) + " |")


if __name__ == "__main__":
    main()
