"""Bring your own step: ``Trainer(model, train_step=S)`` and ``Trainer(model, optimizer,
train_step=fn, extras=(...))``, each against an independent reference.

- The Flax NNX MNIST tutorial's ``train_step`` (copied from flax 0.12.8's
  docs_nnx/mnist_tutorial.md, unchanged) under ``fit`` against the tutorial's own loop.
- A GAN-style pure ``Step`` (two submodules, two optax states) under ``fit`` against a
  hand-written ``jax.jit(lax.scan)`` of its own ``update``; cut and resumed against the run
  never cut.
- ``on_nonfinite`` on a user's step against a loop that skips (or stops at) the poisoned
  batches; a stateful step's outputs against the epoch means of a per-step loop; wrong
  arguments refused before anything compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import Step, init_opt_state
from nnxscan.shell import Trainer

from conftest import ACROSS_PROGRAMS, MLP, assert_trees_close, epoch_batches, state_arrays, xent

BS = 16


def _stacked(batches: list) -> dict:
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)


# -- the Flax NNX MNIST tutorial's train_step, unchanged ----------------------------------------


class TutorialNet(nnx.Module):
    """The tutorial CNN's pieces (a BatchNorm, a Dropout fed call-time ``rngs``) on a
    small MLP, so the test is fast; its ``__call__(x, rngs)`` is the tutorial's signature."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(4, 16, use_bias=False, rngs=rngs)  # bias-free before BN
        self.batch_norm1 = nnx.BatchNorm(16, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.25)
        self.linear2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = nnx.relu(self.batch_norm1(self.linear1(x)))
        return self.linear2(self.dropout1(x, rngs=rngs))


# From here to the next rule: the tutorial's code as it is (section 5).
def loss_fn(model: TutorialNet, batch, rngs: nnx.Rngs | None = None):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


@nnx.jit
def train_step(
    model: TutorialNet,
    optimizer: nnx.Optimizer,
    metrics: nnx.MultiMetric,
    rngs: nnx.Rngs,
    batch,
):
    """Train for a single step."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.
    optimizer.update(model, grads)  # In-place updates.


# ----------------------------------------------------------------------------------------------


def _tutorial_objects():
    """The tutorial's objects (section 4 and 6): model, its train view, optimizer, metrics."""
    model = TutorialNet(rngs=nnx.Rngs(0))
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, train_model, optimizer, metrics


def _as_images(batch: dict) -> dict:
    return {"image": batch["x"], "label": batch["y"]}  # the tutorial's keys


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_the_tutorials_train_step_under_fit_is_the_tutorials_loop(data):
    images = _as_images(data)
    epochs = 3
    # The tutorial's loop (section 7) on fit's batches: a step per batch, the metrics
    # computed and reset at the end of each epoch.
    ref, ref_train, ref_opt, ref_metrics = _tutorial_objects()
    ref_rngs, want = nnx.Rngs(0), []
    for epoch in range(epochs):
        for batch in epoch_batches(data, BS, 0, epoch):
            train_step(ref_train, ref_opt, ref_metrics, ref_rngs, _as_images(batch))
        want.append({k: float(v) for k, v in ref_metrics.compute().items()})
        ref_metrics.reset()

    model, train_model, optimizer, metrics = _tutorial_objects()
    rngs = nnx.Rngs(0)
    trainer = Trainer(train_model, optimizer, train_step=train_step, extras=(metrics, rngs))
    history = trainer.fit(images, epochs=epochs, batch_size=BS, progress=False)

    # The tutorial's per-step program and fit's scan are two programs: floats to rounding
    # (conftest's ACROSS_PROGRAMS), the dropout keys and counts (integers) exactly.
    assert_trees_close(model, ref)  # weights, batch statistics
    assert_trees_close(optimizer, ref_opt)
    assert_trees_close(rngs, ref_rngs)  # the dropout keys advanced alike
    assert trainer.step == int(optimizer.step[...]) == epochs * (len(images["image"]) // BS)
    for logs, ref_logs in zip(history.epochs, want, strict=True):
        np.testing.assert_allclose(logs["train_accuracy"], ref_logs["accuracy"], rtol=1e-6)
        np.testing.assert_allclose(logs["train_loss"], ref_logs["loss"], rtol=1e-5)
        assert "loss" not in logs  # the tutorial's step returns nothing
    # The epochs differ (the metrics were reset between them, and the model learned).
    assert len({logs["train_loss"] for logs in history.epochs}) == epochs


# -- a GAN: a pure Step with two optax states ---------------------------------------------------

ZDIM = 2
G_TX, D_TX = optax.adam(1e-2), optax.adam(2e-2)


class GAN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.gen = MLP(ZDIM, 8, 4, rngs=rngs)  # noise -> a fake example
        self.disc = MLP(4, 8, 1, rngs=rngs)  # an example -> the logit of "real"


def _bce(logits, label):
    return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, label)).mean()


