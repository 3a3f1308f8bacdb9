"""The accelerator set: per-step and per-call costs of a scanned training step, and
populations, on whatever backend JAX runs (a TPU, a GPU, or the CPU), in one process.

    python benchmarks/bench_accel.py                 # every workload, the population
    python benchmarks/bench_accel.py --only small    # one workload
    python benchmarks/bench_accel.py --variant nnx.scan --variant fit  # and the floor
    python benchmarks/bench_accel.py --population-only

Per workload (the small MLP 64-64-64-10, the compute-bound MLP 784-512-512-10, the Flax
MNIST tutorial's CNN on 8x8 inputs, the byte-level transformer of ``_workloads``) and per
variant, every variant training the same math (the workload's loss, Adam, one step per
batch):

  floor       a hand-written ``jax.jit(lax.scan)`` over batches stacked on the device, the
              step written with ``nnx.split``/``nnx.merge`` (the same math as nnxscan's),
              carry donated
  floor, shuffled  the same scan over a shuffled epoch: ``jax.random.permutation`` and the
              gather of every batch in the program, before the loop (PureJaxRL's way):
              the floor of what ``fit`` computes
  floor, not donated  the floor's program called without donating its carry (as
              ``nnx.jit`` calls ``nnx.scan``'s): does donation set XLA:TPU's schedule?
  nnx.scan    Flax's ``nnx.scan`` inside ``nnx.jit``, model and optimizer as ``nnx.Carry``
  scan_steps  ``jax.jit(nnxscan.pure.scan_steps)`` over the same stacked batches
  scan_steps, not donated  the same, its carry not donated
  scan_train  ``nnxscan.shell.scan_train`` over the same stacked batches
  fit         ``Trainer.fit(epochs=1)`` over the flat data (shuffled: it gathers its batches)

each call of ``n`` steps is timed whole (dispatch to results ready) for three ``n``, rounds
interleaved in a shuffled order; ``time(n) = a + b*n`` is fitted to the medians: ``a`` is a
call's fixed cost, ``b`` a step's. On a non-CPU backend the device time of a call (the
profiler's XLA module time) is reported too: the in-program cost of a step, free of the
host's noise. Ratios are to the floor.

``--population``: building N members of the digits MLP (64-128-128-10, Adam) for N = 1 and
the largest N, and the whole run (build, compile, 5 epochs) of N members against one warm
``Trainer.fit`` of the same member (times N: N sequential warm runs).
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx

# Python -P (PYTHONSAFEPATH, as the accelerator's set-up sets it) leaves this folder off the path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workloads import ByteLM, next_byte_loss, source_windows
from bench_epoch import nnx_scan_epoch
from bench_train import MLP, TutorialCNN  # no BatchNorm, no Dropout: nothing drawn

from nnxscan.pure import init_opt_state, make_train_step, scan_steps
from nnxscan.shell import Population, Trainer, scan_train

# -- workloads ----------------------------------------------------------------------------------


def xent(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def lm_loss(model, batch):
    return next_byte_loss(model, batch["tokens"])


def _classes(shape, n, rng):
    return {
        "x": rng.normal(size=(n, *shape)).astype(np.float32),
        "y": rng.integers(0, 10, n).astype(np.int32),
    }


# name: (build, loss, batch size, data(n examples), sizes on an accelerator, on the CPU)
WORKLOADS = {
    "small": (lambda: MLP([64, 64, 64, 10], rngs=nnx.Rngs(0)), xent, 32,
              lambda n, rng: _classes((64,), n, rng), (32, 512, 4096), (16, 128, 512)),
    "compute": (lambda: MLP([784, 512, 512, 10], rngs=nnx.Rngs(0)), xent, 128,
                lambda n, rng: _classes((784,), n, rng), (16, 128, 512), (4, 16, 64)),
    "cnn": (lambda: TutorialCNN(rngs=nnx.Rngs(0)), xent, 32,
            lambda n, rng: _classes((8, 8, 1), n, rng), (16, 128, 512), (4, 16, 64)),
    "lm": (lambda: ByteLM(rngs=nnx.Rngs(0)), lm_loss, 16,
           lambda n, rng: {"tokens": source_windows(n)}, (16, 64, 256), (2, 8, 32)),
}  # fmt: skip
TX = optax.adam(1e-3)


def variants(name: str, steps: int) -> dict[str, Callable[[], object]]:
    """Each variant's zero-argument call of ``steps`` steps (returns what to wait for)."""
    build, loss, batch, make, _, _ = WORKLOADS[name]
    rng = np.random.default_rng(0)
    flat = jax.device_put(make(steps * batch, rng), jax.devices()[0])
    stacked = jax.block_until_ready(
        jax.tree.map(lambda a: a.reshape(steps, batch, *a.shape[1:]), flat)
    )
    out: dict[str, Callable[[], object]] = {}

    # floor: a hand-written scan of the same math, the carry donated.
    graphdef, state = nnx.split(build())
    params, rest = nnx.split_state(state, nnx.Param, ...)
    floor_carry = [params, rest, TX.init(params)]

    def body(carry, b):
        params, rest, opt_state = carry

        def f(p):
            model = nnx.merge(graphdef, p, rest)
            return loss(model, b), nnx.state(model, nnx.Not(nnx.Param))

        (value, rest), grads = jax.value_and_grad(f, has_aux=True)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), rest, opt_state), value

    def floor(params, rest, opt_state, batches):
        (params, rest, opt_state), losses = jax.lax.scan(body, (params, rest, opt_state), batches)
        return params, rest, opt_state, losses

    floor_jit = jax.jit(floor, donate_argnums=(0, 1, 2))

    def run_floor():
        *floor_carry[:], losses = floor_jit(*floor_carry, stacked)
        return losses

    out["floor"] = run_floor

    # The same program with nothing donated, as nnx.jit calls it: Flax's nnx.scan runs
    # 0.81-0.95x the floor on three workloads with the same fusions in the same order; a
    # donated carry ties the loop's buffers to the arguments', which may limit XLA:TPU's
    # memory-space assignment. Measured beside the floor, this tells.
    kept_jit = jax.jit(floor)
    kept_carry = jax.tree.map(jax.numpy.copy, floor_carry)

    def run_kept():
        *kept_carry[:], losses = kept_jit(*kept_carry, stacked)
        return losses

    out["floor, not donated"] = run_kept

    # The floor of a shuffled epoch (what fit trains): the permutation drawn and the batches
    # gathered in the program before the scan, as PureJaxRL's minibatches are.
    def shuffled(params, rest, opt_state, flat, key):
        order = jax.random.permutation(key, steps * batch)
        batches = jax.tree.map(lambda a: a[order].reshape(steps, batch, *a.shape[1:]), flat)
        return floor(params, rest, opt_state, batches)

    shuffled_jit = jax.jit(shuffled, donate_argnums=(0, 1, 2))
    shuffled_carry = jax.tree.map(jax.numpy.copy, floor_carry)
    key = jax.random.key(0)

    def run_shuffled():
        *shuffled_carry[:], losses = shuffled_jit(*shuffled_carry, flat, key)
        return losses

    out["floor, shuffled"] = run_shuffled

    # Flax's nnx.scan.
    e_model = build()
    e_opt = nnx.Optimizer(e_model, TX, wrt=nnx.Param)

    nnx_epoch = nnx_scan_epoch(loss)

    out["nnx.scan"] = lambda: nnx_epoch(e_model, e_opt, stacked)

    # The pure core.
    step = make_train_step(loss, TX)
    p_graphdef, p_state = nnx.split(build())
    pure_carry = [p_state, init_opt_state(TX, p_state)]
    pure = jax.jit(lambda s, o, b: scan_steps(step, p_graphdef, s, o, b), donate_argnums=(0, 1))

    def run_pure():
        pure_carry[0], pure_carry[1], losses = pure(*pure_carry, stacked)
        return losses

    out["scan_steps"] = run_pure

    # The pure core called without donating its carry (as the floor, not donated).
    pure_kept = jax.jit(lambda s, o, b: scan_steps(step, p_graphdef, s, o, b))
    kept_pure_carry = jax.tree.map(jax.numpy.copy, [p_state, init_opt_state(TX, p_state)])

    def run_pure_kept():
        kept_pure_carry[0], kept_pure_carry[1], losses = pure_kept(*kept_pure_carry, stacked)
        return losses

    out["scan_steps, not donated"] = run_pure_kept

    st_model = build()
    st_opt = nnx.Optimizer(st_model, TX, wrt=nnx.Param)
    out["scan_train"] = lambda: scan_train(st_model, st_opt, loss, stacked)

    trainer = Trainer(build(), TX, loss)
    out["fit"] = lambda: trainer.fit(flat, epochs=1, batch_size=batch, progress=False).losses
    return out


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


