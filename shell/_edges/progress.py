"""Progress for a whole ``fit``: one bar, advanced per compiled call, never forcing a sync.

In a terminal, a rich bar shows the epoch, the latest loss, steps/s, the last epoch's eval
metrics and the ETA (the elapsed time once done, or while the total is unknown), fitted to
the terminal's width: eval metrics that do not fit are left out. The loss shown is that of
the newest call whose result is already on the host side (``is_ready``), so drawing the bar
never waits for the device. When stdout is not a terminal (CI logs), no bar is drawn: one
plain line per epoch is printed instead, so logs are not flooded.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

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

from nnxscan.shell._engine.placement import to_host

LINE_EVERY_S = 10.0
BAR_WIDTH = 16
TIME_WIDTH = 7  # "1:23:45"; "12:34" under an hour


def _ready_loss(out: Any, has_aux: bool) -> float | None:
    """The newest finite loss of a call already on the host (members: their median)."""
    losses = out[0] if has_aux else out
    if not losses.is_ready():
        return None
    last = np.asarray(to_host(losses))[-1]
    finite = np.ravel(last)[np.isfinite(np.ravel(last))]
    return float(np.median(finite)) if finite.size else None


def _loss_text(logs: dict) -> str:
    """An epoch's loss: one model's, or the members' median with their range."""
    if "loss" not in logs:  # a stateful train_step that reports none
        return "no loss"
    loss = np.asarray(logs["loss"], np.float64)
    if loss.ndim == 0:
        return f"loss {float(loss):.4g}"
    low, mid, high = (
        np.nanpercentile(loss, [0, 50, 100]) if np.isfinite(loss).any() else [np.nan] * 3
    )
    return f"loss median {mid:.4g} [{low:.4g}, {high:.4g}] of {loss.size} members"


def _eval_texts(logs: dict) -> list[str]:
    texts = []
    for key, value in logs.items():
        if not key.startswith("eval_"):
            continue
        if isinstance(value, float):
            texts.append(f"{key} {value:.4g}")
        elif np.ndim(value) == 1 and np.isfinite(value).any():  # members: the median
            texts.append(f"{key} median {float(np.nanmedian(value)):.4g}")
    return texts


def _status(loss: float | None, rate: float, evals: list[str], room: int) -> str:
    """Loss and steps/s, then as many eval metrics as fit in ``room`` characters."""
    parts = [] if loss is None else [f"loss {loss:.4g}"]
    parts.append(f"{rate:,.0f} steps/s")
    for text in evals:
        if len("  ".join([*parts, text])) > room:
            break
        parts.append(text)
    return "  ".join(parts)


class RunProgress:
    """``with RunProgress(epochs, calls_per_epoch, enabled) as bar: bar.call_done(...)``.

    ``calls_per_epoch=None`` (a stream of unknown length) shows a running count, no ETA.
    ``members=N``: the losses are a population's; the line shows their median and range.
    """

    def __init__(
        self,
        epochs: int,
        calls_per_epoch: int | None,
        enabled: bool,
        *,
        has_aux: bool = False,
        console: Console | None = None,
        members: int | None = None,
    ):
        self._console = console or Console()
        self._enabled = enabled
        self._has_aux = has_aux
        self._progress = None
        self._loss: float | None = None
        self._start = time.perf_counter()
        self._steps = 0
        self._printed = -1.0
        self._compile_s = 0.0
        self._last_epoch: int | None = None
        if not enabled or not self._console.is_terminal:
            return
        total = None if calls_per_epoch is None else epochs * calls_per_epoch
        # Fixed-width columns, so that the status text can be fitted to what is left of the
        # line: rich would otherwise squeeze the bar, the count and the times out of it.
        time_column = (
            TimeElapsedColumn()
            if total is None
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
        self._count_width = 2 * len(str(total)) + 1 if total is not None else 12
        self._evals: list[str] = []
        self._task = self._progress.add_task("fit", total=total, status="", epoch=0)

    def _status_room(self, epoch: int) -> int:
        """Characters left for the status text on one line of the terminal."""
        fixed = len(f"epoch {epoch}") + BAR_WIDTH + self._count_width + TIME_WIDTH + 4
        return self._console.width - fixed - 1

    def __enter__(self) -> RunProgress:
        if self._progress is not None:
            self._progress.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.__exit__(exc_type, exc, tb)

    def set_last_epoch(self, epoch: int) -> None:
        """The global index of the run's last epoch (always printed off a terminal)."""
        self._last_epoch = epoch

    def call_done(self, epoch: int, steps: int, out: Any, compile_s: float = 0.0) -> None:
        """After a compiled call of ``steps`` steps whose outputs are ``out``;
        ``compile_s``: the seconds this run spent compiling so far (left out of the rate)."""
        self._steps += steps
        self._compile_s = compile_s
        if self._progress is None:
            return
        loss = _ready_loss(out, self._has_aux)
        self._loss = self._loss if loss is None else loss
        rate = self._steps / max(time.perf_counter() - self._start - compile_s, 1e-9)
        status = _status(self._loss, rate, self._evals, self._status_room(epoch))
        self._progress.update(self._task, advance=1, epoch=epoch, status=status)

    def epoch_done(self, epoch: int, logs: dict) -> None:
        if not self._enabled:
            return
        evals, rate = _eval_texts(logs), logs["steps_per_sec"]
        if self._progress is None:
            # Off a terminal (CI logs), at most a line every LINE_EVERY_S seconds, and the
            # last epoch's: a long run of short epochs must not flood the log.
            now = time.perf_counter()
            last = epoch == self._last_epoch
            if last or now - self._printed >= LINE_EVERY_S or self._printed < 0:
                extras = "".join(f"  {text}" for text in evals)
                active = logs.get("active")
                if active is not None:
                    extras += f"  {int(np.sum(active))} of {np.size(active)} training"
                compiled = logs.get("compile_time", 0.0)
                # The rate is the steady one; a first epoch's compile is named apart.
                after = f" after a {compiled:.1f} s compile" if compiled >= 0.05 else ""
                line = f"epoch {epoch}  {_loss_text(logs)}{extras}  {rate:,.0f} steps/s{after}"
                # soft_wrap: a log line stays one line, whatever the console's width
                # (rich's default off a terminal is 80 columns).
                self._console.print(line, highlight=False, markup=False, soft_wrap=True)
                self._printed = now
        else:
            loss = np.asarray(logs.get("loss", np.nan), np.float64)
            finite = loss[np.isfinite(loss)]
            self._loss = float(np.median(finite)) if finite.size else None
            self._evals = evals
            status = _status(self._loss, rate, evals, self._status_room(epoch))
            self._progress.update(self._task, epoch=epoch, status=status)
