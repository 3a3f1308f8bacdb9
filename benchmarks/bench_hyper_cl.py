"""hypnettorch's continual-learning example on split digits: nnxscan vs hypnettorch and HyperLight.

hypnettorch's ``examples/hypercl/run.py`` with its default arguments: 5 tasks learned in
sequence (task-incremental, each task its own 2-way output), a target MLP 64→100→100→2
(ReLU, 16,802 generated weights), one task embedding of 8 per task, a hypernetwork with
hidden layers [100, 100] (ReLU), Adam (lr 1e-4, betas 0.9/0.999, a fresh optimizer per
task, on every parameter of the hypernetwork, all task embeddings included), batch 32, and
the output regularizer ``beta · mean over earlier tasks of ‖h(e_j) − target_j‖²`` with
beta 0.01, its targets taken before each task (``hreg.get_current_targets``) and the live
embeddings on the other side (``hreg.calc_fix_target_reg``). Here on scikit-learn's 8x8
digits (``load_digits``, 64 features) split as ``nnxscan demo hypernet-cl`` splits them:
digits 2k/2k+1 are task k, every task cut to the smallest task's sizes (280 training and
66 test digits for seed 0), 32 epochs of 8 batches = 256 steps a task.

Every side trains bitwise the same data in the same order: the driver writes each seed's
tasks and every epoch's permutation (``nnxscan.pure.epoch_order(seed + t, epoch, n)``, the
order ``train_tasks`` / ``Trainer.fit`` uses) to an ``.npz`` that the torch side reads.

Setups (the hypernetwork's own weights in brackets, task embeddings included):

- ``nnxscan-heads``: ``ConditionalHypernetwork``, trunk 8→100→100 (ReLU) and one head per
  target tensor (1,708,042), the output regularizer as in ``nnxscan demo hypernet-cl``;
- ``nnxscan-chunked``: the same trunk and ``ChunkedHeads`` with chunks of 750, chunk
  embeddings of 8 (one set per task, the default) and a chunk layer of 87 (87,455 weights,
  hypnettorch's ChunkedHMLP has 87,774);
- ``nnxscan-structured``: the same trunk and ``StructuredHeads``, a chunk per 10 output
  units of a layer (their fan-ins and biases), chunk embeddings of 8 per task and a chunk
  layer of 38 (88,652 weights);
- ``hypnettorch-hmlp``: ``HMLP`` as run.py builds it with ``--hnet_type hmlp``;
- ``hypnettorch-chunked``: ``ChunkedHMLP``, chunks of 750 and chunk embeddings of 8
  (run.py's default hypernetwork);
- ``hyperlight``: HyperLight's ``HyperNet.from_existing`` on the target's initial weights
  (MIP: theta = theta0 + delta, both learned; ``encoding=None`` so the input is the task
  embedding itself), 5 learned task embeddings of 8 beside it, the same regularizer.

nnxscan's learner is built with ``nnxscan.pure.build_compiled`` (its initializers in one
compiled program) and trained with the ``hypernet-cl`` demo's loss (every task's weights
generated once a step, the snapshot taken in each task's first step).

Timing: each run is a fresh process (so compiling is part of nnxscan's whole run), runs
are interleaved (the order of setups rotates from one seed and round to the next) and the
table gives medians over ``--seeds`` (3 by default) times ``--rounds`` (1). "whole run" is
building the hypernetwork to the last accuracy matrix entry (imports and data loading
excluded on every side); "÷ hypnettorch's" is the median (and range) of each nnxscan
run's whole time over that of hypnettorch's network of its kind in the same round and
seed (HMLP for one head per tensor, ChunkedHMLP for the chunked and structured heads):
on a shared host, runs minutes apart see the same load; "step" is a later task's
training and evaluation time divided by its 256 steps (median over tasks 2-5: no
compiling in it on either side).

The torch side runs in its own environment, never in nnxscan's. Set it up once::

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    .venv-bench/bin/pip install hypnettorch==0.0.4 hyperlight==0.0.5 matplotlib

(``matplotlib``: hypnettorch's utilities import it; plain ``pip install torch`` also works.)

Run: ``.venv/bin/python benchmarks/bench_hyper_cl.py [--seeds 0,1,2] [--rounds 3]
[--torch-python .venv-bench/bin/python] [--setups nnxscan-heads,...] [--epochs 32]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

NUM_TASKS = 5
HIDDEN = (100, 100)
EMBEDDING = 8
LEARNING_RATE = 1e-4
BATCH_SIZE = 32
BETA = 0.01
CHUNK = 750
NNXSCAN = ("nnxscan-heads", "nnxscan-chunked", "nnxscan-structured")
TORCH = ("hypnettorch-hmlp", "hypnettorch-chunked", "hyperlight")
TITLES = {
    "nnxscan-heads": "nnxscan, one head per tensor",
    "nnxscan-chunked": f"nnxscan ChunkedHeads, chunk {CHUNK}",
    "nnxscan-structured": "nnxscan StructuredHeads, 10 output units a chunk",
    "hypnettorch-hmlp": "hypnettorch HMLP, as run.py",
    "hypnettorch-chunked": f"hypnettorch ChunkedHMLP, chunk {CHUNK}",
    "hyperlight": "HyperLight HyperNet.from_existing",
}


# -- the data: written by the driver, read by both sides ----------------------------------------


def write_tasks(path: pathlib.Path, seed: int, epochs: int) -> None:
    """Seed ``seed``'s split digits tasks and every epoch's order, as one ``.npz``."""
    from nnxscan.pure import epoch_order
    from nnxscan.shell.demos.digits import digits_split
    from nnxscan.shell.demos.hypernet_cl import equal_sizes, split_tasks

    train, test = digits_split(seed)
    trains, tests = equal_sizes(split_tasks(train)), equal_sizes(split_tasks(test))
    arrays = {}
    for t in range(NUM_TASKS):
        n = len(trains[t]["y"])
        for key in ("x", "y"):
            arrays[f"train_{key}_{t}"] = trains[t][key]
            arrays[f"test_{key}_{t}"] = tests[t][key]
        # The order Trainer.fit(seed=seed + t) draws, epoch after epoch (train_tasks' rule).
        arrays[f"order_{t}"] = np.stack([epoch_order(seed + t, e, n) for e in range(epochs)])
    np.savez(path, **arrays)


def read_tasks(path: str) -> list[dict[str, np.ndarray]]:
    data = np.load(path)
    return [
        {key: data[f"{key}_{t}"] for key in ("train_x", "train_y", "test_x", "test_y", "order")}
        for t in range(NUM_TASKS)
    ]


def batches_of(task: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The index batches fit trains: each epoch's order cut into full batches."""
    out = []
    for order in task["order"]:
        steps = len(order) // BATCH_SIZE
        out.extend(order[: steps * BATCH_SIZE].reshape(steps, BATCH_SIZE))
    return out


