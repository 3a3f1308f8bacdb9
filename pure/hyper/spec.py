"""ParamSpec: which variables of a target network are generated, and everything else.

A hypernetwork needs three facts about its target: the shapes of the tensors it generates,
how to put them back into the target, and the target's other variables (the layers it does
not generate, batch statistics, RNG state). :class:`ParamSpec` holds all three as one plain
pytree, so a spec can be closed over, passed through ``jax.jit`` or carried through a scan:

- static (pytree metadata): the target's ``graphdef``, the ``treedef`` of the generated
  ``nnx.State`` and one :class:`LeafSpec` (path, shape, dtype) per generated tensor;
- data (pytree leaves): ``rest``, the target's non-generated state, and ``init_mean`` /
  ``init_var``, the per-tensor mean and variance of the target's own values of the generated
  tensors (what :class:`~nnxscan.pure.hyper.HyperHeads` matches at initialization).

"Spec order" is the order ``jax.tree.leaves`` visits an ``nnx.State``: sorted by path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "LeafSpec",
    "ParamSpec",
    "check_params",
    "path_str",
    "ravel",
    "spec_from_split",
    "variable_leaves",
]

Path = tuple[Any, ...]


class LeafSpec(NamedTuple):
    """One generated tensor: where it lives in the target, its shape and its dtype."""

    path: Path
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        """Number of scalars in the tensor."""
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        """The path as ``'layers/0/kernel'``."""
        return path_str(self.path)


def path_str(path: Path) -> str:
    """Formats a state path, e.g. ``('layers', 0, 'kernel')`` as ``'layers/0/kernel'``."""
    return "/".join(str(k) for k in path) or "<root>"


def _key(entry: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def variable_leaves(tree: Any) -> list[tuple[Path, Any]]:
    """``(path, array)`` pairs of a State or nested dict, in spec order.

    Variables count as leaves (their value is returned), so an ``nnx.State`` of Params, a
    State of plain arrays and a nested dict of arrays with the same keys all give the same
    paths.

    Example:
      >>> [path for path, _ in variable_leaves(nnx.state(mlp, nnx.Param))]
      [('hidden', 'bias'), ('hidden', 'kernel'), ('out', 'bias'), ('out', 'kernel')]
    """
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)
    return [
        (tuple(_key(k) for k in path), v.get_value() if _is_variable(v) else v) for path, v in pairs
    ]


def _plain_variables(module: nnx.Module) -> nnx.Module:
    """``module``, or a copy of it whose hijax Variables (``nnx.var_defaults(hijax=True)``)
    are plain ones, sharing their arrays: a spec merges its graphdef inside ``jax.grad``,
    where Flax can't create hijax Variables.

    Example:
      >>> graphdef, state = nnx.split(_plain_variables(target))
    """
    variables = jax.tree.leaves(nnx.state(module), is_leaf=_is_variable)
    if not any(getattr(v, "hijax", False) for v in variables):
        return module
    return nnx.with_vars(module, hijax=False)


def _copy_array(x: Any) -> Any:
    return jnp.array(x, copy=True) if isinstance(x, jax.Array) else x


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["rest", "init_mean", "init_var"],
    meta_fields=["graphdef", "treedef", "leaves"],
)
@dataclasses.dataclass(frozen=True, eq=False)
class ParamSpec:
    """What a hypernetwork generates for a target network, and the target's other state.

    Build one with :meth:`ParamSpec.from_module`. It is a pytree: ``rest``, ``init_mean`` and
    ``init_var`` are its leaves; ``graphdef``, ``treedef`` and ``leaves`` are static.

    Attributes:
      graphdef: the target's ``nnx.GraphDef``.
      treedef: the pytree structure of the generated ``nnx.State`` (Variable types included).
      leaves: one :class:`LeafSpec` per generated tensor, in spec order.
      rest: the target's non-generated state (a snapshot taken at creation).
      init_mean, init_var: ``(len(leaves),)`` float32, the mean and variance of each of the
        target's own generated tensors at creation.

    Example:
      >>> spec = ParamSpec.from_module(target, wrt=nnx.Param)
      >>> spec.size, [leaf.name for leaf in spec.leaves]
      (25, ['hidden/bias', 'hidden/kernel', 'out/bias', 'out/kernel'])
    """

    graphdef: nnx.GraphDef
    treedef: jax.tree_util.PyTreeDef
    leaves: tuple[LeafSpec, ...]
    rest: nnx.State
    init_mean: jax.Array
    init_var: jax.Array

    @classmethod
    def from_module(cls, target: nnx.Module, *, wrt: nnx.filterlib.Filter = nnx.Param) -> ParamSpec:
        """Describes the ``wrt`` variables of ``target`` as generated, the rest as its own.

        The target is not modified, and later changes to it are not seen by the spec: the
        non-generated state is copied (so donating the target's buffers elsewhere cannot
        invalidate the spec). Build a new spec to pick up a retrained target.

        Args:
          target: the network whose variables are generated.
          wrt: an NNX filter selecting the generated variables, e.g. ``nnx.Param`` (all
            weights) or ``nnx.All(nnx.Param, nnx.PathContains('out'))`` (one layer).

        Raises:
          TypeError: ``target`` is not an NNX module.
          ValueError: ``wrt`` selects no variable, or a non-floating one.

        Example:
          >>> spec = hyper.ParamSpec.from_module(mlp, wrt=nnx.All(nnx.Param,
          ...                                                     nnx.PathContains("out")))
        """
        if not isinstance(target, nnx.Module):
            raise TypeError(
                f"ParamSpec.from_module needs an nnx.Module, got {type(target).__name__}."
            )
        graphdef, params, rest = nnx.split(_plain_variables(target), wrt, ...)
        rest = jax.tree.map(_copy_array, rest)
        return spec_from_split(graphdef, params, rest, wrt=wrt)

    @property
    def size(self) -> int:
        """Number of generated scalars (the length of :func:`ravel`'s vector)."""
        return sum(leaf.size for leaf in self.leaves)

    @property
    def paths(self) -> tuple[Path, ...]:
        """The generated variables' paths in the target, in spec order."""
        return tuple(leaf.path for leaf in self.leaves)

    def unravel(self, flat: jax.Array) -> nnx.State:
        """Cuts a ``(size,)`` vector into an ``nnx.State`` shaped like the generated params.

        The inverse of :func:`ravel`: cut in spec order (one ``jax.lax.split``), reshaped
        and cast to each tensor's dtype. For several vectors at once,
        ``jax.vmap(spec.unravel)``.

        Raises:
          ValueError: ``flat`` is not 1-D or its length is not ``spec.size``.

        Example:
          >>> params = spec.unravel(jnp.zeros(spec.size))
          >>> y = hyper.call(spec, params, x)
        """
        shape = jnp.shape(flat)
        if len(shape) != 1:
            hint = " Use jax.vmap(spec.unravel) for a batch of vectors." if shape else ""
            raise ValueError(
                f"unravel expects a 1-D vector of length {self.size}, got shape {shape}.{hint}"
            )
        if shape[0] != self.size:
            raise ValueError(
                f"unravel expects a vector of length {self.size} (spec.size), got length "
                f"{shape[0]}. Build the vector with hyper.ravel(params) of this spec's params."
            )
        # One split, not a slice per tensor: a slice's gradient is a pad to the whole vector
        # (a full pass per tensor), split's is one concatenation.
        sizes = [leaf.size for leaf in self.leaves]
        if isinstance(flat, np.ndarray):  # numpy in, numpy out, as slicing gave
            pieces = np.split(flat, np.cumsum(sizes)[:-1])
        else:
            pieces = jax.lax.split(flat, sizes)
        values = [
            piece.reshape(leaf.shape).astype(leaf.dtype)
            for leaf, piece in zip(self.leaves, pieces, strict=True)
        ]
        return jax.tree.unflatten(self.treedef, values)

    def __repr__(self) -> str:
        generated = ", ".join(f"{leaf.name}: {leaf.shape}" for leaf in self.leaves)
        n_rest = len(jax.tree.leaves(self.rest))
        return f"ParamSpec(size={self.size}, generated={{{generated}}}, rest={n_rest} arrays)"


def spec_from_split(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    *,
    wrt: Any = None,
) -> ParamSpec:
    """Builds a ParamSpec from ``nnx.split(target, wrt, ...)``'s three parts (no copies).

    Raises ValueError when ``params`` is empty or holds a non-floating variable.

    Example:
      >>> spec = spec_from_split(*nnx.split(mlp, nnx.Param, ...), wrt=nnx.Param)
    """
    pairs = variable_leaves(params)
    if not pairs:
        types = sorted(
            {type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=_is_variable)}
            | {type(v).__name__ for v in jax.tree.leaves(params, is_leaf=_is_variable)}
        )
        raise ValueError(
            f"wrt={wrt!r} selects no variable of the target, so there is nothing to "
            f"generate. Variable types present: {types}. Pass e.g. wrt=nnx.Param, or "
            f"wrt=nnx.All(nnx.Param, nnx.PathContains('out')) to generate one layer."
        )
    leaves = []
    for path, value in pairs:
        dtype = jnp.result_type(value)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"wrt={wrt!r} selects {path_str(path)} of dtype {dtype}; only floating-point "
                f"variables can be generated. Narrow wrt, e.g. nnx.All(nnx.Param, ...)."
            )
        leaves.append(LeafSpec(path, tuple(jnp.shape(value)), np.dtype(dtype)))
    treedef = jax.tree.structure(params)
    if treedef.num_leaves != len(leaves):
        raise ValueError(
            "Each generated variable must hold exactly one array; got "
            f"{treedef.num_leaves} arrays in {len(leaves)} variables."
        )
    mean, var = _moments([v for _, v in pairs])
    return ParamSpec(graphdef, treedef, tuple(leaves), rest, mean, var)


