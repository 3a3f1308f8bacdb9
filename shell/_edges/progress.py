"""Progress for a whole ``fit``: one bar, advanced per compiled call, never forcing a sync.

In a terminal, a rich bar counts the calls the fit's schedule plans and shows the epoch,
the latest loss, the step's scalar logs (aux leaves that are a scalar per step, e.g. a PPO
step's ``episode_return``, averaged over the call), steps/s, the last epoch's eval metrics
and the ETA, fitted to the terminal's width in that order of priority. What it shows comes
from the newest call whose result is already on the host (``is_ready``): drawing never
waits for the device. Off a terminal (CI logs) it prints the epochs' logs as plain lines
instead, not flooding the log.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column

from nnxscan.shell._edges.host import to_host
from nnxscan.shell._edges.logs import scalar_aux
from nnxscan.shell._edges.warn import warn

if TYPE_CHECKING:  # the engine's type only: the edges import nothing of the engine
    from nnxscan.shell._engine.layout import Layout

LINE_EVERY_S = 10.0
BAR_WIDTH = 16
TIME_WIDTH = 7  # "1:23:45"; "12:34" under an hour


def _median(values: Any) -> float | None:
    """One number for the status line: a model's value, or the members' median of the
    finite ones (None when none is)."""
    values = np.ravel(np.asarray(values, np.float64))
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if finite.size else None


def _ready_outputs(
    out: Any, has_aux: bool, layout: Layout
) -> tuple[float | None, dict[str, np.ndarray]] | None:
    """A call's newest finite loss (members: their median) and the mean over its steps of
    each scalar aux log (members: one per member), if the call's outputs are on the host
    already; else None."""
    losses = out[0] if has_aux else out
    leaves = scalar_aux(out[1], layout) if has_aux else {}
    if not losses.is_ready() or not all(x.is_ready() for x in leaves.values()):
        return None
    losses, leaves = to_host((losses, leaves))
    # A skipped step's NaN stays out of the mean (NaN where every step was skipped).
    means = {
        k: layout.step_mean(np.asarray(v, np.float64), skipping=True) for k, v in leaves.items()
    }
    return _median(np.asarray(losses)[-1]), means


def _log_texts(values: dict[str, Any], layout: Layout) -> list[str]:
    """``name value`` for each log with a finite value (members: ``name median value``,
    over the members' finite values): the step's scalar logs, the epoch's eval metrics."""
    texts = [layout.shown(key, value) for key, value in values.items() if value is not None]
    return [text for text in texts if text is not None]


def _loss_text(logs: dict, layout: Layout) -> str:
    """An epoch's loss: one model's, or the members' median with their range."""
    if "loss" not in logs:  # a stateful train_step that reports none
        return "no loss"
    return layout.loss_text(logs["loss"])


def _eval_texts(logs: dict, layout: Layout) -> list[str]:
    return _log_texts({k: v for k, v in logs.items() if k.startswith("eval_")}, layout)


def _status(
    loss: float | None, rate: float, evals: list[str], room: int, logs: list[str] = ()
) -> str:
    """What fits in ``room`` characters of: the loss, the step's scalar ``logs``, steps/s,
    the eval metrics, in that order of priority (a log the step reports, such as an RL
    step's return, comes before the rate when the line is short)."""
    parts = [] if loss is None else [f"loss {loss:.4g}"]
    shown = 0
    for text in logs:
        if len("  ".join([*parts, text])) > room:
            break
        parts.append(text)
        shown += 1
    rate_text = f"{rate:,.0f} steps/s"
    if shown and (shown < len(logs) or len("  ".join([*parts, rate_text])) > room):
        return "  ".join(parts)  # the rate gave its room to the step's logs
    parts.append(rate_text)
    for text in evals:
        if len("  ".join([*parts, text])) > room:
            break
        parts.append(text)
    return "  ".join(parts)


class RunProgress:
    """``with RunProgress(calls, enabled) as bar: bar.call_done(...)``.

    ``calls``: the compiled calls planned (None, a stream's: a running count, no ETA).
    ``last_epoch``: the fit's last epoch, whose line is always printed off a terminal.
    ``layout``: a population's shows the members' median and range (and each scalar log's
    median). ``log_names``: the scalar logs to show, in order (None: all the step reports).
    """

    def __init__(
        self,
        calls: int | None,
        enabled: bool,
        *,
        last_epoch: int | None = None,
        has_aux: bool = False,
        console: Console | None = None,
        layout: Layout,
        log_names: Sequence[str] | None = None,
    ):
        # No console when nothing is shown: building rich's costs time on every fit.
        self._console = console or (Console() if enabled else None)
        self._enabled, self._has_aux, self._layout = enabled, has_aux, layout
        self._progress = None
        self._loss: float | None = None
        # The step's scalar logs (their names, known from the first call's output shapes)
        # and the newest call's values of them.
        self._log_keys: list[str] | None = None
        self._log_names = None if log_names is None else list(log_names)
        self._logs: dict[str, Any] = {}
        self._start = time.perf_counter()
        self._steps = 0
        self._printed = -1.0
        self._last_epoch = last_epoch
        if not enabled or not self._console.is_terminal:
            return
        # Fixed-width columns, so that the status text can be fitted to what is left of the
        # line: rich would otherwise squeeze the bar, the count and the times out of it.
        time_column = (
            TimeElapsedColumn()
            if calls is None
            else TimeRemainingColumn(compact=True, elapsed_when_finished=True)
        )
        self._progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}"),
            BarColumn(bar_width=BAR_WIDTH),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}", table_column=Column(no_wrap=True)),
            time_column,
            console=self._console,
        )
        self._count_width = 2 * len(str(calls)) + 1 if calls is not None else 12
        self._evals: list[str] = []
        self._task = self._progress.add_task("fit", total=calls, status="", epoch=0)

    def _status_room(self, epoch: int) -> int:
        """Characters left for the status text on one line of the terminal."""
        fixed = len(f"epoch {epoch}") + BAR_WIDTH + self._count_width + TIME_WIDTH + 4
        return self._console.width - fixed - 1

    def __enter__(self) -> RunProgress:
        if self._progress is not None:
            self._progress.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc_info)

    def call_done(self, epoch: int, steps: int, out: Any, compile_s: float = 0.0) -> None:
        """After a compiled call of ``steps`` steps whose outputs are ``out``;
        ``compile_s``: the seconds this run spent compiling so far (left out of the rate)."""
        self._steps += steps
        if self._log_keys is None:  # shapes only: no sync
            self._log_keys = self._shown_logs(out)
        if self._progress is None:
            return
        ready = _ready_outputs(out, self._has_aux, self._layout)
        if ready is not None:
            loss, means = ready
            self._logs = {key: means[key] for key in self._log_keys}
            self._loss = self._loss if loss is None else loss
        rate = self._steps / max(time.perf_counter() - self._start - compile_s, 1e-9)
        status = _status(self._loss, rate, self._evals, self._status_room(epoch),
                         _log_texts(self._logs, self._layout))  # fmt: skip
        self._progress.update(self._task, advance=1, epoch=epoch, status=status)

    def _shown_logs(self, out: Any) -> list[str]:
        """The scalar logs to show (``log_names``, or all the step reports), once."""
        reported = list(scalar_aux(out[1], self._layout)) if self._has_aux else []
        if self._log_names is None:
            return reported
        missing = [name for name in self._log_names if name not in reported]
        if missing and self._enabled:
            warn(
                f"nnxscan: progress_logs names {missing}, which the training step does not "
                f"report as a scalar per step; it reports {reported or 'none'}."
            )
        return [name for name in self._log_names if name in reported]

    def epoch_done(self, epoch: int, logs: dict) -> None:
        if not self._enabled:
            return
        evals, rate = _eval_texts(logs, self._layout), logs["steps_per_sec"]
        # The epoch's means of the step's scalar logs (on the bar, they replace the call's).
        means = {key: logs.get(key) for key in self._log_keys or ()}
        if self._progress is None:
            # Off a terminal (CI logs), at most a line every LINE_EVERY_S seconds, and the
            # last epoch's: a long run of short epochs must not flood the log.
            now = time.perf_counter()
            last = epoch == self._last_epoch
            if last or now - self._printed >= LINE_EVERY_S or self._printed < 0:
                extras = "".join(f"  {text}" for text in [*_log_texts(means, self._layout), *evals])
                active = logs.get("active")
                if active is not None:
                    extras += f"  {int(np.sum(active))} of {np.size(active)} training"
                compiled = logs.get("compile_time", 0.0)
                # The rate is the steady one; a first epoch's compile is named apart.
                after = f" after a {compiled:.1f} s compile" if compiled >= 0.05 else ""
                loss = _loss_text(logs, self._layout)
                line = f"epoch {epoch}  {loss}{extras}  {rate:,.0f} steps/s{after}"
                # soft_wrap: a log line stays one line, whatever the console's width
                # (rich's default off a terminal is 80 columns).
                self._console.print(line, highlight=False, markup=False, soft_wrap=True)
                self._printed = now
        else:
            self._loss = _median(logs.get("loss", np.nan))
            self._evals, self._logs = evals, means
            status = _status(self._loss, rate, evals, self._status_room(epoch),
                             _log_texts(self._logs, self._layout))  # fmt: skip
            self._progress.update(self._task, epoch=epoch, status=status)
