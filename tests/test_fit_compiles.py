"""What a second fit compiles (docs/training.md): nothing with the same shapes and epochs;
one program per new count of fused epochs; nothing when epochs are not fused. What one fit
compiles: each program it calls once, those after the first while the first compiles."""

from __future__ import annotations

import threading
import time

import jax
import jax.monitoring
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import LambdaCallback, Trainer
from nnxscan.shell._engine import fit as fit_module

from conftest import MLP, state_arrays, xent

TX = optax.adam(1e-2)


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_fused_epochs_compile_once_per_stretch_length(data, compile_count, stretch_count):
    trainer = Trainer(MLP(hidden=23, rngs=nnx.Rngs(0)), TX, xent)
    new, calls = [], []
    for epochs in (5, 3, 10, 6, 7, 3):
        before, first = compile_count(), stretch_count()
        trainer.fit(data, epochs=epochs, batch_size=16, progress=False)
        new.append(compile_count() - before)
        calls.append(stretch_count() - first)
    # One fused call of epochs x 4 steps, a new program per count; unless a length compiled
    # before divides the epochs: 10 = 2 calls of 5, 6 = 2 of 3 (compiling nothing).
    assert new == [1, 1, 0, 0, 1, 0]
    assert calls == [1, 1, 2, 2, 1, 1]
    straight = Trainer(MLP(hidden=23, rngs=nnx.Rngs(0)), TX, xent)
    straight.fit(data, epochs=34, batch_size=16, progress=False)  # the same 34 epochs
    for a, b in zip(state_arrays(trainer.model), state_arrays(straight.model), strict=True):
        np.testing.assert_array_equal(a, b)  # however they are cut into calls


def test_epochs_that_are_not_fused_compile_nothing_for_another_count(data, compile_count):
    fused = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    apart = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    seen = []
    callback = LambdaCallback(on_epoch_end=lambda t, epoch, logs: seen.append(epoch))
    apart.fit(data, epochs=1, batch_size=16, progress=False, callbacks=[callback])
    before = compile_count()
    for epochs in (5, 3, 7):
        apart.fit(data, epochs=epochs, batch_size=16, progress=False, callbacks=[callback])
    assert compile_count() == before  # every epoch is the same call
    assert seen == list(range(16))
    for epochs in (1, 5, 3, 7):
        fused.fit(data, epochs=epochs, batch_size=16, progress=False)
    for a, b in zip(state_arrays(fused.model), state_arrays(apart.model), strict=True):
        np.testing.assert_array_equal(a, b)  # fused or not, the same bits


def test_fused_epochs_end_where_one_gather_ends(data, stretch_count, monkeypatch):
    """Epochs fuse into one call only as far as one gather holds their batches
    (``pure.batching.steps_per_gather``): a longer call would gather in chunks, an outer
    loop around the loop of steps that XLA compiles longer. Reference: the same epochs
    fused into one call under the default budget; the same bits however they are cut."""
    from nnxscan.pure import batching

    tx = optax.adam(1e-2)  # its own programs: no length compiled by another test to reuse
    whole = Trainer(MLP(rngs=nnx.Rngs(0)), tx, xent)
    first = stretch_count()
    whole.fit(data, epochs=6, batch_size=16, progress=False)
    assert stretch_count() - first == 1  # 6 epochs of 4 steps: one gather
    per_step = batching._batch_bytes(data, 16)
    budgets = (
        "GATHER_BUDGET_BYTES",
        "NARROW_GATHER_BUDGET_BYTES",
        "ACCELERATOR_GATHER_BUDGET_BYTES",
    )
    for name in budgets:  # the CPU's two and a TPU's
        monkeypatch.setattr(batching, name, 9 * per_step)  # 2 epochs' batches, not 3
    assert batching.steps_per_gather(data, 16) == 9
    cut = Trainer(MLP(rngs=nnx.Rngs(0)), tx, xent)
    first = stretch_count()
    cut.fit(data, epochs=6, batch_size=16, progress=False)
    assert stretch_count() - first == 3  # calls of 2 epochs each
    for a, b in zip(state_arrays(cut.model), state_arrays(whole.model), strict=True):
        np.testing.assert_array_equal(a, b)


