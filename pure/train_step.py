"""The pure training step: ``step(graphdef, state, opt_state, batch)``.

``state`` is the whole ``nnx.split(model)`` state. Only the ``wrt`` part is differentiated and
updated by the optax transform; every other variable the forward pass changes (batch
statistics, RNG counts, user variables) is carried forward, so a scanned loop behaves exactly
like the plain per-step NNX loop.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nnxscan.pure import _host_init, checks
from nnxscan.pure.nonfinite import all_finite, tree_select
from nnxscan.pure.step import Step
from nnxscan.pure.step_node import call_loss, unpack_step_node
from nnxscan.pure.threefry import _unrolled_on_cpu

__all__ = ["init_opt_state", "make_train_step", "split_wrt"]

LossFn = Callable[[nnx.Module, Any], Any]
StepFn = Callable[[nnx.GraphDef, nnx.State, Any, Any], tuple[nnx.State, Any, Any]]


def split_wrt(state: nnx.State, wrt: nnx.filterlib.Filter) -> tuple[nnx.State, nnx.State]:
    """Splits a whole module state into ``(params, rest)`` by the ``wrt`` filter.

    Raises ValueError when ``wrt`` selects no variable at all: a step would then train
    nothing, which is never what the caller meant.

    Example:
      >>> params, rest = split_wrt(nnx.state(model), nnx.Param)
    """
    if isinstance(state, tuple | list):
        # The pieces of nnx.split(model, filter_a, filter_b, ...): Flax's own error, deep
        # in its state code, names neither the argument nor the fix.
        raise TypeError(
            f"state must be one nnx.State (the module's whole state), got a "
            f"{type(state).__name__} of {len(state)} pieces, as nnx.split(model, filter, "
            f"...) returns them: merge them with nnx.merge_state(*pieces) (and split with "
            f"one graphdef), or use nnx.split(model) / nnx.state(model)."
        )
    params, rest = nnx.split_state(state, wrt, ...)
    if not jax.tree.leaves(params):
        raise ValueError(
            f"wrt={wrt!r} selects no variable of the model, so there is nothing to train. "
            f"Variable types present: {sorted(_variable_types(state))}."
        )
    return params, rest


def _variable_types(state: nnx.State) -> set[str]:
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return {type(v).__name__ for v in leaves}


def init_opt_state(
    tx: optax.GradientTransformation, state: nnx.State, wrt: nnx.filterlib.Filter = nnx.Param
) -> Any:
    """Initializes the optax state for the ``wrt`` part of a whole module state.

    ``tx.init(params)``, with the same values, dtypes and placement; where every leaf it
    makes is a constant (Adam's zeros and count, SGD's momentum) and the params sit
    uncommitted on the CPU, those leaves are made on the host instead of compiling a small
    program per shape.

    Example:
      >>> graphdef, state = nnx.split(model)
      >>> opt_state = init_opt_state(optax.adam(1e-3), state)
    """
    tx = checks.check_transform(tx)
    params, _ = split_wrt(state, wrt)
    return _host_init.initial_state(tx.init, params)


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    wrt: nnx.filterlib.Filter = nnx.Param,
    has_aux: bool = False,
    skip_nonfinite: bool = False,
    accumulate: int = 1,
    with_rngs: bool = False,
    update_metrics: Callable[[Any, Any, Any, Any], Any] | None = None,
) -> Step:
    """Builds the pure training step of a loss for an NNX model, as a :class:`Step`.

    Args:
      loss_fn: ``loss_fn(model, batch)`` returning a scalar loss, or ``(loss, aux)`` with
        ``has_aux=True``; ``loss_fn(model, batch, rngs)`` with ``with_rngs``. ``model`` is
        a live NNX module merged inside the traced function.
      tx: the optax transform that updates the ``wrt`` variables.
      wrt: an NNX filter choosing the variables to differentiate and update.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      skip_nonfinite: when the loss or a gradient is not finite, leave the params, the
        optax state and the other variables (batch statistics...) as they were, advance
        only the RNG state, and report the step's loss as NaN. A ``jnp.where`` select:
        no host sync.
      accumulate: split each batch into this many micro-batches (the leading size must
        divide), scan over them and apply their averaged gradient once: the memory of one
        micro-batch. Non-``wrt`` variables (batch statistics, RNG counts) advance once per
        micro-batch, and aux leaves are averaged over micro-batches. With
        ``skip_nonfinite``, a non-finite micro-batch is dropped from the average (the step
        is skipped only when all are), so one bad micro-batch never poisons later steps
        (unlike ``optax.MultiSteps(optax.apply_if_finite(...))``, whose accumulator keeps
        the NaN).
      with_rngs: the loss takes call-time ``nnx.Rngs`` as its third argument, as in Flax's
        MNIST tutorial. The Rngs travel in the state: split ``(model, rngs)``. Its counts
        advance every step exactly as in the plain loop that passes ``rngs`` to each step.
      update_metrics: ``update_metrics(metrics, loss, aux, batch)`` updates NNX metrics
        (an ``nnx.Metric`` or ``nnx.MultiMetric``) inside the step, with the loss and aux
        of the step (gradients stopped). The metrics travel in the state: split
        ``(model, metrics)`` or ``(model, rngs, metrics)``. A skipped (non-finite) step
        leaves them as they were; with ``accumulate`` they are updated per micro-batch.

    optax transforms that take extra arguments in ``update``
    (``optax.GradientTransformationExtraArgs``: ``optax.lbfgs()``, the linesearches,
    ``optax.contrib.reduce_on_plateau``, ``optax.contrib.sam``) get those of ``value=``
    (this batch's loss), ``grad=`` (its gradient), ``value_fn=`` (``value_fn(params)``: the
    loss of given ``wrt`` parameters on this batch) and ``grad_fn=`` (``grad_fn(params, i)``:
    its gradient there, what SAM's opaque mode calls; ``i`` is ignored) that their ``update``
    names, or all four when it takes ``**extra_args``, as optax's own loops pass them.
    ``value_fn`` and ``grad_fn`` see the other variables (batch statistics, RNG counts) as
    they were before the step, and change none of them. A transform whose ``update`` needs
    any other argument raises a TypeError naming it here, before anything is traced (one
    needed inside an ``optax.chain``, whose ``update`` takes ``**extra_args``, while tracing).

    Returns:
      A :class:`Step`: ``step.init(graphdef, state)`` is :func:`init_opt_state`, and
      ``step(graphdef, state, opt_state, batch) -> (state, opt_state, loss)``, or with
      ``has_aux=True`` ``-> (state, opt_state, (loss, aux))``. It is pure: jit, scan, vmap
      (over stacked states) and fori_loop all apply.

    Example:
      >>> step = make_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), tx)
      >>> graphdef, state = nnx.split(model)
      >>> opt_state = init_opt_state(tx, state)
      >>> state, opt_state, loss = jax.jit(step.update)(graphdef, state, opt_state, batch)

      With call-time Rngs and metrics (the Flax NNX MNIST tutorial's loss and MultiMetric):

      >>> step = make_train_step(loss_fn, tx, has_aux=True, with_rngs=True,
      ...     update_metrics=lambda m, loss, logits, b: m.update(
      ...         loss=loss, logits=logits, labels=b["label"]))
      >>> graphdef, state = nnx.split((model, rngs, metrics))
    """
    tx = checks.check_transform(tx)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    accumulate = checks.check_count(accumulate, "accumulate", 1)
    if update_metrics is not None and not callable(update_metrics):
        raise TypeError(f"update_metrics must be callable, got {type(update_metrics).__name__}.")
    checks.check_no_captured_nnx(loss_fn, "loss_fn")
    extra_args = _update_extra_args(tx)  # read once: the signature is the same every step

    def value_and_grad(graphdef, params, rest, batch):
        def forward(params):
            # copy=True: merging without a copy breaks Dropout under grad outside jit
            # (flax#5050), and copying is free under jit.
            node = nnx.merge(graphdef, params, rest, copy=True)
            parts = unpack_step_node(
                node, with_rngs=with_rngs, with_metrics=update_metrics is not None
            )
            loss, aux = call_loss(loss_fn, parts, batch, has_aux)
            if update_metrics is not None:
                stopped = jax.lax.stop_gradient((loss, aux))
                update_metrics(parts.metrics, *stopped, batch)
            # The whole state after the forward pass carries the moved batch statistics,
            # advanced RNG counts and updated metrics back out of the trace.
            return loss, (aux, nnx.state(node))

        (loss, (aux, new_state)), grads = jax.value_and_grad(forward, has_aux=True)(params)
        _, new_rest = nnx.split_state(new_state, wrt, ...)
        _check_same_structure(rest, new_rest)
        return loss, aux, grads, new_rest

    def loss_of(graphdef, rest, params, batch):
        """The loss of given params on a batch (what linesearches and SAM evaluate)."""
        node = nnx.merge(graphdef, params, rest, copy=True)
        parts = unpack_step_node(node, with_rngs=with_rngs, with_metrics=update_metrics is not None)
        return call_loss(loss_fn, parts, batch, has_aux)[0]

    def value_fn_of(graphdef, rest, batch):
        """``value_fn(params)``: the batch's loss (the micro-batches' mean)."""
        if accumulate == 1:
            return lambda params: loss_of(graphdef, rest, params, batch)
        micro = _micro_batches(batch, accumulate)
        return lambda params: jnp.mean(
            jax.lax.map(lambda b: loss_of(graphdef, rest, params, b), micro)
        )

    def grad_fn_of(graphdef, rest, batch):
        """``grad_fn(params, i)``: the batch loss's gradient at given params (SAM's opaque
        mode); one micro-batch at a time with ``accumulate``, as the step's own gradient."""
        grad = jax.grad(loss_of, argnums=2)
        if accumulate == 1:
            return lambda params, _=None: grad(graphdef, rest, params, batch)
        micro = _micro_batches(batch, accumulate)

        def grad_fn(params, _=None):
            grads = jax.lax.map(lambda b: grad(graphdef, rest, params, b), micro)
            return jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)

        return grad_fn

    def accumulated(graphdef, params, rest, batch):
        micro = _micro_batches(batch, accumulate)

        def body(carry, mb):
            rest, grad_sum, loss_sum, kept = carry
            loss, aux, grads, new_rest = value_and_grad(graphdef, params, rest, mb)
            ok = all_finite(loss, grads) if skip_nonfinite else jnp.bool_(True)
            zero = jax.tree.map(jnp.zeros_like, grads)
            grad_sum = jax.tree.map(jnp.add, grad_sum, tree_select(ok, grads, zero))
            loss_sum = loss_sum + jnp.where(ok, loss, 0.0)
            new_rest = _keep_unless(ok, rest, new_rest) if skip_nonfinite else new_rest
            return (new_rest, grad_sum, loss_sum, kept + ok), aux

        zeros = jax.tree.map(jnp.zeros_like, params)
        start = (rest, zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        (new_rest, grad_sum, loss_sum, kept), auxs = jax.lax.scan(body, start, micro)
        denominator = jnp.maximum(kept, 1).astype(jnp.float32)
        grads = jax.tree.map(lambda g: (g / denominator).astype(g.dtype), grad_sum)
        loss = jnp.where(kept > 0, loss_sum / denominator, jnp.nan)
        aux = None if auxs is None else jax.tree.map(_mean_over_micro_batches, auxs)
        return loss, aux, grads, new_rest

    def step(graphdef, state, opt_state, batch):
        params, rest = split_wrt(state, wrt)
        if accumulate == 1:
            loss, aux, grads, new_rest = value_and_grad(graphdef, params, rest, batch)
        else:
            loss, aux, grads, new_rest = accumulated(graphdef, params, rest, batch)
        if extra_args:
            offered = {
                "value": lambda: loss,
                "grad": lambda: grads,
                "value_fn": lambda: value_fn_of(graphdef, rest, batch),
                "grad_fn": lambda: grad_fn_of(graphdef, rest, batch),
            }
            extra = {name: offered[name]() for name in extra_args}
            updates, new_opt_state = _update_with_extra_args(tx, grads, opt_state, params, **extra)
        else:
            updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if skip_nonfinite:
            ok = all_finite(loss, grads)
            new_params = tree_select(ok, new_params, params)
            new_opt_state = tree_select(ok, new_opt_state, opt_state)
            new_rest = _keep_unless(ok, rest, new_rest)
            loss = jnp.where(ok, loss, jnp.nan)
        state = nnx.merge_state(new_params, new_rest)
        return state, new_opt_state, ((loss, aux) if has_aux else loss)

    step.__doc__ = f"Pure training step of {getattr(loss_fn, '__name__', 'loss_fn')}."
    # Its draws (dropout, noise) through JAX's threefry hash unrolled on the CPU: the same
    # bits, compiled in a fraction of the time of JAX's CPU loop of it (pure/threefry.py).
    step = _unrolled_on_cpu(step)
    return Step(lambda graphdef, state: init_opt_state(tx, state, wrt), step, has_aux)


# What the built-in step can give a transform's update besides (updates, state, params).
_EXTRA_ARGS = ("value", "grad", "value_fn", "grad_fn")


def _update_extra_args(tx: optax.GradientTransformation) -> tuple[str, ...]:
    """The extra arguments of :data:`_EXTRA_ARGS` that ``tx.update`` takes: all of them when
    it takes ``**extra_args``, the ones it names otherwise, none for a plain
    ``GradientTransformation`` (``optax.MultiSteps``' among them).

    Raises TypeError, naming the argument, when ``update`` requires one the step cannot
    give: better now than mid-trace.
    """
    if not isinstance(tx, optax.GradientTransformationExtraArgs):
        return ()
    try:
        parameters = list(inspect.signature(tx.update).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): offer them all
        return _EXTRA_ARGS
    kind = inspect.Parameter
    positional = [
        p for p in parameters if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)
    ]
    # update(updates, state, params, ...): the arguments after the first three.
    extra = positional[3:] + [p for p in parameters if p.kind is kind.KEYWORD_ONLY]
    needed = [
        p.name
        for p in extra
        if p.default is p.empty and (p.name not in _EXTRA_ARGS or p.kind is kind.POSITIONAL_ONLY)
    ]
    if needed:
        listed = ", ".join(f"{name}=" for name in needed)
        raise TypeError(
            f"the optax transform's update requires {listed} "
            f"({'an argument' if len(needed) == 1 else 'arguments'} the built-in step cannot "
            f"give: it gives value= the batch's loss, grad= its gradient, value_fn(params) "
            f"the loss of given params on the batch and grad_fn(params, i) their gradient). "
            f"Write your own nnxscan.pure.Step whose update calls tx.update with "
            f"{'it' if len(needed) == 1 else 'them'}."
        )
    if any(p.kind is kind.VAR_KEYWORD for p in parameters):
        return _EXTRA_ARGS
    names = {p.name for p in extra if p.kind is not kind.POSITIONAL_ONLY}
    return tuple(name for name in _EXTRA_ARGS if name in names)


