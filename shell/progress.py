"""A progress bar that advances once per compiled call and never forces a device sync."""

from __future__ import annotations

from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["EpochProgress"]


class EpochProgress:
    """``with EpochProgress(epochs, calls_per_epoch, enabled) as bar: bar.advance()``.

    ``calls_per_epoch=None`` (a stream of unknown length) shows a running count.
    """

    def __init__(self, epochs: int, calls_per_epoch: int | None, enabled: bool):
        self._progress = None
        if not enabled:  # no bar at all: a disabled rich Progress still costs per call
            return
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            disable=not enabled,
        )
        total = None if calls_per_epoch is None else epochs * calls_per_epoch
        self._task = self._progress.add_task("epoch", total=total, status="")

    def __enter__(self) -> EpochProgress:
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

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

    def epoch_done(self, epoch: int, logs: dict) -> None:
        if self._progress is None:
            return
        status = f"epoch {epoch}  loss {logs['loss']:.4g}  {logs['steps_per_sec']:,.0f} steps/s"
        self._progress.update(self._task, status=status)
