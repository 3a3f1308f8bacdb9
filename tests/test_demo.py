"""``nnxscan demo`` end to end, through the installed console script."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from nnxscan.adapters._extras import require_extra


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
    png = tmp_path / "nnxscan_digits_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
