"""``nnxscan demo hypernet-cl``: a hypernetwork keeps 5 split-digits tasks, fine-tuning forgets."""

from __future__ import annotations

import re

import numpy as np
import pytest

import nnxscan.shell
from nnxscan.shell.cli import DEMOS, main
from nnxscan.shell.demos import hypernet_cl
from nnxscan.shell.demos.hypernet_cl import format_accuracy_matrix, run_hypernet_cl_demo


@pytest.mark.slow
def test_hypernet_cl_demo_remembers_every_task_where_fine_tuning_forgets(
    tmp_path, capsys, monkeypatch
):
    # Through the command line, progress on: off a terminal (captured), fit prints a line
    # per epoch (its first and last at least), each under a line naming learner and task.
    results = []
    monkeypatch.setattr(
        hypernet_cl, "run_hypernet_cl_demo",
        lambda *a, **k: results.append(run_hypernet_cl_demo(*a, **k)) or results[-1],
    )  # fmt: skip
    assert main(["demo", "hypernet-cl", "--out", str(tmp_path / "out"), "--no-compile-cache"]) == 0
    (result,) = results
    out = capsys.readouterr().out

    learners = ["hypernetwork", "fine-tuned baseline"]
    headers = [f"{name}: task {t} of 5" for name in learners for t in range(1, 6)]
    lines = out.splitlines()
    at = [i for i, line in enumerate(lines) if line in headers]
    assert [lines[i] for i in at] == headers, "each learner's tasks, in order"
    for start, end in zip(at, [*at[1:], len(lines)], strict=True):
        group = [line for line in lines[start + 1 : end] if re.match(r"epoch \d+ ", line)]
        assert group and group[0].startswith("epoch 0 ") and group[-1].startswith("epoch 29 ")
    first_epoch_line = next(i for i, line in enumerate(lines) if re.match(r"epoch \d+ ", line))
    assert first_epoch_line > at[0], "no epoch line comes before its learner and task"

    png = (tmp_path / "out" / "nnxscan_demo_hypernet-cl.png").resolve()
    assert result["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in out.splitlines()

    hnet, base = np.asarray(result["hypernetwork"]), np.asarray(result["baseline"])
    for acc in (hnet, base):
        assert acc.shape == (5, 5)
        assert np.isnan(acc[np.triu_indices(5, 1)]).all()
        assert ((acc[np.tril_indices(5)] >= 0) & (acc[np.tril_indices(5)] <= 1)).all()
    # the goals
    assert hnet[-1].mean() >= 0.95
    assert hnet[0, 0] - hnet[-1, 0] <= 0.02
    assert base[0, 0] - base[-1, 0] >= 0.2  # fine-tuning visibly forgets task 1
    assert base[-1].mean() <= hnet[-1].mean() - 0.05
    assert result["compression_ratio"] < 1
    assert result["final_average"] == {
        "hypernetwork": pytest.approx(hnet[-1].mean()),
        "baseline": pytest.approx(base[-1].mean()),
    }

    # both tables are printed, a row per task learned, and the final averages
    rows = [line for line in out.splitlines() if re.match(r"\s*after task \d", line)]
    assert len(rows) == 10
    assert [len(re.findall(r"[\d.]+%", row)) for row in rows[:5]] == [2, 3, 4, 5, 6]
    assert f"{hnet[-1].mean():.1%}" in out and f"{base[-1].mean():.1%}" in out
    assert len(re.findall(r"final average accuracy", out)) == 2


def test_accuracy_table_leaves_untrained_tasks_blank():
    acc = np.array([[1.0, np.nan], [0.5, 0.75]])
    table = format_accuracy_matrix("title", acc).splitlines()
    assert table[0] == "title"
    assert re.findall(r"[\d.]+%", table[2]) == ["100.0%", "100.0%"]
    assert re.findall(r"[\d.]+%", table[3]) == ["50.0%", "75.0%", "62.5%"]


def test_the_cli_lists_the_demo():
    assert "hypernet-cl" in DEMOS


def test_the_cli_runs_the_demo_with_its_arguments(tmp_path, monkeypatch):
    calls, caches = [], []
    monkeypatch.setattr(
        hypernet_cl, "run_hypernet_cl_demo", lambda *a, **k: calls.append((a, k)) or {}
    )
    monkeypatch.setattr(nnxscan.shell, "enable_compilation_cache", caches.append)
    out = str(tmp_path / "plots")
    argv = ["demo", "hypernet-cl", "--out", out, "--seed", "3", "--no-progress"]
    assert main([*argv, "--compile-cache", str(tmp_path / "cache")]) == 0
    assert main([*argv, "--no-compile-cache"]) == 0
    assert main(["demo", "hypernet-cl", "--no-compile-cache"]) == 0  # the defaults
    assert calls == [
        ((out,), {"seed": 3, "progress": False}),
        ((out,), {"seed": 3, "progress": False}),
        ((".",), {"seed": 0, "progress": True}),
    ]
    assert caches == [str(tmp_path / "cache")]  # --no-compile-cache enables none
