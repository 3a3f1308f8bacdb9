"""An error reaches the user at their own call, with nnxscan's frames left out of it.

A wrong feature width fails deep inside a traced step: its traceback ran through two dozen
frames of nnxscan (the engine, the programs, the step's rewrites) before the user's loss and
model, the frames that say what is wrong. JAX leaves its own frames out of such tracebacks
(``JAX_TRACEBACK_FILTERING``); every front door does the same with nnxscan's, with the same
switch: ``JAX_TRACEBACK_FILTERING=off`` (or ``jax.config.update("jax_traceback_filtering",
"off")``) keeps them. Only ``Exception``s are touched (a ``KeyboardInterrupt`` keeps its
whole traceback), and only their traceback and the order of their notes: the object raised,
its message and its attributes are the ones raised inside.
"""

from __future__ import annotations

import functools
import os
import pathlib
import traceback
import types
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from nnxscan.shell._engine.trace_notes import NOTE_HEADER

F = TypeVar("F", bound=Callable[..., Any])

#: The folders of nnxscan's own code (the shell, the core, the adapters, the package).
_OWN = tuple(
    str(pathlib.Path(__file__).resolve().parents[1] / folder) + os.sep
    for folder in ("shell", "pure", "adapters", "nnxscan")
)
HIDDEN_NOTE = (
    "nnxscan left its own frames out of this traceback, as JAX leaves out its own; set "
    "JAX_TRACEBACK_FILTERING=off to include them."
)


def own_frame(filename: str) -> bool:
    """Whether a frame's file is nnxscan's own code."""
    return os.path.realpath(filename).startswith(_OWN)


def _without_own_frames(tb: types.TracebackType) -> types.TracebackType | None:
    out = None
    for frame, lineno in reversed(list(traceback.walk_tb(tb))):
        if not own_frame(frame.f_code.co_filename):
            out = types.TracebackType(out, frame, frame.f_lasti, lineno)
    return out


def at_the_call(fn: F) -> F:
    """Wraps a front door so that an ``Exception`` it raises reaches the caller with
    nnxscan's own frames left out of its traceback, and nnxscan's note about a traced
    function that failed (the batch's shapes) first among its notes.

    Example:
      >>> @at_the_call
      ... def fit(self, data, **options): ...
    """

    @functools.wraps(fn)
    def front_door(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            if jax.config.jax_traceback_filtering == "off" or error.__traceback__ is None:
                raise
            error.with_traceback(_without_own_frames(error.__traceback__))
            notes = getattr(error, "__notes__", [])
            if HIDDEN_NOTE not in notes:
                error.add_note(HIDDEN_NOTE)
                ours = [n for n in error.__notes__ if n.startswith(NOTE_HEADER)]
                error.__notes__[:] = ours + [n for n in error.__notes__ if n not in ours]
            raise  # a bare raise adds no frame of its own: the traceback starts at the caller

    return front_door  # type: ignore[return-value]
