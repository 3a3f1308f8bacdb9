"""Experiment trackers as metric writers: MLflow and Weights & Biases.

Both are ``fit`` callbacks with the other writers' interface (see
:mod:`nnxscan.adapters.writers`, which re-exports them): every numeric epoch log (the loss,
``eval_*`` metrics, ``learning_rate``, steps/s, ...) is logged at ``trainer.step``, the global
step count at the epoch's end; a ``Population``'s per-member values (it declares
``num_members``) as one series per member, ``key/i``; the run's hyperparameters (yours, and a
population's seeds and per-member hyperparameters) once per ``fit``. The run is ended on
every way out of ``fit``: ``on_train_end`` marks it finished, and ``close()``, which ``fit``
calls when an exception escapes, marks it failed. One writer is one run: a later ``fit``
with the same writer re-opens it and goes on at the global step.

Each library is an optional extra, imported when the writer is built (so a missing one
fails before anything compiles): ``pip install 'nnxscan[mlflow]'``, ``'nnxscan[wandb]'``.
Only process 0 of a multi-process run logs.

Example:
  >>> from nnxscan.adapters.writers import MLflowWriter
  >>> trainer.fit(data, epochs=10, batch_size=32,
  ...             callbacks=[MLflowWriter(pathlib.Path("mlflow.db"), params={"lr": 1e-3})])
"""

from __future__ import annotations

import os
import pathlib
import sys
import time
from collections.abc import Mapping
from typing import Any

from nnxscan.adapters._extras import require_extra
from nnxscan.adapters._log_values import logs_of, numeric_logs, primary_only, run_params

__all__ = ["MLflowWriter", "WandbWriter"]

# What one MLflow log_batch call may carry.
_MLFLOW_MAX_METRICS, _MLFLOW_MAX_PARAMS = 1000, 100


def _interrupted() -> bool:
    """Whether the exception being handled (``close()`` runs inside fit's handler) is a
    Ctrl-C rather than an error."""
    return isinstance(sys.exc_info()[1], KeyboardInterrupt)


class MLflowWriter:
    """Logs each epoch to an MLflow run: metrics at ``trainer.step``, params, run status.

    Talks to the tracking store through ``mlflow.tracking.MlflowClient``, never through
    MLflow's global "active run", so the host program's own MLflow runs are left alone.
    The run is created at the first ``fit`` (in ``experiment``, made if missing) and set
    ``FINISHED`` when ``fit`` ends, ``FAILED`` when it raises (``KILLED`` on Ctrl-C); a
    later ``fit`` with the same writer sets it ``RUNNING`` again and logs on. Params are
    written as strings, as MLflow stores them. Needs mlflow: ``pip install
    'nnxscan[mlflow]'``.

    Args:
      tracking_uri: where runs are stored: a tracking URI as MLflow takes it (a str, e.g.
        ``"sqlite:///mlflow.db"`` or a tracking server's URL), or a ``pathlib.Path`` to a
        SQLite database file (created if missing, with its folder); default: MLflow's
        own (``MLFLOW_TRACKING_URI``, else its default).
      experiment: the experiment's name; default ``MLFLOW_EXPERIMENT_NAME``, else
        ``"Default"``.
      run_name: the run's name (MLflow makes one up by default).
      run_id: log into this existing run instead of creating one (e.g. to continue a run
        after ``fit(..., resume=True)`` in a new process).
      params: hyperparameters of the run to record, ``{name: value}``.
      tags: tags of a created run, ``{name: str}``.

    Attributes:
      tracking_uri: the URI the runs go to (a path given is turned into ``sqlite:///...``).
      run_id: the run's id, once the first ``fit`` began (read it back with
        ``MlflowClient(writer.tracking_uri).get_run(writer.run_id)``).

    Example:
      >>> writer = MLflowWriter(pathlib.Path("runs/mlflow.db"), experiment="digits",
      ...                       params={"learning_rate": 1e-3, "batch_size": 32})
      >>> trainer.fit(data, epochs=10, batch_size=32, callbacks=[writer])
      >>> MlflowClient(writer.tracking_uri).get_metric_history(writer.run_id, "loss")
    """

    def __init__(
        self,
        tracking_uri: str | os.PathLike[str] | None = None,
        *,
        experiment: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        # Imported now, not at the first epoch: a missing extra fails before anything
        # compiles.
        tracking = require_extra("mlflow.tracking", "mlflow", needed_by="MLflowWriter")
        self._entities = require_extra("mlflow.entities", "mlflow", needed_by="MLflowWriter")
        self._client_cls = tracking.MlflowClient
        if isinstance(tracking_uri, os.PathLike):  # a SQLite file: MLflow's local store
            database = pathlib.Path(tracking_uri).expanduser().resolve()
            database.parent.mkdir(parents=True, exist_ok=True)
            tracking_uri = "sqlite:///" + database.as_posix()  # four slashes: absolute
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id = run_id
        self.params = dict(params or {})
        self.tags = {k: str(v) for k, v in (tags or {}).items()}
        self._client: Any = None
        self._open = False

    def _experiment_id(self) -> str:
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        found = self._client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self._client.create_experiment(name)

    def _start(self, trainer: Any) -> None:
        if self._client is None:
            self._client = self._client_cls(tracking_uri=self.tracking_uri)
        if self.run_id is None:
            run = self._client.create_run(
                self._experiment_id(), run_name=self.run_name, tags=self.tags
            )
            self.run_id = run.info.run_id
        else:
            self._client.update_run(self.run_id, status="RUNNING")
        self._open = True
        Param = self._entities.Param
        params = [Param(k, str(v)) for k, v in run_params(trainer, self.params).items()]
        for i in range(0, len(params), _MLFLOW_MAX_PARAMS):
            self._client.log_batch(self.run_id, params=params[i : i + _MLFLOW_MAX_PARAMS])

    def _end(self, status: str) -> None:
        if self._open:
            self._open = False
            self._client.set_terminated(self.run_id, status=status)

    @primary_only
    def on_train_begin(self, trainer: Any) -> None:
        self._start(trainer)

    @primary_only
    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, Any]) -> None:
        if not self._open:  # driven without on_train_begin
            self._start(trainer)
        now = int(time.time() * 1000)
        Metric = self._entities.Metric
        values = numeric_logs(logs, logs_of(trainer).num_members)
        metrics = [Metric(k, v, now, int(trainer.step)) for k, v in values.items()]
        for i in range(0, len(metrics), _MLFLOW_MAX_METRICS):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + _MLFLOW_MAX_METRICS])

    @primary_only
    def on_train_end(self, trainer: Any, history: Any) -> None:
        self._end("FINISHED")

    @primary_only
    def close(self) -> None:
        """Ends a run still open as ``FAILED`` (``KILLED`` while a Ctrl-C is handled):
        ``fit`` calls it when an exception escapes."""
        self._end("KILLED" if _interrupted() else "FAILED")


