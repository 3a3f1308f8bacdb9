"""A PPO population through the shell against PureJaxRL's own vmapped ``train``, whole runs.

Three ways to train N seeds of PPO on CartPole-v1 (PureJaxRL's defaults: 4 environments x
128 steps, 976 updates, 4 update epochs x 4 minibatches), each timed from building the
run to its trained result, compile included:

  population  ``Population(model_fn, train_step=make_ppo_step(...), seeds=range(N))
              .fit(None, epochs=61, steps_per_epoch=16)``, as ``nnxscan demo ppo --seeds N
              --sweep ent_coef=0.01`` builds it: 61 compiled calls, logs per member;
  PureJaxRL   ``jax.jit(jax.vmap(make_train(config)))(keys)``: PureJaxRL's ``ppo.py``,
              unchanged (``--purejaxrl DIR``, see ``bench_ppo.py`` for what DIR holds);
  jit         ``jax.jit(jax.vmap(make_ppo_train(...)))(keys)``: nnxscan's single program.

Member / seed ``s`` is ``nnx.Rngs(s)`` for the population, ``jax.random.key(s)`` for
``jit`` (the same run: the population's member is its seed trained alone) and
``jax.random.PRNGKey(s)`` for PureJaxRL (its own initialization from that key).

Every run is a fresh process (cold compilation caches, no persistent cache); a round runs
each (variant, N) once in a new shuffled order. Reported per variant: the whole run's wall
time, the process's CPU time over it (all threads; on a shared machine it moves far less
with the load than the wall clock), XLA's compile time (JAX's ``backend_compile`` events,
every program the run compiled) and the final return, the mean over the last 16 updates
(the population's last epoch) of PureJaxRL's logged return, the seeds' mean and minimum,
so that equal work is visible (500 is CartPole's maximum). Medians over ``--rounds``, and
each variant ÷ PureJaxRL as the median of the rounds' paired ratios.

    python benchmarks/bench_ppo_population.py --purejaxrl DIR --out ppo_population.md
    python benchmarks/bench_ppo_population.py --purejaxrl DIR --seeds 8 --rounds 1
    python benchmarks/bench_ppo_population.py --purejaxrl DIR --quick   # < 1 minute

PureJaxRL's init calls LAPACK's QR under ``jax.vmap``; on jaxlib 0.10 its batched kernels
can deadlock XLA:CPU's thread pool (here: 2 seeds hung in most tries, 1, 8 and 16 did not).
A run with no result in ``--timeout`` seconds is killed and run again; the table counts them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

import gymnax
import jax
import numpy as np
from bench_ppo import json_child, load_purejaxrl, ours, theirs, whole_run

from nnxscan.shell import Population
from nnxscan.shell.demos.ppo import PPOConfig, make_policy, make_ppo_step
from nnxscan.shell.demos.ppo_demo import updates_per_epoch

VARIANTS = ("population", "PureJaxRL", "jit")
UPDATES = 976  # PureJaxRL's CartPole defaults: 5e5 // 128 // 4

_compile_s = [0.0]


def _on_duration(event: str, seconds: float, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compile_s[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def population_run(config: PPOConfig, seeds: int) -> tuple[float, float, np.ndarray]:
    """The population's whole run from empty caches: (whole s, CPU s, final returns)."""
    jax.clear_caches()
    env, env_params = gymnax.make("CartPole-v1")
    per_epoch = updates_per_epoch(config.num_updates)
    start, cpu_start = time.perf_counter(), time.process_time()
    population = Population(
        lambda rngs: make_policy(env, env_params, config, rngs),
        train_step=make_ppo_step(env, env_params, config),
        seeds=list(range(seeds)),
        hyperparams={"ent_coef": [config.ent_coef] * seeds},  # as the demo's sweep does
    )
    history = population.fit(
        None, epochs=config.num_updates // per_epoch, steps_per_epoch=per_epoch, progress=False
    )
    finals = np.asarray(history.epochs[-1]["episode_return"], np.float64)
    return time.perf_counter() - start, time.process_time() - cpu_start, finals


def run_variant(variant: str, seeds: int, updates: int, purejaxrl: str | None) -> dict:
    """One whole run of ``variant`` on ``seeds`` seeds in this process, from empty caches."""
    config = PPOConfig(total_timesteps=updates * 4 * 128)
    last = updates_per_epoch(config.num_updates)  # the population's last epoch
    _compile_s[0] = 0.0
    if variant == "population":
        whole, cpu, finals = population_run(config, seeds)
    elif variant == "jit":
        keys = jax.numpy.stack([jax.random.key(s) for s in range(seeds)])
        whole, _, cpu, finals = whole_run(lambda: ours(config), seeds, variant, keys, last)
    else:
        module = load_purejaxrl(purejaxrl)
        keys = jax.numpy.stack([jax.random.PRNGKey(s) for s in range(seeds)])
        build = lambda: theirs(module, config)  # noqa: E731
        whole, _, cpu, finals = whole_run(build, seeds, variant, keys, last)
    return {
        "whole": whole,
        "cpu": cpu,
        "compile": _compile_s[0],
        "mean": float(finals.mean()),
        "min": float(finals.min()),
    }


