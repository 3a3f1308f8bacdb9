"""Convolutions in the dimension order XLA:CPU's fast kernels take, inside loop bodies too.

XLA:CPU runs a convolution with its fast (Eigen) kernels only when its operands are in one
canonical dimension order: the input batch first and features last, the kernel ``(spatial..., in,
out)``, the output batch first and features last. Its ``ConvCanonicalization`` pass puts
convolutions into that order, but it visits only a program's entry computation, never a
while-loop body. A forward ``nnx.Conv`` (NHWC input, HWIO kernel) is already canonical; the
weight- and input-gradient convolutions JAX's transpose rules emit are not (the weight
gradient's "batch" is the channel axis), so inside a ``lax.scan`` they fall back to XLA's
generic loop code, many times slower (jax#12868; docs/performance.md).

:func:`canonical_conv_dimensions` does the pass's rewrite before XLA sees the program: every
non-canonical ``conv_general_dilated`` of a traced function becomes transposes into the
canonical dimension order, the same convolution with canonical dimension numbers, and a transpose of
the result back to where the original dimension numbers put it, in nested jaxprs too.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.extend.core as jex
import numpy as np
from jax import lax

__all__ = ["canonical_conv_dimensions"]

F = TypeVar("F", bound=Callable[..., Any])


def canonical_conv_dimensions(fn: F) -> F:
    """Wraps ``fn`` so every convolution it computes runs in XLA:CPU's canonical dimension order.

    The returned function has ``fn``'s signature and computes the same values. Each call
    traces ``fn`` to a jaxpr and evaluates that jaxpr with every ``conv_general_dilated``
    that is not in the canonical dimension order (input batch-first and features-last, kernel
    ``(spatial..., in, out)``, output batch-first and features-last) rebound as: the two
    operands transposed into that order, the same convolution (strides, padding, lhs and rhs
    dilation, ``feature_group_count``, precision unchanged) with canonical dimension numbers,
    and the result transposed back to where the original dimension numbers put it. A
    convolution with ``batch_group_count`` > 1 (the weight gradient of a grouped one) is
    first rewritten as XLA:CPU rewrites it, with the groups as one more spatial dimension.

    This is what XLA:CPU's own passes do to a program's entry computation. Those passes
    skip while-loop bodies: inside ``lax.scan`` the weight- and input-gradient convolutions
    of a training step otherwise take XLA's generic code, many times slower (jax#12868);
    wrapped, they run the fast kernels of the per-step program.

    What it promises, on every CPU: the wrapped step computes the step's values to float
    rounding (a scan of it gives the per-step loop's results to rounding), and a program
    built from the wrapped step is one program like any other, so running it again -- or
    ``Trainer.fit``, which wraps its compiled calls the same way -- gives the same bits as a
    ``lax.scan`` of the wrapped step. Not bitwise equality with the unwrapped or per-step
    program: those are other programs, XLA:CPU picks its convolution kernels per CPU model
    (on CI's CPU the two agree bit for bit; on an AMD EPYC the nested convolutions'
    gradients differ by up to 1e-7), and it fuses the rest of a loop body on its own terms.

    What it rewrites: every convolution in ``fn``'s trace -- the forward ones and those of
    any ``jax.grad`` taken INSIDE ``fn`` (a step of :func:`make_train_step`), 1-D, 2-D and
    3-D, at any depth of nested jaxprs (``jax.jit``, ``lax.scan``/``while_loop``/``cond``
    bodies, ``jax.checkpoint``, ``custom_jvp``/``custom_vjp`` functions). A jaxpr with
    nothing to rewrite is left as it is (the same object).

    What it does not: convolutions that do not exist yet when ``fn`` is traced -- those a
    ``jax.grad``, ``jax.vjp`` or ``jax.vmap`` taken OUTSIDE the wrapper emits (wrap the
    outermost function: ``canonical_conv_dimensions(jax.grad(loss))``, not
    ``jax.grad(canonical_conv_dimensions(loss))``), and those of a ``custom_jvp`` rule or
    ``custom_vjp`` backward pass that only an outer transform runs; convolutions with an
    explicit ``out_sharding``. The rewrite follows XLA:CPU; on other backends the results
    are the same but no faster.

    It is a pure function transform: it works under ``jax.jit``, ``jax.vmap``, ``jax.grad``
    and inside ``lax.scan``. Each call traces ``fn``, so call it under ``jax.jit`` -- or wrap
    a ``jax.jit``-ed ``fn``, whose trace jit caches: the wrapper then costs no second trace.
    Array leaves of the arguments are traced; other leaves (an ``nnx.GraphDef``, Python
    numbers, strings) are passed to ``fn`` as static values. Outputs are pytrees of arrays.

    Args:
      fn: the function to wrap, e.g. a training step ``step(graphdef, state, opt_state,
        batch)``.

    Returns:
      A function with ``fn``'s signature and results.

    Example:
      >>> step = canonical_conv_dimensions(make_train_step(loss_fn, tx))
      >>> state, opt_state, losses = jax.jit(scan_steps, static_argnums=0)(
      ...     step, graphdef, state, opt_state, batches)
    """
    if not callable(fn):
        raise TypeError(f"canonical_conv_dimensions takes a function, got {type(fn).__name__}.")
    return _rewriting(fn, _conv_rule)  # type: ignore[return-value]


def _canonical_specs(num_spatial: int) -> lax.ConvDimensionNumbers:
    """Batch first and features last on the input and output, kernel (spatial..., in, out)."""
    spatial = tuple(range(1, num_spatial + 1))
    features = num_spatial + 1
    return lax.ConvDimensionNumbers(
        lhs_spec=(0, features, *spatial),
        rhs_spec=(num_spatial + 1, num_spatial, *range(num_spatial)),
        out_spec=(0, features, *spatial),
    )


def _needs_rewrite(eqn: Any) -> bool:
    params = eqn.params
    if params.get("out_sharding") is not None:
        return False  # its sharding names the original order's axes
    numbers = params["dimension_numbers"]
    lhs_shape, rhs_shape = (v.aval.shape for v in eqn.invars)
    return numbers != _canonical_specs(len(lhs_shape) - 2) or _expands_batch_groups(
        params["batch_group_count"], lhs_shape[numbers.lhs_spec[0]], rhs_shape[numbers.rhs_spec[0]]
    )


def _expands_batch_groups(groups: int, batch: int, out_features: int) -> bool:
    """Whether XLA:CPU turns this batch-grouped convolution into one with an extra spatial
    dimension (it masks the filter instead when the batch and the output features both have
    size ``groups``)."""
    return groups > 1 and not (batch == groups and out_features == groups)


def _conv_in_canonical_order(lhs: jax.Array, rhs: jax.Array, *, params: dict) -> jax.Array:
    """The convolution ``params`` describes, computed as XLA:CPU computes it in an entry
    computation: batch groups expanded first, then every operand in the canonical dimension
    order."""
    numbers = params["dimension_numbers"]
    out_shape = None
    if _expands_batch_groups(
        params["batch_group_count"], lhs.shape[numbers.lhs_spec[0]], rhs.shape[numbers.rhs_spec[0]]
    ):
        out_shape = _conv_shape(lhs, rhs, params)
        lhs, rhs, params = _batch_groups_as_spatial(lhs, rhs, params)
        numbers = params["dimension_numbers"]
    num_spatial = len(numbers.lhs_spec) - 2
    # Spatial dimensions keep their dimension-number order, so strides, padding and
    # dilations (given per spatial dimension in that order) apply unchanged.
    lhs = lax.transpose(lhs, (numbers.lhs_spec[0], *numbers.lhs_spec[2:], numbers.lhs_spec[1]))
    rhs = lax.transpose(rhs, (*numbers.rhs_spec[2:], numbers.rhs_spec[1], numbers.rhs_spec[0]))
    out = lax.conv_general_dilated_p.bind(
        lhs, rhs, **{**params, "dimension_numbers": _canonical_specs(num_spatial)}
    )
    # out is (batch, spatial..., features): the axes out_spec puts at these places.
    placed = (numbers.out_spec[0], *numbers.out_spec[2:], numbers.out_spec[1])
    out = lax.transpose(out, tuple(int(i) for i in np.argsort(placed)))
    return out if out_shape is None else out.reshape(out_shape)


def _conv_shape(lhs: jax.Array, rhs: jax.Array, params: dict) -> tuple[int, ...]:
    return jax.eval_shape(
        lambda a, b: lax.conv_general_dilated_p.bind(a, b, **params), lhs, rhs
    ).shape


def _batch_groups_as_spatial(lhs: jax.Array, rhs: jax.Array, params: dict):
    """XLA's ``ConvolutionGroupConverter`` rewrite of a batch-grouped convolution, step for
    step: the G batch groups of the input and the G output-feature groups of the kernel
    become one more spatial dimension (the last), which a window of size G, stride G-1 and
    input dilation G walks so that input group g meets kernel group g only (every other
    product meets a dilation zero). XLA does this before it canonicalizes layouts, so in a
    loop body the convolution it builds is never canonicalized; building it here lets the
    canonical rewrite reach it. Returns the new operands and parameters; the result has the
    output groups as its spatial dimension and reshapes to the original result."""
    numbers = params["dimension_numbers"]
    groups = params["batch_group_count"]

    def split(x, axis):  # (..., n, ...) -> (..., G, n/G, ...) at ``axis``
        return x.reshape(*x.shape[:axis], groups, x.shape[axis] // groups, *x.shape[axis + 1 :])

    def shifted(dims, at):  # dimension indices after a new axis is inserted at ``at``
        return tuple(d + 1 if d > at else d for d in dims)

    b, f, *lhs_spatial = numbers.lhs_spec
    o, i, *rhs_spatial = numbers.rhs_spec
    ob, of, *out_spatial = numbers.out_spec
    lhs_spec = (b + 1, f + 1 if f > b else f, *shifted(lhs_spatial, b), b)
    rhs_spec = (o + 1, i + 1 if i > o else i, *shifted(rhs_spatial, o), o)
    out_spec = (ob + 1 if ob > of else ob, of + 1, *shifted(out_spatial, of), of)
    params = {
        **params,
        "window_strides": (*params["window_strides"], groups - 1),
        "padding": (*params["padding"], (0, 0)),
        "lhs_dilation": (*params["lhs_dilation"], groups),
        "rhs_dilation": (*params["rhs_dilation"], 1),
        "batch_group_count": 1,
        "dimension_numbers": lax.ConvDimensionNumbers(lhs_spec, rhs_spec, out_spec),
    }
    return split(lhs, b), split(rhs, o), params


def _conv_rule(eqn: Any) -> list[Any] | None:
    """A non-canonical convolution's replacement: the same convolution in the canonical
    dimension order, between transposes."""
    if eqn.primitive is not lax.conv_general_dilated_p or not _needs_rewrite(eqn):
        return None
    return _traced_eqns(eqn, functools.partial(_conv_in_canonical_order, params=eqn.params))


# -- the rewrite of a traced function's equations, shared with pure/threefry.py ----------------
# A function wrapped by ``_rewriting(fn, rule)`` traces ``fn`` to a jaxpr, replaces each
# equation ``rule(eqn)`` returns replacements for (None keeps it), at any depth of nested
# jaxprs (``jax.jit``, ``lax.scan``/``while_loop``/``cond`` bodies, ``jax.checkpoint``,
# ``custom_jvp``/``custom_vjp`` functions), and evaluates the result.

# Leaves traced as the wrapped function's inputs; anything else (a GraphDef, a Python
# number, a string) is passed through as a static value, as jax.jit's static arguments are.
_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
# Rewritten jaxprs a wrapped function keeps, so the trace jax.jit caches for a jitted ``fn``
# maps to one rewritten jaxpr (and one compiled program when called outside jit).
_KEPT_REWRITES = 64

#: ``rule(eqn)``: the equations that replace ``eqn`` (reading its inputs, writing its
#: outputs), or None to keep it.
_Rule = Callable[[Any], "list[Any] | None"]


def _rewriting(fn: Callable, rule: _Rule, *, nested: bool = False) -> Callable:
    """``fn``, traced and evaluated with ``rule`` applied to every equation of its jaxpr.

    With ``nested``, ``fn`` is traced under a ``jax.jit`` of its own, so that evaluating the
    result binds one equation (the call, with the rewritten jaxpr in it) instead of every
    equation again: a step wrapped on every call is traced once per call, and binding its
    whole jaxpr each time would redo the rewrite's work. XLA inlines the call.
    """
    kept: OrderedDict[int, tuple[Any, Any]] = OrderedDict()

    @functools.wraps(fn)
    def rewritten(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((args, kwargs))
        traced = [isinstance(x, _ARRAY_TYPES) for x in leaves]
        dynamic = [x for x, t in zip(leaves, traced, strict=True) if t]

        def flat_fn(*values):
            values = iter(values)
            full = [next(values) if t else x for x, t in zip(leaves, traced, strict=True)]
            call_args, call_kwargs = jax.tree.unflatten(treedef, full)
            return fn(*call_args, **call_kwargs)

        traced_fn = jax.jit(flat_fn) if nested else flat_fn
        closed, out_shapes = jax.make_jaxpr(traced_fn, return_shape=True)(*dynamic)
        memo = _Memo(kept, rule)
        top = closed
        closed = memo.closed(closed)
        if not nested:  # nested: the jaxprs under the fresh jit are new on every call
            memo.keep_nested(skip=(top, top.jaxpr))
        outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *dynamic)
        return jax.tree.unflatten(jax.tree.structure(out_shapes), outs)

    return rewritten


def _traced_eqns(eqn: Any, fn: Callable[..., Any]) -> list[Any] | None:
    """The equations of ``fn`` traced on ``eqn``'s input types, reading ``eqn``'s inputs
    and writing its outputs: what replaces ``eqn`` when ``fn`` computes the same. None
    where ``fn``'s trace cannot be spliced in (it closes over array constants, or passes an
    input or a constant straight through to an output)."""
    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
             for v in eqn.invars]  # fmt: skip
    closed = jax.make_jaxpr(fn)(*specs)
    small = closed.jaxpr
    produced = {v for e in small.eqns for v in e.outvars}
    if closed.consts or not all(v in produced for v in small.outvars):
        return None
    renamed = dict(zip(small.invars, eqn.invars, strict=True))
    renamed.update(zip(small.outvars, eqn.outvars, strict=True))
    return [
        e.replace(
            invars=[renamed.get(v, v) if isinstance(v, jex.Var) else v for v in e.invars],
            outvars=[renamed.get(v, v) for v in e.outvars],
            source_info=eqn.source_info,
            ctx=eqn.ctx,
        )
        for e in small.eqns
    ]


class _Memo:
    """Rewritten jaxprs by ``id`` of the original (held, so the id stays valid): the ones of
    this call, and the last few nested ones of earlier calls (``kept``). Through it a jaxpr
    shared by many equations (one jitted function called twice) is rewritten once."""

    def __init__(self, kept: OrderedDict, rule: _Rule):
        self.kept, self.now, self.rule = kept, {}, rule

    def get(self, jaxpr: Any) -> Any:
        hit = self.now.get(id(jaxpr)) or self.kept.get(id(jaxpr))
        return None if hit is None else hit[1]

    def put(self, jaxpr: Any, result: Any) -> None:
        self.now[id(jaxpr)] = (jaxpr, result)

    def keep_nested(self, skip: tuple) -> None:
        """Keeps the jaxprs nested in this call's top-level one (``skip``, new on every
        call): those are what jit caches and hands out again."""
        skipped = {id(x) for x in skip}
        for key, entry in self.now.items():
            if key in skipped or entry[0] is entry[1]:
                continue  # new every call, or left alone (cheap to find so again)
            self.kept[key] = entry
            self.kept.move_to_end(key)
        while len(self.kept) > _KEPT_REWRITES:
            self.kept.popitem(last=False)

    def closed(self, closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
        hit = self.get(closed)
        if hit is not None:
            return hit
        jaxpr = self.jaxpr(closed.jaxpr)
        result = closed if jaxpr is closed.jaxpr else jex.ClosedJaxpr(jaxpr, closed.consts)
        self.put(closed, result)
        return result

    def param(self, value: Any) -> Any:
        if isinstance(value, jex.ClosedJaxpr):
            return self.closed(value)
        if isinstance(value, jex.Jaxpr):
            return self.jaxpr(value)
        if isinstance(value, tuple | list) and any(
            isinstance(v, jex.ClosedJaxpr | jex.Jaxpr) for v in value
        ):
            new = type(value)(self.param(v) for v in value)
            return value if all(a is b for a, b in zip(new, value, strict=True)) else new
        return value

    def jaxpr(self, jaxpr: jex.Jaxpr) -> jex.Jaxpr:
        """``jaxpr`` with the rule applied; ``jaxpr`` itself when nothing changed."""
        hit = self.get(jaxpr)
        if hit is not None:
            return hit
        eqns, changed = [], False
        for eqn in jaxpr.eqns:
            replacement = self.rule(eqn)
            if replacement is not None:
                eqns += replacement
                changed = True
                continue
            params = {k: self.param(v) for k, v in eqn.params.items()}
            if any(params[k] is not v for k, v in eqn.params.items()):
                eqn = eqn.replace(params=params)
                changed = True
            eqns.append(eqn)
        result = jaxpr.replace(eqns=eqns) if changed else jaxpr
        self.put(jaxpr, result)
        return result