def gan_init(graphdef, state):
    gan = nnx.merge(graphdef, state)
    return {
        "gen": G_TX.init(nnx.state(gan.gen, nnx.Param)),
        "disc": D_TX.init(nnx.state(gan.disc, nnx.Param)),
        "count": jnp.zeros((), jnp.uint32),  # the noise's key is folded with it
    }


def gan_update(graphdef, state, opt_state, batch):
    gan = nnx.merge(graphdef, state)
    key = jax.random.fold_in(jax.random.key(7), opt_state["count"])
    z = jax.random.normal(key, (batch["x"].shape[0], ZDIM))

    def d_loss(disc, gen):  # the discriminator: real examples -> 1, fakes -> 0
        return _bce(disc(batch["x"]), 1.0) + _bce(disc(jax.lax.stop_gradient(gen(z))), 0.0)

    d_value, grads = nnx.value_and_grad(d_loss)(gan.disc, gan.gen)
    params = nnx.state(gan.disc, nnx.Param)
    updates, d_state = D_TX.update(grads, opt_state["disc"], params)
    nnx.update(gan.disc, optax.apply_updates(params, updates))

    def g_loss(gen, disc):  # then the generator, against the updated discriminator
        return _bce(disc(gen(z)), 1.0)

    g_value, grads = nnx.value_and_grad(g_loss)(gan.gen, gan.disc)
    params = nnx.state(gan.gen, nnx.Param)
    updates, g_state = G_TX.update(grads, opt_state["gen"], params)
    nnx.update(gan.gen, optax.apply_updates(params, updates))
    new_opt_state = {"gen": g_state, "disc": d_state, "count": opt_state["count"] + 1}
    return nnx.state(gan), new_opt_state, (g_value, {"d_loss": d_value})


GAN_STEP = Step(gan_init, gan_update, has_aux=True)


@pytest.fixture(scope="module")
def reals(data):
    return {"x": data["x"]}


@pytest.fixture(scope="module")
def gan_straight(reals):
    """Four epochs of the GAN step under fit, never cut: (trainer, history)."""
    trainer = Trainer(GAN(rngs=nnx.Rngs(0)), train_step=GAN_STEP)
    return trainer, trainer.fit(reals, epochs=4, batch_size=BS, progress=False)


@pytest.mark.slow_on_accelerator("a GAN's programs under fit and by hand: 5 s")
def test_a_gan_step_under_fit_is_a_hand_written_scan_of_its_update(reals, gan_straight):
    trainer, history = gan_straight
    graphdef, state = nnx.split(GAN(rngs=nnx.Rngs(0)))
    opt_state = GAN_STEP.init(graphdef, state)
    batches = _stacked([b for e in range(4) for b in epoch_batches(reals, BS, 0, e)])

    @jax.jit
    def run(state, opt_state, batches):
        def body(carry, batch):
            state, opt_state, out = GAN_STEP.update(graphdef, *carry, batch)
            return (state, opt_state), out

        return jax.lax.scan(body, (state, opt_state), batches)

    (state, opt_state), (g_losses, aux) = run(state, opt_state, batches)
    # A hand-written scan is another program than fit's: to rounding (conftest).
    assert_trees_close(trainer.model, state)
    assert_trees_close(trainer.opt_state, opt_state)  # both adam states, count
    np.testing.assert_allclose(history.losses, g_losses, **ACROSS_PROGRAMS)
    d_losses = np.asarray(aux["d_loss"]).reshape(4, -1)
    g_losses = np.asarray(g_losses).reshape(4, -1)
    for logs, g, d in zip(history.epochs, g_losses, d_losses, strict=True):
        np.testing.assert_allclose(logs["loss"], g.mean(), rtol=1e-6)
        np.testing.assert_allclose(logs["d_loss"], d.mean(), rtol=1e-6)  # aux is logged
    assert trainer.step == 16 and int(trainer.opt_state["count"]) == 16


