"""Where the carry (state, optax state) and the data live: one device, or a mesh — with the
shardings the model brings.

Without a mesh everything is committed to the device that holds the model, so numpy,
uncommitted and committed inputs compile once. With a ``jax.sharding.Mesh`` (``mesh=``, else
the one ``jax.set_mesh`` put in context when the call runs) every variable's sharding is
decided once per call by the rules docs/scaling.md lists, first match wins: a path rule, the
array's own ``NamedSharding``, its NNX annotation, the FSDP rule, replicated (one leaf's rule
is ``Placement._variable_spec``; its parts, in ``nnxscan.adapters._sharding_rules``). A
population's members axis is sharded over ``member_axis``; batches split over the data axes.
The compiled calls pin the carry's shardings in and out, so a model comes back sharded
exactly as it went in.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxscan.adapters._sharding_rules import (
    annotated_spec,
    check_rules,
    fsdp_spec,
    is_variable,
    leaf_path,
    parameters_of,
    replicated_on_one,
    same_spec,
)
from nnxscan.shell._engine.layout import ONE_MODEL, Layout


def device_of(like: Any) -> Any:
    """The device holding ``like``'s first leaf (the default device if it is sharded)."""
    leaves = jax.tree.leaves(like)
    devices = leaves[0].devices() if leaves and hasattr(leaves[0], "devices") else set()
    return next(iter(devices)) if len(devices) == 1 else jax.devices()[0]


def context_mesh() -> Mesh | None:
    """The concrete mesh ``jax.set_mesh`` put in context, or None."""
    mesh = jax.sharding.get_mesh()
    return mesh if isinstance(mesh, Mesh) and not mesh.empty else None


