"""Whole-run speed: each workload as its authors wrote it, and through nnxscan, compile included.

What a user feels is the time from starting a training script to a trained model, compile
included. For every workload of ``_workloads.py`` this times, in one process:

  nnx_jit          the authors' ``train_step`` under ``nnx.jit``, called once per batch
                   (the Flax NNX tutorial; recipe 1 of Flax's performance guide)
  cached_partial   the same step through ``nnx.cached_partial(step, *nodes)`` (recipe 2)
  split_merge_jit  ``nnx.split`` once, ``jax.jit`` with the state donated, ``nnx.merge``
                   inside the step, ``nnx.update`` after each epoch (recipe 3)
  fit_auto, fit_scan, fit_step, fit_unrolled
                   ``Trainer(...).fit(data, epochs=E, batch_size=B)`` with each execution
                   plan (the tutorial CNN ported as docs/porting.md shows: ``has_aux``,
                   ``rngs``, ``metrics``, ``update_metrics``)
  nnx_scan         Flax's own answer to "scan my step": the authors' ``train_step`` under
                   ``nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))`` inside
                   ``nnx.jit``, one call per epoch over that epoch's batches stacked on the
                   host (the stacking is timed: a Flax user has to do it)
  one_scan         (mlp_digits only) one ``jax.jit`` around one ``lax.scan`` over every step
                   of the run, the step from ``nnxscan.pure.make_train_step``: the floor
                   for fusing epochs
  keras, keras_spe (the MLPs and the CNN, when the ``bench`` extra is installed) Keras 3 on
                   the JAX backend, ``model.compile`` + ``model.fit`` from the Flax model's
                   initial weights on the same batches (``_keras_models.py``), with
                   ``steps_per_execution`` 1 and the workload epoch's steps

Every variant trains the same number of steps on the same batches (the permutations
``Trainer.fit(seed=0)`` draws), so their final losses (the last epoch's mean training loss)
agree up to rounding. The loops gather each batch on the host from the numpy data set, as
a data loader hands batches to a loop; ``fit`` and ``one_scan`` get the numpy data set.

Timing. Each repetition runs every variant once, in a new shuffled order. Each run gets
fresh, untrained nodes (model, optimizer, ...: a copy of one untrained set, with a new
optax transform; untimed), then ``jax.clear_caches()`` empties every compilation cache, so
each run traces and compiles everything again, as a new process does:

  whole   from building the step function (``nnx.jit(...)``, ``Trainer(...)``, ...) to the
          trained model with every step done (blocked on), compile included;
  steady  the same run once more in the same process, on the same objects with the same
          compiled functions (for fit: a second ``fit`` call on the same Trainer, which
          trains the next epochs): compile excluded.

``whole - steady`` is about what compiling (and tracing) costs. Before the first workload
every variant runs once on a tiny workload, untimed, so one-time imports and set-up land
in no timing. Medians over ``--reps`` repetitions.

    python benchmarks/bench_wholerun.py --out wholerun.md
    python benchmarks/bench_wholerun.py --workloads cnn_8x8,lm --reps 5
    python benchmarks/bench_wholerun.py --quick          # tiny sizes, checks it runs
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
from _keras_models import expressible, keras_installed, keras_variant
from _workloads import WORKLOADS, Nodes, Workload, mlp_digits
from flax import nnx

from nnxscan.pure import init_opt_state, make_train_step
from nnxscan.shell import Plan, Trainer

# A variant builds, from a workload and fresh nodes, ``train()``: it trains the whole run on
# the nodes and returns the last epoch's mean training loss. Building is timed with it.
Train = Callable[[], float]
Variant = Callable[[Workload, Nodes], Train]

RECIPES = ("nnx_jit", "cached_partial", "split_merge_jit", "nnx_scan")
PLANS = ("fit_scan", "fit_step", "fit_unrolled")


# -- the Flax performance guide's three recipes, and nnx.scan --------------------------------


def per_step_loop(workload: Workload, nodes: Nodes, step: Callable) -> Train:
    """The authors' loop: one step call per batch, the epoch's loss read at its end."""

    def train() -> float:
        for epoch in range(workload.epochs):
            outputs = [step(batch) for batch in workload.batches(epoch)]
            loss = workload.epoch_loss(nodes, outputs)
        return loss

    return train


def nnx_jit(workload: Workload, nodes: Nodes) -> Train:
    step = nnx.jit(workload.train_step)
    return per_step_loop(workload, nodes, lambda batch: step(*nodes, batch))


def cached_partial(workload: Workload, nodes: Nodes) -> Train:
    step = nnx.cached_partial(nnx.jit(workload.train_step), *nodes)
    return per_step_loop(workload, nodes, step)


def split_merge_jit(workload: Workload, nodes: Nodes) -> Train:
    graphdef, _ = nnx.split(nodes)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
        live = nnx.merge(graphdef, state)
        out = workload.train_step(*live, batch)
        return nnx.state(live), out

    def train() -> float:
        for epoch in range(workload.epochs):
            state, outputs = nnx.state(nodes), []
            for batch in workload.batches(epoch):
                state, out = step(state, batch)
                outputs.append(out)
            nnx.update(nodes, state)  # the epoch's loss may read the nodes (metrics)
            loss = workload.epoch_loss(nodes, outputs)
        return loss

    return train


def nnx_scan(workload: Workload, nodes: Nodes) -> Train:
    """One ``nnx.jit`` call per epoch of ``nnx.scan`` over the stacked batches, the nodes
    carried (``nnx.Carry``): the Flax anchor for scanned training."""

    @nnx.jit
    def epoch(nodes, batches):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def body(nodes, batch):
            return nodes, workload.train_step(*nodes, batch)

        return body(nodes, batches)[1]

    def train() -> float:
        for e in range(workload.epochs):
            batches = jax.tree.map(lambda *b: np.stack(b), *workload.batches(e))
            loss = workload.epoch_loss(nodes, epoch(nodes, batches))
        return loss

    return train


# -- nnxscan ------------------------------------------------------------------------------


def make_trainer(workload: Workload, nodes: Nodes, execution: str) -> Trainer:
    model, optimizer = nodes[:2]
    options = workload.trainer_options(nodes)
    return Trainer(model, optimizer, workload.loss_fn, execution=execution, **options)


def fit(execution: str) -> Variant:
    def variant(workload: Workload, nodes: Nodes) -> Train:
        trainer = make_trainer(workload, nodes, execution)

        def train() -> float:
            history = trainer.fit(
                workload.data, epochs=workload.epochs, batch_size=workload.batch_size,
                progress=False,
            )  # fmt: skip
            return history.epochs[-1]["loss"]

        return train

    return variant


def one_scan(workload: Workload, nodes: Nodes) -> Train:
    """Every step of the run in one compiled ``lax.scan``: no host between epochs."""
    model, optimizer = nodes[:2]
    step = make_train_step(workload.loss_fn, optimizer.tx)

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
    def run(graphdef, state, opt_state, data, indices):
        def body(carry, idx):
            batch = jax.tree.map(lambda a: a[idx], data)
            state, opt_state, loss = step(graphdef, *carry, batch)
            return (state, opt_state), loss

        (state, opt_state), losses = jax.lax.scan(body, (state, opt_state), indices)
        return state, opt_state, losses

    def train() -> float:
        indices = np.concatenate([workload.batch_indices(e) for e in range(workload.epochs)])
        graphdef, state = nnx.split(model)
        opt_state = init_opt_state(optimizer.tx, state)
        state, _, losses = run(graphdef, state, opt_state, workload.data, indices)
        nnx.update(model, state)
        return float(np.mean(np.asarray(losses)[-workload.steps_per_epoch :]))

    return train


VARIANTS: dict[str, Variant] = {
    "nnx_jit": nnx_jit,
    "cached_partial": cached_partial,
    "split_merge_jit": split_merge_jit,
    "nnx_scan": nnx_scan,
    "fit_auto": fit("auto"),
    "fit_scan": fit("scan"),
    "fit_step": fit("step"),
    "fit_unrolled": fit("unrolled"),
    "one_scan": one_scan,
}
KERAS = ("keras", "keras_spe")
if keras_installed():  # the bench extra
    VARIANTS["keras"] = keras_variant(lambda w: 1)
    VARIANTS["keras_spe"] = keras_variant(lambda w: w.steps_per_epoch)


def variants_of(workload: Workload, wanted: list[str]) -> list[str]:
    return [
        v
        for v in wanted
        if (v != "one_scan" or workload.one_scan_floor)
        and (v not in KERAS or expressible(workload))
    ]


# -- timing -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    whole: float  # seconds, compile included
    steady: float  # seconds, the same run again, compiled
    loss: float  # the last epoch's mean training loss of the first run


class FreshNodes:
    """Fresh, untrained nodes for every run, without building the model again.

    Building a model right after ``jax.clear_caches()`` compiles every initializer anew
    (~2 s, untimed but slow), so the nodes are built once and each run gets a copy of their
    arrays, with a new optax transform: nnxscan caches compiled programs (and the plan it
    traced for) by the transform object, and a new one makes each run start cold, as a new
    process does.
    """

    def __init__(self, workload: Workload):
        self.make_tx = workload.make_tx
        self.graphdef, self.state = nnx.split(workload.nodes())

    def __call__(self) -> Nodes:
        nodes = nnx.merge(self.graphdef, jax.device_put(self.state, may_alias=False))
        nodes[1].tx = self.make_tx()  # the nnx.Optimizer's
        return nodes


def cold_run(workload: Workload, variant: Variant, fresh_nodes: FreshNodes):
    """``(seconds, final loss, train, nodes)``: one whole run from empty in-memory
    compilation caches, on fresh nodes (``train()`` runs it again).

    A variant with a ``prepare(workload, nodes)`` (Keras) builds its own model from the
    nodes there, untimed, and gets it as a third argument."""
    nodes = fresh_nodes()
    prepare = getattr(variant, "prepare", None)
    prepared = () if prepare is None else (prepare(workload, nodes),)
    gc.collect()
    jax.clear_caches()

    start = time.perf_counter()
    train = variant(workload, nodes, *prepared)
    loss = train()
    jax.block_until_ready(nnx.state(nodes))
    return time.perf_counter() - start, loss, train, nodes


def run_variant(workload: Workload, variant: Variant, fresh_nodes: FreshNodes) -> Run:
    """One whole run from empty compilation caches, then the same run again, compiled."""
    whole, loss, train, nodes = cold_run(workload, variant, fresh_nodes)
    start = time.perf_counter()
    train()
    jax.block_until_ready(nnx.state(nodes))
    steady = time.perf_counter() - start
    return Run(whole, steady, loss)


def bench(workload: Workload, names: list[str], reps: int, shuffler: random.Random, log):
    """``{variant: [Run, ...]}``: every variant once per repetition, in a shuffled order."""
    runs: dict[str, list[Run]] = {name: [] for name in names}
    order, fresh_nodes = list(names), FreshNodes(workload)
    for rep in range(reps):
        shuffler.shuffle(order)
        for name in order:
            run = run_variant(workload, VARIANTS[name], fresh_nodes)
            runs[name].append(run)
            log(
                f"  {workload.name} rep {rep + 1}/{reps} {name:<16} whole {run.whole:7.3f} s  "
                f"steady {run.steady:7.3f} s  loss {run.loss:.5g}"
            )
    return runs


def warm_up(names: list[str], log: Callable[[str], None]) -> None:
    """Every variant once on a tiny workload, untimed: one-time imports and set-up."""
    tiny = mlp_digits(quick=True)
    fresh_nodes = FreshNodes(tiny)
    for name in variants_of(tiny, names):
        run_variant(tiny, VARIANTS[name], fresh_nodes)
    log("  warmed up")


def auto_plan(workload: Workload) -> Plan:
    """The plan ``fit_auto`` runs (traced once here, untimed)."""
    trainer = make_trainer(workload, workload.nodes(), "auto")
    return trainer.plan_for(workload.data, workload.batch_size)


# -- reporting ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Medians:
    whole: float
    steady: float
    compile: float  # median of whole - steady
    loss: float


def medians(runs: list[Run]) -> Medians:
    return Medians(
        whole=statistics.median(r.whole for r in runs),
        steady=statistics.median(r.steady for r in runs),
        compile=statistics.median(r.whole - r.steady for r in runs),
        loss=statistics.median(r.loss for r in runs),
    )


def plan_label(plan: Plan) -> str:
    return plan.kind if plan.kind != "unrolled" else f"unrolled×{plan.steps_per_call}"


def variant_label(name: str, plan: Plan) -> str:
    return f"fit_auto ({plan_label(plan)})" if name == "fit_auto" else name


def workload_table(workload: Workload, result: dict[str, Medians], plan: Plan, reps: int) -> str:
    best = min(m.whole for m in result.values())
    lines = [
        f"**{workload.name}**: {workload.title}; {workload.steps:,} steps "
        f"({workload.epochs} epochs × {workload.steps_per_epoch}), medians of {reps}",
        "",
        "| variant | whole-run s | steady s | whole − steady s | ÷ best whole | final loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, m in result.items():
        lines.append(
            f"| {variant_label(name, plan)} | {m.whole:.3f} | {m.steady:.3f} | "
            f"{m.compile:.3f} | {m.whole / best:.2f}× | {m.loss:.5g} |"
        )
    return "\n".join(lines)


def ratio_to_best(result: dict[str, Medians], names: tuple[str, ...], attr: str) -> str:
    """fit_auto's time ÷ the best of ``names``; "—" when a side was not run."""
    others = [getattr(result[n], attr) for n in names if n in result]
    if "fit_auto" not in result or not others:
        return "—"
    return f"{getattr(result['fit_auto'], attr) / min(others):.2f}×"


