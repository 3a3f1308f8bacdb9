"""Hypernetwork: an ordinary NNX module = trunk + heads + the target it generates for.

The heads are :class:`HyperHeads` (one per generated tensor) or, with ``chunk_size``,
:class:`ChunkedHeads` (one shared layer, chunk by chunk).

Where the generated slots live. ``hnet.target`` is the hypernetwork's own copy of the
target in which every generated variable has been re-wrapped as a :class:`GeneratedSlot`
(holding the target's initial value, which ``hnet.spec`` measures for the head init). A
``GeneratedSlot`` is not an ``nnx.Param``, so training ``hnet`` with ``wrt=nnx.Param``
(the default everywhere in nnxscan) differentiates and optimizes the trunk, the heads and
the target's *non-generated* Params, and neither differentiates the generated slots nor
carries them in the optimizer state. With a broader filter such as ``nnx.Variable``, exclude
them explicitly: ``nnx.All(nnx.Variable, nnx.Not(hyper.GeneratedSlot))``.
"""

from __future__ import annotations

from typing import Any, TypedDict

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from nnxscan.pure.hyper.call import call_with_state
from nnxscan.pure.hyper.chunked import ChunkedHeads
from nnxscan.pure.hyper.heads import HyperHeads
from nnxscan.pure.hyper.spec import (
    ParamSpec,
    _plain_variables,
    spec_from_split,
    variable_leaves,
)
from nnxscan.pure.hyper.structured import StructuredHeads
from nnxscan.pure.hyper.variance import check_init

__all__ = ["FrozenParam", "GeneratedSlot", "Hypernetwork", "HypernetworkOptions"]


class GeneratedSlot(nnx.Variable):
    """A target variable whose value a :class:`Hypernetwork` generates; not a Param.

    Holds the target's own initial value, which ``hnet(z, ...)`` never uses (with
    ``pretrained=``, the base the deltas are added to is ``hnet.base``).
    """


class FrozenParam(nnx.Variable):
    """A target Param a :class:`Hypernetwork` keeps fixed (``freeze_target=True``), or the
    pretrained weights of ``pretrained="frozen"``: not an ``nnx.Param``, so no ``wrt=nnx.Param``
    training updates it."""


PRETRAINED = (None, "frozen", "trainable")


_CHUNK_EMBEDDING_FEATURES = 16  # ChunkedHeads' default


def _check_chunk_options(
    chunk_size: int | None,
    embedding_features: int | None,
    hidden_features: int | None,
    structured_units: int | None = None,
) -> None:
    if chunk_size is not None and structured_units is not None:
        raise ValueError(
            "chunk_size and structured_units choose two kinds of heads (equal chunks of the "
            "flat vector, or chunks of a layer's output units): pass one of them."
        )
    if structured_units is not None:
        return
    given = [
        name
        for name, value in (
            ("chunk_embedding_features", embedding_features),
            ("chunk_hidden_features", hidden_features),
        )
        if value is not None
    ]
    if chunk_size is None and given:
        raise ValueError(
            f"{' and '.join(given)} only shape chunked heads, but chunk_size is None (one "
            f"head per tensor). Pass chunk_size=... to generate in chunks, or drop "
            f"{' and '.join(given)}."
        )


class HypernetworkOptions(TypedDict, total=False):
    """The options of :class:`Hypernetwork` that its subclasses (``ConditionalHypernetwork``)
    take as they are, each described there; declared once so a subclass forwards them."""

    wrt: nnx.filterlib.Filter
    input_variance: float
    chunk_size: int | None
    chunk_embedding_features: int | None
    chunk_hidden_features: int | None
    structured_units: int | None
    init: str | None
    init_gain: float
    pretrained: str | None
    freeze_target: bool


