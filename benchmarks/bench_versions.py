"""Loop speed across jax releases: the jax 0.11.1 CPU dynamic-update-slice regression, and
whether nnxscan's own loops feel it.

jax/jaxlib 0.11.1 made a small dynamic-update-slice (a write of under ~480 bytes into a big
array) inside a loop body cost the whole buffer on XLA:CPU, every iteration: the
``fori_loop`` / ``scan`` accumulation idiom became quadratic in the trip count (reported by
QuantEcon, lecture-python-programming#622). nnxscan's loops carry the model state, gather
each batch from the data set by index and write one scalar loss per step into the stacked
losses, the small write that idiom makes. This times, in each virtual environment given:

  fori_4B_n10k, fori_4B_n100k   ``fori_loop`` writing row ``t + 1 = f(row t)`` of a
                                ``(n, 1)`` float32 buffer (4-byte rows): QuantEcon's loop
  fori_512B_n100k               the same with ``(n, 128)`` rows (512 bytes, above the
                                threshold)
  scan_ys_n100k                 ``lax.scan`` with a scalar carry stacking one scalar per step
                                (how ``scan_steps`` returns its losses)
  gather_n100k                  ``lax.scan`` reading row ``idx[i]`` of an ``(n, 64)`` buffer
                                into its carry, writing nothing (how an epoch takes batches)
  mlp_fit_200, mlp_fit_5000     ``Trainer.fit`` (scan plan) of bench_train's small MLP
                                (64→64→64→10, batch 32, adam): 5 epochs of 200 steps, and one
                                epoch of 5,000 steps (one compiled call writing 5,000 losses)
  lm_fit_200                    ``Trainer.fit`` (scan plan) of _workloads' byte-level
                                transformer LM (2 layers, width 128), one epoch of 200 steps
  tiny_fit_100k                 ``Trainer.fit`` (scan plan) of one ``nnx.Linear(8, 1)``, batch
                                8, sgd, one epoch of 100,000 steps in one call: the worst
                                case, a cheap step writing its loss into a long buffer

as µs per loop iteration (the first five) or per training step (the fit cases), compile
excluded (each case runs twice before it is timed; ``first_s`` is the first fit call,
compile included). Each environment runs in its own process; the driver runs them in
rounds, alternating the order (A B C, then C B A, ...), and reports the median over every
timing of every round, so slow drift of a shared machine hits all of them alike. Inside a
process every timing round runs the cases in a new shuffled order.

    python benchmarks/bench_versions.py --python .venv/bin/python --python .venv313/bin/python
    python benchmarks/bench_versions.py --quick          # tiny sizes, this interpreter only
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent

# A case builds ``(run, count)``: ``run()`` does the timed work once and blocks on its
# result; ``count`` is how many loop iterations or training steps one ``run()`` does.
Case = Callable[[bool], tuple[Callable[[], object], int]]


# -- loop idioms ------------------------------------------------------------------------------


def fori_rows(n: int, width: int) -> Case:
    def build(quick: bool):
        import jax
        import jax.numpy as jnp

        size = n // 100 if quick else n

        @jax.jit
        def run(x0):
            def body(t, buf):
                row = buf[t]
                return buf.at[t + 1].set(3.9 * row * (1 - row))

            buf = jnp.zeros((size, width), jnp.float32).at[0].set(x0)
            return jax.lax.fori_loop(0, size - 1, body, buf)

        x0 = jnp.full((width,), 0.1, jnp.float32)
        return (lambda: run(x0).block_until_ready()), size - 1

    return build


def scan_stacked_scalars(n: int) -> Case:
    def build(quick: bool):
        import jax
        import jax.numpy as jnp

        size = n // 100 if quick else n

        @jax.jit
        def run(x0):
            def body(x, _):
                x = 3.9 * x * (1 - x)
                return x, x

            return jax.lax.scan(body, x0, None, length=size)[1]

        x0 = jnp.float32(0.1)
        return (lambda: run(x0).block_until_ready()), size

    return build


def scan_gather_rows(n: int) -> Case:
    def build(quick: bool):
        import jax
        import jax.numpy as jnp
        import numpy as np

        size = n // 100 if quick else n
        data = jnp.asarray(np.random.default_rng(0).normal(size=(size, 64)), jnp.float32)
        idx = jnp.asarray(np.random.default_rng(1).permutation(size), jnp.int32)

        @jax.jit
        def run(data, idx):
            def body(carry, i):
                return 0.5 * carry + data[i], None

            return jax.lax.scan(body, jnp.zeros(64, jnp.float32), idx)[0]

        return (lambda: run(data, idx).block_until_ready()), size

    return build


# -- nnxscan's own loops ----------------------------------------------------------------------


def fit_case(workload: str, steps_per_epoch: int, epochs: int) -> Case:
    def build(quick: bool):
        import jax
        import numpy as np
        import optax
        from flax import nnx

        from nnxscan.shell import Trainer

        steps = min(steps_per_epoch, 4) if quick else steps_per_epoch
        if workload == "tiny":
            # The cheapest step there is, so the per-step write of the loss shows.
            rng = np.random.default_rng(0)
            x = rng.normal(size=(steps * 8, 8)).astype(np.float32)
            data = jax.device_put({"x": x, "y": x.sum(-1, keepdims=True)})
            make_model, tx, batch_size = (
                (lambda: nnx.Linear(8, 1, rngs=nnx.Rngs(0))),
                optax.sgd(1e-2),
                8,
            )

            def loss_fn(model, batch):
                return ((model(batch["x"]) - batch["y"]) ** 2).mean()

        elif workload == "mlp":
            from bench_train import loss_fn, make_case

            make_model, tx, batch_size, data, _ = make_case("small", steps)
        else:
            from _workloads import ByteLM, next_byte_loss, source_windows

            batch_size, tx, loss_fn = 16, optax.adam(1e-3), next_byte_loss
            data = jax.device_put(source_windows(steps * batch_size))
            make_model = lambda: ByteLM(rngs=nnx.Rngs(0))  # noqa: E731
        trainer = Trainer(make_model(), tx, loss_fn, execution="scan")

        def run():
            trainer.fit(data, epochs=epochs, batch_size=batch_size, progress=False)
            jax.block_until_ready(nnx.state(trainer.model))

        return run, steps * epochs

    return build


CASES: dict[str, Case] = {
    "fori_4B_n10k": fori_rows(10_000, 1),
    "fori_4B_n100k": fori_rows(100_000, 1),
    "fori_512B_n100k": fori_rows(100_000, 128),
    "scan_ys_n100k": scan_stacked_scalars(100_000),
    "gather_n100k": scan_gather_rows(100_000),
    "mlp_fit_200": fit_case("mlp", 200, 5),
    "mlp_fit_5000": fit_case("mlp", 5_000, 1),
    "lm_fit_200": fit_case("lm", 200, 1),
    "tiny_fit_100k": fit_case("tiny", 100_000, 1),
}
UNITS = {name: "µs/step" if "fit" in name else "µs/iter" for name in CASES}


def child(reps: int, quick: bool, names: list[str]) -> dict:
    """Times the cases ``names`` in this interpreter: ``{case: [µs per iteration or step]}``."""
    import flax
    import jax
    import optax

    runs, first = {}, {}
    for name in names:
        run, count = CASES[name](quick)
        start = time.perf_counter()
        run()  # compiles
        first[name] = time.perf_counter() - start
        run()
        runs[name] = (run, count)
    times: dict[str, list[float]] = {name: [] for name in runs}
    order, shuffler = list(runs), random.Random(0)
    for _ in range(reps):
        shuffler.shuffle(order)
        for name in order:
            run, count = runs[name]
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / count * 1e6)
    return {
        "label": f"jax {jax.__version__} · py{platform.python_version()}",
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxlib": importlib.metadata.version("jaxlib"),
            "flax": flax.__version__,
            "optax": optax.__version__,
        },
        "times": times,
        "first_s": first,
    }


def run_child(python: str, reps: int, quick: bool, names: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    cmd = [python, str(Path(__file__).resolve()), "--child", "--reps", str(reps)]
    cmd += ["--cases", ",".join(names)]
    cmd += ["--quick"] if quick else []
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{python} failed:\n{out.stdout}{out.stderr}")
    line = next(s for s in reversed(out.stdout.splitlines()) if s.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def table(results: list[dict], names: list[str]) -> str:
    labels = [r["label"] for r in results]
    base = results[0]["times"]
    lines = [
        "| case | unit | " + " | ".join(labels) + " |",
        "|---|---|" + "---:|" * len(labels),
    ]
    for name in names:
        cells = []
        for r in results:
            us = statistics.median(r["times"][name])
            ratio = us / statistics.median(base[name])
            cells.append(f"{us:,.3f} ({ratio:.2f}×)" if us < 10 else f"{us:,.0f} ({ratio:.2f}×)")
        lines.append(f"| {name} | {UNITS[name]} | " + " | ".join(cells) + " |")
    for name in (n for n in names if "fit" in n):
        cells = [f"{statistics.median(r['first_s'][name]):.1f}" for r in results]
        lines.append(f"| {name} first call | s | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="an interpreter (repeat)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per interpreter")
    parser.add_argument("--reps", type=int, default=5, help="timings per case per process")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks it runs")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--json", help="also write every timing to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.cases.split(",")
    if unknown := sorted(set(names) - set(CASES)):
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    if args.child:
        print("RESULT " + json.dumps(child(args.reps, args.quick, names)))
        return
    pythons = args.python or [sys.executable]
    merged: dict[str, dict] = {}
    load = [os.getloadavg()[0]]
    for round_index in range(args.rounds):
        ordered = pythons if round_index % 2 == 0 else pythons[::-1]
        for python in ordered:
            result = run_child(python, args.reps, args.quick, names)
            print(f"round {round_index}: {result['label']} done", file=sys.stderr, flush=True)
            into = merged.setdefault(python, {**result, "times": {}, "first_s": {}})
            for name, values in result["times"].items():
                into["times"].setdefault(name, []).extend(values)
                into["first_s"].setdefault(name, []).append(result["first_s"][name])
        load.append(os.getloadavg()[0])
    results = [merged[p] for p in pythons]
    print(
        f"Loop speed by jax release, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; medians of {args.rounds} processes × {args.reps} timings "
        f"(ratio to the first column); 1-min load average over the run "
        f"{min(load):.1f}–{max(load):.1f}\n"
    )
    print(table(results, names))
    for r in results:
        print(f"\n{r['label']}: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