# -- nnxscan ----------------------------------------------------------------------------------


def run_nnxscan(
    setup: str, tasks: list[dict[str, np.ndarray]], seed: int, cache: str | None = None
) -> dict:
    import jax
    import optax
    from flax import nnx

    from nnxscan.pure import build_compiled, hyper
    from nnxscan.shell import train_tasks
    from nnxscan.shell.demos.hypernet_cl import (
        ContinualLearner,
        hypernetwork_accuracy,
        hypernetwork_losses,
    )

    class Target(nnx.Module):
        def __init__(self, rngs):
            self.layer1 = nnx.Linear(64, HIDDEN[0], rngs=rngs)
            self.layer2 = nnx.Linear(HIDDEN[0], HIDDEN[1], rngs=rngs)
            self.layer3 = nnx.Linear(HIDDEN[1], 2, rngs=rngs)

        def __call__(self, x):
            return self.layer3(nnx.relu(self.layer2(nnx.relu(self.layer1(x)))))

    if cache:  # opt-in: compiled programs kept on disk, so a later process compiles nothing
        from nnxscan.shell import enable_compilation_cache

        enable_compilation_cache(cache)
    epochs = len(tasks[0]["order"])
    data = [
        (
            {"x": t["train_x"], "y": t["train_y"], "task": np.full(len(t["train_y"]), k, np.int32)},
            {"x": t["test_x"], "y": t["test_y"], "task": np.full(len(t["test_y"]), k, np.int32)},
        )
        for k, t in enumerate(tasks)
    ]
    starts = []
    regularized = hypernetwork_losses(BETA)

    def loss_for_task(t, learner):
        starts.append(time.perf_counter())
        return regularized(t, learner)

    start = time.perf_counter()

    def build():
        rngs = nnx.Rngs(seed + 1)
        trunk = nnx.Sequential(
            nnx.Linear(EMBEDDING, HIDDEN[0], rngs=rngs), nnx.relu,
            nnx.Linear(HIDDEN[0], HIDDEN[1], rngs=rngs), nnx.relu,
        )  # fmt: skip
        return ContinualLearner(hyper.ConditionalHypernetwork(
            Target(nnx.Rngs(seed)), trunk, HIDDEN[1], num_conditions=NUM_TASKS,
            embedding_features=EMBEDDING, rngs=nnx.Rngs(seed + 2), **heads,
        ))  # fmt: skip

    heads = {
        "nnxscan-heads": {},
        # Chunk embeddings of 8 as ChunkedHMLP's, one set per task (the default), and a chunk
        # layer of 87: 87,455 weights to ChunkedHMLP's 87,774.
        "nnxscan-chunked": {
            "chunk_size": CHUNK,
            "chunk_embedding_features": EMBEDDING,
            "chunk_hidden_features": 87,
        },
        "nnxscan-structured": {
            "structured_units": 10,
            "chunk_embedding_features": EMBEDDING,
            "chunk_hidden_features": 38,
        },
    }[setup]
    # Every initializer in one compiled call: built eagerly, each jax.random draw and
    # scaling of a new shape compiles its own small program.
    learner = build_compiled(build)
    weights = sum(x.size for x in jax.tree.leaves(nnx.state(learner.hnet, nnx.Param)))
    acc = train_tasks(
        learner, optax.adam(LEARNING_RATE), data, loss_for_task,
        lambda j: hypernetwork_accuracy, epochs=epochs, batch_size=BATCH_SIZE, seed=seed,
        progress=False,
    )  # fmt: skip
    end = time.perf_counter()  # acc is on the host: every program has run
    return {"weights": int(weights), "whole": end - start, "task_times": _task_times(starts, end),
            "accuracy": acc.tolist()}  # fmt: skip


