"""Differentiating through training: hypergradients of a validation loss w.r.t. the learning
rate through ``scan_steps`` and ``make_epoch`` (against central finite differences, float64),
and MAML on sine tasks (an inner loop of pure steps, the outer update trained by ``Trainer``)
against a plainly pre-trained initialisation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import (
    init_opt_state,
    make_epoch,
    make_train_step,
    scan_steps,
    with_hyperparams,
)
from nnxscan.shell import Trainer

from conftest import float64_checks


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


# -- hypergradients --------------------------------------------------------------------------


class Tanh64(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(1, 16, param_dtype=jnp.float64, rngs=rngs)
        self.out = nnx.Linear(16, 1, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def _central_difference(f, x, h):
    return (f(x + h) - f(x - h)) / (2 * h)


@pytest.mark.parametrize("loop", ["scan_steps", pytest.param("make_epoch", marks=pytest.mark.slow)])
def test_hypergradient_of_the_learning_rate_matches_central_differences(loop):
    with float64_checks():  # a context: no global flag outlives the test
        rng = np.random.default_rng(0)
        x = rng.uniform(-2, 2, (20, 16, 1))
        batches = {"x": x, "y": np.sin(x)}
        data = jax.tree.map(lambda a: a.reshape(-1, 1), batches)  # the same 320 examples
        x_val = rng.uniform(-2, 2, (64, 1))
        val = {"x": x_val, "y": np.sin(x_val)}
        tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
        graphdef, state = nnx.split(Tanh64(nnx.Rngs(0)))
        step = make_train_step(mse, tx)
        epoch = make_epoch(step, batch_size=32)

        def val_loss(lr):
            opt_state = with_hyperparams(init_opt_state(tx, state), learning_rate=lr)
            if loop == "scan_steps":  # 20 SGD-momentum steps
                trained, _, _ = scan_steps(step, graphdef, state, opt_state, batches)
            else:  # 2 shuffled epochs of 10 steps, each order drawn from a key
                trained = state
                for e in range(2):
                    trained, opt_state, _ = epoch(
                        graphdef, trained, opt_state, data, jax.random.key(e)
                    )
            return mse(nnx.merge(graphdef, trained), val)

        lr = jnp.float64(0.1)
        grad = jax.jit(jax.grad(val_loss))(lr)
        assert grad.dtype == jnp.float64
        grad = float(grad)
        numeric = float(_central_difference(jax.jit(val_loss), lr, 1e-5))
    assert abs(grad) > 0.1  # a real dependence, not a vanishing one
    assert grad == pytest.approx(numeric, rel=1e-5)


@pytest.mark.slow
def test_skip_nonfinite_is_transparent_to_the_hypergradient_until_a_step_is_skipped():
    with jax.enable_x64(True):
        rng = np.random.default_rng(2)
        x = rng.uniform(-2, 2, (12, 16, 1))
        bad_y = np.sin(x)
        bad_y[5, 0, 0] = np.nan  # one non-finite label: step 5 is skipped
        x_val = rng.uniform(-2, 2, (64, 1))
        val = {"x": x_val, "y": np.sin(x_val)}
        tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
        graphdef, state = nnx.split(Tanh64(nnx.Rngs(1)))
        plain, skipping = make_train_step(mse, tx), make_train_step(mse, tx, skip_nonfinite=True)

        @jax.value_and_grad
        def val_loss(lr, batches, skip):
            opt_state = with_hyperparams(init_opt_state(tx, state), learning_rate=lr)
            step = skipping if skip else plain
            trained, _, _ = scan_steps(step, graphdef, state, opt_state, batches)
            return mse(nnx.merge(graphdef, trained), val)

        val_loss = jax.jit(val_loss, static_argnums=2)
        lr, good = jnp.float64(0.1), {"x": x, "y": np.sin(x)}
        assert val_loss(lr, good, True) == val_loss(lr, good, False)  # the select is exact
        kept = {"x": np.delete(x, 5, 0), "y": np.delete(np.sin(x), 5, 0)}
        skipped_loss, skipped_grad = val_loss(lr, {"x": x, "y": bad_y}, True)
        without_loss, without_grad = val_loss(lr, kept, False)
    assert float(skipped_loss) == pytest.approx(float(without_loss), rel=1e-12)  # trains right
    assert np.isfinite(without_grad) and np.isnan(skipped_grad)  # 0 x NaN in the backward pass


# -- MAML ------------------------------------------------------------------------------------

INNER_STEPS, INNER_LR, SHOTS = 5, 0.01, 10


class SineMLP(nnx.Module):
    """Finn et al.'s sine-regression network, 1→40→40→1 with ReLU."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(1, 40, rngs=rngs)
        self.hidden2 = nnx.Linear(40, 40, rngs=rngs)
        self.out = nnx.Linear(40, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden2(nnx.relu(self.hidden1(x)))))


def sine_tasks(seed: int, n: int) -> dict[str, np.ndarray]:
    """``n`` tasks ``y = a sin(x - b)``, a in [0.1, 5], b in [0, π], x in [-5, 5]: a support
    set (``xs``, ``ys``) to adapt on and a query set (``xq``, ``yq``) to score, ``SHOTS``
    points each."""
    rng = np.random.default_rng(seed)
    a, b = rng.uniform(0.1, 5.0, (n, 1, 1)), rng.uniform(0, np.pi, (n, 1, 1))
    xs, xq = rng.uniform(-5, 5, (n, SHOTS, 1)), rng.uniform(-5, 5, (n, SHOTS, 1))
    tasks = {"xs": xs, "ys": a * np.sin(xs - b), "xq": xq, "yq": a * np.sin(xq - b)}
    return {k: v.astype(np.float32) for k, v in tasks.items()}


