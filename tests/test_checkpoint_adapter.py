"""nnxscan.adapters.checkpoint: orbax checkpoints of plain pytrees.

Every round trip is checked against host copies of the saved arrays taken before the save
(raw key bits for PRNG keys), compared bitwise with their dtypes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.adapters.checkpoint import (
    all_steps,
    latest_step,
    restore_checkpoint,
    save_checkpoint,
)

from conftest import MLP, BNDropout


def snapshot(tree) -> dict:
    """Host copies of every leaf by path: arrays copied, PRNG keys as raw bits, scalars as is."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = ("key", str(leaf.dtype), np.array(jax.random.key_data(leaf)))
        elif isinstance(leaf, jax.Array | np.ndarray):
            leaf = np.array(leaf)
        out[jax.tree_util.keystr(path)] = leaf
    return out


def assert_bitwise_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for path, expected in want.items():
        actual = got[path]
        if isinstance(expected, tuple):  # a PRNG key: kind, dtype, raw bits
            assert actual[:2] == expected[:2], path
            actual, expected = actual[2], expected[2]
        if isinstance(expected, np.ndarray):
            assert actual.dtype == expected.dtype, path
            np.testing.assert_array_equal(actual, expected, err_msg=path, strict=True)
        else:
            assert type(actual) is type(expected) and actual == expected, path


def trained_bn_dropout(seed: int):
    """A BatchNorm+Dropout model after one train-mode step: moved batch stats, advanced RNG
    counts, and an adam state with non-zero moments and count 1."""
    model = BNDropout(rngs=nnx.Rngs(seed, dropout=seed + 1))
    tx = optax.adam(1e-2)
    x = np.random.default_rng(seed).normal(size=(16, 4)).astype(np.float32)

    @nnx.jit  # one compile instead of dozens of eager ones
    def step(model, opt_state):
        params = nnx.state(model, nnx.Param)
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=nnx.DiffState(0, nnx.Param))(model)
        return tx.update(grads, opt_state, params)[1]

    opt_state = step(model, tx.init(nnx.state(model, nnx.Param)))
    return model, tx, opt_state, x


def mlp_tree(din: int = 4, hidden: int = 8, *, abstract: bool = False) -> dict:
    # Abstract templates (shapes only) skip the eager initialization a new shape compiles.
    make = lambda: MLP(din, hidden, rngs=nnx.Rngs(0))  # noqa: E731
    model = nnx.eval_shape(make) if abstract else make()
    return {"state": nnx.state(model), "meta": {"epoch": 0, "step": 0, "seed": 0}}


def test_round_trip_of_nnx_state_optax_state_and_meta_is_bitwise(tmp_path):
    model, tx, opt_state, x = trained_bn_dropout(seed=0)
    saved = {
        "state": nnx.state(model),
        "opt_state": opt_state,
        "meta": {"epoch": 3, "step": 120, "seed": 42},
    }
    want = snapshot(saved)
    dtypes = {v[1] if isinstance(v, tuple) else getattr(v, "dtype", None) for v in want.values()}
    assert {"key<fry>", np.dtype("uint32"), np.dtype("int32"), np.dtype("float32")} <= dtypes

    where = save_checkpoint(tmp_path / "ckpt", 120, saved)
    assert where == (tmp_path / "ckpt" / "120").resolve() and where.is_dir()

    fresh = BNDropout(rngs=nnx.Rngs(7, dropout=8))
    like = {
        "state": nnx.state(fresh),
        "opt_state": tx.init(nnx.state(fresh, nnx.Param)),
        "meta": {"epoch": 0, "step": 0, "seed": 0},
    }
    like_before = snapshot(like)
    tree, step = restore_checkpoint(tmp_path / "ckpt", like)

    assert step == 120
    assert_bitwise_equal(snapshot(tree), want)
    assert_bitwise_equal(snapshot(like), like_before)  # the template is only read
    # The template's containers come back: State with typed Variables, adam's NamedTuple.
    assert isinstance(tree["state"], nnx.State)
    assert type(tree["state"]["drop"]["rngs"]["key"]) is type(model.drop.rngs.key)
    assert type(tree["state"]["bn"]["mean"]) is nnx.BatchStat
    assert type(tree["opt_state"][0]) is type(opt_state[0])
    # The restored model draws the same dropout mask and normalizes with the same statistics.
    nnx.update(fresh, tree["state"])
    forward = nnx.jit(lambda m: m(x))
    np.testing.assert_array_equal(np.asarray(forward(fresh)), np.asarray(forward(model)))


