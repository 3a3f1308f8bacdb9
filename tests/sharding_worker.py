"""Run with 8 simulated CPU devices by tests/test_sharding.py (not collected by pytest):
``python sharding_worker.py OUT.json``. Trains the models of Flax's scale-up guide (and a
few more) with nnxscan on (data, model) meshes and records, for the tests to assert, what
each run gave next to its reference: the guide's own step under ``nnx.jit`` on the same
batches, a per-member Trainer, or a straight run.
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from gspmd_models import (
    DEPTH,
    LAYERS,
    SHARDING_RULES,
    ExplicitMultiDotReluDot,
    LogicalMultiDotReluDot,
    MultiDotReluDot,
    guide_step,
    mse,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscan.pure import epoch_order
from nnxscan.shell import LambdaCallback, Population, Trainer, scan_train

N, B, EPOCHS = 64, 16, 2
rng = np.random.default_rng(0)
DATA = {
    "x": rng.normal(size=(N, DEPTH)).astype(np.float32),
    "y": rng.normal(size=(N, DEPTH)).astype(np.float32),
}
AUTO = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
EXPLICIT = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
# One optax transform for every run and reference: the shell caches compiled programs by
# the transform object (optax.adam(1e-3) twice is two objects), so sharing it lets each
# configuration reuse what an earlier one compiled for the same model and mesh.
TX = optax.adam(1e-3)
GUIDE = {
    "auto": (MultiDotReluDot, AUTO, ()),
    "logical": (LogicalMultiDotReluDot, AUTO, SHARDING_RULES),
    "explicit": (ExplicitMultiDotReluDot, EXPLICIT, ()),
}


def specs(tree) -> dict[str, str]:
    """``{path: spec}`` of every array leaf (trailing Nones dropped, as JAX prints them)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        spec = tuple(leaf.sharding.spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        out[jax.tree_util.keystr(path)] = str(spec)
    return out


def epoch_batches(epochs: int, seed: int = 0) -> list[dict]:
    """The batches Trainer.fit trains: ``epoch_order(seed, e, n)`` cut in order."""
    out = []
    for e in range(epochs):
        order = epoch_order(seed, e, N)
        out += [{k: v[order[i : i + B]] for k, v in DATA.items()} for i in range(0, N, B)]
    return out


def guide_losses(cls, mesh, rules, batches) -> tuple[nnx.Module, list[float]]:
    """The reference: the guide's step under nnx.jit, batches sharded as the guide does."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        model = cls(DEPTH, LAYERS, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
        sharding = NamedSharding(mesh, P("data", None))
        losses = [
            float(guide_step(model, optimizer, *(jax.device_put(b[k], sharding) for k in "xy")))
            for b in batches
        ]
    return model, losses


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def guide_runs(results: dict) -> None:
    """Each guide model: Trainer.fit and scan_train under jax.set_mesh, and Trainer with
    mesh= and no context, against the guide's step on the same batches."""
    for name, (cls, mesh, rules) in GUIDE.items():
        ref, ref_losses = guide_losses(cls, mesh, rules, epoch_batches(EPOCHS))
        out = results[name] = {}
        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
            model = cls(DEPTH, LAYERS, rngs=nnx.Rngs(0))
            out["created"] = specs(nnx.state(model))
            trainer = Trainer(model, TX, mse)
            history = trainer.fit(DATA, epochs=EPOCHS, batch_size=B, progress=False)
            out["fit_diff"] = max_diff(history.losses, ref_losses)
            out["fit_specs"] = specs(nnx.state(model))
            out["fit_state_diff"] = max(
                max_diff(a, b)
                for a, b in zip(
                    jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref)), strict=True
                )
            )
            opt = trainer.opt_state[0]
            out["mu_specs"], out["nu_specs"] = specs(opt.mu), specs(opt.nu)
            out["count_spec"] = str(tuple(opt.count.sharding.spec))
            out["param_specs"] = specs(nnx.state(model, nnx.Param))
            out["eval"] = trainer.evaluate(DATA, mse, batch_size=B)["mse"]
            whole = jax.device_put(DATA, NamedSharding(mesh, P("data", None)))
            out["eval_ref"] = float(mse(ref, whole))

            model = cls(DEPTH, LAYERS, rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
            batches = epoch_batches(EPOCHS)
            stacked = {k: np.stack([b[k] for b in batches]) for k in "xy"}
            losses = scan_train(model, optimizer, mse, stacked)
            out["scan_diff"] = max_diff(losses, ref_losses)
            out["scan_specs"] = specs(nnx.state(model))
            out["scan_opt_specs"] = specs(nnx.state(optimizer))
            out["scan_steps"] = int(optimizer.step[...])
        with nnx.logical_axis_rules(rules):
            with jax.set_mesh(mesh):
                model = cls(DEPTH, LAYERS, rngs=nnx.Rngs(0))
            # No context now: the Trainer enters mesh= itself for the model's own code.
            trainer = Trainer(model, TX, mse, mesh=mesh)
            history = trainer.fit(DATA, epochs=EPOCHS, batch_size=B, progress=False)
            out["mesh_arg_diff"] = max_diff(history.losses, ref_losses)
            out["mesh_arg_specs"] = specs(nnx.state(model))


def memory_check(results: dict) -> None:
    """After every compiled call: no device holds more than its share of a sharded
    parameter or optax moment (per-device bytes from addressable_shards)."""
    checked = []  # (parts, largest bytes on one device x parts / total bytes)

    def check(trainer, logs):
        for leaf in jax.tree.leaves((nnx.state(trainer.model), trainer.opt_state)):
            spec = leaf.sharding.spec
            names = [a for e in spec if e for a in (e if isinstance(e, tuple) else (e,))]
            parts = int(np.prod([AUTO.shape[a] for a in names], dtype=np.int64))
            per_device: dict = {}
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
            checked.append((parts, max(per_device.values()) * parts / max(leaf.nbytes, 1)))

    with jax.set_mesh(AUTO):
        model = MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0))
        trainer = Trainer(model, TX, mse)
        trainer.fit(DATA, epochs=1, batch_size=B, steps_per_call=2, progress=False,
                    callbacks=[LambdaCallback(on_call_end=check)])  # fmt: skip
    results["memory"] = {
        "calls": N // B // 2,
        "checks": len(checked),
        "sharded": sum(p > 1 for p, _ in checked),
        # The largest per-device bytes x parts / total: 1.0 when no device holds more than
        # its share (a whole copy of a 4-way sharded leaf would give 4.0).
        "worst_ratio": max(r for _, r in checked),
    }


