"""Trainer checkpoints: exact resume in a new process, safe failures, determinism."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import Trainer

from conftest import MLP, BNDropout, assert_trees_close, make_data, run_together, state_arrays, xent

TX = optax.adam(1e-2)
BS = 8

# A self-contained training script: the model, data and loss are rebuilt from scratch in
# each process, so nothing but the checkpoint carries state from one process to the next.
SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, numpy as np, optax
    from flax import nnx
    from nnxscan.shell import Trainer

    class BNDropout(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)
            self.l2 = nnx.Linear(8, 3, rngs=rngs)
        def __call__(self, x):
            return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))

    def xent(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    data = {"x": x, "y": np.argmax(x @ rng.normal(size=(4, 3)), -1).astype(np.int32)}
    mode, directory, out = sys.argv[1], sys.argv[2], sys.argv[3]
    model = BNDropout(nnx.Rngs(0))
    trainer = Trainer(model, optax.adam(1e-2), xent)
    if mode == "resume":
        assert trainer.restore(directory) == 2
        trainer.fit(data, epochs=2, batch_size=8, progress=False)
    else:
        trainer.fit(data, epochs=4, batch_size=8, seed=int(mode), progress=False)
    leaves = jax.tree.leaves(nnx.state(model))
    arrays = [np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype,
              jax.dtypes.prng_key) else a) for a in leaves]
    np.savez(out, *arrays, epoch=trainer.epoch, step=trainer.step)
    """
)


def run_script(tmp_path, *args):
    run_scripts(tmp_path, args)


def run_scripts(tmp_path, *runs):
    """Runs the script once per argument tuple, each in a process of its own, all at once."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for p, _, err in run_together([[sys.executable, str(script), *map(str, args)]
                                   for args in runs], timeout=300):  # fmt: skip
        assert p.returncode == 0, err[-3000:]


def load(path):
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files) - 2)], int(z["epoch"]), int(z["step"])


@pytest.mark.slow
def test_train_save_and_resume_in_a_new_process_is_bitwise_training_straight(tmp_path, data):
    straight = BNDropout(rngs=nnx.Rngs(0))
    Trainer(straight, TX, xent).fit(data, epochs=4, batch_size=BS, seed=3, progress=False)

    first = BNDropout(rngs=nnx.Rngs(0))
    trainer = Trainer(first, TX, xent)
    trainer.fit(data, epochs=2, batch_size=BS, seed=3, progress=False)
    trainer.save(tmp_path / "run")

    run_script(tmp_path, "resume", tmp_path / "run", tmp_path / "resumed.npz")
    arrays, epoch, step = load(tmp_path / "resumed.npz")
    assert (epoch, step) == (4, 32)
    for a, b in zip(state_arrays(straight), arrays, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_same_seed_same_data_is_bitwise_equal_across_processes(tmp_path):
    # Two independent processes (run side by side): nothing is shared but the script.
    run_scripts(
        tmp_path,
        (5, tmp_path / "unused", tmp_path / "a.npz"),
        (5, tmp_path / "unused", tmp_path / "b.npz"),
    )
    (a, *_), (b, *_) = load(tmp_path / "a.npz"), load(tmp_path / "b.npz")
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_restore_into_an_nnx_optimizer_and_the_counters(tmp_path, data):
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    trainer = Trainer(model, optimizer, xent)
    trainer.fit(data, epochs=2, batch_size=BS, seed=7, progress=False)
    trainer.save(tmp_path)
    expected_model, expected_opt = state_arrays(model), state_arrays(optimizer)

    fresh = MLP(rngs=nnx.Rngs(1))
    fresh_opt = nnx.Optimizer(fresh, TX, wrt=nnx.Param)
    restored = Trainer(fresh, fresh_opt, xent)
    assert restored.restore(tmp_path) == 2
    assert (restored.step, restored.seed, int(fresh_opt.step[...])) == (16, 7, 16)
    restored_arrays = state_arrays(fresh) + state_arrays(fresh_opt)
    for a, b in zip(expected_model + expected_opt, restored_arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    assert restored.save(tmp_path) == (tmp_path / "16").resolve()  # already saved: kept


def test_fit_saves_every_n_epochs(tmp_path, data):
    from nnxscan.adapters.checkpoint import all_steps

    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    trainer.fit(
        data, epochs=5, batch_size=BS, checkpoint_dir=tmp_path, checkpoint_every=2, progress=False
    )
    assert all_steps(tmp_path) == [16, 32, 40]  # epochs 2 and 4, and the last one


def test_restoring_another_architecture_changes_nothing(tmp_path, data):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    trainer.fit(data, epochs=1, batch_size=BS, progress=False)
    trainer.save(tmp_path)
    wider = MLP(hidden=16, rngs=nnx.Rngs(0))
    other = Trainer(wider, TX, xent)
    before = state_arrays(wider)
    with pytest.raises(ValueError, match=r"\['l1'\]\['bias'\].*\(8,\).*\(16,\)"):
        other.restore(tmp_path)
    for a, b in zip(before, state_arrays(wider), strict=True):
        np.testing.assert_array_equal(a, b)
    assert (other.epoch, other.step) == (0, 0)


def test_missing_checkpoints_name_the_path(tmp_path):
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        trainer.restore(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        trainer.restore(tmp_path / "empty")


def test_resume_in_process_equals_straight_with_a_stream(tmp_path):
    d = make_data()
    batches = [{k: v[i * BS : (i + 1) * BS] for k, v in d.items()} for i in range(8)]
    straight = MLP(rngs=nnx.Rngs(0))
    Trainer(straight, TX, xent).fit(batches, epochs=4, progress=False)
    first = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    first.fit(batches, epochs=2, progress=False)
    first.save(tmp_path)
    resumed_model = MLP(rngs=nnx.Rngs(5))
    resumed = Trainer(resumed_model, TX, xent)
    resumed.restore(tmp_path)
    resumed.fit(batches, epochs=2, progress=False)
    assert_trees_close(resumed_model, straight, exact=True)
