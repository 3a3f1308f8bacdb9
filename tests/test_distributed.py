"""Scaling out: 4 simulated CPU devices in a subprocess, and two processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnxscan.shell import Trainer
from nnxscan.shell._engine.placement import fsdp_spec

from conftest import run_together

WORKER = str(pathlib.Path(__file__).with_name("distributed_worker.py"))


def env(**extra):
    clean = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    tests = str(pathlib.Path(__file__).parent)  # the worker imports conftest's metrics
    path = os.pathsep.join(p for p in (tests, clean.get("PYTHONPATH")) if p)
    return {**clean, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path, **extra}


@pytest.fixture(scope="module")
def mesh4(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mesh4") / "out.npz")
    run = subprocess.run(
        [sys.executable, WORKER, "mesh4", out],
        env=env(XLA_FLAGS="--xla_force_host_platform_device_count=4"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    with np.load(out) as z:
        arrays = {k: z[k] for k in z.files}
    with open(out + ".json") as f:
        return arrays, json.load(f)


def _run(arrays, name):
    keys = sorted(
        (k for k in arrays if k.startswith(name + "_")), key=lambda k: int(k.split("_")[-1])
    )
    return [arrays[k] for k in keys]


@pytest.mark.slow  # mesh4: a 4-device subprocess (~30 s), the slow lane's
@pytest.mark.parametrize("name", ["dp", "fsdp"])
def test_sharded_fit_equals_single_device_fit(mesh4, name):
    arrays, _ = mesh4
    for a, b in zip(_run(arrays, "single"), _run(arrays, name), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # mesh4: a 4-device subprocess (~30 s), the slow lane's
def test_checkpoints_and_evaluate_on_a_mesh(mesh4):
    arrays, info = mesh4
    for a, b in zip(_run(arrays, "straight"), _run(arrays, "resumed"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert info["restored_spec"] == str(P(None, "data"))  # restored into the FSDP layout
    evaluations = info["evaluations"]
    assert evaluations["straight"]["accuracy"] == pytest.approx(evaluations["resumed"]["accuracy"])
    assert 0.0 <= evaluations["before"]["accuracy"] <= 1.0


@pytest.mark.slow  # mesh4: a 4-device subprocess (~30 s), the slow lane's
def test_the_pure_epoch_takes_the_same_sharding_hint(mesh4):
    arrays, _ = mesh4
    for a, b in zip(_run(arrays, "pure_plain"), _run(arrays, "pure_sharded"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # mesh4: a 4-device subprocess (~30 s), the slow lane's
def test_the_state_is_placed_as_asked(mesh4):
    _, info = mesh4
    assert set(info["shardings"]["dp"].values()) == {str(P())}  # replicated
    fsdp = info["shardings"]["fsdp"]
    assert fsdp["['l1']['kernel'].value"] == str(P(None, "data"))  # (8, 64): the 64 is split
    assert fsdp["['l2']['kernel'].value"] == str(P("data"))  # (64, 3)
    assert fsdp["['l1']['bias'].value"] == str(P())  # 64 elements < fsdp_min_size


@pytest.mark.slow  # mesh4: a 4-device subprocess (~30 s), the slow lane's
def test_a_batch_that_does_not_divide_over_the_devices_is_a_clear_error(mesh4):
    _, info = mesh4
    assert "batch size 6 does not divide by the 4 devices" in info["error"]


def test_fsdp_rule():
    assert fsdp_spec((784, 512), 4, "data", 1000) == P("data", None)
    assert fsdp_spec((10, 6), 4, "data", 10) == P()  # nothing divides: replicated
    assert fsdp_spec((3,), 4, "data", 1) == P()
    assert fsdp_spec((8, 8), 4, "data", 1) == P("data", None)  # a tie: the first
    assert fsdp_spec((512, 784), 4, "data", 10**6) == P()  # under the threshold


def test_mesh_arguments_are_checked():
    import jax
    import optax
    from jax.sharding import Mesh

    from conftest import MLP, make_data, xent

    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    with pytest.raises(ValueError, match="data_axis 'data' is not an axis of the mesh"):
        Trainer(MLP(rngs=nnx.Rngs(0)), optax.adam(1e-2), xent, mesh=mesh, data_axis="data")
    # No mesh given and none in context when fit runs: FSDP has nothing to shard over.
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), optax.adam(1e-2), xent, fsdp_min_size=10)
    with pytest.raises(ValueError, match=r"pass mesh=, or call inside jax.set_mesh"):
        trainer.fit(make_data(), epochs=1, batch_size=8, progress=False)
    assert trainer.step == 0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_each_with_half_of_every_batch_equal_one(tmp_path):
    port = str(free_port())
    outs = [str(tmp_path / f"p{i}.npz") for i in range(2)]
    commands = [[sys.executable, WORKER, "process", str(i), port, outs[i]] for i in range(2)]
    for p, _, err in run_together(commands, timeout=240, env=env()):
        assert p.returncode == 0, err[-3000:]

    sys.path.insert(0, str(pathlib.Path(WORKER).parent))
    import distributed_worker as worker

    model, tx, loss = worker.build()
    d = worker.data()
    batches = [{k: v[i : i + 8] for k, v in d.items()} for i in range(0, 64, 8)]
    history = Trainer(model, tx, loss).fit(batches, epochs=2, progress=False)
    reference = [*worker.local_leaves(model), history.losses]
    for out in outs:
        with np.load(out) as z:
            got = [z[f"arr_{i}"] for i in range(len(z.files))]
        for a, b in zip(reference, got, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
