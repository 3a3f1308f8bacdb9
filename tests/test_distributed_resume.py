"""Two processes on 127.0.0.1 save and restore the checkpoints of a data-parallel run, and
the resumed run ends bitwise where a straight run ends.

Each phase is a fresh pair of processes (``distributed_resume_worker.py``) sharing one
checkpoint directory per model: ``first`` trains 1 epoch and exits; ``cut`` runs
``fit(epochs=3, resume=True)`` with step checkpoints and is stopped mid-epoch (the newest
checkpoint is then in the middle of epoch 1); ``resume`` reruns the same ``fit`` to the
end. The reference is ``straight``: the 3 epochs trained straight, without checkpoints, on
a fresh model in the pair that then runs ``first`` (it restores nothing, so it shares
that pair's start-up). Every phase that restores runs in processes of its own.

A process start (imports, ``jax.distributed``, compiles) costs far more than training these
models, so the two one-device-per-process models share each pair of processes, and the
tensor-parallel model's straight run is also the reference of the one-process comparison.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import socket
import sys

import distributed_resume_worker as worker
import numpy as np
import pytest

from conftest import run_together

# The slow lane (pyproject.toml): pairs of processes. The fast lane's cousins: one process
# with 4 devices saving and restoring on a mesh (test_distributed), in-process resumes.
pytestmark = pytest.mark.slow

WORKER = str(pathlib.Path(__file__).with_name("distributed_resume_worker.py"))
STEPS_PER_EPOCH = worker.EXAMPLES // worker.BATCH
DATA_PARALLEL = ("bn", "bn_dropout")  # one device per process: run in the same processes
PAIR_TIMEOUT_S = 240


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
    root: pathlib.Path, models: tuple[str, ...], phases: str, pids: tuple = (0, 1)
) -> dict[str, dict[str, list[dict[str, np.ndarray]]]]:
    """Runs ``phases`` (``+``-separated) of ``models`` in two processes (``pids=("solo",)``:
    one process with all the devices); returns ``{model: {phase: what each process holds
    at the end}}``."""
    root.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    command = [sys.executable, WORKER]
    run = [",".join(models), phases, str(root)]
    devices = (8 // len(pids)) if models == ("tp",) else 1
    commands = [[*command, str(pid), port, *run, str(root / "jax-cache" / f"p{pid}")]
                for pid in pids]  # fmt: skip
    environment = {**env(devices), "PYTHONPATH": str(pathlib.Path(__file__).parent)}
    results = run_together(commands, timeout=PAIR_TIMEOUT_S, env=environment)
    for pid, (p, out, err) in zip(pids, results, strict=True):
        assert p.returncode == 0 and "done" in out, f"{phases}, process {pid}:\n{err[-3000:]}"
    arrays: dict = {}
    for model in models:
        for phase in phases.split("+"):
            for pid in pids:
                with np.load(root / model / f"{phase}.p{pid}.npz") as z:
                    got = {k: z[k] for k in z.files}
                arrays.setdefault(model, {}).setdefault(phase, []).append(got)
    return arrays


def checkpoint_steps(directory: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@dataclasses.dataclass
class Runs:
    """What each process held after each phase, per model, and the newest checkpoint of
    each model's run right after its cut."""

    phases: dict[str, dict[str, list[dict[str, np.ndarray]]]]
    newest_after_cut: dict[str, int]


def run_phases(root: pathlib.Path, models: tuple[str, ...]) -> Runs:
    phases = run_pair(root, models, "straight+first")
    for model, cut in run_pair(root, models, "cut").items():
        phases[model].update(cut)
    newest = {m: checkpoint_steps(root / m / "checkpoints")[-1] for m in models}
    for model, resumed in run_pair(root, models, "resume").items():
        phases[model].update(resumed)
    return Runs(phases, newest)


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory) -> Runs:
    return run_phases(tmp_path_factory.mktemp("data_parallel"), DATA_PARALLEL)


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory) -> Runs:
    return run_phases(tmp_path_factory.mktemp("tensor_parallel"), ("tp",))


@pytest.mark.parametrize("model", ["bn", "bn_dropout", "tp"])
def test_two_processes_resume_a_data_parallel_run_bitwise(request, model):
    """``tp``: tensor parallel over a mesh spanning both processes (4 devices each)."""
    runs = request.getfixturevalue("tensor_parallel" if model == "tp" else "data_parallel")
    phases = runs.phases[model]
    straight, first, cut, resumed = (phases[p] for p in ("straight", "first", "cut", "resume"))
    assert int(first[0]["step"]) == worker.FIRST_EPOCHS * STEPS_PER_EPOCH
    assert int(cut[0]["step"]) >= worker.CUT_STEP
    # The newest checkpoint is mid-epoch (saved at the cut's call, before its hooks ran):
    # the resume finishes a partly trained epoch on both processes.
    newest = runs.newest_after_cut[model]
    assert newest % STEPS_PER_EPOCH and newest <= int(cut[0]["step"]), newest

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


def test_a_tensor_parallel_fit_over_two_processes_equals_one_process_with_all_8(
    tensor_parallel, tmp_path
):
    """The guide's model on a 2 x 4 mesh: 2 processes x 4 devices (gloo between them) end
    where one process with the 8 devices ends (the collectives may sum in another order)."""
    two = tensor_parallel.phases["tp"]["straight"]
    (one,) = run_pair(tmp_path, ("tp",), "straight", pids=("solo",))["tp"]["straight"]
    for got in two:
        assert sorted(got) == sorted(one)
        for name, value in one.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
