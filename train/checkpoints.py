"""Training checkpoints -> modules -> exports: the one export writer of `train` and scripts/export.py.

A Lightning checkpoint holds the module's hyper-parameters (plain values), its state_dict and the
task's name (`TaskModule.on_save_checkpoint`); `load_module` rebuilds the module from them through
the task registry, and `export_checkpoint` writes its export with the module's `write_export`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specdec_models.errors import SpecdecError, check

from .tasks import TaskModule, get_task


def load_module(ckpt_path: str | Path) -> tuple[TaskModule, dict[str, Any]]:
    """(the module of a training checkpoint of any task, with its weights; the raw checkpoint)."""
    ckpt_path = Path(ckpt_path)
    check(ckpt_path.is_file(), f"checkpoint {ckpt_path} does not exist")
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip or truncation errors: report the file, not the stack
        raise SpecdecError(f"cannot read checkpoint {ckpt_path}: {' '.join(str(error).split())}") from None
    check(isinstance(ckpt, dict) and "hyper_parameters" in ckpt and "state_dict" in ckpt,
          f"{ckpt_path} is not a specdec training checkpoint")
    module = get_task(ckpt.get("specdec_task", "prophet")).module(**ckpt["hyper_parameters"])
    module.load_state_dict(ckpt["state_dict"])
    return module, ckpt


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write the export of a training checkpoint of any task (see `TaskModule.write_export`);
    returns the directory."""
    module, ckpt = load_module(ckpt_path)
    meta = {**module.run_export_metadata(), "global_step": int(ckpt.get("global_step", 0)),
            "checkpoint": str(Path(ckpt_path).resolve()), **(metadata or {})}
    return Path(module.write_export(Path(out_dir), meta))
