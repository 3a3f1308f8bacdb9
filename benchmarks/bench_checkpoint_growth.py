"""Does a checkpoint cost more the longer the run? A save at epoch 10, 1,000 and 3,000.

The docs' MLP (1 -> 32 -> 1, 1,000 examples, batch 64: 15 steps an epoch). Two ways of
keeping the History in a checkpoint, side by side in this process:

- ``run log`` (nnxscan now): each save appends the epochs since the last save to
  ``history.jsonl`` beside the checkpoints; the manifest records a byte range.
- ``inline`` (nnxscan up to 0.2): each save writes the whole History so far as JSON into
  its manifest (``['meta']['run']``); reproduced here by swapping what the fit's saves
  record for the old ``run_json`` (everything else is the same code).

Table 1, per save: one fit of ``--epochs`` epochs with a synchronous checkpoint every
epoch (``checkpoint_async=False``, so a save's whole cost lands on the main thread), each
save timed (recording the run + writing the checkpoint); the medians of the saves around
epochs 10, 1,000 and 3,000; the last manifest's and the log's bytes.

Table 2, whole fits: ``--fit-epochs`` epochs with ``checkpoint_every_steps=50`` (the
issue's setting; async, the default) against the same fit without checkpoints; warm
(programs compiled first), interleaved, medians and ratios.

    python benchmarks/bench_checkpoint_growth.py [--epochs 3000] [--fit-epochs 1000] [--reps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscan.adapters import _log_values
from nnxscan.adapters.checkpoint import all_steps
from nnxscan.shell import Trainer
from nnxscan.shell._edges import checkpointing as _checkpointing


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(1, 32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.tanh(self.hidden(x)))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


XS = np.random.default_rng(1).uniform(-2, 2, (1000, 1)).astype(np.float32)
DATA = {"x": XS, "y": np.sin(XS)}
TX = optax.adam(1e-2)
FIT = dict(batch_size=64, seed=0, progress=False)


def inline_run_json(history, partial) -> str:
    """nnxscan 0.2's ``_checkpointing.run_json``: the whole run so far, every save."""
    epochs = [logs for logs in history.epochs if not logs.get("stopped")]
    done = sum(int(logs.get("steps", 0)) for logs in epochs)
    record = {
        "epochs": epochs,
        "losses": np.asarray(history.losses[:done], np.float64).tolist(),
        "partial": np.asarray(partial, np.float64).tolist(),
        "events": history.events,
    }
    return json.dumps(record, default=_log_values.plain)


@contextlib.contextmanager
def history_kept(way: str):
    """Fit's saves record the run as ``way`` says ("run log": as now; "inline": as 0.2)."""
    if way == "run log":
        yield
        return
    original = _checkpointing.RunLog.record
    _checkpointing.RunLog.record = lambda self, history, partial, *aux: inline_run_json(
        history, partial
    )
    try:
        yield
    finally:
        _checkpointing.RunLog.record = original


@contextlib.contextmanager
def timed_saves(seconds: list[float]):
    """Appends each save's seconds (recording the run, then writing the checkpoint)."""
    record, save_with = _checkpointing.RunLog.record, _checkpointing.save_with
    started: list[float] = []

    def timed_record(self, history, partial, *aux):
        started.append(time.perf_counter())
        return record(self, history, partial, *aux)

    def timed_save_with(*args, **kwargs):
        try:
            return save_with(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started.pop())

    _checkpointing.RunLog.record, _checkpointing.save_with = timed_record, timed_save_with
    try:
        yield
    finally:
        _checkpointing.RunLog.record, _checkpointing.save_with = record, save_with


def per_save(way: str, epochs: int, at: tuple[int, ...]) -> str:
    trainer = Trainer(MLP(nnx.Rngs(0)), TX, loss_fn)
    with tempfile.TemporaryDirectory() as folder:  # compiled first: saves measured warm
        trainer.fit(DATA, epochs=1, checkpoint_dir=folder, **FIT)
    seconds: list[float] = []
    with tempfile.TemporaryDirectory() as folder, history_kept(way):
        with timed_saves(seconds):
            trainer.fit(DATA, epochs=epochs, checkpoint_dir=folder, checkpoint_async=False,
                        **FIT)  # fmt: skip
        directory = pathlib.Path(folder)
        manifest = (directory / str(all_steps(directory)[-1]) / "manifest.json").stat().st_size
        log = directory / _checkpointing.LOG
        log_bytes = log.stat().st_size if log.exists() else 0
    assert len(seconds) == epochs, (len(seconds), epochs)
    cells = []
    for epoch in at:  # the median of the 10 saves around that epoch
        window = seconds[max(epoch - 5, 0) : epoch + 5]
        cells.append(f"{1000 * statistics.median(window):.2f}")
    return f"| {way} | {' | '.join(cells)} | {manifest:,} | {log_bytes:,} |"


def whole_fit(epochs: int, reps: int) -> list[str]:
    variants = {
        "no checkpoints": (None, {}),
        "run log": ("run log", {"checkpoint_every_steps": 50}),
        "inline": ("inline", {"checkpoint_every_steps": 50}),
    }
    trainer = Trainer(MLP(nnx.Rngs(0)), TX, loss_fn)

    def run(name: str) -> float:
        way, options = variants[name]
        with tempfile.TemporaryDirectory() as folder, history_kept(way or "run log"):
            if way is not None:
                options = {**options, "checkpoint_dir": folder}
            start = time.perf_counter()
            trainer.fit(DATA, epochs=epochs, **FIT, **options)
            return time.perf_counter() - start

    for name in variants:  # compile every program first
        run(name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(run(name))
    none = statistics.median(times["no checkpoints"])
    return [
        f"| {name} | {statistics.median(times[name]):.2f} | "
        f"{statistics.median(times[name]) / none:.2f}x |"
        for name in variants
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3000)
    parser.add_argument("--fit-epochs", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tables", default="per-save,whole-fit")
    args = parser.parse_args()
    tables = args.tables.split(",")
    if "per-save" in tables:
        at = tuple(e for e in (10, 1000, 3000) if e <= args.epochs)
        print(f"| History | {' | '.join(f'ms per save at epoch {e:,}' for e in at)} | "
              f"last manifest bytes | log bytes |")  # fmt: skip
        print("|---|" + "---:|" * (len(at) + 2))
        for way in ("run log", "inline"):
            print(per_save(way, args.epochs, at), flush=True)
    if "whole-fit" in tables:
        print(f"\n| {args.fit_epochs:,} epochs x 15 steps, checkpoint_every_steps=50 | "
              f"fit s | ÷ no checkpoints |")  # fmt: skip
        print("|---|---:|---:|")
        for row in whole_fit(args.fit_epochs, args.reps):
            print(row, flush=True)


if __name__ == "__main__":
    sys.exit(main())
