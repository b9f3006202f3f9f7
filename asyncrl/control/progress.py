"""The console view of a run: a rich progress bar with the numbers people watch.

Only on a terminal: redirected to a file or a CI log, a live bar is redrawn into a mess of
truncated lines ("train ━━━━ 20… 0:0…"), so there it shows nothing and the console sink's
plain metrics line every `monitor.console_every` steps is the progress."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class StepProgress:
    """step i/N, reward, staleness and tokens/s, refreshed after every trainer step."""

    def __init__(self, total_steps: int, *, start: int = 0, console: Console | None = None):
        console = console or Console(stderr=True)
        self.live = console.is_terminal
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            disable=not self.live,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start, info="")

    def __enter__(self) -> StepProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def update(self, step: int, m: dict[str, float]) -> None:
        info = (
            f"reward {m.get('reward/mean', float('nan')):.3f}  "
            f"staleness {m.get('staleness/mean', float('nan')):.2f} (max {m.get('staleness/max', float('nan')):.0f})  "
            f"train {m.get('throughput/train_tokens_per_s', float('nan')):.0f} tok/s  "
            f"v{int(m.get('learner/version', 0))}"
        )
        self._progress.update(self._task, completed=step, info=info)

    def print(self, *args, **kwargs) -> None:
        self._progress.console.print(*args, **kwargs)
