"""Streaming batches from host iterators, against the per-step NNX loop on the same batches."""

from __future__ import annotations

import itertools
import re
import threading

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import Trainer

from conftest import (
    MLP,
    assert_trees_close,
    make_data,
    reference_loop,
    state_arrays,
    xent,
)

TX = optax.adam(1e-2)
BS = 4


@pytest.fixture(scope="module")
def batches():
    """15 batches of 4 in a fixed order (the stream), as numpy."""
    d = make_data(n=60)
    return [{k: v[i * BS : (i + 1) * BS] for k, v in d.items()} for i in range(15)]


def reference(batch_list, epochs=1):
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    losses = reference_loop(model, optimizer, xent, list(batch_list) * epochs)
    return model, np.array(losses)


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "nnxscan-prefetch" and t.is_alive()]


@pytest.mark.parametrize("steps_per_call", [5, 4, 100])  # divides 15, doesn't, longer
@pytest.mark.parametrize("prefetch", [True, False])
def test_stream_equals_the_per_step_loop_on_the_same_batches(batches, steps_per_call, prefetch):
    ref, ref_losses = reference(batches, epochs=2)
    model = MLP(rngs=nnx.Rngs(0))
    history = Trainer(model, TX, xent).fit(
        batches, epochs=2, steps_per_call=steps_per_call, prefetch=prefetch, progress=False
    )
    np.testing.assert_allclose(history.losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(model, ref)
    assert [e["steps"] for e in history.epochs] == [15, 15]
    assert not prefetch_threads()


def test_stream_equals_unshuffled_arrays(batches):
    arrays = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    streamed, stacked = MLP(rngs=nnx.Rngs(0)), MLP(rngs=nnx.Rngs(0))
    Trainer(streamed, TX, xent).fit(batches, epochs=2, steps_per_call=4, progress=False)
    Trainer(stacked, TX, xent).fit(arrays, epochs=2, batch_size=BS, shuffle=False, progress=False)
    assert_trees_close(streamed, stacked)


class FakeTensor:
    """Behaves like a PyTorch CPU tensor as far as conversion goes."""

    def __init__(self, array):
        self._array = np.asarray(array)

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self._array


class FakeDataLoader:
    """Re-iterable, has a length, yields (x, y) tuples of tensors, like torch's DataLoader."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter([(FakeTensor(b["x"]), FakeTensor(b["y"])) for b in self.batches])


def tuple_xent(model, batch):
    x, y = batch
    return xent(model, {"x": x, "y": y})


def test_dataloader_like_object_and_generator_factory(batches):
    ref, ref_losses = reference(batches, epochs=2)
    from_loader, from_factory = MLP(rngs=nnx.Rngs(0)), MLP(rngs=nnx.Rngs(0))
    h1 = Trainer(from_loader, TX, tuple_xent).fit(
        FakeDataLoader(batches), epochs=2, batch_size=BS, progress=False
    )

    def factory():
        yield from batches

    h2 = Trainer(from_factory, TX, xent).fit(factory, epochs=2, progress=False)
    for model, history in [(from_loader, h1), (from_factory, h2)]:
        np.testing.assert_allclose(history.losses, ref_losses, rtol=1e-5, atol=1e-6)
        assert_trees_close(model, ref)


def test_single_use_iterator_trains_one_epoch(batches):
    ref, _ = reference(batches)
    model = MLP(rngs=nnx.Rngs(0))
    Trainer(model, TX, xent).fit(iter(batches), epochs=1, progress=False)
    assert_trees_close(model, ref)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_ragged_final_batch_is_dropped_with_a_warning_or_kept(batches):
    short = {k: v[:3] for k, v in batches[0].items()}
    stream = [*batches[:6], short]
    ref, _ = reference(stream[:6])
    model = MLP(rngs=nnx.Rngs(0))
    with pytest.warns(UserWarning, match="dropped the final short batch of 3 examples") as said:
        history = Trainer(model, TX, xent).fit(stream, epochs=1, progress=False)
    assert said[0].filename == __file__  # the user's line, not nnxscan's
    assert history.epochs[0]["dropped_examples"] == 3 and history.epochs[0]["steps"] == 6
    assert_trees_close(model, ref)

    ref_kept, ref_losses = reference(stream, epochs=2)
    kept = MLP(rngs=nnx.Rngs(0))
    history = Trainer(kept, TX, xent).fit(
        stream, epochs=2, steps_per_call=4, drop_remainder=False, progress=False
    )
    np.testing.assert_allclose(history.losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(kept, ref_kept)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_arrays_with_steps_per_call_and_kept_tail_compile_once(compile_count):
    d = make_data(n=62)  # 15 batches of 4 and a tail of 2
    order = np.arange(62)
    cuts = [order[i : i + BS] for i in range(0, 62, BS)]
    ref, ref_losses = reference([{k: v[c] for k, v in d.items()} for c in cuts], epochs=2)
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    options = dict(batch_size=BS, shuffle=False, steps_per_call=4, drop_remainder=False)
    history = trainer.fit(d, epochs=1, progress=False, **options)
    compiled = compile_count()
    history2 = trainer.fit(d, epochs=1, progress=False, **options)
    assert compile_count() == compiled  # the short chunk (3 steps) and the tail: cached
    losses = np.concatenate([history.losses, history2.losses])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(model, ref)


class Tiny(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.w = nnx.Linear(2, 1, rngs=rngs)

    def __call__(self, x):
        return self.w(x)


@pytest.mark.slow  # paced by sleeps; the other prefetch tests stay fast
def test_prefetch_never_pulls_more_than_two_chunks_ahead_of_the_last_finished_call():
    steps, k = 100_000, 1_000
    pulled = {"n": 0}
    batch = {"x": np.ones((2, 2), np.float32), "y": np.zeros((2, 1), np.float32)}

    def lazy_batches():
        for _ in range(steps):
            pulled["n"] += 1
            yield batch

    class Watch:
        most_ahead = 0

        def on_call_end(self, trainer, logs):
            step = logs["step"]
            Watch.most_ahead = max(Watch.most_ahead, pulled["n"] - step)

    def mse(model, b):
        return ((model(b["x"]) - b["y"]) ** 2).mean()

    trainer = Trainer(Tiny(rngs=nnx.Rngs(0)), optax.sgd(1e-3), mse)
    trainer.fit(lazy_batches, epochs=1, steps_per_call=k, callbacks=[Watch()], progress=False)
    assert trainer.step == steps and pulled["n"] == steps
    assert 0 < Watch.most_ahead <= 2 * k


def test_an_iterator_raising_mid_epoch_keeps_the_last_completed_call(batches):
    def failing():
        for i, b in enumerate(itertools.cycle(batches)):
            if i == 37:
                raise RuntimeError("loader broke at batch 37")
            yield b

    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    with pytest.raises(RuntimeError, match="batch 37"):
        trainer.fit(failing, epochs=1, steps_per_call=10, progress=False)
    ref, _ = reference((batches * 3)[:30])  # three completed calls of 10
    assert trainer.step == 30
    assert_trees_close(model, ref)
    model(batches[0]["x"])  # usable
    assert not prefetch_threads()


def test_an_interrupt_in_a_callback_stops_the_prefetch_thread(batches):
    class Stop:
        def on_call_end(self, trainer, logs):
            step = logs["step"]
            if step == 8:
                raise KeyboardInterrupt

    pulled = {"n": 0}

    def counted():
        for b in batches * 100:
            pulled["n"] += 1
            yield b

    model = MLP(rngs=nnx.Rngs(0))
    with pytest.raises(KeyboardInterrupt) as kept:  # a kept traceback must not keep the thread
        Trainer(model, TX, xent).fit(
            counted, epochs=1, steps_per_call=4, callbacks=[Stop()], progress=False
        )
    assert kept.value is not None and not prefetch_threads()
    after = pulled["n"]
    assert after <= 8 + 2 * 4 + 1  # bounded, and nothing pulled once fit has raised
    ref, _ = reference(batches[:8])
    assert_trees_close(model, ref)


def test_pulls_stay_two_chunks_ahead_of_the_steps_that_ran():
    """Measured at every pull, against steps that really executed (a host callback)."""
    k, steps = 5, 200
    ran, pulled, most_ahead = {"n": 0}, {"n": 0}, {"n": 0}
    batch = {"x": np.ones((2, 2), np.float32), "y": np.zeros((2, 1), np.float32)}

    def lazy_batches():
        for _ in range(steps):
            most_ahead["n"] = max(most_ahead["n"], pulled["n"] - ran["n"])
            pulled["n"] += 1
            yield batch

    def count(_):
        ran["n"] += 1

    def mse(model, b):
        jax.debug.callback(count, b["x"][0, 0])
        return ((model(b["x"]) - b["y"]) ** 2).mean()

    trainer = Trainer(Tiny(rngs=nnx.Rngs(0)), optax.sgd(1e-3), mse)
    trainer.fit(lazy_batches, epochs=1, steps_per_call=k, progress=False)
    assert ran["n"] == steps and 0 < most_ahead["n"] <= 2 * k


# -- bad input ---------------------------------------------------------------------------------


def test_a_batch_with_another_dtype_is_caught_before_it_trains(batches):
    bad = [*batches[:5], {"x": batches[0]["x"], "y": batches[0]["y"].astype(np.float32)}]
    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    with pytest.raises(ValueError, match=r"batch 5, leaf \['y'\]: shape \(4,\) float32.*int32"):
        trainer.fit(bad, epochs=1, steps_per_call=4, progress=False)
    ref, _ = reference(batches[:4])  # the first chunk trained; the bad one never did
    assert trainer.step == 4
    assert_trees_close(model, ref)


def test_an_epoch_with_other_shapes_names_the_epoch(batches):
    epochs_seen = {"n": 0}

    def shifting():
        epochs_seen["n"] += 1
        if epochs_seen["n"] == 1:
            yield from batches
        else:
            yield {"x": np.zeros((4, 5), np.float32), "y": batches[0]["y"]}

    model = MLP(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent)
    with pytest.raises(ValueError, match=r"batch 0 of epoch 1, leaf \['x'\]"):
        trainer.fit(shifting, epochs=2, progress=False)
    ref, _ = reference(batches)
    assert trainer.epoch == 1
    assert_trees_close(model, ref)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_a_streamed_cnn_keeps_calls_of_four_unrolled_steps():
    from conftest import SmallCNN

    rng = np.random.default_rng(0)
    stream = [
        {"x": rng.normal(size=(4, 8, 8, 1)).astype(np.float32),
         "y": rng.integers(0, 3, 4).astype(np.int32)}
        for _ in range(10)
    ]  # fmt: skip
    model = SmallCNN(rngs=nnx.Rngs(0))
    trainer = Trainer(model, TX, xent, execution="unrolled")
    calls = []

    class Count:
        def on_call_end(self, trainer, logs):
            step = logs["step"]
            calls.append(step)

    trainer.fit(stream, epochs=1, steps_per_call=10, callbacks=[Count()], progress=False)
    assert calls == [4, 8, 10]  # a chunk of 10 runs as unrolled calls of 4, 4, 2
    ref = SmallCNN(rngs=nnx.Rngs(0))
    reference_loop(ref, nnx.Optimizer(ref, TX, wrt=nnx.Param), xent, stream)
    assert_trees_close(model, ref, rtol=1e-4, atol=1e-6)


def _unchanged(model, before):
    for a, b in zip(before, state_arrays(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_batch_with_other_shapes_names_index_path_and_shapes(batches):
    bad = [*batches[:5], {"x": np.zeros((4, 5), np.float32), "y": batches[0]["y"]}]
    model = MLP(rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"batch 5, leaf \['x'\]: shape \(4, 5\).*\(4, 4\)"):
        Trainer(model, TX, xent).fit(bad, epochs=1, steps_per_call=10, progress=False)
    missing = [*batches[:2], {"x": batches[0]["x"]}]
    with pytest.raises(ValueError, match="batch 2 has another structure"):
        Trainer(model, TX, xent).fit(missing, epochs=1, progress=False)


class Loader:
    """A DataLoader-like iterable: a fresh iterator over its batches each epoch."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


LIST_HINT = r"\(A list is read as a list of batches: pass a tuple \(x, y\) for a data set"
YIELD_HINT = r"\(Every batch {} yields is one step, trained as it comes: make it yield the same"
STREAM_KINDS = {
    "list": (lambda b: b, LIST_HINT),
    "generator": (lambda b: (x for x in b), YIELD_HINT.format("the generator")),
    "data callable": (
        lambda b: lambda: iter(b),
        YIELD_HINT.format("the iterator your data callable <lambda> returns"),
    ),
    "iterator": (lambda b: iter(b), YIELD_HINT.format(r"the iterator \(list_iterator\)")),
    "loader": (lambda b: Loader(b), YIELD_HINT.format("the Loader")),
}


@pytest.mark.parametrize("kind", list(STREAM_KINDS))
@pytest.mark.parametrize("fault", ["shape", "structure"])
def test_a_bad_batch_gets_the_hint_of_its_kind_of_stream(batches, kind, fault):
    """A list may have been meant as a data set; a generator's batches are its own doing:
    the message ends with the hint that fits where the batch came from."""
    wrong = (
        {"x": np.zeros((4, 5), np.float32), "y": batches[0]["y"]}
        if fault == "shape"
        else {"x": batches[0]["x"]}
    )
    make, hint = STREAM_KINDS[kind]
    where = (
        r"batch 2, leaf \['x'\]: shape \(4, 5\)"
        if fault == "shape"
        else "batch 2 has another structure"
    )
    with pytest.raises(ValueError, match=where) as error:
        Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent).fit(
            make([*batches[:2], wrong]), epochs=1, steps_per_call=10, progress=False
        )
    assert re.search(hint, str(error.value)), str(error.value)
    assert ("list of batches" in str(error.value)) == (kind == "list")


