"""``nnxscan demo ppo``: what it prints, the PNG it draws, and the command line that runs it."""

from __future__ import annotations

import re

import numpy as np
import pytest

from nnxscan.shell import cli
from nnxscan.shell.demos import ppo_demo
from nnxscan.shell.demos.ppo import PPOConfig


@pytest.mark.slow
def test_ppo_demo_prints_each_seeds_return_and_the_time_and_writes_a_png(tmp_path, capsys):
    total = 4 * 128 * 5  # 5 updates: the printing and plotting, not the learning
    result = ppo_demo.run_ppo_demo(tmp_path / "out", seeds=2, seed=3, total_timesteps=total)
    out = capsys.readouterr().out

    png = (tmp_path / "out" / "nnxscan_demo_ppo.png").resolve()
    assert result["plot"] == str(png) and f"wrote {png}" in out.splitlines()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["seeds"] == [3, 4] and result["env_steps"] == total
    printed = [float(v) for v in re.findall(r"^seed \d: final return ([\d.]+)$", out, re.M)]
    assert printed == pytest.approx(result["final_return"], abs=0.05) and len(printed) == 2
    assert all(0 < v < 500 for v in printed)
    match = re.search(r"whole run ([\d.]+) s \(compile ([\d.]+) s \+ train ([\d.]+) s\)", out)
    assert match, out
    assert float(match.group(1)) == pytest.approx(result["compile_s"] + result["train_s"], abs=0.1)


def test_the_figure_draws_a_line_per_seed_and_their_mean_in_bold():
    steps = PPOConfig(total_timesteps=4 * 128 * 3).env_steps()
    returns = np.array([[10.0, 20.0, 30.0], [30.0, 60.0, 90.0]])
    fig = ppo_demo.draw_returns(steps, returns, [0, 1])
    (ax,) = fig.get_axes()
    lines = ax.get_lines()
    assert len(lines) == 3
    *seeds, mean = lines
    for line, curve in zip(seeds, returns, strict=True):
        np.testing.assert_array_equal(line.get_xdata(), [512, 1024, 1536])
        np.testing.assert_array_equal(line.get_ydata(), curve)
    np.testing.assert_array_equal(mean.get_ydata(), [20.0, 40.0, 60.0])
    assert mean.get_linewidth() > 2 * max(line.get_linewidth() for line in seeds)
    assert ax.get_xlabel() == "environment steps" and ax.get_ylabel() == "episode return"


def test_the_command_line_runs_the_ppo_demo_with_its_seeds(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(ppo_demo, "run_ppo_demo", lambda out, **kw: calls.append((out, kw)))
    argv = ["demo", "ppo", "--seeds", "4", "--seed", "2", "--out", str(tmp_path)]
    assert cli.main([*argv, "--no-compile-cache"]) == 0
    assert calls == [(str(tmp_path), {"seeds": 4, "seed": 2})]
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    assert re.search(r"ppo\s+PPO on CartPole", capsys.readouterr().out)


@pytest.mark.parametrize(("seeds", "seed"), [(0, 0), (2, -1)])
def test_bad_seed_counts_are_refused_before_anything_runs(tmp_path, seeds, seed):
    with pytest.raises(ValueError, match="seed"):
        ppo_demo.run_ppo_demo(tmp_path, seeds=seeds, seed=seed, total_timesteps=512)
    assert not (tmp_path / "nnxscan_demo_ppo.png").exists()
