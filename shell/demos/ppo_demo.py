"""``nnxscan demo ppo``: PureJaxRL's PPO on gymnax's CartPole-v1, three ways.

- Plain: the whole run (every seed, vmapped) in one compiled program; prints each seed's
  final return and the time, draws the curves.
- ``checkpoint_dir=D``: one seed through ``Trainer(policy, train_step=make_ppo_step(...))
  .fit(None, ...)``: checkpointed, resumable (kill it and run it again: it ends bitwise
  where the uninterrupted run ends), SIGTERM-safe, with progress.
- ``sweep={"ent_coef": [...]}`` (or ``seeds > 1`` with ``checkpoint_dir``): a
  ``Population`` of seeds x values trained side by side; prints a table, draws a line per
  member grouped by value.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Unpack

import jax
import numpy as np
from flax import nnx

from nnxscan.adapters._extras import require_extra
from nnxscan.pure.checks import check_count
from nnxscan.shell.demos._arguments import DemoArguments, demo_arguments, demo_plot_path
from nnxscan.shell.demos.ppo import (
    HYPERPARAMS,
    PPOConfig,
    final_return,
    make_policy,
    make_ppo_step,
    make_ppo_train,
)

__all__ = [
    "checkpoint_epochs",
    "draw_returns",
    "draw_sweep_returns",
    "format_sweep_table",
    "parse_sweep",
    "run_ppo_demo",
    "updates_per_epoch",
]

ENV_NAME = "CartPole-v1"
#: Updates per epoch of the shell's runs (at most): an epoch is a compiled call, a
#: checkpoint and a line of logs; 16 updates of CartPole are a fraction of a second.
UPDATES_PER_EPOCH = 16
#: Updates between the shell's checkpoints (at least): counted in updates, never in time,
#: so where a run is saved does not depend on the machine. With 16 updates an epoch, a
#: checkpoint every 8 epochs and one at the end: 8 saves in the default 976-update run (a
#: save after every epoch costs more: docs/performance.md); a kill loses at most 128
#: updates.
CHECKPOINT_EVERY_UPDATES = 128
#: What the progress line shows besides the loss: the mean episode return (of each call on
#: a terminal, of each epoch off one); the other scalars the step reports (actor and value
#: losses, entropy) stay in the History and the writers.
PROGRESS_LOGS = ("episode_return",)


def draw_returns(env_steps: np.ndarray, returns: np.ndarray, seeds: list[int]) -> Any:
    """A matplotlib Figure: episode return against environment steps, a thin line per seed
    (``returns`` is ``(seeds, updates)``) and their mean in bold black."""
    fig, ax = _returns_axes(f"{len(seeds)} seed(s) trained in one compiled program")
    for seed, curve in zip(seeds, returns, strict=True):
        ax.plot(
            env_steps, curve, lw=0.8, alpha=0.6, label=f"seed {seed}" if len(seeds) <= 10 else None
        )
    ax.plot(env_steps, returns.mean(axis=0), color="black", lw=2.5, label="mean over seeds")
    ax.legend(loc="lower right")
    return fig


def _returns_axes(title: str) -> tuple[Any, Any]:
    Figure = require_extra("matplotlib.figure", "demo", needed_by="nnxscan demo ppo").Figure
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.set_title(f"PPO on {ENV_NAME}: {title}")
    ax.grid(alpha=0.3)
    return fig, ax


def draw_sweep_returns(
    env_steps: np.ndarray, returns: np.ndarray, name: str, values: Sequence[float]
) -> Any:
    """A matplotlib Figure: episode return against environment steps, a thin line per
    member in its value's color (``returns`` is ``(values, seeds, points)``) and each
    value's mean over seeds in bold, same color, labelled ``name=value``."""
    num_members = returns.shape[0] * returns.shape[1]
    fig, ax = _returns_axes(
        f"{num_members} members ({returns.shape[1]} seeds x {returns.shape[0]} {name}) in one "
        f"Population"
    )
    for j, (value, group) in enumerate(zip(values, returns, strict=True)):
        for curve in group:
            ax.plot(env_steps, curve, color=f"C{j}", lw=0.7, alpha=0.45)
        ax.plot(env_steps, group.mean(axis=0), color=f"C{j}", lw=2.5, label=f"{name}={value:g}")
    ax.legend(loc="lower right", title="bold: mean over seeds")
    return fig


