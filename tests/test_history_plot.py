"""History.plot: a real PNG, drawn without pyplot's global state, and its smoothing."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from nnxscan.adapters._log_values import logs_of
from nnxscan.adapters._plots import _eval_series, _smooth, _smoothing_window
from nnxscan.shell.history import History

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _history(with_eval: bool) -> History:
    rng = np.random.default_rng(0)
    steps_per_epoch, epochs = 25, 6
    n = steps_per_epoch * epochs
    losses = np.exp(-np.arange(n) / 40) * (1 + 0.3 * rng.random(n)) + 0.01
    losses[37] = np.nan  # a skipped step
    history = History()
    for epoch in range(epochs):
        logs = {"epoch": epoch, "loss": float(np.nanmean(losses)), "steps": steps_per_epoch}
        if with_eval and epoch % 2 == 1:  # eval_every=2
            logs.update(eval_loss=1.0 / (epoch + 1), eval_accuracy=0.5 + 0.08 * epoch)
        history._append(losses[epoch * steps_per_epoch : (epoch + 1) * steps_per_epoch], logs)
    return history


def _read_png(path) -> np.ndarray:
    import matplotlib.image as image

    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = image.imread(path)
    assert pixels[..., :3].var() > 1e-3, "blank image"
    return pixels


@pytest.mark.parametrize("smooth", [0.98, 10])
def test_plot_writes_a_png_with_an_eval_panel(tmp_path, smooth):
    import matplotlib.pyplot as pyplot

    figures_before = pyplot.get_fignums()
    with_eval = _read_png(_history(True).plot(tmp_path / "with.png", smooth=smooth))
    without = _read_png(_history(False).plot(tmp_path / "without.png", smooth=smooth))
    assert with_eval.shape[0] > without.shape[0], "eval metrics get a second panel"
    assert pyplot.get_fignums() == figures_before, "pyplot's figure registry was touched"


def test_plot_returns_the_path_and_handles_non_positive_losses(tmp_path):
    history = History()
    history._append(np.array([0.5, -0.25, 0.0, np.nan, 0.1]), {"epoch": 0, "steps": 5})
    out = history.plot(str(tmp_path / "curve.png"))
    assert out == tmp_path / "curve.png"
    _read_png(out)


def test_plot_creates_the_folders_of_its_path_as_the_writers_do(tmp_path):
    history = History()
    history._append(np.array([0.5, 0.25, 0.1]), {"epoch": 0, "steps": 3})
    out = history.plot(tmp_path / "t3" / "deeper" / "pop.png")
    assert out == tmp_path / "t3" / "deeper" / "pop.png"
    _read_png(out)


def test_plot_of_an_empty_history_raises(tmp_path):
    with pytest.raises(ValueError, match="nothing to plot"):
        History().plot(tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def _decay(n: int = 500, noise: float = 0.1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A loss falling exponentially from 2.0 to 0.01 over ``n`` steps: (clean, noisy)."""
    clean = 2.0 * (0.01 / 2.0) ** (np.arange(n) / (n - 1))
    rng = np.random.default_rng(seed)
    return clean, clean * (1 + noise * rng.standard_normal(n))


def test_default_smoothing_follows_a_falling_loss_without_lag():
    clean, noisy = _decay()
    window = _smoothing_window(0.98, clean.size)  # plot's default
    # Without noise the curve is the loss itself, to within the curvature of its fall (an
    # EMA of weight 0.98, capped to a 50-step span, drew it 100% above, 50 steps behind).
    np.testing.assert_allclose(_smooth(clean, window), clean, rtol=0.02)

    smoothed = _smooth(noisy, window)
    raw_error, error = (noisy - clean) / clean, (smoothed - clean) / clean
    assert np.abs(raw_error).max() > 0.25  # the band below is tighter than the noise
    assert np.abs(error[6:]).max() < 0.25, np.abs(error).argmax()
    assert np.abs(error[6:]).mean() < 0.02
    assert error.std() < 0.25 * raw_error.std()
    assert (smoothed - clean).std() < 0.5 * (noisy - clean).std()