@pytest.mark.slow_on_accelerator("three GAN fits and a resume: 5.8 s")
def test_a_gan_cut_after_two_epochs_and_resumed_is_the_run_never_cut(reals, gan_straight, tmp_path):
    straight, straight_history = gan_straight
    first = Trainer(GAN(rngs=nnx.Rngs(0)), train_step=GAN_STEP)
    first.fit(reals, epochs=2, batch_size=BS, checkpoint_dir=tmp_path, resume=True,
              progress=False)  # fmt: skip
    # A new process would start here: fresh objects, the same command.
    resumed = Trainer(GAN(rngs=nnx.Rngs(0)), train_step=GAN_STEP)
    history = resumed.fit(
        reals, epochs=4, batch_size=BS, checkpoint_dir=tmp_path, resume=True, progress=False
    )
    assert resumed.epoch == 4 and resumed.step == 16
    # Bitwise: both runs scan the same step body (conftest), only cut at another place.
    assert_trees_close(resumed.model, straight.model, exact=True)
    assert_trees_close(resumed.opt_state, straight.opt_state, exact=True)
    assert jax.tree.structure(resumed.opt_state) == jax.tree.structure(straight.opt_state)
    np.testing.assert_array_equal(history.losses, straight_history.losses)


# -- on_nonfinite on a user's step ---------------------------------------------------------------

TX = optax.adam(1e-2)


def plain_update(graphdef, state, opt_state, batch):
    """A hand-written step: the gradient of ``xent`` and one adam update."""
    model = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(xent)(model, batch)
    params = nnx.state(model, nnx.Param)
    updates, opt_state = TX.update(grads, opt_state, params)
    nnx.update(model, optax.apply_updates(params, updates))
    return nnx.state(model), opt_state, loss


PLAIN_STEP = Step(lambda graphdef, state: init_opt_state(TX, state), plain_update)
_plain_jitted = jax.jit(plain_update, static_argnums=0)


@pytest.fixture(scope="module")
def poisoned(data):
    d = {k: v.copy() for k, v in data.items()}
    d["x"][[5, 40], 1] = np.nan  # two bad examples: the batches holding them go non-finite
    return d


def _has_nan(batch) -> bool:
    return bool(np.isnan(batch["x"]).any())


def _plain_loop(batches):
    """The reference: ``plain_update`` jitted, one call per batch, from a fresh model."""
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    opt_state = TX.init(nnx.state(nnx.merge(graphdef, state), nnx.Param))
    for batch in batches:
        state, opt_state, _ = _plain_jitted(graphdef, state, opt_state, batch)
    return state, opt_state


def test_skip_on_a_user_step_is_a_loop_that_skips_the_poisoned_batches(poisoned):
    batches = [b for e in range(2) for b in epoch_batches(poisoned, BS, 0, e)]
    bad = [_has_nan(b) for b in batches]
    assert 0 < sum(bad) < len(bad)
    want, want_opt = _plain_loop([b for b, nan in zip(batches, bad, strict=True) if not nan])

    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=PLAIN_STEP, on_nonfinite="skip")
    history = trainer.fit(poisoned, epochs=2, batch_size=BS, progress=False)
    assert_trees_close(trainer.model, want)
    assert_trees_close(trainer.opt_state, want_opt)
    np.testing.assert_array_equal(np.isnan(history.losses), bad)
    per_epoch = np.reshape(bad, (2, -1)).sum(axis=1)
    assert [e["skipped_steps"] for e in history.epochs] == per_epoch.tolist()
    assert all(np.isfinite(e["loss"]) for e in history.epochs)


