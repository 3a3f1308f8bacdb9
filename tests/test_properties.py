"""Property-based tests (hypothesis): random shapes, step counts, chunkings and batch sizes.

The scanned result equals the per-step NNX loop for every plan; malformed input always
raises ValueError/TypeError before anything runs, and never changes the model.
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnxscan.shell import Plan, Trainer

from conftest import MLP, assert_trees_close, epoch_batches, reference_loop, state_arrays, xent

TX = optax.sgd(0.1, momentum=0.9)
# Each example compiles two programs (ours and the reference); keep the count small.
SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def random_data(n, din, classes, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, din)).astype(np.float32)
    return {"x": x, "y": rng.integers(0, classes, n).astype(np.int32)}


@pytest.mark.slow
@SETTINGS
@given(
    din=st.integers(1, 5),
    hidden=st.integers(1, 6),
    dout=st.integers(2, 4),
    batch_size=st.integers(1, 5),
    steps=st.integers(1, 7),
    extra=st.integers(0, 4),
    epochs=st.integers(1, 2),
    plan=st.sampled_from(["scan", "unrolled", "step", "scan-chunked"]),
    chunk=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_scanned_training_equals_the_per_step_loop(
    din, hidden, dout, batch_size, steps, extra, epochs, plan, chunk, seed
):
    n = steps * batch_size + min(extra, batch_size - 1)
    data = random_data(n, din, dout, seed)
    ref = MLP(din, hidden, dout, rngs=nnx.Rngs(seed))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    batches = [b for e in range(epochs) for b in epoch_batches(data, batch_size, seed, e)]
    ref_losses = reference_loop(ref, ref_opt, xent, batches)

    model = MLP(din, hidden, dout, rngs=nnx.Rngs(seed))
    execution = {"unrolled": Plan("unrolled", chunk), "scan-chunked": "scan"}.get(plan, plan)
    history = Trainer(model, TX, xent, execution=execution).fit(
        data,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        steps_per_call=chunk if plan == "scan-chunked" else None,
        progress=False,
    )
    np.testing.assert_allclose(history.losses, np.array(ref_losses), rtol=2e-5, atol=2e-6)
    assert_trees_close(model, ref, rtol=2e-5, atol=2e-6)


KINDS = (
    "leading sizes differ",
    "empty",
    "string leaf",
    "object leaf",
    "string array",
    "scalar leaf",
    "batch too large",
    "batch zero",
    "batch float",
    "epochs negative",
    "epochs float",
    "wrong feature size",
    "stream shape change",
    "stream empty",
    "stream ragged middle",
)


def malformed(kind, data):
    x, y = data["x"], data["y"]
    fit = {"epochs": 1, "batch_size": 4}
    if kind == "leading sizes differ":
        return {"x": x, "y": y[:-1]}, fit
    if kind == "empty":
        return {"x": x[:0], "y": y[:0]}, fit
    if kind == "string leaf":
        return {"x": x, "y": y, "name": "digits"}, fit
    if kind == "object leaf":
        return {"x": x, "y": [object()] * len(y)}, fit
    if kind == "string array":
        return {"x": x, "y": y.astype(str)}, fit
    if kind == "scalar leaf":
        return {"x": x, "y": y, "w": np.float32(1.0)}, fit
    if kind == "batch too large":
        return data, {**fit, "batch_size": len(x) + 1}
    if kind == "batch zero":
        return data, {**fit, "batch_size": 0}
    if kind == "batch float":
        return data, {**fit, "batch_size": 4.0}
    if kind == "epochs negative":
        return data, {**fit, "epochs": -1}
    if kind == "epochs float":
        return data, {**fit, "epochs": 1.5}
    if kind == "wrong feature size":
        return {"x": np.ones((len(x), 7), np.float32), "y": y}, fit
    batches = [{"x": x[i : i + 4], "y": y[i : i + 4]} for i in range(0, 16, 4)]
    if kind == "stream shape change":
        return [batches[0], {"x": np.ones((4, 7), np.float32), "y": y[:4]}], {"epochs": 1}
    if kind == "stream empty":
        return [], {"epochs": 1}
    return [batches[0], {"x": x[:2], "y": y[:2]}, batches[1]], {"epochs": 1}  # ragged middle


@pytest.mark.parametrize("kind", KINDS)  # every kind, each with a few random models
@settings(SETTINGS, max_examples=3)
@given(seed=st.integers(0, 100), use_optimizer=st.booleans())
def test_malformed_input_raises_a_clear_error_and_mutates_nothing(kind, seed, use_optimizer):
    data = random_data(16, 4, 3, seed)
    model = MLP(rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param) if use_optimizer else TX
    trainer = Trainer(model, optimizer, xent)
    before = state_arrays(model) + (state_arrays(optimizer) if use_optimizer else [])
    bad, kwargs = malformed(kind, data)
    try:
        trainer.fit(bad, progress=False, **kwargs)
    except (ValueError, TypeError):
        pass
    else:
        raise AssertionError(f"{kind}: fit accepted malformed input")
    after = state_arrays(model) + (state_arrays(optimizer) if use_optimizer else [])
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (trainer.step, trainer.epoch) == (0, 0)
    model(data["x"])  # still usable: no donated buffer left behind
