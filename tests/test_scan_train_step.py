"""``scan_train`` runs the user's own step: a stateful NNX function (the Q&A's ``backprop``,
the Flax tutorial's ``train_step``) against Flax's own ``nnx.scan`` and the per-step loop,
and a pure ``Step`` against a hand-written ``jax.lax.scan`` of its ``update``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import Step, init_opt_state, split_wrt
from nnxscan.shell import scan_train

from conftest import ACROSS_PROGRAMS, MLP, assert_trees_close, state_arrays, xent

STEPS, BATCH = 6, 8


def _batches(steps: int = STEPS, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, BATCH, 4)).astype(np.float32)
    w = rng.normal(size=(4, 3))
    return {"x": x, "y": np.argmax(x @ w, axis=-1).astype(np.int32)}


def _model_and_optimizer(seed: int = 0) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


# -- the Q&A's step, as its asker wrote it (flax 0.12's optimizer.update(model, grads)) ---------


def backprop(policy, optimizer, x):
    def loss_fn(policy):
        logits = policy(x["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, x["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(policy)
    optimizer.update(policy, grads)
    return loss


@nnx.jit
def _flax_scan(nodes, batches):
    """Flax's own answer: ``nnx.scan`` over ``nnx.Carry`` inside ``nnx.jit``."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def body(nodes, batch):
        return nodes, backprop(*nodes, batch)

    return body(nodes, batches)[1]


def test_qa_step_under_scan_train_equals_flaxs_nnx_scan():
    batches = _batches()
    policy, optimizer = _model_and_optimizer()
    losses = scan_train(policy, optimizer, batches=batches, train_step=backprop)

    ref_policy, ref_optimizer = _model_and_optimizer()
    ref_losses = _flax_scan((ref_policy, ref_optimizer), batches)

    assert losses.shape == (STEPS,)
    # Flax's nnx.scan is another program (its own loop body): equal to rounding (conftest).
    np.testing.assert_allclose(np.asarray(losses), np.asarray(ref_losses), **ACROSS_PROGRAMS)
    assert_trees_close(policy, ref_policy)
    assert_trees_close(optimizer, ref_optimizer)  # moments, and the step exactly
    assert int(optimizer.step[...]) == STEPS
    untrained = state_arrays(MLP(rngs=nnx.Rngs(0)))
    assert all(np.any(x != y) for x, y in zip(state_arrays(policy), untrained, strict=True))


@pytest.mark.slow
def test_stateful_outputs_come_back_stacked_whatever_their_tree():
    def with_norms(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(xent)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "norms": (optax.tree.norm(grads), jnp.zeros((2,)))}

    model, optimizer = _model_and_optimizer()
    outs = scan_train(model, optimizer, batches=_batches(), train_step=with_norms)
    assert jax.tree.map(jnp.shape, outs) == {"loss": (STEPS,), "norms": ((STEPS,), (STEPS, 2))}

    ref_model, ref_optimizer = _model_and_optimizer()
    loop = [with_norms(ref_model, ref_optimizer, b) for b in _split(_batches())]
    np.testing.assert_allclose(outs["loss"], [o["loss"] for o in loop], rtol=1e-5)
    np.testing.assert_allclose(outs["norms"][0], [o["norms"][0] for o in loop], rtol=1e-5)


def _split(batches: dict) -> list[dict]:
    steps = len(jax.tree.leaves(batches)[0])
    return [jax.tree.map(lambda x, i=i: x[i], batches) for i in range(steps)]


# -- the Flax tutorial's step: @nnx.jit, metrics and rngs among its objects, returns nothing -----


class DropoutMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.3)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs):
        return self.l2(self.drop(nnx.relu(self.l1(x)), rngs=rngs))


