"""The loggers' callback: where the run's loggers stood, kept in every checkpoint.

`LoggerState` (attached to every run by `train.run`) flushes the loggers at every checkpoint save,
before the file is written, and records in the checkpoint (`train.loggers.STATE_KEY`) the number
of rows in the CSV file and the W&B run id, which a resumed run continues
(`train.loggers.resume_kwargs`).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.loggers import wandb as wandb_logs

from ..loggers import STATE_KEY, CSVLogger


class LoggerState(L.Callback):
    """Flushes every logger when a checkpoint is saved, before it is written, and records where
    they stood in it (`STATE_KEY`); see the module docstring."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        state: dict[str, Any] = {}
        for logger in trainer.loggers:
            logger.save()
            if not trainer.is_global_zero:
                continue
            if isinstance(logger, CSVLogger):
                state["csv_rows"] = logger.experiment.rows
            elif isinstance(logger, wandb_logs.WandbLogger):
                state["wandb_id"] = logger.version
                state["wandb_name"] = logger.name
        checkpoint[STATE_KEY] = state
