"""nnxscan.adapters.data: loader batches to numpy, and grain sources as per-epoch iterators.

Every expectation is written out by hand (arrays, id orders) or computed from the documented
rule with grain and numpy directly, never taken from the adapter's own output.
"""

from __future__ import annotations

import collections.abc
import sys
from typing import NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nnxscan.adapters.data import from_grain, to_numpy

# -- to_numpy: containers -----------------------------------------------------------------------


class Pair(NamedTuple):
    x: object
    label: object


class LazyBatch(collections.abc.Mapping):
    """A read-only Mapping that is not a dict, as HuggingFace's batches are."""

    def __init__(self, data: dict):
        self._data = data

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


class FakeTensor:
    """Behaves like a PyTorch CPU tensor: ``detach().cpu().numpy()``; records the calls."""

    def __init__(self, values, calls=None):
        self._values = np.array(values)
        self.calls = [] if calls is None else calls

    def detach(self):
        self.calls.append("detach")
        return FakeTensor(self._values, self.calls)

    def cpu(self):
        self.calls.append("cpu")
        return FakeTensor(self._values, self.calls)

    def numpy(self):
        self.calls.append("numpy")
        return self._values


class HasArray:
    def __array__(self, dtype=None, copy=None):
        return np.array([[1, 2, 3]], dtype=np.int16)


def assert_numpy_equal(got, want):
    assert type(got) is np.ndarray, type(got)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want)


def test_dict_of_numpy_and_jax_arrays():
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    out = to_numpy({"x": x, "y": jnp.array([0, 1, 2], dtype=jnp.int32)})
    assert type(out) is dict and list(out) == ["x", "y"]
    assert out["x"] is x  # numpy arrays pass through uncopied
    assert_numpy_equal(out["y"], np.array([0, 1, 2], dtype=np.int32))


def test_mapping_becomes_a_dict_with_the_same_keys():
    out = to_numpy(LazyBatch({"input_ids": [[5, 6], [7, 8]], "label": np.array([1, 0])}))
    assert type(out) is dict and list(out) == ["input_ids", "label"]
    assert_numpy_equal(out["input_ids"], np.array([[5, 6], [7, 8]]))
    assert_numpy_equal(out["label"], np.array([1, 0]))


def test_tuple_and_namedtuple_keep_their_type():
    out = to_numpy((np.ones((2, 1), np.float32), [True, False]))
    assert type(out) is tuple and len(out) == 2
    assert_numpy_equal(out[0], np.ones((2, 1), np.float32))
    assert_numpy_equal(out[1], np.array([True, False]))

    pair = to_numpy(Pair(x=jnp.zeros((2, 3)), label=FakeTensor([4, 5])))
    assert type(pair) is Pair
    assert_numpy_equal(pair.x, np.zeros((2, 3), np.float32))
    assert_numpy_equal(pair.label, np.array([4, 5]))


def test_list_of_arrays_stays_a_list_and_lists_of_numbers_become_arrays():
    out = to_numpy([np.array([1.0, 2.0]), {"ids": [1, 2, 3], "mask": [[True], [False]]}])
    assert type(out) is list and len(out) == 2
    assert_numpy_equal(out[0], np.array([1.0, 2.0]))
    assert_numpy_equal(out[1]["ids"], np.array([1, 2, 3], dtype=np.int64))
    assert_numpy_equal(out[1]["mask"], np.array([[True], [False]]))
    # numpy scalars inside a list count as numbers too.
    assert_numpy_equal(to_numpy([np.float32(0.5), np.float32(1.5)]), np.array([0.5, 1.5], "f4"))
    assert_numpy_equal(to_numpy([[1.0, 2.0], [3.0, 4.0]]), np.array([[1.0, 2.0], [3.0, 4.0]]))


def test_torch_like_tensor_is_detached_moved_to_cpu_and_converted():
    tensor = FakeTensor([[1.5, 2.5], [3.5, 4.5]])
    out = to_numpy({"x": tensor})
    assert_numpy_equal(out["x"], np.array([[1.5, 2.5], [3.5, 4.5]]))
    assert tensor.calls == ["detach", "cpu", "numpy"]


def test_objects_with_array_protocol_and_ml_dtypes_convert():
    assert_numpy_equal(to_numpy({"a": HasArray()})["a"], np.array([[1, 2, 3]], np.int16))
    out = to_numpy(jnp.array([1.0, 2.0], dtype=jnp.bfloat16))
    assert_numpy_equal(out, np.array([1.0, 2.0], dtype=ml_dtypes.bfloat16))


