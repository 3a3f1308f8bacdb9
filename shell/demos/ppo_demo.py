"""``nnxscan demo ppo``: PureJaxRL's PPO on gymnax's CartPole-v1, the whole run (every seed)
in one compiled program; prints each seed's final return and the time, draws the curves."""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np

from nnxscan.adapters._extras import require_extra
from nnxscan.pure.checks import check_count
from nnxscan.shell.demos._output import demo_plot_path
from nnxscan.shell.demos.ppo import PPOConfig, final_return, make_ppo_train

__all__ = ["draw_returns", "run_ppo_demo"]

ENV_NAME = "CartPole-v1"


def draw_returns(env_steps: np.ndarray, returns: np.ndarray, seeds: list[int]) -> Any:
    """A matplotlib Figure: episode return against environment steps, a thin line per seed
    (``returns`` is ``(seeds, updates)``) and their mean in bold black."""
    Figure = require_extra("matplotlib.figure", "demo", needed_by="nnxscan demo ppo").Figure
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for seed, curve in zip(seeds, returns, strict=True):
        ax.plot(
            env_steps, curve, lw=0.8, alpha=0.6, label=f"seed {seed}" if len(seeds) <= 10 else None
        )
    ax.plot(env_steps, returns.mean(axis=0), color="black", lw=2.5, label="mean over seeds")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.set_title(f"PPO on {ENV_NAME}: {len(seeds)} seed(s) trained in one compiled program")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return fig


def run_ppo_demo(
    out_dir: str | os.PathLike[str] = ".",
    *,
    seeds: int = 1,
    seed: int = 0,
    total_timesteps: int = 500_000,
) -> dict[str, Any]:
    """Trains PPO on ``CartPole-v1`` for seeds ``seed, ..., seed + seeds - 1``: one
    ``jax.jit`` of ``jax.vmap(train)`` over their keys, compile included in the time.

    Prints each seed's final return (the mean episode return over its last 10 updates; 500
    is the most CartPole gives) and the whole run's time, and writes the curves to
    ``<out_dir>/nnxscan_demo_ppo.png`` (created if missing). Needs the ``rl`` extra
    (gymnax) and the ``demo`` extra (matplotlib).

    Returns a dict with ``seeds`` (list), ``final_return`` (one float per seed),
    ``compile_s``, ``train_s``, ``env_steps`` (per seed) and ``plot`` (the PNG's path).

    Example:
      >>> result = run_ppo_demo("/tmp/demo", seeds=4)
      >>> min(result["final_return"]) > 400, result["plot"]
      (True, '/tmp/demo/nnxscan_demo_ppo.png')
    """
    seeds = check_count(seeds, "seeds", 1)
    seed = check_count(seed, "seed", 0)
    gymnax = require_extra("gymnax", "rl", needed_by="nnxscan demo ppo")
    require_extra("matplotlib.figure", "demo", needed_by="nnxscan demo ppo")  # fail early
    config = PPOConfig(total_timesteps=total_timesteps)
    env, env_params = gymnax.make(ENV_NAME)
    train = make_ppo_train(env, env_params, config)
    seed_list = [seed + i for i in range(seeds)]
    keys = jax.numpy.stack([jax.random.key(s) for s in seed_list])
    print(
        f"PPO on {ENV_NAME}: {seeds} seed(s) x {config.num_envs} environments x "
        f"{config.num_updates * config.num_steps * config.num_envs:,} steps, "
        f"one compiled program"
    )
    start = time.perf_counter()
    compiled = jax.jit(jax.vmap(train)).lower(keys).compile()
    compiled_at = time.perf_counter()
    run = jax.block_until_ready(compiled(keys))
    done = time.perf_counter()
    returns = np.asarray(run.metrics["episode_return"])
    finals = final_return(returns)
    for s, value in zip(seed_list, finals, strict=True):
        print(f"seed {s}: final return {value:.1f}")
    compile_s, train_s = compiled_at - start, done - compiled_at
    print(
        f"whole run {compile_s + train_s:.1f} s (compile {compile_s:.1f} s + train {train_s:.1f} s)"
    )
    path = demo_plot_path(out_dir, "ppo")
    draw_returns(config.env_steps(), returns, seed_list).savefig(path, dpi=120)
    print(f"wrote {path}")
    return {
        "seeds": seed_list,
        "final_return": [float(v) for v in finals],
        "compile_s": compile_s,
        "train_s": train_s,
        "env_steps": int(config.env_steps()[-1]),
        "plot": str(path),
    }
