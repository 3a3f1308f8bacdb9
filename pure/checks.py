"""Argument checks that raise before anything is traced or compiled.

``nnxscan.pure``'s own functions and the shell (``Trainer``, ``Population``,
``scan_train``, the adapters) check their arguments with these, so a count, a data set's
size or a batch size means the same thing, and fails with the same message, everywhere.
Use them in your own loop to fail as early and as clearly.

Every check works on Python values and shapes only, so it runs the same eagerly and under
a trace, and every message names the offending leaf path and the sizes involved.

- :func:`check_count`: an int (a Python or numpy int, never a bool) in a range.
- :func:`check_leading_size`: the examples (or steps) axis every leaf of a pytree shares.
- :func:`check_batch_size`: a batch size that leaves at least one batch.
- :func:`check_transform`: an optax transform (``optax.MultiSteps`` included).
- :func:`check_no_captured_nnx`: a function that captures no NNX object.
- :func:`globals_loaded`: the global names a code object loads (what the check above reads).
- :func:`abstract_batch`: shapes and dtypes of a batch, to trace a step before any data
  reaches it (``jax.eval_shape``).

Example:
  >>> from nnxscan.pure import checks
  >>> checks.check_count(3, "epochs", 1)
  3
  >>> checks.check_leading_size({"x": np.zeros((8, 3)), "y": np.zeros(8)})
  8
"""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

__all__ = [
    "abstract_batch",
    "check_batch_size",
    "check_count",
    "check_leading_size",
    "check_no_captured_nnx",
    "check_transform",
    "globals_loaded",
]


def check_count(value: Any, name: str, minimum: int = 0, maximum: int | None = None) -> int:
    """Returns ``value`` as an int after checking it is one (not a bool) in range.

    Args:
      value: the count to check (a Python or numpy integer).
      name: the argument's name, for the message.
      minimum: the smallest value allowed.
      maximum: the largest value allowed, or None for no bound.

    Returns:
      ``value`` as a Python int.

    Raises:
      TypeError: ``value`` is not a Python or numpy integer (bools are refused: ``True``
        epochs is a bug, not 1).
      ValueError: ``value`` is below ``minimum`` or above ``maximum``.

    Example:
      >>> check_count(np.int64(3), "epochs", 0)
      3
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}.")
    return int(value)


def abstract_batch(tree: Any, *, leading: int | None = None, drop_leading: bool = False) -> Any:
    """``jax.ShapeDtypeStruct`` for every leaf of ``tree``: what tracing needs, no data.

    Args:
      tree: a pytree of arrays (numpy or JAX, or anything with a shape and a dtype).
      leading: replaces each leaf's first dimension (one batch of a data set).
      drop_leading: removes each leaf's first dimension (one batch of a stack of batches).

    Returns:
      ``tree`` with every leaf a ``jax.ShapeDtypeStruct``: hand it to ``jax.eval_shape``
      to trace a step on a batch's shapes without touching (or transferring) any data.

    Example:
      >>> abstract_batch({"x": np.zeros((100, 3))}, leading=32)["x"]
      ShapeDtypeStruct(shape=(32, 3), dtype=float64)
    """

    def one(x: Any) -> jax.ShapeDtypeStruct:
        shape = tuple(np.shape(x))
        if drop_leading:
            shape = shape[1:]
        elif leading is not None:
            shape = (leading, *shape[1:])
        return jax.ShapeDtypeStruct(shape, jax.numpy.result_type(x))

    return jax.tree.map(one, tree)


def _path(path: tuple) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _check_array_leaves(tree: Any, what: str) -> list[tuple[tuple, Any]]:
    """Returns the (path, leaf) pairs of ``tree``; raises TypeError on a non-array leaf."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    for path, leaf in leaves:
        is_array = isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)
        if is_array or hasattr(leaf, "aval"):
            dtype = np.dtype(leaf.dtype) if not hasattr(leaf, "aval") else leaf.aval.dtype
            if not (jax.dtypes.issubdtype(dtype, np.number) or dtype == np.bool_):
                raise TypeError(
                    f"{what} leaf {_path(path)} has dtype {dtype} (shape {tuple(leaf.shape)}); "
                    f"JAX needs numeric or bool arrays. Encode it (e.g. as integer ids) or "
                    f"drop it from the pytree."
                )
            continue
        raise TypeError(
            f"{what} leaf {_path(path)} is a {type(leaf).__name__}, not an array. "
            f"Every leaf of {what} must be a numpy or JAX array; convert it with "
            f"np.asarray(...) or drop it from the pytree."
        )
    return leaves