# -- to_numpy: bad leaves -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "path", "what"),
    [
        ({"x": np.ones(2), "label": "cat"}, "leaf ['label']", "str"),
        ({"x": np.ones(2), "label": None}, "leaf ['label']", "None"),
        ({"label": b"raw"}, "leaf ['label']", "bytes"),
        ({"label": object()}, "leaf ['label']", "builtins.object"),
        ({"label": np.array(["a", "b"])}, "leaf ['label']", "<U1"),
        ({"label": np.array([1, "b"], dtype=object)}, "leaf ['label']", "object"),
        ({"text": ["a b", "c"]}, "leaf ['text'][0]", "str"),
        ({"a": ({"b": None},)}, "leaf ['a'][0]['b']", "None"),
        (Pair(x=np.ones(2), label="dog"), "leaf .label", "str"),
        ("just text", "batch 37", "str"),
    ],
)
def test_non_numeric_leaves_raise_type_error_naming_path_type_and_batch(batch, path, what):
    with pytest.raises(TypeError) as info:
        to_numpy(batch, index=37)
    message = str(info.value)
    assert path in message and what in message and "batch 37" in message, message
    assert "encode" in message  # says what to do instead


def test_error_without_index_names_no_batch_number():
    with pytest.raises(TypeError, match=r"leaf \['label'\] of the batch is None") as info:
        to_numpy({"label": None})
    assert "batch 0" not in str(info.value)


@pytest.mark.parametrize(
    "leaf",
    [3, 2.5, True, np.float32(1.0), np.array(4), jnp.array(1.0), FakeTensor(7)],
    ids=["int", "float", "bool", "np-scalar", "np-0d", "jax-0d", "tensor-0d"],
)
def test_zero_d_leaves_raise_value_error(leaf):
    with pytest.raises(ValueError, match=r"leaf \['n'\] of batch 3 is a 0-d .*leading batch axis"):
        to_numpy({"x": np.ones(2), "n": leaf}, index=3)


def test_ragged_nested_list_raises_value_error():
    with pytest.raises(ValueError, match=r"leaf \['ids'\] of batch 5 is a ragged"):
        to_numpy({"ids": [[1, 2], [3]]}, index=5)


# -- from_grain -----------------------------------------------------------------------------------

N = 50


