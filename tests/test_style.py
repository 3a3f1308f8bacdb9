"""ruff, configured in pyproject.toml, is part of the suite so style can't drift."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff() -> str:
    beside = pathlib.Path(sys.executable).parent / "ruff"
    exe = str(beside) if beside.exists() else shutil.which("ruff")
    assert exe, "ruff is part of the test extra: pip install -e '.[test]'"
    return exe


def test_ruff_check_passes():
    out = subprocess.run([_ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_is_clean():
    out = subprocess.run(
        [_ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
