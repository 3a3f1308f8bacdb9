"""Population.fit beyond plain epochs: frozen members, per-member EarlyStopping, evaluation
during fit, non-finite policies, plans, checkpoints and a mesh, each against single-model
runs (Trainer, a hand-computed loss) or a straight uninterrupted population run."""

from __future__ import annotations

import csv
import functools
import io
import json
import os
import pathlib
import signal
import subprocess
import sys
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from nnxscan.adapters.writers import CSVWriter, JSONLinesWriter, TextLogger
from nnxscan.pure import unstack_states
from nnxscan.shell import EarlyStopping, LambdaCallback, Population, Preempted, Trainer

from conftest import (
    MLP,
    SmallCNN,
    assert_trees_close,
    epoch_batches,
    make_data,
    state_arrays,
    xent,
)

# One optimizer object per configuration: the shell caches its compiled programs by the
# optimizer, so the reference Trainer of each member reuses them (optax transforms hold no
# state: sharing one changes nothing that is trained).
TX = optax.adam(1e-2)
BS = 8
SEEDS = [0, 1, 2]
WORKER = str(pathlib.Path(__file__).with_name("population_mesh_worker.py"))


def mlp(rngs: nnx.Rngs) -> nnx.Module:
    return MLP(rngs=rngs)


@functools.cache
def injected_adam(learning_rate: float = 1e-2) -> optax.GradientTransformation:
    return optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate)


def eval_loss(model, batch):
    return xent(model, batch)


def trainer_run(seed, data, epochs, *, rate=1e-2, **options):
    """Member ``seed`` trained alone by a Trainer: the reference every test compares to."""
    fit_keys = ("callbacks", "eval_data", "metric_fn")
    fit_options = {k: options.pop(k) for k in fit_keys if k in options}
    trainer = Trainer(MLP(rngs=nnx.Rngs(seed)), injected_adam(rate), xent, **options)
    history = trainer.fit(
        data, epochs=epochs, batch_size=BS, seed=seed, progress=False, **fit_options
    )
    return trainer, history


@pytest.mark.slow
def test_a_frozen_member_stays_bitwise_and_logs_its_loss_at_the_frozen_state(data):
    pop = Population(mlp, injected_adam(), xent, seeds=SEEDS)
    before = unstack_states(pop.state)[1], unstack_states(pop.opt_state)[1]
    pop.freeze(1)
    history = pop.fit(data, epochs=2, batch_size=BS)
    assert_trees_close(unstack_states(pop.state)[1], before[0], exact=True)
    assert_trees_close(unstack_states(pop.opt_state)[1], before[1], exact=True)
    assert history.epochs[-1]["active"].tolist() == [True, False, True]
    # Its losses: the untrained model on member 1's own batches.
    frozen = MLP(rngs=nnx.Rngs(1))
    expected = [float(xent(frozen, b)) for e in range(2) for b in epoch_batches(data, BS, 1, e)]
    np.testing.assert_allclose(history.losses[:, 1], expected, rtol=1e-5)
    for i in (0, 2):  # the others train as if alone
        trainer, alone = trainer_run(SEEDS[i], data, 2)
        np.testing.assert_allclose(history.losses[:, i], alone.losses, rtol=1e-5, atol=1e-6)
        assert_trees_close(pop.member(i), trainer.model)
    pop.unfreeze()
    assert pop.active.all()
    with pytest.raises(ValueError, match="member index"):
        pop.freeze(3)


