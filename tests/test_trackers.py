"""MLflowWriter and WandbWriter, read back with each library's own reader.

MLflow: a real SQLite tracking store in a temporary folder, read with
``mlflow.tracking.MlflowClient``. W&B: offline runs (no network, no login) under a temporary
``WANDB_DIR``, read with wandb's own reader of its run files (``wandb leet inspect``: every
record of the ``.wandb`` log, and the run's state, config and summary). What they must hold
is taken from the run itself: the History ``fit`` returned.
"""

from __future__ import annotations

import ipaddress
import json
import math
import signal
import socket
import subprocess
import sys
import types

import numpy as np
import optax
import pytest
import wandb
from flax import nnx
from mlflow.tracking import MlflowClient

from nnxscan.adapters.writers import MLflowWriter, WandbWriter
from nnxscan.shell import LambdaCallback, Population, Trainer

from conftest import MLP, make_data, xent

BS = 8  # 64 examples: 8 steps an epoch

# mlflow's SQLite store, through SQLAlchemy 2.1, warns about its own code.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


def eval_xent(model, batch):
    return xent(model, batch)


def _split():
    full = make_data(96)
    return ({k: v[a:b] for k, v in full.items()} for a, b in ((0, 64), (64, 96)))


def _injected(rate=1e-2):
    return optax.inject_hyperparams(optax.adam)(learning_rate=rate)


def _expected_metrics(history, num_members=None) -> dict[str, list[tuple[int, float]]]:
    """What a writer must have logged: every number of every epoch's logs at the epoch's
    global end step, per member as ``key/i``."""
    want: dict[str, list[tuple[int, float]]] = {}
    step = 0
    for logs in history.epochs:
        step += logs["steps"]
        for key, value in logs.items():
            values = {key: value}
            if num_members is not None and np.shape(value) == (num_members,):
                values = {f"{key}/{i}": v for i, v in enumerate(np.asarray(value).tolist())}
            for name, v in values.items():
                if isinstance(v, int | float | np.number) and not isinstance(v, bool | np.bool_):
                    want.setdefault(name, []).append((step, float(v)))
    return want


def _same_series(got, want) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


# -- MLflow ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory):
    # One SQLite store for the module: creating its tables takes seconds. Each test uses an
    # experiment of its own.
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


@pytest.fixture(scope="module")
def tracking_uri(mlflow_db):
    return f"sqlite:///{mlflow_db}"  # sqlite:////tmp/...: an absolute path


def _mlflow_metrics(client, run_id) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        for key in run.data.metrics
    }


