"""`SpecdecCallback`: the base of callbacks with a say in the run beyond Lightning's hooks.

It checks the module it will work with (`check_module`: `train.run` asks every callback before it
creates anything, and `setup` asks again for a Trainer built elsewhere) and offers values for the
export (`export_metadata`: copied into each checkpoint's `EXPORT_METADATA_KEY` entry, where
`train.checkpoints.export_checkpoint` reads them).
"""

from __future__ import annotations

from typing import Any

import lightning as L

from ..checkpoints import EXPORT_METADATA_KEY


class SpecdecCallback(L.Callback):
    """A callback that checks its module before any step and may add to the export (module
    docstring). Subclasses override `check_module` and `export_metadata`; one that overrides
    `setup` or `on_save_checkpoint` calls super()."""

    def check_module(self, module: L.LightningModule) -> None:
        """Refuse (one-line SpecdecError) a module this callback cannot work with."""

    def export_metadata(self) -> dict[str, Any]:
        """Plain JSON values the run's export records (in its metadata) from this callback."""
        return {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.check_module(pl_module)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint.setdefault(EXPORT_METADATA_KEY, {}).update(self.export_metadata())
