"""``nnxscan demo hypernet``: one hypernetwork learns a whole family of 1-D functions.

The family is ``y = a·sin(x + b)``; a task is one ``(a, b)`` pair and its embedding is
``z = (a, b)``. A trunk maps ``z`` to features, :class:`~nnxscan.pure.hyper.HyperHeads` map
the features to every weight of a small MLP ``1→32→32→1``, and the MLP runs on ``x`` with
those weights. The :class:`~nnxscan.shell.Trainer` trains trunk and heads with scanned
epochs; the demo then draws the generated networks of tasks it never saw against the truth.
"""

from __future__ import annotations

import math
import os
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscan.adapters._extras import require_extra
from nnxscan.pure import hyper
from nnxscan.pure.checks import check_count
from nnxscan.shell.demos._arguments import DemoArguments, demo_arguments, demo_plot_path
from nnxscan.shell.trainer import Trainer

__all__ = ["run_hypernet_demo"]

A_RANGE = (0.5, 2.0)
B_RANGE = (-1.5, 1.5)
POINTS_PER_TASK = 32
TRAIN_TASKS = 1024
BATCH_TASKS = 32


class SineNet(nnx.Module):
    """The target: an MLP 1→32→32→1 whose every weight the hypernetwork generates."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(1, 32, rngs=rngs)
        self.hidden2 = nnx.Linear(32, 32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.tanh(self.hidden2(nnx.tanh(self.hidden1(x)))))


def sample_tasks(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """``n`` tasks: embeddings ``z = (a, b)``, random inputs in [-π, π] and targets."""
    z = rng.uniform([A_RANGE[0], B_RANGE[0]], [A_RANGE[1], B_RANGE[1]], size=(n, 2))
    x = rng.uniform(-math.pi, math.pi, size=(n, POINTS_PER_TASK, 1))
    y = z[:, None, :1] * np.sin(x + z[:, None, 1:])
    return {k: v.astype(np.float32) for k, v in {"z": z, "x": x, "y": y}.items()}


def task_loss(hnet: hyper.Hypernetwork, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean squared error over a batch of tasks, one generated network per task."""
    pred = jax.vmap(hnet)(batch["z"], batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)


def build_hypernetwork(seed: int) -> hyper.Hypernetwork:
    trunk = nnx.Sequential(
        nnx.Linear(2, 64, rngs=nnx.Rngs(seed + 1)),
        nnx.tanh,
        nnx.Linear(64, 64, rngs=nnx.Rngs(seed + 2)),
        nnx.tanh,
    )
    return hyper.Hypernetwork(SineNet(rngs=nnx.Rngs(seed)), trunk, 64, rngs=nnx.Rngs(seed + 3))


def draw_held_out_tasks(
    x: np.ndarray, tasks: np.ndarray, truth: np.ndarray, curves: np.ndarray
) -> Any:
    """A matplotlib Figure, 2x2: for each of 4 tasks ``(a, b)``, truth and generated network.

    ``x`` has shape ``(points,)``, ``tasks`` ``(4, 2)``, ``truth`` and ``curves``
    ``(4, points)``. pyplot's global state is not touched.
    """
    Figure = require_extra("matplotlib.figure", "demo", needed_by="nnxscan demo hypernet").Figure
    fig = Figure(figsize=(10, 6), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).ravel()
    for ax, (a, b), want, curve in zip(axes, tasks, truth, curves, strict=True):
        ax.plot(x, want, color="black", label="truth: a·sin(x + b)")
        ax.plot(x, curve, color="tab:orange", linestyle="--", label="generated network")
        ax.set_title(f"held-out task (a, b) = ({a:.2f}, {b:.2f})")
        ax.set_xlabel("x")
        ax.set_ylabel("y")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize="small")
    fig.suptitle("Networks a hypernetwork generated for unseen tasks of y = a·sin(x + b)")
    return fig


def run_hypernet_demo(
    out_dir: str | os.PathLike[str] = ".", *, steps: int = 3000, **options: Unpack[DemoArguments]
) -> dict[str, Any]:
    """Trains the hypernetwork demo and writes ``nnxscan_demo_hypernet.png`` into ``out_dir``.

    Args:
      out_dir: folder for the PNG, created if missing.
      steps: training steps (batches of 32 tasks), rounded up to whole epochs over 1024
        training tasks.
      **options: ``seed`` (0) seeds the data, the target, the trunk and the heads;
        ``progress`` (True) shows the Trainer's progress bar.

    Returns:
      ``{"loss": final epoch's mean training loss, "held_out_mse": MSE on 4 unseen tasks
      (200 grid points each),
      "initial_loss": the first step's loss, "steps": steps trained, "plot": the PNG's
      absolute path}``.

    Example:
      >>> result = run_hypernet_demo("/tmp/demo", steps=2000)
      >>> result["plot"]
      '/tmp/demo/nnxscan_demo_hypernet.png'
    """
    seed, progress = demo_arguments("run_hypernet_demo", options)
    steps = check_count(steps, "steps", 1)
    require_extra("matplotlib.figure", "demo", needed_by="nnxscan demo hypernet")  # fail early
    rng = np.random.default_rng(seed)
    train = sample_tasks(rng, TRAIN_TASKS)
    held_out = sample_tasks(rng, 4)

    hnet = build_hypernetwork(seed)
    steps_per_epoch = TRAIN_TASKS // BATCH_TASKS
    epochs = math.ceil(steps / steps_per_epoch)
    schedule = optax.cosine_decay_schedule(3e-3, epochs * steps_per_epoch, alpha=0.05)
    trainer = Trainer(hnet, optax.adam(schedule), task_loss)
    print(
        f"hypernet demo: y = a·sin(x + b), {TRAIN_TASKS} training tasks, "
        f"{epochs * steps_per_epoch} steps; target MLP 1→32→32→1 with "
        f"{hnet.spec.size} generated weights"
    )
    history = trainer.fit(
        train, epochs=epochs, batch_size=BATCH_TASKS, seed=seed, progress=progress
    )

    grid = np.linspace(-math.pi, math.pi, 200, dtype=np.float32)[:, None]
    curves = np.asarray(jax.jit(jax.vmap(lambda z: hnet(z, grid)))(jnp.asarray(held_out["z"])))[
        ..., 0
    ]
    a, b = held_out["z"][:, :1], held_out["z"][:, 1:]
    truth = a * np.sin(grid[:, 0] + b)
    held_out_mse = float(np.mean((curves - truth) ** 2))

    plot = demo_plot_path(out_dir, "hypernet")
    draw_held_out_tasks(grid[:, 0], held_out["z"], truth, curves).savefig(plot, dpi=100)

    result = {
        "loss": float(history.epochs[-1]["loss"]),
        "initial_loss": float(history.losses[0]),
        "held_out_mse": held_out_mse,
        "steps": int(history.losses.shape[0]),
        "plot": str(plot),
    }
    print(
        f"loss {result['initial_loss']:.3g} → {result['loss']:.3g}; held-out MSE {held_out_mse:.3g}"
    )
    print(f"wrote {plot}")
    return result
