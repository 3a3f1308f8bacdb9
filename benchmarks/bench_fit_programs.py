"""What a fit compiles: programs, XLA compile seconds and the whole fit, per scenario.

Each scenario runs in a new process (empty caches; the model is built, and its initializers
compiled, before the clock starts), counting every XLA compile through ``jax.monitoring``
with its program's name. To compare two checkouts, give ``--python`` one interpreter per
checkout (each an editable install): the scenarios then run interleaved, the checkouts in
turn, ``--reps`` times, and the report gives medians and after ÷ before.

    python benchmarks/bench_fit_programs.py
    python benchmarks/bench_fit_programs.py --python ../base/.venv/bin/python,.venv/bin/python
    python benchmarks/bench_fit_programs.py --compile-cache /tmp/cache   # a second run

Scenarios (MLPs on random data, adam):

  digits_30     64→128→128→10, 1,408 examples, batch 32, fit(epochs=30): one fused call
  compute_rest  784→512→512→10, 4,000 examples, batch 128, fit(epochs=3): 93 fused steps,
                their gathers cut in chunks that leave a rest
  digits_300    digits_30's, fit(epochs=300): more than FUSED_STEPS steps
  eval_every    digits_30's, fit(epochs=10, eval_every=4, eval_data=...)
  notebook      digits_30's, fit(epochs=1) then fit(epochs=5)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time

SCENARIOS = ("digits_30", "compute_rest", "digits_300", "eval_every", "notebook")


def run_scenario(name: str, cache: str | None = None) -> dict:
    """Runs one scenario in this process (with JAX's persistent compilation cache in
    ``cache``, if given); returns its counts and seconds."""
    if cache:
        from nnxscan.shell import enable_compilation_cache

        enable_compilation_cache(cache)
    import jax
    import jax.monitoring
    import numpy as np
    import optax
    from flax import nnx

    from nnxscan.shell import Trainer

    compiles: list[tuple[str, float]] = []

    def on_event(event: str, secs: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((str(kwargs.get("fun_name", "?")), secs))

    class MLP(nnx.Module):
        def __init__(self, sizes, rngs):
            self.layers = nnx.List(
                [nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)]
            )

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = nnx.relu(layer(x))
            return self.layers[-1](x)

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def metric_fn(model, batch):  # one function for both fits: one evaluation program
        return {"loss": loss_fn(model, batch)}

    rng = np.random.default_rng(0)
    compute = name == "compute_rest"
    sizes = (784, 512, 512, 10) if compute else (64, 128, 128, 10)
    n, batch_size = (4000, 128) if compute else (1408, 32)
    data = {
        "x": rng.normal(size=(n, sizes[0])).astype(np.float32),
        "y": rng.integers(0, 10, n).astype(np.int32),
    }
    model = MLP(sizes, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    jax.block_until_ready(nnx.state(model))
    jax.monitoring.register_event_duration_secs_listener(on_event)
    started = time.perf_counter()
    trainer = Trainer(model, optimizer, loss_fn)
    options = dict(batch_size=batch_size, progress=False)

    def fit() -> None:
        if name == "digits_300":
            trainer.fit(data, epochs=300, **options)
        elif name == "eval_every":
            trainer.fit(
                data, epochs=10, eval_every=4, eval_data=data, metric_fn=metric_fn, **options
            )
        elif name == "notebook":
            trainer.fit(data, epochs=1, **options)
            trainer.fit(data, epochs=5, **options)
        else:
            trainer.fit(data, epochs=3 if compute else 30, **options)
        jax.block_until_ready(nnx.state(model))

    fit()
    whole = time.perf_counter() - started
    fit_compiles = compiles[:]  # the fit's; the loss below compiles eagerly
    started = time.perf_counter()
    fit()  # the same fit again, compiled: its steady time
    steady = time.perf_counter() - started
    loss = float(loss_fn(model, {k: v[:256] for k, v in data.items()}))
    return {
        "whole_s": whole,
        "steady_s": steady,
        "programs": len(fit_compiles),
        "compile_s": sum(s for _, s in fit_compiles),
        "names": sorted(f for f, _ in fit_compiles),
        "loss": loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--python", default=sys.executable, help="comma-separated interpreters")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="every process with the persistent compilation cache in DIR (one per checkout: "
        "DIR/0, DIR/1, ...); the first repetition fills it, the report is of the others",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process's scenario
    parser.add_argument("--cache", help=argparse.SUPPRESS)  # a child process's cache
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_scenario(args.one, args.cache)))
        return
    pythons = args.python.split(",")
    results: dict = {}
    for rep in range(args.reps + bool(args.compile_cache)):
        for name in args.scenarios.split(","):
            for i, python in enumerate(pythons):
                command = [python, __file__, "--one", name]
                if args.compile_cache:
                    command += ["--cache", f"{args.compile_cache}/{i}"]
                out = subprocess.run(command, capture_output=True, text=True, check=True)
                if rep or not args.compile_cache:  # a cache's first run fills it
                    run = json.loads(out.stdout.splitlines()[-1])
                    results.setdefault((name, python), []).append(run)
    print(
        "| scenario | checkout | programs | XLA compile s | whole fit s | ÷ first | steady s "
        "| ÷ first |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.scenarios.split(","):
        first = None
        for python in pythons:
            runs = results[(name, python)]
            whole = statistics.median(r["whole_s"] for r in runs)
            steady = statistics.median(r["steady_s"] for r in runs)
            compile_s = statistics.median(r["compile_s"] for r in runs)
            first = (whole, steady) if first is None else first
            print(
                f"| {name} | {python} | {runs[0]['programs']} | {compile_s:.3f} | {whole:.3f} "
                f"| {whole / first[0]:.2f}× | {steady:.3f} | {steady / first[1]:.2f}× |"
            )
        for python in pythons:
            run = results[(name, python)][0]
            print(f"<!-- {name} {python}: loss {run['loss']:.8g}; {', '.join(run['names'])} -->")


if __name__ == "__main__":
    main()
