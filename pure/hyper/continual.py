"""Continual learning with a hypernetwork: von Oswald et al.'s output regularizer.

One hypernetwork learns task after task (von Oswald, Henning, Grewe & Sacramento,
"Continual learning with hypernetworks", ICLR 2020). Before training task ``t``, store the
weights it generates for each earlier task ``t' < t``, ``θ*_t' = generate(t')``; while
training task ``t``, add to the task's loss

    β · mean over t' < t of ‖generate(t') − θ*_t'‖²

(the squared Euclidean norm of the difference of the flat generated vectors, summed over
every generated scalar). The hypernetwork stays free to change how it produces the earlier
tasks' weights, but not the weights themselves. This is the paper's regularizer without its
optional look-ahead term (``Θ_h + ΔΘ_h``), which costs a second backward pass per step.

- :func:`generated_vectors`: the flat generated params for a batch of inputs.
- :func:`snapshot_generated`: the same, gradient stopped: what to store before a task.
- :func:`output_regularizer`: the penalty, to add inside a ``loss_fn``; with ``where=``, a
  mask of the rows that count, so every task's step has the same shapes (one compiled
  program for all tasks).

``generate`` is any function from one input (a condition id, an embedding ``z``) to the
generated params, e.g. ``hnet.generate`` of a
:class:`~nnxscan.pure.hyper.ConditionalHypernetwork`; ``inputs`` stacks the inputs along a
leading axis (``jnp.arange(t)`` for the first ``t`` tasks).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnxscan.pure.checks import check_count
from nnxscan.pure.hyper.spec import ravel

__all__ = ["fisher_diagonal", "generated_vectors", "output_regularizer", "snapshot_generated"]


def _count(inputs: Any) -> int:
    leaves = jax.tree.leaves(inputs)
    if not leaves:
        raise ValueError(
            "inputs has no arrays: pass the earlier tasks' inputs stacked on a leading axis, "
            "e.g. jnp.arange(t) for condition ids 0..t-1."
        )
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if None in sizes:
        raise ValueError(
            "inputs must stack one input per task along a leading axis, e.g. jnp.arange(t) "
            "(not a scalar id)."
        )
    if len(sizes) != 1:
        raise ValueError(f"inputs' leaves disagree on the leading size: {sorted(sizes)}.")
    return sizes.pop()


def generated_vectors(generate: Callable[[Any], Any], inputs: Any) -> jax.Array:
    """The flat generated params for each input: ``(n, spec.size)``, one row per input.

    Args:
      generate: one input to generated params (an ``nnx.State`` or nested dict).
      inputs: a pytree of arrays whose leaves share a leading axis of ``n`` inputs.

    Returns:
      ``jax.vmap(lambda i: hyper.ravel(generate(i)))(inputs)``, differentiable.

    Example:
      >>> hyper.generated_vectors(hnet.generate, jnp.arange(3)).shape == (3, hnet.spec.size)
      True
    """
    if not callable(generate):
        raise TypeError(f"generate must be callable, got {type(generate).__name__}.")
    _count(inputs)
    return jax.vmap(lambda i: ravel(generate(i)))(inputs)


def snapshot_generated(generate: Callable[[Any], Any], inputs: Any) -> jax.Array:
    """What to store before training a new task: the earlier tasks' generated params.

    Args:
      generate: one input to generated params, e.g. ``hnet.generate``.
      inputs: the earlier tasks' inputs on a leading axis, e.g. ``jnp.arange(t)``; zero
        tasks (``jnp.arange(0)``) give a ``(0, spec.size)`` array.

    Returns:
      A ``(n, spec.size)`` array with its gradient stopped (a constant of later losses).

    Example:
      >>> stored = hyper.snapshot_generated(hnet.generate, jnp.arange(t))   # before task t
    """
    return jax.lax.stop_gradient(generated_vectors(generate, inputs))


def _is_real(beta: Any) -> bool:
    if isinstance(beta, bool | np.bool_):
        return False
    if isinstance(beta, numbers.Real):  # Python and numpy scalars
        return True
    if isinstance(beta, np.ndarray | jax.Array):  # tracers too
        dtype = jnp.result_type(beta)
        return bool(jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
    return False


def _check_beta(beta: Any) -> None:
    # A traced beta (a schedule under jit) can only be checked for its shape; any concrete
    # one (Python, numpy or a jax array outside a trace) is checked for its value too.
    if not _is_real(beta):
        raise TypeError(
            f"beta must be a real number >= 0 (e.g. 0.05), got {type(beta).__name__} {beta!r}."
        )
    if jnp.ndim(beta) != 0:
        raise ValueError(f"beta must be a scalar >= 0, got shape {jnp.shape(beta)}.")
    if not isinstance(beta, jax.core.Tracer) and not float(beta) >= 0:
        raise ValueError(f"beta must be >= 0, got {float(beta)!r}.")


def _check_where(where: Any, n: int) -> None:
    if not jnp.issubdtype(jnp.result_type(where), jnp.bool_):
        raise TypeError(
            f"where must be a boolean mask, one entry per input, got dtype "
            f"{jnp.result_type(where)}; e.g. jnp.arange(num_tasks) < t."
        )
    if jnp.shape(where) != (n,):
        raise ValueError(
            f"where must have shape ({n},), one entry per input, got {jnp.shape(where)}."
        )


def _sample_rows(key: jax.Array, valid: jax.Array, sample: int) -> tuple[jax.Array, jax.Array]:
    """``sample`` distinct row indices, uniformly among the valid rows first (all of them
    when there are at most ``sample``), and which of the picked rows are valid."""
    scores = jnp.where(valid, jax.random.uniform(key, valid.shape), 2.0)  # invalid ones last
    picked = jnp.argsort(scores)[:sample]
    return picked, valid[picked]


def output_regularizer(
    generate: Callable[[Any], Any],
    inputs: Any,
    stored: jax.Array,
    beta: float | jax.Array,
    *,
    where: jax.Array | None = None,
    importance: jax.Array | None = None,
    sample: int | None = None,
    key: jax.Array | None = None,
) -> jax.Array:
    """``beta`` · mean over the inputs of ``‖ravel(generate(input)) − stored row‖²``.

    Zero when nothing drifted, and when there are no earlier tasks (``n = 0``). Its gradient
    with respect to the generated vectors ``g`` is ``2 · beta · (g − stored) / n``: it pulls
    each earlier task's weights back to the stored ones.

    With ``where``, a boolean ``(n,)`` mask, only the rows where it is true count: the mean
    is over those rows (``2 · beta · (g − stored) / count`` for them, zero gradient for the
    others), and the value is zero when no row is. This keeps every shape fixed as tasks go
    by: store all ``num_tasks`` rows in the model's state, pass ``jnp.arange(num_tasks)``
    and ``where=jnp.arange(num_tasks) < t``, and one compiled training step serves every
    task (see the guide's continual-learning section).

    Args:
      generate: one input to generated params, e.g. ``hnet.generate`` of the model the
        ``loss_fn`` receives.
      inputs: the earlier tasks' inputs on a leading axis, as given to
        :func:`snapshot_generated`.
      stored: :func:`snapshot_generated`'s ``(n, spec.size)`` array.
      beta: the regularization strength (``>= 0``); von Oswald et al. use 0.01 to 0.1. A
        traced ``beta`` is checked for its shape only.
      where: optional boolean ``(n,)`` mask of the rows that count (may be traced).
      importance: optional ``(n, spec.size)`` non-negative weights per generated scalar
        (e.g. each earlier task's diagonal Fisher, :func:`fisher_diagonal`, raveled): row
        ``j`` counts ``Σ importance_j · (g_j − stored_j)²`` instead of the plain sum
        (hypnettorch's ``fisher_estimates``).
      sample: optional ``k``: regularize only ``k`` of the rows that count, drawn uniformly
        without replacement with ``key`` (all of them when at most ``k`` count), and
        generate only those ``k`` (hypnettorch's ``hnet_reg_batch_size``): the mean is over
        the drawn rows. Draw a new ``key`` every step.
      key: the PRNG key ``sample`` draws with.

    Returns:
      A scalar.

    Raises:
      TypeError: ``beta`` is not a real number, or ``where`` is not boolean.
      ValueError: ``stored`` does not have one row per input, ``beta`` is negative or not
        a scalar, or ``where`` does not have one entry per input.

    Example:
      >>> stored = hyper.snapshot_generated(hnet.generate, jnp.arange(t))
      >>> def loss_fn(hnet, batch):                   # training task t with a Trainer
      ...     ce = cross_entropy(hnet(t, batch["x"]), batch["y"])
      ...     return ce + hyper.output_regularizer(hnet.generate, jnp.arange(t), stored, 0.05)
    """
    _check_beta(beta)
    n = _count(inputs)
    if (sample is None) != (key is None):
        raise ValueError(
            "sample and key go together: sample=k regularizes k earlier tasks drawn with key "
            "(pass both), or neither for every task."
        )
    if sample is not None:
        sample = check_count(sample, "sample", 1)
    if jnp.ndim(stored) != 2 or jnp.shape(stored)[0] != n:
        raise ValueError(
            f"stored has shape {jnp.shape(stored)}, but {n} inputs need one row each: "
            f"({n}, spec.size). Take it with hyper.snapshot_generated(generate, inputs) "
            f"with the same inputs."
        )
    if where is not None:
        _check_where(where, n)
    if importance is not None and jnp.shape(importance) != jnp.shape(stored):
        raise ValueError(
            f"importance has shape {jnp.shape(importance)}, but it weighs each stored scalar: "
            f"it needs stored's shape {jnp.shape(stored)}."
        )
    if n == 0:
        return jnp.zeros((), jnp.result_type(stored))
    if sample is not None and sample < n:
        valid = jnp.ones(n, bool) if where is None else where
        picked, where = _sample_rows(key, valid, sample)
        inputs = jax.tree.map(lambda x: x[picked], inputs)
        stored = stored[picked]
        importance = None if importance is None else importance[picked]
    now = generated_vectors(generate, inputs)
    if now.shape != jnp.shape(stored):
        raise ValueError(
            f"generate gives vectors of length {now.shape[1]}, but stored rows have length "
            f"{jnp.shape(stored)[1]}: the snapshot comes from another hypernetwork or target."
        )
    squared = (now - stored) ** 2
    squared = jnp.sum(squared if importance is None else importance * squared, axis=-1)
    if where is None:
        return beta * jnp.mean(squared)
    # jnp.where, not a product: a masked-out row's gradient is exactly zero.
    count = jnp.sum(where)
    total = jnp.sum(jnp.where(where, squared, 0.0))
    return beta * total / jnp.maximum(count, 1).astype(total.dtype)


def fisher_diagonal(
    log_likelihood: Callable[[Any, Any], jax.Array], params: Any, examples: Any
) -> Any:
    """The diagonal of the empirical Fisher information: ``mean_i (∂ log p_i / ∂params)²``.

    ``log_likelihood(params, example)`` is one example's log-likelihood (e.g. the target's
    log-softmax at the label, run with :func:`~nnxscan.pure.hyper.call` on generated
    params); the squared gradient is taken example by example (``jax.vmap``) and averaged,
    as hypnettorch's and EWC's ``compute_fisher`` do with the given labels. Raveled and
    stacked per task, it is ``output_regularizer``'s ``importance``.

    Args:
      log_likelihood: ``(params, one example) -> scalar``.
      params: the pytree to differentiate (e.g. ``hnet.generate(t)``).
      examples: a pytree of arrays with a leading examples axis.

    Returns:
      A pytree like ``params``.

    Example:
      >>> def log_likelihood(params, example):
      ...     logits = hyper.call(spec, params, example["x"])
      ...     return jax.nn.log_softmax(logits)[example["y"]]
      >>> fisher = hyper.fisher_diagonal(log_likelihood, hnet.generate(t), task_data)
      >>> row = hyper.ravel(fisher)          # task t's row of importance
    """
    if not callable(log_likelihood):
        raise TypeError(f"log_likelihood must be callable, got {type(log_likelihood).__name__}.")
    _count(examples)
    grads = jax.vmap(jax.grad(log_likelihood), in_axes=(None, 0))(params, examples)
    return jax.tree.map(lambda g: jnp.mean(jnp.square(g), axis=0), grads)
