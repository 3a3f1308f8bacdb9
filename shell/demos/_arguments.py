"""What every demo takes besides its own options, declared once: where it writes its plot
(``out_dir``: one name scheme, one folder rule), its seed and its progress display.

Each ``run_<name>_demo(out_dir=".", *, <its own options>, **options:
Unpack[DemoArguments])`` reads ``seed`` and ``progress`` with :func:`demo_arguments`, as
the front doors read theirs (``shell/_construction.py``).
"""

from __future__ import annotations

import difflib
import os
import pathlib
from collections.abc import Mapping
from typing import Any, TypedDict


class DemoArguments(TypedDict, total=False):
    """``seed`` and ``progress``: what every demo takes (``nnxscan demo``'s ``--seed`` and
    ``--no-progress``)."""

    seed: int  # seeds the data, the initial weights and the shuffling (default 0)
    progress: bool  # show progress bars (default True)


#: Each of :class:`DemoArguments`' defaults.
DEMO_DEFAULTS: dict[str, Any] = {"seed": 0, "progress": True}


def demo_arguments(demo: str, options: Mapping[str, Any]) -> tuple[int, bool]:
    """``(seed, progress)`` of a demo's ``**options``, defaulted.

    Raises:
      TypeError: a name no demo takes (as Python says of a parameter it does not know),
        with the close one when it is a misspelling.

    Example:
      >>> demo_arguments("run_sweep_demo", {"progress": False})
      (0, False)
    """
    for name in options:
        if name not in DEMO_DEFAULTS:
            close = difflib.get_close_matches(name, DEMO_DEFAULTS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{demo}() got an unexpected keyword argument {name!r}.{hint}")
    given = {**DEMO_DEFAULTS, **options}
    return given["seed"], given["progress"]


def demo_plot_path(out_dir: str | os.PathLike[str], name: str) -> pathlib.Path:
    """``<out_dir>/nnxscan_demo_<name>.png`` as an absolute path, its folder created."""
    folder = pathlib.Path(out_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"nnxscan_demo_{name}.png"
