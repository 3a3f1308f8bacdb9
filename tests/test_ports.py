"""Existing Flax code, brought as it is: the NNX MNIST tutorial, a Linen model, flat data.

The references are the code's own loops: the tutorial's ``nnx.jit`` train and eval steps
(copied from Flax's docs_nnx/mnist_tutorial.md as of flax 0.12.8), and a Linen
``TrainState`` loop.
"""

from __future__ import annotations

import itertools
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

from nnxscan.adapters.linen import LinenModule
from nnxscan.pure import init_opt_state, make_evaluate_metrics, make_train_step, scan_steps
from nnxscan.shell import Trainer, scan_train

from conftest import (
    ACROSS_PROGRAMS,
    MLP,
    TRAINED_CNN_ON_ACCELERATOR,
    assert_trees_close,
    make_data,
    reference_loop,
    tolerance,
    xent,
)

# -- the Flax NNX MNIST tutorial, verbatim (model, loss, metrics, train and eval steps) -------


class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        x = self.linear2(x)
        return x


def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


@nnx.jit
def train_step(model, optimizer, metrics, rngs, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


@nnx.jit
def eval_step(model, metrics, batch):
    loss, logits = loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


def tutorial_objects():
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def update_metrics(metrics, loss, logits, batch):
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


@pytest.fixture(scope="module")
def mnist_like():
    """scikit-learn's 8x8 digits blown up to the tutorial's 28x28x1 (tiny: 96 + 40)."""
    import sklearn.datasets as datasets

    x, y = datasets.load_digits(return_X_y=True)
    images = np.kron(x.reshape(-1, 8, 8) / 16.0, np.ones((3, 3)))  # 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))[..., None].astype(np.float32)
    train = {"image": images[:96], "label": y[:96].astype(np.int32)}
    test = {"image": images[96:136], "label": y[96:136].astype(np.int32)}
    return train, test


def batches_of(data, size):
    n = len(data["label"]) // size
    return [{k: v[i * size : (i + 1) * size] for k, v in data.items()} for i in range(n)]


@pytest.fixture(scope="module")
def tutorial_run(mnist_like):
    """The tutorial's own loop: 2 epochs of 3 steps, metrics computed and reset per epoch,
    then its evaluation loop over the test set."""
    train, test = mnist_like
    model, optimizer, metrics = tutorial_objects()
    rngs = nnx.Rngs(0)
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)
    per_epoch = []
    for _ in range(2):
        for batch in batches_of(train, 32):
            train_step(train_model, optimizer, metrics, rngs, batch)
        per_epoch.append({k: float(v) for k, v in metrics.compute().items()})
        metrics.reset()
    for batch in batches_of(test, 8):
        eval_step(eval_model, metrics, batch)
    evaluation = {k: float(v) for k, v in metrics.compute().items()}
    return model, optimizer, rngs, per_epoch, evaluation


def assert_close_but_biases_before_batchnorm(got, want, biases: set[str], bound: float):
    """Every float leaf to rounding (two programs: conftest's ACROSS_PROGRAMS, or
    TRAINED_CNN_ON_ACCELERATOR on an accelerator), integers
    exactly, except the biases (and their optimizer state) of the layers feeding a
    BatchNorm: the normalization removes them, so their gradient is rounding noise, which
    Adam turns into steps of up to its learning rate either way; the two programs' noise
    may differ, so those are only held within ``bound`` (the steps' rates summed, twice)."""
    want_leaves = dict(jax.tree_util.tree_leaves_with_path(state_arrays_by_path(want)))
    close = tolerance(**ACROSS_PROGRAMS, accelerator=TRAINED_CNN_ON_ACCELERATOR)
    for path, a in jax.tree_util.tree_leaves_with_path(state_arrays_by_path(got)):
        name = [str(getattr(k, "key", k)) for k in path]
        b = want_leaves[path]
        if not np.issubdtype(a.dtype, np.inexact):
            np.testing.assert_array_equal(a, b, err_msg=str(name))
        elif "bias" in name and biases & set(name):
            np.testing.assert_allclose(a, b, rtol=0, atol=bound, err_msg=str(name))
        else:
            np.testing.assert_allclose(a, b, **close, err_msg=str(name))


