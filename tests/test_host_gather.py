"""A fit over arrays on the CPU gathers each call's batches on the host, the next call's
while one trains (shell/_engine/host_gather.py): the same rows in the same order as the
core's epoch rule, so bitwise what a user's loop of ``pure.make_epoch`` calls trains, and
the same as the calls that gather inside (one core, a GPU).

References: a loop of jitted ``make_epoch`` calls over ``epoch_order``'s orders, and the
order cut by hand with numpy.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import epoch_order, init_opt_state, make_epoch, make_train_step
from nnxscan.shell import LambdaCallback, Trainer
from nnxscan.shell._engine import host_gather

from conftest import MLP, assert_trees_close, xent

TX = optax.adam(1e-2)
BS = 8
ROW_BYTES = 4 * 4 + 4  # conftest's data: x (4 float32s), y (an int32)


def pure_epochs(data, epochs: int, seed: int):
    """The user's own loop: a jitted make_epoch per epoch, fed the documented order."""
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    opt_state = init_opt_state(TX, state)
    epoch = jax.jit(make_epoch(make_train_step(xent, TX), batch_size=BS))
    n, losses = len(data["x"]), []
    for e in range(epochs):
        state, opt_state, out = epoch(graphdef, state, opt_state, data, epoch_order(seed, e, n))
        losses.append(np.asarray(out))
    return state, opt_state, np.concatenate(losses)


def cut_orders(seed: int, epochs: range, n: int) -> np.ndarray:
    """Each epoch's order cut into full batches by hand, the epochs one after another."""
    return np.concatenate([epoch_order(seed, e, n)[: n // BS * BS].reshape(-1, BS) for e in epochs])


@pytest.fixture
def events(monkeypatch):
    """The host gather's main-thread events, ``(what, first row)``, and every gathered
    call's rows (on the worker), on a machine taken to have two cores."""
    monkeypatch.setattr(host_gather, "_cores", lambda: 2)
    record: dict[str, list] = {"main": [], "rows": []}
    cls = host_gather.HostGather
    submit, take, gather = cls.submit, cls.take, cls.gather

    def on_submit(self, key, rows):
        record["main"].append(("submit", key))
        return submit(self, key, rows)

    def on_take(self, key, rows):
        record["main"].append(("take", key))
        return take(self, key, rows)

    def on_gather(self, rows):
        record["rows"].append(np.array(rows))
        return gather(self, rows)

    monkeypatch.setattr(cls, "submit", on_submit)
    monkeypatch.setattr(cls, "take", on_take)
    monkeypatch.setattr(cls, "gather", on_gather)
    return record


def test_fused_epochs_run_as_calls_within_the_host_budget_bitwise_a_pure_loop(
    data, events, monkeypatch
):
    # 3 fused epochs of 8 steps = 24 steps; at most 5 steps a call: 6 calls of 4 (one
    # program: a length that divides the 24 steps, not 5 + 5 + 5 + 5 + 4).
    monkeypatch.setattr(host_gather, "HOST_GATHER_BUDGET_BYTES", 5 * BS * ROW_BYTES)
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent, execution="scan")
    history = trainer.fit(data, epochs=3, batch_size=BS, seed=5, progress=False)

    state, opt_state, losses = pure_epochs(data, 3, seed=5)
    assert_trees_close(model, state, exact=True)
    assert_trees_close(trainer.opt_state, opt_state, exact=True)
    np.testing.assert_array_equal(history.losses, losses)
    # Every call's rows gathered once, in the epoch rule's order, nothing more.
    assert [len(rows) for rows in events["rows"]] == [4] * 6
    np.testing.assert_array_equal(np.concatenate(events["rows"]), cut_orders(5, range(3), 64))


def test_the_next_epochs_batches_are_prepared_before_an_epoch_ends_and_a_stop_drops_them(
    data, events
):
    def on_epoch_end(trainer, epoch, logs):
        events["main"].append(("epoch_end", epoch))
        trainer.stop_training = epoch == 1  # stop after the second of three epochs

    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent, execution="scan")
    trainer.fit(
        data, epochs=3, batch_size=BS, seed=2, progress=False,
        callbacks=[LambdaCallback(on_epoch_end=on_epoch_end)],
    )  # fmt: skip

    # An epoch hook: one epoch per call. Each epoch's call was prepared (submitted) before
    # the epoch before it ended; the third, prepared, was never taken after the stop.
    assert events["main"] == [
        ("submit", (0, 1, 0, 0)),
        ("take", (0, 1, 0, 0)),
        ("submit", (1, 1, 0, 0)),
        ("epoch_end", 0),
        ("take", (1, 1, 0, 0)),
        ("submit", (2, 1, 0, 0)),
        ("epoch_end", 1),
    ]
    state, _, _ = pure_epochs(data, 2, seed=2)
    assert_trees_close(model, state, exact=True)
    for thread in threading.enumerate():  # the worker ends with the fit
        if thread.name.startswith("nnxscan-gather"):
            thread.join(timeout=10)
            assert not thread.is_alive()


@pytest.mark.parametrize("cores", [1, 2])
def test_with_one_core_the_calls_gather_inside_and_train_the_same(data, monkeypatch, cores):
    monkeypatch.setattr(host_gather, "_cores", lambda: cores)
    made = []
    monkeypatch.setattr(
        host_gather.HostGather, "__init__",
        lambda self, *a, init=host_gather.HostGather.__init__: (made.append(1), init(self, *a))[1],
    )  # fmt: skip
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent, execution="scan")
    history = trainer.fit(data, epochs=2, batch_size=BS, seed=4, progress=False)
    assert len(made) == (cores > 1)
    state, opt_state, losses = pure_epochs(data, 2, seed=4)
    assert_trees_close(model, state, exact=True)
    assert_trees_close(trainer.opt_state, opt_state, exact=True)
    np.testing.assert_array_equal(history.losses, losses)


def test_a_resumed_epoch_prepares_only_its_remaining_batches(data, events, tmp_path):
    """A rerun after a save mid-epoch: the first prepared call starts where the epoch
    stopped, and the run ends bitwise where a straight run ends."""
    straight = MLP(rngs=nnx.Rngs(0))
    Trainer(straight, TX, xent, execution="scan").fit(
        data, epochs=2, batch_size=BS, seed=3, progress=False
    )

    class Cut(Exception):
        pass

    def cut_once(trainer, logs):
        if logs["step"] == 11 and not cut_once.done:
            cut_once.done = True
            raise Cut

    cut_once.done = False
    options = dict(
        epochs=2, batch_size=BS, seed=3, progress=False, steps_per_call=1,
        checkpoint_dir=tmp_path, checkpoint_every_steps=1, resume=True,
    )  # fmt: skip
    with pytest.raises(Cut):
        Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent, execution="scan").fit(
            data, callbacks=[LambdaCallback(on_call_end=cut_once)], **options
        )
    events["main"].clear()
    events["rows"].clear()
    model = MLP(rngs=nnx.Rngs(0))
    Trainer(model, TX, xent, execution="scan").fit(data, **options)
    assert events["main"][0] == ("submit", (1, 1, 3, 0))  # epoch 1, 3 of its 8 steps done
    np.testing.assert_array_equal(
        np.concatenate(events["rows"]), cut_orders(3, range(1, 2), 64)[3:]
    )
    assert_trees_close(model, straight, exact=True)