def test_bad_streams_raise_before_training(batches):
    model = MLP(rngs=nnx.Rngs(0))
    before = state_arrays(model)
    trainer = Trainer(model, TX, xent)
    with pytest.raises(ValueError, match="empty"):
        trainer.fit([], epochs=1, progress=False)
    with pytest.raises(ValueError, match="empty"):
        trainer.fit(lambda: iter(()), epochs=1, progress=False)
    with pytest.raises(ValueError, match="callable"):
        trainer.fit(iter(batches), epochs=2, progress=False)
    with pytest.raises(ValueError, match="batch_size=3"):
        trainer.fit(batches, epochs=1, batch_size=3, progress=False)
    with pytest.raises(ValueError, match="only the final batch"):
        short = {k: v[:2] for k, v in batches[0].items()}
        trainer.fit([batches[0], short, batches[1]], epochs=1, progress=False)
    with pytest.raises(TypeError, match=r"\['y'\].*batch 1"):
        trainer.fit([batches[0], {"x": batches[0]["x"], "y": ["a"] * 4}], epochs=1, progress=False)
    _unchanged(model, before)
    assert trainer.step == 0 and trainer.epoch == 0


def test_is_stream_rule():
    from nnxscan.shell._engine.streaming import is_stream

    x = np.zeros((4, 2))
    assert not is_stream({"x": x}) and not is_stream((x, x)) and not is_stream(x)
    assert not is_stream(jax.numpy.zeros(3))
    assert is_stream([{"x": x}]) and is_stream(lambda: iter([])) and is_stream(iter([]))
    assert is_stream(FakeDataLoader([]))


def test_grain_source_end_to_end():
    """A grain pipeline feeds fit; the reference replays the same epochs' batches."""
    from nnxscan.adapters.data import from_grain

    d = make_data(n=48)
    records = [{"x": d["x"][i], "y": d["y"][i]} for i in range(48)]
    replayer = from_grain(records, batch_size=8, seed=3)
    replay = [b for _ in range(2) for b in replayer()]
    assert len(replay) == 12 and replay[0]["x"].shape == (8, 4)
    ref, ref_losses = reference(replay)
    model = MLP(rngs=nnx.Rngs(0))
    history = Trainer(model, TX, xent).fit(
        from_grain(records, batch_size=8, seed=3), epochs=2, steps_per_call=4, progress=False
    )
    np.testing.assert_allclose(history.losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(model, ref)


def test_a_streams_short_last_chunk_compiles_once(batches, compile_count):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    trainer.fit(batches, epochs=1, steps_per_call=4, progress=False)  # chunks 4, 4, 4, 3
    compiled = compile_count()
    trainer.fit(batches, epochs=2, steps_per_call=4, progress=False)
    assert compile_count() == compiled