@pytest.mark.slow
def test_early_stopping_freezes_each_member_as_its_own_trainer_stops(tmp_path):
    """Each member stops at the epoch its own Trainer + EarlyStopping stops at, and ends
    with the weights that run restores: the members' best epochs differ."""
    full = make_data(112)  # held-out examples of the same task
    data, test = ({k: v[a:b] for k, v in full.items()} for a, b in ((0, 64), (64, 112)))
    rates = [3e-1, 3e-2, 3e-3]
    options = dict(eval_data=test, metric_fn=eval_loss)
    pop = Population(mlp, injected_adam(), xent, seeds=SEEDS, hyperparams={"learning_rate": rates})
    stop = EarlyStopping("eval_eval_loss", patience=2, min_delta=1e-2, verbose=False)
    history = pop.fit(
        data, epochs=12, batch_size=BS, callbacks=[stop], checkpoint_dir=tmp_path, **options
    )
    # The last checkpoint holds the members' restored best weights, not their last ones.
    saved = Population(
        mlp, injected_adam(), xent, seeds=SEEDS, hyperparams={"learning_rate": rates}
    )
    saved.restore(tmp_path)
    for a, b in zip(state_arrays(saved.state), state_arrays(pop.state), strict=True):
        np.testing.assert_array_equal(a, b)
    stopped = []
    for i, (seed, rate) in enumerate(zip(SEEDS, rates, strict=True)):
        alone_stop = EarlyStopping("eval_eval_loss", patience=2, min_delta=1e-2, verbose=False)
        trainer, alone = trainer_run(seed, data, 12, rate=rate, callbacks=[alone_stop], **options)
        epochs_run = len(alone.epochs)
        evals = [e["eval_eval_loss"][i] for e in history.epochs[:epochs_run]]
        np.testing.assert_allclose(evals, [e["eval_eval_loss"] for e in alone.epochs], rtol=1e-4)
        expected_stop = -1 if alone_stop.stopped_epoch is None else alone_stop.stopped_epoch
        assert stop.stopped_epoch[i] == expected_stop
        assert stop.best_epoch[i] == alone_stop.best_epoch
        assert_trees_close(pop.member(i), trainer.model, rtol=1e-4, atol=1e-5)
        stopped.append(expected_stop)
    assert stopped == [2, 10, -1], "the members should stop at different epochs (or not)"
    assert len(history.epochs) == 12 and pop.active.tolist() == [False, False, True]


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_skip_nonfinite_is_per_member(data):
    """A NaN example poisons the step each member meets it at, at a different step per
    member (each has its own order): skipping it leaves the others untouched."""
    poisoned = {k: v.copy() for k, v in data.items()}
    poisoned["x"][5, 0] = np.nan
    pop = Population(mlp, injected_adam(), xent, seeds=SEEDS, on_nonfinite="skip")
    history = pop.fit(poisoned, epochs=2, batch_size=BS)
    for i, seed in enumerate(SEEDS):
        trainer, alone = trainer_run(seed, poisoned, 2, on_nonfinite="skip")
        np.testing.assert_allclose(history.losses[:, i], alone.losses, rtol=1e-5, atol=1e-6)
        assert history.epochs[-1]["skipped_steps"][i] == alone.epochs[-1]["skipped_steps"]
        assert_trees_close(pop.member(i), trainer.model)
    assert history.epochs[0]["skipped_steps"].tolist() == [1, 1, 1]


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_stop_nonfinite_freezes_the_member_at_the_state_before_its_step(data):
    poisoned = {k: v.copy() for k, v in data.items()}
    poisoned["x"][5, 0] = np.nan
    pop = Population(mlp, injected_adam(), xent, seeds=SEEDS, on_nonfinite="stop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = pop.fit(poisoned, epochs=2, batch_size=BS)
    said = sorted(str(w.message) for w in caught if w.category is RuntimeWarning)
    assert {w.filename for w in caught if w.category is RuntimeWarning} == {__file__}
    assert [m.split(":")[0] for m in said] == ["member 0", "member 1", "member 2"]
    steps = [int(m.split("global step ")[1].split()[0]) for m in said]
    nan_steps = [int(np.argmax(np.isnan(history.losses[:, i]))) for i in range(3)]
    assert steps == nan_steps and len(set(steps)) > 1, (steps, nan_steps)
    assert not pop.active.any()
    assert len(history.epochs) == 1, "fit ends when every member has halted"
    for i, seed in enumerate(SEEDS):
        trainer = Trainer(MLP(rngs=nnx.Rngs(seed)), injected_adam(), xent, on_nonfinite="stop")
        with pytest.raises(FloatingPointError):
            trainer.fit(poisoned, epochs=2, batch_size=BS, seed=seed, progress=False)
        assert_trees_close(pop.member(i), trainer.model)


@pytest.mark.slow_on_accelerator("a CNN population and per-member per-step references: 9 s")
def test_scanned_cnn_population_equals_trainer_step_plan():
    rng = np.random.default_rng(0)
    images = {
        "x": rng.normal(size=(32, 8, 8, 1)).astype(np.float32),
        "y": rng.integers(0, 3, 32).astype(np.int32),
    }
    pop = Population(lambda rngs: SmallCNN(rngs=rngs), TX, xent, seeds=[0, 1])
    # auto scans CNNs on the CPU too (convolutions canonicalized in the compiled programs)
    assert pop.plan_for(images, BS).kind == "scan"
    history = pop.fit(images, epochs=1, batch_size=BS)
    for i in range(2):
        trainer = Trainer(SmallCNN(rngs=nnx.Rngs(i)), TX, xent, execution="step")
        alone = trainer.fit(images, epochs=1, batch_size=BS, seed=i, progress=False)
        np.testing.assert_allclose(history.losses[:, i], alone.losses, rtol=1e-5, atol=1e-6)
        assert_trees_close(pop.member(i), trainer.model, rtol=1e-4, atol=1e-6)


def test_checkpoint_resume_equals_a_straight_run(data, tmp_path):
    make = lambda: Population(  # noqa: E731
        mlp, injected_adam(), xent, seeds=SEEDS, hyperparams={"learning_rate": [1e-2, 3e-3, 1e-3]}
    )
    straight = make()
    straight.freeze(2)
    full = straight.fit(data, epochs=4, batch_size=BS)

    first = make()
    first.freeze(2)
    first.fit(data, epochs=2, batch_size=BS, checkpoint_dir=tmp_path)
    resumed = make()  # a fresh process would build it the same way
    history = resumed.fit(data, epochs=4, batch_size=BS, checkpoint_dir=tmp_path, resume=True)
    assert (resumed.epoch, resumed.step) == (4, 32)
    assert resumed.active.tolist() == [True, True, False]
    # Bitwise: calls of whole epochs, fused or not, scan the same loop body (conftest).
    for a, b in zip(state_arrays(resumed.state), state_arrays(straight.state), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(state_arrays(resumed.opt_state), state_arrays(straight.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(history.losses, full.losses)
    np.testing.assert_array_equal(history.epochs[1]["loss"], full.epochs[1]["loss"])
    # Done already: resuming again trains nothing.
    again = make().fit(data, epochs=4, batch_size=BS, checkpoint_dir=tmp_path, resume=True)
    assert len(again.epochs) == 4

    other = Population(mlp, injected_adam(), xent, seeds=[0, 1, 5])
    with pytest.raises(ValueError, match=r"seeds \[0, 1, 2\]"):
        other.restore(tmp_path)
    assert other.step == 0


def test_save_and_restore_round_trip_and_refusals(data, tmp_path):
    rates = {"learning_rate": [1e-2, 3e-3, 1e-3]}
    pop = Population(mlp, injected_adam(), xent, seeds=SEEDS, hyperparams=rates)
    pop.fit(data, epochs=1, batch_size=BS)
    pop.freeze(0)
    path = pop.save(tmp_path)
    assert path.name == str(pop.step)
    fresh = Population(mlp, injected_adam(), xent, seeds=SEEDS, hyperparams=rates)
    assert fresh.restore(tmp_path) == 1
    assert (fresh.step, fresh.epoch) == (pop.step, pop.epoch)
    assert fresh.active.tolist() == [False, True, True]
    for tree in ("state", "opt_state"):
        ours, saved = state_arrays(getattr(fresh, tree)), state_arrays(getattr(pop, tree))
        for a, b in zip(ours, saved, strict=True):
            np.testing.assert_array_equal(a, b)
    # Another population is refused before anything changes.
    other_rates = Population(
        mlp, injected_adam(), xent, seeds=SEEDS, hyperparams={"learning_rate": [0.5] * 3}
    )
    with pytest.raises(ValueError, match=r"learning_rate=\[0.01, 0.003, 0.001\]"):
        other_rates.restore(tmp_path)
    fewer = Population(mlp, injected_adam(), xent, seeds=SEEDS[:2])
    with pytest.raises(ValueError, match="this population has 2 members"):
        fewer.restore(tmp_path)
    assert other_rates.step == fewer.step == 0 and other_rates.active.all()
    with pytest.raises(ValueError, match="shared_order=True"):
        fresh.fit(data, epochs=3, batch_size=BS, checkpoint_dir=tmp_path, resume=True,
                  shared_order=True)  # fmt: skip


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_sigterm_before_an_epoch_saves_before_its_first_call_and_a_resume_equals_a_straight_run(
    data, tmp_path
):
    make = lambda: Population(mlp, TX, xent, seeds=SEEDS)  # noqa: E731
    straight = make()
    full = straight.fit(data, epochs=3, batch_size=BS)
    preempt = LambdaCallback(
        on_epoch_begin=lambda pop, epoch: epoch == 1 and os.kill(os.getpid(), signal.SIGTERM)
    )
    first = make()
    with pytest.raises(Preempted, match="step 8 "):
        first.fit(data, epochs=3, batch_size=BS, checkpoint_dir=tmp_path, callbacks=[preempt])
    assert (first.epoch, first.step) == (1, 8)  # no call of epoch 1 started after the signal
    resumed = make()
    history = resumed.fit(data, epochs=3, batch_size=BS, checkpoint_dir=tmp_path, resume=True)
    # Bitwise: calls of whole epochs, fused or not, scan the same loop body (conftest).
    np.testing.assert_array_equal(history.losses, full.losses)
    for a, b in zip(state_arrays(resumed.state), state_arrays(straight.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_writers_record_one_value_per_member(data, tmp_path):
    pop = Population(mlp, TX, xent, seeds=SEEDS)
    stream = io.StringIO()
    writers = [
        CSVWriter(tmp_path / "logs.csv"),
        JSONLinesWriter(tmp_path / "logs.jsonl"),
        TextLogger(stream),
    ]
    history = pop.fit(data, epochs=2, batch_size=BS, callbacks=writers)
    losses = [logs["loss"] for logs in history.epochs]
    lines = [json.loads(line) for line in (tmp_path / "logs.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([line["loss"] for line in lines], losses, rtol=1e-6)
    with open(tmp_path / "logs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    np.testing.assert_allclose(
        [[float(row[f"loss/{i}"]) for i in range(3)] for row in rows], losses, rtol=1e-6
    )
    first = stream.getvalue().splitlines()[0]
    assert first.startswith("epoch 0  loss [") and first.count(" ") > 6


def test_fit_arguments_are_checked_before_anything_runs(data, compile_count):
    pop = Population(mlp, TX, xent, seeds=SEEDS)
    state = pop.state  # a copy (eager ops)
    built = compile_count()  # building members runs eager ops (compiled once per process)
    with pytest.raises(ValueError, match="both eval_data and a metric_fn"):
        pop.fit(data, epochs=1, batch_size=BS, eval_data=data)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        pop.fit(data, epochs=1, batch_size=BS, resume=True)
    with pytest.raises(ValueError, match="on_nonfinite"):
        Population(mlp, TX, xent, seeds=SEEDS, on_nonfinite="drop")
    with pytest.raises(ValueError, match="where must be one bool per member"):
        pop.load_state(state, where=[True])
    one = Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(ValueError, match="member_axis and data_axis are both 'data'"):
        Population(mlp, TX, xent, seeds=SEEDS, mesh=one, member_axis="data")
    assert compile_count() == built and pop.step == 0


@pytest.mark.slow
def test_members_sharded_over_a_mesh_train_as_on_one_device(tmp_path):
    """4 simulated devices: 4 members over a 2 x 2 (members x data) mesh, and the same with
    FSDP inside each member, equal the same population on one device; N that does not
    divide, and one axis for both members and batches, are refused."""
    run = subprocess.run(
        [sys.executable, WORKER, str(tmp_path / "out.npz")],
        env={
            **{k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"},
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "PYTHONPATH": str(pathlib.Path(__file__).parent),
        },
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as z:
        for run in ("mesh", "fsdp"):  # members over their axis; and FSDP inside each member
            for name in ("state", "losses"):
                single, sharded = z[f"single_{name}"], z[f"{run}_{name}"]
                np.testing.assert_allclose(sharded, single, rtol=1e-5, atol=1e-6)
        assert str(z["mesh_spec"]) == "('members',)"
        assert str(z["fsdp_spec"]) == "('members', None, 'data')"
        # 4 members of a (4, 8) kernel: 2 members a device, half of the 8 columns each.
        assert z["mesh_shard"].tolist() == [2, 4, 8] and z["fsdp_shard"].tolist() == [2, 4, 4]
        errors = str(z["errors"]).splitlines()
        assert "3 members do not divide over the 2 devices of mesh axis 'members'" in errors[0]
        assert "member_axis and data_axis are both 'members'" in errors[1]
        assert "batch size 7 does not divide by the 2 devices" in errors[2]
        # A frozen member on the mesh stays bitwise; member(i) trains with a plain Trainer.
        np.testing.assert_array_equal(z["frozen_after"], z["frozen_before"])
        np.testing.assert_allclose(z["member_trained"], z["alone_trained"], rtol=1e-5, atol=1e-6)


def test_progress_line_names_the_members_in_training(data, capsys):
    pop = Population(mlp, TX, xent, seeds=SEEDS)
    pop.freeze(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pop.fit(data, epochs=1, batch_size=BS, progress=True)
    out = capsys.readouterr().out
    assert "of 3 members" in out and "2 of 3 training" in out
    assert jax.tree.leaves(pop.state)  # still readable after the donated calls
