"""The shell (Trainer, scan_train) against the plain per-step NNX loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import Plan, Trainer, scan_train
from nnxscan.shell._engine import programs as programs_module

from conftest import (
    MLP,
    BNDropout,
    SmallCNN,
    accuracy,
    assert_trees_close,
    epoch_batches,
    make_data,
    reference_loop,
    state_arrays,
    xent,
    xent_aux,
)

TX = optax.adam(1e-2)
BS = 8


def reference_fit(model_cls, data, *, epochs, batch_size=BS, seed=0, tx=TX, loss_fn=xent):
    model = model_cls(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    losses = []
    for epoch in range(epochs):
        losses += reference_loop(
            model, optimizer, loss_fn, epoch_batches(data, batch_size, seed, epoch)
        )
    return model, optimizer, np.array(losses)


@pytest.mark.parametrize("execution", ["auto", "scan", "unrolled", "step", Plan("unrolled", 3)])
def test_fit_equals_per_step_nnx_loop_for_every_plan(data, execution):
    ref, _, ref_losses = reference_fit(BNDropout, data, epochs=2)
    model = BNDropout(rngs=nnx.Rngs(0))
    history = Trainer(model, TX, xent, execution=execution).fit(
        data, epochs=2, batch_size=BS, progress=False
    )
    np.testing.assert_allclose(history.losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(model, ref)
    assert [e["epoch"] for e in history.epochs] == [0, 1]
    np.testing.assert_allclose(history.epochs[1]["loss"], ref_losses[8:].mean(), rtol=1e-5)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
@pytest.mark.parametrize("execution", ["auto", "scan", "step"])
def test_data_smaller_than_a_batch_trains_one_short_batch_with_drop_remainder_false(
    data, execution
):
    """The error for batch_size > examples says "or drop_remainder=False to train on one
    short batch": that call trains each epoch on one batch of every example, as the plain
    per-step loop does on the same (shuffled) batch."""
    small = {k: v[:5] for k, v in data.items()}
    ref = BNDropout(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    ref_losses = []
    for epoch in range(3):
        order = np.random.default_rng((4, epoch)).permutation(5)
        batch = {k: v[order] for k, v in small.items()}  # the one short batch
        ref_losses += reference_loop(ref, optimizer, xent, [batch])
    model = BNDropout(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent, execution=execution)
    with pytest.raises(ValueError, match="or drop_remainder=False to train on one short batch"):
        trainer.fit(small, epochs=3, batch_size=BS, seed=4, progress=False)
    assert trainer.step == 0
    history = trainer.fit(small, epochs=3, batch_size=BS, seed=4, drop_remainder=False,
                          progress=False)  # fmt: skip
    assert (trainer.epoch, trainer.step) == (3, 3)
    np.testing.assert_allclose(history.losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(model, ref)


def test_fit_with_nnx_optimizer_updates_it_like_optimizer_update(data):
    ref, ref_opt, _ = reference_fit(MLP, data, epochs=2)
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    Trainer(model, optimizer, xent).fit(data, epochs=2, batch_size=BS, progress=False)
    assert int(optimizer.step[...]) == int(ref_opt.step[...]) == 16
    assert_trees_close(optimizer, ref_opt)
    assert_trees_close(model, ref)


def test_scan_train_updates_model_and_optimizer_exactly_as_optimizer_update(data, compile_count):
    batches = {k: v[:48].reshape(6, BS, *v.shape[1:]) for k, v in data.items()}
    ref = BNDropout(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    steps = [{k: v[i] for k, v in batches.items()} for i in range(6)]
    ref_losses = reference_loop(ref, ref_opt, xent, steps + steps)

    model = BNDropout(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    first = scan_train(model, optimizer, xent, batches)
    compiled = compile_count()
    second = scan_train(model, optimizer, xent, batches)
    assert compile_count() == compiled, "a second scan_train with the same objects recompiled"
    np.testing.assert_allclose(
        np.concatenate([first, second]), np.array(ref_losses), rtol=1e-5, atol=1e-6
    )
    assert int(optimizer.step[...]) == 12
    assert_trees_close(model, ref)
    assert_trees_close(optimizer, ref_opt)


def test_fit_twice_is_bitwise_fit_once_longer(data):
    once = MLP(rngs=nnx.Rngs(0))
    Trainer(once, TX, xent).fit(data, epochs=4, batch_size=BS, seed=3, progress=False)
    twice = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(twice, TX, xent)
    trainer.fit(data, epochs=2, batch_size=BS, seed=3, progress=False)
    trainer.fit(data, epochs=2, batch_size=BS, seed=3, progress=False)
    assert trainer.epoch == 4 and trainer.step == 4 * (len(data["x"]) // BS)
    assert_trees_close(once, twice, exact=True)


def test_second_fit_with_the_same_shapes_compiles_nothing(data, compile_count):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    trainer.evaluate(data, accuracy, batch_size=BS)
    before = compile_count()
    # The same shapes and the same epochs per call (another count of fused epochs is
    # another program, compiled once: tests/test_fit_compiles.py).
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    trainer.evaluate(data, accuracy, batch_size=BS)
    # A new Trainer on the same objects shares the cached program too.
    Trainer(trainer.model, TX, xent).fit(data, epochs=1, batch_size=BS, progress=False)
    assert compile_count() == before


class Boom(Exception):
    pass


class RaiseAt:
    def __init__(self, epoch, exc=Boom):
        self.epoch, self.exc = epoch, exc

    def on_epoch_end(self, trainer, epoch, logs):
        if epoch == self.epoch:
            raise self.exc()


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_interrupted_fit_leaves_the_last_completed_state_and_can_resume(data, exc):
    ref, _, _ = reference_fit(MLP, data, epochs=2)
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    with pytest.raises(exc):
        trainer.fit(data, epochs=5, batch_size=BS, callbacks=[RaiseAt(1, exc)], progress=False)
    assert_trees_close(model, ref)  # usable: no deleted buffer, holds epoch 1's state
    model(data["x"])
    trainer.fit(data, epochs=2, batch_size=BS, progress=False)
    ref4, _, _ = reference_fit(MLP, data, epochs=4)
    assert_trees_close(model, ref4)


def test_failure_mid_epoch_with_step_plan_keeps_the_last_completed_step(data, monkeypatch):
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    trainer = Trainer(model, optimizer, xent, execution="step")
    program = trainer._engine.program
    real_runner = program.runner
    calls = {"n": 0}

    def flaky_runner(*args, **kwargs):
        real = real_runner(*args, **kwargs)

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 4:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        return flaky

    monkeypatch.setattr(program, "runner", flaky_runner)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    ref = MLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    reference_loop(ref, ref_opt, xent, epoch_batches(data, BS, 0, 0)[:3])
    assert int(optimizer.step[...]) == 3 and trainer.step == 3
    assert_trees_close(model, ref)
    assert_trees_close(optimizer, ref_opt)


def test_callbacks_see_the_synced_model_and_can_stop(data):
    seen = []

    class Probe:
        def on_epoch_end(self, trainer, epoch, logs):
            seen.append((epoch, float(trainer.evaluate(data, accuracy, batch_size=64)["accuracy"])))
            trainer.stop_training = epoch == 1

    model = MLP(rngs=nnx.Rngs(0))
    history = Trainer(model, TX, xent).fit(
        data, epochs=5, batch_size=BS, callbacks=[Probe(), object()], progress=False
    )
    assert [e for e, _ in seen] == [0, 1] and len(history.epochs) == 2
    ref, _, _ = reference_fit(MLP, data, epochs=2)
    np.testing.assert_allclose(
        seen[-1][1], np.mean(np.asarray(ref(data["x"]).argmax(-1)) == data["y"])
    )


def test_history_logs_aux_means_and_speed(data):
    history = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent_aux, has_aux=True).fit(
        data, epochs=2, batch_size=BS, progress=False
    )
    logs = history.epochs[-1]
    assert {"epoch", "loss", "acc", "steps", "steps_per_sec", "wall_time"} <= set(logs)
    assert history.losses.shape == (16,) and logs["steps"] == 8
    assert 0.0 <= logs["acc"] <= 1.0 and logs["steps_per_sec"] > 0


def test_evaluate_averages_every_example_with_ragged_tail():
    d = make_data(n=29)
    model = BNDropout(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    before = state_arrays(model)
    out = trainer.evaluate(d, accuracy, batch_size=8)
    model.eval()
    expected = np.mean(np.asarray(model(d["x"]).argmax(-1)) == d["y"])
    model.train()
    assert out == {"accuracy": pytest.approx(expected, rel=1e-6)}
    for a, b in zip(before, state_arrays(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_auto_plan_rule():
    # CNNs scan on the CPU too: the compiled programs canonicalize convolution layouts
    # themselves, so a loop body no longer runs their gradients slowly (jax#12868).
    x = np.zeros((8, 8, 8, 1), np.float32)
    cnn = Trainer(SmallCNN(rngs=nnx.Rngs(0)), TX, xent)
    mlp = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    assert cnn.plan_for({"x": x, "y": np.zeros(8, np.int32)}, 4) == Plan("scan")
    assert mlp.plan_for(make_data(8), 4) == Plan("scan")


def test_cnn_unrolled_plan_equals_per_step_loop():
    rng = np.random.default_rng(0)
    d = {
        "x": rng.normal(size=(24, 8, 8, 1)).astype(np.float32),
        "y": rng.integers(0, 3, 24).astype(np.int32),
    }
    ref, _, ref_losses = reference_fit(SmallCNN, d, epochs=1, batch_size=4)
    model = SmallCNN(rngs=nnx.Rngs(0))
    history = Trainer(model, TX, xent).fit(d, epochs=1, batch_size=4, progress=False)
    np.testing.assert_allclose(history.losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(model, ref, rtol=1e-4, atol=1e-6)


def test_progress_bar_prints_only_when_asked(data, capsys):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    assert capsys.readouterr().out == ""
    trainer.fit(data, epochs=2, batch_size=BS, progress=True)
    lines = capsys.readouterr().out.splitlines()  # not a terminal: one line per epoch
    assert len(lines) == 2 and lines[1].startswith("epoch 2  loss ") and "steps/s" in lines[1]


def test_progress_bar_in_a_terminal_shows_loss_rate_and_eta():
    import io

    import jax.numpy as jnp
    from rich.console import Console

    from nnxscan.shell._edges.progress import RunProgress
    from nnxscan.shell._engine.layout import ONE_MODEL

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with RunProgress(2 * 3, True, console=console, layout=ONE_MODEL) as bar:
        for epoch in range(2):
            for _ in range(3):
                bar.call_done(epoch, 10, jnp.array([0.5, 0.25]))
            bar.epoch_done(epoch, {"loss": 0.3, "steps_per_sec": 1000.0, "eval_acc": 0.9})
    shown = out.getvalue()
    assert "6/6" in shown and "loss 0.3" in shown and "eval_acc 0.9" in shown


# -- bad input: a clear error, nothing compiled, nothing mutated -------------------------------


def _bad_fit_cases(data):
    x, y = data["x"], data["y"]
    return [
        (dict(data={"x": x, "y": y[:-1]}, epochs=1, batch_size=BS), ValueError, r"64.*63"),
        (dict(data={"x": x[:0], "y": y[:0]}, epochs=1, batch_size=BS), ValueError, "empty"),
        (dict(data={}, epochs=1, batch_size=BS), ValueError, "empty"),
        (dict(data=data, epochs=1, batch_size=0), ValueError, "at least 1, got 0"),
        (dict(data=data, epochs=1, batch_size=65), ValueError, "65.*64"),
        (dict(data={"x": x, "y": y, "name": "digits"}, epochs=1, batch_size=BS), TypeError, "name"),
        (dict(data={"x": x, "y": [object()] * 64}, epochs=1, batch_size=BS), TypeError, "object"),
        (dict(data=data, epochs=-1, batch_size=BS), ValueError, "epochs"),
        (dict(data=data, epochs=1.5, batch_size=BS), TypeError, "epochs"),
    ]


def test_bad_fit_inputs_raise_before_compiling_and_mutate_nothing(data, compile_count):
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    trainer = Trainer(model, optimizer, xent)
    before_model, before_opt = state_arrays(model), state_arrays(optimizer)
    compiles = compile_count()
    for kwargs, error, pattern in _bad_fit_cases(data):
        with pytest.raises(error, match=pattern):
            trainer.fit(**kwargs, progress=False)
    assert compile_count() == compiles
    for a, b in zip(
        before_model + before_opt, state_arrays(model) + state_arrays(optimizer), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    assert trainer.step == 0 and trainer.epoch == 0


def test_non_scalar_loss_raises_and_mutates_nothing(data):
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    before = state_arrays(model) + state_arrays(optimizer)
    for execution in ["auto", "step"]:
        trainer = Trainer(model, optimizer, lambda m, b: m(b["x"]), execution=execution)
        with pytest.raises(ValueError, match="scalar"):
            trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    with pytest.raises(ValueError, match="scalar"):
        scan_train(
            model,
            optimizer,
            lambda m, b: m(b["x"]).sum(-1),
            {k: v[:16].reshape(2, 8, -1) for k, v in {"x": data["x"]}.items()},
        )
    for a, b in zip(before, state_arrays(model) + state_arrays(optimizer), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_constructor_arguments():
    model = MLP(rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="GradientTransformation"):
        Trainer(model, "adam", xent)
    with pytest.raises(TypeError, match=r"nnx\.Module"):
        Trainer({"w": jnp.zeros(3)}, TX, xent)
    with pytest.raises(ValueError, match="selects no variable"):
        Trainer(model, TX, xent, wrt=nnx.BatchStat)
    with pytest.raises(ValueError, match="not a plan"):
        Trainer(model, TX, xent, execution="fast")
    with pytest.raises(ValueError, match="differs"):
        Trainer(model, nnx.Optimizer(model, TX, wrt=nnx.Param), xent, wrt=nnx.PathContains("l1"))
    other = nnx.Optimizer(MLP(din=5, rngs=nnx.Rngs(0)), TX, wrt=nnx.Param)
    with pytest.raises(ValueError, match="another model"):
        Trainer(model, other, xent)
    with pytest.raises(TypeError, match=r"nnx\.Optimizer"):
        scan_train(model, TX, xent, make_data(8))


def test_program_cache_is_bounded():
    from nnxscan.shell._engine.caching import MAX_CACHED

    before = len(programs_module._TRAIN)
    for _ in range(MAX_CACHED + 5):
        programs_module.train_program(lambda m, b: 0.0, TX, nnx.Param, False)
    assert len(programs_module._TRAIN) <= MAX_CACHED
    assert before <= MAX_CACHED
