"""optax's SAM (``optax.contrib.sam``), transparent and opaque, through the built-in step.

The reference is optax's own SAM notebook's experiment (``sam_notebook.py``: its settings
and its plain optax loop, written from its description) on fewer steps: its per-step loop
of jitted steps, and the same step under one ``lax.scan`` (what nnxscan's paths are: a scan
of steps). The notebook's problem is two scalars and elementwise arithmetic, so the scanned
paths equal the scanned notebook loop bitwise; against the per-step loop (another program:
XLA may fuse and order a step's floats otherwise inside a loop body) the comparison is to
rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import sam_notebook
from flax import nnx
from optax import contrib

from nnxscan.pure import make_train_step, scan_steps
from nnxscan.shell import Trainer, scan_train

from conftest import assert_trees_close

STEPS = 40  # the notebook runs 8000 (4000 opaque); sync periods 2 and 5 divide 40
MODES = ("transparent", "opaque")


class Point(nnx.Module):
    """The notebook's parameters ``(x, y)`` as an NNX module's one Param."""

    def __init__(self, params):
        self.xy = nnx.Param(jnp.asarray(params))


@pytest.fixture(scope="module", params=MODES)
def notebook(request):
    """The notebook's namespace after its loop, with the references nnxscan is held to."""
    ns = sam_notebook.run(request.param, STEPS)
    ns["mode"] = request.param
    ns["loss_fn"] = lambda model, batch: ns["loss"](model.xy[...])  # the batch is a dummy
    return ns


def scanned_notebook(ns, name):
    """The notebook's own jitted step for ``name`` ("sam", "sam_mom", "sam_adam"), run by one
    ``lax.scan`` from the notebook's first store: ``(last store, values, params)``."""
    store = ns["Store"](params=ns["params"], state=ns[f"{name}_opt"].init(ns["params"]))

    def body(store, _):
        store, value = ns[f"{name}_step"](store)
        return store, (value, store.params)

    store, (values, params) = jax.jit(lambda store: jax.lax.scan(body, store, None, length=STEPS))(
        store
    )
    return store, values, params


def per_step_notebook(ns, name):
    """The notebook loop's lists: values (loss before each step) and params after each."""
    return np.array(ns[f"{name}_vals"]), np.array(ns[f"{name}_params"])