def tutorial_loss(model, rngs, batch):
    logits = model(batch["x"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, logits


@nnx.jit
def tutorial_train_step(model, optimizer, metrics, rngs, batch):
    grad_fn = nnx.value_and_grad(tutorial_loss, has_aux=True)
    (loss, logits), grads = grad_fn(model, rngs, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])
    optimizer.update(model, grads)


def _tutorial_objects():
    model = DropoutMLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics, nnx.Rngs(dropout=1)


def test_tutorial_train_step_with_extras_equals_its_per_step_loop():
    batches = _batches()
    model, optimizer, metrics, rngs = _tutorial_objects()
    outs = scan_train(
        model, optimizer, batches=batches, train_step=tutorial_train_step, extras=(metrics, rngs)
    )
    assert outs is None  # the step returns nothing

    ref = _tutorial_objects()
    for batch in _split(batches):
        tutorial_train_step(*ref, batch)

    for ours, theirs in zip((model, optimizer, metrics, rngs), ref, strict=True):
        # The per-step program is another program than the scan: floats to rounding
        # (conftest); dropout keys and counts (integers) exactly.
        assert_trees_close(ours, theirs)
    computed, ref_computed = metrics.compute(), ref[2].compute()
    for name in ("accuracy", "loss"):
        np.testing.assert_allclose(computed[name], ref_computed[name], rtol=1e-6)
    assert int(optimizer.step[...]) == STEPS and int(rngs.dropout.count[...]) == STEPS


# -- a pure Step: the caller holds its opt_state -------------------------------------------------


TX = optax.sgd(0.1, momentum=0.9)
EMA = 0.8


def _ema_init(graphdef, state):
    params, _ = split_wrt(state, nnx.Param)
    return {"tx": init_opt_state(TX, state), "ema": params}


def _ema_update(graphdef, state, opt_state, batch):
    """SGD with momentum, and an EMA of the weights carried in the opt_state."""
    params, rest = split_wrt(state, nnx.Param)

    def loss_of(params):
        return xent(nnx.merge(graphdef, params, rest), batch)

    loss, grads = jax.value_and_grad(loss_of)(params)
    updates, tx_state = TX.update(grads, opt_state["tx"], params)
    params = optax.apply_updates(params, updates)
    ema = jax.tree.map(lambda e, p: EMA * e + (1 - EMA) * p, opt_state["ema"], params)
    new_state = nnx.merge_state(params, rest)
    return new_state, {"tx": tx_state, "ema": ema}, (loss, {"grad_norm": optax.tree.norm(grads)})


EMA_STEP = Step(_ema_init, _ema_update, has_aux=True)


@functools.partial(jax.jit, static_argnums=0)
def _hand_scan(graphdef, state, opt_state, batches):
    """The reference: a hand-written ``jax.lax.scan`` of ``EMA_STEP.update``."""

    def body(carry, batch):
        state, opt_state, out = EMA_STEP.update(graphdef, *carry, batch)
        return (state, opt_state), out

    (state, opt_state), outs = jax.lax.scan(body, (state, opt_state), batches)
    return state, opt_state, outs


def _hand_reference(batches: dict):
    model = MLP(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    state, opt_state, outs = _hand_scan(graphdef, state, EMA_STEP.init(graphdef, state), batches)
    return state, opt_state, outs


def test_pure_step_equals_a_hand_written_lax_scan_of_its_update():
    batches = _batches()
    model = MLP(rngs=nnx.Rngs(0))
    (losses, aux), opt_state = scan_train(model, batches=batches, train_step=EMA_STEP)

    state, ref_opt_state, (ref_losses, ref_aux) = _hand_reference(batches)
    # The hand-written scan is another program (no halt flag, its own carry): to rounding.
    np.testing.assert_allclose(np.asarray(losses), np.asarray(ref_losses), **ACROSS_PROGRAMS)
    np.testing.assert_allclose(aux["grad_norm"], ref_aux["grad_norm"], **ACROSS_PROGRAMS)
    assert_trees_close(model, state)
    assert_trees_close(opt_state, ref_opt_state)  # momentum and EMA weights


def test_two_calls_continue_from_the_returned_opt_state(compile_count):
    batches = _batches(2 * STEPS)
    first, second = (
        jax.tree.map(lambda x, s=s: x[s], batches) for s in (slice(0, STEPS), slice(STEPS, None))
    )
    model = MLP(rngs=nnx.Rngs(0))
    (losses_a, _), opt_state_a = scan_train(model, batches=first, train_step=EMA_STEP)
    kept = state_arrays(opt_state_a)
    before = compile_count()
    (losses_b, _), opt_state_b = scan_train(
        model, batches=second, train_step=EMA_STEP, opt_state=opt_state_a
    )
    assert compile_count() == before  # the same shapes: nothing compiles

    state, ref_opt_state, (ref_losses, _) = _hand_reference(batches)  # one scan of all
    # Another program (the hand-written scan): to rounding, see conftest.
    losses = np.concatenate([losses_a, losses_b])
    np.testing.assert_allclose(losses, np.asarray(ref_losses), **ACROSS_PROGRAMS)
    assert_trees_close(model, state)
    assert_trees_close(opt_state_b, ref_opt_state)
    # The opt_state passed in was not donated: it still holds the first call's values.
    for x, y in zip(state_arrays(opt_state_a), kept, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_stateful_step_called_twice_goes_on_and_compiles_once(compile_count):
    batches = _batches(2 * STEPS)
    first, second = (
        jax.tree.map(lambda x, s=s: x[s], batches) for s in (slice(0, STEPS), slice(STEPS, None))
    )
    policy, optimizer = _model_and_optimizer()
    losses_a = scan_train(policy, optimizer, batches=first, train_step=backprop)
    before = compile_count()
    losses_b = scan_train(policy, optimizer, batches=second, train_step=backprop)
    assert compile_count() == before

    ref_policy, ref_optimizer = _model_and_optimizer()
    ref_losses = _flax_scan((ref_policy, ref_optimizer), batches)
    # Flax's nnx.scan is another program: to rounding, see conftest.
    np.testing.assert_allclose(np.concatenate([losses_a, losses_b]), ref_losses, **ACROSS_PROGRAMS)
    assert_trees_close(policy, ref_policy)
    assert int(optimizer.step[...]) == 2 * STEPS


# -- bad input: a clear TypeError before compiling, nothing changed ------------------------------


def _bad_calls(model, optimizer, batches):
    step_init = EMA_STEP.init(*nnx.split(model))
    return {
        "loss_fn": lambda: scan_train(model, optimizer, xent, batches, train_step=backprop),
        "rngs": lambda: scan_train(
            model, optimizer, batches=batches, train_step=backprop, rngs=nnx.Rngs(0)
        ),
        "non-NNX extra": lambda: scan_train(
            model, optimizer, batches=batches, train_step=tutorial_train_step, extras=(3, 4)
        ),
        "optax transform": lambda: scan_train(
            model, optax.adam(1e-3), batches=batches, train_step=backprop
        ),
        "Step with optimizer": lambda: scan_train(
            model, optimizer, batches=batches, train_step=EMA_STEP
        ),
        "opt_state with fn": lambda: scan_train(
            model, optimizer, batches=batches, train_step=backprop, opt_state=step_init
        ),
        "arity": lambda: scan_train(
            model, optimizer, batches=batches, train_step=lambda policy, x: None
        ),
        "not callable": lambda: scan_train(model, optimizer, batches=batches, train_step=3),
        "no loss": lambda: scan_train(model, optimizer, batches=batches),
    }


BAD_CASES = (
    "loss_fn", "rngs", "non-NNX extra", "optax transform", "Step with optimizer",
    "opt_state with fn", "arity", "not callable", "no loss",
)  # fmt: skip


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_a_type_error_before_compiling(case, compile_count):
    model, optimizer = _model_and_optimizer()
    batches = _batches()
    call = _bad_calls(model, optimizer, batches)[case]
    before, held = compile_count(), state_arrays((model, optimizer))
    with pytest.raises(TypeError) as info:
        call()
    assert compile_count() == before
    assert len(str(info.value)) > 40  # says what to do, not just what went wrong
    for x, y in zip(state_arrays((model, optimizer)), held, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_mismatched_opt_state_is_named_before_compiling(compile_count):
    model = MLP(rngs=nnx.Rngs(0))
    batches = _batches()
    good = EMA_STEP.init(*nnx.split(model))
    bad_shape = {**good, "ema": jax.tree.map(lambda x: x[..., :1], good["ema"])}
    before = compile_count()
    with pytest.raises(ValueError, match="structure"):
        scan_train(model, batches=batches, train_step=EMA_STEP, opt_state=good["tx"])
    with pytest.raises(ValueError, match=r"opt_state leaf \['ema'\]"):
        scan_train(model, batches=batches, train_step=EMA_STEP, opt_state=bad_shape)
    assert compile_count() == before


def test_a_step_stopped_part_way_hands_back_the_matching_opt_state():
    calls = {"n": 0}

    def data_source(_):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("the data source failed")

    def update(graphdef, state, opt_state, batch):
        jax.debug.callback(data_source, batch["x"][0, 0])
        return EMA_STEP.update(graphdef, state, opt_state, batch)

    failing = Step(EMA_STEP.init, update, has_aux=True)
    model = MLP(rngs=nnx.Rngs(0))
    with pytest.raises(Exception, match="data source failed") as info:
        scan_train(model, batches=_batches(), train_step=failing, execution="step")

    first_three = jax.tree.map(lambda x: x[:3], _batches())
    state, ref_opt_state, _ = _hand_reference(first_three)
    # The per-step plan against a scan: two programs, to rounding (conftest).
    assert_trees_close(model, state)  # the last completed step: the third
    assert_trees_close(info.value.opt_state, ref_opt_state)