def check_leading_size(tree: Any, what: str = "data") -> int:
    """Returns the leading-axis size shared by every leaf of ``tree``.

    Args:
      tree: a data set (leaves share an examples axis) or a stack of batches (a steps
        axis).
      what: what ``tree`` is, for the messages (``"data"``, ``"batches"``).

    Returns:
      The size of the leading axis, at least 1.

    Raises:
      ValueError: ``tree`` has no leaves, the leading size is 0 ("empty"), a leaf is a
        scalar, or two leaves disagree on the leading size (both paths and sizes named).
      TypeError: a leaf is not an array (strings, Python objects).

    Example:
      >>> check_leading_size({"x": np.zeros((8, 3)), "y": np.zeros(8)})
      8
    """
    leaves = _check_array_leaves(tree, what)
    if not leaves:
        raise ValueError(f"{what} is empty: it has no array leaves.")
    first_path, first = leaves[0]
    for path, leaf in leaves:
        if np.ndim(leaf) == 0:
            raise ValueError(
                f"{what} leaf {_path(path)} is a scalar (shape ()); every leaf needs a "
                f"leading axis to batch over."
            )
        if leaf.shape[0] != first.shape[0]:
            raise ValueError(
                f"{what} leaves disagree on the leading size: {_path(first_path)} has "
                f"{first.shape[0]} (shape {tuple(first.shape)}) but {_path(path)} has "
                f"{leaf.shape[0]} (shape {tuple(leaf.shape)}). Every leaf must have the "
                f"same number of rows."
            )
    n = int(first.shape[0])
    if n == 0:
        raise ValueError(f"{what} is empty: its leading size is 0 (leaf {_path(first_path)}).")
    return n


def check_batch_size(batch_size: Any, num_examples: int, *, drop_remainder: bool) -> int:
    """Validates ``batch_size`` against the number of examples and returns it as an int.

    Args:
      batch_size: examples per batch.
      num_examples: the data set's size (e.g. from :func:`check_leading_size`).
      drop_remainder: whether a final short batch is dropped: then ``batch_size`` may not
        exceed ``num_examples``, or the epoch would train nothing.

    Returns:
      ``batch_size`` as a Python int.

    Raises:
      TypeError: ``batch_size`` is not an int (see :func:`check_count`).
      ValueError: ``batch_size`` is below 1, or leaves no batch to train.

    Example:
      >>> check_batch_size(32, 100, drop_remainder=True)
      32
      >>> check_batch_size(128, 100, drop_remainder=False)  # one short batch of 100
      128
    """
    batch_size = check_count(batch_size, "batch_size", 1)
    if drop_remainder and batch_size > num_examples:
        raise ValueError(
            f"batch_size {batch_size} is larger than the number of examples {num_examples}, "
            f"so dropping the remainder would leave no batch. Use batch_size <= "
            f"{num_examples}, or drop_remainder=False to train on one short batch."
        )
    return batch_size


def check_transform(tx: Any) -> optax.GradientTransformation:
    """Returns ``tx`` as an optax GradientTransformation, or raises TypeError.

    ``optax.MultiSteps`` (not itself a GradientTransformation) is accepted through its
    ``gradient_transformation()``, whose state is the one ``MultiSteps.init`` builds.

    Args:
      tx: an optax transform, or an ``optax.MultiSteps``.

    Returns:
      ``tx`` as an ``optax.GradientTransformation`` (``optax.GradientTransformationExtraArgs``
      transforms are returned as they are).

    Raises:
      TypeError: ``tx`` is something else; the message says to pass an ``nnx.Optimizer``
        to the shell rather than here.

    Example:
      >>> check_transform(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4))
      GradientTransformation(init=..., update=...)
    """
    if isinstance(tx, optax.GradientTransformation):
        return tx
    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    hint = ""
    if type(tx).__name__ == "Optimizer":
        hint = " To train with an nnx.Optimizer, pass it to Trainer or scan_train."
    raise TypeError(
        f"tx must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), got "
        f"{type(tx).__name__}.{hint}"
    )


