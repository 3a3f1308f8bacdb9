"""Fused epochs that save checkpoints (issue 58 item 9): when nothing but the checkpoints
needs the host between epochs, ``fit`` trains them in one compiled call that also returns
the states of the epochs whose saves the directory keeps, and writes those saves from them.

The reference, in the same process: the same fit with an empty ``on_epoch_end`` hook,
which keeps one compiled call per epoch (a hook may look at the model, so nothing fuses)
and saves each epoch from the model as it stands, as every save was written before. Every
checkpoint the fused fit leaves must be that run's file for file (``arrays.bin`` bitwise,
the manifest but for where the run's History lies in the log), the same steps, the same
History and weights; a SIGTERM during a fused call saves once, after it, and the resumed
run ends as the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from nnxscan.adapters.checkpoint import Checkpointer, all_steps, restore_checkpoint
from nnxscan.shell import LambdaCallback, Population, Preempted, Trainer, load_model
from nnxscan.shell._engine import calls

from conftest import MLP, BNDropout, accuracy, assert_trees_close, make_data, state_arrays, xent

TX = optax.adam(1e-2)
BS = 8
DATA = make_data(64)  # 8 steps an epoch
EVAL = make_data(16, seed=1)
TIMING = {"wall_time", "steps_per_sec", "compile_time"}


def apart() -> list:
    """An empty epoch hook: one compiled call an epoch, each save from the model."""
    return [LambdaCallback(on_epoch_end=lambda trainer, epoch, logs: None)]


def fit(directory, *, separate, model=BNDropout, epochs=6, **options):
    trainer = Trainer(model(rngs=nnx.Rngs(0)), TX, xent)
    history = trainer.fit(
        DATA, epochs=epochs, batch_size=BS, checkpoint_dir=directory, progress=False,
        callbacks=apart() if separate else [], **options,
    )  # fmt: skip
    return trainer, history


def checkpoint_files(directory) -> dict:
    """Each checkpoint's files: ``arrays.bin``'s bytes, the manifest without its crc32 and
    the run log's byte range (the History's lines hold wall times), what else the step
    folder holds."""
    files = {}
    for step in all_steps(directory):
        folder = directory / str(step)
        manifest = json.loads((folder / "manifest.json").read_text())
        del manifest["crc32"]
        for leaf in manifest["leaves"]:
            if leaf["path"] == "['meta']['run']":
                leaf["value"] = {k: v for k, v in json.loads(leaf["value"]).items()
                                 if k not in ("start", "end")}  # fmt: skip
        files[step] = ((folder / "arrays.bin").read_bytes(), manifest, sorted(os.listdir(folder)))
    return files


def host(x) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def without_timing(history) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in TIMING} for e in history.epochs]


def same_history(got, want) -> None:
    np.testing.assert_array_equal(got.losses, want.losses)
    assert len(got.epochs) == len(want.epochs) and got.events == want.events
    for a, b in zip(without_timing(got), without_timing(want), strict=True):
        assert a.keys() == b.keys()
        for key in a:  # a population's logs are arrays, one value a member
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize(
    ("model", "every", "epochs", "asynchronous"),
    [
        # batch statistics and RNG keys and counts in the carry (over ~5 s on 2 cores)
        pytest.param(BNDropout, 1, 6, True, marks=pytest.mark.slow),
        (MLP, 1, 6, False),
        (BNDropout, 2, 7, True),  # the stretch's last epoch not due: the fit's end saves it
        (MLP, 4, 9, True),  # one due save before the last: kept
    ],
)
def test_fused_saves_write_bitwise_the_checkpoints_of_one_call_an_epoch(
    tmp_path, stretch_count, model, every, epochs, asynchronous
):
    options = dict(model=model, epochs=epochs, checkpoint_every=every,
                   checkpoint_async=asynchronous)  # fmt: skip
    trainer, history = fit(tmp_path / "fused", separate=False, **options)
    assert stretch_count() == 1  # every epoch in one compiled call
    reference, want = fit(tmp_path / "apart", separate=True, **options)
    assert stretch_count() == 1 + epochs
    fused, separate = checkpoint_files(tmp_path / "fused"), checkpoint_files(tmp_path / "apart")
    assert list(fused) == list(separate) and len(fused) == 3  # max_to_keep: the newest 3
    for step in fused:
        assert fused[step] == separate[step], f"checkpoint {step} differs"
    assert "state" in fused[max(fused)][2]  # the newest one, for Flax's code
    same_history(history, want)
    assert_trees_close(trainer.model, reference.model, exact=True)
    assert (tmp_path / "fused" / "history.jsonl").read_bytes().count(b"\n") <= epochs


def test_a_fused_fits_checkpoints_restore_the_epochs_they_hold_and_flax_loads_the_newest(
    tmp_path,
):
    """Each kept checkpoint restores the model of its epoch: the reference is a run of
    that many epochs, without checkpoints. Flax's guide loads the newest."""
    fit(tmp_path, separate=False, epochs=5)
    assert all_steps(tmp_path) == [24, 32, 40]
    for step in all_steps(tmp_path):
        plain = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
        plain.fit(DATA, epochs=step // 8, batch_size=BS, progress=False)
        restored = Trainer(BNDropout(rngs=nnx.Rngs(7)), TX, xent)
        assert restored.restore(tmp_path, step=step) == step // 8
        assert restored.step == step
        assert_trees_close(restored.model, plain.model, exact=True)
    abstract = nnx.eval_shape(lambda: BNDropout(rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    state = ocp.StandardCheckpointer().restore(tmp_path.resolve() / "40" / "state", abstract_state)
    model = nnx.merge(graphdef, state)
    assert_trees_close(model, load_model(tmp_path, abstract), exact=True)


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_a_population_fused_saves_write_the_checkpoints_of_one_call_an_epoch(
    tmp_path, stretch_count
):
    def population_fit(directory, separate):
        population = Population(lambda rngs: BNDropout(rngs=rngs), TX, xent, seeds=[0, 5, 9])
        history = population.fit(DATA, epochs=4, batch_size=BS, checkpoint_dir=directory,
                                 progress=False, callbacks=apart() if separate else [])  # fmt: skip
        return population, history

    fused, history = population_fit(tmp_path / "fused", False)
    assert stretch_count() == 1
    separate, want = population_fit(tmp_path / "apart", True)
    assert checkpoint_files(tmp_path / "fused") == checkpoint_files(tmp_path / "apart")
    same_history(history, want)
    for a, b in zip(jax.tree.leaves(fused.state), jax.tree.leaves(separate.state), strict=True):
        np.testing.assert_array_equal(host(a), host(b))


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_epochs_fuse_with_saves_only_when_nothing_else_needs_the_host(tmp_path, stretch_count):
    """The rule: a hook (it may look at the model), saves inside epochs (they come at call
    boundaries) and orbax's storage keep one call an epoch; evaluation ends a fused call
    where it runs (it sees the model of that epoch)."""
    fit(tmp_path / "a", separate=False, epochs=4)
    assert stretch_count() == 1
    fit(tmp_path / "b", separate=True, epochs=4)
    assert stretch_count() == 1 + 4
    fit(tmp_path / "c", separate=False, epochs=4, checkpoint_every_steps=8)
    assert stretch_count() == 1 + 4 + 4
    trainer = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
    trainer.fit(DATA, epochs=4, batch_size=BS, checkpoint_dir=tmp_path / "d", progress=False,
                eval_data=EVAL, metric_fn=accuracy, eval_every=2, eval_batch_size=16)  # fmt: skip
    assert stretch_count() == 1 + 4 + 4 + 2
    assert all_steps(tmp_path / "d") == [16, 24, 32]


class FusedCallSignal:
    """Sends SIGTERM to this process as the ``at``-th compiled call that keeps epoch-end
    states starts (it runs to its end: the signal is only recorded meanwhile)."""

    def __init__(self, monkeypatch, at: int = 1):
        self.at, self.calls = at, 0
        real = calls.LiveState.runner
        signaller = self

        def runner(live, donate):
            run = real(live, donate)

            def counted(*args, **kwargs):
                if "slots" in kwargs:
                    signaller.calls += 1
                    if signaller.calls == signaller.at:
                        os.kill(os.getpid(), signal.SIGTERM)
                return run(*args, **kwargs)

            counted._cache_size = run._cache_size
            return counted

        monkeypatch.setattr(calls.LiveState, "runner", runner)


def eval_fit(directory, **options):
    trainer = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
    history = trainer.fit(
        DATA, epochs=8, batch_size=BS, checkpoint_dir=directory, resume=True, progress=False,
        eval_data=EVAL, metric_fn=accuracy, eval_every=4, eval_batch_size=16, **options,
    )  # fmt: skip
    return trainer, history


def test_a_sigterm_during_a_fused_call_saves_once_after_it_and_the_resume_ends_the_run(
    tmp_path, monkeypatch
):
    """Epochs 0-3 and 4-7 are two fused calls (evaluation every 4 epochs). The signal
    comes as the first starts: that call runs to its end, its epochs before the last end
    (logged, their saves written), the last's end — its evaluation and save — is left to
    the resumed run, and nothing else starts. Reference: the same fit uninterrupted."""
    straight, want = eval_fit(tmp_path / "straight")
    signal_once = FusedCallSignal(monkeypatch)
    with pytest.raises(Preempted, match="at step 32 ") as error:
        eval_fit(tmp_path / "run")
    assert signal_once.calls == 1  # the second fused call never started
    carried = error.value.history
    assert [e["epoch"] for e in carried.epochs] == [0, 1, 2]
    assert not any("eval_accuracy" in e for e in carried.epochs)
    assert all_steps(tmp_path / "run") == [16, 24, 32]  # 16, 24: the fused call's kept
    like = {"meta": {"epoch": 0, "step": 0, "epoch_step": 0, "seed": 0, "run": ""}}
    meta = restore_checkpoint(tmp_path / "run", like)[0]["meta"]
    assert (meta["epoch"], meta["step"], meta["epoch_step"]) == (3, 32, 8)  # trained, not ended
    resumed, history = eval_fit(tmp_path / "run")
    same_history(history, want)
    assert "eval_accuracy" in history.epochs[3] and "eval_accuracy" in history.epochs[7]
    assert_trees_close(resumed.model, straight.model, exact=True)
    assert checkpoint_files(tmp_path / "run") == checkpoint_files(tmp_path / "straight")


def test_together_writes_its_saves_as_one_batch_with_the_item_of_the_last(tmp_path, monkeypatch):
    """``Checkpointer.together``: the block's saves reach the save thread as one batch as it ends
    (the newest with its state/ item when ``last``); the reference is each tree read back."""
    import jax.numpy as jnp

    from nnxscan.adapters import _checkpoint_files

    batches = []
    real = _checkpoint_files.write_many

    def write_many(path, saves, **options):
        batches.append([(save[0], save[4] is not None) for save in saves])
        return real(path, saves, **options)

    monkeypatch.setattr(_checkpoint_files, "write_many", write_many)
    like = {"state": {"w": jax.ShapeDtypeStruct((3,), np.float32)}, "meta": {"step": 0}}
    for asynchronous in (True, False):
        folder = tmp_path / str(asynchronous)
        checkpointer = Checkpointer(folder, asynchronous=asynchronous)
        with checkpointer, checkpointer.together(last=True):
            for step in (1, 2, 3):
                tree = {"state": {"w": jnp.full((3,), float(step))}, "meta": {"step": step}}
                checkpointer.save(step, tree)
                assert checkpointer.newest_step() == step
            assert batches == [] and all_steps(folder) == []  # nothing written yet
        assert batches.pop() == [(1, False), (2, False), (3, True)]
        for step in (1, 2, 3):
            tree, _ = restore_checkpoint(folder, like, step=step)
            np.testing.assert_array_equal(tree["state"]["w"], np.full((3,), float(step)))
            assert (folder / str(step) / "state").exists() == (step == 3)


def test_close_inside_together_writes_the_blocks_saves_first(tmp_path):
    """What a preemption does: a save, then close(), inside the block."""
    with Checkpointer(tmp_path) as checkpointer, checkpointer.together():
        checkpointer.save(4, {"x": np.ones((2,), np.float32)})
        checkpointer.close()
        assert all_steps(tmp_path) == [4]
    assert all_steps(tmp_path) == [4] and (tmp_path / "4" / "state").exists() is False


def test_the_saved_states_are_the_models_own_leaves(tmp_path):
    """The held states come back with the carry's dtypes, shapes and PRNG keys."""
    trainer, _ = fit(tmp_path, separate=False, epochs=3)
    fresh = Trainer(BNDropout(rngs=nnx.Rngs(3)), TX, xent)
    fresh.restore(tmp_path, step=16)
    for a, b in zip(state_arrays(fresh.model), state_arrays(trainer.model), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape


@pytest.mark.parametrize("asynchronous", [True, False])
def test_the_last_fused_saves_renames_reach_the_disk_before_fit_returns(
    tmp_path, monkeypatch, asynchronous
):
    """The fit's last batch is written as the fused call's saves end (on the training
    thread): the directory is fsync'ed after its renames before ``fit`` returns."""
    import pathlib

    from nnxscan.adapters import _checkpoint_files

    events = []
    real_fsync, real_rename = _checkpoint_files._fsync, os.rename

    def fsync(path):
        events.append(("fsync", pathlib.Path(path)))
        real_fsync(path)

    def rename(source, target):
        events.append(("rename", pathlib.Path(target)))
        real_rename(source, target)

    monkeypatch.setattr(_checkpoint_files, "_fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    fit(tmp_path, separate=False, epochs=3, checkpoint_async=asynchronous)
    steps = [path.name for kind, path in events if kind == "rename" and path.parent == tmp_path]
    assert steps == ["8", "16", "24"]
    last = max(i for i, (kind, path) in enumerate(events) if kind == "rename")
    assert ("fsync", tmp_path.resolve()) in events[last:]


def _sample_update(graphdef, state, opt_state, batch):
    """A step without data: it draws its batch from a PRNG key its opt_state carries."""
    import jax.numpy as jnp

    from nnxscan.pure import split_wrt

    key, sub = jax.random.split(opt_state["key"])
    x = jax.random.normal(sub, (16, 4))
    sampled = {"x": x, "y": jnp.argmax(x @ jnp.ones((4, 3)), -1)}
    params, rest = split_wrt(state, nnx.Param)
    loss, grads = jax.value_and_grad(lambda p: xent(nnx.merge(graphdef, p, rest), sampled))(params)
    updates, tx_state = TX.update(grads, opt_state["tx"], params)
    new = nnx.merge_state(optax.apply_updates(params, updates), rest)
    return new, {"tx": tx_state, "key": key}, (loss, {"first_x": x[0, 0]})


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_fused_saves_of_a_step_without_data_and_of_an_nnx_optimizer(tmp_path, stretch_count):
    """Two other owners and epoch sources: a pure Step that takes no batch (a typed PRNG
    key in its opt_state, aux logs) and an ``nnx.Optimizer`` (its step counter), each
    against its own run of one call an epoch."""
    from nnxscan.pure import Step, init_opt_state

    sampler = Step(
        lambda graphdef, state: {"tx": init_opt_state(TX, state), "key": jax.random.key(0)},
        _sample_update, has_aux=True,
    )  # fmt: skip

    def dataless(directory, separate):
        trainer = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=sampler)
        history = trainer.fit(None, epochs=5, steps_per_epoch=6, checkpoint_dir=directory,
                              progress=False, callbacks=apart() if separate else [])  # fmt: skip
        return trainer, history

    def with_optimizer(directory, separate):
        model = MLP(rngs=nnx.Rngs(0))
        trainer = Trainer(model, nnx.Optimizer(model, TX, wrt=nnx.Param), xent)
        history = trainer.fit(DATA, epochs=5, batch_size=BS, checkpoint_dir=directory,
                              progress=False, callbacks=apart() if separate else [])  # fmt: skip
        return trainer, history

    for name, run in (("dataless", dataless), ("optimizer", with_optimizer)):
        before = stretch_count()
        fused, history = run(tmp_path / name / "fused", False)
        assert stretch_count() == before + 1
        separate, want = run(tmp_path / name / "apart", True)
        files = checkpoint_files(tmp_path / name / "fused")
        assert files == checkpoint_files(tmp_path / name / "apart") and len(files) == 3
        same_history(history, want)
        assert_trees_close(fused.model, separate.model, exact=True)
        assert fused.step == separate.step