class Placement:
    """Places the carry, a data set and stream chunks; validates sizes for a mesh.

    Built once by a front-end with the user's options; :meth:`bound` resolves the mesh at
    each call (``mesh=``, else the context's), so the same Trainer trains on one device or
    under ``jax.set_mesh``, for the owner's layout (one model's leaves, or members' with a
    leading members axis).
    """

    def __init__(
        self,
        mesh: Mesh | None = None,
        data_axis: str | tuple[str, ...] | None = None,
        fsdp_min_size: int | None = None,
        member_axis: str | None = None,
        *,
        rules: Any = None,
        tx: optax.GradientTransformation | None = None,
        wrt: Any = nnx.Param,
    ):
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
        if data_axis is not None and not isinstance(data_axis, str | tuple):
            raise TypeError(
                f"data_axis must be a mesh axis name or a tuple of them, got "
                f"{type(data_axis).__name__}."
            )
        self._mesh, self._data_axis = mesh, data_axis
        self.fsdp_min_size, self._member_axis = fsdp_min_size, member_axis
        self.rules = check_rules(rules)
        self.tx, self.wrt = tx, wrt
        self.mesh: Mesh | None = None
        self.data_axes: tuple[str, ...] = ()
        self.member_axis: str | None = None
        #: The spec entries of a carry leaf's leading members axes, one per axis of the
        #: owner's layout's ``shape`` (none for one model); set when bound.
        self.carry_lead: tuple[str | None, ...] = ()
        if mesh is not None:  # data_axis is checked against mesh= at once
            self.mesh, self.data_axes = mesh, self._data_axes(mesh)

    # -- the mesh of this call ----------------------------------------------------------------

    def bound(self, layout: Layout) -> Placement:
        """This placement on the mesh of the current call (``mesh=``, else the one
        ``jax.set_mesh`` put in context; none: one device) for the owner's ``layout``. It
        keeps no copy of the layout (the owner's is the one): what it places by is read from
        it here, the mesh axis the members spread over and the carry's leading spec."""
        context = context_mesh()
        mesh = self._mesh if self._mesh is not None else context
        if self._mesh is not None and context is not None and context != self._mesh:
            raise ValueError(
                f"mesh= is {self._mesh.shape_tuple} but jax.set_mesh put another mesh in "
                f"context ({context.shape_tuple}): pass one of them."
            )
        if mesh is None and (self._data_axis is not None or self.fsdp_min_size is not None):
            what = "data_axis" if self._data_axis is not None else "fsdp_min_size"
            raise ValueError(
                f"{what} shards over a mesh: pass mesh=, or call inside jax.set_mesh(mesh)."
            )
        data_axes, member = (), None
        if mesh is not None:
            data_axes = self._data_axes(mesh)
            member = layout.members_axis(mesh, self._member_axis)
            if member in data_axes:
                raise ValueError(
                    f"member_axis and data_axis are both {member!r}: the members spread over "
                    f"one mesh axis and each member's batches over another."
                )
        lead = (member,) * len(layout.shape)  # each members axis over the member axis
        if mesh is self.mesh and (data_axes, member, lead) == (
            self.data_axes, self.member_axis, self.carry_lead
        ):  # fmt: skip
            return self
        bound = copy.copy(self)
        bound.mesh, bound.data_axes, bound.member_axis = mesh, data_axes, member
        bound.carry_lead = lead
        return bound

    def _data_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """The mesh axes a batch is split over: ``data_axis``, else ``"data"`` if the mesh
        has one, else none."""
        names = tuple(mesh.axis_names)
        axes = self._data_axis
        if axes is None:
            axes = ("data",) if "data" in names else ()
        elif isinstance(axes, str):
            axes = (axes,)
        for axis in axes:
            if axis not in names:
                raise ValueError(f"data_axis {axis!r} is not an axis of the mesh {names}.")
        return tuple(axes)

    def context(self) -> contextlib.AbstractContextManager:
        """What a call is traced in: ``jax.set_mesh(mesh)`` around a call given ``mesh=``
        outside one (model code written for Flax's guide, a bare ``PartitionSpec`` in
        ``with_sharding_constraint`` or ``out_sharding=``, needs the mesh in context), and
        plain Variables by default: compiled calls run hijax models on plain Variables, and
        a Variable a forward pass creates (a Hypernetwork's generated weights) must be plain
        too, since Flax can't differentiate hijax Variables created under ``jax.grad``."""
        stack = contextlib.ExitStack()
        if nnx.var_defaults().hijax:
            stack.enter_context(nnx.var_defaults(hijax=False))
        if self.mesh is not None and context_mesh() is None:
            stack.enter_context(jax.set_mesh(self.mesh))
        return stack

    @property
    def data_parallel(self) -> int:
        """Devices a batch is split over (1 without a mesh)."""
        if self.mesh is None:
            return 1
        return int(np.prod([self.mesh.shape[a] for a in self.data_axes], dtype=np.int64))

    @property
    def batch_sharding(self) -> NamedSharding | None:
        """One batch's leading dimension over the data axes; ``None`` without a mesh."""
        return self.batch_sharding_of(ONE_MODEL)

    def batch_sharding_of(self, layout: Layout) -> NamedSharding | None:
        """A step's batch as ``layout`` runs it: :attr:`batch_sharding`, after the members
        axis (over the member axis, if any) of a population's batch ``(N, batch, ...)``."""
        if self.mesh is None:
            return None
        lead = layout.batch_spec(self.member_axis)
        return NamedSharding(self.mesh, PartitionSpec(*lead, self._data_entry()))

    def _data_entry(self) -> Any:
        if not self.data_axes:
            return None
        return self.data_axes[0] if len(self.data_axes) == 1 else self.data_axes

    def local_data_parallel(self) -> int:
        """Devices of this process a local batch is split over."""
        if self.mesh is None:
            return 1
        local = self.mesh.local_mesh
        return int(np.prod([local.shape[a] for a in self.data_axes], dtype=np.int64))

    def check_batch_size(self, batch_size: int, *, local: bool = False) -> None:
        """A (global, or with ``local`` this process's) batch must split evenly."""
        devices = self.local_data_parallel() if local else self.data_parallel
        if batch_size % devices:
            where = "this process's devices" if local else "devices"
            raise ValueError(
                f"batch size {batch_size} does not divide by the {devices} {where} of mesh "
                f"axes {self.data_axes}; use a multiple of {devices}."
            )

    # -- the carry ------------------------------------------------------------------------

    def state_shardings(self, state: Any) -> list | None:
        """One sharding per leaf of a (module) state, by the rule above; None off a mesh."""
        if self.mesh is None:
            return None
        return self._state_specs(state)[0]

    def _state_specs(self, state: Any) -> tuple[list, list]:
        """Each leaf's sharding, and the spec its array or annotation gave (None if none)."""
        variables = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]
        shardings, given = [], []
        for path, variable in variables:
            value = variable.get_value() if isinstance(variable, nnx.Variable) else variable
            spec, own = self._variable_spec(leaf_path(path), variable, value)
            shardings.append(NamedSharding(self.mesh, spec))
            given.append(own)
        return shardings, given

    def carry_shardings(self, state: Any, opt_state: Any) -> tuple | None:
        """One sharding per leaf of ``(state, opt_state)`` (flattened as a compiled call's carry);
        None off a mesh."""
        if self.mesh is None:
            return None
        state_shardings, given = self._state_specs(state)
        return (*state_shardings, *self._opt_shardings(state, opt_state, state_shardings, given))

    def _opt_shardings(self, state: Any, opt_state: Any, shardings: list, given: list) -> list:
        lead = self.carry_lead  # the members axis' spec, or none
        parameter = parameters_of(self.tx, self.wrt, state, opt_state)
        param_shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(state)]
        out = []
        leaves = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_variable)[0]
        for (path, leaf), param in zip(leaves, parameter, strict=True):
            path = "opt_state/" + leaf_path(path)
            value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
            shape = tuple(np.shape(value))
            own = shape[len(lead) :]
            spec, source = self._rule(path)
            if spec is None:
                spec, source = self._given(leaf, value, optimizer=True)
                # What a moment inherited from its parameter when it was made (the same
                # array sharding or annotation) is not a choice: it follows the parameter.
                if param is not None and spec is not None and same_spec(spec, given[param]):
                    spec = None
            if spec is None and param is not None and param_shapes[param] == shape:
                # (A factored statistic of another shape, Adafactor's, stays replicated.)
                spec = PartitionSpec(*tuple(shardings[param].spec)[len(lead) :])
                source = "its parameter's sharding"
            spec = PartitionSpec() if spec is None else spec
            self._check_spec(path, own, spec, source)
            out.append(NamedSharding(self.mesh, PartitionSpec(*lead, *tuple(spec))))
        return out

    def _rule(self, path: str) -> tuple[PartitionSpec | None, str | None]:
        for pattern, rule in self.rules:
            if pattern.search(path):
                return rule, f"the path rule {pattern.pattern!r}"
        return None, None

    def _given(
        self, variable: Any, value: Any, *, optimizer: bool = False
    ) -> tuple[PartitionSpec | None, str | None]:
        """The spec a leaf's own array sharding (one that shards something) or its
        annotation gives, a population's member axis left out; ``(None, None)`` if none.
        An optax leaf's annotation is ``optimizer_sharding`` (optax states copy their
        parameter's metadata, where Flax's cookbook puts it)."""
        shape = tuple(np.shape(value))
        skip = len(self.carry_lead)
        sharding = getattr(value, "sharding", None)
        if isinstance(sharding, NamedSharding) and not replicated_on_one(sharding):
            full = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
            return PartitionSpec(*full[skip:]), "its array's sharding"
        if not isinstance(variable, nnx.Variable):
            return None, None
        key = "optimizer_sharding" if optimizer else "out_sharding"
        annotation = variable.get_metadata().get(key)
        if not annotation:
            return None, None
        spec = annotated_spec(annotation, variable.get_metadata())
        own = len(shape) - skip
        if len(tuple(spec)) == len(shape) > own:  # annotated after stacking: members' entry
            spec = PartitionSpec(*tuple(spec)[skip:])
        return spec, f"its {key} annotation"

    def _variable_spec(
        self, path: str, variable: Any, value: Any
    ) -> tuple[PartitionSpec, PartitionSpec | None]:
        """The rule of the module docstring for one variable (checked against the mesh),
        and the spec its array or annotation gave (what its moments would have inherited)."""
        shape = tuple(np.shape(value))
        lead = self.carry_lead  # the members axis' spec, or none
        own = shape[len(lead) :]
        is_key = jax.dtypes.issubdtype(getattr(value, "dtype", np.float32), jax.dtypes.prng_key)
        given, given_source = self._given(variable, value)
        spec, source = self._rule(path)
        if spec is None:
            spec, source = given, given_source
        if spec is None and self.fsdp_min_size is not None and self.data_axes and not is_key:
            spec = fsdp_spec(own, self.data_parallel, self._data_entry(), self.fsdp_min_size)
            source = "the FSDP rule"
        spec = PartitionSpec() if spec is None else spec
        self._check_spec(path, own, spec, source)
        return PartitionSpec(*lead, *tuple(spec)), given

    def _check_spec(self, path: str, shape: tuple, spec: PartitionSpec, source: Any) -> None:
        if len(tuple(spec)) > len(shape):
            raise ValueError(
                f"variable {path} has shape {shape} but {source} gives {spec}, which has "
                f"more entries than dimensions."
            )
        names = tuple(self.mesh.axis_names)
        for dim, entry in enumerate(tuple(spec)):
            axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            for axis in axes:
                if axis not in names:
                    raise ValueError(
                        f"variable {path} is sharded {spec} by {source}, but the mesh has no "
                        f"axis {axis!r} (its axes: {names}). Map logical names with "
                        f"nnx.logical_axis_rules(...) around the call, or use a mesh with "
                        f"that axis."
                    )
                if axis == self.member_axis:  # None off a population: never an axis
                    raise ValueError(
                        f"variable {path} is sharded over {axis!r} by {source}, but that is "
                        f"the population's member_axis: shard a member over its other axes."
                    )
            size = int(np.prod([self.mesh.shape[a] for a in axes], dtype=np.int64))
            if shape[dim] % size:
                raise ValueError(
                    f"variable {path} has shape {shape}: dimension {dim} ({shape[dim]}) does "
                    f"not divide over the {size} devices of mesh axes {axes} ({source} gives "
                    f"{spec})."
                )

    def put_carry(self, leaves: list, shardings: Any = None) -> list:
        """The carry's leaves on their shardings (off a mesh: on the model's device)."""
        if self.mesh is None or shardings is None:
            return _commit(leaves, device_of(leaves))
        return [_put(x, s) for x, s in zip(leaves, shardings, strict=True)]

    def put_data(self, tree: Any, like: Any = None, *, device: Any = None) -> Any:
        """A whole data set: next to the model (``like``'s device, or ``device``), or replicated
        over the mesh — a full copy on every device (each step's batch is then gathered and sharded
        over the data axes inside the compiled call)."""
        if self.mesh is None:
            return _commit(tree, device if device is not None else device_of(like))
        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

    def put_chunk(self, tree: Any, device: Any, *, layout: Layout = ONE_MODEL) -> Any:
        """A stream chunk ``(steps, batch, ...)``: batch dimension over the data axes; a
        population's per-member chunk ``(steps, members, batch, ...)`` (``layout``'s batch
        has a members axis): members over ``member_axis`` too."""
        if self.mesh is None:
            return _commit(tree, device)
        lead = layout.batch_spec(self.member_axis)
        sharding = NamedSharding(self.mesh, PartitionSpec(None, *lead, self._data_entry()))
        if jax.process_count() > 1:
            # Each process holds its own share of every batch: assemble the global chunk.
            return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)
        return jax.device_put(tree, sharding)


