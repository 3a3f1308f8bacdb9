"""History.plot: a real PNG, drawn without pyplot's global state, and its smoothing."""

from __future__ import annotations

import numpy as np
import pytest

from nnxscan.shell.history import History, _cap_smoothing, _smooth

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
    image = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = image.imread(path)
    assert pixels[..., :3].var() > 1e-3, "blank image"
    return pixels


@pytest.mark.parametrize("smooth", [0.98, 10])
def test_plot_writes_a_png_with_an_eval_panel(tmp_path, smooth):
    pyplot = pytest.importorskip("matplotlib.pyplot")
    figures_before = pyplot.get_fignums()
    with_eval = _read_png(_history(True).plot(tmp_path / "with.png", smooth=smooth))
    without = _read_png(_history(False).plot(tmp_path / "without.png", smooth=smooth))
    assert with_eval.shape[0] > without.shape[0], "eval metrics get a second panel"
    assert pyplot.get_fignums() == figures_before, "pyplot's figure registry was touched"


def test_plot_returns_the_path_and_handles_non_positive_losses(tmp_path):
    pytest.importorskip("matplotlib")
    history = History()
    history._append(np.array([0.5, -0.25, 0.0, np.nan, 0.1]), {"epoch": 0, "steps": 5})
    out = history.plot(str(tmp_path / "curve.png"))
    assert out == tmp_path / "curve.png"
    _read_png(out)


def test_plot_of_an_empty_history_raises(tmp_path):
    with pytest.raises(ValueError, match="nothing to plot"):
        History().plot(tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_smoothing_ignores_non_finite_losses():
    x = np.array([4.0, np.nan, 2.0, 6.0, np.inf, 1.0, 3.0])
    # Trailing window: the mean of the finite values among the last `w` steps.
    expected = [np.nanmean(np.where(np.isfinite(x), x, np.nan)[max(0, i - 2) : i + 1])
                for i in range(len(x))]  # fmt: skip
    np.testing.assert_allclose(_smooth(x, 3), expected)
    # A bias-corrected EMA of a constant is that constant from the first step, gaps included.
    constant = np.where(np.isfinite(x), 2.5, x)
    np.testing.assert_allclose(_smooth(constant, 0.9), np.full(len(x), 2.5))
    # Hand-computed: weights 0.5 / 0.5, bias-corrected after each finite value.
    ema = _smooth(np.array([2.0, np.nan, 4.0]), 0.5)
    np.testing.assert_allclose(ema, [2.0, 2.0, (0.5 * 1.0 + 2.0) / 0.75])
    np.testing.assert_array_equal(_smooth(x, 0.0)[np.isfinite(x)], x[np.isfinite(x)])
    for bad in (1.0, -0.5, True, "0.9", -3):
        with pytest.raises(ValueError, match="smooth"):
            _smooth(x, bad)


def test_smoothing_spans_at_most_a_tenth_of_the_run():
    assert _cap_smoothing(0.98, 100_000) == 0.98 and _cap_smoothing(500, 100_000) == 500
    assert _cap_smoothing(0.98, 150) == pytest.approx(1 - 1 / 15)
    assert _cap_smoothing(50, 150) == 15
    assert _cap_smoothing(0.98, 5) == 0.0 and _cap_smoothing(3, 5) == 1  # no smoothing