class Plain(nnx.Module):
    """The guide's two matmuls with no annotation at all: a third-party model."""

    def __init__(self, depth: int, rngs: nnx.Rngs):
        self.dot1 = nnx.Linear(depth, depth, use_bias=False, rngs=rngs)
        self.w2 = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (depth, depth)))

    def __call__(self, x):
        return jnp.dot(jax.nn.relu(self.dot1(x)), self.w2[...])


def path_rules(results: dict) -> None:
    """shardings={regex: spec} shards an unannotated model tensor-parallel; a rule wins over
    an annotation; both train as the plain single-device loop does."""
    rules = {r"dot1/kernel": P(None, "model"), r"^w2$": P("model", None)}
    reference = Plain(DEPTH, rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(reference, TX, wrt=nnx.Param)
    batches = epoch_batches(1)
    ref_losses = [float(guide_step(reference, ref_opt, b["x"], b["y"])) for b in batches]
    with jax.set_mesh(AUTO):
        model = Plain(DEPTH, rngs=nnx.Rngs(0))
        trainer = Trainer(model, TX, mse, shardings=rules)
        history = trainer.fit(DATA, epochs=1, batch_size=B, progress=False)
        annotated = MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0))
        Trainer(annotated, TX, mse, shardings={r"dot1/kernel": P(None, None, None)}).fit(
            DATA, epochs=1, batch_size=B, progress=False
        )
    results["rules"] = {
        "diff": max_diff(history.losses, ref_losses),
        "specs": specs(nnx.state(model)),
        "mu_specs": specs(trainer.opt_state[0].mu),
        "override_specs": specs(nnx.state(annotated)),
    }


