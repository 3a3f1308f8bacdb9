"""CNNs inside ``lax.scan`` on the CPU: the per-step program, the plain scan, the rewritten scan.

XLA:CPU canonicalizes convolution layouts only in a program's entry computation, so inside a
loop body the gradient convolutions of a CNN step run XLA's generic code (jax#12868).
``nnxscan.pure.canonical_conv_dimensions`` makes that rewrite before XLA sees the program. For
each workload this times, in one process, on the same batches (the order ``Trainer.fit(
seed=0)`` trains):

  step            the step jitted on its own, one call per batch (the batch gathered from the
                  device-resident data inside the call, the state donated): ``"step"`` plan
  scan            one ``jax.jit`` around a ``lax.scan`` over the epoch's steps, the step as
                  written
  rewritten_scan  the same scan of ``canonical_conv_dimensions(step)``

  whole   from a fresh ``jax.jit`` (``jax.clear_caches()`` first) to ``--epochs`` epochs
          trained, compile included;
  steady  µs per step of the same epochs run again, compiled (the median of 3 runs), wall
          clock and the process's CPU time (all threads; less swayed by other jobs).

Each variant runs once untimed first (one-time set-up), then each repetition runs every
variant once in a new shuffled order; medians, and each variant ÷ ``step``. The final
parameters of each program are compared bit for bit with the per-step program's.

Workloads: ``cnn_8x8`` is the Flax NNX MNIST tutorial's CNN (BatchNorm, Dropout, call-time
Rngs, MultiMetric) on scikit-learn's 8×8 digits, batch 32, adamw, 44 steps an epoch;
``two_conv`` a two-conv NHWC CNN (32 and 64 channels) on the same digits, batch 32, SGD.
``--trace`` also times what wrapping a step without convolutions costs (the shell wraps every
step on the CPU): the plan probe's trace plus the chunk runner's, with and without it.

    python benchmarks/bench_conv_scan.py --reps 5
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _workloads import WORKLOADS, digits, tutorial_cnn, update_metrics
from flax import nnx

from nnxscan.pure import (
    canonical_conv_dimensions,
    epoch_order,
    init_opt_state,
    make_train_step,
    scan_indexed_steps,
    scan_steps,
)

VARIANTS = ("step", "scan", "rewritten_scan")
STEADY_RUNS = 3  # compiled runs per repetition; their median is the repetition's steady


class TwoConv(nnx.Module):
    """Two 3×3 convolutions (32 and 64 channels, NHWC) and a Linear head."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.head = nnx.Linear(8 * 8 * 64, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv2(nnx.relu(self.conv1(x))))
        return self.head(x.reshape(x.shape[0], -1))


