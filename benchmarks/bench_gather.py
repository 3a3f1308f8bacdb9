"""Gathering rows on XLA:CPU: as they are, or through a byte view (``take_rows``).

XLA:CPU gathers a row of few elements element by element; the same row viewed as bytes has
``itemsize`` times as many elements and gathers at memory speed. This times, for float32
rows of 16 to 1,024 elements (64 B to 4 KiB), a random permutation of 16 MiB of rows cut
into ``(steps, 32)`` batches (what an epoch's gather does), interleaved in one process,
medians of ``--reps``:

  plain   ``jnp.take(x, indices, axis=0)``
  bytes   ``nnxscan.pure.batching.take_rows(x, indices)`` (the byte view below 128
          elements a row; above it, the plain gather)
  view    the byte view forced at every row size (what the rule decides against)

    python benchmarks/bench_gather.py --reps 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from nnxscan.pure.batching import take_rows

TOTAL_BYTES = 16 * 2**20


def forced_view(x: jax.Array, indices: jax.Array) -> jax.Array:
    rows = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1)
    taken = jnp.take(rows, indices, axis=0)
    return jax.lax.bitcast_convert_type(taken.reshape(*taken.shape[:-1], -1, 4), x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    variants = {
        "plain": jax.jit(lambda x, i: jnp.take(x, i, axis=0)),
        "bytes": jax.jit(take_rows),
        "view": jax.jit(forced_view),
    }
    print(f"jax {jax.__version__}, {jax.default_backend()}, 16 MiB of rows, medians of "
          f"{args.reps}\n")  # fmt: skip
    print("| row | plain ms | take_rows ms | forced byte view ms | take_rows ÷ plain |")
    print("|---|---:|---:|---:|---:|")
    for width in (16, 32, 64, 128, 256, 1024):
        n = TOTAL_BYTES // (width * 4)
        x = jnp.asarray(np.random.default_rng(0).normal(size=(n, width)).astype(np.float32))
        order = np.random.default_rng(1).permutation(n).astype(np.int32).reshape(-1, 32)
        indices = jnp.asarray(order)
        want = np.asarray(x)[order]
        times: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():  # compile, and check: the same rows
            np.testing.assert_array_equal(jax.block_until_ready(fn(x, indices)), want)
        for rep in range(args.reps):
            names = list(variants)[:: 1 if rep % 2 else -1]
            for name in names:
                start = time.perf_counter()
                jax.block_until_ready(variants[name](x, indices))
                times[name].append((time.perf_counter() - start) * 1e3)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"| {width} float32 ({width * 4} B) | {med['plain']:.2f} | {med['bytes']:.2f} | "
              f"{med['view']:.2f} | {med['bytes'] / med['plain']:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