def summary_table(rows: list[tuple[Workload, dict[str, Medians], Plan]]) -> str:
    lines = [
        "**Summary**: fit_auto's whole-run (and steady) median ÷ the best explicit plan "
        "(fit_scan, fit_step, fit_unrolled), ÷ the best of the Flax loops "
        "(nnx_jit, cached_partial, split_merge_jit, nnx_scan), ÷ Flax's nnx.scan alone, "
        "÷ the one-scan floor",
        "",
        "| workload | steps | auto plan | ÷ best plan | ÷ best recipe | ÷ nnx.scan "
        "| steady ÷ best plan | steady ÷ best recipe | steady ÷ nnx.scan | ÷ one scan |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, result, plan in rows:
        cells = [
            workload.name,
            f"{workload.steps:,}",
            plan_label(plan),
            ratio_to_best(result, PLANS, "whole"),
            ratio_to_best(result, RECIPES, "whole"),
            ratio_to_best(result, ("nnx_scan",), "whole"),
            ratio_to_best(result, PLANS, "steady"),
            ratio_to_best(result, RECIPES, "steady"),
            ratio_to_best(result, ("nnx_scan",), "steady"),
            ratio_to_best(result, ("one_scan",), "whole"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def header(args: argparse.Namespace) -> str:
    import flax
    import optax

    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    device = jax.devices()[0]
    mode = "quick mode (tiny sizes, NOT a measurement)" if args.quick else "full sizes"
    return (
        f"Whole-run benchmark, {mode}: jax {jax.__version__}, flax {flax.__version__}, "
        f"optax {optax.__version__}, Python {platform.python_version()}, backend "
        f"{jax.default_backend()} ({device.device_kind}), {cpu}. Each repetition runs every "
        f"variant once in a shuffled order, from empty compilation caches. whole = build the "
        f"step function or Trainer + train every step, compile included (the model's own "
        f"construction excluded); steady = the same run again in the same process, compiled; "
        f"final loss = the last epoch's mean training loss. The loops gather each batch from "
        f"the host data set; fit and one_scan take the whole host data set."
    )


# -- command line -------------------------------------------------------------------------


def parse_names(text: str, known: list[str], aliases: dict[str, list[str]], what: str):
    names = []
    for name in filter(None, (n.strip() for n in text.split(","))):
        if name not in known and name not in aliases:
            raise SystemExit(f"unknown {what} {name!r}; choose from {', '.join(known)}")
        names += aliases.get(name, [name])
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads", default="all",
        help=f"comma-separated, from: {', '.join(WORKLOADS)} (lm = lm_24,lm_200); default all",
    )  # fmt: skip
    parser.add_argument(
        "--variants", default="all", help=f"comma-separated, from: {', '.join(VARIANTS)}"
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument(
        "--quick", action="store_true", help="2 epochs of a few steps, 1 repetition: a smoke test"
    )
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args(argv)
    workload_names = parse_names(
        args.workloads, list(WORKLOADS),
        {"all": list(WORKLOADS), "lm": ["lm_24", "lm_200"]}, "workload",
    )  # fmt: skip
    variant_names = parse_names(args.variants, list(VARIANTS), {"all": list(VARIANTS)}, "variant")
    reps = 1 if args.quick else args.reps
    # A persistent compilation cache (JAX_COMPILATION_CACHE_DIR, or nnxscan's opt-in one)
    # would survive jax.clear_caches() and turn every run after the first into a warm one.
    jax.config.update("jax_enable_compilation_cache", False)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    started = time.perf_counter()
    sections = [header(args)]
    print(sections[0], "\n", flush=True)
    warm_up(variant_names, log)
    shuffler = random.Random(0)
    rows = []
    for name in workload_names:
        workload = WORKLOADS[name](args.quick)
        plan = auto_plan(workload)
        runs = bench(workload, variants_of(workload, variant_names), reps, shuffler, log)
        result = {variant: medians(r) for variant, r in runs.items()}
        rows.append((workload, result, plan))
        sections.append(workload_table(workload, result, plan, reps))
        print(sections[-1], "\n", flush=True)
    sections.append(summary_table(rows))
    print(sections[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(sections) + "\n")
    log(f"finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
