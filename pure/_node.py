"""What a step's ``graphdef`` describes: the model alone, or the model and its companions.

A loss written for Flax's own loops takes call-time ``nnx.Rngs`` (``loss_fn(model, batch,
rngs)``) and updates NNX metrics next to the gradient. Both are NNX objects whose state
changes every step, so the step carries them with the model: the user splits the tuple
``(model, rngs)``, ``(model, metrics)`` or ``(model, rngs, metrics)`` instead of the model,
in that order, and the step unpacks what it merged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from flax import nnx


class Parts(NamedTuple):
    """The merged objects: the model, and the companions that are present (else None)."""

    model: Any
    rngs: nnx.Rngs | None
    metrics: Any


def node_of(model: Any, rngs: nnx.Rngs | None = None, metrics: Any = None) -> Any:
    """The graph node a step with these companions splits: ``model`` or a tuple."""
    companions = tuple(x for x in (rngs, metrics) if x is not None)
    return (model, *companions) if companions else model


def unpack(node: Any, *, with_rngs: bool, with_metrics: bool) -> Parts:
    """Splits a merged node back into model, rngs and metrics (the absent ones None)."""
    if not (with_rngs or with_metrics):
        return Parts(node, None, None)
    expected = 1 + with_rngs + with_metrics
    if not isinstance(node, tuple) or len(node) != expected:
        names = ["model", *(["rngs"] if with_rngs else []), *(["metrics"] if with_metrics else [])]
        raise ValueError(
            f"this step carries {', '.join(names[1:])} with the model: split the tuple "
            f"({', '.join(names)}), e.g. graphdef, state = nnx.split(({', '.join(names)})), "
            f"not the model alone."
        )
    rngs = node[1] if with_rngs else None
    metrics = node[-1] if with_metrics else None
    if with_rngs and not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"the node's second entry must be an nnx.Rngs, got {type(rngs).__name__}.")
    return Parts(node[0], rngs, metrics)
