"""Whole runs of ``bench_wholerun.py`` a second time, with JAX's persistent compilation cache.

A script run twice with ``nnxscan.shell.enable_compilation_cache()`` at its top (JAX's
persistent cache, opt-in) reads its compiled programs from disk the second time. This times,
for every workload and variant of ``bench_wholerun.py``, the first run with the cache on (an
empty cache folder: every program compiled and written) and the second (a new run from empty
in-memory caches, ``jax.clear_caches()``, as a new process starts: every program read back),
each from fresh untrained nodes; the variants interleaved, each repetition in a fresh cache
folder. The Flax loops get the same cache: it is JAX's, not nnxscan's.

    python benchmarks/bench_cached_wholerun.py --reps 3
    python benchmarks/bench_cached_wholerun.py --workloads mlp_digits --quick   # runs?

What a second process adds on top (imports, building the model) is the same for every
variant and is left out, as in ``bench_wholerun.py``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile

import jax
from _workloads import WORKLOADS
from bench_wholerun import (
    RECIPES,
    VARIANTS,
    FreshNodes,
    cold_run,
    parse_names,
    variants_of,
    warm_up,
)
from jax._src import compilation_cache

from nnxscan.shell import enable_compilation_cache

DEFAULT_VARIANTS = [*RECIPES, "fit_auto"]


def first_and_second(workload, variant, fresh_nodes) -> tuple[float, float, float, float]:
    """The first and the second whole run with the cache on, in a new cache folder."""
    with tempfile.TemporaryDirectory(prefix="nnxscan-cache-bench-") as folder:
        compilation_cache.reset_cache()
        jax.config.update("jax_enable_compilation_cache", True)
        enable_compilation_cache(folder)
        try:
            first, loss1 = cold_run(workload, variant, fresh_nodes)[:2]
            second, loss2 = cold_run(workload, variant, fresh_nodes)[:2]
        finally:
            jax.config.update("jax_enable_compilation_cache", False)
            compilation_cache.reset_cache()
    return first, second, loss1, loss2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="all", help=", ".join(WORKLOADS))
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=", ".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition")
    args = parser.parse_args(argv)
    workloads = parse_names(args.workloads, list(WORKLOADS), {"all": list(WORKLOADS)}, "workload")
    names = parse_names(args.variants, list(VARIANTS), {"all": list(VARIANTS)}, "variant")
    reps = 1 if args.quick else args.reps
    shuffler = random.Random(0)
    print(
        f"Whole runs with JAX's persistent compilation cache: jax {jax.__version__}, "
        f"{jax.default_backend()}; medians of {reps}; s. first = the cache empty (compile and "
        "write), second = the same run again from empty in-memory caches (read back).\n"
    )
    warm_up(names, lambda line: print(line, file=sys.stderr, flush=True), "built")
    rows = []
    for wname in workloads:
        workload = WORKLOADS[wname](args.quick)
        order, fresh = variants_of(workload, names), FreshNodes(workload)
        times = {n: ([], [], []) for n in order}
        for rep in range(reps):
            shuffler.shuffle(order)
            for name in order:
                first, second, loss1, loss2 = first_and_second(workload, VARIANTS[name], fresh)
                times[name][0].append(first)
                times[name][1].append(second)
                times[name][2].append((loss1, loss2))
                print(
                    f"  {wname} rep {rep + 1} {name:<16} first {first:6.3f} s  second "
                    f"{second:6.3f} s  losses {loss1:.5g} {loss2:.5g}",
                    file=sys.stderr,
                    flush=True,
                )
        med = {n: (statistics.median(t[0]), statistics.median(t[1])) for n, t in times.items()}
        loops = [med[n][1] for n in RECIPES if n in med]
        fit = med.get("fit_auto")
        ratio = f"{fit[1] / min(loops):.2f}×" if fit and loops else "—"
        print(f"**{wname}** ({workload.steps:,} steps)\n")
        print("| variant | first run s | second run s | second ÷ first |")
        print("|---|---:|---:|---:|")
        for n in times:
            print(f"| {n} | {med[n][0]:.3f} | {med[n][1]:.3f} | {med[n][1] / med[n][0]:.2f}× |")
        print()
        rows.append((wname, workload.steps, fit, min(loops) if loops else None, ratio))
    print("**Summary**: fit_auto's second run ÷ the best Flax loop's second run\n")
    print("| workload | steps | fit first s | fit second s | best loop second s | ÷ best loop |")
    print("|---|---:|---:|---:|---:|---:|")
    for wname, steps, fit, best, ratio in rows:
        first, second = fit if fit else (float("nan"), float("nan"))
        best = float("nan") if best is None else best
        print(f"| {wname} | {steps:,} | {first:.3f} | {second:.3f} | {best:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