@jax.jit
def _moments(values: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    # One compiled call per list of tensor shapes rather than a few eager ops per tensor.
    values = [jnp.asarray(v, jnp.float32) for v in values]
    zero = jnp.zeros((), jnp.float32)
    mean = jnp.stack([jnp.mean(v) if v.size else zero for v in values])
    var = jnp.stack([jnp.var(v) if v.size else zero for v in values])
    return mean, var


def check_params(spec: ParamSpec, params: Any) -> nnx.State:
    """Checks ``params`` against ``spec`` and returns them as the spec's ``nnx.State``.

    ``params`` may be an ``nnx.State`` (of any Variable type, or of plain arrays) or a nested
    dict with the same paths. Only paths and shapes are checked (dtypes are kept), on
    shapes alone, so this raises the same way eagerly and while tracing, before compiling.

    Raises:
      ValueError: naming the first path (in spec order) whose presence or shape differs.

    Example:
      >>> params = check_params(spec, {"out": {"kernel": k, "bias": b}})
    """
    got = dict(variable_leaves(params))
    for leaf in spec.leaves:
        if leaf.path not in got:
            raise ValueError(
                f"params has no array at {leaf.name}: the spec expects shape {leaf.shape}, "
                f"got no leaf. Expected paths: {[x.name for x in spec.leaves]}."
            )
        shape = tuple(jnp.shape(got[leaf.path]))
        if shape != leaf.shape:
            hint = ""
            if len(shape) > len(leaf.shape) and shape[len(shape) - len(leaf.shape) :] == (
                leaf.shape
            ):
                hint = (
                    " The extra leading axes look like a batch of generated networks: "
                    "jax.vmap over them, e.g. jax.vmap(lambda p: hyper.call(spec, p, x))."
                )
            raise ValueError(
                f"params at {leaf.name} has shape {shape}, but the spec expects {leaf.shape}.{hint}"
            )
    expected = set(spec.paths)
    for path, value in got.items():
        if path not in expected:
            raise ValueError(
                f"params has an array at {path_str(path)} (shape {tuple(jnp.shape(value))}) "
                f"that the spec does not generate (expected no leaf there). Expected paths: "
                f"{[x.name for x in spec.leaves]}."
            )
    return jax.tree.unflatten(spec.treedef, [got[path] for path in spec.paths])


def ravel(params: Any) -> jax.Array:
    """Flattens generated params into one vector, in spec order (sorted paths).

    Mixed dtypes are promoted to a common one; :meth:`ParamSpec.unravel` casts back.

    Args:
      params: an ``nnx.State`` (e.g. ``nnx.state(target, nnx.Param)``) or nested dict.

    Returns:
      A ``(spec.size,)`` vector.

    Example:
      >>> flat = hyper.ravel(nnx.state(target, nnx.Param))
      >>> params = spec.unravel(flat)
    """
    pairs = variable_leaves(params)
    if not pairs:
        raise ValueError("ravel got a pytree with no arrays; pass the generated params.")
    return jnp.concatenate([jnp.ravel(jnp.asarray(v)) for _, v in pairs])
