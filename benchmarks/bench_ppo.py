"""PPO whole runs on CartPole-v1, compile included: nnxscan's port against PureJaxRL's own code.

``nnxscan.shell.demos.ppo`` ports PureJaxRL's ``purejaxrl/ppo.py`` (its defaults: 4
environments x 128 steps, 5e5 steps, 4 update epochs x 4 minibatches, Adam 2.5e-4 annealed,
gymnax ``CartPole-v1``) with the update epochs through ``nnxscan.pure``. This times, in one
process, the whole run of 1, 4, 16 and 64 seeds (one ``jax.jit`` of ``jax.vmap(train)``
over their keys; one seed is ``jax.jit(train)`` as PureJaxRL's own ``__main__`` runs it):

  whole    from building ``train`` to the trained result (blocked on), compile included;
  compile  of that, tracing + lowering + XLA compiling;
  CPU      the process's CPU time (all threads) over the whole run: on a shared machine
           it moves far less with the load than the wall clock does;
  return   the mean episode return over each seed's last 10 updates, PureJaxRL's logged
           ``returned_episode_returns`` (500 is CartPole's maximum): the seeds' mean and
           their minimum.

Every round runs each variant once per seed count, in a new shuffled order, after
``jax.clear_caches()`` (as a new process would compile it; no persistent compilation
cache is enabled). Medians over ``--rounds``.

PureJaxRL side by side (``--purejaxrl DIR``): DIR holds PureJaxRL's ``ppo.py``, unchanged,
next to what it imports that jax 0.10 and gymnax 1.0 lack: a ``distrax.py`` whose
``Categorical(logits)`` has ``sample(seed)``, ``log_prob(value)`` and ``entropy()`` (with
``jax.random.categorical`` and ``log_softmax``; distrax's tensorflow-probability substrate
fails to import on jax 0.10), and a ``wrappers.py`` with its ``FlattenObservationWrapper``
and ``LogWrapper`` whose ``step`` unpacks gymnax 1.0's six values into 0.0's five
(``done = terminated | truncated``). None of that code is part of this repository.

    python benchmarks/bench_ppo.py --out ppo.md
    python benchmarks/bench_ppo.py --purejaxrl /tmp/purejaxrl --seeds 1 4 --rounds 5
    python benchmarks/bench_ppo.py --quick        # 4 updates of 1 and 2 seeds: it runs
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import gymnax
import jax
import jax.numpy as jnp
import numpy as np

from nnxscan.shell.demos.ppo import PPOConfig, final_return, make_ppo_train

RUN_TIMEOUT_S = 1800.0  # a hung run (see the orthogonal init's note in ppo_policy.py) ends it


def ours(config: PPOConfig) -> tuple[Callable[[jax.Array], Any], Callable[[Any], np.ndarray]]:
    env, env_params = gymnax.make("CartPole-v1")
    train = make_ppo_train(env, env_params, config)
    return train, lambda run: np.asarray(run.metrics["episode_return"])


def theirs(
    module: Any, config: PPOConfig
) -> tuple[Callable[[jax.Array], Any], Callable[[Any], np.ndarray]]:
    train = module.make_train(
        {
            "LR": config.learning_rate, "NUM_ENVS": config.num_envs,
            "NUM_STEPS": config.num_steps, "TOTAL_TIMESTEPS": config.total_timesteps,
            "UPDATE_EPOCHS": config.update_epochs, "NUM_MINIBATCHES": config.num_minibatches,
            "GAMMA": config.gamma, "GAE_LAMBDA": config.gae_lambda,
            "CLIP_EPS": config.clip_eps, "ENT_COEF": config.ent_coef,
            "VF_COEF": config.vf_coef, "MAX_GRAD_NORM": config.max_grad_norm,
            "ACTIVATION": "tanh", "ENV_NAME": "CartPole-v1", "ANNEAL_LR": config.anneal_lr,
            "DEBUG": False,
        }
    )  # fmt: skip

    def returns(out: Any) -> np.ndarray:
        # (..., updates, steps, envs) -> per update, the mean over steps and environments
        return np.asarray(out["metrics"]["returned_episode_returns"]).mean(axis=(-2, -1))

    return train, returns


def load_purejaxrl(directory: str) -> Any:
    """PureJaxRL's ``ppo.py`` imported from ``directory`` (with its two stand-ins)."""
    sys.path.insert(0, os.path.abspath(directory))
    return importlib.import_module("ppo")


def whole_run(
    build: Callable[[], tuple[Callable, Callable]],
    seeds: int,
    label: str,
    keys: jax.Array | None = None,
    last: int = 10,
):
    """One whole run from empty compilation caches: (whole s, compile s, CPU s, returns).

    ``keys`` (one per seed, stacked) default to ``jax.random.split(PRNGKey(0), seeds)``;
    the returns are each seed's mean over its ``last`` updates."""
    jax.clear_caches()
    watchdog = threading.Timer(RUN_TIMEOUT_S, _hung, args=(label, seeds))
    watchdog.start()
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        train, returns_of = build()
        if keys is not None:
            program = jax.jit(jax.vmap(train))
        elif seeds == 1:
            keys = jax.random.PRNGKey(0)
            program = jax.jit(train)
        else:
            keys = jax.random.split(jax.random.PRNGKey(0), seeds)
            program = jax.jit(jax.vmap(train))
        compiled = program.lower(keys).compile()
        compiled_at = time.perf_counter()
        out = jax.block_until_ready(compiled(keys))
        done, cpu_done = time.perf_counter(), time.process_time()
    finally:
        watchdog.cancel()
    finals = np.atleast_1d(final_return(returns_of(out), last))
    return done - start, compiled_at - start, cpu_done - cpu_start, finals


