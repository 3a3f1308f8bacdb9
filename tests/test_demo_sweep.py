"""``nnxscan demo sweep``: 4 learning rates x 4 seeds of the digits MLP in one Population."""

from __future__ import annotations

import re

import numpy as np
import pytest

from nnxscan.shell.demos.sweep import LEARNING_RATES, run_sweep_demo


@pytest.mark.slow
def test_sweep_demo_prints_a_table_writes_a_png_and_finds_the_best_member(tmp_path, capsys):
    result = run_sweep_demo(tmp_path / "out", epochs=10, progress=False)
    out = capsys.readouterr().out

    png = (tmp_path / "out" / "nnxscan_demo_sweep.png").resolve()
    assert result["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in out.splitlines()

    rows = [line for line in out.splitlines() if re.match(r"\s*\d(\.\d+)?e-0\d\s", line)]
    assert len(rows) == len(LEARNING_RATES) == 4
    assert all(len(re.findall(r"[\d.]+%", row)) == 5 for row in rows)  # 4 seeds + the mean

    acc = np.asarray(result["accuracy"])
    assert acc.shape == (4, 4)
    assert ((acc >= 0) & (acc <= 1)).all()
    best = result["best"]
    assert best["accuracy"] == pytest.approx(acc.max())
    i, j = LEARNING_RATES.index(best["learning_rate"]), result["seeds"].index(best["seed"])
    assert acc[i, j] == pytest.approx(acc.max())
    assert best["accuracy"] >= 0.9
    assert re.search(rf"best: learning rate {best['learning_rate']:.0e}, seed {best['seed']}", out)


def test_sweep_plot_keeps_equal_scores_apart_and_labels_every_decade():
    from matplotlib.colors import to_rgba

    from nnxscan.shell.demos.sweep import draw_sweep

    rates, seeds = list(LEARNING_RATES), [0, 1, 2, 3]
    acc = np.full((4, 4), 0.9)
    acc[3] = [0.99, 0.9916, 0.985, 0.9916]  # seeds 1 and 3 tie at lr 1e-2, as in the issue
    fig = draw_sweep(rates, seeds, acc)
    fig.canvas.draw()
    (ax,) = fig.axes
    collections = ax.collections
    assert len(collections) == 4  # one per seed
    points = []
    for j, collection in enumerate(collections):
        xy = np.asarray(collection.get_offsets())
        np.testing.assert_array_equal(xy[:, 1], acc[:, j])  # accuracies drawn exactly
        # Shifted along x only a little: each marker stays nearer its own rate than any other.
        shift = np.abs(np.log10(xy[:, 0]) - np.log10(rates))
        assert (shift > 0).all()
        assert (shift < 0.1).all()
        assert all(to_rgba(face)[3] == 0 for face in collection.get_facecolors())  # hollow
        points += [tuple(p) for p in ax.transData.transform(xy)]
    # Every two markers, equal scores included, have centres at least a marker's width
    # (sqrt(s) points, at the figure's dpi) apart on screen.
    width = np.sqrt(collections[0].get_sizes()[0]) * fig.dpi / 72
    centres = np.array(points)
    gaps = np.linalg.norm(centres[:, None] - centres[None], axis=-1)[np.triu_indices(16, 1)]
    assert gaps.min() >= width, gaps.min()
    assert len({c.get_paths()[0].vertices.tobytes() for c in collections}) == 4  # 4 shapes

    # Every decade from below the smallest rate to above the largest is a labelled major
    # tick inside the axis; every swept rate has a labelled tick.
    low, high = ax.get_xlim()
    majors, minors = (
        dict(zip(ax.get_xticks(minor=m), [t.get_text() for t in ax.get_xticklabels(minor=m)],
                 strict=True))
        for m in (False, True)
    )  # fmt: skip
    decades = [10.0**k for k in range(-4, -1)]
    assert low <= min(decades) and max(decades) <= high
    assert [majors.get(d) for d in decades] == ["1e-4", "1e-3", "1e-2"]
    labelled = {**majors, **minors}
    assert [labelled.get(r) for r in rates] == ["3e-4", "1e-3", "3e-3", "1e-2"]
