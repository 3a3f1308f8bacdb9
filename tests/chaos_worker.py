"""Run by tests/test_chaos.py in subprocesses (not collected by pytest).

``python chaos_worker.py CHECKPOINT_DIR OUT.npz CACHE_DIR``: a preemptible training script
on a small model whose forward pass moves batch statistics and RNG counts. It asks for the
WHOLE run with ``resume=True``: rerunning the same command after a kill goes on from the
newest checkpoint. On stdout it reports "ready" just before ``fit`` (imports done, model
built), "training" when ``fit``'s loop begins (after any restore) and "step N" after every
compiled call: what the test times its signals from. Once the run is complete it writes
every array of the final state (and the History) to OUT.npz and prints "done". A SIGTERM
makes ``fit`` save and raise ``Preempted``, which ends the process with a traceback (exit
status 1).
"""

from __future__ import annotations

import sys

EPOCHS, BATCH, EXAMPLES, EVERY_STEPS, SEED = 6, 8, 200, 4, 3  # 25 steps an epoch


def main(checkpoint_dir: str, out: str, cache_dir: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from nnxscan.shell import LambdaCallback, Trainer, enable_compilation_cache

    enable_compilation_cache(cache_dir)

    class BNDropout(nnx.Module):
        """tests/conftest.py's model: BatchNorm statistics and Dropout RNG counts move."""

        def __init__(self, din: int = 4, hidden: int = 16, dout: int = 3, *, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(din, hidden, use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(hidden, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)
            self.l2 = nnx.Linear(hidden, dout, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))

    def xent(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 4)).astype(np.float32)
    data = {"x": x, "y": np.argmax(x @ rng.normal(size=(4, 3)), axis=-1).astype(np.int32)}

    model = BNDropout(rngs=nnx.Rngs(0))
    trainer = Trainer(model, optax.adam(1e-2), xent)
    # What the test times its signals from. The hooks change nothing in what is trained: a
    # run with checkpoint_every_steps writes back after every call and fuses no epochs anyway.
    report = LambdaCallback(
        on_train_begin=lambda trainer: print("training", flush=True),
        on_call_end=lambda trainer, logs: print(f"step {logs['step']}", flush=True),
    )
    print("ready", flush=True)
    history = trainer.fit(
        data, epochs=EPOCHS, batch_size=BATCH, seed=SEED, checkpoint_dir=checkpoint_dir,
        checkpoint_every_steps=EVERY_STEPS, resume=True, progress=False,
        callbacks=[report],
    )  # fmt: skip

    def host(leaf) -> np.ndarray:
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.asarray(leaf)

    arrays = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        arrays["state" + jax.tree_util.keystr(path)] = host(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(trainer.opt_state):
        arrays["opt_state" + jax.tree_util.keystr(path)] = host(leaf)
    arrays["step"] = np.asarray(trainer.step)
    arrays["epoch"] = np.asarray(trainer.epoch)
    # Losses are reductions XLA may fuse differently in calls of another length: the test
    # compares them closely, not bitwise (the states above are compared bitwise).
    arrays["history_losses"] = np.asarray(history.losses)
    arrays["history_epochs"] = np.asarray([logs["epoch"] for logs in history.epochs])
    np.savez(out, **arrays)
    print("done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
