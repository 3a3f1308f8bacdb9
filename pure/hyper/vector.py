"""The heads' own flat vector: every generated scalar once, in the order the heads compute them.

:func:`~nnxscan.pure.hyper.ravel` orders a network's params tensor by tensor, row-major, as
the target holds them. Chunked and structured heads compute a kernel output unit by output
unit (each unit's fan-in contiguous, hypnettorch's order), so building the params moves
every kernel's axes, and raveling them moves them back. Where only some vector of the
generated scalars is needed (von Oswald et al.'s output regularizer compares every task's
generated weights with a snapshot, entry by entry, in whatever order both sides share),
the heads' own order skips both moves: ``heads.vector(h)`` is that vector,
``heads.params_of(v)`` the params it stands for (bitwise ``heads(h)``), and
``heads.vector_of(params)`` the way back.

:class:`VectorHeads` holds what the three heads share; each class says how its pieces are
computed (``_pieces``), in what order (``_order``: tensor indices in spec order), and how a
piece becomes its tensor (``_to_tensor``) and back (``_to_piece``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["EVERY_CONDITION", "VectorHeads"]

# Passed as the condition by ConditionalHypernetwork.generate_vectors: every condition's
# chunk embeddings at once (the whole table, a leading axis of num_conditions), no gather.
EVERY_CONDITION: Any = type("EveryCondition", (), {"__repr__": lambda self: "EVERY_CONDITION"})()


class VectorHeads(nnx.Module):
    """What :class:`HyperHeads`, :class:`ChunkedHeads` and :class:`StructuredHeads` share:
    the generated params as one vector in the heads' own order, and back."""

    treedef: Any
    leaves: Any

    @property
    def _order(self) -> tuple[int, ...]:
        """The tensors (spec indices) in the order the vector holds their pieces."""
        return tuple(range(len(self.leaves)))

    def _to_tensor(self, piece: jax.Array, t: int) -> jax.Array:
        """Tensor ``t`` from its piece ``(..., size_t)``, in the tensor's dtype."""
        leaf = self.leaves[t]
        return piece.reshape(*piece.shape[:-1], *leaf.shape).astype(leaf.dtype)

    def _to_piece(self, tensor: jax.Array, t: int) -> jax.Array:
        """Tensor ``t``'s piece ``(..., size_t)``: :meth:`_to_tensor` undone."""
        shape = self.leaves[t].shape
        return tensor.reshape(*tensor.shape[: tensor.ndim - len(shape)], -1)

    def _params(self, pieces: list[jax.Array]) -> nnx.State:
        """The params from the pieces, listed in ``_order``."""
        tensors = dict(zip(self._order, pieces, strict=True))
        values = [self._to_tensor(tensors[t], t) for t in range(len(self.leaves))]
        return jax.tree.unflatten(self.treedef, values)

    @property
    def vector_size(self) -> int:
        """The vector's length: every generated scalar once (``spec.size``)."""
        return sum(leaf.size for leaf in self.leaves)

    def params_of(self, vector: jax.Array) -> nnx.State:
        """The generated params a vector of :meth:`vector` stands for (leading axes kept).

        ``heads.params_of(heads.vector(h))`` is ``heads(h)``, bitwise.

        Raises:
          ValueError: the last axis is not ``vector_size`` long.

        Example:
          >>> params = heads.params_of(heads.vector(h))    # == heads(h)
        """
        vector = self._check_vector(vector)
        sizes = [self.leaves[t].size for t in self._order]
        return self._params(jax.lax.split(vector, sizes, axis=-1))

    def _check_vector(self, vector: jax.Array) -> jax.Array:
        """``vector`` as an array whose last axis is ``vector_size`` long, or a ValueError."""
        vector = jnp.asarray(vector)
        if vector.shape[-1:] != (self.vector_size,):
            raise ValueError(
                f"{type(self).__name__}.params_of expects a last axis of {self.vector_size} "
                f"(every generated scalar once), got shape {vector.shape}. Pass what "
                f"vector()/generate_vector() return; for hyper.ravel's order, spec.unravel."
            )
        return vector

    def vector_of(self, params: Any) -> jax.Array:
        """The heads' vector of given params (the target's tensors): :meth:`params_of`
        undone, e.g. pretrained weights to add to generated deltas.

        Raises:
          ValueError: ``params`` does not have the generated tensors' structure and shapes.

        Example:
          >>> v = heads.vector_of(heads(h))                # == heads.vector(h)
        """
        leaves = self._check_leaves(params)
        pieces = [self._to_piece(jnp.asarray(leaves[t]), t) for t in self._order]
        return jnp.concatenate(pieces, axis=-1)

    def _check_leaves(self, params: Any) -> list[Any]:
        """``params``' leaves, checked against the generated tensors' count and shapes."""
        leaves = jax.tree.leaves(params)
        if len(leaves) != len(self.leaves):
            raise ValueError(
                f"{type(self).__name__}.vector_of expects the {len(self.leaves)} generated "
                f"tensors ({', '.join(leaf.name for leaf in self.leaves)}), got "
                f"{len(leaves)} leaves."
            )
        for leaf, x in zip(self.leaves, leaves, strict=True):
            if jnp.shape(x)[jnp.ndim(x) - len(leaf.shape) :] != leaf.shape:
                raise ValueError(
                    f"{type(self).__name__}.vector_of: {leaf.name} must end in shape "
                    f"{leaf.shape}, got {jnp.shape(x)}."
                )
        return leaves
