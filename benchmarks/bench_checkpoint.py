"""What preemption safety costs: a checkpoint every epoch, the time per save, and a resume.

On the digits MLP of ``_workloads.py`` (and the byte-level LM, a model 30x larger):

- a checkpoint every epoch: ``fit(checkpoint_every=1)`` with asynchronous saves (the
  default: a save returns once the arrays are on the host) and with synchronous ones
  (``checkpoint_async=False``), both with the epochs fused into one call that returns the
  states their saves need; the same saves with one call an epoch, each save written on its
  own (what ``fit`` did before: an empty epoch callback keeps the epochs apart, and a
  checkpointer whose ``together()`` groups nothing); and asynchronous saves through orbax
  (how every save was written before nnxscan's own files storage; one call an epoch),
  against the same ``fit`` without checkpoints (epochs fused when nothing needs the
  host); and that fit with only the empty epoch callback (what keeping the epochs apart
  alone costs); warm runs, interleaved, medians, ratios;

- per save: ``fit`` with ``checkpoint_every_steps=k`` against the same ``fit`` without
  checkpoints (interleaved, medians), the difference divided by the number of saves;
- resume: ``fit(..., resume=True)`` of a finished run (restore, nothing left to train),
  i.e. what a restarted process pays before it trains again, besides compiling;
- ablation (issue 58 item 9): a checkpoint every epoch (async) ÷ the fit without, and the
  same with parts of the fit's last write taken away *for the measurement only* (no
  fsyncs at all; no ``state/`` item; fsyncs of the newest checkpoint only): bounds on what
  moving each part off the training path, or dropping it, could gain. Not in the default
  tables; the variants break the documented promises and exist only here.

    python benchmarks/bench_checkpoint.py --reps 5 [--tables every-epoch,per-save,resume,ablation]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import jax
from _workloads import WORKLOADS

from nnxscan.adapters import _checkpoint_files
from nnxscan.adapters.checkpoint import Checkpointer, all_steps
from nnxscan.shell import LambdaCallback, Trainer
from nnxscan.shell._edges import checkpointing as _checkpointing


def timed_fit(workload, every: int, **fit) -> tuple[float, Trainer]:
    """Seconds of a warm fit whose calls are ``every`` steps long, one epoch at a time (an
    epoch hook keeps epochs apart, as checkpoints do)."""
    nodes = workload.nodes()
    trainer = Trainer(nodes[0], nodes[1], workload.loss_fn, **workload.trainer_options(nodes))
    options = dict(steps_per_call=every, callbacks=[LambdaCallback(on_epoch_end=_nothing)])
    # Compile outside the timing: what a save costs is measured on a warm run.
    trainer.fit(workload.data, epochs=1, batch_size=workload.batch_size, progress=False,
                **options)  # fmt: skip
    start = time.perf_counter()
    trainer.fit(workload.data, epochs=workload.epochs, batch_size=workload.batch_size,
                progress=False, **options, **fit)  # fmt: skip
    return time.perf_counter() - start, trainer


def _nothing(*args) -> None:
    pass


def per_save(name: str, every: int, reps: int) -> str:
    """ms per save of ``checkpoint_every_steps=every`` (own files, and through orbax)."""
    workload = WORKLOADS[name](False)
    times: dict[str | None, list[float]] = {"plain": [], None: [], "orbax": []}
    saves = workload.steps // every
    for rep in range(reps):
        order = list(times) if rep % 2 == 0 else list(reversed(times))
        for variant in order:
            if variant == "plain":
                times[variant].append(timed_fit(workload, every)[0])
                continue
            with tempfile.TemporaryDirectory() as folder, storage(variant):
                options = dict(checkpoint_every_steps=every, checkpoint_every=10**6)
                seconds, _ = timed_fit(workload, every, checkpoint_dir=folder, **options)
                times[variant].append(seconds)
    plain, own, orbax = (statistics.median(times[v]) for v in times)
    return (
        f"| {name} | {workload.steps} | {every} | {plain:.3f} | {own:.3f} | {saves} | "
        f"{1000 * (own - plain) / max(saves, 1):.1f} | "
        f"{1000 * (orbax - plain) / max(saves, 1):.1f} |"
    )


def resume_cost(name: str, reps: int) -> str:
    workload = WORKLOADS[name](False)
    costs = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as folder:
            nodes = workload.nodes()
            trainer = Trainer(nodes[0], nodes[1], workload.loss_fn)
            trainer.fit(workload.data, epochs=1, batch_size=workload.batch_size,
                        progress=False, checkpoint_dir=folder)  # fmt: skip
            assert all_steps(folder)
            nodes = workload.nodes()
            again = Trainer(nodes[0], nodes[1], workload.loss_fn)
            start = time.perf_counter()
            again.fit(workload.data, epochs=1, batch_size=workload.batch_size,
                      progress=False, checkpoint_dir=folder, resume=True)  # fmt: skip
            costs.append(time.perf_counter() - start)
    return f"| {name} | {1000 * statistics.median(costs):.0f} |"


_APART = [LambdaCallback(on_epoch_end=_nothing)]
VARIANTS = {
    "none": {},
    # No checkpoints, the epochs kept apart as checkpoints kept them before: what that costs.
    "epoch callback": {"callbacks": [LambdaCallback(on_epoch_end=_nothing)]},
    "sync": {"checkpoint_async": False},
    "async": {},
    # Before fused saves: one call an epoch (the hook), each save written on its own (Apart).
    "sync, before": {"checkpoint_async": False, "storage": "apart", "callbacks": _APART},
    "async, before": {"storage": "apart", "callbacks": _APART},
    "async, orbax": {"storage": "orbax"},  # orbax storage never fuses: one call an epoch
}


class Apart(Checkpointer):
    """The checkpointer as it was before fused saves (nnxscan at commit 184f481): no
    ``together()`` batches; each save queued (or, synchronous, written) on its own, and the
    newest checkpoint's ``state/`` item added by ``close()``; each batch's files fsync'ed
    by a thread made per file (:func:`_fsync_all_before`, swapped in by :func:`storage`).
    (Not reproduced: the ``state/`` item was written after ``arrays.bin``, not meanwhile.)"""

    @contextlib.contextmanager
    def together(self, *, last: bool = False):
        yield


def _fsync_all_before(paths):
    """``_checkpoint_files._fsync_all`` at commit 184f481: a thread made per path."""
    errors = []

    def sync(target):
        try:
            _checkpoint_files._fsync(target)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=sync, args=(p,), daemon=True) for p in paths[:-1]]
    for thread in threads:
        thread.start()
    if paths:
        sync(paths[-1])
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@contextlib.contextmanager
def storage(name: str | None):
    """Every checkpointer fit opens writes through ``name`` (``None``: the default).
    ``"orbax"`` is what every save went through before nnxscan's own files storage."""
    if name is None:
        yield
        return
    original = _checkpointing.open_checkpointer, _checkpoint_files._fsync_all
    _checkpointing.open_checkpointer = functools.partial(_checkpointer, name)
    if name == "apart":
        _checkpoint_files._fsync_all = _fsync_all_before
    try:
        yield
    finally:
        _checkpointing.open_checkpointer, _checkpoint_files._fsync_all = original


