"""``nnxscan demo``: an MLP on scikit-learn's bundled digits, trained with scanned epochs."""

from __future__ import annotations

import os
from typing import Any, Unpack

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscan.adapters._extras import require_extra
from nnxscan.shell.demos._arguments import DemoArguments, demo_arguments, demo_plot_path
from nnxscan.shell.trainer import Trainer

__all__ = ["run_digits_demo"]


class DigitsMLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(64, 128, rngs=rngs)
        self.hidden2 = nnx.Linear(128, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden2(nnx.relu(self.hidden1(x)))))


def cross_entropy(model: nnx.Module, batch: dict) -> jnp.ndarray:
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def accuracy(model: nnx.Module, batch: dict) -> jnp.ndarray:
    return jnp.mean(model(batch["x"]).argmax(-1) == batch["y"])


def digits_split(seed: int = 0, test_fraction: float = 0.2) -> tuple[dict, dict]:
    """scikit-learn's 1,797 8x8 digits, scaled to [0, 1], split into train and test."""
    datasets = require_extra("sklearn.datasets", "demo", needed_by="nnxscan demo")
    x, y = datasets.load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
    n_test = int(len(x) * test_fraction)
    return {"x": x[n_test:], "y": y[n_test:]}, {"x": x[:n_test], "y": y[:n_test]}


def run_digits_demo(
    out_dir: str | os.PathLike[str] = ".", *, epochs: int = 30, **options: Unpack[DemoArguments]
) -> dict[str, Any]:
    """Trains an MLP on the digits, prints held-out accuracy and speed, writes a loss curve.

    The curves (training loss per step, held-out accuracy every 5 epochs) go to
    ``<out_dir>/nnxscan_demo_digits.png``; ``out_dir`` is created if missing.

    Returns a dict with ``accuracy``, ``steps_per_sec`` (median over epochs after the
    first, which compiles), ``steps``, ``plan`` and ``plot`` (the PNG's absolute path).

    Example:
      >>> result = run_digits_demo("/tmp/demo", epochs=30)
      >>> result["accuracy"] >= 0.95, result["plot"]
      (True, '/tmp/demo/nnxscan_demo_digits.png')
    """
    seed, progress = demo_arguments("run_digits_demo", options)
    train, test = digits_split(seed)
    model = DigitsMLP(rngs=nnx.Rngs(seed))
    trainer = Trainer(model, optax.adam(1e-3), cross_entropy)
    history = trainer.fit(
        train, epochs=epochs, batch_size=32, seed=seed, progress=progress,
        eval_data=test, metric_fn=accuracy, eval_every=5,
    )  # fmt: skip
    acc = trainer.evaluate(test, accuracy, batch_size=128)["accuracy"]
    speeds = [e["steps_per_sec"] for e in history.epochs[1:]] or [0.0]
    plot = demo_plot_path(out_dir, "digits")
    history.plot(plot)
    result = {
        "accuracy": acc,
        "steps_per_sec": float(np.median(speeds)),
        "steps": len(history.losses),
        "plan": trainer.plan_for(train, 32).kind,
        "plot": str(plot),
    }
    print(
        f"digits MLP: held-out accuracy {acc:.2%} after {epochs} epochs "
        f"({result['steps']} steps, plan '{result['plan']}', "
        f"{result['steps_per_sec']:,.0f} steps/s)"
    )
    print(f"wrote {plot}")
    return result