def test_restores_into_abstract_and_pure_dict_templates(tmp_path):
    model, _, _, _ = trained_bn_dropout(seed=1)
    want = snapshot(nnx.to_pure_dict(nnx.state(model)))
    save_checkpoint(tmp_path, 0, {"state": nnx.state(model)})

    abstract = nnx.state(nnx.eval_shape(lambda: BNDropout(rngs=nnx.Rngs(0, dropout=1))))
    tree, _ = restore_checkpoint(tmp_path, {"state": abstract})
    assert_bitwise_equal(snapshot(nnx.to_pure_dict(tree["state"])), want)

    # An nnx.State and its pure dict share one on-disk format.
    pure_like = {"state": nnx.to_pure_dict(nnx.state(BNDropout(rngs=nnx.Rngs(3, dropout=4))))}
    tree, _ = restore_checkpoint(tmp_path, pure_like)
    assert isinstance(tree["state"], dict)
    assert_bitwise_equal(snapshot(tree["state"]), want)


def test_latest_or_explicit_step_and_leaf_types(tmp_path):
    def tree_at(step: int) -> dict:
        return {
            "w": jnp.full((2, 3), step, jnp.float32),
            "host": np.arange(4, dtype=np.int64) * step,
            "meta": {"step": step, "lr": 0.5 * step, "done": step == 3, "tag": f"s{step}"},
        }

    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, tree_at(step))
    like = tree_at(0)

    assert all_steps(tmp_path) == [1, 2, 3] and latest_step(tmp_path) == 3
    tree, step = restore_checkpoint(tmp_path, like)
    assert step == 3
    assert_bitwise_equal(snapshot(tree), snapshot(tree_at(3)))
    tree, step = restore_checkpoint(tmp_path, like, step=2)
    assert step == 2
    assert_bitwise_equal(snapshot(tree), snapshot(tree_at(2)))
    assert isinstance(tree["w"], jax.Array) and isinstance(tree["host"], np.ndarray)


def test_max_to_keep_keeps_the_newest_checkpoints(tmp_path):
    tree = {"w": np.zeros(3, np.float32)}
    for step in range(5):
        save_checkpoint(tmp_path, step * 10, tree, max_to_keep=2)
    assert all_steps(tmp_path) == [30, 40]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["30", "40"]


def test_steps_must_increase(tmp_path):
    tree = {"w": np.zeros(3, np.float32)}
    save_checkpoint(tmp_path, 5, tree)
    with pytest.raises(FileExistsError, match="already exists"):
        save_checkpoint(tmp_path, 5, tree)
    with pytest.raises(ValueError, match="older than the latest checkpoint 5"):
        save_checkpoint(tmp_path, 4, tree)
    assert all_steps(tmp_path) == [5]


def test_unsupported_leaf_is_rejected_before_touching_the_disk(tmp_path):
    with pytest.raises(TypeError, match=r"\['meta'\]\['fn'\]"):
        save_checkpoint(tmp_path / "ckpt", 0, {"meta": {"fn": print}})
    assert not (tmp_path / "ckpt").exists()


def test_missing_directory_empty_directory_or_step_raise_file_not_found(tmp_path):
    like = mlp_tree()
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        restore_checkpoint(missing, like)
    assert not missing.exists()  # reading creates nothing
    assert all_steps(missing) == [] and latest_step(missing) is None

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"no checkpoint in {empty}"):
        restore_checkpoint(empty, like)

    save_checkpoint(tmp_path / "ckpt", 7, like)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint 8 .*available steps: \[7\]") as e:
        restore_checkpoint(tmp_path / "ckpt", like, step=8)
    assert str(tmp_path / "ckpt") in str(e.value)


def test_another_layer_size_raises_naming_the_path_and_both_shapes(tmp_path):
    save_checkpoint(tmp_path, 1, mlp_tree(din=4))
    with pytest.raises(ValueError) as e:
        restore_checkpoint(tmp_path, mlp_tree(din=5, abstract=True))
    message = str(e.value)
    assert "['state']['l1']['kernel']" in message
    assert "(4, 8)" in message and "(5, 8)" in message

    with pytest.raises(ValueError, match=r"\['state'\]\['l1'\]\['bias'\].*\(8,\).*\(16,\)"):
        restore_checkpoint(tmp_path, mlp_tree(hidden=16, abstract=True))

    # A failed restore leaves a concrete template as it was.
    like = mlp_tree(din=4)
    like["state"]["l2"]["kernel"] = nnx.Param(jnp.zeros((8, 5)))
    before = snapshot(like)
    with pytest.raises(ValueError, match=r"\['state'\]\['l2'\]\['kernel'\].*\(8, 3\).*\(8, 5\)"):
        restore_checkpoint(tmp_path, like)
    assert_bitwise_equal(snapshot(like), before)


