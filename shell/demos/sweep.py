"""``nnxscan demo sweep``: a learning-rate x seed sweep of the digits MLP in one Population."""

from __future__ import annotations

import os
from typing import Any, Unpack

import numpy as np
import optax

from nnxscan.adapters._extras import require_extra
from nnxscan.shell.demos._arguments import DemoArguments, demo_arguments, demo_plot_path
from nnxscan.shell.demos.digits import DigitsMLP, accuracy, cross_entropy, digits_split
from nnxscan.shell.population import Population

__all__ = ["LEARNING_RATES", "draw_sweep", "format_sweep_table", "run_sweep_demo"]

LEARNING_RATES = (3e-4, 1e-3, 3e-3, 1e-2)
SEEDS_PER_RATE = 4


def format_sweep_table(rates: list[float], seeds: list[int], acc: np.ndarray) -> str:
    """A plain-text table: one row per learning rate, one column per seed, then the mean."""
    header = f"{'learning rate':>13} " + "".join(f"{f'seed {s}':>9}" for s in seeds)
    lines = [header + f"{'mean':>9}"]
    for rate, row in zip(rates, acc, strict=True):
        cells = "".join(f"{v:>9.2%}" for v in row)
        lines.append(f"{rate:>13.0e} {cells}{row.mean():>9.2%}")
    return "\n".join(lines)


# Members with the same score would hide behind each other: each seed's markers are
# shifted along the log x-axis by its own small offset (in decades; the rates are half a
# decade apart, so a shifted marker stays with its rate), and drawn hollow in a shape of
# its own, so even markers that still touch show both outlines. The accuracy (y) is exact.
SEED_OFFSET_DECADES = 0.06
SEED_MARKERS = "osD^v<>p"


def _rate_label(rate: float) -> str:
    """``3e-4`` for 0.0003: numpy's ``3e-04`` without the padding zero."""
    mantissa, exponent = f"{rate:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def draw_sweep(rates: list[float], seeds: list[int], acc: np.ndarray) -> Any:
    """A matplotlib Figure: held-out accuracy against learning rate (log x), a marker per
    seed (hollow, shifted a little along x per seed, so equal scores stay visible), the
    mean over seeds, and every decade and every swept rate labelled on the x-axis."""
    Figure = require_extra("matplotlib.figure", "demo", needed_by="nnxscan demo sweep").Figure
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    rates_array = np.asarray(rates, np.float64)
    offsets = np.linspace(-1.0, 1.0, len(seeds)) * SEED_OFFSET_DECADES if len(seeds) > 1 else [0]
    for j, seed in enumerate(seeds):
        ax.scatter(
            rates_array * 10.0 ** offsets[j], acc[:, j], label=f"seed {seed}", s=40, lw=1.4,
            marker=SEED_MARKERS[j % len(SEED_MARKERS)], facecolors="none", edgecolors=f"C{j}",
        )  # fmt: skip
    ax.plot(rates, acc.mean(axis=1), color="black", lw=1, label="mean over seeds")
    ax.set_xscale("log")
    # Whole decades from below the smallest rate to above the largest, each labelled; the
    # swept rates between them get labelled minor ticks.
    low = int(np.floor(np.log10(rates_array.min()) + 1e-9))
    high = int(np.ceil(np.log10(rates_array.max()) - 1e-9))
    decades = [10.0**k for k in range(low, high + 1)]
    margin = 10.0 ** (2 * SEED_OFFSET_DECADES)
    ax.set_xlim(
        min(decades[0], rates_array.min()) / margin, max(decades[-1], rates_array.max()) * margin
    )
    ax.set_xticks(decades, [_rate_label(d) for d in decades])
    between = [r for r in rates if not np.isclose(np.log10(r), np.round(np.log10(r)))]
    ax.set_xticks(between, [_rate_label(r) for r in between], minor=True, fontsize="small")
    ax.set_xlabel("learning rate (Adam)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"digits MLP: {acc.size} members trained in one Population")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def run_sweep_demo(
    out_dir: str | os.PathLike[str] = ".", *, epochs: int = 20, **options: Unpack[DemoArguments]
) -> dict[str, Any]:
    """Trains 4 learning rates x 4 seeds of the digits MLP as one Population, in one
    compiled program per epoch; prints the held-out accuracy table and the best member.

    The plot (accuracy against learning rate, one dot per seed) goes to
    ``<out_dir>/nnxscan_demo_sweep.png``; ``out_dir`` is created if missing.

    Returns a dict with ``learning_rates`` (4), ``seeds`` (4), ``accuracy`` (a 4x4 nested
    list, rows: learning rate, columns: seed), ``best`` (``learning_rate``, ``seed``,
    ``accuracy``), ``steps_per_sec`` and ``plot`` (the PNG's absolute path).

    Example:
      >>> result = run_sweep_demo("/tmp/demo", epochs=20)
      >>> result["best"]["accuracy"] >= 0.9, result["plot"]
      (True, '/tmp/demo/nnxscan_demo_sweep.png')
    """
    seed, progress = demo_arguments("run_sweep_demo", options)
    require_extra("matplotlib.figure", "demo", needed_by="nnxscan demo sweep")  # fail early
    train, test = digits_split(seed)
    rates = list(LEARNING_RATES)
    seeds = [seed + j for j in range(SEEDS_PER_RATE)]
    # Member i = (rate i // 4, seed i % 4).
    member_rates = [rate for rate in rates for _ in seeds]
    member_seeds = seeds * len(rates)
    population = Population(
        lambda rngs: DigitsMLP(rngs=rngs),
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
        cross_entropy,
        seeds=member_seeds,
        hyperparams={"learning_rate": member_rates},
    )
    history = population.fit(train, epochs=epochs, batch_size=32, progress=progress)
    scores = population.evaluate(test, accuracy, batch_size=128)["accuracy"]
    acc = np.asarray(scores, np.float64).reshape(len(rates), len(seeds))
    best = population.best(scores, mode="max")
    best_rate, best_seed = rates[best // len(seeds)], seeds[best % len(seeds)]
    speeds = [e["steps_per_sec"] for e in history.epochs[1:]] or [0.0]

    plot = demo_plot_path(out_dir, "sweep")
    draw_sweep(rates, seeds, acc).savefig(plot, dpi=100)
    result = {
        "learning_rates": rates,
        "seeds": seeds,
        "accuracy": acc.tolist(),
        "best": {"learning_rate": best_rate, "seed": best_seed, "accuracy": float(scores[best])},
        "steps_per_sec": float(np.median(speeds)),
        "plot": str(plot),
    }
    print(
        f"digits MLP sweep: {len(population)} members in one Population, {epochs} epochs, "
        f"held-out accuracy:"
    )
    print(format_sweep_table(rates, seeds, acc))
    print(
        f"best: learning rate {best_rate:.0e}, seed {best_seed}: {scores[best]:.2%} "
        f"({result['steps_per_sec']:,.0f} steps/s for all {len(population)} members)"
    )
    print(f"wrote {plot}")
    return result