def _reference_smooth(losses: np.ndarray, window: int) -> np.ndarray:
    """_smooth, step by step: a centred mean, or a clipped line fit where the run ends."""
    out = np.full(losses.size, np.nan)
    for k in range(losses.size):
        half = min(window // 2, k // 3)
        steps = np.arange(k - half, min(k + half + 1, losses.size))
        ok = np.isfinite(losses[steps])
        values, steps = losses[steps][ok], steps[ok]
        if k + half < losses.size:
            out[k] = values.mean() if values.size else np.nan
        elif values.size:
            line = np.polyfit(steps, values, 1) if values.size > 1 else (0.0, values[0])
            out[k] = np.clip(np.polyval(line, k), values.min(), values.max())
    return out


def test_smoothing_matches_a_step_by_step_reference_and_skips_non_finite_losses():
    _, noisy = _decay(200, noise=0.3, seed=1)
    noisy[[0, 50, 51, 120, 197]] = [np.nan, np.inf, np.nan, -np.inf, np.nan]
    for window in (1, 4, 15, 20):
        np.testing.assert_allclose(_smooth(noisy, window), _reference_smooth(noisy, window))
    x = np.array([4.0, np.nan, 2.0, 6.0, np.inf, 1.0, 3.0])
    assert np.isnan(_smooth(x, 3)[1])  # a window of one non-finite loss
    np.testing.assert_array_equal(_smooth(x, 1)[np.isfinite(x)], x[np.isfinite(x)])
    # A constant stays constant, gaps included; a straight line stays straight to the end.
    constant = np.where(np.isfinite(noisy), 2.5, noisy)
    np.testing.assert_allclose(_smooth(constant, 20)[1:], 2.5)
    ramp = np.linspace(3.0, 1.0, 100)
    np.testing.assert_allclose(_smooth(ramp, 30), ramp, rtol=1e-9)


def test_smoothing_window_follows_the_smooth_argument_and_spans_at_most_a_tenth_of_the_run():
    # A float w averages over (1 + w) / (1 - w) steps: an EMA of weight w's noise reduction.
    assert _smoothing_window(0.98, 100_000) == 99 and _smoothing_window(0.9, 100_000) == 19
    assert _smoothing_window(500, 100_000) == 500
    assert _smoothing_window(0.98, 500) == 50 and _smoothing_window(50, 150) == 15
    for no_smoothing in (0, 0.0, 1):
        assert _smoothing_window(no_smoothing, 1000) == 1
    assert _smoothing_window(0.98, 5) == 1 and _smoothing_window(3, 5) == 1
    for bad in (1.0, -0.5, True, "0.9", -3, float("nan")):
        with pytest.raises(ValueError, match="smooth"):
            _smoothing_window(bad, 100)


def _population_history(num_members: int) -> History:
    rng = np.random.default_rng(1)
    history = History(losses=np.zeros((0, num_members), np.float32))
    for epoch in range(4):
        losses = np.exp(-np.arange(20)[:, None] / (10.0 * (1 + np.arange(num_members)))) + 0.1
        losses = losses * (1 + 0.2 * rng.random((20, num_members))) / (epoch + 1)
        logs = {"epoch": epoch, "steps": 20, "loss": losses.mean(axis=0),
                "eval_accuracy": 0.5 + 0.1 * epoch + 0.01 * np.arange(num_members)}  # fmt: skip
        history._append(losses, logs)
    return history


def _has_colour(pixels: np.ndarray, hex_colour: str, at_least: int = 20) -> bool:
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(pixels[..., :3] - rgb).max(axis=-1) < 0.03).sum()) >= at_least