class TPMLP(nnx.Module):
    """An annotated tensor-parallel MLP with no activation constraints (so that it runs
    inside a population's vmap over another mesh axis)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(DEPTH, 2 * DEPTH, kernel_init=nnx.with_partitioning(
            init, (None, "model")), bias_init=nnx.with_partitioning(
            nnx.initializers.zeros, ("model",)), rngs=rngs)  # fmt: skip
        self.down = nnx.Linear(2 * DEPTH, DEPTH, kernel_init=nnx.with_partitioning(
            init, ("model", None)), rngs=rngs)  # fmt: skip

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def populations(results: dict) -> None:
    """Members over one mesh axis, each member tensor-parallel over another: each member
    trains what its own Trainer trains on the same mesh."""
    mesh = jax.make_mesh((2, 4), ("members", "model"), axis_types=(AxisType.Auto,) * 2)
    seeds = [0, 1]
    with jax.set_mesh(mesh):
        pop = Population(TPMLP, TX, mse, seeds=seeds)
        history = pop.fit(DATA, epochs=EPOCHS, batch_size=B, progress=False)
        out = {"specs": specs(pop.state), "diffs": [], "state_diffs": []}
        for i, seed in enumerate(seeds):
            model = TPMLP(nnx.Rngs(seed))
            alone = Trainer(model, TX, mse).fit(
                DATA, epochs=EPOCHS, batch_size=B, seed=seed, progress=False
            )
            out["diffs"].append(max_diff(history.losses[:, i], alone.losses))
            member = pop.member(i)
            out["state_diffs"].append(
                max(
                    max_diff(a, b)
                    for a, b in zip(
                        jax.tree.leaves(nnx.state(member)),
                        jax.tree.leaves(nnx.state(model)),
                        strict=True,
                    )
                )
            )
            out["member_specs"] = specs(nnx.state(model))
        out["eval_shape"] = list(pop.evaluate(DATA, mse, batch_size=B)["mse"].shape)
    # mesh= and no context at all: the members are built (annotated layers sharded as they
    # are created) and trained on that mesh, as under jax.set_mesh.
    assert jax.sharding.get_abstract_mesh().empty
    pop = Population(TPMLP, TX, mse, seeds=seeds, mesh=mesh, member_axis="members")
    out["mesh_arg_built_specs"] = specs(pop.state)
    alone = pop.fit(DATA, epochs=EPOCHS, batch_size=B, progress=False)
    out["mesh_arg_specs"] = specs(pop.state)
    out["mesh_arg_diff"] = max_diff(alone.losses, history.losses)
    results["population"] = out


def elastic(results: dict) -> None:
    """Saved on 2 x 4, restored onto 4 x 2 and onto 1 x 4 (4 of the 8 devices), trained
    on: each ends where the straight 2 x 4 run ends (up to the rounding of another
    partitioning), and each restored array lands on the model's current sharding."""
    directory = tempfile.mkdtemp()
    with jax.set_mesh(AUTO):
        straight = Trainer(MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0)), TX, mse)
        full = straight.fit(DATA, epochs=2, batch_size=B, progress=False)
        first = Trainer(MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0)), TX, mse)
        first.fit(DATA, epochs=1, batch_size=B, checkpoint_dir=directory, progress=False)
    out = {}
    meshes = {
        "4x2": jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2),
        "1x4": jax.make_mesh(
            (1, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4]
        ),
    }
    for name, mesh in meshes.items():
        with jax.set_mesh(mesh):
            model = MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(1))  # other weights
            created = specs(nnx.state(model))
            trainer = Trainer(model, TX, mse)
            epoch = trainer.restore(directory)
            restored = {
                "epoch": epoch,
                "specs": specs(nnx.state(model)) == created,
                "devices": len(jax.tree.leaves(nnx.state(model))[0].sharding.device_set),
            }
            history = trainer.fit(DATA, epochs=1, batch_size=B, progress=False)
            restored["loss_diff"] = max_diff(history.losses, full.losses[-len(history.losses) :])
            restored["state_diff"] = max(
                max_diff(a, b)
                for a, b in zip(
                    jax.tree.leaves(nnx.state(model)),
                    jax.tree.leaves(nnx.state(straight.model)),
                    strict=True,
                )
            )
            restored["after"] = specs(nnx.state(model)) == created
        out[name] = restored
    results["elastic"] = out