def test_missing_or_extra_variable_raises(tmp_path):
    def linear_tree(use_bias: bool, abstract: bool = True) -> dict:
        make = lambda: nnx.Linear(4, 8, use_bias=use_bias, rngs=nnx.Rngs(0))  # noqa: E731
        return {"state": nnx.state(nnx.eval_shape(make) if abstract else make())}

    save_checkpoint(tmp_path / "with_bias", 0, linear_tree(use_bias=True, abstract=False))
    save_checkpoint(tmp_path / "no_bias", 0, linear_tree(use_bias=False, abstract=False))
    with pytest.raises(ValueError, match=r"\['state'\]\['bias'\]: not in the model"):
        restore_checkpoint(tmp_path / "with_bias", linear_tree(use_bias=False))
    with pytest.raises(ValueError, match=r"\['state'\]\['bias'\]: missing in checkpoint"):
        restore_checkpoint(tmp_path / "no_bias", linear_tree(use_bias=True))
    with pytest.raises(ValueError, match=r"\['meta'\]\['step'\]: missing in checkpoint"):
        restore_checkpoint(tmp_path / "no_bias", {**linear_tree(False), "meta": {"step": 0}})


@pytest.mark.slow  # a fresh Python process (~1.5 s)
def test_importing_the_adapter_leaves_orbax_and_logging_alone():
    code = textwrap.dedent(
        """
        import logging, sys
        before = (list(logging.getLogger().handlers), logging.getLogger().level)
        import nnxscan.adapters.checkpoint
        assert not [m for m in sys.modules if m.startswith("orbax")], "orbax imported"
        assert before == (list(logging.getLogger().handlers), logging.getLogger().level)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# The child saves checkpoint 1, then starts a 200 MB checkpoint 2 that the parent kills.
CRASHING_SAVER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from nnxscan.adapters.checkpoint import save_checkpoint

    directory, storage = sys.argv[1:]
    small = np.arange(12, dtype=np.float32).reshape(3, 4)
    big = np.random.default_rng(0).random(50_000_000, dtype=np.float32)
    save_checkpoint(directory, 1, {"w": small, "meta": {"step": 1}}, storage=storage)
    print("saved 1", flush=True)
    save_checkpoint(directory, 2, {"w": small + 1, "big": big, "meta": {"step": 2}},
                    storage=storage)
    print("saved 2", flush=True)
    """
)


def bytes_under(directory) -> int:
    # os.walk skips folders that vanish mid-walk: orbax renames its temporary ones as it goes.
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


def save_in_progress(directory, step: int):
    """The folder of a save of ``step`` in progress (orbax's ``<step>.orbax-checkpoint-tmp-*``,
    nnxscan's own ``<step>.nnxscan-tmp``), or None."""
    return next((p for p in directory.iterdir() if p.name.startswith(f"{step}.")), None)


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
@pytest.mark.parametrize("storage", ["auto", pytest.param("orbax", marks=pytest.mark.slow)])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_restorable(tmp_path, storage):
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_SAVER, str(tmp_path), storage],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while (in_progress := save_in_progress(tmp_path, 2)) is None and child.poll() is None:
            assert time.monotonic() < deadline, "checkpoint 2 never started"
            time.sleep(0.01)
        # Kill once the 200 MB array is being written (or after 1 s, still mid-save).
        deadline = time.monotonic() + 1.0
        while bytes_under(in_progress) < 2**20 and time.monotonic() < deadline:
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == -signal.SIGKILL, err
    assert out.split("\n")[0] == "saved 1" and "saved 2" not in out, "not killed mid-save"
    assert in_progress.exists() and not (tmp_path / "2").exists()
    assert 0 < bytes_under(in_progress) < 200 * 2**20  # half-written

    assert all_steps(tmp_path) == [1] and latest_step(tmp_path) == 1
    like = {"w": np.zeros((3, 4), np.float32), "meta": {"step": 0}}
    tree, step = restore_checkpoint(tmp_path, like)
    assert step == 1 and tree["meta"] == {"step": 1}
    np.testing.assert_array_equal(
        tree["w"], np.arange(12, dtype=np.float32).reshape(3, 4), strict=True
    )

    # Resuming saves step 2 again: the half-written directory is replaced, not an obstacle.
    tree = {"w": np.ones((3, 4), np.float32), "meta": {"step": 2}}
    save_checkpoint(tmp_path, 2, tree, storage=storage)
    assert all_steps(tmp_path) == [1, 2] and not in_progress.exists()
    tree, step = restore_checkpoint(tmp_path, like)
    assert step == 2 and tree["meta"] == {"step": 2}
