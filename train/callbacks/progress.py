"""The progress callback: what a run shows while it trains, in optimizer steps.

`StepProgressBar` counts optimizer steps, what `trainer.max_steps` counts (Lightning's own bar
counts batches: with accumulate_grad_batches=4 it shows `3/3 100%` and then `10/?`), with the
total and an ETA from this run's pace (a resumed run starts at its checkpoint's step) or, when
`trainer.max_time` ends the run first, from its time left. On a terminal it is one tqdm bar;
otherwise (a pipe, a file, a batch job) it logs plain lines through the `train.progress` logger:
one every `log_every_seconds`, one after each validation and one at the end, so redirected output
stays readable line by line (`train.run_log` also writes them to the run's `train.log`, where
`specdec plot` reads them under the logger name `train.progress`).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, Timer

from specdec_models.errors import check, check_positive_int

log = logging.getLogger("train.progress")       # the name train.log's progress lines carry


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class StepProgressBar(ProgressBar):
    """Training progress in optimizer steps with a total and an ETA (see the module docstring).
    `refresh_rate`: redraw the terminal bar every N steps; `terminal`: None decides by whether
    stdout is a terminal."""

    def __init__(self, refresh_rate: int = 1, log_every_seconds: float = 60.0, terminal: bool | None = None) -> None:
        super().__init__()
        check_positive_int(refresh_rate, "progress_bar.refresh_rate")
        check(isinstance(log_every_seconds, (int, float)) and log_every_seconds >= 0,
              f"progress_bar.log_every_seconds must be >= 0, got {log_every_seconds!r}")
        self.refresh_rate, self.log_every_seconds, self.terminal = refresh_rate, float(log_every_seconds), terminal
        self._enabled = True
        self._bar: Any = None
        self._start_step, self._start_time, self._shown, self._last_line = 0, 0.0, -1, -math.inf

    # -- ProgressBar's interface -----------------------------------------------------------------

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self._enabled

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self._bar is not None:
            self._bar.write(" ".join(map(str, args)))
        else:
            print(*args, **kwargs)

    # -- what it shows ---------------------------------------------------------------------------

    def _total(self, trainer: L.Trainer) -> int | None:
        return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None

    def _metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())

    def line(self, trainer: L.Trainer, pl_module: L.LightningModule, event: str = "") -> str:
        """`step 120/1000 (12%) | 0.45 s/step | ETA 0:06:36 | train/loss=3.21`, from this run's pace."""
        step, total = trainer.global_step, self._total(trainer)
        parts = [f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"]
        done = step - self._start_step
        if done > 0:
            pace = (time.monotonic() - self._start_time) / done
            parts.append(f"{pace:.3g} s/step")
            eta = [pace * max(total - step, 0)] if total else []
            timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
            left = timer.time_remaining("train") if timer is not None else None
            if left is not None:                    # max_time may end the run before max_steps
                eta.append(max(left, 0.0))
            if eta:
                parts.append(f"ETA {_duration(min(eta))}")
        if event:
            parts.append(event)
        metrics = self._metrics(trainer, pl_module)
        return " | ".join(parts + ([metrics] if metrics else []))

    # -- hooks -----------------------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_step = self._shown = trainer.global_step
        self._start_time, self._last_line = time.monotonic(), -math.inf
        if not self._enabled:
            return
        terminal = sys.stdout.isatty() if self.terminal is None else self.terminal
        if terminal:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self._total(trainer), initial=self._start_step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stdout, smoothing=0.05)
        else:
            log.info(self.line(trainer, pl_module, "training starts"))
            self._last_line = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if not self._enabled or step == self._shown:        # mid-accumulation: no new optimizer step
            return
        self._shown = step
        last = step == self._total(trainer)
        if self._bar is not None:
            if step % self.refresh_rate == 0 or last:
                self._bar.n = step
                self._bar.set_postfix_str(self._metrics(trainer, pl_module), refresh=False)
                self._bar.refresh()
        elif last or time.monotonic() - self._last_line >= self.log_every_seconds:
            log.info(self.line(trainer, pl_module))
            self._last_line = time.monotonic()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled and self._bar is not None and not trainer.sanity_checking:
            self._bar.set_description_str("validating")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._enabled or trainer.sanity_checking:
            return
        if self._bar is not None:
            self._bar.set_description_str("train")
            self._bar.set_postfix_str(self._metrics(trainer, pl_module))
        else:
            log.info(self.line(trainer, pl_module, "validated"))
            self._last_line = time.monotonic()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