def json_child(
    command: list[str], label: str, timeout: float = 1200.0, tries: int = 3, env: Any = None
) -> dict:
    """Runs ``command`` (a benchmark's child process, printing one JSON line last) and
    returns that dict with ``hung``: how many earlier tries were killed after ``timeout``
    seconds without a result. PureJaxRL's init calls LAPACK's QR under ``jax.vmap``, whose
    batched kernels can deadlock XLA:CPU's thread pool on jaxlib 0.10 (see
    ``ppo_policy.orthogonal``): such a run is killed and run again."""
    for attempt in range(tries):
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            print(f"{label}: no result in {timeout:.0f} s (hung): killed, run again", flush=True)
            continue
        if out.returncode:
            raise RuntimeError(f"{label} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1]) | {"hung": attempt}
    raise RuntimeError(f"{label} hung {tries} times in a row.")


def _hung(label: str, seeds: int) -> None:
    print(f"\n{label} with {seeds} seed(s) gave no result in {RUN_TIMEOUT_S:.0f} s: stopped.")
    sys.stdout.flush()
    os._exit(3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--purejaxrl", metavar="DIR", help="folder with PureJaxRL's ppo.py")
    parser.add_argument("--quick", action="store_true", help="4 updates, 1 and 2 seeds")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()

    config = PPOConfig()
    seed_counts, rounds = args.seeds, args.rounds
    if args.quick:
        config, seed_counts, rounds = PPOConfig(total_timesteps=4 * 128 * 4), [1, 2], 1
    variants: dict[str, Callable[[], tuple[Callable, Callable]]] = {"nnxscan": lambda: ours(config)}
    if args.purejaxrl:
        module = load_purejaxrl(args.purejaxrl)
        variants["PureJaxRL"] = lambda: theirs(module, config)

    # Untimed warm-up: imports, gymnax's own jits and the first-use costs land nowhere.
    tiny = PPOConfig(total_timesteps=config.num_envs * config.num_steps)
    whole_run(lambda: ours(tiny), 1, "warm-up")

    results: dict[tuple[str, int], list[tuple[float, float, float, np.ndarray]]] = {}
    out_of_memory: set[tuple[str, int]] = set()
    for r in range(rounds):
        cells = [(name, n) for name in variants for n in seed_counts]
        random.Random(r).shuffle(cells)
        for name, n in cells:
            try:
                result = whole_run(variants[name], n, name)
            except jax.errors.JaxRuntimeError as error:
                # PureJaxRL's ppo.py returns every step's info of every environment: at
                # 1,024 seeds that is 16.8 GiB of outputs, more than a 16 GiB chip holds.
                if "RESOURCE_EXHAUSTED" not in str(error):
                    raise
                print(f"round {r}: {name:>9} {n:>2} seed(s): out of device memory", flush=True)
                out_of_memory.add((name, n))
                continue
            results.setdefault((name, n), []).append(result)
            whole, compile_s, cpu, finals = result
            print(
                f"round {r}: {name:>9} {n:>2} seed(s): whole {whole:6.2f} s "
                f"(compile {compile_s:5.2f} s), CPU {cpu:6.2f} s, return mean "
                f"{finals.mean():6.1f} min {finals.min():6.1f}",
                flush=True,
            )

    lines = [
        f"PPO on CartPole-v1, {config.num_updates * config.num_steps * config.num_envs:,} "
        f"steps per seed; {platform.machine()}, {os.cpu_count()} cores, jax "
        f"{jax.__version__}; medians of {rounds} round(s), compile included",
        "",
        "| seeds | variant | whole run (s) | compile (s) | CPU (s) | per seed (s) | return: mean"
        " | min |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in seed_counts:
        for name in variants:
            if (name, n) in out_of_memory:
                lines.append(f"| {n} | {name} | out of device memory | | | | | |")
                continue
            runs = results[(name, n)]
            whole = statistics.median(run[0] for run in runs)
            compile_s = statistics.median(run[1] for run in runs)
            cpu = statistics.median(run[2] for run in runs)
            finals = np.concatenate([run[3] for run in runs])
            lines.append(
                f"| {n} | {name} | {whole:.2f} | {compile_s:.2f} | {cpu:.2f} | {whole / n:.2f} "
                f"| {finals.mean():.1f} | {finals.min():.1f} |"
            )
    if "PureJaxRL" in variants:
        lines += [
            "",
            "| seeds | nnxscan ÷ PureJaxRL: whole run | CPU | median of paired rounds |",
            "|---:|---:|---:|---:|",
        ]
        for n in seed_counts:
            if ("nnxscan", n) in out_of_memory or ("PureJaxRL", n) in out_of_memory:
                lines.append(f"| {n} | — (a side ran out of device memory) | | |")
                continue
            ours_runs, their_runs = results[("nnxscan", n)], results[("PureJaxRL", n)]

            def ratio(i, ours_runs=ours_runs, their_runs=their_runs):
                return statistics.median(r[i] for r in ours_runs) / statistics.median(
                    r[i] for r in their_runs
                )

            paired = statistics.median(
                a[0] / b[0] for a, b in zip(ours_runs, their_runs, strict=True)
            )
            lines.append(f"| {n} | {ratio(0):.2f}× | {ratio(2):.2f}× | {paired:.2f}× |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    jnp.zeros(())  # start the backend before the first timing
    main()
