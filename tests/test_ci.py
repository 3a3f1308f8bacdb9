"""The pieces of .ci/run's second run: finding a Python >= 3.12, and lifting the version caps."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIND = ROOT / ".ci" / "find_newer_python"


def _load_uncapped():
    spec = importlib.util.spec_from_file_location("uncapped", ROOT / ".ci/uncapped_requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("requirement", "expected"),
    [
        ("jax>=0.10,<0.13", "jax>=0.10"),
        ("optax>=0.2.8,<0.3", "optax>=0.2.8"),
        ("flax <= 0.12.12", "flax"),
        ("numpy~=2.1", "numpy>=2.1"),
        ("rich>=13", "rich>=13"),
        ("orbax-checkpoint==0.12.8", "orbax-checkpoint==0.12.8"),
        ("grain[parquet]>=0.2,<1,!=0.2.5", "grain[parquet]>=0.2,!=0.2.5"),
        ('tomli>=2,<3; python_version < "3.11"', 'tomli>=2; python_version < "3.11"'),
    ],
)
def test_uncapped_drops_upper_bounds_and_keeps_the_rest(requirement, expected):
    assert _load_uncapped().uncapped(requirement) == expected


def test_the_uncapped_list_is_pyprojects_dependencies_and_test_extra_without_caps():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci/uncapped_requirements.py")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    printed = out.stdout.splitlines()
    declared = project["dependencies"] + project["optional-dependencies"]["test"]
    assert len(printed) == len(declared)
    for line, requirement in zip(printed, declared, strict=True):
        # Same distribution, every clause but the caps kept, in order.
        name, *clauses = requirement.replace(">=", ",>=").replace("!=", ",!=").split(",")
        kept = [c for c in clauses if c and not c.startswith("<")]
        assert line == name + ",".join(kept), (requirement, line)


# -- finding a newer Python -------------------------------------------------------------------


def _fake(path: pathlib.Path, body: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _find(path_dir: pathlib.Path, pyenv_root: pathlib.Path) -> subprocess.CompletedProcess:
    # Only the fakes and `sort` on PATH, so a real python3.12 of the machine can't answer.
    (path_dir / "sort").symlink_to(shutil.which("sort"))
    env = {"PATH": str(path_dir), "PYENV_ROOT": str(pyenv_root), "HOME": str(path_dir)}
    return subprocess.run(
        [shutil.which("bash"), str(FIND)], capture_output=True, text=True, env=env, check=False
    )


def test_a_failing_shim_on_path_is_skipped_for_pyenvs_newest_version(tmp_path):
    bin_dir, root = tmp_path / "bin", tmp_path / "pyenv"
    # What a pyenv shim does where pyenv has not selected 3.13: exists, fails when run.
    _fake(bin_dir / "python3.13", 'echo "pyenv: python3.13: command not found" >&2; exit 127')
    for version in ("3.12.4", "3.12.10", "3.13.9", "3.13.10"):
        _fake(root / "versions" / version / "bin" / f"python{version[:4]}", "exit 0")
    found = _find(bin_dir, root)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(root / "versions/3.13.10/bin/python3.13")


def test_a_working_python_on_path_comes_first_and_312_when_no_313(tmp_path):
    bin_dir, root = tmp_path / "bin", tmp_path / "pyenv"
    on_path = _fake(bin_dir / "python3.12", "exit 0")
    _fake(root / "versions/3.12.10/bin/python3.12", "exit 0")
    _fake(root / "versions/3.11.7/bin/python3.11", "exit 0")
    assert _find(bin_dir, root).stdout.strip() == str(on_path)


def test_an_older_interpreter_behind_a_newer_name_is_refused(tmp_path):
    bin_dir, root = tmp_path / "bin", tmp_path / "pyenv"
    # A real interpreter that says it is 3.11 (whichever Python runs this suite), whatever
    # its name says: the finder must read the version, not trust the name.
    as_311 = "import sys; sys.version_info = (3, 11, 7, 'final', 0); exec(sys.argv[1])"
    _fake(bin_dir / "python3.13", f'exec "{sys.executable}" -c "{as_311}" "$2"')
    found = _find(bin_dir, root)
    assert (found.returncode, found.stdout) == (1, "")


def test_no_newer_python_prints_nothing_and_fails(tmp_path):
    (tmp_path / "bin").mkdir()
    found = _find(tmp_path / "bin", tmp_path / "no-pyenv")
    assert (found.returncode, found.stdout) == (1, "")
