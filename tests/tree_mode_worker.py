"""Run by tests/test_tree_mode.py (not collected by pytest) with 4 simulated CPU devices and
``NNX_GRAPH_MODE`` set: ``python tree_mode_worker.py OUT_DIR``. Trains a model annotated for
a (data, model) mesh, as Flax's scale-up guide annotates its layers, through ``Trainer.fit``
(checkpoints, then a resume in fresh objects) and ``scan_train`` (the built-in step, and a
step written for tree mode), and writes each run's arrays (``RUN.npz``) and every
parameter's sharding (``seen.json``), for the test to compare between the modes.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import numpy as np
import optax
from flax import nnx
from gspmd_models import DEPTH, DotReluDot, mse
from jax.sharding import AxisType
from test_tree_mode import make_tree_step

from nnxscan.shell import Trainer, scan_train

from conftest import state_arrays

OUT = pathlib.Path(sys.argv[1])
MESH = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
TX = optax.adam(1e-3)
rng = np.random.default_rng(0)
DATA = {
    "x": rng.normal(size=(64, DEPTH)).astype(np.float32),
    "y": rng.normal(size=(64, DEPTH)).astype(np.float32),
}


class Model(nnx.Module):
    """Two of the guide's annotated blocks (a Python attribute each, no nnx.vmap: tree mode
    has no ``transform_metadata``)."""

    def __init__(self, rngs: nnx.Rngs):
        self.first = DotReluDot(DEPTH, rngs)
        self.second = DotReluDot(DEPTH, rngs)

    def __call__(self, x):
        return self.second(self.first(x))


tree_step = make_tree_step(mse)


def specs(node) -> dict[str, str]:
    """``{path: spec}`` of every Param (trailing Nones dropped, as JAX prints them)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(node, nnx.Param)):
        spec = tuple(leaf.sharding.spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        out[jax.tree_util.keystr(path)] = str(spec)
    return out


def save(name: str, *nodes, losses) -> None:
    leaves = [x for node in nodes for x in state_arrays(node)] + [np.asarray(losses)]
    np.savez(OUT / f"{name}.npz", *leaves)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    seen = {"graph_mode": bool(nnx.set_graph_mode.current_value()), "specs": {}}
    stacked = jax.tree.map(lambda v: v[:48].reshape(6, 8, *v.shape[1:]), DATA)
    with jax.set_mesh(MESH):
        model = Model(nnx.Rngs(0))
        seen["created"] = specs(model)
        Trainer(model, TX, mse).fit(
            DATA, epochs=2, batch_size=16, checkpoint_dir=OUT / "ckpt", progress=False
        )
        model = Model(nnx.Rngs(1))
        trainer = Trainer(model, nnx.Optimizer(model, TX, wrt=nnx.Param), mse)
        history = trainer.fit(DATA, epochs=3, batch_size=16, checkpoint_dir=OUT / "ckpt",
                              resume=True, progress=False)  # fmt: skip
        save("fit_resume", model, trainer.optimizer, losses=history.losses)
        seen["specs"]["fit_resume"] = specs(model)

        for name, kwargs in (
            ("scan_builtin", {"loss_fn": mse}),
            ("scan_user_step", {"train_step": tree_step}),
        ):
            model = Model(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
            losses = scan_train(model, optimizer, batches=stacked, **kwargs)
            save(name, model, optimizer, losses=losses)
            seen["specs"][name] = specs(model)
    (OUT / "seen.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
