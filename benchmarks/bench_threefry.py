"""JAX's threefry hash on the CPU: its loop (JAX's CPU lowering) against the hash unrolled
(``nnxscan.pure.unrolled_threefry``, what every training loop of nnxscan applies there).

For each program, the plain ``jax.jit`` and the same function wrapped are lowered once and
compiled ``--reps`` times each from empty caches, interleaved in shuffled orders; each
compiled program then runs ``--runs`` times. Medians, and whether the outputs are bitwise
equal (the draws must be; a float program around them may round otherwise):

  dropout mask     ``jax.random.bernoulli`` of one 32x28x28x32 activation (the tutorial
                   CNN's first dropout), applied
  VAE noise        ``jax.random.normal`` of (64, 32), the Flax example VAE's
  tutorial step    the Flax NNX MNIST tutorial CNN's training step (two dropouts, 28x28
                   digits, batch 32, adamw): ``make_train_step`` jitted on its own

    python benchmarks/bench_threefry.py --reps 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _workloads import WORKLOADS, train_step
from bench_compile_parts import Captured
from bench_xla_options import leaves
from flax import nnx

from nnxscan.pure.threefry import unrolled_threefry


def dropout_mask():
    def fn(key, x):
        return jnp.where(jax.random.bernoulli(key, 0.975, x.shape), x / 0.975, 0.0)

    return fn, (jax.random.key(0), jnp.ones((32, 28, 28, 32), jnp.float32))


def vae_noise():
    def fn(key, mean):
        return mean + jax.random.normal(key, mean.shape)

    return fn, (jax.random.key(0), jnp.zeros((64, 32), jnp.float32))


def tutorial_step():
    """The tutorial's ``train_step`` in split/merge form, as ``jax.jit`` takes it."""
    w = WORKLOADS["cnn_28x28"](False)
    graphdef, state = nnx.split(w.nodes())  # (model, optimizer, metrics, rngs)

    def fn(state, batch):
        nodes = nnx.merge(graphdef, state)
        train_step(*nodes, batch)
        return nnx.state(nodes)

    return fn, (state, {k: v[: w.batch_size] for k, v in w.data.items()})


PROGRAMS = {"dropout mask": dropout_mask, "VAE noise": vae_noise, "tutorial step": tutorial_step}


def measure(capture: Captured, fn, args, reps: int, runs: int, shuffler: random.Random) -> dict:
    variants = {"JAX's loop": jax.jit(fn), "unrolled": jax.jit(unrolled_threefry(fn))}
    modules = {name: capture.largest(lambda f=f: f.lower(*args).compile())
               for name, f in variants.items()}  # fmt: skip
    compiled = {name: f.lower(*args).compile() for name, f in variants.items()}
    compile_s = {name: [] for name in variants}
    order = list(variants)
    for _ in range(reps):
        shuffler.shuffle(order)
        for name in order:
            compile_s[name].append(capture.seconds(modules[name]))
    run_s = {name: [] for name in variants}
    outs = {name: jax.block_until_ready(compiled[name](*args)) for name in variants}
    for _ in range(runs):
        shuffler.shuffle(order)
        for name in order:
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            run_s[name].append(time.perf_counter() - start)
    same = all(
        np.array_equal(a, b)
        for a, b in zip(leaves(outs["JAX's loop"]), leaves(outs["unrolled"]), strict=True)
    )
    return {
        name: (statistics.median(compile_s[name]), statistics.median(run_s[name]), same)
        for name in variants
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="compiles of each program")
    parser.add_argument("--runs", type=int, default=20, help="runs of each compiled program")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    shuffler = random.Random(0)
    capture = Captured()  # before anything compiles
    print(f"jax {jax.__version__}, {jax.default_backend()}; medians of {args.reps} compiles "
          f"and {args.runs} runs\n")  # fmt: skip
    print("| program | threefry | XLA compile s | run ms | bitwise the other's |")
    print("|---|---|---:|---:|---|")
    for name, make in PROGRAMS.items():
        fn, fn_args = make()
        for variant, (secs, run, same) in measure(
            capture, fn, fn_args, args.reps, args.runs, shuffler
        ).items():
            print(f"| {name} | {variant} | {secs:.3f} | {1e3 * run:.2f} | "
                  f"{'yes' if same else 'no'} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
