"""``nnxscan demo`` end to end, through the installed console script."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from nnxscan.adapters._extras import require_extra
from nnxscan.shell.demos._arguments import demo_plot_path


@pytest.mark.slow
def test_digits_demo_reaches_95_percent_and_writes_a_png(tmp_path):
    # The script sits beside the interpreter in a virtual environment that is not activated.
    beside = pathlib.Path(sys.executable).parent / "nnxscan"
    exe = str(beside) if beside.exists() else shutil.which("nnxscan")
    assert exe, "the nnxscan console script is not installed"
    out = subprocess.run(
        [exe, "demo", "--out", str(tmp_path), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    match = re.search(r"held-out accuracy ([\d.]+)%", out.stdout)
    assert match, out.stdout
    assert float(match.group(1)) >= 95.0
    assert re.search(r"[\d,]+ steps/s", out.stdout)
    png = tmp_path / "nnxscan_demo_digits.png"
    assert f"wrote {png.resolve()}" in out.stdout.splitlines()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hypernet_demo_figure_labels_its_axes_and_names_each_task():
    from nnxscan.shell.demos.hypernet import draw_held_out_tasks

    x = np.linspace(-np.pi, np.pi, 50)
    tasks = np.array([[0.5, -1.0], [1.0, 0.0], [1.5, 0.25], [2.0, 1.5]])
    truth = tasks[:, :1] * np.sin(x + tasks[:, 1:])
    fig = draw_held_out_tasks(x, tasks, truth, truth + 0.1)
    axes = fig.get_axes()
    assert len(axes) == 4
    for ax, (a, b) in zip(axes, tasks, strict=True):
        assert ax.get_xlabel() == "x" and ax.get_ylabel() == "y"
        assert f"(a, b) = ({a:.2f}, {b:.2f})" in ax.get_title()


def test_both_demos_write_nnxscan_demo_name_png_into_a_created_folder(tmp_path):
    out = tmp_path / "new" / "folder"
    for name in ("digits", "hypernet"):
        path = demo_plot_path(out, name)
        assert path == (out / f"nnxscan_demo_{name}.png").resolve() and out.is_dir()


def test_missing_extra_names_what_to_install():
    with pytest.raises(ImportError, match=r"pip install 'nnxscan\[demo\]'"):
        require_extra("surely_not_an_installed_module_1234", "demo")


def test_cli_rejects_unknown_demo():
    out = subprocess.run(
        [sys.executable, "-m", "nnxscan.shell.cli", "demo", "nonsense"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode != 0 and "invalid choice" in out.stderr


def test_every_demo_takes_seed_and_progress_and_names_a_misspelling(tmp_path):
    """The options every demo shares are declared once (``DemoArguments``): each demo
    refuses another name before it trains, as Python refuses an unknown keyword."""
    from nnxscan.shell.demos import digits, hypernet, hypernet_cl, lr_find, ppo_demo, sweep

    demos = (
        digits.run_digits_demo, hypernet.run_hypernet_demo, lr_find.run_lr_find_demo,
        hypernet_cl.run_hypernet_cl_demo, sweep.run_sweep_demo, ppo_demo.run_ppo_demo,
    )  # fmt: skip
    for demo in demos:
        with pytest.raises(TypeError, match=rf"{demo.__name__}\(\) .* 'sed'. Did you mean 'seed'"):
            demo(tmp_path, sed=1)
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'verbose'\.$"):
            demo(tmp_path, verbose=False)
    assert not list(tmp_path.iterdir()), "a demo wrote something before refusing"