def engine_features(results: dict) -> None:
    """Streams, fused epochs and non-finite skipping on a sharded model: a fused run equals
    the same epochs run one call each, bitwise; a skipped batch leaves the model as it was."""
    out = {}
    with jax.set_mesh(AUTO):

        def run(**fit):
            trainer = Trainer(MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0)),
                              TX, mse, on_nonfinite="skip")  # fmt: skip
            trainer.fit(DATA, epochs=3, batch_size=B, progress=False, **fit)
            return [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model))]

        fused = run()
        separate = run(callbacks=[LambdaCallback(on_epoch_end=lambda *a: None)])
        out["fused_equal"] = all(np.array_equal(a, b) for a, b in zip(fused, separate, strict=True))
        bad = [{k: v[i : i + B] for k, v in DATA.items()} for i in range(0, N, B)]
        bad[1] = {"x": np.full_like(bad[1]["x"], np.nan), "y": bad[1]["y"]}
        trainer = Trainer(MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0)),
                          TX, mse, on_nonfinite="skip")  # fmt: skip
        history = trainer.fit(bad, epochs=1, progress=False)
        out["skipped"] = int(history.epochs[0]["skipped_steps"])
        out["stream_specs_kept"] = specs(nnx.state(trainer.model)) == results["auto"]["created"]
    results["features"] = out


def errors(results: dict) -> None:
    """Bad combinations are refused before anything compiles, and change nothing."""
    messages = []
    with jax.set_mesh(AUTO):
        plain = lambda depth, rules: Trainer(  # noqa: E731
            Plain(depth, rngs=nnx.Rngs(0)), TX, mse, shardings=rules
        )
        cases = [
            lambda: plain(DEPTH, {"dot1": P(None, "tensor")}),  # an axis the mesh lacks
            lambda: plain(DEPTH, {"dot1": P(None, None, "model")}),  # more entries than dims
            lambda: plain(DEPTH + 2, {"dot1": P(None, "model")}),  # 34 over 4 devices
            lambda: Trainer(MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0)), TX, mse),
        ]
        data = [DATA, DATA, {k: np.ones((N, DEPTH + 2), np.float32) for k in "xy"}, DATA]
        sizes = [B, B, B, 7]
        for make, batch_data, size in zip(cases, data, sizes, strict=True):
            trainer = make()
            try:
                trainer.fit(batch_data, epochs=1, batch_size=size, progress=False)
                messages.append("no error")
            except ValueError as error:
                messages.append(str(error))
            messages[-1] += f" | step {trainer.step}"
    other = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(AUTO):
        trainer = Trainer(Plain(DEPTH, rngs=nnx.Rngs(0)), TX, mse, mesh=other)
        try:
            trainer.fit(DATA, epochs=1, batch_size=B, progress=False)
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    results["errors"] = messages


# Flax's optimization cookbook, "Sharding Optimization State Differently from Parameters":
# its toy model and data, Adam moments sharded P('x', 'y') on a 2 x 4 Explicit mesh while
# the parameters stay replicated.
COOK_STEPS = 6
COOK_MESH = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
COOK_TX = optax.adam(1e-3)
_cook_rngs = nnx.Rngs(0)
COOK_X, COOK_Y = _cook_rngs.normal((32, 2)), _cook_rngs.normal((32, 8))