def _wrapped(value: Any) -> Any:
    """The function a decorated one wraps (``__wrapped__``, set by ``nnx.jit``, ``jax.jit``
    and ``functools.wraps``), or None."""
    try:
        inner = getattr(value, "__wrapped__", None)
    except Exception:  # an object whose __getattr__ raises something else
        return None
    return inner if callable(inner) else None


def globals_loaded(code: types.CodeType) -> frozenset[str]:
    """The global names ``code`` loads, with those of the functions and lambdas defined
    inside it (they read the same globals). A function of the code object alone, which
    never changes: the shell memoizes it (so a loss is disassembled once, not at every
    ``scan_train`` call); what the globals hold is looked up at each check.

    Example:
      >>> sorted(globals_loaded((lambda x: np.sum(x) + len(x)).__code__))
      ['len', 'np']
    """
    loaded = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            loaded |= globals_loaded(const)
    return frozenset(loaded)


def _captured(
    fn: Any,
    depth: int = 2,
    seen: set[int] | None = None,
    names: Callable[[types.CodeType], AbstractSet[str]] = globals_loaded,
) -> list[tuple[str, Any]]:
    """(description, value) of what ``fn`` captures: closure cells, referenced globals
    (``names(code)``: the global names a code object loads), defaults and
    ``functools.partial`` arguments, following plain functions it refers to ``depth``
    levels down."""
    seen = set() if seen is None else seen
    if id(fn) in seen or depth < 0:
        return []
    seen.add(id(fn))
    found: list[tuple[str, Any]] = []
    if isinstance(fn, functools.partial):
        found += [(f"a functools.partial argument {i}", a) for i, a in enumerate(fn.args)]
        found += [(f"the functools.partial keyword {k!r}", v) for k, v in fn.keywords.items()]
        return found + _captured(fn.func, depth, seen, names)
    if not isinstance(fn, types.FunctionType):
        # A decorated function (nnx.jit, jax.jit, functools.wraps): what it wraps captures.
        inner = _wrapped(fn)
        return found if inner is None else _captured(inner, depth, seen, names)
    code = fn.__code__
    cells = zip(code.co_freevars, fn.__closure__ or (), strict=False)
    for name, cell in cells:
        try:
            found.append((f"the closure variable {name!r}", cell.cell_contents))
        except ValueError:  # an empty cell (a name assigned later)
            continue
    # Only the globals the code loads: co_names also holds attribute names (model.rngs),
    # which may coincide with an unrelated global.
    loaded = names(code)
    for name in sorted(loaded):
        if name in fn.__globals__:
            found.append((f"the global {name!r}", fn.__globals__[name]))
    for i, value in enumerate(fn.__defaults__ or ()):
        found.append((f"default argument {i}", value))
    found += [(f"the default of {k!r}", v) for k, v in (fn.__kwdefaults__ or {}).items()]
    nested = [
        value
        for _, value in found
        if value is not fn
        and (  # functions, partials, and decorated functions (nnx.jit's helpers)
            isinstance(value, types.FunctionType | functools.partial) or _wrapped(value)
        )
    ]
    for value in nested:
        found += _captured(value, depth - 1, seen, names)
    return found