def test_stop_on_a_user_step_raises_at_the_step_with_the_model_before_it(poisoned):
    batches = [b for e in range(2) for b in epoch_batches(poisoned, BS, 0, e)]
    first_bad = next(i for i, b in enumerate(batches) if _has_nan(b))
    want, want_opt = _plain_loop(batches[:first_bad])

    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=PLAIN_STEP, on_nonfinite="stop")
    with pytest.raises(FloatingPointError, match=rf"global step {first_bad}\b"):
        trainer.fit(poisoned, epochs=2, batch_size=BS, progress=False)
    assert trainer.step == first_bad
    assert_trees_close(trainer.model, want)
    assert_trees_close(trainer.opt_state, want_opt)
    assert np.isfinite(np.asarray(trainer.model(poisoned["x"][:4]))).all()


@pytest.mark.parametrize("guard", ["skip", "halt"])
def test_the_guards_keep_the_old_state_of_an_update_that_mutates_its_merged_model(poisoned, guard):
    # plain_update merges ``state`` and writes the new parameters into the merged model:
    # the Variables it writes are those of ``state`` itself (nnx.merge shares them). The
    # reference: the state as it was before the poisoned batch, read on the host.
    from nnxscan.pure import halt_after_nonfinite, skip_nonfinite

    bad = next(b for b in epoch_batches(poisoned, BS, 0, 0) if _has_nan(b))
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    opt_state = PLAIN_STEP.init(graphdef, state)
    before = state_arrays(state)
    if guard == "skip":
        new_state, _, loss = jax.jit(skip_nonfinite(PLAIN_STEP).update, static_argnums=0)(
            graphdef, state, opt_state, bad
        )
    else:
        halting = halt_after_nonfinite(PLAIN_STEP)
        new_state, halt, loss = jax.jit(halting.update, static_argnums=0)(
            graphdef, state, halting.init(graphdef, state), bad
        )
        assert bool(halt.halted)
    assert np.isnan(loss)
    for got, want in zip(state_arrays(new_state), before, strict=True):
        np.testing.assert_array_equal(got, want)


def stateful_xent_step(model, optimizer, batch):
    """A stateful step in the tutorial's manner that returns its loss."""
    loss, grads = nnx.value_and_grad(xent)(model, batch)
    optimizer.update(model, grads)
    return loss


def test_skip_on_a_stateful_step_is_the_nnx_loop_that_skips_the_poisoned_batches(poisoned):
    batches = [b for e in range(2) for b in epoch_batches(poisoned, BS, 0, e)]
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    jitted = nnx.jit(stateful_xent_step)
    for batch in batches:
        if not _has_nan(batch):
            jitted(ref, ref_opt, batch)

    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    trainer = Trainer(model, optimizer, train_step=stateful_xent_step, on_nonfinite="skip")
    history = trainer.fit(poisoned, epochs=2, batch_size=BS, progress=False)
    assert_trees_close(model, ref)
    assert_trees_close(optimizer, ref_opt)  # its step counts the trained steps only
    assert sum(e["skipped_steps"] for e in history.epochs) == sum(map(_has_nan, batches))


# -- what a stateful step returns becomes the logs -----------------------------------------------


@nnx.jit
def dict_step(model, optimizer, batch):
    logits = model(batch["x"])

    def loss_of(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_of)(model)
    optimizer.update(model, grads)
    return {"loss": loss, "accuracy": jnp.mean(logits.argmax(-1) == batch["y"])}


@nnx.jit
def renamed_step(model, optimizer, batch):
    """The same step reporting its loss under another name: no "loss" in the logs."""
    out = dict_step(model, optimizer, batch)
    return {"xent": out["loss"], "accuracy": out["accuracy"]}


@pytest.mark.parametrize("step", [dict_step, renamed_step], ids=["with_loss", "without"])
def test_a_stateful_steps_dict_is_logged_as_each_keys_epoch_mean(data, step):
    epochs = 2
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    want = []
    for epoch in range(epochs):
        outs = [step(ref, ref_opt, b) for b in epoch_batches(data, BS, 0, epoch)]
        want.append({k: np.mean([float(o[k]) for o in outs]) for k in outs[0]})

    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    history = Trainer(model, optimizer, train_step=step).fit(
        data, epochs=epochs, batch_size=BS, progress=False
    )
    assert_trees_close(model, ref)
    for logs, ref_logs in zip(history.epochs, want, strict=True):
        for key, value in ref_logs.items():
            np.testing.assert_allclose(logs[key], value, rtol=1e-5)
        assert ("loss" in logs) == ("loss" in ref_logs)


