"""Flax's tree mode (``nnx.set_graph_mode(False)``, ``NNX_GRAPH_MODE=false``) and hijax
Variables (``nnx.var_defaults(hijax=True)``): nnxscan's core paths give in each the bits they
give in graph mode with plain Variables.

Every run below is the same program on the same inputs in each variant (a split in tree
mode, or of hijax Variables, gives the same arrays in the same order, and the compiled step
merges them into the same forward pass), so the comparisons are bitwise. The graph-mode runs
are held to Flax's own loops by the rest of the suite; here the user's step is also held to
Flax's own per-step loop of it, in each mode (another program: to rounding). Flax's own
loops can't differentiate hijax Variables that a forward pass mutates (flax 0.12.8: "jvp not
implemented for 'get_variable'"): nnxscan runs a hijax model's step on plain Variables and
writes the results back into the hijax ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import Step, hyper, init_opt_state, make_epoch, make_train_step
from nnxscan.shell import Population, Trainer, scan_train

from conftest import BNDropout, make_data, run_together, state_arrays, xent

# (graph mode, hijax Variables) of each variant.
VARIANTS = {
    "graph": (True, False),
    "tree": (False, False),
    "graph_hijax": (True, True),
    "tree_hijax": (False, True),
}
OTHERS = [v for v in VARIANTS if v != "graph"]
TX = optax.adam(1e-2)
DATA = make_data()
STACKED = jax.tree.map(lambda v: v[:48].reshape(6, 8, *v.shape[1:]), DATA)


@contextlib.contextmanager
def variant(name):
    """Builds and trains inside: Flax's graph or tree mode, plain or hijax Variables."""
    graph, hijax = VARIANTS[name]
    with nnx.set_graph_mode(graph), nnx.var_defaults(hijax=hijax):
        yield


def arrays(node) -> list[np.ndarray]:
    """Host copies of every array of an NNX object or state, hijax Variables read as plain."""
    state = node if isinstance(node, nnx.State) else nnx.state(node)
    return state_arrays(nnx.with_vars(state, hijax=False))


def make_tree_step(loss_fn):
    """A stateful step written for tree mode, as FLIP 5310 ports ``nnx.grad``: differentiate
    the Param part only (the RNG counts are integers); the forward pass's batch statistics
    and RNG counts flow back through the Variables."""

    def tree_step(model, optimizer, batch):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_of(params, rest):
            return loss_fn(nnx.merge(graphdef, params, rest), batch)

        loss, grads = nnx.value_and_grad(loss_of)(params, rest)
        optimizer.update(model, grads)
        return loss

    return tree_step


tree_step = make_tree_step(xent)


