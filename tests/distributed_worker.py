"""Run by tests/test_distributed.py in subprocesses (not collected by pytest).

``python distributed_worker.py mesh4 OUT``: on 4 simulated CPU devices, trains the same
model single-device, data-parallel and FSDP, and saves everything needed to compare.
``python distributed_worker.py process PID PORT OUT``: one of two processes on 127.0.0.1,
each feeding its half of every batch.
"""

from __future__ import annotations

import functools
import json
import sys

import numpy as np


class Spec:
    din, hidden, classes, n, batch = 8, 64, 3, 64, 8


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(Spec.n, Spec.din)).astype(np.float32)
    return {"x": x, "y": rng.integers(0, Spec.classes, Spec.n).astype(np.int32)}


@functools.cache
def _parts():
    """The model class, optax transform and loss, made once per process: the shell caches
    compiled programs by the transform and loss objects and the graphdef (the class), so
    every scenario of a process reuses what an earlier one compiled for the same shapes."""
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(Spec.din, Spec.hidden, rngs=rngs)
            self.l2 = nnx.Linear(Spec.hidden, Spec.classes, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    def xent(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return MLP, optax.adam(1e-2), xent


def build():
    """A freshly initialised model (the same weights every time), the transform, the loss."""
    from flax import nnx

    cls, tx, loss = _parts()
    return cls(nnx.Rngs(0)), tx, loss


def local_leaves(model):
    import jax
    from flax import nnx

    # Sharded (FSDP) arrays are whole when every device is ours; replicated arrays over
    # several processes are read from the local copy.
    return [
        np.asarray(a) if a.is_fully_addressable else np.asarray(a.addressable_shards[0].data)
        for a in jax.tree.leaves(nnx.state(model))
    ]


def mesh4(out):
    import jax
    from flax import nnx
    from jax.sharding import Mesh

    from nnxscan.shell import Trainer

    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    d = data()
    results, shardings = {}, {}
    for name, options in {
        "single": {},
        "dp": {"mesh": mesh},
        "fsdp": {"mesh": mesh, "fsdp_min_size": 100},
    }.items():
        model, tx, loss = build()
        trainer = Trainer(model, tx, loss, **options)
        history = trainer.fit(d, epochs=2, batch_size=Spec.batch, seed=1, progress=False)
        batches = [{k: v[i : i + 8] for k, v in d.items()} for i in range(0, Spec.n, 8)]
        trainer.fit(batches, epochs=1, progress=False)  # and a stream, sharded by chunk
        results[name] = [*local_leaves(model), history.losses]
        shardings[name] = {
            str(jax.tree_util.keystr(p)): str(getattr(x.sharding, "spec", "single device"))
            for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model))
        }
    # Checkpoints on the mesh: train 1 epoch, save, restore into a new trainer, train 1
    # more; evaluate before and after. Compared with 2 epochs straight.
    import tempfile

    from conftest import accuracy

    straight_model, tx, loss = build()
    straight = Trainer(straight_model, tx, loss, mesh=mesh)
    evaluations = {"before": straight.evaluate(d, accuracy, batch_size=16)}
    straight.fit(d, epochs=2, batch_size=Spec.batch, progress=False)
    first_model, tx, loss = build()
    first = Trainer(first_model, tx, loss, mesh=mesh)
    first.fit(d, epochs=1, batch_size=Spec.batch, progress=False)
    run_dir = tempfile.mkdtemp()
    first.save(run_dir)
    resumed_model, tx, loss = build()
    resumed = Trainer(resumed_model, tx, loss, mesh=mesh, fsdp_min_size=100)
    resumed.restore(run_dir)
    restored_spec = str(resumed_model.l1.kernel[...].sharding.spec)
    resumed.fit(d, epochs=1, batch_size=Spec.batch, progress=False)
    evaluations["straight"] = straight.evaluate(d, accuracy, batch_size=16)
    evaluations["resumed"] = resumed.evaluate(d, accuracy, batch_size=16)
    results["straight"] = local_leaves(straight_model)
    results["resumed"] = local_leaves(resumed_model)

    # The pure core with the same sharding hint, under the user's own jax.jit.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nnxscan.pure import init_opt_state, make_epoch, make_train_step

    model, tx, loss = build()
    graphdef, state = nnx.split(model)
    opt_state = init_opt_state(tx, state)
    step = make_train_step(loss, tx)
    key = jax.random.key(0)
    plain = jax.jit(make_epoch(step, batch_size=8))(graphdef, state, opt_state, d, key)
    replicated = NamedSharding(mesh, P())
    hinted = make_epoch(step, batch_size=8, batch_sharding=NamedSharding(mesh, P("data")))
    sharded = jax.jit(hinted)(graphdef, *jax.device_put((state, opt_state, d), replicated), key)
    for name, (new_state, _, losses) in {"pure_plain": plain, "pure_sharded": sharded}.items():
        results[name] = [*(np.asarray(x) for x in jax.tree.leaves(new_state)), losses]

    model, tx, loss = build()
    try:
        Trainer(model, tx, loss, mesh=mesh).fit(d, epochs=1, batch_size=6, progress=False)
        error = ""
    except ValueError as e:
        error = str(e)
    np.savez(out, **{f"{k}_{i}": a for k, v in results.items() for i, a in enumerate(v)})
    with open(out + ".json", "w") as f:
        json.dump(
            {
                "shardings": shardings,
                "error": error,
                "evaluations": evaluations,
                "restored_spec": restored_spec,
            },
            f,
        )


def process(pid, port, out):
    from nnxscan.adapters.distributed import initialize

    initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
    import jax
    from jax.sharding import Mesh

    from nnxscan.shell import Trainer

    d = data()
    half = slice(pid * Spec.batch // 2, (pid + 1) * Spec.batch // 2)
    mine = [
        {k: v[i : i + Spec.batch][half] for k, v in d.items()} for i in range(0, Spec.n, Spec.batch)
    ]
    model, tx, loss = build()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    history = Trainer(model, tx, loss, mesh=mesh).fit(mine, epochs=2, progress=False)
    np.savez(out, *local_leaves(model), history.losses)


if __name__ == "__main__":
    if sys.argv[1] == "mesh4":
        mesh4(sys.argv[2])
    else:
        process(int(sys.argv[2]), sys.argv[3], sys.argv[4])
