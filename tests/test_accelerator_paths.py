"""The TPU's loops, on any backend: what ``scan_indexed_steps`` compiles where
``nnxscan.pure.batching.slices_in_loop()`` is False (a TPU), beside the CPU's rule.

There a loop body must not take its batch by an index read from an array (a TPU waits for
each such index every step), so a call's batches are gathered before the loop, in chunks
beyond the gather budget. Both rules are forced here, whatever the backend; the references
are a hand-written ``lax.scan`` of the step over batches gathered with numpy indexing, and
the CPU rule's own path: the same step on the same rows. Those are other programs, and XLA
may pick other kernels for them, so results are compared to float32 rounding (rtol 1e-5,
atol 1e-6: a wrong row or a skipped step moves them by far more); the loop bodies are
inspected for what they no longer do. Integer outputs (the data-less step's) are exact.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import batching, init_opt_state, make_train_step, scan_indexed_steps, scan_steps

from conftest import MLP, assert_trees_close, make_data, xent

TX = optax.adam(1e-2)
BS = 8


@pytest.fixture(scope="module")
def setup():
    data = make_data(n=64)
    step = make_train_step(xent, TX)
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    return data, step, graphdef, state, init_opt_state(TX, state)


def _run(setup, data, indices, **options):
    _, step, graphdef, state, opt_state = setup

    def call(s, o):
        return scan_indexed_steps(step, graphdef, s, o, data, indices, **options)

    return jax.jit(call)(state, opt_state), jax.make_jaxpr(call)(state, opt_state)


def _loop_bodies(jaxpr) -> list[str]:
    """The text of each loop's body, outermost first."""
    bodies = []
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "scan":
            bodies.append(str(eqn.params["jaxpr"]))
        elif eqn.primitive.name == "while":
            bodies.append(str(eqn.params["body_jaxpr"]))
    return bodies


def _ops(text: str) -> tuple[int, int]:
    return text.count("dynamic_slice"), text.count("gather[")


def _stacked_body(setup, batches) -> str:
    """The body of ``scan_steps`` over batches stacked by hand: what a loop that takes no
    index from an array holds (the step's own slices and gathers)."""
    _, step, graphdef, state, opt_state = setup
    jaxpr = jax.make_jaxpr(lambda s, o: scan_steps(step, graphdef, s, o, batches))(state, opt_state)
    (body,) = _loop_bodies(jaxpr)
    return body


def _by_hand(setup, batches):
    """The independent reference: a hand-written jitted ``lax.scan`` of the step over
    batches stacked with numpy indexing (what a user's own loop trains)."""
    _, step, graphdef, state, opt_state = setup

    def run(s, o):
        def body(carry, batch):
            s, o, loss = step(graphdef, *carry, batch)
            return (s, o), loss

        (s, o), losses = jax.lax.scan(body, (s, o), batches)
        return s, o, losses

    return jax.jit(run)(state, opt_state)


@pytest.fixture(autouse=True)
def _cpu_rule_first(monkeypatch):
    """Each test runs the CPU's rule first and then forces the TPU's, whatever the backend
    (on a TPU the default rule is already the TPU's)."""
    monkeypatch.setattr(batching, "slices_in_loop", lambda: True)


def _on_accelerator(monkeypatch):
    monkeypatch.setattr(batching, "slices_in_loop", lambda: False)


def test_stacked_batches_gather_before_the_loop_bitwise(setup, monkeypatch):
    """A ``(steps,)`` index of whole stacked batches (``scan_train``'s, a stream chunk's):
    the CPU slices each step's batch in the loop; the accelerator gathers them first."""
    data = setup[0]
    stacked = jax.tree.map(lambda v: v.reshape(8, BS, *v.shape[1:]), data)
    numbers = np.array([3, 0, 7, 7, 1, 2], np.int32)  # any order, repeated
    cpu, cpu_jaxpr = _run(setup, stacked, numbers)
    reference = _ops(_stacked_body(setup, jax.tree.map(lambda v: v[numbers], stacked)))
    assert sum(_ops(_loop_bodies(cpu_jaxpr)[0])) == sum(reference) + 2  # takes x's and y's
    _on_accelerator(monkeypatch)
    accel, jaxpr = _run(setup, stacked, numbers)
    assert_trees_close(accel, cpu)
    assert_trees_close(accel, _by_hand(setup, jax.tree.map(lambda v: v[numbers], stacked)),
                       )  # fmt: skip
    (body,) = _loop_bodies(jaxpr)  # one loop, its batches gathered before it
    assert _ops(body) == reference