def device_lines(run: Callable[[], object], calls: int = 3) -> list:
    """The profiler's device timelines (``XLA Modules``, ``XLA Ops``, ...) of ``calls``
    calls of ``run``: what the device planes of one trace hold."""
    from jax.profiler import ProfileData

    directory = tempfile.mkdtemp()
    jax.profiler.start_trace(directory)
    for _ in range(calls):
        timed(run)
    jax.profiler.stop_trace()
    (path,) = glob.glob(directory + "/**/*.xplane.pb", recursive=True)
    planes = ProfileData.from_file(path).planes
    return [line for plane in planes if plane.name.startswith("/device:") for line in plane.lines]


def device_seconds(run: Callable[[], object], calls: int = 3) -> float | None:
    """The profiler's XLA module time of one call (None on the CPU, which reports none)."""
    if jax.default_backend() == "cpu":
        return None
    lines = device_lines(run, calls)
    total = sum(
        ev.duration_ns for line in lines if line.name == "XLA Modules" for ev in line.events
    )
    return total / calls / 1e9


def bench_workload(name: str, reps: int, only: set[str] | None = None) -> list[str]:
    sizes = WORKLOADS[name][4 if jax.default_backend() != "cpu" else 5]
    runs = {n: variants(name, n) for n in sizes}
    names = [v for v in runs[sizes[0]] if only is None or v in only or v == "floor"]
    for n in sizes:
        for v in names:
            timed(runs[n][v])
            timed(runs[n][v])
    times: dict[str, dict[int, list[float]]] = {v: defaultdict(list) for v in names}
    for _ in range(reps):
        jobs = [(v, n) for v in names for n in sizes]
        random.shuffle(jobs)
        for v, n in jobs:
            times[v][n].append(timed(runs[n][v]))
    fits = {}
    for v in names:
        medians = [statistics.median(times[v][n]) for n in sizes]
        b, a = np.polyfit(np.array(sizes, float), np.array(medians), 1)
        fits[v] = (a, b, medians[-1])
    device = {v: device_seconds(runs[sizes[-1]][v]) for v in names}
    a0, b0 = fits["floor"][:2]
    d0 = device["floor"]
    rows = [
        f"\n### {name} ({jax.default_backend()}, n = {', '.join(map(str, sizes))} steps a call, "
        f"medians of {reps})\n",
        "| variant | per call a (ms) | per step b (µs) | b ÷ floor | a ÷ floor | device µs/step "
        "| device ÷ floor |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in names:
        a, b, _ = fits[v]
        dev = device[v]
        dev_cells = f"{dev / sizes[-1] * 1e6:.2f} | {dev / d0:.2f}" if dev is not None else "— | —"
        rows.append(
            f"| {v} | {a * 1e3:.2f} | {b * 1e6:.2f} | {b / b0:.2f} | {a / a0:.2f} | {dev_cells} |"
        )
    return rows


# -- populations --------------------------------------------------------------------------------


def population_rows(num_members: int, epochs: int) -> list[str]:
    from _workloads import digits

    images, labels = digits(1792)
    data = {"x": images.reshape(len(images), -1), "y": labels}
    data = jax.device_put(data, jax.devices()[0])
    model_fn = lambda rngs: MLP([64, 128, 128, 10], rngs=rngs)  # noqa: E731

    def build(n: int) -> float:
        start = time.perf_counter()
        population = Population(model_fn, TX, xent, seeds=range(n))
        jax.block_until_ready(jax.tree.leaves(population._owner.read()[1]))
        return time.perf_counter() - start

    build(1)  # the first build in a process compiles Flax's initialisers
    one = statistics.median(build(1) for _ in range(3))
    many = statistics.median(build(num_members) for _ in range(3))

    start = time.perf_counter()
    population = Population(model_fn, TX, xent, seeds=range(num_members))
    history = population.fit(data, epochs=epochs, batch_size=32, progress=False)
    whole = time.perf_counter() - start
    trainer = Trainer(model_fn(nnx.Rngs(0)), TX, xent)
    trainer.fit(data, epochs=epochs, batch_size=32, progress=False)  # warm
    warm, gaps = [], []
    for seed in range(3):
        trainer = Trainer(model_fn(nnx.Rngs(seed)), TX, xent)
        start = time.perf_counter()
        alone = trainer.fit(data, epochs=epochs, batch_size=32, seed=seed, progress=False)
        warm.append(time.perf_counter() - start)
        # member `seed` trains what a lone fit of that seed trains (docs/populations.md)
        ours, theirs = np.asarray(history.losses)[:, seed], np.asarray(alone.losses)
        gaps.append(float(np.max(np.abs(ours - theirs) / np.maximum(np.abs(theirs), 1e-6))))
    warm_fit = statistics.median(warm)
    losses = np.asarray(history.epochs[-1]["loss"])
    return [
        f"\n### population of the digits MLP 64-128-128-10 ({jax.default_backend()})\n",
        "| what | seconds | ratio |",
        "|---|---:|---:|",
        f"| build 1 member | {one:.3f} | 1.00 |",
        f"| build {num_members} members | {many:.3f} | {many / one:.2f} |",
        f"| whole run, {num_members} members x {epochs} epochs | {whole:.2f} | |",
        f"| one warm Trainer.fit x {num_members} | {warm_fit * num_members:.2f} | "
        f"{warm_fit * num_members / whole:.1f}x the population |",
        f"\nmembers 0-2 against their lone Trainer.fit, every step's loss: largest relative "
        f"difference {max(gaps):.2e}",
        f"\nlast epoch's loss over members: min {losses.min():.4f}, median "
        f"{np.median(losses):.4f}, max {losses.max():.4f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(WORKLOADS), help="workloads, comma-separated")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--variant", action="append", help="a variant to run (repeat it; default: all; the "
        "floor always)"
    )  # fmt: skip
    parser.add_argument("--population", action="store_true", help="also the population")
    parser.add_argument("--population-only", action="store_true")
    parser.add_argument("--members", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    print(f"# bench_accel: {jax.devices()}, jax {jax.__version__}, {platform.processor()}")
    if not args.population_only:
        for name in args.only.split(","):
            only = None if args.variant is None else set(args.variant)
            print("\n".join(bench_workload(name, args.reps, only)), flush=True)
    if args.population or args.population_only:
        print("\n".join(population_rows(args.members, args.epochs)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
