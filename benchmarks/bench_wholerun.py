"""Whole-run speed: each workload as its authors wrote it, and through nnxscan, compile included.

What a user feels is the time from starting a training script to a trained model, compile
included. For every workload of ``_workloads.py`` this times, in one process:

  nnx_jit          the authors' ``train_step`` under ``nnx.jit``, called once per batch
                   (the Flax NNX tutorial; recipe 1 of Flax's performance guide)
  cached_partial   the same step through ``nnx.cached_partial(step, *nodes)`` (recipe 2)
  split_merge_jit  ``nnx.split`` once, ``jax.jit`` with the state donated, ``nnx.merge``
                   inside the step, ``nnx.update`` after each epoch (recipe 3)
  fit_auto, fit_scan, fit_step, fit_unrolled
                   ``Trainer(model, tx, loss_fn).fit(data, epochs=E, batch_size=B)`` with
                   each execution plan, given the optax transform as the README does (the
                   tutorial CNN ported as docs/porting.md shows: ``has_aux``, ``rngs``,
                   ``metrics``, ``update_metrics``)
  fit_optimizer    ``fit_auto`` given an ``nnx.Optimizer`` built as the loops build theirs
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

Timing. Each repetition runs every variant once, in a new shuffled order. Each run starts
as a new process does: ``jax.clear_caches()`` empties every compilation cache, then the
model is built (untimed: its initializers compile as they would in a script, and stay
cached), and the clock starts with the built model, as it does for Keras's
``model.compile`` + ``fit``:

  whole   from the built model to the trained model with every step done (blocked on),
          compile included: the optimizer's construction (the loops' ``nnx.Optimizer``
          and its state; ``fit_auto`` gets the optax transform and builds the state
          itself), the step function (``nnx.jit(...)``, ``Trainer(...)``, ...), every step;
  steady  the same run once more in the same process, on the same objects with the same
          compiled functions (for fit: a second ``fit`` call on the same Trainer, which
          trains the next epochs): compile excluded.

``whole - steady`` is about what compiling (and tracing) costs. Each workload runs in a
process of its own, as a training script does: what one workload's variants import or
leave behind (Keras, whose import slowed every later run of a process by ~10%, a larger
heap) does not slow another's (``--one-process`` runs every workload in this one). Before
its repetitions each of the workload's variants runs once on a tiny workload, untimed, so
one-time imports and set-up land in no timing. Medians over ``--reps`` repetitions; the
summary's ``paired`` column is the median over repetitions of ``fit_auto`` ÷ that
repetition's fastest Flax loop (the runs of one repetition ran back to back).

``--optimizer built`` times what earlier tables timed: every variant gets a copy of one
untrained set of nodes with its ``nnx.Optimizer`` already built (untimed, compiled caches
emptied after), ``fit_auto`` that ``nnx.Optimizer``.

    python benchmarks/bench_wholerun.py --out wholerun.md
    python benchmarks/bench_wholerun.py --workloads cnn_8x8,lm --reps 5
    python benchmarks/bench_wholerun.py --quick          # tiny sizes, checks it runs
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
from _keras_models import expressible, keras_installed, keras_variant
from _workloads import WORKLOADS, Nodes, Workload, mlp_digits, optimizer_of, with_optimizer
from flax import nnx

from nnxscan.pure import init_opt_state, make_train_step
from nnxscan.shell import Plan, Trainer

# A variant builds, from a workload and fresh nodes, ``train()``: it trains the whole run on
# the nodes and returns the last epoch's mean training loss. Building is timed with it. The
# nodes' optimizer slot is None when the run builds its optimizer itself (timed).
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
    nodes = with_optimizer(nodes, workload.make_tx())
    step = nnx.jit(workload.train_step)
    return per_step_loop(workload, nodes, lambda batch: step(*nodes, batch))


def cached_partial(workload: Workload, nodes: Nodes) -> Train:
    nodes = with_optimizer(nodes, workload.make_tx())
    step = nnx.cached_partial(nnx.jit(workload.train_step), *nodes)
    return per_step_loop(workload, nodes, step)


def split_merge_jit(workload: Workload, nodes: Nodes) -> Train:
    nodes = with_optimizer(nodes, workload.make_tx())
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
    nodes = with_optimizer(nodes, workload.make_tx())

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


def make_trainer(
    workload: Workload, nodes: Nodes, execution: str, nnx_optimizer: bool = False
) -> Trainer:
    """A Trainer of the nodes' model: given their ``nnx.Optimizer`` when they hold one, else
    a new optax transform (the README's way) or, with ``nnx_optimizer``, an
    ``nnx.Optimizer`` built here as the loops build theirs."""
    model, optimizer = nodes[:2]
    if optimizer is None:
        tx = workload.make_tx()
        optimizer = optimizer_of(model, tx) if nnx_optimizer else tx
    options = workload.trainer_options(nodes)
    return Trainer(model, optimizer, workload.loss_fn, execution=execution, **options)


def fit(execution: str, nnx_optimizer: bool = False) -> Variant:
    def variant(workload: Workload, nodes: Nodes) -> Train:
        trainer = make_trainer(workload, nodes, execution, nnx_optimizer)

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
    tx = workload.make_tx() if optimizer is None else optimizer.tx
    step = make_train_step(workload.loss_fn, tx)

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
        opt_state = init_opt_state(tx, state)
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
    "fit_optimizer": fit("auto", nnx_optimizer=True),
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


class BuiltModel:
    """Fresh nodes without an optimizer, the model built right after the caches are emptied
    (``--optimizer timed``): what a script has when its model exists. Its initializers'
    programs stay cached, as in that script (the zeros of a bias shape, say, which an
    ``nnx.Optimizer`` then finds compiled); each run builds its optimizer itself, timed."""

    builds_after_clearing = True

    def __init__(self, workload: Workload):
        self.workload = workload

    def __call__(self) -> Nodes:
        return self.workload.model_nodes()


def cold_run(workload: Workload, variant: Variant, fresh_nodes: FreshNodes | BuiltModel):
    """``(seconds, final loss, train, nodes)``: one whole run from empty in-memory
    compilation caches, on fresh nodes (``train()`` runs it again).

    A variant with a ``prepare(workload, nodes)`` (Keras) builds its own model from the
    nodes there, untimed, and gets it as a third argument."""
    prepare = getattr(variant, "prepare", None)
    build_after_clearing = getattr(fresh_nodes, "builds_after_clearing", False)
    if build_after_clearing:
        _empty_caches()
    nodes = fresh_nodes()
    prepared = () if prepare is None else (prepare(workload, nodes),)
    if build_after_clearing:
        _block_on(nodes)
    else:
        _empty_caches()

    start = time.perf_counter()
    train = variant(workload, nodes, *prepared)
    loss = train()
    _block_on(nodes)
    return time.perf_counter() - start, loss, train, nodes


def _empty_caches() -> None:
    gc.collect()
    jax.clear_caches()


def _block_on(nodes: Nodes) -> None:
    """Waits for the nodes' arrays (an optimizer a run builds itself is not among them; its
    state comes out of the same programs as the model's)."""
    jax.block_until_ready(nnx.state([n for n in nodes if n is not None]))


def run_variant(workload: Workload, variant: Variant, fresh_nodes: FreshNodes | BuiltModel) -> Run:
    """One whole run from empty compilation caches, then the same run again, compiled."""
    whole, loss, train, nodes = cold_run(workload, variant, fresh_nodes)
    start = time.perf_counter()
    train()
    _block_on(nodes)
    steady = time.perf_counter() - start
    return Run(whole, steady, loss)


def fresh_nodes_for(workload: Workload, optimizer: str) -> FreshNodes | BuiltModel:
    """What each run starts from: the built model (``"timed"``), or a copy of untrained
    nodes whose ``nnx.Optimizer`` is built (``"built"``)."""
    return BuiltModel(workload) if optimizer == "timed" else FreshNodes(workload)


def bench(
    workload: Workload,
    names: list[str],
    reps: int,
    shuffler: random.Random,
    log,
    optimizer: str = "timed",
):
    """``{variant: [Run, ...]}``: every variant once per repetition, in a shuffled order."""
    runs: dict[str, list[Run]] = {name: [] for name in names}
    order, fresh_nodes = list(names), fresh_nodes_for(workload, optimizer)
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


def warm_up(names: list[str], log: Callable[[str], None], optimizer: str = "timed") -> None:
    """Every variant once on a tiny workload, untimed: one-time imports and set-up."""
    tiny = mlp_digits(quick=True)
    fresh_nodes = fresh_nodes_for(tiny, optimizer)
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


def ratio_to_best(
    result: dict[str, Medians], names: tuple[str, ...], attr: str, who: str = "fit_auto"
) -> str:
    """``who``'s time ÷ the best of ``names``; "—" when a side was not run."""
    others = [getattr(result[n], attr) for n in names if n in result]
    if who not in result or not others:
        return "—"
    return f"{getattr(result[who], attr) / min(others):.2f}×"


def paired_to_best(
    runs: dict[str, list[Run]], names: tuple[str, ...], who: str = "fit_auto"
) -> str:
    """Median over repetitions of ``who``'s whole run ÷ that repetition's fastest of
    ``names`` (every variant ran once per repetition, back to back); "—" when a side was
    not run."""
    others = [runs[n] for n in names if n in runs]
    if who not in runs or not others:
        return "—"
    ratios = [mine.whole / min(o[i].whole for o in others) for i, mine in enumerate(runs[who])]
    return f"{statistics.median(ratios):.2f}×"


def summary_table(rows: list[tuple[Workload, dict[str, list[Run]], Plan]]) -> str:
    lines = [
        "**Summary**: fit_auto's whole-run (and steady) median ÷ the best explicit plan "
        "(fit_scan, fit_step, fit_unrolled), ÷ the best of the Flax loops "
        "(nnx_jit, cached_partial, split_merge_jit, nnx_scan), ÷ Flax's nnx.scan alone, "
        "÷ Keras's better fit (keras, keras_spe), ÷ the one-scan floor; fit_optimizer's "
        "÷ the best Flax loop; paired: the median of each repetition's ratio",
        "",
        "| workload | steps | auto plan | ÷ best plan | ÷ best recipe | paired ÷ best recipe "
        "| ÷ nnx.scan | ÷ Keras | paired ÷ Keras | steady ÷ best plan | steady ÷ best recipe "
        "| steady ÷ nnx.scan | ÷ one scan | fit_optimizer ÷ best recipe |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, runs, plan in rows:
        result = {variant: medians(r) for variant, r in runs.items()}
        cells = [
            workload.name,
            f"{workload.steps:,}",
            plan_label(plan),
            ratio_to_best(result, PLANS, "whole"),
            ratio_to_best(result, RECIPES, "whole"),
            paired_to_best(runs, RECIPES),
            ratio_to_best(result, ("nnx_scan",), "whole"),
            ratio_to_best(result, KERAS, "whole"),
            paired_to_best(runs, KERAS),
            ratio_to_best(result, PLANS, "steady"),
            ratio_to_best(result, RECIPES, "steady"),
            ratio_to_best(result, ("nnx_scan",), "steady"),
            ratio_to_best(result, ("one_scan",), "whole"),
            ratio_to_best(result, RECIPES, "whole", who="fit_optimizer"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def header(args: argparse.Namespace) -> str:
    import flax
    import optax

    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    device = jax.devices()[0]
    mode = "quick mode (tiny sizes, NOT a measurement)" if args.quick else "full sizes"
    if args.optimizer == "timed":
        start = (
            "The model is built after the caches are emptied (untimed, its initializers "
            "compiled as in a script); whole = from the built model to the trained model: "
            "the optimizer (the loops' nnx.Optimizer; fit_auto is given the optax transform), "
            "the step function or Trainer, every step, compile included"
        )
    else:
        start = (
            "whole = build the step function or Trainer + train every step, compile "
            "included (the model and its nnx.Optimizer built before, untimed)"
        )
    return (
        f"Whole-run benchmark, {mode}: jax {jax.__version__}, flax {flax.__version__}, "
        f"optax {optax.__version__}, Python {platform.python_version()}, backend "
        f"{jax.default_backend()} ({device.device_kind}), {cpu}. Each repetition runs every "
        f"variant once in a shuffled order, from empty compilation caches, each workload "
        f"in {'this one process' if args.one_process else 'a process of its own'}. "
        f"{start}; steady = "
        f"the same run again in the same process, compiled; final loss = the last epoch's "
        f"mean training loss. The loops gather each batch from the host data set; fit and "
        f"one_scan take the whole host data set."
    )


# -- command line -------------------------------------------------------------------------


def bench_workload(
    workload: Workload, variant_names: list[str], reps: int, seed: int,
    args: argparse.Namespace, log, warmed: bool = False,
) -> tuple[dict[str, list[Run]], Plan]:  # fmt: skip
    """One workload's runs in this process (orders shuffled from ``seed``), and the plan
    ``fit_auto`` runs. Unless ``warmed``, its variants are warmed up first (only those: a
    variant the workload does not run, Keras's, is not imported for it)."""
    names = variants_of(workload, variant_names)
    if not warmed:
        warm_up(names, log, args.optimizer)
    plan = auto_plan(workload)
    return bench(workload, names, reps, random.Random(seed), log, args.optimizer), plan


def bench_in_child(
    name: str, variant_names: list[str], reps: int, seed: int, args: argparse.Namespace,
    env: dict,
) -> tuple[dict[str, list[Run]], Plan]:  # fmt: skip
    """:func:`bench_workload` in a new Python process with environment ``env`` (its log on
    this one's stderr; its runs on the last line of its stdout)."""
    command = [
        sys.executable, os.path.abspath(__file__), "--child", name,
        "--variants", ",".join(variant_names), "--reps", str(reps),
        "--optimizer", args.optimizer, "--seed", str(seed),
    ] + (["--quick"] if args.quick else [])  # fmt: skip
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, env=env)
    data = json.loads(done.stdout.strip().splitlines()[-1])
    runs = {v: [Run(*r) for r in rs] for v, rs in data["runs"].items()}
    return runs, Plan(*data["plan"])


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
    parser.add_argument(
        "--optimizer", choices=("timed", "built"), default="timed",
        help="timed (default): each run starts from the built model and builds its "
        "optimizer, timed; built: every variant gets an nnx.Optimizer built untimed",
    )  # fmt: skip
    parser.add_argument(
        "--one-process", action="store_true",
        help="run every workload in this process (default: each in a new one)",
    )  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one workload, runs as JSON
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    workload_names = parse_names(
        args.workloads, list(WORKLOADS),
        {"all": list(WORKLOADS), "lm": ["lm_24", "lm_200"]}, "workload",
    )  # fmt: skip
    variant_names = parse_names(args.variants, list(VARIANTS), {"all": list(VARIANTS)}, "variant")
    if args.optimizer == "built":  # fit_optimizer is fit_auto there: both get the nodes' one
        variant_names = [v for v in variant_names if v != "fit_optimizer"]
    reps = 1 if args.quick else args.reps
    # A persistent compilation cache (JAX_COMPILATION_CACHE_DIR, or nnxscan's opt-in one)
    # would survive jax.clear_caches() and turn every run after the first into a warm one.
    jax.config.update("jax_enable_compilation_cache", False)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.child:  # one workload in this process, for the parent: its runs as JSON
        workload = WORKLOADS[args.child](args.quick)
        runs, plan = bench_workload(workload, variant_names, reps, args.seed, args, log)
        as_lists = {v: [dataclasses.astuple(r) for r in rs] for v, rs in runs.items()}
        print(json.dumps({"runs": as_lists, "plan": list(plan)}), flush=True)
        return

    child_env = dict(os.environ)  # the children's, as given: they run the benchmark
    if not args.one_process:
        # This process only reads the device's name: on a GPU it must not take the
        # memory its children will need (JAX preallocates most of it on first use).
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    started = time.perf_counter()
    sections = [header(args)]
    print(sections[0], "\n", flush=True)
    rows = []
    if args.one_process:
        warm_up(variant_names, log, args.optimizer)
    for seed, name in enumerate(workload_names):
        workload = WORKLOADS[name](args.quick)
        if args.one_process:
            runs, plan = bench_workload(workload, variant_names, reps, seed, args, log, True)
        else:
            runs, plan = bench_in_child(name, variant_names, reps, seed, args, child_env)
        result = {variant: medians(r) for variant, r in runs.items()}
        rows.append((workload, runs, plan))
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