def _put(x: Any, sharding: Any) -> Any:
    """``jax.device_put`` that also places typed PRNG keys on a mesh spanning processes:
    JAX refuses a key there, so its raw data travels and is wrapped again."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.device_put(np.asarray(jax.device_get(jax.random.key_data(x))), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(x, sharding)


def _commit(tree: Any, device: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    # Arrays already committed to the device pass through: device_put costs host time per
    # call even when it has nothing to do (docs/performance.md), and fit and scan_train
    # call this every time. An uncommitted array is committed (a compiled call's cache
    # tells committed arguments from uncommitted ones: one of each would compile twice).
    # Arrays the user sharded over several devices keep their sharding.
    moving = [
        i
        for i, x in enumerate(leaves)
        if not (
            isinstance(x, jax.Array)
            and (len(x.devices()) > 1 or (x.committed and x.devices() == {device}))
        )
    ]
    if not moving:  # a new container all the same: callers count who holds the leaves
        return jax.tree.unflatten(treedef, leaves)
    # One device_put for every leaf that moves: its host cost is per call, not per leaf.
    moved = jax.device_put([leaves[i] for i in moving], device)
    placed = list(leaves)
    for i, x in zip(moving, moved, strict=True):
        placed[i] = x
    return jax.tree.unflatten(treedef, placed)
