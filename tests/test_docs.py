"""The README and every guide in docs/ run as written, and link only inside the repository.

Conventions for the ```` ```python ```` blocks of a markdown file (other fences never run):

- The blocks of one file run in order, in one fresh namespace, as a user would paste them
  into one session; the working directory is a temporary folder, so files the examples
  write (checkpoints, logs, plots) never land in the repository. One test per file.
- A block whose first line is ``# file: NAME`` is a script, not a snippet: it is written to
  ``NAME`` in that folder instead of being run in the namespace. If its second line is
  ``# run: CMD & CMD ...``, the commands (split on ``&``; a leading ``python`` means this
  interpreter) are started at once as separate processes, which must all exit 0 within
  ``SCRIPT_TIMEOUT`` seconds. They run on the CPU with ``COORDINATOR`` set to
  ``127.0.0.1:<free port>``, so a multi-process script reads its ``jax.distributed``
  coordinator address from that variable (and may default to a fixed port for users).

For example, a two-process script in docs/scaling.md starts with::

    # file: train.py
    # run: python train.py 0 & python train.py 1
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 200
SCRIPT_TIMEOUT = 300

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, code, first line number)`` of each fenced block, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        fence, language, start = opened.group(1), opened.group(2).lower(), i + 1
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            i += 1
        blocks.append((language, "\n".join(lines[start:i]) + "\n", start + 1))
        i += 1
    return blocks


def outside_fences(text: str) -> str:
    """The text outside fenced blocks."""
    kept, inside = [], None
    for line in text.splitlines():
        opened = _FENCE.match(line)
        if inside is None and opened:
            inside = opened.group(1)
        elif inside is not None and line.startswith(inside):
            inside = None
        elif inside is None:
            kept.append(line)
    return "\n".join(kept)


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code spans."""
    return re.sub(r"(`+).+?\1", "", outside_fences(text), flags=re.DOTALL)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _script_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "JAX_PLATFORMS": "cpu", "COORDINATOR": f"127.0.0.1:{_free_port()}"}


def run_script(code: str, where: pathlib.Path, label: str) -> None:
    """Writes a ``# file:`` block and runs the processes of its ``# run:`` line."""
    lines = code.splitlines()
    name = lines[0].removeprefix("# file:").strip()
    (where / name).write_text(code)
    if len(lines) < 2 or not lines[1].startswith("# run:"):
        return
    commands = [shlex.split(c) for c in lines[1].removeprefix("# run:").split("&")]
    commands = [[sys.executable, *c[1:]] if c[0] == "python" else c for c in commands if c]
    env = _script_env()
    # Output goes to files, not pipes: a process blocked on a full pipe would stall the
    # other one in its collectives.
    logs = [where / f"{name}.{i}.log" for i in range(len(commands))]
    procs = []
    try:
        for command, log in zip(commands, logs, strict=True):
            with log.open("w") as out:
                procs.append(
                    subprocess.Popen(
                        command, cwd=where, env=env, stdout=out, stderr=subprocess.STDOUT
                    )
                )
        for p in procs:
            p.wait(timeout=SCRIPT_TIMEOUT)
    finally:
        for p in procs:
            p.kill()
    for command, p, log in zip(commands, procs, logs, strict=True):
        assert p.returncode == 0, (
            f"{label}: {shlex.join(command[1:])} exited {p.returncode}:\n{log.read_text()[-3000:]}"
        )


# The slow lane (pyproject.toml): guides whose scripts start processes, and the guides whose
# examples train longest (their library paths have fast tests of their own).
SLOW_GUIDES = {"custom_loops.md", "custom_steps.md", "evaluation.md", "hypernetworks.md",
               "populations.md", "porting.md", "pure_core.md",
               "reinforcement_learning.md", "training.md"}  # fmt: skip


# Guides in the slow lane off the CPU only (tests/conftest.py, lane_for_backend), and why.
SLOW_ON_ACCELERATOR_GUIDES = {"performance.md": "its examples' eager loops: 12 s on a TPU v5e"}


def _lane(path: pathlib.Path):
    slow = path.name in SLOW_GUIDES or "\n# run:" in path.read_text()
    marks = [pytest.mark.slow] if slow else []
    if path.name in SLOW_ON_ACCELERATOR_GUIDES:
        marks.append(pytest.mark.slow_on_accelerator(SLOW_ON_ACCELERATOR_GUIDES[path.name]))
    return pytest.param(path, id=path.name, marks=marks)


@pytest.mark.parametrize("path", [_lane(p) for p in MARKDOWN])
def test_python_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for language, code, line in fenced_blocks(path.read_text()):
        if language != "python":
            continue
        label = f"{path.relative_to(ROOT)}, the python block at line {line}"
        if code.startswith("# file:"):
            run_script(code, tmp_path, label)
        else:
            exec(compile(code, label, "exec"), namespace)


