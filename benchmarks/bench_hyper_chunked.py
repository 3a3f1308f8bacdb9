"""Chunked heads vs one head per tensor: training-step cost and hypernetwork size.

All hypernetworks share the trunk and the target (an MLP 64→256→256→10, 85,002 generated
parameters) and differ only in their heads:

- ``HyperHeads``: one ``(d_k, n_t)`` head per target tensor (``hyper.Hypernetwork``'s
  default);
- ``ChunkedHeads``: one shared layer generating the flat vector in chunks of ``chunk_size``
  (``hyper.Hypernetwork(..., chunk_size=...)``), for several chunk sizes.

Each step generates ``--nets`` networks from as many embeddings (``jax.vmap``) and runs each
on the same batch of inputs. Two workloads: generating the params and running the targets
(forward), and a training step (``value_and_grad`` of a loss on the targets' outputs with
respect to the hypernetwork's params). Runs are paired and interleaved in one process (the
order rotates each round); the table reports median ms, the median of the per-round ratios
chunked / HyperHeads (> 1: the chunked heads are slower), and each hypernetwork's
compression ratio (its own params, trunk included, over the 85,002 it generates).

Run: ``.venv/bin/python benchmarks/bench_hyper_chunked.py [--nets 64] [--rounds 20]
[--chunks 256,1024,4096]``
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from bench_hyper import time_call  # the same timing as the per-tensor heads' benchmark
from bench_train import MLP  # the same target MLP as the training benchmark
from flax import nnx

from nnxscan.pure import hyper

WORKLOADS = ("generate + run target", "training step (value_and_grad)")


def compiled_workloads(hnet, zs, x, y):
    """The jitted workloads of one hypernetwork, as functions of its Params."""
    graphdef, params, rest = nnx.split(hnet, nnx.Param, ...)

    def outputs(params):
        net = nnx.merge(graphdef, params, rest)
        return jax.vmap(lambda z: net(z, x))(zs)

    def loss(params):
        return jnp.mean((outputs(params) - y) ** 2)

    return params, {
        WORKLOADS[0]: jax.jit(outputs),
        WORKLOADS[1]: jax.jit(jax.value_and_grad(loss)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", type=int, default=64, help="generated networks per step")
    parser.add_argument("--features", type=int, default=64, help="trunk features d_k")
    parser.add_argument("--batch", type=int, default=32, help="inputs per network")
    parser.add_argument("--rounds", type=int, default=20, help="paired timing rounds")
    parser.add_argument(
        "--chunks", default="256,1024,4096", help="comma-separated chunk sizes to compare"
    )
    args = parser.parse_args()

    target = MLP([64, 256, 256, 10], rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    zs = jnp.asarray(rng.normal(size=(args.nets, 16)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(args.batch, 64)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(args.nets, args.batch, 10)), jnp.float32)

    def build(chunk_size):
        trunk = nnx.Sequential(nnx.Linear(16, args.features, rngs=nnx.Rngs(1)), nnx.tanh)
        return hyper.Hypernetwork(
            target, trunk, args.features, chunk_size=chunk_size, rngs=nnx.Rngs(2)
        )

    contenders = {"HyperHeads": build(None)}
    for chunk in (int(c) for c in args.chunks.split(",")):
        contenders[f"ChunkedHeads, chunk_size {chunk}"] = build(chunk)
    ratios = {name: hnet.compression_ratio for name, hnet in contenders.items()}
    compiled = {name: compiled_workloads(h, zs, x, y) for name, h in contenders.items()}
    names = list(contenders)
    size = contenders["HyperHeads"].spec.size

    times = {(n, w): [] for n in names for w in WORKLOADS}
    for w in WORKLOADS:
        for n in names:  # compile and warm up
            params, fns = compiled[n]
            for _ in range(3):
                time_call(fns[w], params)
        for r in range(args.rounds):
            shift = r % len(names)
            for n in names[shift:] + names[:shift]:
                params, fns = compiled[n]
                times[n, w].append(time_call(fns[w], params))

    print(
        f"{args.nets} generated MLPs 64→256→256→10 ({size:,} params each), trunk features "
        f"{args.features}, {args.batch} inputs per network; jax {jax.__version__}, "
        f"{jax.devices()[0].platform}, median of {args.rounds} paired rounds.\n"
    )
    print("| heads | compression ratio | " + " | ".join(f"{w} (ms)" for w in WORKLOADS) + " | "
          + " | ".join(f"{w}: ratio" for w in WORKLOADS) + " |")  # fmt: skip
    print("|---|---:|" + "---:|" * (2 * len(WORKLOADS)))
    base = names[0]
    for n in names:
        cells = [f"{statistics.median(times[n, w]):.1f}" for w in WORKLOADS]
        for w in WORKLOADS:
            pairs = zip(times[base, w], times[n, w], strict=True)
            cells.append(f"{statistics.median(c / b for b, c in pairs):.2f}×")
        print(f"| {n} | {ratios[n]:.3g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