def _pure_update(graphdef, state, opt_state, batch):
    """A pure Step's update, with no NNX transform: what runs in any mode."""
    params, rest = nnx.split_state(state, nnx.Param, ...)

    def loss_fn(params):
        model = nnx.merge(graphdef, params, rest, copy=True)
        return xent(model, batch), nnx.state(model, nnx.Not(nnx.Param))

    (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return nnx.merge_state(optax.apply_updates(params, updates), rest), opt_state, loss


PURE_STEP = Step(lambda g, s: init_opt_state(TX, s), _pure_update)


def _loss_of_hypernetwork(model, batch):
    logits = model(jnp.ones(2), batch["x"][:, :1])  # the target's weights generated from z
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


# -- the runs: each returns host arrays; cached, so the graph-mode reference runs once --------

_RUNS: dict[tuple[str, str], list] = {}


def run(path: str, name: str, tmp_path=None) -> list:
    key = (path, name)
    if key not in _RUNS:
        with variant(name):
            _RUNS[key] = RUNNERS[path](None if tmp_path is None else tmp_path / name)
    return _RUNS[key]


def _builtin(_):
    model = BNDropout(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    losses = scan_train(model, optimizer, xent, STACKED)
    return [*arrays(model), *arrays(optimizer), np.asarray(losses)]


def _user_step(_):
    model = BNDropout(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    losses = scan_train(model, optimizer, batches=STACKED, train_step=tree_step)
    return [*arrays(model), *arrays(optimizer), np.asarray(losses)]


def _pure_step(_):
    model = BNDropout(rngs=nnx.Rngs(0))
    losses, opt_state = scan_train(model, batches=STACKED, train_step=PURE_STEP)
    return [*arrays(model), *state_arrays(opt_state), np.asarray(losses)]


def _fit_resume(tmp_path):
    """Two epochs with checkpoints, then a resume in fresh objects to four."""
    where = tmp_path / "checkpoints"
    model = BNDropout(rngs=nnx.Rngs(0))
    Trainer(model, TX, xent).fit(DATA, epochs=2, batch_size=16, checkpoint_dir=where,
                                 progress=False)  # fmt: skip
    model = BNDropout(rngs=nnx.Rngs(7))
    trainer = Trainer(model, nnx.Optimizer(model, TX, wrt=nnx.Param), xent)
    history = trainer.fit(DATA, epochs=4, batch_size=16, checkpoint_dir=where, resume=True,
                          progress=False)  # fmt: skip
    return [*arrays(model), *arrays(trainer.optimizer), np.asarray(history.losses)]


def _population(_):
    population = Population(lambda rngs: BNDropout(rngs=rngs), TX, xent, seeds=[0, 1])
    history = population.fit(DATA, epochs=2, batch_size=16)
    return [*arrays(population.state), *state_arrays(population.opt_state),
            np.asarray(history.losses)]  # fmt: skip


def _hypernetwork(_):
    """A Hypernetwork (its target with BatchNorm) through Trainer.fit, then the pure core's
    make_epoch on its split."""
    from hyper_models import MLP as Target

    target = Target(1, 8, 3, batchnorm=True, rngs=nnx.Rngs(0))
    trunk = nnx.Sequential(nnx.Linear(2, 8, rngs=nnx.Rngs(1)), nnx.tanh)
    hnet = hyper.Hypernetwork(target, trunk, 8, rngs=nnx.Rngs(2))
    Trainer(hnet, TX, _loss_of_hypernetwork).fit(DATA, epochs=2, batch_size=16, progress=False)
    graphdef, state = nnx.split(hnet)
    state = nnx.with_vars(state, hijax=False)
    epoch = jax.jit(make_epoch(make_train_step(_loss_of_hypernetwork, TX), batch_size=16))
    state, _, losses = epoch(graphdef, state, init_opt_state(TX, state), DATA, jax.random.key(0))
    return [*arrays(hnet), *arrays(state), np.asarray(losses)]


RUNNERS = {
    "builtin": _builtin,
    "user_step": _user_step,
    "pure_step": _pure_step,
    "fit_resume": _fit_resume,
    "population": _population,
    "hypernetwork": _hypernetwork,
}


def assert_same_bits(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


# -- the fast lane: scan_train with the built-in step and a user's step -----------------------


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("path", "name"),
    [("builtin", name) for name in OTHERS]
    + [("user_step", "tree")]
    + [pytest.param("user_step", name, marks=SLOW) for name in ("graph_hijax", "tree_hijax")],
)
def test_scan_train_gives_graph_modes_bits(path, name):
    assert_same_bits(run(path, name), run(path, "graph"))


@pytest.mark.parametrize("name", [pytest.param("graph", marks=SLOW), "tree"])
def test_the_user_step_equals_flaxs_own_loop_of_it(name):
    with variant(name):
        model = BNDropout(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
        step = nnx.jit(tree_step)
        for i in range(len(STACKED["x"])):
            step(model, optimizer, jax.tree.map(lambda v, i=i: v[i], STACKED))
        flax_loop = [*arrays(model), *arrays(optimizer)]
    ours = run("user_step", name)[:-1]  # less the losses
    for x, y in zip(ours, flax_loop, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    assert int(optimizer.step[...]) == 6


def test_model_and_optimizer_in_tree_mode(compile_count):
    """The built-in step takes it (bits of graph mode's nnx.Optimizer run); a stateful step
    that takes the model AND the optimizer holding it can't run in tree mode (objects there
    share no Variables): a TypeError says what to pass, before anything compiles."""
    with variant("tree"):
        model = BNDropout(rngs=nnx.Rngs(0))
        optimizer = nnx.ModelAndOptimizer(model, TX)
        losses = scan_train(model, optimizer, xent, STACKED)
        got = [*arrays(model), *arrays(nnx.state(optimizer, nnx.optimizer.OptState)),
               np.asarray(losses)]  # fmt: skip
        assert_same_bits(got, run("builtin", "graph"))

        model = BNDropout(rngs=nnx.Rngs(0))
        optimizer = nnx.ModelAndOptimizer(model, TX)
        before, compiled = arrays(model), compile_count()
        for call in (
            lambda: scan_train(model, optimizer, batches=STACKED, train_step=tree_step),
            lambda: Trainer(model, optimizer, train_step=tree_step),
        ):
            with pytest.raises(TypeError, match=r"tree mode.*nnx\.Optimizer\(model, tx"):
                call()
        assert compile_count() == compiled
        assert_same_bits(arrays(model), before)


# -- the slow lane: fit, checkpoints, populations, hypernetworks, shardings -------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHERS)
@pytest.mark.parametrize("path", ["pure_step", "fit_resume", "population", "hypernetwork"])
def test_the_core_paths_give_graph_modes_bits(path, name, tmp_path):
    assert_same_bits(run(path, name, tmp_path), run(path, "graph", tmp_path))


@pytest.mark.slow
def test_a_resumed_fit_is_the_straight_fit_in_tree_mode_with_hijax():
    with variant("tree_hijax"):
        model = BNDropout(rngs=nnx.Rngs(0))
        trainer = Trainer(model, nnx.Optimizer(model, TX, wrt=nnx.Param), xent)
        history = trainer.fit(DATA, epochs=4, batch_size=16, progress=False)
        straight = [*arrays(model), *arrays(trainer.optimizer), np.asarray(history.losses)]
    resumed = run("fit_resume", "tree_hijax", None)
    assert_same_bits(resumed[:-1], straight[:-1])
    assert_same_bits(resumed[-1], straight[-1][-len(resumed[-1]) :])  # the resumed epochs


WORKER = str(pathlib.Path(__file__).with_name("tree_mode_worker.py"))


@pytest.mark.slow
def test_sharded_runs_under_nnx_graph_mode_false_give_graph_modes_bits(tmp_path):
    """4 simulated devices, one process per mode (the environment variable sets the mode
    for the whole process): fit with checkpoints and a resume, scan_train with the built-in
    step and the tree-mode step, on a (data, model) mesh; the same bits, every sharding the
    model brought kept."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NNX_GRAPH_MODE")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=str(pathlib.Path(__file__).parent))  # fmt: skip
    outs = {mode: tmp_path / mode for mode in ("true", "false")}
    procs = run_together(
        [["env", f"NNX_GRAPH_MODE={mode}", sys.executable, WORKER, str(out)]
         for mode, out in outs.items()],
        timeout=600, env=env,
    )  # fmt: skip
    for process, _, err in procs:
        assert process.returncode == 0, err[-4000:]
    seen = {mode: json.loads((out / "seen.json").read_text()) for mode, out in outs.items()}
    assert seen["true"]["graph_mode"] is True and seen["false"]["graph_mode"] is False
    for run_name in ("fit_resume", "scan_builtin", "scan_user_step"):
        graph = np.load(outs["true"] / f"{run_name}.npz")
        tree = np.load(outs["false"] / f"{run_name}.npz")
        assert sorted(graph) == sorted(tree)
        for key in graph:
            np.testing.assert_array_equal(tree[key], graph[key], err_msg=f"{run_name} {key}")
        for mode in outs:
            assert seen[mode]["specs"][run_name] == seen[mode]["created"], (mode, run_name)
    assert any("model" in spec for spec in seen["false"]["created"].values())