def test_batch_numbers_gather_their_rows_before_the_loop_bitwise(setup, monkeypatch):
    """``batch_rows`` (an unshuffled epoch's batches by number) on an accelerator: the same
    rows gathered before the loop, bitwise the CPU's slices."""
    data = setup[0]
    numbers = np.array([2, 0, 7, 7, 3], np.int32)
    cpu, _ = _run(setup, data, numbers, batch_rows=BS)
    _on_accelerator(monkeypatch)
    accel, jaxpr = _run(setup, data, numbers, batch_rows=BS)
    assert_trees_close(accel, cpu)
    rows = numbers[:, None] * BS + np.arange(BS)
    assert_trees_close(accel, _by_hand(setup, jax.tree.map(lambda v: v[rows], data)))
    (body,) = _loop_bodies(jaxpr)
    assert _ops(body) == _ops(_stacked_body(setup, jax.tree.map(lambda v: v[rows], data)))
    with pytest.raises(ValueError, match=r"batch numbers must lie in \[0, 8\).*got 0\.\.8"):
        _run(setup, data, np.array([0, 8]), batch_rows=BS)


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_an_accelerator_gathers_wide_batches_in_the_loop_and_stacked_ones_in_chunks(
    setup, monkeypatch
):
    """Big batches of wide rows (``LOOP_GATHER_BYTES`` a step): an accelerator gathers each
    step's batch inside the one loop even within the gather budget (the CPU gathers them
    first); the same batches stacked and taken by number, over the budget, run in chunks
    of steps gathered once each (no index read from an array inside a loop). Bitwise the
    CPU's results both."""
    din = batching.LOOP_GATHER_BYTES // (4 * BS)  # a batch of float32 rows: 64 KiB
    data = make_data(n=64, din=din)
    _, step, _, _, _ = setup
    graphdef, state = nnx.split(MLP(din, rngs=nnx.Rngs(0)))
    wide = (data, step, graphdef, state, init_opt_state(TX, state))
    order = np.random.default_rng(0).permutation(64).astype(np.int32).reshape(8, BS)
    cpu, cpu_jaxpr = _run(wide, data, order)
    reference = _ops(_stacked_body(wide, jax.tree.map(lambda v: v[order], data)))
    assert _ops(_loop_bodies(cpu_jaxpr)[0]) == reference  # the CPU gathers them first
    stacked = jax.tree.map(lambda v: v[order], data)  # (8, BS, din): a 64 KiB row each
    numbers = np.array([5, 1, 1, 7, 0, 2, 3], np.int32)
    budget = 3 * batching._batch_bytes(stacked, 1)
    cpu_stacked, _ = _run(wide, stacked, numbers, gather_budget=budget)

    _on_accelerator(monkeypatch)
    assert batching._gather_budget(data) == batching.ACCELERATOR_GATHER_BUDGET_BYTES
    accel, jaxpr = _run(wide, data, order)
    assert_trees_close(accel, cpu)
    (body,) = _loop_bodies(jaxpr)
    assert _ops(body)[1] == reference[1] + len(data)  # a gather a leaf a step, in the loop
    accel_stacked, jaxpr = _run(wide, stacked, numbers, gather_budget=budget)
    assert_trees_close(accel_stacked, cpu_stacked)
    (outer,) = _loop_bodies(jaxpr)
    assert "scan[" in outer or "while[" in outer  # chunks: a loop in a loop


def test_batch_numbers_past_the_end_clamp_as_the_cpu_does(setup, monkeypatch):
    """A traced batch number out of range (and rows that do not divide the data): the
    accelerator takes the rows the CPU's dynamic slice clamps to."""
    data = jax.tree.map(lambda v: v[:61], setup[0])  # 61 rows: 7 batches of 8, 5 left
    numbers = np.array([6, 9, 0], np.int32)
    _, step, graphdef, state, opt_state = setup

    def call(s, o, numbers):  # traced numbers: no host check, clamped
        return scan_indexed_steps(step, graphdef, s, o, data, numbers, batch_rows=BS)

    cpu = jax.jit(call)(state, opt_state, numbers)
    _on_accelerator(monkeypatch)
    accel = jax.jit(call)(state, opt_state, numbers)
    assert_trees_close(accel, cpu)
    rows = np.minimum(numbers * BS, 61 - BS)[:, None] + np.arange(BS)  # lax.dynamic_slice's
    assert_trees_close(accel, _by_hand(setup, jax.tree.map(lambda v: v[rows], data)))


def test_a_step_without_data_runs_on_an_accelerator(monkeypatch):
    """``fit(None, steps_per_epoch=K)``: the index is only a step count (nothing is
    gathered); the accelerator's rule leaves it so, and trains what the CPU trains."""
    from nnxscan.pure import Step
    from nnxscan.shell import Trainer

    def update(graphdef, state, opt_state, batch):
        assert batch is None
        return state, opt_state + 1, opt_state.astype(np.float32)

    def losses():  # a new Step each time: a program of its own, traced under the rule
        step = Step(lambda graphdef, state: np.int32(0), update)
        trainer = Trainer(MLP(rngs=nnx.Rngs(0)), train_step=step)
        return trainer.fit(None, epochs=2, steps_per_epoch=3, progress=False).losses

    cpu = losses()
    _on_accelerator(monkeypatch)
    np.testing.assert_array_equal(losses(), cpu)
    np.testing.assert_array_equal(cpu, np.arange(6, dtype=np.float32))  # 6 steps, in order
