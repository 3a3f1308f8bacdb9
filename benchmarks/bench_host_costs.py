"""The small host costs the shell is built to avoid paying per call.

Each row is a piece of host work the shell does (or skips) around its compiled calls, timed
on the small MLP of the benchmarks (64 -> 64 -> 64 -> 10, Adam, an ``nnx.Optimizer``: 19
carry leaves), every variant once per round in a shuffled order, medians of the rounds in
microseconds:

- a walk of the user's objects (``nnx.split`` of the model; the owner's ``read()`` of model
  and optimizer), which ``ModelOwner.reads_held`` does once per set-up instead of per read;
- writing a trained carry back: the owner's write-back (a value swap per Variable) against
  ``nnx.update`` of the model and the optimizer (what it does for another structure);
- flattening and rebuilding the ``(state, opt_state)`` carry (``jax.tree`` round trip);
- ``jax.device_put`` of a leaf already committed to the device, against letting it through;
- one compiled call's fixed cost: a jitted, donating identity over the carry's leaves,
  dispatched and waited for;
- ``jax.device_get`` of a flat list of 100 small arrays against ``np.asarray`` per array (a
  checkpoint's copy to the host);
- building a ``rich.console.Console`` (the progress bar's, skipped when nothing is shown).

    python benchmarks/bench_host_costs.py --rounds 21
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_epoch import MLP  # the small MLP of bench_epoch and bench_custom_step
from flax import nnx

from nnxscan.adapters.nnx_optimizer import optimizer_state_builder
from nnxscan.shell._engine.owner import ModelOwner


def _per_call(fn: Callable[[], object], reps: int) -> float:
    """Microseconds per call of ``fn``, over ``reps`` calls (one warm-up first)."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def variants() -> dict[str, Callable[[], object]]:
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    owner = ModelOwner(model, optimizer)
    _, state, opt_state = owner.read()
    leaves, treedef = jax.tree.flatten((state, opt_state))
    write = owner.make_write_back()
    build = optimizer_state_builder(optimizer)
    step = jnp.asarray(0, jnp.uint32)
    device = jax.devices()[0]
    small = [jnp.full((16,), i, jnp.float32) for i in range(100)]
    identity = jax.jit(lambda xs: [x * 1 for x in xs], donate_argnums=0)
    carry = [[x.copy() for x in leaves]]  # donated: its own arrays

    def call() -> None:
        carry[0] = identity(carry[0])
        jax.block_until_ready(carry[0])

    def update_both() -> None:
        nnx.update(model, state)
        nnx.update(optimizer, build(opt_state, step))

    def console() -> object:
        from rich.console import Console

        return Console()

    return {
        "walk: nnx.split(model)": lambda: nnx.split(model),
        "walk: owner.read() (model and optimizer)": owner.read,
        "write-back: the owner's value swap": lambda: write(leaves, treedef, 0),
        "write-back: nnx.update of model and optimizer": update_both,
        "carry: jax.tree flatten + unflatten": lambda: jax.tree.unflatten(
            *reversed(jax.tree.flatten((state, opt_state)))
        ),
        "device_put of a committed leaf (per leaf)": lambda: [
            jax.device_put(x, device) for x in leaves
        ],
        "a committed leaf let through (per leaf)": lambda: [
            x if isinstance(x, jax.Array) else jax.device_put(x, device) for x in leaves
        ],
        "a compiled call (donating identity, 19 leaves), waited for": call,
        "jax.device_get of 100 small arrays": lambda: jax.device_get(small),
        "np.asarray of each of 100 small arrays": lambda: [np.asarray(x) for x in small],
        "rich Console()": console,
    }


PER_LEAF = ("device_put of a committed leaf (per leaf)", "a committed leaf let through (per leaf)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--reps", type=int, default=200, help="calls per timed round")
    args = parser.parse_args()
    runs = variants()
    leaves = 19
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        names = list(runs)
        random.shuffle(names)
        for name in names:
            micros = _per_call(runs[name], args.reps)
            times[name].append(micros / leaves if name in PER_LEAF else micros)
    print(f"| host work (small MLP, Adam, {leaves} carry leaves) | µs, median of {args.rounds} |")
    print("|---|---:|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):,.1f} |")


if __name__ == "__main__":
    main()
