"""The checkpoint callback: `last.ckpt` by time and by steps between validations.

`PeriodicCheckpoint` (conf/callbacks/default.yaml) writes `last.ckpt` every `every_minutes` and
every `every_steps` optimizer steps, between the validations that write it too, so a crash loses
at most that much work. The file is written atomically by the Trainer's `AtomicCheckpointIO`
(`train.checkpoints`, which also reads checkpoints back and turns them into exports).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import lightning as L

from specdec_models.errors import check


class PeriodicCheckpoint(L.Callback):
    """Writes `dirpath/filename` (last.ckpt) every `every_minutes` of training and every
    `every_steps` optimizer steps (null turns one off), counted from the last checkpoint saved by
    anyone (a validation's too).

    It saves at the start of the first batch after an optimizer step, when that step's metrics
    have been logged (Lightning's own step checkpoints save before, so a resume never logs the
    saved step: see `train.loggers`), and marks the batch already fetched as not started, the
    state Lightning itself saves at the end of training. Right after a validation it waits one
    step (that state restarts differently; the validation's checkpoint covers it).

    `clock` (seconds, monotonic; `time.monotonic`) is what "every_minutes" is measured with: tests
    give a fake one, so what they check does not depend on the machine's speed."""

    def __init__(self, dirpath: str, every_minutes: float | None = 10.0, every_steps: int | None = 1000,
                 filename: str = "last.ckpt", clock: Callable[[], float] = time.monotonic) -> None:
        check(every_minutes is None or (isinstance(every_minutes, (int, float)) and not isinstance(every_minutes, bool)
                                        and math.isfinite(every_minutes) and every_minutes > 0),
              f"periodic_checkpoint.every_minutes must be > 0 or null, got {every_minutes!r}")
        check(every_steps is None or (isinstance(every_steps, int) and not isinstance(every_steps, bool)
                                      and every_steps >= 1),
              f"periodic_checkpoint.every_steps must be a positive integer or null, got {every_steps!r}")
        self.path = Path(dirpath) / filename
        self.every_seconds = None if every_minutes is None else 60.0 * every_minutes
        self.every_steps = every_steps
        self.clock = clock
        self._saved_step, self._saved_at, self._seen_step = 0, clock(), 0
        self._after_validation = self._saving = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._saved_step = self._seen_step = trainer.global_step
        self._saved_at = self.clock()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._after_validation = not trainer.sanity_checking

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        after_validation, self._after_validation = self._after_validation, False
        step = trainer.global_step
        if step == self._seen_step:                # mid-accumulation, or no step since the last batch
            return
        self._seen_step = step
        by_steps = self.every_steps is not None and step - self._saved_step >= self.every_steps
        by_time = self.every_seconds is not None and self.clock() - self._saved_at >= self.every_seconds
        # every rank must agree (saving is collective): rank 0's clock decides
        if not trainer.strategy.broadcast(bool(by_steps or by_time) and not after_validation, src=0):
            return
        self._saving = True
        try:
            trainer.save_checkpoint(self.path, weights_only=False)
        finally:
            self._saving = False

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._saved_step, self._saved_at = trainer.global_step, self.clock()
        if self._saving:
            # the batch Lightning fetched for the next step counts as "ready": uncount it, so the
            # checkpoint reads as saved between batches and the resume fetches that batch again
            progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
            for counts in (progress["total"], progress["current"]):
                check(counts["ready"] - 1 == counts["started"] == counts["processed"] == counts["completed"],
                      f"unexpected Lightning loop state in a periodic checkpoint: {progress}")
                counts["ready"] -= 1