def _checkpointer(name, directory, *, max_to_keep=3, asynchronous=True):
    if name == "apart":
        return Apart(directory, max_to_keep=max_to_keep, asynchronous=asynchronous)
    return Checkpointer(directory, max_to_keep=max_to_keep, asynchronous=asynchronous, storage=name)


def _interleaved_medians(run: Callable[[str], float], variants: list[str], reps: int) -> dict:
    """Each variant's median of ``reps`` timed runs, after one untimed run each (every
    program compiled first: saves are measured warm); rounds alternate forward and back."""
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    for variant in variants:
        run(variant)
    for rep in range(reps):
        for variant in variants if rep % 2 == 0 else variants[::-1]:
            times[variant].append(run(variant))
    return {variant: statistics.median(seconds) for variant, seconds in times.items()}


def every_epoch(name: str, epochs: int, steps_per_epoch: int | None, reps: int) -> str:
    """``fit`` with a checkpoint every epoch (async and sync, own files, fused and as
    before; async through orbax), and with only an empty epoch callback, ÷ the same fit
    without either."""
    workload = WORKLOADS[name](False)
    data = workload.data
    if steps_per_epoch is not None:
        data = jax.tree.map(lambda a: a[: steps_per_epoch * workload.batch_size], data)
    steps = len(jax.tree.leaves(data)[0]) // workload.batch_size
    nodes = workload.nodes()
    trainer = Trainer(nodes[0], nodes[1], workload.loss_fn, **workload.trainer_options(nodes))
    fit = dict(batch_size=workload.batch_size, progress=False)

    def run(variant: str) -> float:
        options = dict(VARIANTS[variant])
        with tempfile.TemporaryDirectory() as folder, storage(options.pop("storage", None)):
            if variant not in ("none", "epoch callback"):
                options["checkpoint_dir"] = folder
            start = time.perf_counter()
            trainer.fit(data, epochs=epochs, **fit, **options)
            return time.perf_counter() - start

    medians = _interleaved_medians(run, list(VARIANTS), reps)
    none = medians["none"]
    cells = " | ".join(f"{medians[v]:.3f} | {medians[v] / none:.2f}x" for v in list(VARIANTS)[1:])
    return f"| {name} | {epochs} x {steps} | {none:.3f} | {cells} |"


