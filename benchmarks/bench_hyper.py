"""Structured HyperHeads vs one big output layer + unravel, for a batch of generated networks.

Both hypernetworks share the trunk and the target (an MLP 64→256→256→10, 85k generated
parameters); they differ only in the output layer:

- structured: ``hyper.HyperHeads``, one ``(d_k, n_t)`` head per target tensor (reshaped);
- big layer:  one ``nnx.Linear(d_k, spec.size)`` whose output ``spec.unravel`` cuts up.

Each step generates ``--nets`` networks from as many embeddings (``jax.vmap``) and runs each
on the same batch of inputs. Three workloads: generating the params only; generating them and
running the target; and a training step's ``value_and_grad`` of a loss on the targets' outputs
with respect to the hypernetwork's params (trunk and output layer). Runs are paired and interleaved
in one process (the order alternates each round); the table reports median ms and the
median of the per-round ratios big layer / structured (> 1: the structured heads are faster).

Run: ``.venv/bin/python benchmarks/bench_hyper.py [--nets 64] [--rounds 30]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_train import MLP  # the same target MLP as the training benchmark
from flax import nnx

from nnxscan.pure import hyper


class BigLayerHypernet(nnx.Module):
    """trunk -> one Linear(d_k, spec.size) -> spec.unravel."""

    def __init__(self, spec, trunk, features, *, rngs):
        self.trunk = trunk
        self.out = nnx.Linear(features, spec.size, rngs=rngs)

    def generate(self, spec, z):
        return spec.unravel(self.out(self.trunk(z)))


class StructuredHypernet(nnx.Module):
    """trunk -> HyperHeads."""

    def __init__(self, spec, trunk, features, *, rngs):
        self.trunk = trunk
        self.heads = hyper.HyperHeads(spec, features, rngs=rngs)

    def generate(self, spec, z):
        return self.heads(self.trunk(z))


WORKLOADS = (
    "generate params",
    "generate + run target",
    "training step (value_and_grad)",
)


def compiled_workloads(model, spec, zs, x, y):
    """The jitted workloads of one hypernetwork, as functions of its state."""
    graphdef, state = nnx.split(model)

    def params(state):
        net = nnx.merge(graphdef, state)
        return jax.vmap(lambda z: net.generate(spec, z))(zs)

    def outputs(state):
        net = nnx.merge(graphdef, state)
        return jax.vmap(lambda z: hyper.call(spec, net.generate(spec, z), x))(zs)

    def loss(state):
        return jnp.mean((outputs(state) - y) ** 2)

    return state, {
        WORKLOADS[0]: jax.jit(params),
        WORKLOADS[1]: jax.jit(outputs),
        WORKLOADS[2]: jax.jit(jax.value_and_grad(loss)),
    }


def time_call(fn, state):
    start = time.perf_counter()
    jax.block_until_ready(fn(state))
    return (time.perf_counter() - start) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", type=int, default=64, help="generated networks per step")
    parser.add_argument("--features", type=int, default=64, help="trunk features d_k")
    parser.add_argument("--batch", type=int, default=32, help="inputs per network")
    parser.add_argument("--rounds", type=int, default=30, help="paired timing rounds")
    args = parser.parse_args()

    target = MLP([64, 256, 256, 10], rngs=nnx.Rngs(0))
    spec = hyper.ParamSpec.from_module(target)
    rng = np.random.default_rng(0)
    zs = jnp.asarray(rng.normal(size=(args.nets, 16)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(args.batch, 64)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(args.nets, args.batch, 10)), jnp.float32)

    def trunk(seed):
        return nnx.Sequential(nnx.Linear(16, args.features, rngs=nnx.Rngs(seed)), nnx.tanh)

    contenders = {
        "structured HyperHeads": StructuredHypernet(
            spec, trunk(1), args.features, rngs=nnx.Rngs(2)
        ),
        "big layer + unravel": BigLayerHypernet(spec, trunk(1), args.features, rngs=nnx.Rngs(2)),
    }
    compiled = {name: compiled_workloads(m, spec, zs, x, y) for name, m in contenders.items()}
    names = list(contenders)
    workloads = WORKLOADS

    times = {(n, w): [] for n in names for w in workloads}
    for w in workloads:
        for n in names:  # compile and warm up
            state, fns = compiled[n]
            for _ in range(3):
                time_call(fns[w], state)
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                state, fns = compiled[n]
                times[n, w].append(time_call(fns[w], state))

    print(
        f"{args.nets} generated MLPs 64→256→256→10 ({spec.size:,} params each), trunk "
        f"features {args.features}, {args.batch} inputs per network; jax {jax.__version__}, "
        f"{jax.devices()[0].platform}, median of {args.rounds} paired rounds.\n"
    )
    print("| workload | structured HyperHeads (ms) | big layer + unravel (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for w in workloads:
        structured, big = times[names[0], w], times[names[1], w]
        ratio = statistics.median(b / s for s, b in zip(structured, big, strict=True))
        print(
            f"| {w} | {statistics.median(structured):.1f} | {statistics.median(big):.1f} "
            f"| {ratio:.2f}× |"
        )


if __name__ == "__main__":
    main()