@pytest.mark.slow
def test_mlflow_records_a_fit_and_a_second_fit_continues_the_run(tracking_uri):
    data, test = _split()
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), _injected(), xent)
    params = {"batch_size": BS, "optimizer": "adam"}
    writer = MLflowWriter(
        tracking_uri, experiment="trainer", run_name="mlp", params=params, tags={"who": "test"}
    )
    options = dict(batch_size=BS, eval_data=test, metric_fn=eval_xent, eval_every=2,
                   callbacks=[writer], progress=False)  # fmt: skip
    first = trainer.fit(data, epochs=3, **options)
    client = MlflowClient(tracking_uri)
    run = client.get_run(writer.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "mlp"
    assert run.data.params == {"batch_size": "8", "optimizer": "adam"}
    assert run.data.tags["who"] == "test"
    assert client.get_experiment(run.info.experiment_id).name == "trainer"
    want = _expected_metrics(first)
    got = _mlflow_metrics(client, writer.run_id)
    assert set(got) == set(want)
    assert {"loss", "eval_eval_xent", "learning_rate", "steps_per_sec"} <= set(got)
    for key in want:
        _same_series(got[key], want[key])
    assert [s for s, _ in got["eval_eval_xent"]] == [16]  # eval every 2nd epoch

    run_id = writer.run_id
    second = trainer.fit(data, epochs=2, **options)
    assert writer.run_id == run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    got = _mlflow_metrics(client, run_id)["loss"]
    both = _expected_metrics(first)["loss"] + [
        (24 + s, v) for s, v in _expected_metrics(second)["loss"]
    ]
    _same_series(got, both)


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
@pytest.mark.parametrize(
    "raised, status", [(RuntimeError, "FAILED"), (KeyboardInterrupt, "KILLED")]
)
def test_mlflow_run_fails_when_fit_raises(tracking_uri, raised, status):
    data, _ = _split()
    writer = MLflowWriter(tracking_uri, experiment=f"failing-{status}")

    def fail_at_epoch_1(trainer, epoch, logs):
        if epoch == 1:
            raise raised("boom")

    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), optax.adam(1e-2), xent)
    with pytest.raises(raised) as caught:
        trainer.fit(data, epochs=3, batch_size=BS, progress=False, callbacks=[
            writer, LambdaCallback(on_epoch_end=fail_at_epoch_1)])  # fmt: skip
    client = MlflowClient(tracking_uri)
    assert client.get_run(writer.run_id).info.status == status
    want = _expected_metrics(caught.value.history)["loss"]
    _same_series(_mlflow_metrics(client, writer.run_id)["loss"], want)
    assert [s for s, _ in want] == [8, 16]  # both epochs logged before the hook raised


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_mlflow_population_logs_each_member_and_its_hyperparameters(tracking_uri):
    data, test = _split()
    rates = [3e-2, 1e-2, 3e-3]
    pop = Population(lambda rngs: MLP(rngs=rngs), _injected(), xent, seeds=[4, 5, 6],
                     hyperparams={"learning_rate": rates})  # fmt: skip
    writer = MLflowWriter(tracking_uri, experiment="population", params={"sweep": "lr"})
    history = pop.fit(data, epochs=2, batch_size=BS, eval_data=test, metric_fn=eval_xent,
                      callbacks=[writer], progress=False)  # fmt: skip
    client = MlflowClient(tracking_uri)
    run = client.get_run(writer.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {
        "sweep": "lr", "num_members": "3", "seed/0": "4", "seed/1": "5", "seed/2": "6",
        "learning_rate/0": "0.03", "learning_rate/1": "0.01", "learning_rate/2": "0.003",
    }  # fmt: skip
    want = _expected_metrics(history, num_members=3)
    got = _mlflow_metrics(client, writer.run_id)
    assert set(got) == set(want)
    assert {"loss/0", "loss/2", "eval_eval_xent/1", "learning_rate/2"} <= set(got)
    assert "loss" not in got and "active/0" not in got  # per member only; flags are no metric
    for key in want:
        _same_series(got[key], want[key])
    np.testing.assert_allclose([v for _, v in got["learning_rate/2"]], [3e-3, 3e-3], rtol=1e-6)


@pytest.mark.slow_on_accelerator("mlflow's SQL store set up on the host: 5 s")
def test_mlflow_scripted_logs_keep_nan_and_skip_what_is_no_number(mlflow_db, tracking_uri):
    writer = MLflowWriter(mlflow_db, experiment="scripted")  # a Path: that SQLite file
    assert writer.tracking_uri == tracking_uri
    trainer = types.SimpleNamespace(step=0)
    script = [{"epoch": 0, "loss": 1.5, "note": "text", "flag": True},
              {"epoch": 1, "loss": float("nan"), "eval_acc": np.float32(0.25)}]  # fmt: skip
    for logs in script:  # as the other writers' tests drive them: no on_train_begin
        trainer.step += 10
        writer.on_epoch_end(trainer, logs["epoch"], logs)
    writer.on_train_end(trainer, None)
    client = MlflowClient(tracking_uri)
    got = _mlflow_metrics(client, writer.run_id)
    assert set(got) == {"epoch", "loss", "eval_acc"}
    assert got["loss"][0] == (10, 1.5) and got["loss"][1][0] == 20
    assert math.isnan(got["loss"][1][1]) and got["eval_acc"] == [(20, 0.25)]
    assert client.get_run(writer.run_id).info.status == "FINISHED"
    writer.close()  # after the end: nothing is left to close
    assert client.get_run(writer.run_id).info.status == "FINISHED"


def test_mlflow_without_mlflow_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(ImportError, match=r"pip install 'nnxscan\[mlflow\]'"):
        MLflowWriter("sqlite:///never.db")


# -- W&B, offline ----------------------------------------------------------------------------------

WANDB_TIMEOUT_S = 120


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """Offline W&B in ``tmp_path``: no network (a Python socket that reaches past the
    loopback raises), nothing under ``~``, and a deadline: a test that would hang fails.

    wandb reads its environment once per process, when its first run starts (an earlier
    test, the docs, may have started one): ``wandb.teardown()`` before and after makes the
    next run read this environment again, and stops wandb's service.
    """
    for name, value in {
        "WANDB_MODE": "offline", "WANDB_DIR": tmp_path, "WANDB_CONFIG_DIR": tmp_path / "config",
        "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data",
        "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true", "WANDB_ERROR_REPORTING": "false",
        "WANDB_X_DISABLE_STATS": "true", "WANDB_INIT_TIMEOUT": "60",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    connect = socket.socket.connect

    def local_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
                raise AssertionError(f"a test tried the network: {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)

    def too_long(signum, frame):
        raise TimeoutError(f"a W&B test ran past {WANDB_TIMEOUT_S} s")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(WANDB_TIMEOUT_S)
    wandb.teardown()
    try:
        yield tmp_path
    finally:
        wandb.teardown()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _inspect(run_dir, *flags) -> str:
    """wandb's own reader of a run's ``.wandb`` log."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", str(run_dir), "--json", *flags],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def _wandb_run(run_dir) -> tuple[dict, dict[str, list[tuple[int, float]]]]:
    """(state/config/summary of the run, {key: [(step, value)]} of its history)."""
    summary = json.loads(_inspect(run_dir, "--summary"))
    series: dict[str, list[tuple[int, float]]] = {}
    for line in _inspect(run_dir).splitlines():
        record = json.loads(line)
        if record["type"] != "history":
            continue
        item = record["history"]["item"]
        for key, value in item.items():
            if not key.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                series.setdefault(key, []).append((item["_step"], float(value)))
    return summary, series


@pytest.mark.slow
def test_wandb_offline_run_holds_history_config_and_summary(wandb_offline):
    data, test = _split()
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), _injected(), xent)
    writer = WandbWriter("nnxscan-tests", name="mlp", config={"batch_size": BS})
    history = trainer.fit(data, epochs=3, batch_size=BS, eval_data=test, metric_fn=eval_xent,
                          eval_every=2, callbacks=[writer], progress=False)  # fmt: skip
    assert writer.run_dir.startswith(str(wandb_offline / "wandb" / "offline-run-"))
    summary, series = _wandb_run(writer.run_dir)
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    assert summary["run_id"] == writer.run_id and summary["name"] == "mlp"
    assert summary["project"] == "nnxscan-tests"
    assert summary["config"] == {"batch_size": BS}
    want = _expected_metrics(history)
    assert set(series) == set(want)
    for key in want:
        _same_series(series[key], want[key])
        assert summary["summary"][key] == pytest.approx(want[key][-1][1], rel=1e-6)


@pytest.mark.slow
def test_wandb_run_fails_when_fit_raises_and_a_population_logs_each_member(wandb_offline):
    data, _ = _split()
    pop = Population(lambda rngs: MLP(rngs=rngs), _injected(), xent, seeds=[0, 1],
                     hyperparams={"learning_rate": [1e-2, 1e-3]})  # fmt: skip
    writer = WandbWriter("nnxscan-tests", mode="offline")

    def fail_at_epoch_1(population, epoch, logs):
        if epoch == 1:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError) as caught:
        pop.fit(data, epochs=3, batch_size=BS, progress=False,
                callbacks=[writer, LambdaCallback(on_epoch_end=fail_at_epoch_1)])  # fmt: skip
    summary, series = _wandb_run(writer.run_dir)
    assert summary["state"] == "failed" and summary["exit_code"] == 1
    assert summary["config"] == {"num_members": 2, "seed/0": 0, "seed/1": 1,
                                 "learning_rate/0": 0.01, "learning_rate/1": 0.001}  # fmt: skip
    want = _expected_metrics(caught.value.history, num_members=2)
    assert set(series) == set(want) and {"loss/0", "loss/1", "learning_rate/1"} <= set(series)
    for key in want:
        _same_series(series[key], want[key])

    # The same writer in the next fit resumes the run id, in a new offline segment.
    first_dir, run_id = writer.run_dir, writer.run_id
    pop.fit(data, epochs=1, batch_size=BS, progress=False, callbacks=[writer])
    assert writer.run_id == run_id and writer.run_dir != first_dir
    summary, series = _wandb_run(writer.run_dir)
    assert summary["state"] == "finished" and summary["run_id"] == run_id
    assert [s for s, _ in series["loss/0"]] == [24]


def test_wandb_without_wandb_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'nnxscan\[wandb\]'"):
        WandbWriter("p")