def _compiles_during(run) -> list[tuple[str, str]]:
    """``run()``'s XLA compiles: ``(program name, thread name)`` each."""
    compiles = []

    def on_event(event: str, secs: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((str(kwargs.get("fun_name")), threading.current_thread().name))

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        run()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    return compiles


@pytest.mark.parametrize(
    ("tail", "slow"), [pytest.param(False, False, marks=pytest.mark.slow), (True, False),
     pytest.param(False, True, marks=pytest.mark.slow)],  # over ~5 s each on 2 cores
    ids=["cut_stretch", "short_batch", "slow_thread"],
)  # fmt: skip
def test_programs_of_later_calls_compile_ahead_and_once(data, tail, slow, monkeypatch):
    """The programs a fit will surely call after its first (the 2-epoch stretch that
    evaluation every 4 of 10 epochs leaves, or each epoch's short last batch, and the
    evaluation) compile on a thread while the first call compiles: each program once, no
    program the run does not call, and the same bits as epochs run one call each. However
    late the thread starts compiling (``slow``), a call waits for its program rather than
    compiling it a second time: where programs compile never depends on timing."""
    if slow:
        compile_all = fit_module.Ahead._compile_all
        late = lambda self, programs: (time.sleep(1.0), compile_all(self, programs))  # noqa: E731
        monkeypatch.setattr(fit_module.Ahead, "_compile_all", late)
    hidden = {(False, False): 11, (True, False): 13, (False, True): 29}[tail, slow]  # new shapes
    options = dict(batch_size=24 if tail else 16, drop_remainder=not tail, progress=False)
    evaluation = dict(eval_every=4, eval_data=data, metric_fn=lambda m, b: {"loss": xent(m, b)})
    ahead = Trainer(MLP(hidden=hidden, rngs=nnx.Rngs(0)), TX, xent)
    compiles = _compiles_during(lambda: ahead.fit(data, epochs=10, **options, **evaluation))
    main = [name for name, thread in compiles if thread == "MainThread"]
    assert main == ["jit(run)"]  # the first call's; every other one was compiled ahead
    assert sorted(name for name, thread in compiles if thread == "nnxscan-compile") == [
        "jit(evaluate)",
        "jit(run)",
    ]
    apart = Trainer(MLP(hidden=hidden, rngs=nnx.Rngs(0)), TX, xent)
    callback = LambdaCallback(on_epoch_end=lambda t, epoch, logs: None)  # no fusing
    apart.fit(data, epochs=10, callbacks=[callback], **options)
    for a, b in zip(state_arrays(ahead.model), state_arrays(apart.model), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_only_an_evaluation_the_run_reaches_compiles_ahead(data):
    """The evaluation compiles ahead when the fit surely reaches one (with callbacks that
    could stop it, only when the first epoch ends in one), and not at all when none falls
    within the fit's epochs."""
    evaluation = dict(eval_data=data, metric_fn=lambda m, b: {"loss": xent(m, b)})
    options = dict(batch_size=16, progress=False)
    never = Trainer(MLP(hidden=17, rngs=nnx.Rngs(0)), TX, xent)
    compiles = _compiles_during(
        lambda: never.fit(data, epochs=3, eval_every=5, **options, **evaluation)
    )
    assert [name for name, _ in compiles] == ["jit(run)"]  # epochs 0-2: no evaluation
    hooked = Trainer(MLP(hidden=19, rngs=nnx.Rngs(0)), TX, xent)
    callback = LambdaCallback(on_epoch_end=lambda t, epoch, logs: None)  # epochs apart
    compiles = _compiles_during(
        lambda: hooked.fit(data, epochs=2, callbacks=[callback], **options, **evaluation)
    )
    assert sorted(compiles) == [("jit(evaluate)", "nnxscan-compile"), ("jit(run)", "MainThread")]


def test_fit_and_evaluate_trace_with_the_garbage_collector_paused(data):
    # Tracing allocates many short-lived objects; full collections during it walked the
    # whole heap (docs/performance.md). Observed where JAX reports each trace and lowering
    # (jax.monitoring, on the tracing thread): the training call's program ("run"), the
    # evaluation's ("evaluate") and the step the plan rule traces (the user's loss_fn),
    # each with the collector paused, and the collector on again after.
    import gc

    traced = []

    def loss_fn(model, batch):
        traced.append(("loss_fn", gc.isenabled()))
        return xent(model, batch)

    def on_event(event, duration, **kwargs):
        if event.endswith(("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration")):
            traced.append((kwargs.get("fun_name"), gc.isenabled()))

    _EVENTS["listener"] = on_event
    gc.enable()  # whatever an earlier test left
    trainer = Trainer(MLP(hidden=19, rngs=nnx.Rngs(0)), TX, loss_fn)
    try:
        trainer.fit(data, epochs=1, batch_size=16, progress=False)
        trainer.evaluate(data, lambda m, b: {"loss": xent(m, b)}, batch_size=16)
    finally:
        _EVENTS["listener"] = None
    ours = {"loss_fn", "run", "jit(run)", "evaluate", "jit(evaluate)"}
    seen = [(name, on) for name, on in traced if name in ours]
    assert {name for name, _ in seen} == ours, traced
    assert not any(on for _, on in seen), seen
    assert gc.isenabled()


# One listener for the module (jax.monitoring has no public way to remove one).
_EVENTS = {"listener": None}


def _forward_event(event, duration, **kwargs):
    if _EVENTS["listener"] is not None:
        _EVENTS["listener"](event, duration, **kwargs)


jax.monitoring.register_event_duration_secs_listener(_forward_event)
