"""Training speed: per-step NNX loops vs a hand-written pure-JAX scan vs nnxscan.

Runs, in one process and interleaved (every method once per round, in a shuffled order
each round), five epochs of the same batches with:

  A  per-step ``nnx.jit`` loop with ``nnx.Optimizer`` (the NNX tutorial loop)
  B  ``nnx.split``/``nnx.merge`` + ``jax.jit`` per step, state donated
  C  hand-written pure-JAX ``lax.scan`` over plain pytrees with optax (the floor)
  E  Flax's own ``nnx.scan`` over the epoch's batches stacked on the device (model and
     optimizer as ``nnx.Carry``), one ``nnx.jit`` call per epoch
  D  ``Trainer.fit`` with ``execution="auto"``
  D:scan / D:unrolled / D:step  ``Trainer.fit`` with each plan forced

and prints median µs/step and the ratio to C (and to the fastest). Every method trains on
the same device-resident batches; A and B get their batches pre-cut on the device, so the
comparison is about the loop, not the data path.

    python benchmarks/bench_train.py --case all
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_epoch import nnx_scan_epoch
from flax import nnx

from nnxscan.shell import Trainer

# Each timing trains this many epochs (D: one fit(epochs=EPOCHS) call, as users call it).
EPOCHS = 5

# -- models -------------------------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, sizes: list[int], *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


class TutorialCNN(nnx.Module):
    """The Flax NNX MNIST tutorial's CNN, sized for 8x8 digits (2x2x64 after two pools)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(2 * 2 * 64, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        pool = lambda h: nnx.avg_pool(h, window_shape=(2, 2), strides=(2, 2))  # noqa: E731
        x = pool(nnx.relu(self.conv1(x)))
        x = pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def pure_mlp_loss(params, batch):
    """The same MLP as a plain function of a list of (kernel, bias) pairs."""
    x = batch["x"]
    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, batch["y"]).mean()


def pure_cnn_loss(params, batch):
    def conv(x, w, b):
        y = jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return y + b

    def pool(h):
        return jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0

    (w1, b1), (w2, b2), (w3, b3), (w4, b4) = params
    x = pool(jax.nn.relu(conv(batch["x"], w1, b1)))
    x = pool(jax.nn.relu(conv(x, w2, b2)))
    x = x.reshape(x.shape[0], -1)
    logits = jax.nn.relu(x @ w3 + b3) @ w4 + b4
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


# -- cases --------------------------------------------------------------------------------------


def make_case(name: str, steps: int):
    rng = np.random.default_rng(0)
    if name == "small":
        sizes, batch, tx = [64, 64, 64, 10], 32, optax.adam(1e-3)
        x = rng.normal(size=(steps * batch, 64)).astype(np.float32)
        build = lambda: MLP(sizes, rngs=nnx.Rngs(0))  # noqa: E731
        pure_loss = pure_mlp_loss
    elif name == "compute":
        sizes, batch, tx = [784, 512, 512, 10], 128, optax.adam(1e-3)
        x = rng.normal(size=(steps * batch, 784)).astype(np.float32)
        build = lambda: MLP(sizes, rngs=nnx.Rngs(0))  # noqa: E731
        pure_loss = pure_mlp_loss
    elif name == "cnn":
        batch, tx = 32, optax.adamw(1e-3)
        x = rng.normal(size=(steps * batch, 8, 8, 1)).astype(np.float32)
        build = lambda: TutorialCNN(rngs=nnx.Rngs(0))  # noqa: E731
        pure_loss = pure_cnn_loss
    else:
        raise ValueError(name)
    y = rng.integers(0, 10, len(x)).astype(np.int32)
    data = jax.device_put({"x": x, "y": y})
    return build, tx, batch, data, pure_loss


def pure_params(model) -> list:
    """(kernel, bias) pairs in layer order, as plain arrays."""
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Linear | nnx.Conv)]
    return [(jnp.array(m.kernel[...]), jnp.array(m.bias[...])) for m in layers]


