"""``nnxscan --help`` and ``--version`` answer before jax is imported; the shell loads lazily."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

import nnxscan.shell

HEAVY = ("jax", "jaxlib", "flax", "optax", "numpy")


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_cli_flag_imports_no_jax(flag):
    out = _run_python(
        f"""
        import contextlib, io, sys
        from nnxscan.shell.cli import main
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            try:
                main([{flag!r}])
            except SystemExit as exit:
                assert exit.code == 0, exit.code
        assert text.getvalue().strip(), "nothing printed"
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def _console_script() -> str:
    beside = pathlib.Path(sys.executable).parent / "nnxscan"
    exe = str(beside) if beside.exists() else shutil.which("nnxscan")
    assert exe, "the nnxscan console script is not installed"
    return exe


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_installed_console_script_imports_no_jax(flag):
    # -X importtime's log, switched on by environment for the console script: one line per
    # module imported, so a jax import anywhere on the way shows.
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    out = subprocess.run(
        [_console_script(), flag], capture_output=True, text=True, timeout=120, env=env,
        check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "nnxscan" in out.stdout
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in out.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "nnxscan.shell.cli" in imported, "the import log was not captured"
    assert not {m for m in imported if m.split(".")[0] in HEAVY}, sorted(imported)


@pytest.mark.slow  # a fresh Python process (~1.5 s)
def test_importing_the_shell_loads_no_module_until_a_name_is_used():
    out = _run_python(
        """
        import sys
        import nnxscan.shell
        before = "jax" in sys.modules or "nnxscan.shell.trainer" in sys.modules
        from nnxscan.shell import Trainer
        from nnxscan.shell.trainer import Trainer as Direct
        assert Trainer is Direct
        print(before, "jax" in sys.modules)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_every_public_name_resolves_and_a_missing_one_raises_attribute_error():
    from nnxscan.shell.callbacks import EarlyStopping
    from nnxscan.shell.population import Population

    assert nnxscan.shell.EarlyStopping is EarlyStopping
    assert nnxscan.shell.Population is Population
    for name in nnxscan.shell.__all__:
        assert getattr(nnxscan.shell, name).__name__ == name
        assert name in dir(nnxscan.shell)
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        nnxscan.shell.Trainr  # noqa: B018
    with pytest.raises(ImportError, match="Trainr"):
        exec("from nnxscan.shell import Trainr", {})
    assert not hasattr(nnxscan.shell, "not_a_name")
