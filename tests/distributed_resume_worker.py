"""Run by tests/test_distributed_resume.py in subprocesses (not collected by pytest).

``python distributed_resume_worker.py PID PORT MODELS PHASES ROOT CACHE``: one of two
processes on 127.0.0.1 (jax.distributed, gloo) training data-parallel models over the mesh
of both processes' devices. Both processes hold the whole data set; every batch is split
over the two devices. MODELS is a comma-separated list of ``bn`` (Linear, BatchNorm,
Linear: batch statistics move) and ``bn_dropout`` (with Dropout too: its RNG key and count
move), or ``tp``: Flax's scale-up guide's ``MultiDotReluDot``, tensor-parallel on a 2 x 4
``('data', 'model')`` mesh spanning both processes' 4 devices each (run with 4 simulated
devices per process; with PID ``solo`` one process holds all 8: the one-process
reference). PHASES is a ``+``-separated list of:

- ``straight``: ``EPOCHS`` epochs, no checkpoints (the reference).
- ``first``: ``FIRST_EPOCHS`` epochs with a checkpoint at each epoch's end, then exit.
- ``cut``: ``fit(epochs=EPOCHS, resume=True)`` with a checkpoint every ``EVERY_STEPS``
  steps, stopped by a callback right after the call that reaches ``CUT_STEP`` (before its
  save, as a crash would): the newest checkpoint is then in the middle of an epoch.
- ``resume``: the same ``fit`` as ``cut``, without the cut: it finishes the run.

Each model and phase starts from a freshly built model and ``Trainer``; a model's phases
share the checkpoint directory ``ROOT/MODEL/checkpoints``. The test runs a phase that
restores in a fresh pair of processes, so what a restore reads comes from the disk only.
Each process writes the final arrays it holds (its copy of the replicated state) to
``ROOT/MODEL/PHASE.pPID.npz``, and prints ``done`` at the end.
"""

from __future__ import annotations

import sys

EPOCHS, FIRST_EPOCHS, BATCH, EXAMPLES, EVERY_STEPS, SEED = 3, 1, 8, 64, 3, 5  # 8 steps an epoch
CUT_STEP = 13  # the call 11..14 of epoch 1 reaches it; it saves at 14, then the cut


class Cut(Exception):
    """What the ``cut`` phase raises to stop the run mid-epoch."""


def main(pid: str, port: str, models: str, phases: str, root: str, cache: str) -> None:
    import pathlib

    from nnxscan.adapters.distributed import initialize

    if pid != "solo":
        initialize(
            f"127.0.0.1:{port}", num_processes=2, process_id=int(pid), initialization_timeout=60
        )
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh

    from nnxscan.shell import LambdaCallback, Trainer, enable_compilation_cache

    from run_record import save_run

    enable_compilation_cache(cache)  # one folder per process index: no two processes share one

    class BNDropout(nnx.Module):
        """tests/conftest.py's model: BatchNorm statistics (and Dropout RNG counts) move."""

        def __init__(self, dropout: bool, *, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(4, 16, use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs) if dropout else None
            self.l2 = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            h = nnx.relu(self.bn(self.l1(x)))
            return self.l2(self.drop(h) if self.drop is not None else h)

    def xent(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    # One transform per process: the shell caches compiled programs by the transform
    # object, so the phases a process runs (straight+first) reuse each other's compiles.
    tx = optax.adam(1e-2)

    def run_phase(model_name: str, phase: str, checkpoint_dir: str, out: str) -> None:
        rng = np.random.default_rng(0)
        if model_name == "tp":
            from gspmd_models import DEPTH, LAYERS, MultiDotReluDot, mse

            x = rng.normal(size=(EXAMPLES, DEPTH)).astype(np.float32)
            data = {"x": x, "y": np.tanh(x @ rng.normal(size=(DEPTH, DEPTH))).astype(np.float32)}
            assert len(jax.devices()) == 8, jax.devices()
            auto = (jax.sharding.AxisType.Auto,) * 2  # the guide's auto-mode mesh
            mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)
            with jax.set_mesh(mesh):  # the guide's annotated model is sharded as it is built
                model = MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0))
            trainer = Trainer(model, tx, mse, mesh=mesh)
        else:
            x = rng.normal(size=(EXAMPLES, 4)).astype(np.float32)
            data = {"x": x, "y": np.argmax(x @ rng.normal(size=(4, 3)), axis=-1).astype(np.int32)}
            assert jax.process_count() == 2 and len(jax.devices()) == 2, jax.devices()
            mesh = Mesh(np.array(jax.devices()), ("data",))
            model = BNDropout({"bn": False, "bn_dropout": True}[model_name], rngs=nnx.Rngs(0))
            trainer = Trainer(model, tx, xent, mesh=mesh)
        fit = dict(batch_size=BATCH, seed=SEED, progress=False)
        if phase == "straight":
            history = trainer.fit(data, epochs=EPOCHS, **fit)
        elif phase == "first":
            history = trainer.fit(
                data, epochs=FIRST_EPOCHS, checkpoint_dir=checkpoint_dir, resume=True, **fit
            )
        else:
            callbacks = []
            if phase == "cut":

                def cut(trainer, logs):
                    if logs["step"] >= CUT_STEP:
                        raise Cut(logs["step"])

                callbacks = [LambdaCallback(on_call_end=cut)]
            try:
                history = trainer.fit(
                    data, epochs=EPOCHS, checkpoint_dir=checkpoint_dir,
                    checkpoint_every_steps=EVERY_STEPS, resume=True, callbacks=callbacks, **fit,
                )  # fmt: skip
            except Cut as stop:
                history = stop.history

        save_run(out, model, trainer, history)

    for model_name in models.split(","):
        directory = pathlib.Path(root) / model_name
        directory.mkdir(parents=True, exist_ok=True)
        for phase in phases.split("+"):
            out = directory / f"{phase}.p{pid}.npz"
            run_phase(model_name, phase, str(directory / "checkpoints"), str(out))
    print("done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:7])
