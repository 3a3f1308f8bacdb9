"""PPO's compile against PureJaxRL's: trace, lower and XLA compile times, program sizes.

The 1-seed whole run of ``nnxscan demo ppo`` is mostly compiling (a few seconds of a
~7 s run on 2 cores), so its gap to PureJaxRL's ``ppo.py`` is a compile gap. This builds,
in a fresh process per measurement (cold caches), ``jax.jit(jax.vmap(train))`` over N keys
as the demo runs it (``--no-vmap``: ``jax.jit(train)`` on one key, as PureJaxRL's own
``__main__`` runs it) and reports:

  trace, lower       tracing to a jaxpr, lowering to StableHLO (wall s);
  compile            XLA's compile of the lowered program (wall s, and the process's CPU s:
                     on a shared machine the CPU seconds move far less with the load);
  run                the compiled call, blocked on (wall s);
  whole              trace to result (wall s, and the process's CPU s);
  size               StableHLO ops and ``while`` loops of the lowered program; instructions,
                     ``while`` loops and fusions of the optimized HLO XLA compiled.

Variants: ``nnxscan`` (this tree's ``make_ppo_train``), ``PureJaxRL`` (``--purejaxrl DIR``,
see ``bench_ppo.py``) and, with ``--baseline DIR``, ``baseline``: ``make_ppo_train`` of
another source tree of this repository (``git archive <rev> | tar -x -C DIR``), to show a
change's effect paired with the tree it changes. Rounds run every variant once, in a new
shuffled order; medians, and the ratios to PureJaxRL (or the baseline) as the median of
the rounds' paired ratios.

    python benchmarks/bench_ppo_compile.py --purejaxrl DIR --seeds 1 16 --rounds 5
    python benchmarks/bench_ppo_compile.py --purejaxrl DIR --baseline /tmp/before --rounds 5
    python benchmarks/bench_ppo_compile.py --quick      # 1 round, 1 seed, 8 updates: it runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time


def use_source_tree(root: str) -> None:
    """Import ``nnxscan`` from ``root``, another checkout of this repository, in place of
    the installed (editable) one: its finder's package folders are rewritten."""
    for finder in sys.meta_path:
        mapping = getattr(sys.modules.get(getattr(finder, "__module__", "")), "MAPPING", None)
        if isinstance(mapping, dict) and "nnxscan.pure" in mapping:
            here = os.path.dirname(mapping["nnxscan.pure"])
            for name, path in mapping.items():
                mapping[name] = os.path.join(os.path.abspath(root), os.path.relpath(path, here))
            return
    raise RuntimeError("no editable install of nnxscan found to redirect (pip install -e .)")


