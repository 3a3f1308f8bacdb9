"""Errors raised while tracing the user's loss or metric carry a note describing the batch.

The reference is the untouched error: the same function called eagerly on the same batch,
as a plain NNX loop would call it. nnxscan must raise that exception (same type, same
message, the user's frame still in the traceback) with one note added that names the
function and every leaf of the batch with its shape and dtype.
"""

from __future__ import annotations

import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import Population, Trainer, scan_train
from nnxscan.shell._engine.trace_notes import NOTE_HEADER, noting_batch
from nnxscan.shell._tracebacks import HIDDEN_NOTE, own_frame

N, BATCH, EVAL_BATCH = 32, 8, 12


def xent(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def xent_metric(model, batch):
    return xent(model, batch)


def model_fn(rngs: nnx.Rngs) -> nnx.Module:
    return nnx.Linear(64, 10, rngs=rngs)


def _data(kind: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 64)).astype(np.float32)
    y = rng.integers(0, 10, N).astype(np.int32)
    if kind == "shape":  # 8x8 images into Linear(64): the example
        return {"x": x.reshape(N, 8, 8), "y": y}
    if kind == "dtype":  # float labels into an integer-label loss
        return {"x": x, "y": y.astype(np.float32)}
    if kind == "key":  # the labels under another name
        return {"x": x, "label": y}
    raise AssertionError(kind)


KINDS = ["shape", "dtype", "key"]


def _untouched_error(fn, data, size: int) -> Exception:
    """What ``fn`` raises on the first batch, called eagerly: no nnxscan in between."""
    batch = {k: jnp.asarray(v[:size]) for k, v in data.items()}
    with pytest.raises(Exception) as caught:
        fn(model_fn(nnx.Rngs(0)), batch)
    assert not getattr(caught.value, "__notes__", None) or not any(
        NOTE_HEADER in n for n in caught.value.__notes__
    )
    return caught.value


def _check(caught, reference: Exception, fn, data, size: int, what: str) -> None:
    error = caught.value
    assert type(error) is type(reference)
    assert str(error) == str(reference)
    notes = [n for n in getattr(error, "__notes__", []) if n.startswith(NOTE_HEADER)]
    assert len(notes) == 1, error.__notes__
    note = notes[0]
    role = "loss_fn" if what == "training step" else "metric_fn"
    assert f"while tracing the {what} on the first batch" in note
    assert f"{role} {fn.__module__}.{fn.__qualname__}" in note
    lines = note.splitlines()
    for key, value in data.items():
        shape = (size, *value.shape[1:])
        (line,) = [row for row in lines if row.strip().startswith(f"['{key}']")]
        assert line.split() == [f"['{key}']", "shape", *str(shape).split(), str(value.dtype)]
    # The original traceback stays: it reaches down into the user's function, with
    # nnxscan's own frames left out (the front door, the engine, the step's rewrites) and
    # nnxscan's note about the batch first among the notes.
    frames = traceback.extract_tb(error.__traceback__)
    assert fn.__name__ in [frame.name for frame in frames]
    assert [f"{f.filename}:{f.name}" for f in frames if own_frame(f.filename)] == []
    assert error.__notes__[0] == note
    assert HIDDEN_NOTE in error.__notes__


@pytest.mark.parametrize("front", ["fit", "scan_train"])
def test_a_wrong_width_reaches_the_user_at_their_call_unless_filtering_is_off(front):
    """The issue's case: a feature width the model does not take. Counted against the same
    error with JAX_TRACEBACK_FILTERING=off, where nnxscan's frames all stay."""
    data = _data("shape")

    def raised() -> Exception:
        model = model_fn(nnx.Rngs(0))
        with pytest.raises(TypeError, match="dot_general requires contracting") as caught:
            if front == "fit":
                Trainer(model, optax.sgd(0.1), xent).fit(
                    data, epochs=1, batch_size=BATCH, progress=False
                )
            else:
                optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
                scan_train(model, optimizer, xent, data, batch_size=BATCH)
        return caught.value

    def own_frames(error: Exception) -> list[str]:
        frames = traceback.extract_tb(error.__traceback__)
        return [f.name for f in frames if own_frame(f.filename)]

    filtered = raised()
    previous = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        unfiltered = raised()
    finally:
        jax.config.update("jax_traceback_filtering", previous)
    assert own_frames(filtered) == []
    assert len(own_frames(unfiltered)) >= 10  # the engine, programs, the step's rewrites
    assert filtered.__notes__[0].startswith(NOTE_HEADER)
    assert "shape (8, 8, 8)" in filtered.__notes__[0]
    assert not any(HIDDEN_NOTE in n for n in getattr(unfiltered, "__notes__", []))
    rendered = "".join(traceback.format_exception(filtered))
    # The user's call, then the user's loss and model, then the message and the note.
    assert rendered.index("in raised") < rendered.index("in xent") < rendered.index(NOTE_HEADER)


