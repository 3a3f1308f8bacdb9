"""XLA:CPU options that compile a loop of the step sooner: what they save, what they cost.

For each workload, the per-step program (``one step``) and the loop ``fit`` runs for a call
over the gather budget (``gather per step in the loop``) from ``bench_compile_parts.py`` are
lowered once and compiled ``--reps`` times under each set of ``compiler_options`` (shuffled,
from empty caches): XLA's compile seconds (median), one run of the compiled program, and
whether its results are bitwise those of the default options (the contract: a user's own
``jax.jit`` of the same pure functions reproduces ``fit`` bitwise, so an option that changes
bits is not one ``fit`` may turn on for its own programs).

    python benchmarks/bench_xla_options.py --workloads mlp_compute,vae --reps 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import jax
import numpy as np
from _workloads import WORKLOADS
from bench_compile_parts import programs
from jax._src.interpreters import pxla

# "default" names an option at its default value: Lowered.compile() with no options would
# return the executable jit compiled already.
OPTIONS = {
    "default": {"xla_cpu_use_fusion_emitters": True},
    "no fusion emitters": {"xla_cpu_use_fusion_emitters": False},
    "optimization level 1": {"xla_backend_optimization_level": 1},
}
PARTS = ("one step", "gather per step in the loop")


def leaves(tree) -> list[np.ndarray]:
    out = []
    for x in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x))
    return out


def measure(lowered, args, reps: int, shuffler) -> dict[str, tuple[float, float, bool]]:
    compile_s = {name: [] for name in OPTIONS}
    run_s, results = {}, {}
    order = list(OPTIONS)
    for rep in range(reps):
        shuffler.shuffle(order)
        for name in order:
            pxla._cached_compilation.cache_clear()
            start = time.perf_counter()
            compiled = lowered.compile(compiler_options=OPTIONS[name])
            compile_s[name].append(time.perf_counter() - start)
            if rep == 0:  # run twice on fresh copies (the carry is donated), time the second
                for _ in range(2):
                    carry = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), args[:2]))
                    start = time.perf_counter()
                    out = jax.block_until_ready(compiled(*carry, *args[2:]))
                    run_s[name] = time.perf_counter() - start
                results[name] = leaves(out)
    base = results["default"]
    return {
        name: (
            statistics.median(compile_s[name]),
            run_s[name],
            all(
                np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
                for a, b in zip(base, results[name], strict=True)
            ),
        )
        for name in OPTIONS
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mlp_digits,mlp_compute,vae,lm_24")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    shuffler = random.Random(0)
    print(f"jax {jax.__version__}, {jax.default_backend()}; medians of {args.reps} compiles\n")
    print("| workload | program | options | XLA compile s | one run s | bitwise the default's |")
    print("|---|---|---|---:|---:|---|")
    for name in args.workloads.split(","):
        parts = programs(WORKLOADS[name](False))
        for part in PARTS:
            fn, fn_args = parts[part]
            for option, (secs, run, same) in measure(
                fn.lower(*fn_args), fn_args, args.reps, shuffler
            ).items():
                print(
                    f"| {name} | {part} | {option} | {secs:.3f} | {run:.3f} | "
                    f"{'yes' if same else 'NO'} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