def _update_with_extra_args(tx: Any, grads: Any, opt_state: Any, params: Any, **extra: Any):
    """``tx.update`` with optax's extra arguments.

    A transform that takes ``**extra_args`` hands them to the transforms it holds
    (``optax.chain``) or to its ``value_fn`` (the linesearches, which refuse any they can't
    place), and no signature says which it can take. One refused by name in a TypeError
    (``optax.contrib.sam`` takes ``grad_fn`` only; ``optax.lbfgs()``'s linesearch takes
    all but ``grad_fn``) is dropped and the update traced again, as optax's own loops pass
    each transform only what it needs. Tracing is pure: a refused attempt leaves nothing
    behind. An argument still missing raises a TypeError that says what the step passes.
    """
    while True:
        try:
            return tx.update(grads, opt_state, params, **extra)
        except TypeError as error:
            refused = next((name for name in extra if _refuses(error, name)), None)
            if refused is not None:
                extra = {k: v for k, v in extra.items() if k != refused}
                continue
            if "argument" not in str(error):
                raise
            raise TypeError(
                f"the optax transform's update failed on the extra arguments the built-in "
                f"step passes it (value= the batch's loss, grad= its gradient, "
                f"value_fn(params) the loss of given params on the batch, grad_fn(params, i) "
                f"their gradient): {error} For other arguments, write your own "
                f"nnxscan.pure.Step whose update calls tx.update with them."
            ) from None