def test_an_error_nnxscan_raises_itself_ends_at_the_users_call():
    trainer = Trainer(model_fn(nnx.Rngs(0)), optax.sgd(0.1), xent)
    with pytest.raises(ValueError, match="batch_size") as caught:
        trainer.fit(_data("key"), epochs=1, batch_size=0, progress=False)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert frames[-1].name == "test_an_error_nnxscan_raises_itself_ends_at_the_users_call"


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_fit(kind):
    data = _data(kind)
    reference = _untouched_error(xent, data, BATCH)
    trainer = Trainer(model_fn(nnx.Rngs(0)), optax.sgd(0.1), xent)
    with pytest.raises(type(reference)) as caught:
        trainer.fit(data, epochs=1, batch_size=BATCH, progress=False)
    _check(caught, reference, xent, data, BATCH, "training step")
    assert trainer.step == 0


@pytest.mark.parametrize("kind", KINDS)
def test_scan_train(kind):
    data = _data(kind)
    reference = _untouched_error(xent, data, BATCH)
    model = model_fn(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(type(reference)) as caught:
        scan_train(model, optimizer, xent, data, batch_size=BATCH)
    _check(caught, reference, xent, data, BATCH, "training step")


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_evaluate(kind):
    data = _data(kind)
    reference = _untouched_error(xent_metric, data, EVAL_BATCH)
    trainer = Trainer(model_fn(nnx.Rngs(0)), optax.sgd(0.1), xent)
    with pytest.raises(type(reference)) as caught:
        trainer.evaluate(data, xent_metric, batch_size=EVAL_BATCH)
    _check(caught, reference, xent_metric, data, EVAL_BATCH, "evaluation")


def test_evaluation_inside_fit_is_noted_once():
    good, bad = _data("shape"), _data("shape")
    good["x"] = good["x"].reshape(N, 64)
    reference = _untouched_error(xent_metric, bad, EVAL_BATCH)
    trainer = Trainer(model_fn(nnx.Rngs(0)), optax.sgd(0.1), xent)
    with pytest.raises(type(reference)) as caught:
        trainer.fit(good, epochs=1, batch_size=BATCH, progress=False, eval_data=bad,
                    metric_fn=xent_metric, eval_batch_size=EVAL_BATCH)  # fmt: skip
    _check(caught, reference, xent_metric, bad, EVAL_BATCH, "evaluation")


@pytest.mark.parametrize("kind", KINDS)
def test_population_fit(kind):
    data = _data(kind)
    reference = _untouched_error(xent, data, BATCH)
    population = Population(model_fn, optax.sgd(0.1), xent, seeds=[0, 1])
    with pytest.raises(type(reference)) as caught:
        population.fit(data, epochs=1, batch_size=BATCH, progress=False)
    _check(caught, reference, xent, data, BATCH, "training step")


def test_population_evaluate():
    data = _data("key")
    reference = _untouched_error(xent_metric, data, EVAL_BATCH)
    population = Population(model_fn, optax.sgd(0.1), xent, seeds=[0, 1])
    with pytest.raises(type(reference)) as caught:
        population.evaluate(data, xent_metric, batch_size=EVAL_BATCH)
    _check(caught, reference, xent_metric, data, EVAL_BATCH, "evaluation")


def test_the_note_is_added_once_and_never_to_runtime_errors():
    batch = {"x": jax.ShapeDtypeStruct((4, 3), jnp.float32), "nested": [np.zeros((4,), bool)]}
    outer, inner = (
        noting_batch("evaluation", xent_metric, batch),
        noting_batch("training step", xent, batch),
    )
    with pytest.raises(KeyError) as caught, outer, inner:
        raise KeyError("y")
    (note,) = caught.value.__notes__
    assert "training step" in note and "['nested'][0]" in note and "(4,)" in note
    with (
        pytest.raises(jax.errors.JaxRuntimeError) as runtime,
        noting_batch("training step", xent, batch),
    ):
        raise jax.errors.JaxRuntimeError("INTERNAL: device failure")
    assert not getattr(runtime.value, "__notes__", None)
    # Nothing happens without an exception; several functions are named by role.
    two = {"loss_fn": xent, "update_metrics": print}
    with noting_batch("evaluation", two, batch):
        pass
    with pytest.raises(ValueError) as both, noting_batch("evaluation", two, batch):
        raise ValueError("bad")
    assert f"loss_fn {__name__}.xent, update_metrics builtins.print" in both.value.__notes__[0]
