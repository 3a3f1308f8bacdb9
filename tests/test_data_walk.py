"""The walk of ``data`` through ``fit``: how often it goes back to a file it had left.

Issue 59 asks that following ``data`` from ``fit`` through the engine return to a file it
left at most 5 times (it counted 21 in 0.3.0.dev0). This is the walk, measured while a fit
runs (``sys.setprofile``), so that what it counts is what runs, not what a reader guesses:

- on the walk: every call of a function of the package (pure/, shell/, adapters/) that
  gets, as an argument, the user's ``data``, an array (or a pytree of arrays) that a
  function on the walk returned when given it directly (the placed data set), or an
  object holding either as an attribute (the epochs that hand out its calls); a
  generator's resumption is a call;
- write down each such call's file, in order, merging repeats: a stay;
- a file written down again is a return to a file the walk left.

A function's return to its caller is not a step of the walk: the reader goes back up the
page they came from, the walk does not move on (counting those too, every call into another
file would add one at its end).
"""

from __future__ import annotations

import os
import sys
import types

import jax
import numpy as np
import optax
from flax import nnx

from nnxscan.shell import Trainer

from conftest import MLP, make_data, xent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = tuple(os.path.join(ROOT, p) + os.sep for p in ("pure", "shell", "adapters"))

#: The issue's bound.
MOST_RETURNS = 5


def _is_ours(code: types.CodeType) -> bool:
    return code.co_filename.startswith(PACKAGES)


def _array_tree(value) -> bool:
    try:
        leaves = jax.tree.leaves(value)
    except Exception:  # an object the tree utilities refuse: not data
        return False
    return bool(leaves) and all(
        isinstance(x, np.ndarray | jax.Array) and np.ndim(x) >= 1 for x in leaves
    )


def walk(run, data) -> list[tuple[str, str]]:
    """``(file, function)`` of every call on ``data``'s walk while ``run()`` runs (on this
    thread: a stream's prefetch thread only reads batches)."""
    followed = {id(data): data}  # by identity; the objects are kept alive here
    calls: list[tuple[str, str]] = []
    on_walk: dict[int, bool] = {}  # frame id -> got a followed object directly

    def holds(value) -> bool:
        if id(value) in followed:
            return True
        return isinstance(value, tuple | list) and any(id(x) in followed for x in value)

    def profile(frame, event, arg):
        if event not in ("call", "return") or not _is_ours(frame.f_code):
            return
        if event == "call":
            args = list(frame.f_locals.values())
            direct = any(holds(v) for v in args)
            held = direct or any(
                not isinstance(v, type | types.ModuleType | types.FunctionType)
                and any(holds(a) for a in getattr(v, "__dict__", {}).values())
                for v in args
            )
            if held:
                on_walk[id(frame)] = direct
                name = os.path.relpath(frame.f_code.co_filename, ROOT)
                calls.append((name, frame.f_code.co_name))
        # Returning: what a call given data directly returns is data too, if it is arrays.
        elif id(frame) in on_walk and on_walk.pop(id(frame)) and _array_tree(arg):
            followed[id(arg)] = arg

    previous = sys.getprofile()  # a profiler of the user's, put back after
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
    return calls


def returns(calls: list[tuple[str, str]]) -> tuple[int, list[str]]:
    """How many stays go back to a file already left, and the stays."""
    stays: list[str] = []
    for name, _ in calls:
        if not stays or stays[-1] != name:
            stays.append(name)
    return sum(name in stays[:i] for i, name in enumerate(stays)), stays


def test_returns_counts_a_file_written_down_again():
    calls = [("a.py", "f"), ("b.py", "g"), ("b.py", "h"), ("a.py", "i"), ("c.py", "j")]
    assert returns(calls) == (1, ["a.py", "b.py", "a.py", "c.py"])
    assert returns([("a.py", "f"), ("a.py", "g")]) == (0, ["a.py"])


def _trainer() -> Trainer:
    return Trainer(MLP(rngs=nnx.Rngs(0)), optax.adam(1e-2), xent)


def test_the_walk_of_a_data_set_through_fit():
    data = make_data(64)
    trainer = _trainer()
    calls = walk(lambda: trainer.fit(data, epochs=2, batch_size=16, progress=False), data)
    count, stays = returns(calls)
    # The walk saw data go where it goes (else the count would prove nothing): checked,
    # placed, cut into epochs' calls, trained.
    files = set(stays)
    for name in ("engine.py", "placement.py", "epochs.py", "fit.py", "checks.py"):
        assert any(f.endswith(name) for f in files), (name, stays)
    assert count <= MOST_RETURNS, stays


def test_the_walk_of_a_stream_through_fit():
    data = make_data(64)
    batches = [{k: v[i : i + 16] for k, v in data.items()} for i in range(0, 64, 16)]
    trainer = _trainer()
    calls = walk(lambda: trainer.fit(batches, epochs=2, progress=False), batches)
    count, stays = returns(calls)
    assert any(f.endswith("streaming.py") for f in stays), stays
    assert count <= MOST_RETURNS, stays
