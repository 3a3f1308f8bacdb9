"""The pieces of .ci/run's second run: finding a Python >= 3.12, and lifting the version caps."""

from __future__ import annotations

import importlib.util
import pathlib
import re
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


# -- .ci/run's lanes and runs, on fake interpreters -------------------------------------------

_FAKE_PYTHON = """\
# "-m venv DIR" makes a venv whose pip exits $PIP_{which} and whose pytest prints its venv and
# arguments, then exits $PYTEST_SLOW_{which} when asked for the slow lane (-m slow) and
# $PYTEST_{which} otherwise; anything else (a version check, a script) succeeds silently.
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  {mkdir} -p "$3/bin"
  printf '#!{sh}\\nexit 0\\n' > "$3/bin/python"
  printf '#!{sh}\\nexit %s\\n' "${{PIP_{which}:-0}}" > "$3/bin/pip"
  printf '#!{sh}\\necho "pytest ran in %s: $*"\\n' "$3" > "$3/bin/pytest"
  printf 'case "$*" in *slow*) exit %s;; esac\\nexit %s\\n' \\
    "${{PYTEST_SLOW_{which}:-0}}" "${{PYTEST_{which}:-0}}" >> "$3/bin/pytest"
  {chmod} +x "$3/bin/python" "$3/bin/pip" "$3/bin/pytest"
fi
exit 0
"""


def _ci(tmp_path: pathlib.Path, newer: bool, **statuses: int) -> subprocess.CompletedProcess:
    """Runs a copy of .ci/run where ``python3`` (and, if ``newer``, ``python3.13``) are
    fakes, and only the tools the script needs are on PATH."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / ".ci").mkdir(parents=True)
    bin_dir.mkdir()
    for name in ("run", "find_newer_python"):
        shutil.copy2(ROOT / ".ci" / name, repo / ".ci" / name)
    for tool in ("bash", "rm", "dirname", "sort"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    tools = {name: shutil.which(name) for name in ("sh", "mkdir", "chmod")}
    _fake(bin_dir / "python3", _FAKE_PYTHON.format(which="MAIN", **tools))
    if newer:
        _fake(bin_dir / "python3.13", _FAKE_PYTHON.format(which="NEWEST", **tools))
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "none")}
    env |= {name.upper(): str(status) for name, status in statuses.items()}
    return subprocess.run(
        [shutil.which("bash"), str(repo / ".ci/run")],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip


def _pytest_runs(out: subprocess.CompletedProcess) -> list[str]:
    """Each fake pytest's venv and arguments, in the order they ran."""
    prefix = "pytest ran in "
    runs = [
        line.removeprefix(prefix) for line in out.stdout.splitlines() if line.startswith(prefix)
    ]
    return [run.rpartition("/")[2].strip() for run in runs]


def test_ci_runs_both_lanes_on_the_pinned_releases_then_the_fast_lane_on_the_newest(tmp_path):
    out = _ci(tmp_path, newer=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _pytest_runs(out) == [".venv:", ".venv: -m slow -n 2 --dist loadfile", ".venv-newest:"]
    for lane in ("fast lane (pinned releases)", "slow lane (pinned releases)",
                 "fast lane (newest releases)"):  # fmt: skip
        assert re.search(rf"^CI: {re.escape(lane)} passed in \d+ s$", out.stdout, re.M), lane
    assert "CI: newest run passed" in out.stdout


@pytest.mark.parametrize("failure", [{"pytest_main": 1}, {"pip_main": 1}, {"pytest_main": 5}])
def test_a_failed_fast_lane_fails_ci_and_nothing_else_starts(tmp_path, failure):
    out = _ci(tmp_path, newer=True, **failure)
    assert out.returncode == failure.get("pytest_main", out.returncode) != 0
    assert _pytest_runs(out) == ([".venv:"] if "pytest_main" in failure else [])
    assert ".venv-newest" not in out.stdout + out.stderr
    assert not (tmp_path / "repo/.venv-newest").exists()


@pytest.mark.parametrize("status", [1, 5])
def test_a_failed_slow_lane_fails_ci_and_the_newest_run_never_starts(tmp_path, status):
    """5: pytest ran no test (the slow lane lost its tests)."""
    out = _ci(tmp_path, newer=True, pytest_slow_main=status)
    assert out.returncode == status
    assert _pytest_runs(out) == [".venv:", ".venv: -m slow -n 2 --dist loadfile"]
    assert "CI: fast lane (pinned releases) passed" in out.stdout
    assert f"CI: slow lane (pinned releases) failed (pytest exit {status})" in out.stdout
    assert "CI: main run passed" not in out.stdout
    assert not (tmp_path / "repo/.venv-newest").exists()


@pytest.mark.parametrize("failure", [{"pytest_newest": 1}, {"pip_newest": 1}])
def test_a_failed_newest_run_fails_ci(tmp_path, failure):
    out = _ci(tmp_path, newer=True, **failure)
    assert out.returncode != 0
    assert "CI: main run passed" in out.stdout
    assert "CI: newest run passed" not in out.stdout


def test_without_a_newer_python_ci_prints_one_line_and_passes_on_the_main_run(tmp_path):
    out = _ci(tmp_path, newer=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _pytest_runs(out) == [".venv:", ".venv: -m slow -n 2 --dist loadfile"]
    lines = out.stdout.splitlines()
    assert lines[-2].startswith("CI: main run passed")
    assert lines[-1].startswith("CI: no Python >= 3.12") and "skipped" in lines[-1]