class Hypernetwork(nnx.Module):
    """A trunk, heads, and the target network they generate weights for.

    Args:
      target: the network to generate variables for. It is copied (arrays included) and
        never modified; ``hnet.target`` is the copy, with generated slots re-wrapped as
        :class:`GeneratedSlot`.
      trunk: any NNX module (or callable) mapping an embedding ``z`` to features of size
        ``trunk_features``; it is stored as is and trained with the hypernetwork.
      trunk_features: the size of the trunk's output.
      wrt: the filter selecting the target's generated variables (default: all Params).
      input_variance: the variance of the trunk's output features the head init assumes.
      chunk_size: ``None`` (default): one :class:`HyperHeads` head per generated tensor.
        An int: one :class:`ChunkedHeads` generating the flat parameter vector in chunks
        of this many scalars, so the hypernetwork can be smaller than its target
        (``compression_ratio``).
      chunk_embedding_features, chunk_hidden_features: with ``chunk_size`` or
        ``structured_units`` only, the size of each learned chunk embedding (default 16, or
        8 for structured heads) and the width of the chunk layer (default
        ``trunk_features``); see :class:`ChunkedHeads`. Given without either they raise
        rather than be ignored.
      structured_units: an int: one :class:`StructuredHeads`, chunks of this many output
        units of one layer (each unit's whole fan-in and bias), hypnettorch's structured
        chunking. Exclusive with ``chunk_size``.
      init, init_gain: the variance each generated tensor starts with: ``"target"``
        (default: the target's own initializer's), ``"hyperfan_in"``, ``"hyperfan_out"``
        (Chang et al.; ``init_gain`` is their ``c``, 2 for ReLU targets) or ``"zeros"``; see
        :func:`~nnxscan.pure.hyper.variance.init_moments`. With ``pretrained``, the
        default is ``"zeros"``.
      pretrained: ``None`` (default): the heads generate the weights themselves.
        ``"frozen"`` or ``"trainable"``: they generate a delta added to the target's own
        (pretrained) weights, ``θ = θ0 + Δ(z)`` (HyperLight's ``from_existing``, MIP);
        ``Δ`` starts at exactly zero (``init="zeros"``), so before any training ``hnet(z,
        x)`` is the pretrained target's output for every ``z``. ``θ0`` is ``hnet.base``:
        :class:`FrozenParam` (never trained) or ``nnx.Param`` (trained with the rest).
      freeze_target: keep the target's own (non-generated) Params fixed: they are re-wrapped
        as :class:`FrozenParam`, so ``Trainer(hnet, ...)`` (``wrt=nnx.Param``) never updates
        them. For generated LoRA adapters of a frozen base: ``wrt=nnx.LoRAParam,
        freeze_target=True``.
      param_dtype: dtype of the heads' weights (default float32).
      rngs: draws the head weights.

    ``hnet.generate(z)`` returns the generated params for one embedding ``z``;
    ``hnet(z, *args, **kwargs)`` runs the target on ``args`` with them. Changes the target's
    forward makes to its own state (batch statistics, RNG counts) are written back to
    ``hnet.target``. For many networks at once, ``jax.vmap(lambda z: hnet(z, x))(zs)``.

    Example:
      >>> target = MLP(1, 8, 1, rngs=nnx.Rngs(0))
      >>> trunk = nnx.Sequential(nnx.Linear(3, 32, rngs=rngs), nnx.tanh)
      >>> hnet = hyper.Hypernetwork(target, trunk, 32, rngs=nnx.Rngs(1))
      >>> y = hnet(jnp.array([1.0, 0.5, 0.0]), x)        # target(x) with generated weights
      >>> trainer = Trainer(hnet, optax.adam(1e-3), loss_fn)   # trains trunk and heads
    """

    def __init__(
        self,
        target: nnx.Module,
        trunk: Any,
        trunk_features: int,
        *,
        wrt: nnx.filterlib.Filter = nnx.Param,
        input_variance: float = 1.0,
        chunk_size: int | None = None,
        chunk_embedding_features: int | None = None,
        chunk_hidden_features: int | None = None,
        structured_units: int | None = None,
        init: str | None = None,
        init_gain: float = 2.0,
        pretrained: str | None = None,
        freeze_target: bool = False,
        param_dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if not callable(trunk):
            raise TypeError(f"trunk must be callable (an NNX module), got {type(trunk).__name__}.")
        if pretrained not in PRETRAINED:
            raise ValueError(f"pretrained must be one of {PRETRAINED}, got {pretrained!r}.")
        if not isinstance(freeze_target, bool):
            raise TypeError(f"freeze_target must be a bool, got {type(freeze_target).__name__}.")
        if init is None:
            init = "target" if pretrained is None else "zeros"
        check_init(init, init_gain)
        _check_chunk_options(
            chunk_size, chunk_embedding_features, chunk_hidden_features, structured_units
        )
        target = _plain_variables(target)  # the forward pass merges it inside jax.grad
        spec = ParamSpec.from_module(target, wrt=wrt)  # copies the non-generated state
        graphdef, own, rest = nnx.split(target, wrt, ...)
        slots = jax.tree.map(
            lambda v: GeneratedSlot(jnp.array(v.get_value(), copy=True)),
            own,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
        if freeze_target:
            rest = jax.tree.map(
                lambda v: FrozenParam(v.get_value()) if isinstance(v, nnx.Param) else v,
                rest,
                is_leaf=lambda x: isinstance(x, nnx.Variable),
            )
        self.trunk = trunk
        if pretrained is not None:
            kind = nnx.Param if pretrained == "trainable" else FrozenParam
            self.base = nnx.List([kind(jnp.array(v, copy=True)) for _, v in variable_leaves(own)])
        heads_init = dict(input_variance=input_variance, init=init, init_gain=init_gain)
        if structured_units is not None:
            self.heads = StructuredHeads(
                spec,
                trunk_features,
                units=structured_units,
                embedding_features=chunk_embedding_features or 8,
                hidden_features=chunk_hidden_features,
                num_conditions=self._chunk_tables(),
                **heads_init,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        elif chunk_size is None:
            self.heads = HyperHeads(
                spec, trunk_features, **heads_init, param_dtype=param_dtype, rngs=rngs
            )
        else:
            if chunk_embedding_features is None:
                chunk_embedding_features = _CHUNK_EMBEDDING_FEATURES
            self.heads = ChunkedHeads(
                spec,
                trunk_features,
                chunk_size=chunk_size,
                embedding_features=chunk_embedding_features,
                hidden_features=chunk_hidden_features,
                num_conditions=self._chunk_tables(),
                **heads_init,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        self.target = nnx.merge(graphdef, slots, rest, copy=True)
        # The original graphdef (slots typed as wrt selected them) and leaf structure, static.
        self._target_graphdef = spec.graphdef
        self._generated_treedef = spec.treedef
        self._generated_leaves = spec.leaves

    def _chunk_tables(self) -> int | None:
        """How many sets of chunk embeddings chunked heads hold (None: one, shared)."""
        return None

    def _add_base(self, delta: nnx.State) -> nnx.State:
        """``θ0 + Δ`` with ``pretrained=``; ``Δ`` itself otherwise."""
        if "base" not in vars(self):
            return delta
        leaves = jax.tree.leaves(delta)
        values = [
            (base[...] + d).astype(d.dtype) for base, d in zip(self.base, leaves, strict=True)
        ]
        return jax.tree.unflatten(self._generated_treedef, values)

    @property
    def spec(self) -> ParamSpec:
        """The target's :class:`ParamSpec`, with ``hnet.target``'s current own state.

        Example:
          >>> y = hyper.call(hnet.spec, hnet.generate(z), x)   # == hnet(z, x)
        """
        _, slots, rest = nnx.split(self.target, GeneratedSlot, ...)
        # Re-type the slots as the target had them, so spec.unravel builds Params again.
        own = jax.tree.unflatten(self._generated_treedef, jax.tree.leaves(slots))
        return spec_from_split(self._target_graphdef, own, rest)

    @property
    def compression_ratio(self) -> float:
        """The hypernetwork's own parameter count over the number of generated scalars.

        Counts every ``nnx.Param`` of the hypernetwork outside ``hnet.target`` (the trunk,
        the heads, learned embeddings), divided by ``spec.size``. Below 1 the hypernetwork
        is smaller than what it generates, as with :class:`ChunkedHeads`; one
        :class:`HyperHeads` head per tensor is always above ``trunk_features``.

        Example:
          >>> hnet = hyper.Hypernetwork(big_target, trunk, 32, chunk_size=256, rngs=rngs)
          >>> hnet.compression_ratio < 1
          True
        """
        own = nnx.state(self, nnx.Param)
        total = sum(x.size for x in jax.tree.leaves(own))
        in_target = sum(x.size for x in jax.tree.leaves(nnx.state(self.target, nnx.Param)))
        return (total - in_target) / sum(leaf.size for leaf in self._generated_leaves)

    def generate(self, z: jax.Array) -> nnx.State:
        """The generated params for embedding ``z``: ``heads(trunk(z))``.

        Example:
          >>> params = hnet.generate(z)
          >>> flat = hyper.ravel(params)
        """
        return self._add_base(self.heads(self.trunk(z)))

    def generate_vector(self, z: jax.Array) -> jax.Array:
        """The generated params for ``z`` as one ``(spec.size,)`` vector, in the heads' own
        order (not :func:`~nnxscan.pure.hyper.ravel`'s; see ``vector.py``).

        For what compares generated weights entry by entry (the output regularizer and its
        snapshots, both taken this way): chunked and structured heads compute kernels unit
        by unit, so this skips moving every kernel's axes and back. ``hnet.params_of(v)``
        gives the params, bitwise ``hnet.generate(z)`` (with ``pretrained=``, ``θ0`` is in
        the vector; bitwise where the generated tensors share the heads' dtype).

        Example:
          >>> v = hnet.generate_vector(z)
          >>> y = hyper.call(hnet.spec, hnet.params_of(v), x)   # == hnet(z, x)
        """
        return self._add_base_vector(self.heads.vector(self.trunk(z)))

    def params_of(self, vector: jax.Array) -> nnx.State:
        """The generated params of a :meth:`generate_vector` vector (leading axes kept).

        Example:
          >>> params = hnet.params_of(hnet.generate_vector(z))   # == hnet.generate(z)
        """
        return self.heads.params_of(vector)

    def _add_base_vector(self, delta: jax.Array) -> jax.Array:
        """``θ0 + Δ`` in the heads' order with ``pretrained=``; ``Δ`` itself otherwise."""
        if "base" not in vars(self):
            return delta
        return delta + self.heads.vector_of([base[...] for base in self.base])

    def __call__(self, z: jax.Array, *args: Any, **kwargs: Any) -> Any:
        """Runs the target on ``*args, **kwargs`` with the params generated from ``z``.

        Example:
          >>> y = hnet(z, x)                               # one network
          >>> ys = jax.vmap(hnet, in_axes=(0, None))(zs, x)  # one network per embedding
        """
        return self._run_target(self.generate(z), args, kwargs)

    def _run_target(self, params: nnx.State, args: tuple, kwargs: dict) -> Any:
        # The spec without the init statistics (only HyperHeads' init reads them).
        rest = nnx.state(self.target, nnx.Not(GeneratedSlot))
        n = len(self._generated_leaves)
        spec = ParamSpec(
            self._target_graphdef,
            self._generated_treedef,
            self._generated_leaves,
            rest,
            jnp.zeros(n, jnp.float32),
            jnp.zeros(n, jnp.float32),
        )
        out, new_spec = call_with_state(spec, params, *args, **kwargs)
        _write_back_changes(self.target, spec.rest, new_spec.rest)
        return out


def _write_back_changes(target: nnx.Module, old: nnx.State, new: nnx.State) -> None:
    # The module updates its own variables in place, as any NNX layer does (BatchNorm's
    # running mean); nnx.update is left to the shell. Only arrays the forward pass replaced
    # are written, so a target with nothing to update (a plain MLP) leaves hnet untouched,
    # and hnet(z, x) works inside a jax.vmap closure.
    variables = jax.tree.leaves(
        nnx.state(target, nnx.Not(GeneratedSlot)), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    pairs = zip(variables, jax.tree.leaves(old), jax.tree.leaves(new), strict=True)
    for variable, before, after in pairs:
        if after is not before:
            variable[...] = after
