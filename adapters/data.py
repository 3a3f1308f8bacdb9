"""Edge to data loaders: turn their batches into numpy pytrees, and grain sources into epochs.

A loader hands out batches in its own types: PyTorch tensors, HuggingFace ``Mapping``
batches, lists of Python numbers, jax arrays. The scanned training step wants one pytree of
numeric numpy arrays per batch, each with a leading batch axis, so that consecutive batches
can be stacked along a new steps axis. ``to_numpy`` does that conversion and rejects, with
the leaf path and the batch index, anything that could not be stacked (strings, ``None``,
0-d scalars).

``from_grain`` wraps a grain source in the per-epoch form ``Trainer.fit`` accepts: a
zero-argument callable that returns a fresh iterator over one epoch of numpy batches.
grain is an optional extra (``pip install 'nnxscan[grain]'``), imported only there.
"""

from __future__ import annotations

import collections.abc
import numbers
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from nnxscan.adapters._extras import require_extra
from nnxscan.pure.checks import check_count

__all__ = ["GrainEpochs", "from_grain", "to_numpy"]

_KeyPath = tuple[Any, ...]

_WHAT_TO_DO = (
    "Batches must hold numeric or bool arrays with a leading batch axis: encode text and "
    "categories as numbers in the loader (a tokenizer, a label-to-id map), or drop the field "
    "before training."
)


def _where(path: _KeyPath, index: int | None) -> str:
    batch = "the batch" if index is None else f"batch {index}"
    return f"leaf {jax.tree_util.keystr(path)} of {batch}" if path else batch


def _is_number(x: Any) -> bool:
    # bool is a numbers.Number already; numpy scalars (np.float32(1.0)) count as numbers
    # because HuggingFace and hand-written loaders hand them out inside lists.
    return isinstance(x, numbers.Number | np.generic) and not isinstance(x, str | bytes)


def _is_list_of_numbers(x: Any) -> bool:
    # Only lists qualify, so a tuple of numbers stays a tuple container (whose leaves are then
    # rejected as 0-d): a tuple is how loaders return (x, y) pairs, never a column.
    if not isinstance(x, list) or not x:
        return False
    return all(_is_list_of_numbers(v) if isinstance(v, list) else _is_number(v) for v in x)


def _is_torch_like(x: Any) -> bool:
    # Duck typing keeps torch an undeclared, unimported dependency.
    return all(callable(getattr(x, name, None)) for name in ("detach", "cpu", "numpy"))


def _is_numeric(dtype: np.dtype) -> bool:
    # jax's issubdtype knows ml_dtypes (bfloat16, float8, int4), whose numpy kind is "V".
    return jax.dtypes.issubdtype(dtype, np.number) or jax.dtypes.issubdtype(dtype, np.bool_)


def _checked_array(array: np.ndarray, leaf: Any, path: _KeyPath, index: int | None) -> np.ndarray:
    if not _is_numeric(array.dtype):
        raise TypeError(
            f"to_numpy: {_where(path, index)} has dtype {array.dtype} (from a "
            f"{type(leaf).__name__}), not a numeric or bool one. {_WHAT_TO_DO}"
        )
    if array.ndim == 0:
        raise ValueError(
            f"to_numpy: {_where(path, index)} is a 0-d {array.dtype} scalar, but every batch "
            f"leaf needs a leading batch axis to be stacked. Give it one per example (shape "
            f"(batch_size,)), or move a per-batch constant out of the batch."
        )
    return array


def _leaf_to_numpy(leaf: Any, path: _KeyPath, index: int | None) -> np.ndarray:
    if isinstance(leaf, np.ndarray):
        return _checked_array(leaf, leaf, path, index)
    if _is_number(leaf):
        return _checked_array(np.asarray(leaf), leaf, path, index)
    if leaf is None:
        raise TypeError(f"to_numpy: {_where(path, index)} is None. {_WHAT_TO_DO}")
    if isinstance(leaf, str | bytes):
        raise TypeError(
            f"to_numpy: {_where(path, index)} is a {type(leaf).__name__} ({leaf!r:.40}). "
            f"{_WHAT_TO_DO}"
        )
    if isinstance(leaf, jax.Array):
        return _checked_array(np.asarray(leaf), leaf, path, index)
    if _is_torch_like(leaf):
        # detach: drop autograd history; cpu: a CUDA tensor has no numpy view.
        return _checked_array(leaf.detach().cpu().numpy(), leaf, path, index)
    if hasattr(leaf, "__array__"):
        return _checked_array(np.asarray(leaf), leaf, path, index)
    raise TypeError(
        f"to_numpy: {_where(path, index)} is a {type(leaf).__module__}.{type(leaf).__qualname__}"
        f", which is neither a container (dict, Mapping, tuple, NamedTuple, list) nor an array. "
        f"{_WHAT_TO_DO}"
    )


