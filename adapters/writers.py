"""Metric writers: callbacks that record each epoch's logs to CSV, JSON lines, TensorBoard, text,
MLflow or Weights & Biases (the last two live in :mod:`nnxscan.adapters.trackers`).

Each writer is a ``fit`` callback. It reads only the epoch logs ``fit`` hands it (plain Python
numbers, already on the host) and ``trainer.step``, so none of them adds a device sync.

Example:
  >>> from nnxscan.adapters.writers import CSVWriter, JSONLinesWriter, TextLogger
  >>> trainer.fit(data, epochs=10, batch_size=32,
  ...             callbacks=[CSVWriter("run/logs.csv"), TextLogger("run/log.txt")])
"""

from __future__ import annotations

import csv
import json
import math
import numbers
import os
import pathlib
import sys
import tempfile
from typing import Any, NamedTuple, TextIO

import numpy as np

from nnxscan.adapters._extras import require_extra
from nnxscan.adapters._log_values import MemberLogs, ModelLogs, logs_of, spread
from nnxscan.adapters._log_values import is_number as _is_number
from nnxscan.adapters._log_values import plain as _plain
from nnxscan.adapters._log_values import primary_only as _primary_only
from nnxscan.adapters.trackers import MLflowWriter, WandbWriter

__all__ = [
    "CSVWriter",
    "JSONLinesWriter",
    "MLflowWriter",
    "TensorBoardWriter",
    "TextLogger",
    "WandbWriter",
]

PathLike = str | os.PathLike[str]


class CSVWriter:
    """Writes one CSV row per epoch: a column per log key, in the order keys first appear.

    Keys can appear after the first epoch (``eval_*`` every N epochs, ``skipped_steps``).
    When a row brings a new key the whole file is rewritten with the wider header, atomically
    (a temporary file renamed over the old one), so the file on disk is always a complete,
    rectangular CSV: every row is durable as soon as its epoch ends, and a reader never sees a
    row longer than the header. A key missing from an epoch is an empty cell. Non-finite
    values are written as Python prints them: ``nan``, ``inf``, ``-inf`` (``float()``, numpy
    and pandas all read those back).

    Args:
      path: the CSV file; its folder is created if needed.
      append: keep the rows of an existing file and add to them (its columns are kept).
        By default the first write keeps only an existing file's rows of EARLIER epochs
        than its own (a ``resume=True`` run continues its file: the epochs it restored
        stay, and an epoch the killed run logged past its last checkpoint is written
        again, once) and replaces the rest: a run from epoch 0 replaces the file. Either
        way, further ``fit`` calls with the same writer continue the same file.

    Example:
      >>> trainer.fit(data, epochs=10, batch_size=32, eval_data=test, metric_fn=accuracy,
      ...             eval_every=5, callbacks=[CSVWriter("run/logs.csv")])
      >>> pandas.read_csv("run/logs.csv")  # 10 rows; eval_accuracy filled on 2 of them
    """

    def __init__(self, path: PathLike, *, append: bool = False) -> None:
        self.path = pathlib.Path(path)
        self.append = append
        self._columns: list[str] = []
        self._rows: list[dict[str, str]] = []
        self._started = False

    def _start(self, epoch: int) -> None:
        # Deferred to the first row so that building the callback list touches no files.
        self._started = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if (self.append or epoch > 0) and self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open(newline="") as f:
                reader = csv.DictReader(f)
                self._columns = list(reader.fieldnames or [])
                self._rows = [{k: v or "" for k, v in row.items() if k} for row in reader]
            if not self.append:  # a resumed run: the epochs before its first stay
                self._rows = [row for row in self._rows if _epoch_of(row) < epoch]
                self._columns = self._columns if self._rows else []
                self._rewrite()
        else:
            self._rewrite()

    def _rewrite(self) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", newline="") as f:
                writer = csv.DictWriter(f, self._columns, restval="")
                if self._columns:
                    writer.writeheader()
                writer.writerows(self._rows)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise

    @_primary_only
    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, Any]) -> None:
        if not self._started:
            self._start(epoch)
        row = {key: ("" if v is None else str(_plain(v))) for key, v in spread(logs).items()}
        self._rows.append(row)
        new = [key for key in row if key not in self._columns]
        if new:
            self._columns += new
            self._rewrite()
            return
        # The common case: the header is unchanged, so appending one line is enough. Opened
        # per epoch (not held open) so nothing leaks when fit raises before on_train_end.
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, self._columns, restval="").writerow(row)