def methods(name: str, steps: int) -> dict[str, Callable[[], float]]:
    """Each method: a zero-arg callable that trains one epoch and returns seconds taken."""
    build, tx, batch, data, pure_loss = make_case(name, steps)
    n = steps * batch
    perm = np.asarray(jax.random.permutation(jax.random.key(0), n)).reshape(steps, batch)
    batches = [jax.tree.map(lambda a, i=i: a[perm[i]], data) for i in range(steps)]
    jax.block_until_ready(batches)

    # A: the NNX tutorial loop.
    model_a = build()
    opt_a = nnx.Optimizer(model_a, tx, wrt=nnx.Param)

    @nnx.jit
    def step_a(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    def run_a():
        t = time.perf_counter()
        for b in batches * EPOCHS:
            loss = step_a(model_a, opt_a, b)
        jax.block_until_ready(loss)
        return time.perf_counter() - t

    # B: split/merge + jax.jit, donated.
    graphdef_b, state_b = nnx.split(build())
    params_b = nnx.state(nnx.merge(graphdef_b, state_b), nnx.Param)
    carry_b = [state_b, tx.init(params_b)]

    @jax.jit
    def step_b_inner(state, opt_state, batch):
        params, rest = nnx.split_state(state, nnx.Param, ...)

        def f(p):
            return loss_fn(nnx.merge(graphdef_b, p, rest), batch)

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return nnx.merge_state(optax.apply_updates(params, updates), rest), opt_state, loss

    step_b = jax.jit(step_b_inner, donate_argnums=(0, 1))

    def run_b():
        t = time.perf_counter()
        for b in batches * EPOCHS:
            carry_b[0], carry_b[1], loss = step_b(carry_b[0], carry_b[1], b)
        jax.block_until_ready(loss)
        return time.perf_counter() - t

    # C: hand-written pure JAX: plain pytrees, optax, one scan per epoch, donated.
    params_c = pure_params(build())
    carry_c = [params_c, tx.init(params_c)]

    def epoch_c(params, opt_state, data, key):
        idx = jax.random.permutation(key, n)[: steps * batch].reshape(steps, batch)

        def body(carry, i):
            params, opt_state = carry
            b = jax.tree.map(lambda a: a[i], data)
            loss, grads = jax.value_and_grad(pure_loss)(params, b)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), idx)
        return params, opt_state, losses

    epoch_c = jax.jit(epoch_c, donate_argnums=(0, 1))
    key = jax.random.key(0)

    def run_c():
        t = time.perf_counter()
        for _ in range(EPOCHS):
            carry_c[0], carry_c[1], losses = epoch_c(carry_c[0], carry_c[1], data, key)
        jax.block_until_ready(losses)
        return time.perf_counter() - t

    # E: Flax's own scan: nnx.scan over the stacked batches, model and optimizer carried.
    model_e = build()
    opt_e = nnx.Optimizer(model_e, tx, wrt=nnx.Param)
    stacked = jax.block_until_ready(jax.tree.map(lambda *b: jnp.stack(b), *batches))

    epoch_e = nnx_scan_epoch(loss_fn)

    def run_e():
        t = time.perf_counter()
        for _ in range(EPOCHS):
            losses = epoch_e(model_e, opt_e, stacked)
        jax.block_until_ready(losses)
        return time.perf_counter() - t

    out = {
        "A nnx.jit per step": run_a,
        "B split/merge+jit": run_b,
        "C pure-JAX scan": run_c,
        "E nnx.scan, stacked batches": run_e,
    }

    # D: Trainer.fit, auto and each plan.
    for execution in ["auto", "scan", "unrolled", "step"]:
        trainer = Trainer(build(), tx, loss_fn, execution=execution)

        def run_d(trainer=trainer):
            t = time.perf_counter()
            trainer.fit(data, epochs=EPOCHS, batch_size=batch, progress=False)
            return time.perf_counter() - t

        label = "D Trainer.fit (auto: {})" if execution == "auto" else f"D:{execution}"
        if execution == "auto":
            label = label.format(trainer.plan_for(data, batch).kind)
        out[label] = run_d
    return out


def bench(name: str, steps: int, reps: int) -> dict[str, float]:
    runs = methods(name, steps)
    for run in runs.values():  # compile and warm up
        run()
        run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    shuffler = random.Random(0)
    for _ in range(reps):
        # Every method once per round, in a new order each round, so no method always
        # follows the same neighbour (cache and frequency effects).
        shuffler.shuffle(order)
        for label in order:
            times[label].append(runs[label]() / (EPOCHS * steps) * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


CASES = {
    "small": ("small MLP 64→64→64→10, batch 32, adam", 200),
    "compute": ("compute-bound MLP 784→512→512→10, batch 128, adam", 40),
    "cnn": ("NNX tutorial CNN on 8×8 digits, batch 32, adamw", 40),
}


def table(name: str, result: dict[str, float]) -> str:
    floor = result["C pure-JAX scan"]
    best = min(result.values())
    lines = [
        f"**{CASES[name][0]}** ({CASES[name][1]} steps/epoch, {EPOCHS} epochs per timing)",
        "",
        "| method | median µs/step | ÷ C | ÷ fastest |",
        "|---|---:|---:|---:|",
    ]
    for label, us in result.items():
        lines.append(f"| {label} | {us:,.0f} | {us / floor:.2f}× | {us / best:.2f}× |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="all", choices=["all", *CASES])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", help="also write the medians to this file")
    args = parser.parse_args()
    cases = list(CASES) if args.case == "all" else [args.case]
    cpu = platform.processor() or platform.machine()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {cpu}")
    results = {}
    for name in cases:
        results[name] = bench(name, CASES[name][1], args.reps)
        print(table(name, results[name]), "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