def cook_model(init=None) -> nnx.Module:
    init = init or nnx.initializers.lecun_normal()
    rngs = nnx.Rngs(1)
    return nnx.Sequential(
        nnx.Linear(2, 8, rngs=rngs, kernel_init=init), nnx.Linear(8, 8, rngs=rngs, kernel_init=init)
    )


def cook_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def cook_batch_loss(model, batch):
    return cook_loss(model, batch["x"], batch["y"])


@nnx.jit
def cook_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(cook_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss


def leaf_report(tree) -> dict[str, list]:
    """``{path: [spec, bytes on device 0, total bytes]}`` of every array leaf."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        spec = tuple(leaf.sharding.spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        shard = leaf.addressable_shards[0].data.nbytes
        out[jax.tree_util.keystr(path)] = [str(spec), int(shard), int(leaf.nbytes)]
    return out


def optimizer_sharding(results: dict) -> None:
    """The cookbook's section: its own nnx.jit loop (resharding the model after each step,
    as it does) against scan_train and Trainer.fit on the same objects, and against a
    Trainer given the transform (the annotation alone) and an unannotated model given a
    path rule on optimizer-state paths."""
    annotated = nnx.with_metadata(nnx.initializers.lecun_normal(), optimizer_sharding=P("x", "y"))
    stacked = {"x": jnp.stack([COOK_X] * COOK_STEPS), "y": jnp.stack([COOK_Y] * COOK_STEPS)}
    data = {"x": COOK_X, "y": COOK_Y}
    fit = dict(epochs=COOK_STEPS, batch_size=32, shuffle=False, progress=False)
    out = results["cookbook"] = {}
    with jax.set_mesh(COOK_MESH):
        model = cook_model(annotated)
        optimizer = nnx.Optimizer(model, tx=COOK_TX, wrt=nnx.Param)
        losses = []
        for _ in range(COOK_STEPS):
            losses.append(float(cook_step(model, optimizer, COOK_X, COOK_Y)))
            model = jax.sharding.reshard(model, P(None, None))
        reference = [np.asarray(x) for x in jax.tree.leaves((model, optimizer.opt_state))]
        out["reference"] = leaf_report((nnx.state(model), optimizer.opt_state))

        def against(losses_got, model, opt_state) -> dict:
            """Losses, parameters and optax leaves next to the cookbook loop's."""
            got = [np.asarray(x) for x in jax.tree.leaves((model, opt_state))]
            return {
                "loss_diff": max_diff(losses_got, losses),
                "state_diff": max(max_diff(a, b) for a, b in zip(got, reference, strict=True)),
                "report": leaf_report((nnx.state(model), opt_state)),
            }

        model = cook_model(annotated)
        optimizer = nnx.Optimizer(model, tx=COOK_TX, wrt=nnx.Param)
        got = scan_train(model, optimizer, cook_batch_loss, stacked)
        out["scan_train"] = against(got, model, optimizer.opt_state)
        out["scan_train"]["steps"] = int(optimizer.step[...])

        model = cook_model(annotated)
        optimizer = nnx.Optimizer(model, tx=COOK_TX, wrt=nnx.Param)
        history = Trainer(model, optimizer, cook_batch_loss).fit(data, **fit)
        out["fit"] = against(history.losses, model, optimizer.opt_state)

        model = cook_model(annotated)  # the transform alone: the annotation decides
        trainer = Trainer(model, COOK_TX, cook_batch_loss)
        history = trainer.fit(data, **fit)
        out["fit_tx"] = against(history.losses, model, trainer.opt_state)

        model = cook_model()  # no annotation: a path rule shards the moments of kernels
        rules = {r"^opt_state/0/(mu|nu)/.*/kernel$": P("x", "y")}
        trainer = Trainer(model, COOK_TX, cook_batch_loss, shardings=rules)
        history = trainer.fit(data, **fit)
        out["rules"] = against(history.losses, model, trainer.opt_state)


def main(out: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    results: dict = {}
    for part in (guide_runs, memory_check, path_rules, populations, elastic, engine_features,
                 errors, optimizer_sharding):  # fmt: skip
        part(results)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
