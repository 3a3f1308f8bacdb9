"""A note on errors raised while tracing the user's function: what the batch looked like.

A shape or dtype mistake in the user's model surfaces from deep inside flax or jax
(``dot_general requires contracting dimensions to have the same shape``) with nothing about
the data that caused it. :func:`noting_batch` wraps the call that first traces the user's
loss or metric and, when an exception escapes, adds a note (``BaseException.add_note``,
Python 3.11) naming the function and every leaf of the batch with its shape and dtype. The
exception itself, its type and its traceback are untouched, so ``except TypeError`` and
``pytest.raises`` keep working, and the note prints under the original message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

NOTE_HEADER = "nnxscan: raised while tracing the"
# The role of the single function each kind of trace calls, for the note's wording.
_ROLE = {"training step": "loss_fn", "evaluation": "metric_fn"}


def qualified_name(fn: Any) -> str:
    """``module.qualname`` of a function (of the function a ``functools.partial`` wraps,
    of the class of a callable object)."""
    target = getattr(fn, "func", fn)
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None) or type(target).__module__
    return f"{module}.{qualname}" if module else qualname


def describe_batch(batch: Any, batch_size: int | None = None) -> list[str]:
    """One line per leaf of ``batch``: its path, shape and dtype, aligned in columns."""
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = tuple(np.shape(leaf))
        if batch_size is not None and shape:
            shape = (min(batch_size, shape[0]), *shape[1:])
        dtype = getattr(leaf, "dtype", None)
        dtype = np.result_type(leaf) if dtype is None else dtype
        rows.append((jax.tree_util.keystr(path) or "<the batch itself>", str(shape), str(dtype)))
    if not rows:
        return ["  (no array leaves)"]
    width = [max(len(row[i]) for row in rows) for i in range(2)]
    return [f"  {p:<{width[0]}}  shape {s:<{width[1]}}  {d}" for p, s, d in rows]


def batch_note(
    what: str, fn: Callable | Mapping[str, Callable], batch: Any, batch_size: int | None = None
) -> str:
    """The note :func:`noting_batch` adds: the function(s) traced and the batch's leaves."""
    functions = fn if isinstance(fn, Mapping) else {_ROLE.get(what, "function"): fn}
    names = ", ".join(f"{role} {qualified_name(f)}" for role, f in functions.items())
    lines = [
        f"{NOTE_HEADER} {what} on the first batch ({names}); the batch it was given:",
        *describe_batch(batch, batch_size),
        "Check these shapes and dtypes against what the model and the function expect.",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def noting_batch(
    what: str,
    fn: Callable | Mapping[str, Callable],
    batch: Any,
    *,
    batch_size: int | None = None,
) -> Iterator[None]:
    """Adds :func:`batch_note` to an exception that escapes the block, and re-raises it.

    Args:
      what: what is traced: ``"training step"`` or ``"evaluation"``.
      fn: the user's function being traced (named ``loss_fn`` / ``metric_fn`` by
        ``what``), or ``{role: function}`` for several.
      batch: the batch the function is traced on (arrays or ``jax.ShapeDtypeStruct``).
      batch_size: ``batch`` is a whole data set cut into batches of this size.

    Nothing is computed unless an exception escapes. Errors of a compiled program at run
    time (``jax.errors.JaxRuntimeError``) are not tracing errors and get no note; an
    exception that already carries the note (nested blocks) gets no second one.

    Example:
      >>> with noting_batch("training step", loss_fn, abstract_batch(data, leading=32)):
      ...     jax.make_jaxpr(step)(graphdef, state, opt_state, batch)
      TypeError: dot_general requires contracting dimensions to have the same shape, ...
      nnxscan: raised while tracing the training step on the first batch (loss_fn ...
    """
    try:
        yield
    except Exception as error:
        notes = getattr(error, "__notes__", ())
        if not isinstance(error, jax.errors.JaxRuntimeError) and not any(
            isinstance(note, str) and note.startswith(NOTE_HEADER) for note in notes
        ):
            with contextlib.suppress(Exception):  # a note must never hide the error
                error.add_note(batch_note(what, fn, batch, batch_size))
        raise