def fresh_process(
    variant: str, seeds: int, updates: int, purejaxrl: str | None, timeout: float
) -> dict:
    """One run in a new process (a hung one is killed and run again: ``json_child``)."""
    command = [sys.executable, __file__, "--child", variant, str(seeds), str(updates)]
    command += ["--purejaxrl", purejaxrl] if purejaxrl else []
    return json_child(command, f"{variant} with {seeds} seeds", timeout)


def table(results: dict, variants: list[str], seed_counts: list[int], header: str) -> str:
    lines = [
        header,
        "",
        "| seeds | variant | whole run (s) | CPU (s) | XLA compile (s) | return: mean | min |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for n in seed_counts:
        for name in variants:
            runs = results[(name, n)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("whole", "cpu", "compile")}
            lines.append(
                f"| {n} | {name} | {med['whole']:.2f} | {med['cpu']:.2f} | {med['compile']:.2f} "
                f"| {statistics.mean(r['mean'] for r in runs):.1f} "
                f"| {min(r['min'] for r in runs):.1f} |"
            )
    hung = sum(r.get("hung", 0) for runs in results.values() for r in runs)
    if hung:
        lines += ["", f"{hung} run(s) hung (killed and run again; see bench_ppo.json_child)."]
    anchor = "PureJaxRL" if "PureJaxRL" in variants else "jit"
    lines += [
        "",
        f"| seeds | variant | ÷ {anchor}: whole run | CPU | XLA compile |",
        "|---:|---|---:|---:|---:|",
    ]
    for n in seed_counts:
        for name in variants:
            if name == anchor:
                continue
            pairs = list(zip(results[(name, n)], results[(anchor, n)], strict=True))

            def paired(key: str, pairs=pairs) -> float:
                return statistics.median(a[key] / b[key] for a, b in pairs)

            lines.append(
                f"| {n} | {name} | {paired('whole'):.2f}× | {paired('cpu'):.2f}× "
                f"| {paired('compile'):.2f}× |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--purejaxrl", metavar="DIR", help="folder with PureJaxRL's ppo.py")
    parser.add_argument(
        "--quick", action="store_true", help="16 updates of 1 seed, one round: it runs"
    )
    parser.add_argument("--out", help="also write the tables to this markdown file")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before a run counts as hung"
    )
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "SEEDS", "UPDATES"))
    args = parser.parse_args()
    if args.child:
        variant, seeds, updates = args.child[0], int(args.child[1]), int(args.child[2])
        print(json.dumps(run_variant(variant, seeds, updates, args.purejaxrl)))
        return

    variants = [v for v in VARIANTS if v != "PureJaxRL" or args.purejaxrl]
    seed_counts, rounds, updates = args.seeds, args.rounds, UPDATES

    if args.quick:
        # One seed (vmapped over one key): PureJaxRL with 2 seeds hung in most tries here.
        seed_counts, rounds, updates, args.timeout = [1], 1, 16, 120.0

    def run(name: str, n: int, updates: int, purejaxrl: str | None) -> dict:
        return fresh_process(name, n, updates, purejaxrl, args.timeout)

    results: dict[tuple[str, int], list[dict]] = {}
    for r in range(rounds):
        cells = [(name, n) for name in variants for n in seed_counts]
        random.Random(r).shuffle(cells)
        for name, n in cells:
            result = run(name, n, updates, args.purejaxrl)
            results.setdefault((name, n), []).append(result)
            print(
                f"round {r}: {name:>10} {n:>2} seeds: whole {result['whole']:7.2f} s, "
                f"CPU {result['cpu']:7.2f} s, XLA compile {result['compile']:5.2f} s, "
                f"return mean {result['mean']:6.1f} min {result['min']:6.1f}",
                flush=True,
            )
    header = (
        f"PPO on CartPole-v1, {updates} updates ({updates * 4 * 128:,} environment steps) per "
        f"seed; {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}; "
        f"medians of {rounds} round(s), each run a fresh process, compile included"
    )
    text = table(results, variants, seed_counts, header)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    jax.numpy.zeros(()).block_until_ready()  # the backend starts before the first clock
    main()