def _refuses(error: TypeError, name: str) -> bool:
    """Whether a TypeError refuses the argument ``name``: CPython's "got an unexpected
    keyword argument 'name'", optax's linesearch "not consumed by `value_fn`: ['name']"."""
    return any(one == name or f"'{name}'" in listed for one, listed in _REFUSED.findall(str(error)))


_REFUSED = re.compile(r"unexpected keyword argument '(\w+)'|not consumed by `\w+`: (\[[^\]]*\])")


def _keep_unless(ok: jax.Array, old: nnx.State, new: nnx.State) -> nnx.State:
    """``new`` where ``ok``, else ``old``; RNG state always advances (new masks next step)."""
    _, old_other = nnx.split_state(old, nnx.RngState, ...)
    new_rng, new_other = nnx.split_state(new, nnx.RngState, ...)
    return nnx.merge_state(new_rng, tree_select(ok, new_other, old_other))


def _micro_batches(batch: Any, n: int) -> Any:
    def cut(path, x):
        size = jnp.shape(x)[0] if jnp.ndim(x) else None
        if size is None or size % n:
            raise ValueError(
                f"accumulate={n} needs every batch leaf's leading size to divide by {n}, "
                f"but {jax.tree_util.keystr(path)} has shape {jnp.shape(x)}. Use a batch "
                f"size that is a multiple of {n}."
            )
        return x.reshape(n, size // n, *x.shape[1:])

    return jax.tree_util.tree_map_with_path(cut, batch)


def _mean_over_micro_batches(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.mean(x, axis=0)
    return x[-1]


def _check_same_structure(before: nnx.State, after: nnx.State) -> None:
    """The state a step returns must have the structure it received (the same variables,
    each of the same shape and dtype): a scan carries it."""
    old = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(before)}
    new = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(after)}
    added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
    if added or removed:
        raise ValueError(
            f"the forward pass changed the model's variables (added: {added or 'none'}, "
            f"removed: {removed or 'none'}), so its state can't be carried from step to step. "
            f"Variables created in __call__ (e.g. self.sow(nnx.Intermediate, ...)) must be "
            f"removed in loss_fn, e.g. with nnx.pop(model, nnx.Intermediate), and returned "
            f"as aux if you need them."
        )
    for key, x in old.items():
        y = new[key]
        if jnp.shape(x) != jnp.shape(y) or jnp.result_type(x) != jnp.result_type(y):
            raise ValueError(
                f"the forward pass changed variable {key} from {jnp.shape(x)} "
                f"{jnp.result_type(x)} to {jnp.shape(y)} {jnp.result_type(y)}; a scanned "
                f"state must keep its shapes and dtypes."
            )