def check_no_captured_nnx(
    fn: Any,
    what: str = "loss_fn",
    *,
    arguments: Mapping[str, Any] | None = None,
    names: Callable[[types.CodeType], AbstractSet[str]] = globals_loaded,
) -> None:
    """Raises TypeError when ``fn`` captures an NNX object (Rngs, metric, module, Variable).

    Inside a compiled step an object captured from outside is a trace-time constant: a
    captured ``nnx.Rngs`` raises "Cannot mutate RngCount from a different trace level", a
    captured metric never accumulates, a captured module's weights are baked in. The
    message says how to pass each kind instead. Closure cells, the globals the code
    reads, default arguments and ``functools.partial`` arguments are looked at, following
    the plain functions ``fn`` refers to two levels down.

    A captured object that IS one of the objects ``fn`` is called with (or a part of one,
    such as a submodule of the model) gets its own message: ``fn`` reads a global
    ``policy`` where it meant its ``model`` argument, and the fix is to use the argument.

    Args:
      fn: the function to check (a loss, a metric function, a step).
      what: its name, for the message.
      arguments: the NNX objects ``fn`` is called with, by the name of the parameter
        that receives each (``{"model": model, "optimizer": optimizer}``).
      names: the global names a code object loads (:func:`globals_loaded`); a caller
        that checks the same functions often passes a memo of it.

    Returns:
      None; raises when ``fn`` captures an NNX object.

    Example:
      >>> rngs = nnx.Rngs(0)
      >>> check_no_captured_nnx(lambda m, b: loss_fn(m, b, rngs))
      Traceback (most recent call last):
      TypeError: loss_fn captures an nnx.Rngs (the closure variable 'rngs') ...
      >>> def step(model, optimizer, batch):  # reads the global `policy`, not `model`
      ...     return policy(batch)
      >>> check_no_captured_nnx(step, "train_step", arguments={"model": policy})
      Traceback (most recent call last):
      TypeError: train_step captures an NNX object (MLP) (the global 'policy'), which is
      the object it receives as its argument 'model' ...
    """
    for where, value in _captured(fn, names=names):
        if not isinstance(value, nnx.Pytree | nnx.Variable):
            continue
        received = _as_argument(value, arguments or {})
        if received is not None:
            kind = f"an NNX object ({type(value).__name__})"
            name, path = received
            use = f"{name}.{path}" if path else name
            which = (
                f"{use}, a part of the object it receives as its argument {name!r}"
                if path
                else f"the very object it receives as its argument {name!r}"
            )
            raise TypeError(
                f"{what} captures {kind} ({where}), which is {which}. Use the argument "
                f"({use}) where {what} reads the captured object: inside the compiled step "
                f"the captured object is a constant, its weights baked in and never "
                f"updated, while the argument carries the state that trains."
            )
        if what == "train_step":
            # A stateful NNX step: its objects come in as arguments, after the optimizer.
            kind = f"an NNX object ({type(value).__name__})"
            fix = (
                "Inside the compiled step it would be a constant, never updated. Pass it in "
                "extras=(..., it): the step is then called as fn(model, optimizer, *extras, "
                "batch) and its state carried through every call."
            )
        elif isinstance(value, nnx.Rngs):
            kind = "an nnx.Rngs"
            fix = (
                "Pass it to the Trainer (or scan_train) as rngs=... and write the loss as "
                "loss_fn(model, batch, rngs); with the pure core, make_train_step(..., "
                "with_rngs=True) and split (model, rngs). Its counts then advance every "
                "step, as in Flax's own loop."
            )
        elif isinstance(value, nnx.Metric):
            kind = "an NNX metric"
            fix = (
                "Pass it to the Trainer as metrics=... with update_metrics=fn, where "
                "fn(metrics, loss, aux, batch) updates it; with the pure core, "
                "make_train_step(..., update_metrics=fn) and split (model, metrics)."
            )
        else:
            kind = f"an NNX object ({type(value).__name__})"
            fix = (
                "Inside the compiled step it would be a constant: its weights baked in, its "
                "state never updated. Make it part of the model (an attribute of the module "
                "you train; keep it frozen with wrt=...), or use the model argument."
            )
        raise TypeError(f"{what} captures {kind} ({where}). {fix}")


def _as_argument(value: Any, arguments: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(argument name, path inside it)`` when ``value`` is one of ``arguments`` (path
    ``""``) or a node of one's graph (a submodule, a Variable), else None."""
    for name, argument in arguments.items():
        if value is argument:
            return name, ""
    for name, argument in arguments.items():
        if not isinstance(argument, nnx.Pytree):
            continue
        for path, node in nnx.iter_graph(argument):
            if node is value:
                return name, ".".join(map(str, path))
    return None