@contextlib.contextmanager
def without(parts: frozenset[str]):
    """The checkpointer's last write with ``parts`` taken away (the ablation's bounds):
    ``"fsync"`` no fsync at all; ``"item"`` an empty ``state/`` folder instead of the
    item; ``"older fsync"`` the fsyncs of a batch's older checkpoints left out (its newest,
    the item, the run log and the directory still fsync'ed)."""
    files = _checkpoint_files
    saved = files._fsync, files._fsync_all, files._start_item
    if "fsync" in parts:
        files._fsync = files._fsync_all = lambda paths: None
    if "older fsync" in parts:

        def newest_only(paths):
            tmps = [p for p in paths if p.name.endswith(files.TMP_SUFFIX)]
            tmps.sort(key=lambda tmp: int(tmp.name.removesuffix(files.TMP_SUFFIX)))
            older = set(tmps[:-1])
            saved[1]([p for p in paths if not older.intersection([p, *p.parents])])

        files._fsync_all = newest_only
    if "item" in parts:
        files._start_item = lambda where, item: (where.mkdir(), list)[1]
    try:
        yield
    finally:
        files._fsync, files._fsync_all, files._start_item = saved


ABLATION = {
    "none": None,
    "async": frozenset(),
    "no fsyncs": frozenset({"fsync"}),
    "no state/ item": frozenset({"item"}),
    "no fsyncs, no item": frozenset({"fsync", "item"}),
    "newest fsync'ed only": frozenset({"older fsync"}),
}


def ablation(name: str, epochs: int, steps_per_epoch: int | None, reps: int) -> str:
    """A checkpoint every epoch (async) ÷ the fit without, whole and with parts of its
    writes taken away (:func:`without`): medians of interleaved warm runs."""
    workload = WORKLOADS[name](False)
    data = workload.data
    if steps_per_epoch is not None:
        data = jax.tree.map(lambda a: a[: steps_per_epoch * workload.batch_size], data)
    nodes = workload.nodes()
    trainer = Trainer(nodes[0], nodes[1], workload.loss_fn, **workload.trainer_options(nodes))
    fit = dict(epochs=epochs, batch_size=workload.batch_size, progress=False)

    def run(variant: str) -> float:
        parts = ABLATION[variant]
        with tempfile.TemporaryDirectory() as folder, without(parts or frozenset()):
            options = {} if parts is None else {"checkpoint_dir": folder}
            start = time.perf_counter()
            trainer.fit(data, **fit, **options)
            return time.perf_counter() - start

    medians = _interleaved_medians(run, list(ABLATION), reps)
    none = medians["none"]
    cells = " | ".join(f"{medians[v] / none:.2f}x" for v in list(ABLATION)[1:])
    return f"| {name} | {_load()} | {1000 * none:.1f} ms | {cells} |"


def ablation_table(reps: int) -> None:
    print()
    names = " | ".join(list(ABLATION)[1:])
    print(f"| workload | load after | fit, no checkpoints | {names} |")
    print("|---|---|---:|" + "---:|" * (len(ABLATION) - 1))
    for name, epochs, steps in (("lm_24", 4, 8), ("mlp_digits", 10, None)):
        print(ablation(name, epochs, steps, reps), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tables", default="every-epoch,per-save,resume",
                        help="which tables, comma-separated")  # fmt: skip
    args = parser.parse_args()
    tables = args.tables.split(",")
    print(f"load average before: {_load()}", flush=True)
    if "every-epoch" in tables:
        every_epoch_table(args.reps)
    if "per-save" in tables:
        per_save_table(args.reps)
    if "ablation" in tables:
        ablation_table(args.reps)
    if "resume" in tables:
        print("\n| workload | resume (restore) ms |\n|---|---:|")
        for name in ("mlp_digits", "lm_200"):
            print(resume_cost(name, args.reps), flush=True)
    print(f"\nload average after: {_load()}")


def _load() -> str:
    """The machine's 1/5/15-minute load averages and its cores (what else ran meanwhile)."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def every_epoch_table(reps: int) -> None:
    print(
        "| workload | epochs x steps | fit s, no checkpoints | an epoch callback instead s | "
        "÷ none | every epoch, sync s | ÷ none | every epoch, async s | ÷ none | "
        "sync, before (a call an epoch, saves apart) s | ÷ none | async, before s | ÷ none | "
        "async through orbax s | ÷ none |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, epochs, steps in (("lm_24", 4, 8), ("mlp_digits", 10, None)):
        print(every_epoch(name, epochs, steps, reps), flush=True)


def per_save_table(reps: int) -> None:
    print()
    print(
        "| workload | steps | save every | fit s | fit with saves s | saves | ms per save | "
        "ms per save through orbax |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, every in (("mlp_digits", 100), ("lm_200", 50)):
        print(per_save(name, every, reps), flush=True)


if __name__ == "__main__":
    sys.exit(main())
