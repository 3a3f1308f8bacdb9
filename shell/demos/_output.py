"""Where the demos write their plots: one name scheme, one folder rule."""

from __future__ import annotations

import os
import pathlib


def demo_plot_path(out_dir: str | os.PathLike[str], name: str) -> pathlib.Path:
    """``<out_dir>/nnxscan_demo_<name>.png`` as an absolute path, its folder created."""
    folder = pathlib.Path(out_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"nnxscan_demo_{name}.png"
