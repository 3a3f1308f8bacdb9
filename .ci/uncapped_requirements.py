"""Print nnxscan's dependencies and its test extra with every upper bound removed.

CI's second run installs these (``pip install -r``), then nnxscan itself with ``--no-deps``,
so pip resolves the NEWEST releases that install on that Python, whatever pyproject.toml's
window says; lower bounds stay. Read from pyproject.toml so the list never drifts from it.

Run: ``python .ci/uncapped_requirements.py [pyproject.toml]`` (Python >= 3.11, stdlib only).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def uncapped(requirement: str) -> str:
    """``"jax>=0.10,<0.11"`` -> ``"jax>=0.10"``; ``==`` pins, extras and markers are kept."""
    spec, _, marker = requirement.partition(";")
    name_end = next((i for i, c in enumerate(spec) if c in "<>=!~ "), len(spec))
    name, clauses = spec[:name_end], spec[name_end:]
    kept = [
        # "~=1.2" caps too (>=1.2, ==1.*): keep only its floor.
        c.strip().replace("~=", ">=", 1)
        for c in clauses.split(",")
        if c.strip() and not c.strip().startswith("<")
    ]
    out = name.strip() + ",".join(kept)
    return f"{out}; {marker.strip()}" if marker else out


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[1] / "pyproject.toml")
    project = tomllib.loads(path.read_text())["project"]
    for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
        print(uncapped(requirement))


if __name__ == "__main__":
    main()
