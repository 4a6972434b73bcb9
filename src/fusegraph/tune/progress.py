"""A progress bar on stderr for tuning that takes more than a moment (rich if installed, else one line).

Nothing is shown until `SHOW_AFTER_S` has passed, so quick tuning stays silent.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

SHOW_AFTER_S = 1.0


class TuningProgress:
    def __init__(self, label: str, total: int, *, stream: TextIO | None = None,
                 show_after_s: float | None = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.best_ms: float | None = None
        self._stream = stream
        self._show_after_s = SHOW_AFTER_S if show_after_s is None else show_after_s
        self._start = time.perf_counter()
        self._shown = False
        self._rich: Any = None
        self._rich_task: Any = None

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def advance(self, ms: float | None) -> None:
        """One more candidate timed (`ms` None when it failed)."""
        self.done += 1
        if ms is not None and (self.best_ms is None or ms < self.best_ms):
            self.best_ms = ms
        if not self._shown and time.perf_counter() - self._start >= self._show_after_s:
            self._show()
        if self._shown:
            self._update()

    def close(self) -> None:
        if not self._shown:
            return
        if self._rich is not None:
            self._rich.stop()
        elif self._interactive():
            self.stream.write("\n")
        else:
            self.stream.write(self._line() + "\n")
        self.stream.flush()
        self._shown = False

    def __enter__(self) -> TuningProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _interactive(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def _line(self) -> str:
        best = f", best {self.best_ms:.4g} ms" if self.best_ms is not None else ""
        elapsed = time.perf_counter() - self._start
        return f"fusegraph: tuning {self.label}: {self.done}/{self.total} candidates{best} ({elapsed:.1f} s)"

    def _show(self) -> None:
        self._shown = True
        if not self._interactive():
            return  # logs get one summary line at close, not a stream of carriage returns
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            return
        self._rich = Progress(TextColumn("[bold]fusegraph[/] tuning {task.description}"), BarColumn(),
                              MofNCompleteColumn(), TextColumn("{task.fields[best]}"), TimeElapsedColumn(),
                              console=Console(file=self.stream), transient=False)
        self._rich_task = self._rich.add_task(self.label, total=self.total, completed=0, best="")
        self._rich.start()

    def _update(self) -> None:
        if self._rich is not None:
            best = f"best {self.best_ms:.4g} ms" if self.best_ms is not None else ""
            self._rich.update(self._rich_task, completed=self.done, best=best)
        elif self._interactive():
            self.stream.write("\r" + self._line())
            self.stream.flush()