def test_a_populations_history_plots_a_curve_and_eval_line_per_member(tmp_path):
    history = _population_history(3)
    pixels = _read_png(history.plot(tmp_path / "population.png"))
    # matplotlib's first colours, one per member: C0, C1, C2 (and not C3).
    for colour in ("#1f77b4", "#ff7f0e", "#2ca02c"):
        assert _has_colour(pixels, colour), colour
    assert not _has_colour(pixels, "#d62728")
    ends = np.array([20, 40, 60, 80])
    assert history.num_members == 3  # built without it: its (steps, 3) losses say
    series = _eval_series(history.epochs, ends, logs_of(history))
    assert sorted(series) == [("eval_accuracy", 0), ("eval_accuracy", 1), ("eval_accuracy", 2)]
    xs, ys = series[("eval_accuracy", 2)]
    assert xs == ends.tolist()
    np.testing.assert_allclose(ys, [e["eval_accuracy"][2] for e in history.epochs])
    _read_png(_population_history(24).plot(tmp_path / "many.png"))  # no legend past 10


def _pickled_before_num_members(history: History) -> bytes:
    """``history`` pickled as nnxscan pickled a History before ``num_members``: its class
    and a state of ``losses``, ``epochs`` and ``events`` alone."""
    old = History.__new__(History)
    old.__dict__.update({k: v for k, v in vars(history).items() if k != "num_members"})
    data = pickle.dumps(old)
    assert b"num_members" not in data
    return data


def test_a_history_without_num_members_loads_and_plots_as_before(tmp_path):
    """A History pickled before it had ``num_members``, or built by hand without it, reads
    it off its losses: ``(steps, N)`` is N members (a curve and an eval line per member,
    pixel for pixel the plot of the History that declares N), ``(steps,)`` one model."""
    population = _population_history(3)
    declared = History(population.losses, population.epochs, population.events, 3)
    for old in (pickle.loads(_pickled_before_num_members(population)), population):
        assert old.num_members == 3
        drawn = _read_png(old.plot(tmp_path / "old.png"))
        np.testing.assert_array_equal(drawn, _read_png(declared.plot(tmp_path / "new.png")))
        series = _eval_series(old.epochs, np.array([20, 40, 60, 80]), logs_of(old))
        assert sorted(series) == [("eval_accuracy", m) for m in range(3)]
    one = pickle.loads(_pickled_before_num_members(_history(True)))
    assert one.num_members is None and History(np.zeros(0), [], []).num_members is None
    _read_png(one.plot(tmp_path / "one.png"))
    # Kept by a pickle and a copy once declared.
    assert pickle.loads(pickle.dumps(declared)).num_members == 3
    assert copy.deepcopy(History(np.zeros(0), num_members=2)).num_members == 2


def _eval_label(tmp_path, logged_at: list[int], epochs: int, monkeypatch) -> str:
    """The eval panel's y label of a History that logged eval_* at ``logged_at``."""
    figure = pytest.importorskip("matplotlib.figure")
    saved, original = [], figure.Figure.savefig
    monkeypatch.setattr(
        figure.Figure,
        "savefig",
        lambda self, *a, **k: saved.append(self) or original(self, *a, **k),
    )
    history = History()
    for epoch in range(epochs):
        logs = {"epoch": epoch, "steps": 5, "loss": 1.0}
        if epoch in logged_at:
            logs["eval_accuracy"] = 0.5
        history._append(np.linspace(2.0, 1.0, 5), logs)
    history.plot(tmp_path / f"eval_{len(saved)}.png")
    return saved[-1].axes[1].get_ylabel()


@pytest.mark.parametrize(
    "logged_at, epochs, label",
    [
        ([4, 9, 14, 19, 24, 29], 30, "eval (every 5th epoch)"),  # the digits demo's eval_every=5
        (list(range(6)), 6, "eval (per epoch)"),
        ([1, 3, 5], 6, "eval (every 2nd epoch)"),
        ([2, 5, 8], 9, "eval (every 3rd epoch)"),
        ([10, 21], 22, "eval (every 11th epoch)"),
        ([3], 6, "eval (epoch 3)"),
        ([0, 3, 4], 6, "eval (epochs 0, 3 and 4)"),
        ([0, 1, 3, 6, 10], 12, "eval (5 of 12 epochs)"),
    ],
)
def test_the_eval_panel_says_which_epochs_it_was_logged_at(
    tmp_path, monkeypatch, logged_at, epochs, label
):
    assert _eval_label(tmp_path, logged_at, epochs, monkeypatch) == label