class Records:
    """A random-access source: record i is {"x": [i, 2i, 3i] (float32), "id": i}."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": np.array([i, 2 * i, 3 * i], dtype=np.float32), "id": i}


@pytest.fixture
def grain():
    return pytest.importorskip("grain")


def epoch_ids(epoch_iter) -> list[np.ndarray]:
    """Each batch's ids, after checking the batch's structure, dtypes and x against its ids."""
    out = []
    for batch in epoch_iter:
        assert type(batch) is dict and sorted(batch) == ["id", "x"]
        assert type(batch["x"]) is np.ndarray and batch["x"].dtype == np.float32
        assert type(batch["id"]) is np.ndarray and batch["id"].dtype == np.int64
        want_x = batch["id"][:, None].astype(np.float32) * np.array([1, 2, 3], np.float32)
        np.testing.assert_array_equal(batch["x"], want_x)
        out.append(batch["id"])
    return out


@pytest.mark.usefixtures("grain")
def test_drop_remainder_yields_full_batches_each_example_once():
    epochs = from_grain(Records(), batch_size=8, seed=1)
    ids = epoch_ids(epochs())
    assert [len(b) for b in ids] == [8] * 6  # 50 // 8 batches; 2 examples dropped
    flat = np.concatenate(ids)
    assert len(set(flat.tolist())) == 48 and set(flat.tolist()) <= set(range(N))

    ids = epoch_ids(from_grain(Records(), batch_size=10, seed=1)())
    assert [len(b) for b in ids] == [10] * 5
    assert sorted(np.concatenate(ids).tolist()) == list(range(N))


@pytest.mark.usefixtures("grain")
def test_keep_remainder_adds_a_final_short_batch():
    epochs = from_grain(Records(), batch_size=8, drop_remainder=False)
    ids = epoch_ids(epochs())
    assert [len(b) for b in ids] == [8] * 6 + [2]
    assert sorted(np.concatenate(ids).tolist()) == list(range(N))


@pytest.mark.usefixtures("grain")
def test_every_epoch_reshuffles_and_the_seed_replays_the_orders():
    first, second = (
        from_grain(Records(), batch_size=10, seed=3),
        from_grain(Records(), batch_size=10, seed=3),
    )
    a0, a1 = np.concatenate(epoch_ids(first())), np.concatenate(epoch_ids(first()))
    b0, b1 = np.concatenate(epoch_ids(second())), np.concatenate(epoch_ids(second()))
    assert first.epoch == 2
    assert sorted(a0.tolist()) == sorted(a1.tolist()) == list(range(N))
    assert a0.tolist() != a1.tolist()  # a new order each epoch
    assert a0.tolist() != list(range(N))
    np.testing.assert_array_equal(a0, b0)  # same seed, same orders
    np.testing.assert_array_equal(a1, b1)
    other = np.concatenate(epoch_ids(from_grain(Records(), batch_size=10, seed=4)()))
    assert other.tolist() != a0.tolist()


def test_epoch_order_follows_the_documented_seed_rule(grain):
    # Docstring: epoch e shuffles with seed SeedSequence((seed, e)).generate_state(1)[0].
    def reference_order(seed: int, epoch: int) -> list[int]:
        epoch_seed = int(np.random.SeedSequence((seed, epoch)).generate_state(1)[0])
        return list(grain.MapDataset.range(N).shuffle(seed=epoch_seed))

    epochs = from_grain(Records(), batch_size=10, seed=7)
    for e in range(2):
        assert np.concatenate(epoch_ids(epochs())).tolist() == reference_order(7, e)
    resumed = from_grain(Records(), batch_size=10, seed=7)
    resumed.epoch = 5  # resuming a run replays its epoch 5
    assert np.concatenate(epoch_ids(resumed())).tolist() == reference_order(7, 5)


def test_shuffle_false_keeps_source_order_and_accepts_map_datasets(grain):
    want = np.arange(48).reshape(6, 8)
    for source in (Records(), [Records()[i] for i in range(N)], grain.MapDataset.source(Records())):
        epochs = from_grain(source, batch_size=8, shuffle=False)
        for _ in range(2):
            np.testing.assert_array_equal(np.stack(epoch_ids(epochs())), want)


def test_grain_data_loader_is_re_iterated_per_epoch(grain):
    loader = grain.DataLoader(
        data_source=Records(),
        sampler=grain.samplers.IndexSampler(N, shuffle=False, num_epochs=1, seed=0),
        operations=[grain.transforms.Batch(batch_size=10, drop_remainder=True)],
        worker_count=0,
    )
    epochs = from_grain(loader)
    want = np.arange(N).reshape(5, 10)
    for _ in range(2):
        np.testing.assert_array_equal(np.stack(epoch_ids(epochs())), want)
    with pytest.raises(ValueError, match="no other arguments"):
        from_grain(loader, batch_size=10)


def test_endless_data_loader_is_rejected(grain):
    loader = grain.DataLoader(
        data_source=Records(),
        sampler=grain.samplers.IndexSampler(N, shuffle=False, num_epochs=None, seed=0),
        operations=[grain.transforms.Batch(batch_size=10)],
    )
    with pytest.raises(ValueError, match="num_epochs=1"):
        from_grain(loader)


def test_bad_records_raise_type_error_naming_leaf_and_batch(grain):
    records = [{"x": np.ones(2, np.float32), "name": f"r{i}"} for i in range(6)]
    with pytest.raises(TypeError, match=r"leaf \['name'\] of batch 0 has dtype <U2"):
        next(from_grain(records, batch_size=2, shuffle=False)())


@pytest.mark.usefixtures("grain")
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 8, "worker_count": 2}, ValueError, "worker_count=0"),
        ({}, ValueError, "batch_size is required"),
        ({"batch_size": 0}, ValueError, "batch_size must be at least 1"),
        ({"batch_size": 8, "seed": -1}, ValueError, "seed must be at least 0"),
        ({"batch_size": 64}, ValueError, "50 records, fewer than batch_size=64"),
    ],
)
def test_bad_arguments_are_rejected_before_iterating(kwargs, error, match):
    with pytest.raises(error, match=match):
        from_grain(Records(), **kwargs)


def test_unsupported_sources_are_rejected(grain):
    with pytest.raises(TypeError, match="MapDataset it came from"):
        from_grain(grain.MapDataset.source(Records()).to_iter_dataset(), batch_size=8)
    with pytest.raises(TypeError, match="function returning a fresh one"):
        from_grain((r for r in [Records()[0]]), batch_size=8)


def test_missing_grain_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "grain", None)  # makes `import grain` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'nnxscan\[grain\]'"):
        from_grain(Records(), batch_size=8)
