"""What every metric writer does with an epoch's logs: plain numbers, process 0 only."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from nnxscan.adapters.distributed import is_primary


def plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds; anything else unchanged."""
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "shape", None) == ():
        return item()
    return value


def is_number(value: Any) -> bool:
    """A real number that is not a bool (bools are flags, not metrics)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def primary_only(hook: Any) -> Any:
    """Runs a writer's hook on process 0 only: several processes train one model, and
    one log is wanted, not one per process writing over the others."""

    @functools.wraps(hook)
    def wrapped(self: Any, *args: Any) -> Any:
        if is_primary():
            return hook(self, *args)
        return None

    return wrapped


class ModelLogs:
    """What the logs of a run on one model are (its side of :func:`logs_of`): a value per
    log, nothing per member."""

    num_members = None

    def params(self, trainer: Any) -> dict[str, Any]:
        """A run's own hyperparameters beside the user's: none."""
        return {}

    def per_member(self, value: Any) -> bool:
        """Whether ``value`` is one value per member: never."""
        return False

    def pick(self, model: Any, members: Any) -> Any:
        """What a writer or callback does for one model, of its two ways."""
        return model


class MemberLogs:
    """What the logs of a ``Population``'s run are (its side of :func:`logs_of`): every
    per-member log holds one value per member along its first axis."""

    def __init__(self, num_members: int):
        self.num_members = num_members

    def params(self, trainer: Any) -> dict[str, Any]:
        """``num_members`` and each member's ``seed/i`` and ``<hyperparameter>/i``."""
        out: dict[str, Any] = {"num_members": self.num_members}
        for i, seed in enumerate(getattr(trainer, "seeds", ())):
            out[f"seed/{i}"] = plain(seed)
        for name, values in (getattr(trainer, "hyperparams", None) or {}).items():
            for i, value in enumerate(values):
                out[f"{name}/{i}"] = plain(value)
        return out

    def per_member(self, value: Any) -> bool:
        """Whether ``value`` is one value per member (an ``(N,)`` array)."""
        return np.shape(value) == (self.num_members,)

    def pick(self, model: Any, members: Any) -> Any:
        """What a writer or callback does for members, of its two ways."""
        return members


def logs_of(trainer: Any) -> ModelLogs | MemberLogs:
    """What ``trainer``'s logs are: one model's, or a population's members'. The one place
    outside the shell's layout that asks (the object training runs declares it:
    ``num_members``, never read off shapes); writers and callbacks ask what it returns.

    Example:
      >>> logs_of(population).per_member(logs["loss"])
      True
    """
    count = getattr(trainer, "num_members", None)
    return ModelLogs() if count is None else MemberLogs(count)


def history_members(num_members: int | None, losses: Any) -> int | None:
    """How many members a History logs: ``num_members`` as ``fit`` declared it (every
    History a run makes, a resumed one's too, declares it). Only for a History that
    declares none (built by hand, or pickled before ``History.num_members`` existed) do its
    losses say, the one place their shape does: nothing else about it is left to read.
    ``(steps, N)`` is ``N`` members, ``(steps,)`` one model (None).

    Example:
      >>> history_members(None, np.zeros((0, 3)))
      3
    """
    if num_members is not None or np.ndim(losses) != 2:
        return num_members
    return int(np.shape(losses)[1])


def spread(logs: Mapping[str, Any]) -> dict[str, Any]:
    """Logs with every element of an array value as an entry of its own, named by its index:
    ``key/i``, and ``key/i/j`` for two axes; a value of one element and no axes (a float, a
    0-d array, text) keeps its key and is unchanged.

    Every axis is spread the same way, whatever it holds: a ``Population``'s per-member
    logs lead with the members axis (``loss/2`` is member 2's loss), a metric per class
    has its classes (``hits_per_class/1``), and a per-class metric of members has both
    (``eval_hits/2/1``: member 2, class 1). So nothing here asks what an axis is: whether a
    run has members is :func:`logs_of`'s to say, never a value's shape.

    Example:
      >>> spread({"epoch": 3, "loss": np.array([0.5, 0.25])})
      {'epoch': 3, 'loss/0': np.float64(0.5), 'loss/1': np.float64(0.25)}
    """
    out: dict[str, Any] = {}
    for key, value in logs.items():
        array = np.asarray(value)
        # np.ndindex of a 0-d value yields the one empty index: the key itself, the value
        # as it came (a Python float stays one).
        for index in np.ndindex(array.shape):
            out["/".join([key, *map(str, index)])] = array[index] if index else value
    return out