def state_arrays_by_path(node):
    """``nnx.state(node)`` as host arrays (RNG keys as their raw data), paths kept."""

    def host(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(host, nnx.state(node))


# "auto" scans the epoch: on the CPU its convolutions are canonicalized like the tutorial's
# per-step program's, so it runs the same convolution kernels. Still two programs, so to
# rounding (on the CPUs tested, bitwise).
@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
@pytest.mark.parametrize("execution", [pytest.param("step", marks=pytest.mark.slow), "auto"])
def test_the_mnist_tutorial_runs_through_trainer_as_its_own_loop(
    mnist_like, tutorial_run, execution
):
    train, test = mnist_like
    ref_model, ref_optimizer, ref_rngs, ref_epochs, ref_eval = tutorial_run
    # The port of the tutorial's training section: its own objects, no edit to them.
    model, optimizer, metrics = tutorial_objects()
    rngs = nnx.Rngs(0)
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    trainer = Trainer(
        train_model, optimizer, loss_fn, has_aux=True, rngs=rngs, metrics=metrics,
        update_metrics=update_metrics, execution=execution,
    )  # fmt: skip
    history = trainer.fit(train, epochs=2, batch_size=32, shuffle=False, progress=False)

    convs = {"conv1", "conv2"}  # each feeds a BatchNorm; adamw at 0.005, 6 steps
    assert_close_but_biases_before_batchnorm(model, ref_model, convs, 2 * 6 * 0.005)
    assert_trees_close(rngs, ref_rngs, exact=True)  # RNG keys and counts: integers
    assert_close_but_biases_before_batchnorm(optimizer, ref_optimizer, convs, 2 * 6 * 0.005)
    for logs, ref in zip(history.epochs, ref_epochs, strict=True):
        # An argmax may flip between the two programs' roundings: one example of 96.
        assert logs["train_accuracy"] == pytest.approx(ref["accuracy"], abs=1.01 / 96)
        # The loss is not on the gradients' path: XLA may reduce it in another order in
        # the two programs (1 ulp on an AVX-512 machine, bitwise on others).
        np.testing.assert_allclose(
            logs["train_loss"],
            ref["loss"],
            **tolerance(1e-5, 0, accelerator=TRAINED_CNN_ON_ACCELERATOR),
        )
    # Its evaluation loop: the trainer's metrics, in eval mode, never touching the objects.
    before = [np.array(x) for x in jax.tree.leaves(nnx.state(metrics))]
    evaluation = trainer.evaluate(test, batch_size=8)
    assert evaluation.keys() == ref_eval.keys()
    for key, value in ref_eval.items():  # accuracy over 40 examples: one may flip
        close = tolerance(1e-5, 0, accelerator=TRAINED_CNN_ON_ACCELERATOR)
        np.testing.assert_allclose(evaluation[key], value, rtol=close["rtol"], atol=1.01 / 40)
    after = [np.array(x) for x in jax.tree.leaves(nnx.state(metrics))]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert_trees_close(rngs, ref_rngs, exact=True)


@pytest.mark.slow
def test_the_tutorial_step_in_the_pure_core_under_scan(mnist_like, tutorial_run):
    """with_rngs / update_metrics in the pure core, scanned: the tutorial's numbers."""
    train, _ = mnist_like
    _, _, ref_rngs, ref_epochs, _ = tutorial_run
    model, _, metrics = tutorial_objects()
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    tx = optax.adamw(0.005, 0.9)
    step = make_train_step(loss_fn, tx, has_aux=True, with_rngs=True, update_metrics=update_metrics)
    graphdef, state = nnx.split((train_model, nnx.Rngs(0), metrics))
    opt_state = init_opt_state(tx, state)
    batches = jax.tree.map(lambda *xs: np.stack(xs), *batches_of(train, 32))
    run = jax.jit(scan_steps, static_argnums=(0, 1))
    state, opt_state, _ = run(step, graphdef, state, opt_state, batches)
    node = nnx.merge(graphdef, state)
    np.testing.assert_allclose(float(node[2].compute()["accuracy"]), ref_epochs[0]["accuracy"])
    assert int(node[1].default.count[...]) == int(ref_rngs.default.count[...]) // 2


def test_a_loss_closing_over_rngs_is_refused_before_compiling(compile_count):
    rngs, model, metrics = nnx.Rngs(0), MLP(rngs=nnx.Rngs(0)), nnx.metrics.Average("loss")
    tx = optax.adam(1e-3)
    before = compile_count()
    with pytest.raises(TypeError, match=r"captures an nnx.Rngs .*'rngs'.*rngs=") as err:
        Trainer(model, tx, lambda m, b: loss_fn(m, b, rngs))
    assert "Trainer (or scan_train) as rngs=" in str(err.value)
    with pytest.raises(TypeError, match=r"NNX metric.*metrics="):
        Trainer(model, tx, partial(_uses_metric, metrics=metrics))
    assert compile_count() == before


def _uses_metric(model, batch, metrics):
    return xent(model, batch)


def test_an_optimizer_and_a_transform_together_get_a_helpful_error():
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with pytest.raises(TypeError, match=r"takes ONE of an nnx.Optimizer or an optax transform"):
        Trainer(model, optimizer, optax.adam(1e-2), xent)
    with pytest.raises(TypeError, match="takes ONE of"):
        Trainer(model, optimizer, optax.adam(1e-2))


def test_metrics_need_update_metrics_and_evaluate_needs_something(data):
    model = MLP(rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="go together"):
        Trainer(model, optax.adam(1e-2), xent, metrics=nnx.metrics.Average("loss"))
    trainer = Trainer(model, optax.adam(1e-2), xent)
    with pytest.raises(ValueError, match=r"a metric_fn, or NNX metrics"):
        trainer.evaluate(data, batch_size=8)
    with pytest.raises(ValueError, match=r"a metric_fn, or NNX metrics"):
        trainer.fit(data, epochs=1, batch_size=8, eval_data=data, progress=False)


def test_pure_metric_evaluation_counts_every_example(data):
    """make_evaluate_metrics against a hand loop of metric updates, short batch included."""
    model = MLP(rngs=nnx.Rngs(0))
    metrics = nnx.metrics.Accuracy()
    evaluate = jax.jit(
        make_evaluate_metrics(
            lambda m, b: (xent(m, b), m(b["x"])),
            lambda mt, loss, logits, b: mt.update(logits=logits, labels=b["y"]),
            batch_size=24,
            has_aux=True,
        )
    )
    got = evaluate(*nnx.split((model, metrics)), data)
    want = np.mean(np.argmax(np.asarray(model(data["x"])), -1) == data["y"])
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    # The caller's metrics object is not the one that counted: it still holds nothing.
    assert all(float(x) == 0 for x in jax.tree.leaves(nnx.state(metrics)))


# -- scan_train on flat data, with call-time Rngs -----------------------------------------------


@pytest.mark.slow
def test_scan_train_cuts_flat_data_and_refuses_it_without_batch_size():
    data = make_data(70)
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"\['y'\] has shape \(70,\).*batch_size=B"):
        scan_train(model, optimizer, xent, data)
    losses = scan_train(model, optimizer, xent, data, batch_size=16, drop_remainder=False)
    assert losses.shape == (5,) and int(optimizer.step[...]) == 5  # 4 x 16 + 6
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    stops = [0, 16, 32, 48, 64, 70]
    # The plain per-step loop, jitted (conftest's): run eagerly it took ~10 s.
    reference_loop(ref, ref_opt, xent, [{k: v[a:b] for k, v in data.items()}
                                        for a, b in itertools.pairwise(stops)])  # fmt: skip
    assert_trees_close(model, ref, rtol=2e-5, atol=1e-6)


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_scan_train_with_call_time_rngs_matches_the_plain_loop():
    class Noisy(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.5)

        def __call__(self, x, rngs):
            return self.drop(self.lin(x), rngs=rngs)

    def noisy_loss(model, batch, rngs):
        logits = model(batch["x"], rngs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    data = make_data(64)
    model, rngs = Noisy(nnx.Rngs(0)), nnx.Rngs(5)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    scan_train(model, optimizer, noisy_loss, data, batch_size=16, rngs=rngs)
    ref, ref_rngs = Noisy(nnx.Rngs(0)), nnx.Rngs(5)
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    for i in range(4):
        batch = {k: v[i * 16 : (i + 1) * 16] for k, v in data.items()}
        ref_opt.update(ref, nnx.grad(noisy_loss)(ref, batch, ref_rngs))
    assert_trees_close(rngs, ref_rngs, exact=True)
    assert_trees_close(model, ref, rtol=1e-5, atol=1e-6)


# -- Linen through nnx.bridge ------------------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(3)(nn.relu(x))


def linen_xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.mark.slow
def test_a_linen_model_trains_as_a_train_state_loop_and_evaluates_in_eval_mode(data):
    batches = [{k: v[i * 16 : (i + 1) * 16] for k, v in data.items()} for i in range(4)]
    model = LinenModule(LinenMLP(), data["x"][:8], rngs=nnx.Rngs(0, dropout=1))
    trainer = Trainer(
        model, optax.adam(1e-2), lambda m, b: linen_xent(m(b["x"]), b["y"]), execution="step"
    )
    trainer.fit(data, epochs=1, batch_size=16, shuffle=False, progress=False)

    # The Linen loop: TrainState, mutable batch_stats, a dropout key per step drawn from
    # the same streams ToNNX draws from (it forks the Rngs it is given, then draws params
    # and dropout keys once at init and once a call).
    keys = nnx.Rngs(0, dropout=1).fork()
    init = LinenMLP().init({"params": keys.default(), "dropout": keys.dropout()},
                           data["x"][:8], train=False)  # fmt: skip
    state = train_state.TrainState.create(
        apply_fn=LinenMLP().apply, params=init["params"], tx=optax.adam(1e-2)
    )
    batch_stats = init["batch_stats"]

    @jax.jit
    def linen_step(state, batch_stats, batch, dropout_key):
        def loss(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": batch_stats}, batch["x"], train=True,
                mutable=["batch_stats"], rngs={"dropout": dropout_key},
            )  # fmt: skip
            return linen_xent(logits, batch["y"]), updates["batch_stats"]

        (_, new_stats), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), new_stats

    for batch in batches:
        keys.default()
        state, batch_stats = linen_step(state, batch_stats, batch, keys.dropout())

    ours = nnx.state(model.inner, nnx.Not(nnx.RngState))
    params, stats = jax.tree.map(np.asarray, (state.params, batch_stats))
    want = {layer: {**params.get(layer, {}), **stats.get(layer, {})} for layer in params}
    for path, leaf in jax.tree_util.tree_leaves_with_path(ours):
        layer, name = path[0].key, path[1].key
        # Two programs (Trainer's step, the TrainState loop's): to rounding (conftest),
        # but Dense_0's bias, before the BatchNorm: rounding noise that Adam turns into
        # steps of up to its rate (1e-2, 4 steps).
        if (layer, name) == ("Dense_0", "bias"):
            np.testing.assert_allclose(np.asarray(leaf), want[layer][name], atol=2 * 4 * 1e-2)
        else:
            np.testing.assert_allclose(np.asarray(leaf), want[layer][name], **ACROSS_PROGRAMS)

    def accuracy(model, batch):
        return jnp.mean(model(batch["x"]).argmax(-1) == batch["y"])

    evaluated = trainer.evaluate(data, accuracy, batch_size=16)["accuracy"]
    logits = LinenMLP().apply({"params": state.params, "batch_stats": batch_stats},
                              data["x"], train=False)  # fmt: skip
    assert evaluated == pytest.approx(float(np.mean(np.argmax(logits, -1) == data["y"])))
    assert model.deterministic is False  # evaluation switched a copy, not the model
