"""Optional extras: import one, or say which ``pip install 'nnxscan[extra]'`` brings it."""

from __future__ import annotations

import importlib
from typing import Any


def require_extra(module: str, extra: str, *, needed_by: str = "this feature") -> Any:
    """Imports ``module``, or raises ImportError naming the extra that installs it.

    Example:
      >>> figure = require_extra("matplotlib.figure", "demo", needed_by="History.plot")
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"{needed_by} needs {module.split('.')[0]}, an optional extra; install it with: "
            f"pip install 'nnxscan[{extra}]'"
        ) from err