def numeric_logs(logs: Mapping[str, Any]) -> dict[str, float]:
    """The numbers among one epoch's logs, as ``{key: float}``, arrays spread into
    ``key/i`` (:func:`spread`; for a ``Population``, ``i`` is the member). Anything that is
    not a real number (text, flags) is left out."""
    out: dict[str, float] = {}
    for key, value in spread(logs).items():
        value = plain(value)
        if is_number(value):
            out[key] = float(value)
    return out


def run_params(trainer: Any, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The hyperparameters of a run: the user's ``params``, then, for a ``Population``,
    ``num_members`` and each member's ``seed/i`` and ``<hyperparameter>/i``."""
    out = {key: plain(value) for key, value in (params or {}).items()}
    return {**out, **logs_of(trainer).params(trainer)}


# -- exact JSON: what a run log stores and gives back equal --------------------------------

_TAG = "__nnxscan__"
_ML_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float16")
_EXACT_KINDS = (
    "None, bool, int, float, str, numpy and jax arrays and scalars (real dtypes), and lists, "
    "tuples and dicts (str keys) of them"
)


def to_exact_json(value: Any, where: str) -> Any:
    """``value`` as JSON data that :func:`from_exact_json` turns back into an equal value
    of the same type (a jax array onto the default device).

    Arrays and numpy scalars keep their dtype and shape (tagged objects); tuples stay
    tuples; non-finite floats are written as JSON's common extension (``NaN``,
    ``Infinity``), which Python's json reads back.

    Raises:
      TypeError: a value of another type, naming ``where`` (e.g. ``"History.epochs[0]['tag']"``)
        and what the log stores instead.
    """
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if isinstance(value, np.generic | np.ndarray) or _is_jax_array(value):
        array = np.asarray(value)
        # bfloat16 and float8 (ml_dtypes) are numpy kind "V"; complex and objects are out.
        if array.dtype.kind not in "biuf" and array.dtype.name not in _ML_FLOATS:
            raise TypeError(
                f"{where} is an array of dtype {array.dtype}: the run log stores exactly "
                f"{_EXACT_KINDS}. Log it as real numbers or a str, or keep it out of the logs."
            )
        return {
            _TAG: "scalar"
            if isinstance(value, np.generic)
            else "array"
            if kind is np.ndarray
            else "jax",
            "dtype": array.dtype.name,
            "shape": list(array.shape),
            "values": array.reshape(-1).tolist(),
        }
    if kind is list:
        return [to_exact_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind is tuple:
        return {_TAG: "tuple", "values": [to_exact_json(v, f"{where}[{i}]") for i, v in
                                          enumerate(value)]}  # fmt: skip
    if kind is dict and all(type(key) is str for key in value) and _TAG not in value:
        return {key: to_exact_json(v, f"{where}[{key!r}]") for key, v in value.items()}
    raise TypeError(
        f"{where} is a {kind.__name__}: the run log (history.jsonl, beside the checkpoints) "
        f"stores exactly {_EXACT_KINDS}, so that a resumed run's History is the one it had. "
        f"Log it as one of those (e.g. str(value), or a list), or keep it out of the logs."
    )


def from_exact_json(value: Any) -> Any:
    """The value :func:`to_exact_json` encoded."""
    if isinstance(value, list):
        return [from_exact_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag == "tuple":
        return tuple(from_exact_json(v) for v in value["values"])
    if tag in ("array", "scalar", "jax"):
        # jnp.dtype knows bfloat16 and float8 by name; numpy does not.
        import jax.numpy as jnp

        dtype = jnp.dtype(value["dtype"])
        if dtype.kind not in "biuf" and dtype.name not in _ML_FLOATS:
            raise ValueError(f"dtype {dtype} is not one a run log holds")
        array = np.asarray(value["values"], dtype).reshape(value["shape"])
        if tag == "jax":
            return jnp.asarray(array)
        return array[()] if tag == "scalar" else array
    return {key: from_exact_json(v) for key, v in value.items()}


def _is_jax_array(value: Any) -> bool:
    return type(value).__module__.startswith("jax") and hasattr(value, "__array__")