def image_xent(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


@dataclasses.dataclass(frozen=True)
class Setup:
    """A pure step, the untrained ``(graphdef, state, opt_state)`` and the data."""

    name: str
    title: str
    step: Callable
    graphdef: Any
    state: Any
    opt_state: Any
    data: dict
    batch_size: int

    @property
    def steps_per_epoch(self) -> int:
        return len(self.data["label"]) // self.batch_size

    def indices(self, epochs: int) -> np.ndarray:
        """``(epochs * steps_per_epoch, batch_size)`` example indices, Trainer.fit's order."""
        n, per = len(self.data["label"]), self.steps_per_epoch * self.batch_size
        return np.concatenate(
            [epoch_order(0, e, n)[:per].reshape(-1, self.batch_size) for e in range(epochs)]
        )


def tutorial_setup() -> Setup:
    workload = tutorial_cnn("cnn_8x8", quick=False)
    model, _, metrics, rngs = workload.nodes()
    tx = workload.make_tx()
    step = make_train_step(
        workload.loss_fn, tx, has_aux=True, with_rngs=True, update_metrics=update_metrics
    )
    graphdef, state = nnx.split((model, rngs, metrics))
    return Setup(
        "cnn_8x8", workload.title, step, graphdef, state, init_opt_state(tx, state),
        workload.data, workload.batch_size,
    )  # fmt: skip


def two_conv_setup() -> Setup:
    images, labels = digits(1408)
    tx = optax.sgd(0.01)
    graphdef, state = nnx.split(TwoConv(rngs=nnx.Rngs(0)))
    return Setup(
        "two_conv", "two-conv NHWC CNN (32/64 channels) on the 8×8 digits, batch 32, SGD",
        make_train_step(image_xent, tx), graphdef, state, init_opt_state(tx, state),
        {"image": images[..., None], "label": labels}, 32,
    )  # fmt: skip


SETUPS = {"cnn_8x8": tutorial_setup, "two_conv": two_conv_setup}


# -- the three programs ------------------------------------------------------------------------


def per_step_program(setup: Setup) -> Callable:
    """``train(state, opt_state, data, indices)``: one jitted call per step, as the
    ``"step"`` plan runs (the batch gathered inside the call, the carry donated)."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def one(state, opt_state, data, idx):
        batch = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), data)
        state, opt_state, _ = setup.step(setup.graphdef, state, opt_state, batch)
        return state, opt_state

    def train(state, opt_state, data, indices):
        for i in range(len(indices)):
            state, opt_state = one(state, opt_state, data, indices[i])
        return state, opt_state

    return train


def scan_program(step: Callable, setup: Setup) -> Callable:
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train(state, opt_state, data, indices):
        state, opt_state, _ = scan_indexed_steps(
            step, setup.graphdef, state, opt_state, data, indices
        )
        return state, opt_state

    return train


def program(name: str, setup: Setup) -> Callable:
    if name == "step":
        return per_step_program(setup)
    step = canonical_conv_dimensions(setup.step) if name == "rewritten_scan" else setup.step
    return scan_program(step, setup)


# -- timing ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    whole: float  # s, compile included
    steady_us: float  # µs per step, compiled
    cpu_us: float  # the process's CPU time per step (all threads): less swayed by other load
    params: list  # host copies of the final state's arrays


def fresh(tree: Any) -> Any:
    return jax.device_put(tree, may_alias=False)


def run_variant(name: str, setup: Setup, data: dict, indices: jax.Array) -> Run:
    gc.collect()
    jax.clear_caches()
    state, opt_state = fresh(setup.state), fresh(setup.opt_state)
    start = time.perf_counter()
    train = program(name, setup)
    state, opt_state = jax.block_until_ready(train(state, opt_state, data, indices))
    whole = time.perf_counter() - start
    params = [np.asarray(x) for x in jax.tree.leaves(nnx.split_state(state, nnx.Param, ...)[0])]
    steady, cpu = [], []
    for _ in range(STEADY_RUNS):
        again = fresh(setup.state), fresh(setup.opt_state)
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(train(*again, data, indices))
        steady.append((time.perf_counter() - start) / len(indices))
        cpu.append((time.process_time() - start_cpu) / len(indices))
    return Run(whole, 1e6 * statistics.median(steady), 1e6 * statistics.median(cpu), params)


def bench(setup: Setup, epochs: int, reps: int, shuffler: random.Random, log) -> dict:
    data = jax.device_put(setup.data)
    indices = jax.device_put(setup.indices(epochs))
    runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    for name in order:  # untimed: one-time set-up lands in no timing
        run_variant(name, setup, data, indices[:2])
    for rep in range(reps):
        shuffler.shuffle(order)
        for name in order:
            run = run_variant(name, setup, data, indices)
            runs[name].append(run)
            log(f"  {setup.name} rep {rep + 1}/{reps} {name:<15} whole {run.whole:7.3f} s  "
                f"steady {run.steady_us:8.0f} µs/step")  # fmt: skip
    return runs


def table(setup: Setup, runs: dict, epochs: int, reps: int) -> str:
    steps = epochs * setup.steps_per_epoch
    ref = runs["step"][0].params
    whole = {v: statistics.median(r.whole for r in rs) for v, rs in runs.items()}
    steady = {v: statistics.median(r.steady_us for r in rs) for v, rs in runs.items()}
    cpu = {v: statistics.median(r.cpu_us for r in rs) for v, rs in runs.items()}
    lines = [
        f"**{setup.name}**: {setup.title}; {steps} steps ({epochs} epochs × "
        f"{setup.steps_per_epoch}), medians of {reps}",
        "",
        "| program | whole run s (compile incl.) | ÷ step | steady µs/step | ÷ step "
        "| CPU µs/step | ÷ step | params vs step |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for v in VARIANTS:
        got = runs[v][0].params
        same = all(np.array_equal(a, b) for a, b in zip(got, ref, strict=True))
        worst = max(float(np.max(np.abs(a - b))) for a, b in zip(got, ref, strict=True))
        lines.append(
            f"| {v} | {whole[v]:.3f} | {whole[v] / whole['step']:.2f}× | {steady[v]:,.0f} | "
            f"{steady[v] / steady['step']:.2f}× | {cpu[v]:,.0f} | {cpu[v] / cpu['step']:.2f}× | "
            f"{'bitwise' if same else f'max abs diff {worst:.1e}'} |"
        )
    return "\n".join(lines)


# -- what wrapping a step without convolutions costs ------------------------------------------


def trace_cost(name: str, reps: int) -> str:
    """The shell's traces of a step without convolutions -- the plan probe's, then the
    chunk runner's (a scan of the jitted step) -- with the runner as it is and wrapped in
    canonical_conv_dimensions as the shell wraps it on the CPU; interleaved, medians."""
    workload = WORKLOADS[name](False)
    tx = workload.make_tx()
    step = make_train_step(workload.loss_fn, tx)
    graphdef, state = nnx.split(workload.nodes()[0])
    opt_state = init_opt_state(tx, state)
    batch = jax.tree.map(lambda a: a[: workload.batch_size], workload.data)
    batches = jax.tree.map(lambda a: np.stack([a] * 4), batch)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for wrapped in (False, True):
            start = time.perf_counter()
            jitted = jax.jit(lambda s, o, b: step(graphdef, s, o, b))

            def as_step(_g, s, o, b, jitted=jitted):
                return jitted(s, o, b)

            def run(s, o, b, as_step=as_step):
                return scan_steps(as_step, graphdef, s, o, b)

            jax.make_jaxpr(as_step, static_argnums=0)(graphdef, state, opt_state, batch)
            program = canonical_conv_dimensions(run) if wrapped else run
            jax.jit(program).trace(state, opt_state, batches)
            seconds[wrapped].append(time.perf_counter() - start)
    plain, wrapped = (1e3 * statistics.median(seconds[k]) for k in (False, True))
    extra = f"{wrapped - plain:+.1f} | {wrapped / plain:.2f}×"
    return f"| {name} | {plain:.1f} | {wrapped:.1f} | {extra} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="cnn_8x8,two_conv")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=1, help="epochs per run (default 1)")
    parser.add_argument("--trace", action="store_true", help="also time the no-conv trace cost")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, each repetition runs every "
        f"program once in a shuffled order from empty compilation caches.\n",
        flush=True,
    )
    shuffler = random.Random(0)
    for name in filter(None, args.workloads.split(",")):
        setup = SETUPS[name]()
        runs = bench(setup, args.epochs, args.reps, shuffler, log)
        print(table(setup, runs, args.epochs, args.reps), "\n", flush=True)
    if args.trace:
        print(
            "Trace cost of the wrapper on steps without convolutions (plan probe + chunk "
            f"runner trace, ms, medians of {args.reps})\n\n"
            "| workload | runner as it is | wrapped | extra ms | ratio |\n|---|---:|---:|---:|---:|"
        )
        for name in ("mlp_digits", "vae", "lm_200"):
            print(trace_cost(name, args.reps), flush=True)


if __name__ == "__main__":
    main()