def _epoch_of(record: dict) -> float:
    """A written row's (or line's) epoch; one without a readable epoch counts as after
    every epoch (so a resumed run does not keep it)."""
    try:
        return int(record.get("epoch"))
    except (TypeError, ValueError):
        return math.inf


def _json_value(value: Any) -> Any:
    if len(getattr(value, "shape", ())) >= 1:  # per member (or per class): a (nested) list
        return [_json_value(v) for v in value]
    value = _plain(value)
    if isinstance(value, float) and not math.isfinite(value):
        # Strict JSON has no NaN or Infinity; protobuf's JSON mapping spells them as these
        # strings, which keeps NaN distinct from a missing key and float() reads them back.
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _unwritable(values: dict, logs: dict, epoch: int, path: pathlib.Path) -> str:
    """Names the first log JSON cannot hold, its type, and what to log instead."""
    for key, value in values.items():
        try:
            json.dumps({key: value}, allow_nan=False)
        except (TypeError, ValueError):
            return (
                f"JSONLinesWriter({path}): log {key!r} of epoch {epoch} is a "
                f"{type(logs[key]).__name__}, which JSON cannot hold: log numbers, strings "
                f"or arrays of numbers (e.g. str(value) or list(value)), or keep it out of "
                f"the logs."
            )
    return f"JSONLinesWriter({path}): epoch {epoch}'s logs are not JSON"  # pragma: no cover


class JSONLinesWriter:
    """Writes one JSON object per epoch, one per line, holding exactly that epoch's log keys.

    Each line is flushed when its epoch ends. The output is strict JSON: a non-finite float is
    written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (protobuf's JSON
    spelling; ``float(s)`` parses each), so ``jq`` and JavaScript read the file too; a key
    absent from an epoch is simply absent from its line.

    Args:
      path: the ``.jsonl`` file; its folder is created if needed.
      append: add to an existing file. By default the first write keeps only an existing
        file's lines of earlier epochs than its own (a ``resume=True`` run continues its
        file, as :class:`CSVWriter`'s) and replaces the rest. Either way, further ``fit``
        calls with the same writer continue the same file.

    Example:
      >>> trainer.fit(data, epochs=10, batch_size=32, callbacks=[JSONLinesWriter("logs.jsonl")])
      >>> [json.loads(line)["loss"] for line in open("logs.jsonl")]
    """

    def __init__(self, path: PathLike, *, append: bool = False) -> None:
        self.path = pathlib.Path(path)
        self.append = append
        self._started = False

    @_primary_only
    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, Any]) -> None:
        if not self._started:
            self._started = True
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.append:
                kept = []
                if epoch > 0 and self.path.exists():  # a resumed run: earlier epochs stay
                    for line in self.path.read_text().splitlines():
                        try:
                            if _epoch_of(json.loads(line)) < epoch:
                                kept.append(line + "\n")
                        except (ValueError, AttributeError):
                            pass  # a torn or foreign line: not an earlier epoch's
                self.path.write_text("".join(kept))
        values = {key: _json_value(v) for key, v in logs.items()}
        try:
            line = json.dumps(values, allow_nan=False)
        except (TypeError, ValueError):
            raise TypeError(_unwritable(values, logs, epoch, self.path)) from None
        # Opened per epoch so the line is on disk when the epoch ends and no handle leaks
        # when fit raises before on_train_end.
        with self.path.open("a") as f:
            f.write(line + "\n")


class TensorBoardWriter:
    """Writes every numeric epoch log as a TensorBoard scalar ``epoch/<key>`` at ``trainer.step``.

    The x-axis is the global step count at the end of the epoch, so curves from resumed runs
    line up and per-epoch scalars sit beside any per-step ones written elsewhere. The event
    file is flushed each epoch and closed by ``on_train_end`` (or :meth:`close`); a later
    ``fit`` with the same writer opens a new event file in the same ``logdir``. Needs
    tensorboardX: ``pip install 'nnxscan[tensorboard]'``.

    Args:
      logdir: the folder TensorBoard is pointed at (``tensorboard --logdir ...``).

    Example:
      >>> trainer.fit(data, epochs=10, batch_size=32, callbacks=[TensorBoardWriter("runs/a")])
      $ tensorboard --logdir runs
    """

    def __init__(self, logdir: PathLike) -> None:
        # Imported here, not at module level, since tensorboardX is an optional extra; and
        # now, not at the first epoch, so a missing extra fails before anything compiles.
        tensorboard_x = require_extra("tensorboardX", "tensorboard", needed_by="TensorBoardWriter")
        self._summary_writer_cls = tensorboard_x.SummaryWriter
        self.logdir = pathlib.Path(logdir)
        self._writer: Any = None

    @_primary_only
    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, Any]) -> None:
        if self._writer is None:
            self._writer = self._summary_writer_cls(logdir=str(self.logdir))
        for key, value in spread(logs).items():
            value = _plain(value)
            if _is_number(value):
                self._writer.add_scalar(f"epoch/{key}", float(value), global_step=trainer.step)
        self._writer.flush()

    @_primary_only
    def on_train_end(self, trainer: Any, history: Any) -> None:
        self.close()

    def close(self) -> None:
        """Flushes and closes the event file; the next epoch written opens a new one."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# Bookkeeping keys the line shows in its own way (or not at all) rather than as "key value".
_TEXT_SKIP = frozenset({"epoch", "steps", "steps_per_sec", "wall_time"})
_ONE_MODEL = ModelLogs()


class _Counted(NamedTuple):
    """What :func:`logs_of` reads, for ``format_line``'s count of members (None: one model)."""

    num_members: int | None


