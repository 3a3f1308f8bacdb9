"""Building a Population's members: one compiled program against one member at a time.

N members of an MLP with Adam, each from its own seed, built as ``Population`` builds them
(``nnxscan.shell._engine.member_build``), whole: from empty compilation caches
(``jax.clear_caches()``, as ``bench_wholerun.py`` empties them), compile included, until
every member's state and optax state is ready:

  one_program  ``build_members``: ``model_fn`` traced once under a ``jax.vmap`` over the
               seeds, every member's state and Adam state made by one compiled program
  one_by_one   ``build_members(one_by_one=True)`` (what ``build_members`` did before, and
               still does for a ``model_fn`` it cannot trace): each member built eagerly on
               the host, Flax's initializers op by op, then stacked

Models: the small MLP 64→64→64→10 (``mlp_keras``'s) and the digits MLP 64→128→128→10
(``mlp_digits``'s). Reported per model and N: the median seconds of each variant over
``--reps`` repetitions (the variants of one repetition run back to back, in a shuffled
order), each as a ratio to its own time at the first size (N=1), and one_by_one ÷ one_program.

    python benchmarks/bench_population_build.py --sizes 1,16,256,1024 --reps 3

``--one-program-only`` leaves the one-by-one build out (on a TPU v5e it
takes ~50 ms a member).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import jax
import optax
from _workloads import MLP

from nnxscan.pure import make_train_step
from nnxscan.shell._engine.layout import Members
from nnxscan.shell._engine.member_build import build_members

MODELS = {"small MLP 64-64-64-10": (64, 64, 64, 10), "digits MLP 64-128-128-10": (64, 128, 128, 10)}
VARIANTS = {"one_program": False, "one_by_one": True}  # build_members(one_by_one=)


def build(one_by_one: bool, sizes: tuple[int, ...], n: int) -> float:
    """Seconds to build ``n`` members from empty caches, every array ready."""
    gc.collect()
    jax.clear_caches()
    start = time.perf_counter()
    step = make_train_step(lambda model, batch: 0.0, optax.adam(1e-3))  # init only
    owner = build_members(
        lambda rngs: MLP(sizes, rngs=rngs), step, tuple(range(n)), {}, Members(n),
        one_by_one=one_by_one,
    )  # fmt: skip
    jax.block_until_ready(owner.read()[1:])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,256,1024")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--one-program-only", action="store_true")
    args = parser.parse_args()
    if args.one_program_only:
        VARIANTS.pop("one_by_one")
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(0)
    for variant in VARIANTS.values():  # imports and first-call set-up land in no timing
        build(variant, (2, 2), 2)
    print(f"{jax.devices()[0].device_kind}; whole build from empty caches, compile included; "
          f"medians of {args.reps}\n")  # fmt: skip
    print(f"| model | members | one by one s | one program s | one by one ÷ N={sizes[0]} | "
          f"one program ÷ N={sizes[0]} | one by one ÷ one program |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, model in MODELS.items():
        first: dict[str, float] = {}
        for n in sizes:
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(args.reps):
                for v in rng.sample(list(VARIANTS), len(VARIANTS)):
                    times[v].append(build(VARIANTS[v], model, n))
            med = {v: statistics.median(t) for v, t in times.items()}
            first = first or med
            new = med["one_program"]
            old = med.get("one_by_one", float("nan"))
            ratios = old / first.get("one_by_one", old), new / first["one_program"], old / new
            print(f"| {name} | {n} | {old:.2f} | {new:.2f} | {ratios[0]:.2f}× | "
                  f"{ratios[1]:.2f}× | {ratios[2]:.1f}× |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