def _to_numpy(x: Any, path: _KeyPath, index: int | None) -> Any:
    if isinstance(x, collections.abc.Mapping):
        return {k: _to_numpy(v, (*path, jax.tree_util.DictKey(k)), index) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # NamedTuple
        return type(x)(
            *(
                _to_numpy(v, (*path, jax.tree_util.GetAttrKey(name)), index)
                for name, v in zip(x._fields, x, strict=True)
            )
        )
    if isinstance(x, tuple):
        return type(x)(
            _to_numpy(v, (*path, jax.tree_util.SequenceKey(i)), index) for i, v in enumerate(x)
        )
    if _is_list_of_numbers(x):
        try:
            return _checked_array(np.asarray(x), x, path, index)
        except ValueError as err:
            if "inhomogeneous" not in str(err):
                raise
            raise ValueError(
                f"to_numpy: {_where(path, index)} is a ragged nested list of numbers; pad its "
                f"rows to one length in the loader."
            ) from err
    if isinstance(x, list):
        return [_to_numpy(v, (*path, jax.tree_util.SequenceKey(i)), index) for i, v in enumerate(x)]
    return _leaf_to_numpy(x, path, index)


def to_numpy(batch: Any, *, index: int | None = None) -> Any:
    """Converts one loader batch into a pytree of numpy arrays with a leading batch axis.

    Containers keep their structure: a ``dict`` or any ``Mapping`` (HuggingFace batches)
    becomes a ``dict`` with the same keys, a tuple or NamedTuple stays its type, a list stays
    a list, except a list (or nested lists) of Python or numpy numbers, which becomes one
    array. Leaves become numpy arrays: numpy arrays as they are, jax arrays and anything with
    ``__array__`` through ``np.asarray``, PyTorch tensors (recognised by their ``detach``,
    ``cpu`` and ``numpy`` methods; torch is never imported) through
    ``x.detach().cpu().numpy()``.

    Args:
      batch: one batch as a loader returns it.
      index: the batch's position in the epoch, quoted in error messages.

    Returns:
      The same structure with numeric or bool numpy arrays as leaves.

    Raises:
      TypeError: a leaf is a string, bytes, ``None``, another object, or an array of
        non-numeric dtype (strings, objects); the message names the leaf path and the batch.
      ValueError: a leaf is 0-d (a bare number), so it has no batch axis to stack along; or a
        nested list of numbers is ragged.

    Example:
      >>> batch = to_numpy({"x": [[1.0, 2.0], [3.0, 4.0]], "y": torch.tensor([0, 1])})
      >>> batch["x"].shape, batch["y"]
      ((2, 2), array([0, 1]))
    """
    return _to_numpy(batch, (), index)


def _numpy_batches(batches: Iterator[Any]) -> Iterator[Any]:
    for i, batch in enumerate(batches):
        yield to_numpy(batch, index=i)


class GrainEpochs:
    """One grain pipeline as epochs: each call returns a fresh iterator over one epoch.

    Built by ``from_grain``; pass it to ``Trainer.fit`` as the data.

    Attributes:
      epoch: the epoch the next call produces. A call counts as an epoch as soon as it
        returns its iterator, read to the end or not. Set it to resume a run's order.
    """

    def __init__(self, make_epoch: Callable[[int], Iterable[Any]]) -> None:
        self._make_epoch = make_epoch
        self.epoch = 0

    def __call__(self) -> Iterator[Any]:
        # Start the pipeline now rather than on the first next(), so a broken source
        # fails where the epoch is requested.
        batches = iter(self._make_epoch(self.epoch))
        self.epoch += 1
        return _numpy_batches(batches)

    def __repr__(self) -> str:
        return f"GrainEpochs(epoch={self.epoch})"


def _epoch_seed(seed: int, epoch: int) -> int:
    # SeedSequence mixes (seed, epoch) into a well-spread 32-bit seed, the range grain's
    # shuffle takes; seed + epoch would make run (seed=1, epoch 0) replay (seed=0, epoch 1).
    return int(np.random.SeedSequence((seed, epoch)).generate_state(1)[0])


def _from_data_loader(
    loader: Any,
    batch_size: int | None,
    shuffle: bool,
    seed: int,
    drop_remainder: bool,
    worker_count: int,
) -> GrainEpochs:
    if (batch_size, shuffle, seed, drop_remainder, worker_count) != (None, True, 0, True, 0):
        raise ValueError(
            "from_grain: a grain.DataLoader samples and batches by itself; set shuffle and "
            "seed on its IndexSampler, the batch size on its operations "
            "(grain.transforms.Batch) and worker_count on the loader, and call "
            "from_grain(loader) with no other arguments."
        )
    # grain has no public accessor for the sampler; an IndexSampler built with
    # num_epochs=None reports sys.maxsize records, and one "epoch" of it would never end.
    sampler = getattr(loader, "_sampler", None)
    if isinstance(sampler, collections.abc.Sized) and len(sampler) >= sys.maxsize:
        raise ValueError(
            f"from_grain: the DataLoader's sampler {sampler!r} never ends, so one epoch would "
            f"never end: build it with grain.samplers.IndexSampler(..., num_epochs=1)."
        )
    return GrainEpochs(lambda epoch: loader)


def from_grain(
    source: Any,
    *,
    batch_size: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    drop_remainder: bool = True,
    worker_count: int = 0,
) -> GrainEpochs:
    """Wraps a grain source as a zero-argument callable returning one epoch of numpy batches.

    The pipeline per epoch ``e`` is ``grain.MapDataset.source(source)``, then
    ``.shuffle(seed=s_e)`` when ``shuffle``, then ``.batch(batch_size, drop_remainder=...)``,
    read in order by ``.to_iter_dataset`` with each batch converted by ``to_numpy``. The
    epoch seed is ``s_e = np.random.SeedSequence((seed, e)).generate_state(1)[0]``: every
    epoch is reshuffled, and the same ``seed`` replays the same orders. The returned
    ``GrainEpochs`` counts the epochs it has handed out (its ``epoch`` attribute).

    Records are read in the thread that pulls batches (grain's ``ReadOptions(num_threads=0,
    prefetch_buffer_size=0)``), with no read-ahead of grain's own: the trainer's prefetch
    thread overlaps reading with training, and its bound on host memory then holds. grain's
    default would read up to 500 batches ahead.

    ``worker_count`` must be 0. grain's worker processes fail unless the host program has
    parsed absl flags, take seconds to start, and interleave the workers' records, so this
    adapter does not start them. To use them, build a ``grain.DataLoader(worker_count=N)``
    in a program that parses absl flags (``absl.app.run``) and pass the loader itself.

    A ``grain.DataLoader`` is accepted as ``source``, with no other argument: its sampler and
    operations decide the order and the batches, and every call iterates it once more. Its
    ``IndexSampler`` needs ``num_epochs=1``; it replays the same order each epoch.

    Args:
      source: a random-access source (``__len__``, and ``__getitem__`` returning one record,
        e.g. a dict of numpy scalars and arrays), a ``grain.MapDataset`` of records, or a
        ``grain.DataLoader``.
      batch_size: examples per batch; required unless ``source`` is a DataLoader.
      shuffle: reshuffle the records every epoch; ``False`` keeps the source's order.
      seed: a non-negative integer; the epoch orders derive from it.
      drop_remainder: drop a final batch shorter than ``batch_size``.
      worker_count: must be 0 (see above).

    Returns:
      A ``GrainEpochs``: call it once per epoch for a fresh iterator over numpy batches.

    Raises:
      ImportError: grain is not installed.
      ValueError: bad ``batch_size``, ``seed`` or ``worker_count``; a source too small for
        one batch; an endless source.
      TypeError: ``source`` is neither random-access nor a grain MapDataset or DataLoader.

    Example:
      >>> records = [{"x": np.ones(4, np.float32), "y": i % 3} for i in range(50)]
      >>> epochs = from_grain(records, batch_size=16)
      >>> [b["x"].shape for b in epochs()]
      [(16, 4), (16, 4), (16, 4)]
    """
    grain = require_extra("grain", "grain", needed_by="from_grain")

    if isinstance(source, grain.DataLoader):
        return _from_data_loader(source, batch_size, shuffle, seed, drop_remainder, worker_count)
    if worker_count != 0:
        raise ValueError(
            f"from_grain: worker_count={worker_count} is not supported; use worker_count=0, "
            f"or pass a grain.DataLoader(worker_count=N) built in a program that parses absl "
            f"flags (grain's worker processes need them)."
        )
    if batch_size is None:
        raise ValueError(
            "from_grain: batch_size is required for a record source or a MapDataset (only a "
            "grain.DataLoader brings its own batching)."
        )
    batch_size = check_count(batch_size, "from_grain: batch_size", 1)
    seed = check_count(seed, "from_grain: seed", 0)
    if isinstance(source, grain.IterDataset):
        raise TypeError(
            "from_grain: a grain.IterDataset can be neither shuffled globally nor restarted per "
            "epoch; pass the grain.MapDataset it came from, or its source."
        )
    if isinstance(source, grain.MapDataset):
        dataset = source
    elif hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        dataset = grain.MapDataset.source(source)
    else:
        raise TypeError(
            f"from_grain: the source is a {type(source).__qualname__}, with no __len__ and "
            f"__getitem__. Pass a random-access source, a grain.MapDataset or a "
            f"grain.DataLoader; for a generator, pass a function returning a fresh one to "
            f"Trainer.fit instead."
        )

    num_records = len(dataset)
    if num_records >= sys.maxsize:
        raise ValueError(
            "from_grain: the source is endless (a .repeat() without count?); pass one epoch."
        )
    num_batches = -(-num_records // batch_size) if not drop_remainder else num_records // batch_size
    if num_batches == 0:
        raise ValueError(
            f"from_grain: the source has {num_records} records, fewer than batch_size="
            f"{batch_size}, and drop_remainder=True drops them all: no batches. Lower "
            f"batch_size or pass drop_remainder=False."
        )
    read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)

    def make_epoch(epoch: int) -> Iterable[Any]:
        ordered = dataset.shuffle(seed=_epoch_seed(seed, epoch)) if shuffle else dataset
        batched = ordered.batch(batch_size, drop_remainder=drop_remainder)
        return batched.to_iter_dataset(read_options)

    return GrainEpochs(make_epoch)
