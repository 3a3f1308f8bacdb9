"""Optional extras: import one, or say in one line which ``pip install`` brings it."""

from __future__ import annotations

import importlib
from typing import Any


class MissingExtraError(ImportError):
    """An optional extra is not installed; the message names the commands that install it
    (from a package index, and from a clone of the repository). The ``nnxscan`` command
    prints it as one line, without a traceback."""


def install_commands(extra: str) -> str:
    """How to install ``extra``, from an index and from a clone (``pip install 'nnxscan[x]'``
    fails in a clone, where nnxscan is not on the index: it needs the folder's path).

    Example:
      >>> install_commands("rl")
      "pip install 'nnxscan[rl]' (in a clone of the repository: pip install -e '.[rl]')"
    """
    clone = f"pip install -e '.[{extra}]'"
    return f"pip install 'nnxscan[{extra}]' (in a clone of the repository: {clone})"


def require_extra(module: str, extra: str, *, needed_by: str = "this feature") -> Any:
    """Imports ``module``, or raises :class:`MissingExtraError` naming the extra that installs it.

    Example:
      >>> figure = require_extra("matplotlib.figure", "demo", needed_by="History.plot")
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        # A package that is installed but fails to import (a dependency of its own missing)
        # is named with the import's own message.
        missing = "" if err.name in (None, top, module) else f" ({err})"
        # `from None`: the chained "No module named ..." traceback adds nothing to this line.
        raise MissingExtraError(
            f"{needed_by} needs {top}{missing}, an optional extra; install it with: "
            f"{install_commands(extra)}"
        ) from None