inner_tx = optax.sgd(INNER_LR)
inner_step = make_train_step(mse, inner_tx)


def adapt(graphdef, state, xs, ys):
    """``INNER_STEPS`` pure SGD steps on one task's support set, by ``scan_steps``."""
    support = {"x": jnp.broadcast_to(xs, (INNER_STEPS, *xs.shape)),
               "y": jnp.broadcast_to(ys, (INNER_STEPS, *ys.shape))}  # fmt: skip
    state, _, _ = scan_steps(inner_step, graphdef, state, init_opt_state(inner_tx, state), support)
    return state


def query_losses_after_adapting(graphdef, state, tasks):
    def one(xs, ys, xq, yq):
        adapted = nnx.merge(graphdef, adapt(graphdef, state, xs, ys))
        return jnp.mean((adapted(xq) - yq) ** 2)

    return jax.vmap(one)(tasks["xs"], tasks["ys"], tasks["xq"], tasks["yq"])


def maml_loss(model, tasks):
    """The outer loss: the query loss after adapting, averaged over a batch of tasks. The
    outer gradient flows back through every inner step (second-order MAML)."""
    graphdef, state = nnx.split(model)
    return jnp.mean(query_losses_after_adapting(graphdef, state, tasks))


def pretraining_loss(model, tasks):
    """The baseline: plain regression on every point of every task, no adaptation."""
    x = jnp.concatenate([tasks["xs"], tasks["xq"]], axis=1)
    y = jnp.concatenate([tasks["ys"], tasks["yq"]], axis=1)
    return mse(model, {"x": x, "y": y})


@pytest.fixture(scope="module")
def meta_and_pretrained():
    tasks = sine_tasks(0, 2048)
    fit = {"epochs": 16, "batch_size": 16, "seed": 0, "progress": False}  # 2,048 outer steps
    meta, pretrained = SineMLP(nnx.Rngs(0)), SineMLP(nnx.Rngs(0))
    meta_history = Trainer(meta, optax.adam(1e-3), maml_loss).fit(tasks, **fit)
    Trainer(pretrained, optax.adam(1e-3), pretraining_loss).fit(tasks, **fit)
    return meta, pretrained, meta_history


@pytest.mark.slow
def test_maml_trains_through_the_inner_loop_with_a_trainer(meta_and_pretrained):
    _, _, history = meta_and_pretrained
    losses = np.asarray(history.losses)
    assert losses.shape == (16 * 128,) and np.isfinite(losses).all()
    assert losses[-128:].mean() < 0.6 * losses[:128].mean()


@pytest.mark.slow  # meta-training; the hypergradient tests stay fast
def test_the_meta_learned_init_adapts_better_in_k_steps_than_a_pretrained_one(
    meta_and_pretrained,
):
    meta, pretrained, _ = meta_and_pretrained
    held_out = sine_tasks(1, 500)
    after = jax.jit(query_losses_after_adapting, static_argnums=0)
    meta_after = float(after(nnx.graphdef(meta), nnx.state(meta), held_out).mean())
    pre_after = float(after(nnx.graphdef(pretrained), nnx.state(pretrained), held_out).mean())
    pre_before = float(pretraining_loss(pretrained, held_out))
    meta_before = float(pretraining_loss(meta, held_out))
    # K steps help the meta-learned init a lot; the pre-trained one is best left alone, and
    # the meta-learned init after K steps beats it both ways.
    assert meta_after < 0.6 * meta_before
    assert meta_after < 0.6 * min(pre_before, pre_after)


@pytest.mark.slow
def test_the_outer_gradient_is_second_order_through_the_inner_steps():
    """The MAML gradient differs from the first-order one (inner gradients stopped) and
    matches central differences along a random direction in parameter space."""
    with jax.enable_x64(True):
        tasks = jax.tree.map(lambda a: a.astype(np.float64), sine_tasks(2, 4))
        graphdef, params = nnx.split(Tanh64(nnx.Rngs(3)))  # small, float64: cheap to check

        def outer(p):
            return jnp.mean(query_losses_after_adapting(graphdef, p, tasks))

        grads = jax.jit(jax.grad(outer))(params)
        rng = np.random.default_rng(4)
        direction = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), params)
        along = _dot(grads, direction)

        def shifted(t):
            return outer(jax.tree.map(lambda p, d: p + t * d, params, direction))

        numeric = _central_difference(jax.jit(shifted), 0.0, 1e-6)
        assert float(along) == pytest.approx(float(numeric), rel=1e-5)

        def first_order_step(graphdef, state, xs, ys):
            grads = jax.grad(lambda s: mse(nnx.merge(graphdef, s), {"x": xs, "y": ys}))(state)
            return jax.tree.map(lambda s, g: s - INNER_LR * jax.lax.stop_gradient(g), state, grads)

        def first_order(p):
            def one(xs, ys, xq, yq):
                s = p
                for _ in range(INNER_STEPS):
                    s = first_order_step(graphdef, s, xs, ys)
                return mse(nnx.merge(graphdef, s), {"x": xq, "y": yq})

            return jnp.mean(jax.vmap(one)(tasks["xs"], tasks["ys"], tasks["xq"], tasks["yq"]))

        first_order_grads = jax.jit(jax.grad(first_order))(params)
        # Along the same direction the first-order estimate is off by far more than rounding.
        assert abs(float(_dot(first_order_grads, direction)) - float(along)) > 1e-3 * abs(
            float(along)
        )


def _dot(a, b):
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