@pytest.mark.parametrize(
    "name", ["sam", pytest.param("sam_mom", marks=pytest.mark.slow), "sam_adam"]
)
def test_make_train_step_scan_steps_equal_the_notebook_loop(notebook, name):
    opt = notebook[f"{name}_opt"]
    step = make_train_step(notebook["loss_fn"], opt)
    graphdef, state = nnx.split(Point(notebook["params"]))
    state, opt_state, losses = jax.jit(scan_steps, static_argnums=0)(
        step, graphdef, state, step.init(graphdef, state), jnp.zeros((STEPS, 1))
    )

    store, values, params = scanned_notebook(notebook, name)
    np.testing.assert_array_equal(losses, values)
    np.testing.assert_array_equal(state["xy"][...], params[-1])
    assert_trees_close(opt_state, store.state, exact=True)  # SAMState: cache, counters, moments

    per_step_values, per_step_params = per_step_notebook(notebook, name)
    np.testing.assert_allclose(losses, per_step_values, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state["xy"][...], per_step_params[-1], rtol=1e-6, atol=1e-7)
    # SAM really ran: plain SGD from the same start takes another path.
    assert not np.allclose(per_step_params[-1], notebook["sgd_params"][-1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["sam", pytest.param("sam_adam", marks=pytest.mark.slow)])
def test_trainer_and_scan_train_equal_the_notebook_loop(notebook, name):
    opt = notebook[f"{name}_opt"]
    store, values, params = scanned_notebook(notebook, name)

    # Trainer(model, sam_opt, loss_fn), the notebook's loop having no data.
    model = Point(notebook["params"])
    trainer = Trainer(model, opt, notebook["loss_fn"])
    trainer.fit(None, epochs=1, steps_per_epoch=STEPS, progress=False)
    np.testing.assert_array_equal(model.xy[...], params[-1])
    assert_trees_close(trainer.opt_state, store.state, exact=True)

    # scan_train with an nnx.Optimizer, and with an nnx.ModelAndOptimizer.
    for optimizer_type in (nnx.Optimizer, nnx.ModelAndOptimizer):
        model = Point(notebook["params"])
        optimizer = optimizer_type(model, opt, wrt=nnx.Param)
        losses = scan_train(model, optimizer, notebook["loss_fn"], jnp.zeros((STEPS, 1)))
        np.testing.assert_array_equal(losses, values)
        np.testing.assert_array_equal(model.xy[...], params[-1])
        assert int(optimizer.step[...]) == STEPS


# -- a loss of the batch: grad_fn is the gradient of THIS batch's loss ------------------------


def _shifted_loss(params, batch):
    """The notebook's loss, its minima moved by each example's shift, averaged over the batch."""
    x, y = params[0] - batch[:, 0], params[1] - batch[:, 1]
    return jnp.mean(-jnp.exp(-((x - 2) ** 2) - y**2) - jnp.exp(-(x**2 + y**2 * 100)))


def _notebook_loop_with_batches(opt, params, batches, grad_fn_batches=None):
    """The notebook's opaque-mode step (cell 29) with a batch, as its cell 21 writes it:
    ``grad_fn = jax.grad(lambda params, _: loss(params, batch))`` (``grad_fn_batches``:
    another batch for grad_fn, to show that the batch matters)."""

    @jax.jit
    def step(params, state, batch, grad_fn_batch):
        value, grads = jax.value_and_grad(_shifted_loss)(params, batch)
        updates, state = opt.update(
            grads, state, params, grad_fn=jax.grad(lambda p, _: _shifted_loss(p, grad_fn_batch))
        )
        return optax.apply_updates(params, updates), state, value

    state, values = opt.init(params), []
    for batch, grad_fn_batch in zip(batches, grad_fn_batches or batches, strict=True):
        params, state, value = step(params, state, batch, grad_fn_batch)
        values.append(value)
    return params, state, np.array(values)


@pytest.mark.parametrize("accumulate", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("opaque", [False, True])
def test_grad_fn_is_the_gradient_of_each_batch(opaque, accumulate):
    shifts = np.random.default_rng(0).normal(scale=0.3, size=(32, 2)).astype(np.float32)
    start = np.array([-0.4, -0.4], np.float32)
    opt = contrib.sam(
        optax.adam(1e-2), optax.chain(contrib.normalize(), optax.adam(0.03)),
        sync_period=4, opaque_mode=opaque,
    )  # fmt: skip
    model = Point(start)
    trainer = Trainer(
        model, opt, lambda m, batch: _shifted_loss(m.xy[...], batch), accumulate=accumulate
    )
    trainer.fit(shifts, epochs=2, batch_size=8, shuffle=False, progress=False)

    batches = [shifts[i : i + 8] for i in range(0, 32, 8)] * 2
    params, state, _ = _notebook_loop_with_batches(opt, start, batches)
    # Another program (and with accumulate, a mean of two half-batch gradients): to rounding.
    np.testing.assert_allclose(model.xy[...], params, rtol=1e-5, atol=1e-6)
    assert_trees_close(trainer.opt_state, state, rtol=1e-5, atol=1e-6)
    if opaque:  # grad_fn of another batch (the first, every step) takes another path
        other, _, _ = _notebook_loop_with_batches(opt, start, batches, [batches[0]] * 8)
        assert not np.allclose(params, other, rtol=0, atol=1e-4)


def test_sam_in_a_chain_gets_grad_fn_as_optaxs_chain_passes_it(notebook):
    """``optax.chain`` passes every extra argument to each transform in it; SAM takes
    ``grad_fn`` only, so the built-in step gives the chain what SAM's own loop gives."""
    tx = optax.chain(optax.clip_by_global_norm(0.5), notebook["sam_opt"])
    step = make_train_step(notebook["loss_fn"], tx)
    graphdef, state = nnx.split(Point(notebook["params"]))
    state, _, losses = jax.jit(scan_steps, static_argnums=0)(
        step, graphdef, state, step.init(graphdef, state), jnp.zeros((STEPS, 1))
    )
    loss = notebook["loss"]

    def body(carry, _):  # the notebook's step (cell 29) on the chain
        params, opt_state = carry
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(
            grads, opt_state, params, grad_fn=jax.grad(lambda p, _: loss(p))
        )
        return (optax.apply_updates(params, updates), opt_state), value

    start = notebook["params"]
    (params, _), values = jax.jit(lambda c: jax.lax.scan(body, c, None, length=STEPS))(
        (start, tx.init(start))
    )
    np.testing.assert_array_equal(losses, values)
    np.testing.assert_array_equal(state["xy"][...], params)


# -- what the step cannot give is said before anything compiles -------------------------------


def _transform(update):
    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def test_a_transform_needing_another_argument_is_named_before_compiling(compile_count):
    def keyword(updates, state, params=None, *, grad_fn, weather, **extra_args):
        return updates, state

    def positional(updates, state, params, season):
        return updates, state

    loss_fn = lambda m, b: jnp.sum(m.xy[...] ** 2)  # noqa: E731
    model = Point([1.0, 2.0])
    cases = [(keyword, "weather="), (positional, "season=")]
    optimizers = [nnx.Optimizer(model, _transform(u), wrt=nnx.Param) for u, _ in cases]
    compiled = compile_count()
    for (update, name), optimizer in zip(cases, optimizers, strict=True):
        with pytest.raises(TypeError, match=rf"requires {name} .*value=.*grad_fn.*own"):
            make_train_step(loss_fn, _transform(update))
        with pytest.raises(TypeError, match=rf"requires {name}"):
            Trainer(model, _transform(update), loss_fn)
        with pytest.raises(TypeError, match=rf"requires {name}"):
            scan_train(model, optimizer, loss_fn, np.zeros((3, 1)))
        np.testing.assert_array_equal(model.xy[...], [1.0, 2.0])
    assert compile_count() == compiled


def test_only_the_arguments_update_names_are_passed():
    """A transform gets exactly what its update names, or all four with ``**extra_args``;
    ``value_fn(params)`` and ``grad_fn(params, i)`` are the loss and its gradient there."""
    seen = {}

    def named(updates, state, params, *, value, grad_fn=None):
        seen["named"] = sorted(["value", "grad_fn"])
        return jax.tree.map(jnp.negative, grad_fn(params, 0)), value

    def everything(updates, state, params=None, **extra_args):
        seen["everything"] = sorted(extra_args)
        return jax.tree.map(jnp.negative, extra_args["grad_fn"](params, 0)), extra_args["value_fn"](
            params
        )

    loss_fn = lambda m, b: jnp.sum(m.xy[...] ** 2)  # noqa: E731
    graphdef, state = nnx.split(Point([1.0, 2.0]))
    for update in (named, everything):
        tx = optax.GradientTransformationExtraArgs(lambda params: jnp.zeros(()), update)
        step = make_train_step(loss_fn, tx)
        new_state, loss_seen, _ = jax.jit(step.update, static_argnums=0)(
            graphdef, state, step.init(graphdef, state), None
        )
        # A step of size 1 along grad_fn's gradient 2 * xy: xy -> -xy; the loss 1 + 4.
        np.testing.assert_array_equal(new_state["xy"][...], [-1.0, -2.0])
        assert float(loss_seen) == 5.0
    assert seen == {"named": ["grad_fn", "value"],
                    "everything": ["grad", "grad_fn", "value", "value_fn"]}  # fmt: skip