def _task_times(starts: list[float], end: float) -> list[float]:
    return [b - a for a, b in zip(starts, [*starts[1:], end], strict=True)]


# -- torch: hypnettorch and HyperLight, as run.py trains -------------------------------------


def run_torch(setup: str, tasks: list[dict[str, np.ndarray]], seed: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    tensors = [
        {
            "train_x": torch.from_numpy(t["train_x"]),
            "train_y": torch.from_numpy(t["train_y"].astype(np.int64)),
            "test_x": torch.from_numpy(t["test_x"]),
            "test_y": torch.from_numpy(t["test_y"].astype(np.int64)),
            "batches": [torch.from_numpy(b.astype(np.int64)) for b in batches_of(t)],
        }
        for t in tasks
    ]
    start = time.perf_counter()
    generate, forward, parameters = _torch_model(setup)
    weights = sum(p.numel() for p in parameters)
    acc = np.full((NUM_TASKS, NUM_TASKS), np.nan)
    starts = []
    for t, task in enumerate(tensors):
        starts.append(time.perf_counter())
        # hreg.get_current_targets: the earlier tasks' weights, before this task trains.
        with torch.no_grad():
            targets = [[w.detach() for w in generate(j)] for j in range(t)]
        optimizer = torch.optim.Adam(parameters, lr=LEARNING_RATE, betas=(0.9, 0.999))
        for index in task["batches"]:
            optimizer.zero_grad()
            logits = forward(task["train_x"][index], generate(t))
            loss = F.cross_entropy(logits, task["train_y"][index], reduction="mean")
            if t > 0:  # hreg.calc_fix_target_reg with the live embeddings
                reg = 0
                for j in range(t):
                    now = torch.cat([w.view(-1) for w in generate(j)])
                    stored = torch.cat([w.view(-1) for w in targets[j]])
                    reg = reg + (stored - now).pow(2).sum()
                loss = loss + BETA * reg / t
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            for j in range(t + 1):
                logits = forward(tensors[j]["test_x"], generate(j))
                acc[t, j] = float((logits.argmax(1) == tensors[j]["test_y"]).float().mean())
    end = time.perf_counter()
    return {"weights": int(weights), "whole": end - start, "task_times": _task_times(starts, end),
            "accuracy": acc.tolist()}  # fmt: skip


def _torch_model(setup: str):
    """(generate(task) -> list of weights, forward(x, weights) -> logits, parameters)."""
    import torch

    if setup.startswith("hypnettorch"):
        from hypnettorch.hnets import HMLP, ChunkedHMLP
        from hypnettorch.mnets import MLP

        # sim_utils.get_mnet_model / get_hypernet with run.py's defaults.
        mnet = MLP(n_in=64, n_out=2, hidden_layers=list(HIDDEN), no_weights=True)
        options = dict(cond_in_size=EMBEDDING, layers=list(HIDDEN), num_cond_embs=NUM_TASKS,
                       verbose=False)  # fmt: skip
        if setup == "hypnettorch-hmlp":
            hnet = HMLP(mnet.param_shapes, **options)
        else:
            hnet = ChunkedHMLP(mnet.param_shapes, CHUNK, chunk_emb_size=EMBEDDING, **options)
        hnet.train()
        mnet.train()
        return (
            lambda t: hnet.forward(cond_id=t),
            lambda x, weights: mnet.forward(x, weights=weights),
            list(hnet.parameters()),
        )
    import hyperlight as hl

    sizes = (64, *HIDDEN, 2)
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    target = torch.nn.Sequential(*layers)
    linears = [m for m in target if isinstance(m, torch.nn.Linear)]
    mainnet, weights = hl.hypernetize(target, modules=linears, return_values=True)
    hypernet = hl.HyperNet.from_existing(
        weights, input_shapes={"e": (EMBEDDING,)}, hidden_sizes=list(HIDDEN), encoding=None
    )
    embeddings = torch.nn.Parameter(torch.randn(NUM_TASKS, EMBEDDING))
    names = list(hypernet.output_shapes)

    def generate(t):
        out = hypernet(e=embeddings[t])
        return [out[name] for name in names]

    def forward(x, generated):
        with mainnet.using_externals(dict(zip(names, generated, strict=True))):
            return mainnet(x)

    return generate, forward, [*hypernet.parameters(), embeddings]


# -- the driver -----------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    tasks = read_tasks(args.data)
    if args.worker in NNXSCAN:
        result = run_nnxscan(args.worker, tasks, args.seed, args.compile_cache)
    else:
        result = run_torch(args.worker, tasks, args.seed)
    result["steps_per_task"] = len(batches_of(tasks[0]))
    print("RESULT " + json.dumps(result))


def run_one(
    setup: str, data: pathlib.Path, seed: int, torch_python: str, cache: str | None = None
) -> dict:
    python = sys.executable if setup in NNXSCAN else torch_python
    command = [python, __file__, "--worker", setup, "--data", str(data), "--seed", str(seed)]
    if cache and setup in NNXSCAN:
        command += ["--compile-cache", cache]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{setup} (seed {seed}) failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(lines[-1][len("RESULT ") :])


# Each nnxscan setup against hypnettorch's network of its kind and size.
COUNTERPART = {
    "nnxscan-heads": "hypnettorch-hmlp",
    "nnxscan-chunked": "hypnettorch-chunked",
    "nnxscan-structured": "hypnettorch-chunked",
}


def paired_ratios(results: dict[str, list[dict]], setup: str) -> list[float]:
    """Each run's whole time over its counterpart's run of the same round and seed: the
    two ran minutes apart, so a ratio sees the same load on the host."""
    other = results.get(COUNTERPART.get(setup, ""), [])
    by_run = {(r["round"], r["seed"]): r["whole"] for r in other}
    return [
        r["whole"] / by_run[r["round"], r["seed"]]
        for r in results[setup]
        if (r["round"], r["seed"]) in by_run
    ]


def report(results: dict[str, list[dict]]) -> None:
    print("| setup | weights | whole run (s) | ÷ hypnettorch's (range) | step (ms) | "
          "final average accuracy | task 1 after it → end |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---|")
    for setup, runs in results.items():
        if not runs:
            continue
        acc = [np.asarray(r["accuracy"]) for r in runs]
        finals = [100 * a[-1].mean() for a in acc]
        step = statistics.median(
            statistics.median(r["task_times"][1:]) / r["steps_per_task"] * 1e3 for r in runs
        )
        # Each seed once (every round trains the same bits).
        seen = {r["seed"]: a for r, a in zip(runs, acc, strict=True)}
        drops = ", ".join(f"{100 * a[0, 0]:.0f} → {100 * a[-1, 0]:.1f}" for a in seen.values())
        ratios = paired_ratios(results, setup)
        ratio = (
            f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"
            if ratios
            else ""
        )
        print(
            f"| {TITLES[setup]} | {runs[0]['weights']:,} | "
            f"{statistics.median(r['whole'] for r in runs):.1f} | {ratio} | {step:.2f} | "
            f"{statistics.median(finals):.1f}% ({min(finals):.1f}-{max(finals):.1f}) | {drops} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=32, help="epochs a task (8 steps each)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="run every seed's setups this many times"
    )
    parser.add_argument("--setups", default=",".join(NNXSCAN + TORCH))
    parser.add_argument("--torch-python", default=".venv-bench/bin/python")
    parser.add_argument("--json", help="also write every run's numbers to this file")
    parser.add_argument(
        "--compile-cache",
        help="nnxscan's opt-in persistent compilation cache folder: warmed by a first run "
        "of each setup on each seed's data (not counted), so every counted run reads its "
        "programs from disk",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    setups = args.setups.split(",")
    unknown = sorted(set(setups) - set(NNXSCAN + TORCH))
    if unknown:
        raise SystemExit(f"unknown setups {unknown}; choose from {NNXSCAN + TORCH}")
    if any(s in TORCH for s in setups) and not pathlib.Path(args.torch_python).exists():
        raise SystemExit(
            f"{args.torch_python} not found: set up the torch side (see the docstring)"
        )
    results = {s: [] for s in setups}
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        for seed in seeds:
            data = pathlib.Path(folder) / f"tasks_{seed}.npz"
            write_tasks(data, seed, args.epochs)
            if args.compile_cache:  # warm it with this seed's shapes, uncounted
                for setup in (s for s in setups if s in NNXSCAN):
                    run_one(setup, data, seed, args.torch_python, args.compile_cache)
        # Rounds outermost, the setups' order rotating: each setup runs early and late.
        for r, (round_, seed) in enumerate(itertools.product(range(args.rounds), seeds)):
            data = pathlib.Path(folder) / f"tasks_{seed}.npz"
            shift = r % len(setups)
            for setup in setups[shift:] + setups[:shift]:
                run = run_one(setup, data, seed, args.torch_python, args.compile_cache)
                run.update(round=round_, seed=seed)
                results[setup].append(run)
                final = 100 * np.asarray(run["accuracy"])[-1].mean()
                print(
                    f"round {round_ + 1} seed {seed} {setup}: {run['whole']:.1f} s, "
                    f"final {final:.1f}%",
                    flush=True,
                )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    print()
    report(results)


if __name__ == "__main__":
    main()
