"""Two processes on 127.0.0.1 save and restore the checkpoints of a data-parallel run, and
the resumed run ends bitwise where a straight run ends.

Each phase is a fresh pair of processes (``distributed_resume_worker.py``) sharing one
checkpoint directory: ``first`` trains 1 epoch and exits; ``cut`` runs
``fit(epochs=3, resume=True)`` with step checkpoints and is stopped mid-epoch (the newest
checkpoint is then in the middle of epoch 1); ``resume`` reruns the same ``fit`` to the
end. The reference is a pair that trains the 3 epochs straight, without checkpoints.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import distributed_resume_worker as worker
import numpy as np
import pytest

WORKER = str(pathlib.Path(__file__).with_name("distributed_resume_worker.py"))
STEPS_PER_EPOCH = worker.EXAMPLES // worker.BATCH


def env(devices: int = 1) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device each
    flags = (
        {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"} if devices > 1 else {}
    )
    return {**clean, "JAX_PLATFORMS": "cpu", **flags}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(
    tmp: pathlib.Path, model: str, phase: str, pids: tuple = (0, 1)
) -> list[dict[str, np.ndarray]]:
    """Runs ``phase`` in two processes (``pids=("solo",)``: one process with all the
    devices); returns what each holds at the end."""
    tmp.mkdir(exist_ok=True)
    port = str(free_port())
    outs = [tmp / f"{phase}.p{pid}.npz" for pid in pids]
    command, run = [sys.executable, WORKER], [model, phase, str(tmp / "checkpoints")]
    devices = (8 // len(pids)) if model == "tp" else 1
    procs = [
        subprocess.Popen(
            [*command, str(pid), port, *run, str(out), str(tmp / "jax-cache" / f"p{pid}")],
            env={**env(devices), "PYTHONPATH": str(pathlib.Path(__file__).parent)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid, out in zip(pids, outs, strict=True)
    ]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for pid, (p, (out, err)) in zip(pids, zip(procs, results, strict=True), strict=True):
        assert p.returncode == 0 and "done" in out, f"{phase}, process {pid}:\n{err[-3000:]}"
    arrays = []
    for out in outs:
        with np.load(out) as z:
            arrays.append({k: z[k] for k in z.files})
    return arrays


def checkpoint_steps(directory: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.mark.parametrize("model", ["bn", "bn_dropout", "tp"])
def test_two_processes_resume_a_data_parallel_run_bitwise(tmp_path, model):
    """``tp``: tensor parallel over a mesh spanning both processes (4 devices each)."""
    straight = run_pair(tmp_path / "straight", model, "straight")
    run = tmp_path / "run"
    first = run_pair(run, model, "first")
    assert int(first[0]["step"]) == worker.FIRST_EPOCHS * STEPS_PER_EPOCH
    cut = run_pair(run, model, "cut")
    assert int(cut[0]["step"]) >= worker.CUT_STEP
    # The newest checkpoint is mid-epoch (saved at the cut's call, before its hooks ran):
    # the resume finishes a partly trained epoch on both processes.
    newest = checkpoint_steps(run / "checkpoints")[-1]
    assert newest % STEPS_PER_EPOCH and newest <= int(cut[0]["step"]), newest
    resumed = run_pair(run, model, "resume")

    total = worker.EPOCHS * STEPS_PER_EPOCH
    for got in (*straight, *resumed):
        assert (int(got["step"]), int(got["epoch"])) == (total, worker.EPOCHS)
        np.testing.assert_array_equal(got["history_epochs"], np.arange(worker.EPOCHS))
    reference = straight[0]
    for pid, got in enumerate(resumed):
        assert sorted(got) == sorted(reference)
        for name, value in reference.items():
            if name == "history_losses":  # reductions fused differently: to the last bits
                np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)
            else:
                np.testing.assert_array_equal(got[name], value, err_msg=f"process {pid}: {name}")


def test_a_tensor_parallel_fit_over_two_processes_equals_one_process_with_all_8(tmp_path):
    """The guide's model on a 2 x 4 mesh: 2 processes x 4 devices (gloo between them) end
    where one process with the 8 devices ends (the collectives may sum in another order)."""
    two = run_pair(tmp_path / "two", "tp", "straight")
    (one,) = run_pair(tmp_path / "one", "tp", "straight", pids=("solo",))
    for got in two:
        assert sorted(got) == sorted(one)
        for name, value in one.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
