"""The step node: what a step's ``graphdef`` describes, the model alone or the model with
its call-time Rngs and NNX metrics.

A loss written for Flax's own loops takes call-time ``nnx.Rngs`` (``loss_fn(model, batch,
rngs)``) and updates NNX metrics next to the gradient. Both are NNX objects whose state
changes every step, so the step carries them with the model: the user splits the tuple
``(model, rngs)``, ``(model, metrics)`` or ``(model, rngs, metrics)`` instead of the model,
in that order, and the step unpacks what it merged. ``make_train_step(..., with_rngs=True,
update_metrics=fn)``, ``make_evaluate_metrics`` and the shell all build and read that
tuple here.

- :func:`step_node`: the node to split, the model or the tuple.
- :func:`unpack_step_node`: a merged node back into :class:`StepNodeParts` (model, rngs,
  metrics).
- :func:`call_loss`: ``loss_fn`` on those parts, its output checked.

Example:
  >>> from nnxscan.pure.step_node import step_node, unpack_step_node
  >>> graphdef, state = nnx.split(step_node(model, rngs=nnx.Rngs(dropout=0)))
  >>> parts = unpack_step_node(nnx.merge(graphdef, state), with_rngs=True, with_metrics=False)
  >>> loss = loss_fn(parts.model, batch, parts.rngs)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
from flax import nnx

__all__ = ["StepNodeParts", "call_loss", "step_node", "unpack_step_node"]


class StepNodeParts(NamedTuple):
    """A merged step node's objects: the model, and the rngs and metrics (None if absent).

    Example:
      >>> parts = unpack_step_node(nnx.merge(graphdef, state), with_rngs=True, with_metrics=False)
      >>> parts.model, parts.rngs, parts.metrics  # metrics is None
    """

    model: Any
    rngs: nnx.Rngs | None
    metrics: Any


def step_node(model: Any, rngs: nnx.Rngs | None = None, metrics: Any = None) -> Any:
    """The graph node a step with these call-time objects splits: ``model`` or a tuple.

    Args:
      model: the ``nnx.Module`` to train.
      rngs: call-time ``nnx.Rngs`` the loss takes as its third argument, or None.
      metrics: NNX metrics the step updates (an ``nnx.Metric`` or ``nnx.MultiMetric``), or
        None.

    Returns:
      ``model`` alone when both are None; else the tuple ``(model, rngs, metrics)`` without
      the absent ones, in that order.

    Example:
      >>> step_node(model) is model
      True
      >>> graphdef, state = nnx.split(step_node(model, metrics=nnx.metrics.Average()))
    """
    present = tuple(x for x in (rngs, metrics) if x is not None)
    return (model, *present) if present else model


def unpack_step_node(node: Any, *, with_rngs: bool, with_metrics: bool) -> StepNodeParts:
    """Splits a merged node back into model, rngs and metrics (the absent ones None).

    Args:
      node: ``nnx.merge(graphdef, state)`` of a state split from :func:`step_node`'s node.
      with_rngs: whether the node carries ``nnx.Rngs``.
      with_metrics: whether it carries metrics.

    Returns:
      :class:`StepNodeParts`.

    Raises:
      ValueError: the node is not the tuple these flags describe (say, the model alone was
        split for a step that carries rngs); the message says what to split.
      TypeError: the entry for the rngs is not an ``nnx.Rngs``.

    Example:
      >>> node = nnx.merge(graphdef, state)  # of nnx.split((model, rngs))
      >>> rngs = unpack_step_node(node, with_rngs=True, with_metrics=False).rngs
    """
    if not (with_rngs or with_metrics):
        return StepNodeParts(node, None, None)
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
    return StepNodeParts(node[0], rngs, metrics)


def call_loss(
    loss_fn: Callable, parts: StepNodeParts, batch: Any, has_aux: bool
) -> tuple[Any, Any]:
    """``loss_fn`` on the merged parts; returns ``(loss, aux)`` after checking their form.

    Args:
      loss_fn: ``loss_fn(model, batch)``, or ``loss_fn(model, batch, rngs)`` when
        ``parts.rngs`` is set; returns a scalar, or ``(loss, aux)`` with ``has_aux``.
      parts: from :func:`unpack_step_node`.
      batch: one batch.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      ``(loss, aux)``; ``aux`` is None without ``has_aux``.

    Raises:
      ValueError: the loss is not a floating-point scalar, or the output's form does not
        match ``has_aux`` (the message says which to pass).

    Example:
      >>> parts = unpack_step_node(node, with_rngs=False, with_metrics=False)
      >>> loss, aux = call_loss(loss_fn, parts, batch, has_aux=False)
    """
    if parts.rngs is None:
        out = loss_fn(parts.model, batch)
    else:
        out = loss_fn(parts.model, batch, parts.rngs)
    if has_aux and not (isinstance(out, tuple | list) and len(out) == 2):
        raise ValueError(
            f"has_aux=True, so loss_fn must return (loss, aux); it returned a "
            f"{type(out).__name__}. Pass has_aux=False for a plain scalar loss."
        )
    loss, aux = out if has_aux else (out, None)
    _check_scalar_loss(loss, has_aux)
    return loss, aux


def _check_scalar_loss(loss: Any, has_aux: bool) -> None:
    if isinstance(loss, tuple) and not has_aux:
        raise ValueError(
            "loss_fn returned a tuple, but the loss must be a scalar. If it returns "
            "(loss, aux), pass has_aux=True."
        )
    shape = jnp.shape(loss)
    if shape != ():
        raise ValueError(
            f"loss_fn must return a scalar loss, got shape {shape}. Reduce it, e.g. with "
            f"jnp.mean(...)."
        )
    if not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
        raise ValueError(
            f"loss_fn must return a floating-point scalar, got dtype {jnp.result_type(loss)}."
        )
