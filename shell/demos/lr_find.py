"""``nnxscan demo lr-find``: a learning-rate range test of the digits MLP as one Population."""

from __future__ import annotations

import os
from typing import Any, Unpack

import optax

from nnxscan.adapters._extras import require_extra
from nnxscan.shell.demos._arguments import DemoArguments, demo_arguments, demo_plot_path
from nnxscan.shell.demos.digits import DigitsMLP, cross_entropy, digits_split
from nnxscan.shell.lr_finder import find_learning_rate

__all__ = ["run_lr_find_demo"]

MIN_LR, MAX_LR, NUM_RATES, BATCH_SIZE = 1e-5, 1.0, 16, 32


def run_lr_find_demo(
    out_dir: str | os.PathLike[str] = ".", *, steps: int = 300, **options: Unpack[DemoArguments]
) -> dict[str, Any]:
    """Trains the digits MLP at 16 learning rates from 1e-5 to 1 (Adam, batch 32) side by
    side in one compiled program for ``steps`` steps; prints each rate's final loss and
    the suggested rate, and writes the two-panel figure of
    :meth:`~nnxscan.shell.LRFinderResult.plot` to ``<out_dir>/nnxscan_demo_lr-find.png``
    (``out_dir`` is created if missing).

    Returns a dict with ``learning_rates``, ``final_losses`` (lists of 16), ``diverged``
    (16 bools), ``suggestion`` and ``plot`` (the PNG's absolute path).

    Example:
      >>> result = run_lr_find_demo("/tmp/demo", steps=300)
      >>> result["suggestion"], result["plot"]
      (0.001, '/tmp/demo/nnxscan_demo_lr-find.png')
    """
    seed, progress = demo_arguments("run_lr_find_demo", options)
    require_extra("matplotlib.figure", "demo", needed_by="nnxscan demo lr-find")  # fail early
    train, _ = digits_split(seed)
    result = find_learning_rate(
        lambda rngs: DigitsMLP(rngs=rngs), cross_entropy, train, batch_size=BATCH_SIZE,
        min_lr=MIN_LR, max_lr=MAX_LR, num=NUM_RATES, steps=steps, optimizer=optax.adam,
        seed=seed, progress=progress,
    )  # fmt: skip
    plot = demo_plot_path(out_dir, "lr-find")
    result.plot(plot)
    print(
        f"digits MLP learning-rate range test: {NUM_RATES} rates of Adam, batch {BATCH_SIZE}, "
        f"{steps} steps each,\ntrained side by side in one compiled program from the same "
        f"weights on the same batches\n(final loss: the mean of the last {result.window} steps)"
    )
    print(result.table())
    if result.suggestion is None:
        print("suggested: none (every rate diverged; lower min_lr)")
    else:
        print(
            f"suggested learning rate: {result.suggestion:.3g} (the smallest rate whose final "
            f"loss is within {result.tolerance:.0%} of the lowest,\namong the rates that did "
            f"not diverge)"
        )
    print(f"wrote {plot}")
    return {
        "learning_rates": result.learning_rates.tolist(),
        "final_losses": result.final_losses.tolist(),
        "diverged": result.diverged.tolist(),
        "suggestion": result.suggestion,
        "plot": str(plot),
    }
