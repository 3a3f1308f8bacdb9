"""PPO on the shell: the PPO step (``make_ppo_step``) through ``Trainer.fit(None, ...)``,
killed and resumed, preempted, and as a ``Population`` of seeds x entropy coefficients,
against the single-program run ``make_ppo_train`` (a ``lax.scan`` of the same step) and a
run that was never interrupted."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import gymnax
import jax
import numpy as np
import ppo_resume_worker
import pytest
from flax import nnx

from nnxscan.shell import LambdaCallback, Population, Preempted, Trainer, cli
from nnxscan.shell.demos import ppo_demo
from nnxscan.shell.demos.ppo import PPOConfig, make_policy, make_ppo_step, make_ppo_train

from conftest import ACROSS_PROGRAMS

ENV, ENV_PARAMS = gymnax.make("CartPole-v1")
TINY = PPOConfig(
    num_envs=2, num_steps=16, update_epochs=2, num_minibatches=2, hidden=8,
    total_timesteps=2 * 16 * 6,
)  # fmt: skip
WORKER = str(pathlib.Path(__file__).with_name("ppo_resume_worker.py"))


def _bits(tree) -> list[np.ndarray]:
    return ppo_resume_worker.leaves_as_arrays(tree)


@pytest.fixture(scope="module")
def alone():
    """``make_ppo_train`` (the whole run in one program) per (seed, ent_coef)."""
    runs = {}

    def run(seed: int, ent_coef: float = TINY.ent_coef):
        if (seed, ent_coef) not in runs:
            train = make_ppo_train(ENV, ENV_PARAMS, TINY._replace(ent_coef=ent_coef))
            runs[seed, ent_coef] = jax.jit(train)(jax.random.key(seed))
        return runs[seed, ent_coef]

    return run


@pytest.mark.slow
def test_sigterm_saves_raises_preempted_and_the_rerun_ends_as_one_program_does(alone, tmp_path):
    def policy(seed):
        return make_policy(ENV, ENV_PARAMS, TINY, nnx.Rngs(seed))

    fit = dict(epochs=2, steps_per_epoch=3, steps_per_call=1, checkpoint_dir=tmp_path,
               resume=True, progress=False)  # fmt: skip
    first = Trainer(policy(4), train_step=make_ppo_step(ENV, ENV_PARAMS, TINY))
    term = LambdaCallback(
        on_call_end=lambda t, logs: t.step == 4 and os.kill(os.getpid(), signal.SIGTERM)
    )
    with pytest.raises(Preempted):
        first.fit(None, callbacks=[term], **fit)
    assert first.step == 4
    # A new process would build the policy from its seed: any weights, the checkpoint wins.
    again = Trainer(policy(9), train_step=make_ppo_step(ENV, ENV_PARAMS, TINY))
    history = again.fit(None, **fit)
    want = alone(4)
    assert again.step == 6
    # One call per update against the whole run in one program: two programs, to rounding
    # (conftest's ACROSS_PROGRAMS); over 6 updates PPO's sampling keeps them that close.
    np.testing.assert_allclose(history.losses, want.metrics["loss"], **ACROSS_PROGRAMS)
    for got, expected in zip(_bits(nnx.state(again.model)), _bits(want.state), strict=True):
        if np.issubdtype(got.dtype, np.inexact):
            np.testing.assert_allclose(got, expected, **ACROSS_PROGRAMS)
        else:  # the run key
            np.testing.assert_array_equal(got, expected)
    returns = np.asarray(want.metrics["episode_return"]).reshape(2, 3).mean(axis=1)
    # Each epoch logs the mean return of all its steps, the one preempted after its first
    # step too (that step's return was saved with the checkpoint), and so its loss.
    np.testing.assert_allclose([e["episode_return"] for e in history.epochs], returns, rtol=1e-6)
    np.testing.assert_allclose(
        history.epochs[1]["loss"], np.asarray(want.metrics["loss"])[3:].mean(), rtol=1e-6
    )


@pytest.mark.slow
def test_a_sweep_member_is_its_seed_and_entropy_coefficient_trained_alone(alone):
    seeds, ent_coefs = [0, 1, 0], [0.0, 0.05, float("nan")]
    population = Population(
        lambda rngs: make_policy(ENV, ENV_PARAMS, TINY, rngs),
        train_step=make_ppo_step(ENV, ENV_PARAMS, TINY),
        seeds=seeds, hyperparams={"ent_coef": ent_coefs}, on_nonfinite="stop",
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="member 2: non-finite loss"):
        history = population.fit(None, epochs=2, steps_per_epoch=3, progress=False)
    assert population.active.tolist() == [True, True, False]  # the NaN coefficient froze
    finals = []
    for i in (0, 1):
        want = alone(seeds[i], ent_coefs[i])
        got = nnx.state(population.member(i), nnx.Param)
        for g, w in zip(
            jax.tree.leaves(got), jax.tree.leaves(nnx.filter_state(want.state, nnx.Param)),
            strict=True,
        ):  # fmt: skip
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6)
        returns = np.asarray(want.metrics["episode_return"]).reshape(2, 3).mean(axis=1)
        got_returns = [e["episode_return"][i] for e in history.epochs]
        np.testing.assert_allclose(got_returns, returns, rtol=1e-5)
        finals.append(returns[-1])
    assert population.best("episode_return", mode="max") == int(np.argmax(finals))
    # The frozen member kept the weights it was built with (its first step was non-finite).
    untrained = make_policy(ENV, ENV_PARAMS, TINY, nnx.Rngs(0))
    for g, w in zip(
        jax.tree.leaves(nnx.state(population.member(2), nnx.Param)),
        jax.tree.leaves(nnx.state(untrained, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.slow
def test_ppo_on_fit_fuses_its_epochs_and_logs_no_learning_rate(stretch_count):
    # The step's learning_rate coefficient is the BASE rate it anneals per update, held in a
    # state shaped like optax.inject_hyperparams' (so populations set it): logging it as the
    # rate would be wrong, and a logged rate would keep every epoch in a call of its own.
    trainer = Trainer(
        make_policy(ENV, ENV_PARAMS, TINY, nnx.Rngs(0)),
        train_step=make_ppo_step(ENV, ENV_PARAMS, TINY),
    )
    history = trainer.fit(None, epochs=2, steps_per_epoch=3, progress=False)
    assert stretch_count() == 1  # both epochs in one compiled stretch
    assert all("learning_rate" not in logs for logs in history.epochs)


def test_the_sweep_figure_draws_a_line_per_member_and_a_bold_mean_per_value():
    steps = np.array([512, 1024, 1536])
    returns = np.array(  # (values, seeds, points)
        [[[10.0, 20.0, 30.0], [30.0, 40.0, 50.0]], [[5.0, 5.0, 5.0], [15.0, 25.0, 35.0]]]
    )
    fig = ppo_demo.draw_sweep_returns(steps, returns, "ent_coef", [0.0, 0.05])
    (ax,) = fig.get_axes()
    lines = ax.get_lines()
    assert len(lines) == 6  # per value: its 2 members, then their mean
    for j, value in enumerate([0.0, 0.05]):
        *members, mean = lines[3 * j : 3 * j + 3]
        for line, curve in zip(members, returns[j], strict=True):
            np.testing.assert_array_equal(line.get_xdata(), steps)
            np.testing.assert_array_equal(line.get_ydata(), curve)
        np.testing.assert_array_equal(mean.get_ydata(), returns[j].mean(axis=0))
        assert mean.get_label() == f"ent_coef={value:g}"
        assert mean.get_linewidth() > 2 * members[0].get_linewidth()
        assert len({line.get_color() for line in (*members, mean)}) == 1  # one color a value
    assert lines[0].get_color() != lines[3].get_color()
    assert ax.get_xlabel() == "environment steps" and ax.get_ylabel() == "episode return"
    table = ppo_demo.format_sweep_table("ent_coef", [0.0, 0.05], [3, 4], returns[..., -1])
    assert table.splitlines()[1].split() == ["0", "30.0", "50.0", "40.0"]
    assert table.splitlines()[2].split() == ["0.05", "5.0", "35.0", "20.0"]


def test_the_command_line_passes_the_sweep_and_the_checkpoint_dir(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(ppo_demo, "run_ppo_demo", lambda out, **kw: calls.append((out, kw)))
    argv = ["demo", "ppo", "--seeds", "8", "--sweep", "ent_coef=0.0,0.01,0.05", "--no-progress",
            "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path)]  # fmt: skip
    assert cli.main([*argv, "--no-compile-cache"]) == 0
    assert calls == [(str(tmp_path), {
        "seeds": 8, "seed": 0, "checkpoint_dir": str(tmp_path / "ck"),
        "sweep": {"ent_coef": [0.0, 0.01, 0.05]}, "progress": False,
    })]  # fmt: skip
    for bad in ("ent_coef", "entropy=0.1", "ent_coef=a,b", "ent_coef="):
        with pytest.raises(ValueError, match="--sweep"):
            ppo_demo.parse_sweep(bad)


# -- killed at random moments, rerun: bitwise the uninterrupted run --------------------------


def _start(checkpoint_dir, out, cache) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, WORKER, str(checkpoint_dir), str(out), str(cache)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        cwd=pathlib.Path(WORKER).parent,
    )  # fmt: skip


def _run_to_end(checkpoint_dir, out, cache) -> None:
    worker = _start(checkpoint_dir, out, cache)
    stdout, _ = worker.communicate(timeout=300)
    assert worker.returncode == 0 and stdout.rstrip().endswith("done"), stdout


@pytest.mark.slow
def test_ppo_killed_at_random_moments_and_rerun_ends_bitwise_as_the_uninterrupted_run(tmp_path):
    cache = tmp_path / "cache"
    _run_to_end(tmp_path / "reference", tmp_path / "reference.npz", cache)
    total = ppo_resume_worker.EPOCHS * ppo_resume_worker.STEPS_PER_EPOCH
    draw = random.Random(0)
    # Kill points: a global step (killed right after its call is reported: in the save, in
    # the next call, between epochs), in order over the first three quarters of the run;
    # and one kill timed from the start (imports, the restore, the compile).
    targets = sorted(draw.sample(range(2, 3 * total // 4), 3))
    kills = [("start", draw.uniform(0.5, 3.0)), *(("step", t) for t in targets)]
    seen = []
    for kind, when in kills:
        worker = _start(tmp_path / "run", tmp_path / "run.npz", cache)
        started = time.monotonic()
        if kind == "start":
            time.sleep(when)
        else:
            for line in worker.stdout:
                if line.startswith("step ") and int(line.split()[1]) >= when:
                    seen.append(int(line.split()[1]))
                    time.sleep(draw.uniform(0.0, 0.02))
                    break
                assert time.monotonic() - started < 300, "the worker stalled"
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=60)
    assert seen == sorted(seen) and seen, seen  # each rerun went on from a later step
    assert not (tmp_path / "run.npz").exists()  # every kill landed before the end
    _run_to_end(tmp_path / "run", tmp_path / "run.npz", cache)
    want, got = np.load(tmp_path / "reference.npz"), np.load(tmp_path / "run.npz")
    assert sorted(want.files) == sorted(got.files) and len(want.files) > 10
    # Bitwise: every call of both runs is the same compiled program (one update a call).
    for name in want.files:  # weights, run key, optax state, environments, keys, losses
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