def format_sweep_table(
    name: str, values: Sequence[float], seeds: Sequence[int], finals: np.ndarray
) -> str:
    """A plain-text table of final returns: a row per value, a column per seed, the mean."""
    header = f"{name:>13} " + "".join(f"{f'seed {s}':>9}" for s in seeds) + f"{'mean':>9}"
    lines = [header]
    for value, row in zip(values, finals, strict=True):
        cells = "".join(f"{v:>9.1f}" for v in row)
        lines.append(f"{value:>13g} {cells}{row.mean():>9.1f}")
    return "\n".join(lines)


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``"ent_coef=0.0,0.01,0.05"`` -> ``("ent_coef", [0.0, 0.01, 0.05])``.

    Example:
      >>> parse_sweep("ent_coef=0,0.01")
      ('ent_coef', [0.0, 0.01])
    """
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or name not in HYPERPARAMS:
        raise ValueError(
            f"--sweep takes NAME=V1,V2,... with NAME one of {', '.join(HYPERPARAMS)}; got {text!r}."
        )
    try:
        parsed = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep {text!r}: the values must be numbers.") from None
    if not parsed:
        raise ValueError(f"--sweep {text!r} names no values.")
    return name, parsed


def updates_per_epoch(num_updates: int, most: int = UPDATES_PER_EPOCH) -> int:
    """The largest divisor of ``num_updates`` up to ``most``: the shell's runs train whole
    epochs, and the annealed learning rate ends at zero after exactly ``num_updates``."""
    return max(k for k in range(1, min(most, num_updates) + 1) if num_updates % k == 0)


def checkpoint_epochs(per_epoch: int, every_updates: int = CHECKPOINT_EVERY_UPDATES) -> int:
    """Epochs of ``per_epoch`` updates between the shell's checkpoints: the fewest that hold
    ``every_updates`` updates (at least one). ``fit`` also saves after the last epoch.

    Example:
      >>> checkpoint_epochs(16)
      8
    """
    return max(1, -(-every_updates // per_epoch))


def run_ppo_demo(
    out_dir: str | os.PathLike[str] = ".",
    *,
    seeds: int = 1,
    total_timesteps: int = 500_000,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    sweep: Mapping[str, Sequence[float]] | None = None,
    **options: Unpack[DemoArguments],
) -> dict[str, Any]:
    """Trains PPO on ``CartPole-v1`` for seeds ``seed, ..., seed + seeds - 1``.

    Without ``checkpoint_dir`` and ``sweep``: one ``jax.jit`` of ``jax.vmap(train)`` over
    the seeds' keys (:func:`~nnxscan.shell.demos.ppo.make_ppo_train`). With
    ``checkpoint_dir`` and one seed: ``Trainer(policy, train_step=make_ppo_step(...))
    .fit(None, epochs=..., steps_per_epoch=..., checkpoint_dir=..., resume=True)``, saving
    every :data:`CHECKPOINT_EVERY_UPDATES` updates and at the end, which a rerun resumes.
    With ``sweep={name: values}`` (one float hyperparameter of
    :data:`~nnxscan.shell.demos.ppo.HYPERPARAMS`), or several seeds and a
    ``checkpoint_dir``: a ``Population`` of every seed x value, printed as a table of final
    returns, with its best member.

    Prints each run's final return (the single program: the mean episode return over its
    last 10 updates; the shell: over its last epoch's updates; 500 is the most CartPole
    gives) and the whole run's time (compile included), and writes the curves to
    ``<out_dir>/nnxscan_demo_ppo.png``. Needs the ``rl`` extra (gymnax) and the ``demo``
    extra (matplotlib).

    Returns a dict with ``seeds`` (list), ``final_return`` (one float per run: per seed, or
    per member in the population's order, values outer, seeds inner), ``compile_s``,
    ``train_s`` (the single program) or ``whole_s`` (the shell's runs), ``env_steps`` (per
    run) and ``plot`` (the PNG's path); a sweep adds ``sweep`` (name, values) and ``best``.

    Example:
      >>> result = run_ppo_demo("/tmp/demo", seeds=4)
      >>> min(result["final_return"]) > 400, result["plot"]
      (True, '/tmp/demo/nnxscan_demo_ppo.png')
      >>> run_ppo_demo("/tmp/demo", checkpoint_dir="/tmp/ppo-run")   # kill it, run it again
      >>> run_ppo_demo("/tmp/demo", seeds=8, sweep={"ent_coef": [0.0, 0.01, 0.05]})
    """
    seed, progress = demo_arguments("run_ppo_demo", options)
    seeds = check_count(seeds, "seeds", 1)
    seed = check_count(seed, "seed", 0)
    sweep = dict(sweep or {})
    if len(sweep) > 1:
        raise ValueError(f"sweep takes one hyperparameter, got {sorted(sweep)}.")
    for name, values in sweep.items():
        if name not in HYPERPARAMS or not values:
            raise ValueError(
                f"sweep={{{name!r}: ...}}: name one of {', '.join(HYPERPARAMS)} with at least "
                f"one value."
            )
    gymnax = require_extra("gymnax", "rl", needed_by="nnxscan demo ppo")
    require_extra("matplotlib.figure", "demo", needed_by="nnxscan demo ppo")  # fail early
    config = PPOConfig(total_timesteps=total_timesteps)
    env, env_params = gymnax.make(ENV_NAME)
    seed_list = [seed + i for i in range(seeds)]
    steps = config.num_updates * config.num_steps * config.num_envs
    if sweep or (checkpoint_dir is not None and seeds > 1):
        return _population_run(
            out_dir, env, env_params, config, seed_list, sweep, checkpoint_dir, progress
        )
    if checkpoint_dir is not None:
        return _trainer_run(out_dir, env, env_params, config, seed, checkpoint_dir, progress)
    train = make_ppo_train(env, env_params, config)
    keys = jax.numpy.stack([jax.random.key(s) for s in seed_list])
    print(
        f"PPO on {ENV_NAME}: {seeds} seed(s) x {config.num_envs} environments x "
        f"{steps:,} steps, one compiled program"
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


def _epochs(config: PPOConfig) -> tuple[int, int, np.ndarray]:
    """``(epochs, updates per epoch, environment steps at each epoch's end)``."""
    per_epoch = updates_per_epoch(config.num_updates)
    epochs = config.num_updates // per_epoch
    return epochs, per_epoch, config.env_steps()[per_epoch - 1 :: per_epoch]


def _trainer_run(out_dir, env, env_params, config, seed, checkpoint_dir, progress):
    from nnxscan.shell.trainer import Trainer

    epochs, per_epoch, env_steps = _epochs(config)
    print(
        f"PPO on {ENV_NAME}: seed {seed} x {config.num_envs} environments x "
        f"{int(env_steps[-1]):,} steps, {epochs} epochs of {per_epoch} updates through "
        f"Trainer.fit, a checkpoint every {checkpoint_epochs(per_epoch) * per_epoch} updates "
        f"and at the end in {checkpoint_dir} (resumed if there are some)"
    )
    start = time.perf_counter()
    trainer = Trainer(
        make_policy(env, env_params, config, nnx.Rngs(seed)),
        train_step=make_ppo_step(env, env_params, config),
    )
    history = trainer.fit(
        None, epochs=epochs, steps_per_epoch=per_epoch, checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_epochs(per_epoch), resume=True, progress=progress,
        progress_logs=PROGRESS_LOGS,
    )  # fmt: skip
    whole_s = time.perf_counter() - start
    returns = np.asarray([e["episode_return"] for e in history.epochs], np.float64)
    final = float(returns[-1])
    print(f"seed {seed}: final return {final:.1f}")
    print(f"whole run {whole_s:.1f} s (compile included; this call's epochs only if resumed)")
    path = demo_plot_path(out_dir, "ppo")
    draw_returns(env_steps[-len(returns) :], returns[None], [seed]).savefig(path, dpi=120)
    print(f"wrote {path}")
    return {
        "seeds": [seed],
        "final_return": [final],
        "whole_s": whole_s,
        "env_steps": int(env_steps[-1]),
        "plot": str(path),
        "model": trainer.model,
    }


def _population_run(out_dir, env, env_params, config, seed_list, sweep, checkpoint_dir, progress):
    from nnxscan.shell.population import Population

    name, values = next(iter(sweep.items())) if sweep else ("ent_coef", [config.ent_coef])
    values = [float(v) for v in values]
    epochs, per_epoch, env_steps = _epochs(config)
    num_members = len(values) * len(seed_list)
    print(
        f"PPO on {ENV_NAME}: {num_members} members ({len(seed_list)} seeds x {name} in "
        f"{values}) x {config.num_envs} environments x {int(env_steps[-1]):,} steps, one "
        f"Population, {epochs} epochs of {per_epoch} updates"
    )
    start = time.perf_counter()
    population = Population(
        lambda rngs: make_policy(env, env_params, config, rngs),
        train_step=make_ppo_step(env, env_params, config),
        seeds=seed_list * len(values),
        hyperparams={name: [v for v in values for _ in seed_list]},
    )
    fit_options = {}
    if checkpoint_dir is not None:
        fit_options = {"checkpoint_dir": checkpoint_dir,
                       "checkpoint_every": checkpoint_epochs(per_epoch)}  # fmt: skip
    history = population.fit(
        None, epochs=epochs, steps_per_epoch=per_epoch, resume=checkpoint_dir is not None,
        progress=progress, progress_logs=PROGRESS_LOGS, **fit_options,
    )  # fmt: skip
    whole_s = time.perf_counter() - start
    # (epochs, members) -> (values, seeds, epochs)
    returns = np.stack([np.asarray(e["episode_return"], np.float64) for e in history.epochs])
    returns = returns.T.reshape(len(values), len(seed_list), -1)
    finals = returns[..., -1]
    best = population.best("episode_return", mode="max")
    print(format_sweep_table(name, values, seed_list, finals))
    print(
        f"best member {best}: {name}={values[best // len(seed_list)]:g}, seed "
        f"{seed_list[best % len(seed_list)]}, final return {finals.ravel()[best]:.1f}"
    )
    print(f"whole run {whole_s:.1f} s (compile included)")
    path = demo_plot_path(out_dir, "ppo")
    draw_sweep_returns(env_steps[-returns.shape[-1] :], returns, name, values).savefig(
        path, dpi=120
    )
    print(f"wrote {path}")
    return {
        "seeds": seed_list,
        "sweep": (name, values),
        "final_return": [float(v) for v in finals.ravel()],
        "best": best,
        "whole_s": whole_s,
        "env_steps": int(env_steps[-1]),
        "plot": str(path),
        "population": population,
    }
