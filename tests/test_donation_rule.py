"""When the shell donates the carry to its compiled calls (``calls.donates_carry``).

Everywhere but on a TPU the carry is donated; there a carry of at most
``ACCELERATOR_KEPT_CARRY_BYTES`` is not (XLA:TPU keeps a donated loop carry out of the
chip's fast memory: docs/performance.md). Here the rule is checked against its closed form,
and the TPU's choice is forced on any backend: a fit and a ``scan_train`` call then train
what the plain per-step NNX loop trains, bitwise what the donating calls train (the same
program but for its buffers' aliasing), and their compiled calls are built without
donation.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnxscan.shell._engine.engine as engine_module
from nnxscan.shell import Trainer, scan_train
from nnxscan.shell._engine import calls
from nnxscan.shell._engine.calls import ACCELERATOR_KEPT_CARRY_BYTES, donates_carry

from conftest import MLP, assert_trees_close, epoch_batches, reference_loop, tolerance, xent

TX = optax.adam(1e-2)
BS = 16


def _carry(nbytes: int) -> dict:
    return {"w": jax.ShapeDtypeStruct((nbytes // 4,), np.float32)}


def test_the_rule_donates_everywhere_but_a_small_carry_on_a_tpu():
    limit = ACCELERATOR_KEPT_CARRY_BYTES
    assert limit == 64 * 2**20
    for backend in ("cpu", "gpu", "cuda"):
        assert donates_carry(_carry(4), backend) and donates_carry(_carry(2 * limit), backend)
    assert not donates_carry(_carry(4), "tpu")
    assert not donates_carry(_carry(limit), "tpu")  # at most the limit: kept
    assert donates_carry(_carry(limit + 4), "tpu")
    # Every leaf counts, at its dtype's size.
    split = {"a": jax.ShapeDtypeStruct((limit // 4,), np.float32),
             "b": jax.ShapeDtypeStruct((2,), np.int8)}  # fmt: skip
    assert donates_carry(split, "tpu")


@pytest.fixture
def built(monkeypatch):
    """Whether each compiled runner the calls ran was built to donate."""
    donates = []
    runner = calls.LiveState.runner

    def spy(self, donate):
        donates.append(donate)
        return runner(self, donate)

    monkeypatch.setattr(calls.LiveState, "runner", spy)
    return donates


def _keep_on_any_backend(monkeypatch):
    """The TPU's choice for a small carry, whatever the backend: nothing donated."""
    monkeypatch.setattr(engine_module, "donates_carry", lambda carry, backend=None: False)


def _fit(data):
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    trainer.fit(data, epochs=2, batch_size=BS, seed=3, progress=False)
    return model


def test_a_fit_that_keeps_its_carry_trains_the_reference(data, built, monkeypatch):
    _keep_on_any_backend(monkeypatch)
    kept_model = _fit(data)
    assert built and not any(built)

    # The independent reference: the plain per-step NNX loop over the documented order.
    ref = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    batches = [b for e in range(2) for b in epoch_batches(data, BS, 3, e)]
    reference_loop(ref, optimizer, xent, batches)
    assert_trees_close(nnx.state(kept_model), nnx.state(ref), **tolerance(1e-5, 1e-6))


def test_keeping_the_carry_trains_bitwise_what_donating_it_trains(data, built, monkeypatch):
    donated_model = _fit(data)
    assert built and all(built) == (jax.default_backend() != "tpu")  # a TPU keeps it
    _keep_on_any_backend(monkeypatch)
    kept_model = _fit(data)
    assert_trees_close(nnx.state(kept_model), nnx.state(donated_model), exact=True)


def test_scan_train_keeps_the_carry(data, built, monkeypatch):
    _keep_on_any_backend(monkeypatch)
    stacked = jax.tree.map(lambda v: v[: 4 * BS].reshape(4, BS, *v.shape[1:]), data)
    model = MLP(rngs=nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    for _ in range(2):  # the second call runs on the kept set-up
        scan_train(model, optimizer, xent, stacked)
    assert built and not any(built)

    ref = MLP(rngs=nnx.Rngs(1))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    batches = [jax.tree.map(lambda v, i=i: v[i], stacked) for i in range(4)] * 2
    reference_loop(ref, ref_opt, xent, batches)
    assert_trees_close(nnx.state(model), nnx.state(ref), **tolerance(1e-5, 1e-6))
    assert_trees_close(nnx.state(optimizer), nnx.state(ref_opt), **tolerance(1e-5, 1e-6))


def test_a_step_with_host_callbacks_waits_and_is_never_donated():
    """A step that can fail inside its call (a host callback) is waited for each call, and
    its carry never donated, whatever the rule says."""

    class Traits:
        has_callback, has_convolution = True, False

    class Program:
        def traits(self, *args):
            return Traits()

    execution = calls.prepare_execution(Program(), None, None, lambda: None, {}, donate=True)
    assert (execution.donate, execution.waits) == (False, True)
    Traits.has_callback = False
    execution = calls.prepare_execution(Program(), None, None, lambda: None, {}, donate=False)
    assert (execution.donate, execution.waits) == (False, False)