@nnx.jit
def silent_step(model, optimizer, batch):
    grads = nnx.grad(xent)(model, batch)
    optimizer.update(model, grads)


def test_skip_with_a_step_that_reports_no_loss_is_refused_before_training(data):
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    before = state_arrays(model) + state_arrays(optimizer)
    trainer = Trainer(model, optimizer, train_step=silent_step, on_nonfinite="skip")
    with pytest.raises(ValueError, match=r"on_nonfinite='skip'.*returns none.*return the loss"):
        trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    assert trainer.step == 0 and trainer.epoch == 0
    for got, want in zip(state_arrays(model) + state_arrays(optimizer), before, strict=True):
        np.testing.assert_array_equal(got, want)


# -- wrong arguments: a TypeError before anything compiles, nothing changed ----------------------


def _captures_a_module():
    teacher = MLP(rngs=nnx.Rngs(1))

    def update(graphdef, state, opt_state, batch):
        return state, opt_state, jnp.mean(teacher(batch["x"]))

    return Step(lambda graphdef, state: (), update)


CAPTURED_RNGS = nnx.Rngs(3)


@nnx.jit
def captures_rngs(model, optimizer, batch):
    """The tutorial's decoration, but the Rngs captured instead of passed in."""
    loss, grads = nnx.value_and_grad(xent)(model, batch)
    optimizer.update(model, grads)
    return loss + 0.0 * jax.random.normal(CAPTURED_RNGS.noise())


BAD_ARGUMENTS = {
    "loss_fn and train_step": (
        lambda m, o: Trainer(m, TX, xent, train_step=PLAIN_STEP),
        r"train_step= replaces the step built from a loss, so loss_fn",
    ),
    "a loss option and train_step": (
        lambda m, o: Trainer(m, o, train_step=stateful_xent_step, has_aux=True),
        r"train_step= replaces .* has_aux has no effect",
    ),
    "a Step and an optax transform": (
        lambda m, o: Trainer(m, TX, train_step=PLAIN_STEP),
        r"a pure Step carries its optimizer state itself",
    ),
    "a Step and an nnx.Optimizer": (
        lambda m, o: Trainer(m, o, train_step=PLAIN_STEP),
        r"a pure Step carries its optimizer state itself",
    ),
    "a Step and extras": (
        lambda m, o: Trainer(m, train_step=PLAIN_STEP, extras=(nnx.Rngs(0),)),
        r"without an optimizer or extras",
    ),
    "a non-NNX extra": (
        lambda m, o: Trainer(m, o, train_step=stateful_xent_step, extras=(np.ones(3),)),
        r"extras\[0\] is a ndarray; extras are the NNX objects",
    ),
    "a non-callable train_step": (
        lambda m, o: Trainer(m, train_step=42),
        r"train_step must be a nnxscan.pure.Step or a function .* got int",
    ),
    "a stateful step with an optax transform": (
        lambda m, o: Trainer(m, TX, train_step=stateful_xent_step),
        r"the second argument is the nnx.Optimizer it receives, got GradientTransformation",
    ),
    "a Step whose update captures a module": (
        lambda m, o: Trainer(m, train_step=_captures_a_module()),
        r"train_step.update captures an NNX object \(MLP\)",
    ),
    "an @nnx.jit step capturing its Rngs": (
        lambda m, o: Trainer(m, o, train_step=captures_rngs),
        r"train_step captures an NNX object \(Rngs\) \(the global 'CAPTURED_RNGS'\).*extras",
    ),
    "extras without train_step": (
        lambda m, o: Trainer(m, TX, xent, extras=(nnx.Rngs(0),)),
        r"extras= goes with a stateful train_step",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS), ids=list(BAD_ARGUMENTS))
def test_wrong_arguments_raise_a_type_error_before_compiling_and_change_nothing(
    case, compile_count
):
    build, message = BAD_ARGUMENTS[case]
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    before, compiled = state_arrays(model) + state_arrays(optimizer), compile_count()
    with pytest.raises(TypeError, match=message):
        build(model, optimizer)
    assert compile_count() == compiled
    for got, want in zip(state_arrays(model) + state_arrays(optimizer), before, strict=True):
        np.testing.assert_array_equal(got, want)
