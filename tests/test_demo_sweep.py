"""``nnxscan demo sweep``: 4 learning rates x 4 seeds of the digits MLP in one Population."""

from __future__ import annotations

import re

import numpy as np
import pytest

from nnxscan.shell.demos.sweep import LEARNING_RATES, run_sweep_demo


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