def child(variant: str, seeds: int, updates: int, vmap: bool, purejaxrl: str | None) -> dict:
    if variant == "baseline":
        use_source_tree(os.environ["BENCH_PPO_BASELINE"])
    import jax
    from bench_ppo import load_purejaxrl, ours, theirs

    from nnxscan.shell.demos.ppo import PPOConfig

    jax.numpy.zeros(()).block_until_ready()  # the backend starts before the clock
    compile_events = [0.0]

    def on_duration(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compile_events[0] += seconds

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    config = PPOConfig(total_timesteps=updates * 4 * 128)
    if variant == "PureJaxRL":
        train, returns = theirs(load_purejaxrl(purejaxrl), config)
        keys = jax.numpy.stack([jax.random.PRNGKey(s) for s in range(seeds)])
    else:
        train, returns = ours(config)
        keys = jax.numpy.stack([jax.random.key(s) for s in range(seeds)])
    if vmap:
        program = jax.jit(jax.vmap(train))
    else:
        program, keys = jax.jit(train), keys[0]
    t0, cpu0 = time.perf_counter(), time.process_time()
    traced = program.trace(keys)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2, cpu2 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t3, cpu3 = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(compiled(keys))
    t4, cpu4 = time.perf_counter(), time.process_time()
    mlir, hlo = lowered.as_text(), compiled.as_text()
    return {
        "trace": t1 - t0,
        "lower": t2 - t1,
        "compile": t3 - t2,
        "compile_cpu": cpu3 - cpu2,
        "xla_events": compile_events[0],
        "run": t4 - t3,
        "whole": t4 - t0,
        "whole_cpu": cpu4 - cpu0,
        "return": float(returns(out)[..., -10:].mean()),
        "stablehlo_ops": len(re.findall(r"= stablehlo\.|^\s*stablehlo\.", mlir, re.M)),
        "stablehlo_while": mlir.count("stablehlo.while"),
        "hlo_instructions": len(re.findall(r"^\s*(ROOT )?%?\S+ = ", hlo, re.M)),
        "hlo_while": len(re.findall(r" while\(", hlo)),
        "hlo_fusions": len(re.findall(r" fusion\(", hlo)),
    }


COLUMNS = (
    ("trace", "trace (s)", ".2f"),
    ("lower", "lower (s)", ".2f"),
    ("compile", "compile (s)", ".2f"),
    ("compile_cpu", "compile CPU (s)", ".2f"),
    ("run", "run (s)", ".2f"),
    ("whole", "whole (s)", ".2f"),
    ("whole_cpu", "whole CPU (s)", ".2f"),
    ("stablehlo_ops", "StableHLO ops", ".0f"),
    ("stablehlo_while", "while", ".0f"),
    ("hlo_instructions", "HLO instrs", ".0f"),
    ("hlo_while", "HLO while", ".0f"),
    ("hlo_fusions", "fusions", ".0f"),
    ("return", "return", ".1f"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=976)
    parser.add_argument("--no-vmap", dest="vmap", action="store_false")
    parser.add_argument("--purejaxrl", metavar="DIR", help="folder with PureJaxRL's ppo.py")
    parser.add_argument("--baseline", metavar="DIR", help="another source tree of nnxscan")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "SEEDS"))
    args = parser.parse_args()
    if args.child:
        result = child(args.child[0], int(args.child[1]), args.updates, args.vmap, args.purejaxrl)
        print(json.dumps(result))
        return
    # Imported here: bench_ppo imports nnxscan, which a baseline child must import from
    # its own tree (use_source_tree) before anything else does.
    from bench_ppo import json_child

    if args.quick:
        args.seeds, args.rounds, args.updates = [1], 1, 8
    variants = ["nnxscan"]
    variants += ["PureJaxRL"] if args.purejaxrl else []
    variants += ["baseline"] if args.baseline else []
    env = dict(os.environ, BENCH_PPO_BASELINE=os.path.abspath(args.baseline or "."))
    results: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        cells = [(v, n) for v in variants for n in args.seeds]
        random.Random(r).shuffle(cells)
        for variant, n in cells:
            command = [sys.executable, __file__, "--child", variant, str(n)]
            command += ["--updates", str(args.updates)] + ([] if args.vmap else ["--no-vmap"])
            command += ["--purejaxrl", args.purejaxrl] if args.purejaxrl else []
            result = json_child(command, f"{variant} with {n} seed(s)", env=env)
            results.setdefault((variant, n), []).append(result)
            print(
                f"round {r}: {variant:>9} {n:>2} seed(s): compile {result['compile']:5.2f} s "
                f"(CPU {result['compile_cpu']:5.2f} s), trace {result['trace']:4.2f} s, lower "
                f"{result['lower']:4.2f} s, run {result['run']:5.2f} s, whole "
                f"{result['whole']:5.2f} s",
                flush=True,
            )
    how = "jax.jit(jax.vmap(train))" if args.vmap else "jax.jit(train)"
    print(f"\nPPO CartPole-v1, {args.updates} updates, {how}; medians of {args.rounds} round(s)\n")
    print("| seeds | variant | " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("|---:|---|" + "---:|" * len(COLUMNS))
    for n in args.seeds:
        for variant in variants:
            runs = results[(variant, n)]
            cells = [format(statistics.median(r[k] for r in runs), f) for k, _, f in COLUMNS]
            print(f"| {n} | {variant} | " + " | ".join(cells) + " |")
    anchors = [a for a in ("PureJaxRL", "baseline") if a in variants]
    if anchors:
        print("\n| seeds | variant | ÷ | compile | compile CPU | whole | whole CPU |")
        print("|---:|---|---|---:|---:|---:|---:|")
        for n in args.seeds:
            for anchor in anchors:
                for variant in variants:
                    if variant == anchor or (anchor == "baseline" and variant == "PureJaxRL"):
                        continue
                    pairs = list(zip(results[(variant, n)], results[(anchor, n)], strict=True))
                    ratios = [
                        statistics.median(a[k] / b[k] for a, b in pairs)
                        for k in ("compile", "compile_cpu", "whole", "whole_cpu")
                    ]
                    print(
                        f"| {n} | {variant} | {anchor} | "
                        + " | ".join(f"{x:.2f}×" for x in ratios)
                        + " |"
                    )


if __name__ == "__main__":
    main()