class WandbWriter:
    """Logs each epoch to a Weights & Biases run: ``run.log(..., step=trainer.step)``.

    The run is started by ``wandb.init`` at the first ``fit`` (``reinit="create_new"``, so
    a run the host program has open is left alone) with the run's hyperparameters as its
    config, and finished when ``fit`` ends (exit code 0), or when it raises (exit code 1:
    the run shows as failed). A later ``fit`` with the same writer resumes the same run id.
    Works offline (``mode="offline"``, or ``WANDB_MODE=offline``): the run is written
    under ``dir`` and ``wandb sync`` uploads it later. Needs wandb: ``pip install
    'nnxscan[wandb]'``.

    Args:
      project: the W&B project (default: wandb's, from ``WANDB_PROJECT``).
      name: the run's display name.
      config: hyperparameters of the run, ``{name: value}``, merged into the run's config.
      dir: the folder under which wandb writes ``wandb/`` (default: ``WANDB_DIR``, else
        the working directory).
      mode: ``"online"``, ``"offline"`` or ``"disabled"`` (default: wandb's,
        ``WANDB_MODE``).
      run_id: resume this run id instead of starting a new run.
      **init_kwargs: anything else ``wandb.init`` takes (``entity``, ``group``, ``tags``,
        ``settings``, ...).

    Attributes:
      run_id: the run's id, once the first ``fit`` began.
      run_dir: the folder of the newest run segment wandb wrote (offline: the one to
        ``wandb sync``).

    Example:
      >>> writer = WandbWriter("digits", mode="offline", config={"learning_rate": 1e-3})
      >>> trainer.fit(data, epochs=10, batch_size=32, callbacks=[writer])
      $ wandb sync wandb/offline-run-*
    """

    def __init__(
        self,
        project: str | None = None,
        *,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        dir: str | os.PathLike[str] | None = None,  # wandb.init calls it dir
        mode: str | None = None,
        run_id: str | None = None,
        **init_kwargs: Any,
    ) -> None:
        self._wandb = require_extra("wandb", "wandb", needed_by="WandbWriter")
        self.project, self.name, self.mode = project, name, mode
        self.config = dict(config or {})
        self.dir = None if dir is None else os.fspath(dir)
        self.run_id = run_id
        self.run_dir: str | None = None
        self.init_kwargs = init_kwargs
        self._run: Any = None

    def _start(self, trainer: Any) -> None:
        options = dict(project=self.project, name=self.name, dir=self.dir, mode=self.mode)
        options = {k: v for k, v in options.items() if v is not None}
        if self.run_id is not None:
            options.update(id=self.run_id, resume="allow")
        config = run_params(trainer, self.config)
        self._run = self._wandb.init(
            config=config, reinit="create_new", **options, **self.init_kwargs
        )
        self.run_id = self._run.id
        self.run_dir = os.path.dirname(self._run.dir)  # run.dir is its files/ folder

    def _end(self, exit_code: int) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.finish(exit_code=exit_code)

    @primary_only
    def on_train_begin(self, trainer: Any) -> None:
        self._start(trainer)

    @primary_only
    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, Any]) -> None:
        if self._run is None:  # driven without on_train_begin
            self._start(trainer)
        values = numeric_logs(logs, logs_of(trainer).num_members)
        self._run.log(values, step=int(trainer.step))

    @primary_only
    def on_train_end(self, trainer: Any, history: Any) -> None:
        self._end(0)

    @primary_only
    def close(self) -> None:
        """Finishes a run still open with exit code 1 (failed): ``fit`` calls it when an
        exception escapes."""
        self._end(1)
