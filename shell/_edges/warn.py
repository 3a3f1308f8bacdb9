"""Warnings that point at the user's line: the first frame outside nnxscan."""

from __future__ import annotations

import os
import pathlib
import sys
import warnings

# The folders of nnxscan's packages (pure/, shell/, adapters/ of this checkout or install;
# this file is shell/_edges/warn.py), as Python names the files it runs, with links
# resolved and not.
_PACKAGE_ROOTS = tuple(
    os.path.join(str(root), name) + os.sep
    for root in {pathlib.Path(__file__).absolute().parents[2],
                 pathlib.Path(__file__).resolve().parents[2]}
    for name in ("pure", "shell", "adapters")
)  # fmt: skip


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` at the user's line, not at the nnxscan line that noticed.

    Example:
      >>> warn("nnxscan: dropped the final short batch of 3 examples ...")
    """
    frame, level = sys._getframe(1), 2  # level 2: warn's caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_ROOTS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