def test_readme_and_guides_have_examples():
    for path in (ROOT / "README.md", *(DOCS / n for n in ("training.md", "pure_core.md"))):
        blocks = [b for b in fenced_blocks(path.read_text()) if b[0] == "python"]
        assert len(blocks) >= 2, f"{path.name} lost its examples"


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move text into docs/"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", outside_fences(path.read_text()), re.MULTILINE)
    return {_slug(h) for h in headings}


_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://|\bmailto:|\bwww\.", re.IGNORECASE)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)


@pytest.mark.parametrize("path", MARKDOWN, ids=[p.name for p in MARKDOWN])
def test_links_stay_inside_the_repository(path):
    text = path.read_text()
    urls = [m.group(0) for m in _URL.finditer(text)]
    assert not urls, f"{path.name} points outside the repository: {urls}"
    visible = prose(text)
    targets = _LINK.findall(visible) + _REFERENCE.findall(visible)
    for target in targets:
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.is_relative_to(ROOT), f"{path.name}: {target} leaves the repository"
        assert linked.exists(), f"{path.name}: {target} does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{path.name}: no heading #{anchor} in {linked.name}"


def test_the_index_lists_every_guide():
    index = DOCS / "index.md"
    linked = {
        pathlib.Path(t.partition("#")[0]).name for t in _LINK.findall(prose(index.read_text()))
    }
    guides = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert guides <= linked, f"docs/index.md does not link {sorted(guides - linked)}"


# -- docs/architecture.md names what exists, and every module --------------------------------

_CODE = re.compile(r"`([^`\n]+)`")
_FILE = re.compile(r"[\w./-]+\.(?:py|md|toml)\b|[\w.-]+(?:/[\w.-]+)*/(?=$|[\s,)])")
PACKAGE_FOLDERS = ("nnxscan", "pure", "shell", "adapters")


def architecture_files(text: str) -> tuple[set[pathlib.Path], list[str]]:
    """The repository paths docs/architecture.md names, and the names that are no file.

    A name with a slash is a path from the repository's root. A bare file name stands in
    the folder its table (the engine's, the edges') or its row (``pure/hyper/``) is about;
    elsewhere it must name a module somewhere in the package."""
    modules = [p for f in PACKAGE_FOLDERS for p in (ROOT / f).rglob("*.py")]
    named, missing = set(), []
    folder = None
    for line in text.splitlines():
        if line.startswith("#"):
            folder = None
        section = re.search(r"\*\*the (?:engine|edges)\*\* \(`([\w/]+/)`\)", line)
        if section:
            folder = ROOT / section.group(1)
        row = re.match(r"\| `(pure/hyper/)` \|", line)
        here = ROOT / row.group(1) if row else folder
        for code in _CODE.findall(line):
            for name in _FILE.findall(code):
                if "/" in name.rstrip("/"):
                    path = ROOT / name
                elif here is not None and (here / name).exists():
                    path = here / name
                else:
                    path = next((m for m in modules if m.name == name), ROOT / name)
                if path.exists():
                    named.add(path)
                else:
                    missing.append(name)
    return named, missing


def test_architecture_names_files_that_exist_and_every_module():
    named, missing = architecture_files((DOCS / "architecture.md").read_text())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
    unnamed = []
    for folder in PACKAGE_FOLDERS:
        for module in sorted((ROOT / folder).rglob("*.py")):
            # The demos are one row of the page; every other module is named on its own.
            demos = ROOT / "shell/demos"
            covered = module in named or (module.is_relative_to(demos) and demos in named)
            if module.name != "__init__.py" and not covered:
                unnamed.append(str(module.relative_to(ROOT)))
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"


def test_the_architecture_reader_resolves_each_form(tmp_path):
    text = (
        "| `pure/scan.py` | `scan_steps`; the rewriter it shares with `threefry.py` |\n"
        "| **the engine** (`shell/_engine/`) | |\n"
        "| `calls.py` | and `no_such.py` |\n"
        "| `pure/hyper/` | `vector.py`, `gone.py` |\n"
        "## Next\n"
        "`tests/conftest.py: reference_loop`, `calls.py`, `shell/demos/`\n"
    )
    named, missing = architecture_files(text)
    assert named == {
        ROOT / "pure/scan.py", ROOT / "pure/threefry.py", ROOT / "shell/_engine/",
        ROOT / "shell/_engine/calls.py", ROOT / "pure/hyper/", ROOT / "pure/hyper/vector.py",
        ROOT / "tests/conftest.py", ROOT / "shell/demos/",
    }  # fmt: skip
    assert missing == ["no_such.py", "gone.py"]