def _format_value(value: Any, logs: ModelLogs | MemberLogs = _ONE_MODEL) -> str:
    if len(getattr(value, "shape", ())) >= 1:
        values = np.asarray(value)
        if logs.per_member(values) and values.size > 8:
            # One value per member, of many members: their spread, not a wall of numbers.
            low, mid, high = (_format_value(v) for v in np.nanpercentile(values, [0, 50, 100]))
            return f"min {low} median {mid} max {high}"
        flat = values.reshape(-1)
        shown = " ".join(_format_value(v) for v in flat[:8])
        return f"[{shown}{' ...' if flat.size > 8 else ''}]"
    value = _plain(value)
    if isinstance(value, bool) or not _is_number(value):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{value:,}"
    value = float(value)
    # Fixed decimals keep successive lines aligned; tiny or huge values (learning rates,
    # exploding losses) switch to exponent form rather than print as 0.0000.
    if value == 0 or not math.isfinite(value) or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4f}"
    return f"{value:.3e}"


class TextLogger:
    """Writes one human-readable line per epoch to a text stream or file.

    A line reads ``epoch 3  loss 0.1234  eval_accuracy 0.9700  12,345 steps/s``: the epoch,
    then every other log key in order (loss, aux means, ``eval_*``, ``learning_rate``, ...),
    then the speed. It writes to the stream directly and leaves the ``logging`` module
    alone, so the host program's logging setup is untouched; to route lines into
    ``logging`` instead, use a ``LambdaCallback``.

    Args:
      stream: a text stream (default: ``sys.stdout`` as it is at each write, so redirection
        works), or a file path, which is appended to.
      every: write every ``every``-th epoch (epochs whose 1-based count is a multiple of it);
        the last epoch of a ``fit`` is always written, at ``on_train_end``.

    Example:
      >>> trainer.fit(data, epochs=100, batch_size=32, progress=False,
      ...             callbacks=[TextLogger(every=10)])
      epoch 9  loss 0.4210  8,412 steps/s
    """

    def __init__(self, stream: TextIO | PathLike | None = None, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every must be a positive number of epochs, got {every}")
        self.stream = stream
        self.every = every
        self._last_written: int | None = None

    def format_line(self, logs: dict[str, Any], num_members: int | None = None) -> str:
        """The line for one epoch's logs, without a newline (``num_members``: a population's
        logs, shown as each member's value, or their spread for more than 8)."""
        parts = [f"epoch {logs['epoch']}"] if "epoch" in logs else []
        kind = logs_of(_Counted(num_members))
        parts += [f"{k} {_format_value(v, kind)}" for k, v in logs.items() if k not in _TEXT_SKIP]
        if "steps_per_sec" in logs:
            parts.append(f"{float(logs['steps_per_sec']):,.0f} steps/s")
        return "  ".join(parts)

    def _write(self, line: str) -> None:
        if self.stream is None or hasattr(self.stream, "write"):
            stream = sys.stdout if self.stream is None else self.stream
            stream.write(line + "\n")
            stream.flush()
        else:
            path = pathlib.Path(self.stream)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(line + "\n")

    @_primary_only
    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, Any]) -> None:
        if (epoch + 1) % self.every == 0:
            self._write(self.format_line(logs, logs_of(trainer).num_members))
            self._last_written = epoch

    @_primary_only
    def on_train_end(self, trainer: Any, history: Any) -> None:
        epochs = getattr(history, "epochs", None)
        if epochs and epochs[-1].get("epoch") != self._last_written:
            self._write(self.format_line(epochs[-1], logs_of(trainer).num_members))
            self._last_written = epochs[-1].get("epoch")
