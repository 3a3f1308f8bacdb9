"""Where a whole run goes: each variant of ``bench_wholerun.py`` cut into its phases.

``bench_wholerun.py`` times whole runs; this says where their time goes, from JAX's own
instrumentation rather than from differences of wall clocks: ``jax.monitoring`` reports every
top-level trace (``/jax/core/compile/jaxpr_trace_duration``), every lowering to MLIR
(``.../jaxpr_to_mlir_module_duration``) and every XLA compile
(``.../backend_compile_duration``), each with the name of the function or program. Per run
(from empty compilation caches, as ``bench_wholerun.run_variant`` does with ``--optimizer
built``: the nodes and their ``nnx.Optimizer`` built before the clock) it records:

  set-up      building the step function or the Trainer (``nnx.jit(...)``, ``Trainer(...)``,
              Keras's ``model.compile(...)``), its own traces and compiles included
  trace       top-level traces during training (a jit nested in a trace is part of the
              outer one) ; ``n`` how many
  lower       lowerings to MLIR ; ``n`` programs
  compile     XLA compiles ; ``n`` programs, and the largest program's own time
  steady      the same run again, compiled (``bench_wholerun``'s steady)
  rest        whole - set-up - trace - lower - compile - steady: what the first run spends
              besides, on the host (data placement, first dispatches, caches filled)
  traced      how many times the user's function (``loss_fn`` or ``train_step``) ran in
              Python, i.e. was traced
  host reads  arrays fetched to the host (``np.asarray``/``float``/``device_get``: each a
              wait on the device unless another fetch waited already)

and, inside fit's traces, nnxscan's own parts (timed by wrapping nnxscan's internals here,
without changing them): the plan rule's probe (``plans.step_traits``: the step traced once,
no compile, its trace kept by jit for the program) and the convolution rewrite
(``canonical_conv_dimensions``, around the runner's trace on the CPU). Beside the runs: the
imports (each package's increment, in a new process), the model's construction (from
empty caches: its initializers compile) and a first evaluation (``Trainer.evaluate``, a
per-batch ``nnx.jit`` loop, Keras's ``evaluate``) with its compiles. Medians of ``--reps``
repetitions, each running every variant once in a shuffled order.

    python benchmarks/bench_phases.py --workloads mlp_digits,cnn_8x8 --out phases.md
    python benchmarks/bench_phases.py --profile fit_auto --workloads mlp_digits
    python benchmarks/bench_phases.py --quick
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import functools
import gc
import io
import os
import pstats
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import bench_wholerun as bw
import jax
import jax.monitoring
import numpy as np
from _keras_models import KerasRun, expressible, import_keras
from _workloads import WORKLOADS, Workload
from flax import nnx
from jax._src import array as jax_array
from jax._src.interpreters import pxla

from nnxscan.shell import Trainer
from nnxscan.shell._engine import placement as _placement
from nnxscan.shell._engine import programs as _programs

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
DEFAULT_VARIANTS = ["nnx_jit", "cached_partial", "split_merge_jit", "nnx_scan", "fit_auto"]


# -- instrumentation ------------------------------------------------------------------------


class Recorder:
    """Collects jax.monitoring events, host reads and nnxscan's parts, all the time;
    ``recording()`` yields what happened while its block ran (blocks may nest)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float]] = []
        self.parts: collections.Counter = collections.Counter()
        self.host_reads = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        value = jax_array.ArrayImpl._value

        def counted(array: Any) -> Any:
            if array._npy_value is None:
                self.host_reads += 1
            return value.fget(array)

        jax_array.ArrayImpl._value = property(counted)
        self._wrap_nnxscan()
        # Every XLA compile's inputs, to compile a program again on its own (compile_only).
        self.compiles: list[tuple[str, float, tuple]] = []
        compile_cached = pxla._cached_compilation

        def capturing(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return compile_cached(*args)
            finally:
                self.compiles.append((args[1], time.perf_counter() - started, args))

        capturing.cache_clear = compile_cached.cache_clear  # jax.clear_caches calls it
        pxla._cached_compilation = capturing
        self._compile_cached = compile_cached

    def largest_compile(self, first: int) -> tuple[str, tuple]:
        """The name and inputs of the longest compile since ``len(self.compiles)`` was
        ``first``; forgets every captured compile (they hold whole modules)."""
        name, _, args = max(self.compiles[first:], key=lambda c: c[1])
        self.compiles.clear()
        return name, args

    def compile_only(self, args: tuple) -> float:
        """Seconds XLA takes to compile a captured program again, from empty caches."""
        self._compile_cached.cache_clear()
        started = time.perf_counter()
        self._compile_cached(*args)
        return time.perf_counter() - started

    def _on_event(self, event: str, secs: float, **kwargs: Any) -> None:
        kind = EVENTS.get(event)
        if kind is not None:
            self.events.append((kind, str(kwargs.get("fun_name", "?")), secs))

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recording]:
        first, parts, reads = len(self.events), self.parts.copy(), self.host_reads
        record = Recording()
        started = time.perf_counter()
        try:
            yield record
        finally:
            record.wall = time.perf_counter() - started
            record.events = self.events[first:]
            record.parts = self.parts - parts
            record.host_reads = self.host_reads - reads

    def timed(self, part: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[part] += time.perf_counter() - started

        return wrapper

    def _wrap_nnxscan(self) -> None:
        """Times nnxscan's own parts of a fit by wrapping the internals that do them."""
        _programs.step_traits = self.timed("probe", _programs.step_traits)
        rewrite = _programs.canonical_conv_dimensions
        _programs.canonical_conv_dimensions = lambda fn: self.timed("conv rewrite", rewrite(fn))
        _placement.Placement.put_data = self.timed("data to device", _placement.Placement.put_data)


@dataclasses.dataclass
class Recording:
    wall: float = 0.0
    events: list = dataclasses.field(default_factory=list)
    parts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    host_reads: int = 0

    def total(self, kind: str) -> float:
        return sum(s for k, _, s in self.events if k == kind)

    def count(self, kind: str) -> int:
        return sum(1 for k, _, _ in self.events if k == kind)

    def programs(self, kind: str = "compile") -> dict[str, tuple[int, float]]:
        """``{function or program: (events, seconds)}`` of one kind of event."""
        out: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        for k, name, secs in self.events:
            if k == kind:
                out[name][0] += 1
                out[name][1] += secs
        return {k: (n, s) for k, (n, s) in out.items()}


@dataclasses.dataclass
class Phases:
    whole: float
    setup: float
    trace: float
    traces: int
    lower: float
    lowerings: int
    compile: float
    compiles: int
    largest: float  # the largest program's compile
    largest_name: str
    steady: float
    rest: float
    traced: int  # calls of the user's function
    host_reads: int
    parts: dict[str, float]
    programs: dict[str, dict[str, tuple[int, float]]]  # {kind: {name: (n, s)}}
    loss: float
    main_program: tuple | None  # (name, inputs of its XLA compile): the largest program


class CountedCalls:
    """The workload with its user functions counting their (tracing) calls."""

    def __init__(self, workload: Workload):
        self.calls = 0

        def counted(fn: Callable) -> Callable:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return fn(*args, **kwargs)

            return wrapper

        self.workload = dataclasses.replace(
            workload, loss_fn=counted(workload.loss_fn), train_step=counted(workload.train_step)
        )


def run_phases(recorder: Recorder, counted: CountedCalls, name: str, fresh: bw.FreshNodes):
    """One cold run of variant ``name`` and its steady rerun, cut into phases."""
    workload, variant = counted.workload, bw.VARIANTS[name]
    nodes = fresh()
    prepare = getattr(variant, "prepare", None)
    prepared = () if prepare is None else (prepare(workload, nodes),)
    gc.collect()
    jax.clear_caches()
    counted.calls = 0
    recorder.compiles.clear()
    with recorder.recording() as whole:
        with recorder.recording() as setup:
            train = variant(workload, nodes, *prepared)
        with recorder.recording() as training:
            loss = train()
            jax.block_until_ready(nnx.state(nodes))
    main_program = recorder.largest_compile(0)
    started = time.perf_counter()
    train()
    jax.block_until_ready(nnx.state(nodes))
    steady = time.perf_counter() - started
    trace, lower = training.total("trace"), training.total("lower")
    comp = training.total("compile")
    programs = {kind: whole.programs(kind) for kind in ("trace", "lower", "compile")}
    largest_name, (_, largest) = max(
        training.programs().items(), key=lambda kv: kv[1][1], default=("", (0, 0.0))
    )
    return Phases(
        whole=whole.wall, setup=setup.wall, trace=trace, traces=training.count("trace"),
        lower=lower, lowerings=training.count("lower"), compile=comp,
        compiles=training.count("compile"), largest=largest, largest_name=largest_name,
        steady=steady, rest=whole.wall - setup.wall - trace - lower - comp - steady,
        traced=counted.calls, host_reads=training.host_reads, parts=dict(whole.parts),
        programs=programs, loss=loss, main_program=main_program,
    )  # fmt: skip


def bench_runs(recorder: Recorder, workload: Workload, names: list[str], reps: int, shuffler, log):
    """``{variant: [Phases, ...]}``: every variant once per repetition, in a shuffled order."""
    counted, fresh = CountedCalls(workload), bw.FreshNodes(workload)
    runs: dict[str, list[Phases]] = {name: [] for name in names}
    order = list(names)
    for rep in range(reps):
        shuffler.shuffle(order)
        for name in order:
            p = run_phases(recorder, counted, name, fresh)
            if rep:  # the first repetition's program is the one compiled again
                p.main_program = None
            runs[name].append(p)
            log(
                f"  {workload.name} rep {rep + 1}/{reps} {name:<16} whole {p.whole:6.3f}  "
                f"setup {p.setup:5.3f}  trace {p.trace:5.3f}/{p.traces}  lower "
                f"{p.lower:5.3f}/{p.lowerings}  compile {p.compile:5.3f}/{p.compiles}  "
                f"steady {p.steady:6.3f}  rest {p.rest:6.3f}  traced {p.traced}  "
                f"reads {p.host_reads}  loss {p.loss:.5g}"
            )
    return runs


def compile_only(
    recorder: Recorder, runs: dict[str, list[Phases]], reps: int, shuffler
) -> dict[str, tuple[str, list[float]]]:
    """Each variant's largest program (captured in its first run) compiled again by XLA,
    ``reps`` times in shuffled orders: ``{variant: (program, [seconds, ...])}``. The same
    module every time, so this is XLA's compile alone, with less noise than whole runs."""
    programs = {name: ps[0].main_program for name, ps in runs.items() if ps[0].main_program}
    times: dict[str, list[float]] = {name: [] for name in programs}
    order = list(programs)
    for _ in range(reps):
        shuffler.shuffle(order)
        for name in order:
            times[name].append(recorder.compile_only(programs[name][1]))
    for ps in runs.values():
        ps[0].main_program = None
    return {name: (programs[name][0], times[name]) for name in programs}


# -- imports, construction, evaluation -------------------------------------------------------

_IMPORTS = {
    "nnxscan": (
        "jax (+ CPU backend)", "import jax; jax.devices()",
        "flax.nnx + optax", "from flax import nnx; import optax",
        "nnxscan.shell (Trainer)", "from nnxscan.shell import Trainer",
    ),
    "keras": (
        "jax (+ CPU backend)", "import jax; jax.devices()",
        "keras (JAX backend)", "import os; os.environ['KERAS_BACKEND'] = 'jax'; import keras",
    ),
}  # fmt: skip


def import_times(reps: int) -> dict[tuple[str, str], float]:
    """Each package's import increment in a new process (medians):
    ``{(process, package): seconds}``."""
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for _ in range(reps):
        for process, steps in _IMPORTS.items():
            labels, codes = steps[::2], steps[1::2]
            lines = ["import time", "t = [time.perf_counter()]"]
            for code in codes:
                lines += [code, "t.append(time.perf_counter())"]
            lines.append("print(' '.join(str(b - a) for a, b in zip(t, t[1:])))")
            out = subprocess.run(
                [sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True,
                check=True,
            ).stdout.split()  # fmt: skip
            for label, secs in zip(labels, out, strict=True):
                times[process, label].append(float(secs))
    return {key: statistics.median(v) for key, v in times.items()}


def construction(recorder: Recorder, workload: Workload, keras: Any) -> dict[str, Recording]:
    """The model's construction from empty caches (its initializers compile, as in a new
    process): Flax's model + ``nnx.Optimizer``, and Keras's model where it has one."""
    out = {}
    gc.collect()
    jax.clear_caches()
    with recorder.recording() as flax_build:
        nodes = workload.nodes()
        jax.block_until_ready(nnx.state(nodes))
    out["flax"] = flax_build
    if keras is not None and expressible(workload):
        run = KerasRun(keras, workload)
        gc.collect()
        jax.clear_caches()
        with recorder.recording() as keras_build:
            model = run.build(nodes, copy_weights=False)
            jax.block_until_ready([v.value for v in model.variables])
        out["keras"] = keras_build
    return out


def eval_loss(workload: Workload) -> Callable:
    """``loss(model, batch)``: the workload's loss, without the tutorial's aux."""
    has_aux = workload.trainer_options(workload.nodes()).get("has_aux", False)

    def loss(model: Any, batch: Any) -> Any:
        out = workload.loss_fn(model, batch)
        return out[0] if has_aux else out

    return loss


def in_order(workload: Workload) -> Iterator[Any]:
    """The data set's batches in stored order, sliced on the host."""
    b = workload.batch_size
    for i in range(workload.num_examples // b):
        yield jax.tree.map(lambda a, i=i: a[i * b : (i + 1) * b], workload.data)


def evaluations(recorder: Recorder, workload: Workload, keras: Any) -> dict[str, tuple]:
    """A first evaluation of the mean loss over the data set (compile included) and a
    second one: ``{way: (first Recording, second seconds, loss)}``."""
    fresh, loss, out = bw.FreshNodes(workload), eval_loss(workload), {}

    def cold() -> Any:
        nodes = fresh()
        gc.collect()
        jax.clear_caches()
        return nodes

    nodes = cold()
    trainer = Trainer(nodes[0], nodes[1], workload.loss_fn, **workload.trainer_options(nodes))

    def with_trainer() -> float:
        return float(trainer.evaluate(workload.data, loss, batch_size=workload.batch_size)["loss"])

    out["Trainer.evaluate"] = _twice(recorder, with_trainer)

    nodes = cold()
    model = nnx.clone(nodes[0])
    model.eval()
    step = nnx.jit(loss)

    def flax_loop() -> float:
        return float(np.mean(jax.device_get([step(model, b) for b in in_order(workload)])))

    out["nnx.jit loop"] = _twice(recorder, flax_loop)

    if keras is not None and expressible(workload):
        nodes, run = cold(), KerasRun(keras, workload)
        run.build(nodes)
        run.compile(1)
        x, y = (
            workload.data[k]
            for k in (("image", "label") if "image" in workload.data else ("x", "y"))
        )

        def keras_evaluate() -> float:
            result = run.model.evaluate(x, y, batch_size=workload.batch_size, verbose=0)
            return float(result[0] if isinstance(result, list) else result)

        out["Keras evaluate"] = _twice(recorder, keras_evaluate)
    return out


def _twice(recorder: Recorder, evaluate: Callable[[], float]) -> tuple:
    with recorder.recording() as first:
        value = evaluate()
    started = time.perf_counter()
    evaluate()
    return first, time.perf_counter() - started, value


# -- reporting ------------------------------------------------------------------------------


def med(values: Any) -> float:
    return statistics.median(list(values))


def phases_table(workload: Workload, runs: dict[str, list[Phases]], reps: int) -> str:
    lines = [
        f"**{workload.name}**: {workload.title}; {workload.steps:,} steps "
        f"({workload.epochs} epochs × {workload.steps_per_epoch}); medians of {reps}, each "
        f"column on its own (so they need not add up to the whole)",
        "",
        "| variant | whole s | set-up s | trace s (n) | lower s (n) | XLA compile s (n) "
        "| largest program s | steady s | rest s | user fn traced | host reads |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, ps in runs.items():

        def s(attr: str, ps: list[Phases] = ps) -> float:
            return med(getattr(p, attr) for p in ps)

        def n(attr: str, ps: list[Phases] = ps) -> int:
            return round(s(attr, ps))

        keras = name.startswith("keras")  # NumPy reads Keras's arrays by the buffer protocol
        traced, reads = ("—", "—") if keras else (str(n("traced")), str(n("host_reads")))
        lines.append(
            f"| {name} | {s('whole'):.3f} | {s('setup'):.3f} | {s('trace'):.3f} ({n('traces')}) "
            f"| {s('lower'):.3f} ({n('lowerings')}) | {s('compile'):.3f} ({n('compiles')}) "
            f"| {s('largest'):.3f} | {s('steady'):.3f} | {s('rest'):.3f} | {traced} | {reads} |"
        )
    for name, ps in runs.items():
        if name.startswith("fit"):
            lines += ["", f"{name}, inside: {fit_details(ps)}."]
    return "\n".join(lines)


def compile_table(rows: list[tuple[Workload, dict[str, tuple[str, list[float]]]]]) -> str:
    names = list(dict.fromkeys(n for _, result in rows for n in result))
    lines = [
        "**XLA compile of each variant's largest program alone** (the module its run "
        "compiled, compiled again from empty caches; medians of interleaved repetitions), s",
        "",
        "| workload | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for workload, result in rows:
        cells = [f"{med(result[n][1]):.3f}" if n in result else "—" for n in names]
        lines.append(f"| {workload.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fit_details(ps: list[Phases]) -> str:
    """nnxscan's own parts of a fit, then its traces, lowerings and compiles by name."""
    parts = sorted({k for p in ps for k in p.parts})
    text = ", ".join(f"{k} {med(p.parts.get(k, 0.0) for p in ps):.3f} s" for k in parts)
    for kind, label in (("trace", "traced"), ("lower", "lowered"), ("compile", "compiled")):
        names = {k for p in ps for k in p.programs[kind]}

        def secs(k: str, kind=kind) -> float:
            return med(p.programs[kind].get(k, (0, 0.0))[1] for p in ps)

        listed = ", ".join(
            f"`{k}` {round(med(p.programs[kind].get(k, (0, 0))[0] for p in ps))}× {secs(k):.3f} s"
            for k in sorted(names, key=lambda k: -secs(k))
        )
        text += f"; {label}: {listed}"
    return text


def summary_table(rows: list[tuple[Workload, dict[str, list[Phases]]]]) -> str:
    lines = [
        "**Summary**: fit_auto against the best Flax loop and Keras's best (medians of whole "
        "runs); fit's phases minus that loop's",
        "",
        "| workload | fit s | best Flax loop s | fit ÷ loop | Keras best s | fit ÷ Keras "
        "| Δ set-up s | Δ trace+lower s | Δ compile s | Δ steady s | Δ rest s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, runs in rows:
        if "fit_auto" not in runs:
            continue
        whole = {name: med(p.whole for p in ps) for name, ps in runs.items()}
        loops = [n for n in bw.RECIPES if n in runs]
        kerases = [n for n in bw.KERAS if n in runs]
        fit = runs["fit_auto"]
        cells = [workload.name, f"{whole['fit_auto']:.3f}"]
        if loops:
            best = min(loops, key=whole.get)
            cells += [f"{whole[best]:.3f} ({best})", f"{whole['fit_auto'] / whole[best]:.2f}×"]
        else:
            cells += ["—", "—"]
        if kerases:
            kbest = min(kerases, key=whole.get)
            cells += [f"{whole[kbest]:.3f} ({kbest})", f"{whole['fit_auto'] / whole[kbest]:.2f}×"]
        else:
            cells += ["—", "—"]
        if loops:
            loop = runs[best]

            def delta(f: Callable[[Phases], float], loop=loop, fit=fit) -> str:
                return f"{med(map(f, fit)) - med(map(f, loop)):+.3f}"

            cells += [
                delta(lambda p: p.setup), delta(lambda p: p.trace + p.lower),
                delta(lambda p: p.compile), delta(lambda p: p.steady), delta(lambda p: p.rest),
            ]  # fmt: skip
        else:
            cells += ["—"] * 5
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def imports_table(times: dict[tuple[str, str], float]) -> str:
    lines = ["**Imports** (each a new process; medians)", "", "| process | import | s |",
             "|---|---|---:|"]  # fmt: skip
    lines += [f"| {proc} | {label} | {s:.3f} |" for (proc, label), s in times.items()]
    return "\n".join(lines)


def construction_table(rows: list[tuple[Workload, list[dict[str, Recording]]]]) -> str:
    lines = [
        "**Model construction** from empty caches (the initializers compile; medians): "
        "seconds (XLA compiles n, s)",
        "",
        "| workload | Flax model + nnx.Optimizer | Keras model |",
        "|---|---:|---:|",
    ]
    for workload, recs in rows:
        cells = [workload.name]
        for key in ("flax", "keras"):
            got = [r[key] for r in recs if key in r]
            if not got:
                cells.append("—")
                continue
            cells.append(
                f"{med(r.wall for r in got):.3f} ({round(med(r.count('compile') for r in got))}, "
                f"{med(r.total('compile') for r in got):.3f})"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def evaluation_table(rows: list[tuple[Workload, list[dict[str, tuple]]]]) -> str:
    lines = [
        "**A first evaluation** (mean loss over the data set; medians): the first call "
        "(compile included), its trace / lower / compile, and a second call",
        "",
        "| workload | way | first s | trace s (n) | lower s (n) | XLA compile s (n) "
        "| second s | loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, recs in rows:
        for way in recs[0]:
            got = [r[way] for r in recs]
            first = [g[0] for g in got]
            phases = [
                f"{med(r.total(k) for r in first):.3f} ({round(med(r.count(k) for r in first))})"
                for k in ("trace", "lower", "compile")
            ]
            lines.append(
                f"| {workload.name} | {way} | {med(r.wall for r in first):.3f} | "
                + " | ".join(phases)
                + f" | {med(g[1] for g in got):.3f} | {med(g[2] for g in got):.4g} |"
            )
    return "\n".join(lines)


def profile(workload: Workload, name: str, top: int = 30) -> str:
    """A cProfile of one cold run of variant ``name``: nnxscan's functions by cumulative
    time (for finding set-up costs; the profiler slows Python, not XLA)."""
    variant, fresh = bw.VARIANTS[name], bw.FreshNodes(workload)
    nodes = fresh()
    gc.collect()
    jax.clear_caches()
    profiler = cProfile.Profile()
    profiler.enable()
    variant(workload, nodes)()
    jax.block_until_ready(nnx.state(nodes))
    profiler.disable()
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer).sort_stats("cumulative")
    stats.print_stats(r"nnxscan|/pure/|/shell/|/adapters/|canonical|pjit|pxla|compiler", top)
    return buffer.getvalue()


# -- command line -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="all", help=f"from: {', '.join(WORKLOADS)}")
    parser.add_argument(
        "--variants", default="default",
        help=f"from: {', '.join(bw.VARIANTS)}; default: {', '.join(DEFAULT_VARIANTS)} and Keras's",
    )  # fmt: skip
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--compile-reps", type=int, default=5,
        help="compiles of each variant's largest program alone (0: none); default 5",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition")
    parser.add_argument("--skip", default="", help="comma-separated: imports,construction,eval")
    parser.add_argument("--profile", help="print a cProfile of one cold run of this variant")
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args(argv)
    names = list(WORKLOADS) if args.workloads == "all" else args.workloads.split(",")
    default = DEFAULT_VARIANTS + [k for k in bw.KERAS if k in bw.VARIANTS]
    variants = default if args.variants == "default" else args.variants.split(",")
    skip = set(filter(None, args.skip.split(",")))
    reps = 1 if args.quick else args.reps
    jax.config.update("jax_enable_compilation_cache", False)
    keras = import_keras()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    started = time.perf_counter()
    if args.profile:
        for name in names:
            print(profile(WORKLOADS[name](args.quick), args.profile))
        return
    recorder = Recorder()
    bw.warm_up(variants, log, "built")
    header = (
        f"Phases of whole runs: jax {jax.__version__}, {jax.default_backend()}, "
        f"{os.cpu_count()} cores{', QUICK (not a measurement)' if args.quick else ''}."
    )
    sections = [header]
    if "imports" not in skip:
        sections.append(imports_table(import_times(reps)))
        print(sections[-1], "\n", flush=True)
    shuffler = random.Random(0)
    built, evaluated, rows, compiled = [], [], [], []
    for name in names:
        workload = WORKLOADS[name](args.quick)
        if "construction" not in skip:
            built.append((workload, [construction(recorder, workload, keras) for _ in range(reps)]))
        runs = bench_runs(
            recorder, workload, bw.variants_of(workload, variants), reps, shuffler, log
        )
        rows.append((workload, runs))
        sections.append(phases_table(workload, runs, reps))
        print(sections[-1], "\n", flush=True)
        if args.compile_reps:
            compiled.append((workload, compile_only(recorder, runs, args.compile_reps, shuffler)))
            log(compile_table(compiled[-1:]))
        if "eval" not in skip:
            evaluated.append(
                (workload, [evaluations(recorder, workload, keras) for _ in range(reps)])
            )
    if compiled:
        sections.append(compile_table(compiled))
    if built:
        sections.append(construction_table(built))
    if evaluated:
        sections.append(evaluation_table(evaluated))
    sections.append(summary_table(rows))
    for section in sections[-4:]:
        print(section, "\n", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(sections) + "\n")
    log(f"finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
