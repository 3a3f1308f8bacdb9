"""Long runs that survive interruption: resume by rerunning, mid-epoch checkpoints, signals.

The reference is always the same run, never interrupted, in the same process: a resumed
run must end bitwise where it would have ended. Bitwise on every CPU: the reference runs the
same calls (its ``steps_per_call`` is the checkpoints' cadence), or calls of whole epochs
whose steps are the same loop body (conftest's ACROSS_PROGRAMS says why that suffices).
"""

from __future__ import annotations

import os
import signal

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.adapters.checkpoint import all_steps
from nnxscan.shell import LambdaCallback, Preempted, Trainer

from conftest import BNDropout, assert_trees_close, make_data, xent

TX = optax.adam(1e-2)
BS = 8
DATA = make_data(60)  # 7 steps an epoch, 4 examples dropped


class Interrupt(Exception):
    """What the tests raise to cut a run at a given step."""


def straight(epochs: int, **fit):
    model = BNDropout(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    history = trainer.fit(DATA, epochs=epochs, batch_size=BS, progress=False, **fit)
    return model, trainer, history


def cut_at(step: int) -> LambdaCallback:
    def maybe_raise(trainer, logs):
        if logs["step"] >= step:
            raise Interrupt(step)

    return LambdaCallback(on_call_end=maybe_raise)


def same_history(a, b) -> None:
    """Equal logs and losses. A loss is a reduction XLA may fuse differently in calls of
    another length (the straight run fuses its epochs), so losses agree to the last bits,
    while the states (compared bitwise) are identical."""
    np.testing.assert_allclose(a.losses, b.losses, rtol=1e-6)
    timing = {"wall_time", "steps_per_sec", "compile_time", "loss"}
    assert [{k: v for k, v in e.items() if k not in timing} for e in a.epochs] == [
        {k: v for k, v in e.items() if k not in timing} for e in b.epochs
    ]
    np.testing.assert_allclose([e["loss"] for e in a.epochs], [e["loss"] for e in b.epochs],
                               rtol=1e-6)  # fmt: skip


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
@pytest.mark.parametrize(
    "cut",
    [pytest.param(7, marks=pytest.mark.slow), 10, pytest.param(16, marks=pytest.mark.slow)],
    ids=["epoch_end", "mid_epoch", "late"],
)
def test_rerunning_the_same_fit_with_resume_ends_bitwise_where_a_straight_run_ends(tmp_path, cut):
    ref_model, ref_trainer, ref_history = straight(4, steps_per_call=3)

    def run(callbacks=()):
        model = BNDropout(rngs=nnx.Rngs(0))
        trainer = Trainer(model, TX, xent)
        history = trainer.fit(
            DATA, epochs=4, batch_size=BS, progress=False, checkpoint_dir=tmp_path,
            checkpoint_every_steps=3, resume=True, callbacks=callbacks,
        )  # fmt: skip
        return model, trainer, history

    with pytest.raises(Interrupt) as err:
        run([cut_at(cut)])
    # The interrupting call's epoch is not logged yet: only the epochs finished before it
    # (calls end at steps 3, 6, 7, 10, 13, 14, 17, ...; 7 steps an epoch).
    logged = [logs["epoch"] for logs in err.value.history.epochs]
    assert logged == list(range((cut - 1) // 7))
    model, trainer, history = run()  # the same command again
    assert (trainer.step, trainer.epoch) == (ref_trainer.step, ref_trainer.epoch) == (28, 4)
    assert_trees_close(model, ref_model, exact=True)  # params, batch stats, RNG state
    assert_trees_close(trainer.opt_state, ref_trainer.opt_state, exact=True)
    same_history(history, ref_history)  # the History up to the restore point comes back


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_an_unshuffled_run_cut_mid_epoch_resumes_bitwise(tmp_path):
    """``shuffle=False`` slices its batches by number: a resume skips the trained ones."""
    ref_model, ref_trainer, _ = straight(2, steps_per_call=3, shuffle=False)

    def run(callbacks=()):
        model = BNDropout(rngs=nnx.Rngs(0))
        trainer = Trainer(model, TX, xent)
        trainer.fit(
            DATA, epochs=2, batch_size=BS, progress=False, checkpoint_dir=tmp_path,
            checkpoint_every_steps=3, resume=True, callbacks=callbacks, shuffle=False,
            steps_per_call=3,
        )  # fmt: skip
        return model, trainer

    with pytest.raises(Interrupt):
        run([cut_at(10)])  # step 10: three steps into the second epoch
    model, trainer = run()
    assert trainer.step == ref_trainer.step == 14
    assert_trees_close(model, ref_model, exact=True)
    assert_trees_close(trainer.opt_state, ref_trainer.opt_state, exact=True)


@pytest.mark.slow
def test_resume_without_a_checkpoint_trains_from_the_start_and_a_finished_run_is_done(
    tmp_path,
):
    ref_model, _, _ = straight(2)
    model = BNDropout(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    trainer.fit(DATA, epochs=2, batch_size=BS, progress=False, checkpoint_dir=tmp_path,
                resume=True)  # fmt: skip
    assert_trees_close(model, ref_model, exact=True)
    again = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
    history = again.fit(DATA, epochs=2, batch_size=BS, progress=False,
                        checkpoint_dir=tmp_path, resume=True)  # fmt: skip
    assert again.step == 14 and len(history.epochs) == 2  # restored, nothing left to train
    assert_trees_close(again.model, ref_model, exact=True)


@pytest.mark.slow
def test_mid_epoch_checkpoints_land_at_the_first_call_boundary_after_each_multiple(tmp_path):
    Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent).fit(
        DATA, epochs=2, batch_size=BS, progress=False, checkpoint_dir=tmp_path,
        checkpoint_every_steps=5, checkpoint_every=100,
    )  # fmt: skip
    # Calls of 5 steps within 7-step epochs end at 5, 7, 12, 14: saves at 5, 12 (the
    # first boundary past 10 is 12), and 14 as the run ends; max_to_keep=3 keeps them all.
    assert all_steps(tmp_path) == [5, 12, 14]


@pytest.mark.slow
def test_a_streamed_run_resumes_mid_epoch_skipping_the_batches_it_trained(tmp_path):
    batches = [{k: v[i * BS : (i + 1) * BS] for k, v in DATA.items()} for i in range(7)]

    def run(callbacks=()):
        model = BNDropout(rngs=nnx.Rngs(0))
        trainer = Trainer(model, TX, xent)
        trainer.fit(batches, epochs=3, progress=False, checkpoint_dir=tmp_path,
                    checkpoint_every_steps=2, resume=True, callbacks=callbacks)  # fmt: skip
        return model, trainer

    ref = BNDropout(rngs=nnx.Rngs(0))
    Trainer(ref, TX, xent).fit(batches, epochs=3, progress=False, steps_per_call=2)
    with pytest.raises(Interrupt):
        run([cut_at(11)])
    model, trainer = run()
    assert trainer.step == 21
    assert_trees_close(model, ref, exact=True)


@pytest.mark.parametrize(
    ("signum", "error"),
    [
        pytest.param(signal.SIGTERM, Preempted, marks=pytest.mark.slow),  # over ~5 s
        (signal.SIGINT, KeyboardInterrupt),
    ],
)
@pytest.mark.slow_on_accelerator("fits signalled, saved and resumed: 4.4 s")
def test_a_signal_finishes_the_call_saves_and_raises_then_resume_goes_on(
    tmp_path, signum, error, default_sigint
):
    ref_model, _, _ = straight(3, steps_per_call=3)

    sent = []

    def send_once(trainer, logs):
        if logs["step"] >= 9 and not sent:  # call boundaries: 3, 6, 7, 10, ...
            sent.append(logs["step"])
            os.kill(os.getpid(), signum)

    model = BNDropout(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    with pytest.raises(error):
        trainer.fit(DATA, epochs=3, batch_size=BS, progress=False, checkpoint_dir=tmp_path,
                    steps_per_call=3, resume=True,
                    callbacks=[LambdaCallback(on_call_end=send_once)])  # fmt: skip
    # The signal came after the call ending at step 10: it stopped there, saved, raised.
    assert sent == [10] and trainer.step == 10
    np.asarray(nnx.state(model)["l1"]["kernel"][...])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    again = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
    again.fit(DATA, epochs=3, batch_size=BS, progress=False, checkpoint_dir=tmp_path,
              steps_per_call=3, resume=True)  # fmt: skip
    assert again.step == 21
    assert_trees_close(again.model, ref_model, exact=True)


def test_an_escaping_exception_keeps_the_history_and_closes_the_callbacks(tmp_path):
    closed = []

    class ClosableCallback:  # as a log writer: fit closes it
        def on_epoch_end(self, trainer, epoch, logs):
            if epoch == 1:
                raise RuntimeError("disk full")

        def close(self):
            closed.append(True)

    trainer = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
    with pytest.raises(RuntimeError, match="disk full") as err:
        trainer.fit(DATA, epochs=4, batch_size=BS, progress=False, callbacks=[ClosableCallback()])
    assert [e["epoch"] for e in err.value.history.epochs] == [0, 1]
    assert closed == [True]


def test_resume_and_step_checkpoints_need_a_directory_and_a_matching_seed(tmp_path):
    trainer = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
    with pytest.raises(ValueError, match="need a checkpoint_dir"):
        trainer.fit(DATA, epochs=1, batch_size=BS, resume=True)
    with pytest.raises(ValueError, match="need a checkpoint_dir"):
        trainer.fit(DATA, epochs=1, batch_size=BS, checkpoint_every_steps=2)
    trainer.fit(DATA, epochs=1, batch_size=BS, progress=False, checkpoint_dir=tmp_path,
                seed=3)  # fmt: skip
    other = Trainer(BNDropout(rngs=nnx.Rngs(0)), TX, xent)
    with pytest.raises(ValueError, match="seed 3"):
        other.fit(DATA, epochs=2, batch_size=BS, progress=False, checkpoint_dir=tmp_path,
                  resume=True, seed=4)  # fmt: skip


@pytest.mark.slow
def test_a_step_checkpoint_that_lands_on_an_epochs_last_step_resumes_the_next_epoch(tmp_path):
    """Found by the chaos test: the save at step 8 (= the end of epoch 0) must count the
    epoch, or the resumed run would find it empty and end early."""
    data = make_data(64)  # 8 steps an epoch

    def run(callbacks=()):
        model = BNDropout(rngs=nnx.Rngs(0))
        trainer = Trainer(model, TX, xent)
        history = trainer.fit(data, epochs=3, batch_size=BS, progress=False,
                              checkpoint_dir=tmp_path, checkpoint_every_steps=4, resume=True,
                              callbacks=callbacks)  # fmt: skip
        return model, trainer, history

    def stop_in_epoch_1(trainer, epoch):
        if epoch == 1:
            raise Interrupt(epoch)

    with pytest.raises(Interrupt):
        run([LambdaCallback(on_epoch_begin=stop_in_epoch_1)])
    assert all_steps(tmp_path) == [4, 8]  # the newest: the step save at the end of epoch 0
    model, trainer, history = run()
    ref = BNDropout(rngs=nnx.Rngs(0))
    Trainer(ref, TX, xent).fit(data, epochs=3, batch_size=BS, progress=False, steps_per_call=4)
    assert (trainer.step, trainer.epoch) == (24, 3)
    assert [e["epoch"] for e in history.epochs] == [0, 1, 2]
    assert_trees_close(model, ref, exact=True)


def test_a_stream_checkpointed_after_its_last_batch_resumes_with_the_next_epoch(tmp_path):
    batches = [{k: v[i * BS : (i + 1) * BS] for k, v in DATA.items()} for i in range(7)]

    def run(callbacks=()):
        model = BNDropout(rngs=nnx.Rngs(0))
        trainer = Trainer(model, TX, xent)
        history = trainer.fit(batches, epochs=2, progress=False, checkpoint_dir=tmp_path,
                              checkpoint_every_steps=7, checkpoint_every=100, resume=True,
                              callbacks=callbacks)  # fmt: skip
        return model, trainer, history

    with pytest.raises(Interrupt):
        run([cut_at(7)])  # a stream cannot tell the call ended the epoch: saved mid-epoch
    assert all_steps(tmp_path) == [7]
    model, trainer, history = run()
    ref = BNDropout(rngs=nnx.Rngs(0))
    Trainer(ref, TX, xent).fit(batches, epochs=2, progress=False, steps_per_call=7)
    assert (trainer.step, trainer.epoch) == (14, 2)
    assert [e["epoch"] for e in history.epochs] == [0, 1]
    assert_trees_close(model, ref, exact=True)
