"""CPU threads handed between runs that share a machine: the `ThreadsFromFile` callback.

The SmolLM2 recipe (`scripts/smollm2.py`) trains its two heads side by side on a 2-core CPU, one
thread each, for the same wall time. The prophet head stops at its `max_steps` about halfway
on a fast host, and its core then idled while the
eagle3 head went on with one thread. With `callbacks.threads_file.path=FILE`, a run reads FILE
before each training step; the recipe writes there the threads each run left may use once another
ends (`scripts/smollm2.py`, `side_by_side`), and the run goes on with them
(`torch.set_num_threads`). On the recipe's eagle3 step an idle Zen 5 core made a step 1.5x faster
(0.41 s against 0.61 s on one thread).

FILE holds one integer >= 1. Absent, the run keeps the threads it started with; unreadable or not
such an integer, it says so once and keeps them too: a handover is worth less than the run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch

log = logging.getLogger(__name__)


class ThreadsFromFile(L.Callback):
    """Set torch's CPU threads from `path` before each training step (module docstring); `path`
    None: never read."""

    def __init__(self, path: str | None = None) -> None:
        self.path = Path(path) if path else None
        self.complained = False

    def wanted(self) -> int | None:
        """The thread count the file asks for, or None (no file, or one that asks nothing valid)."""
        if self.path is None:
            return None
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as error:
            self.complain(f"cannot read it ({error.strerror})")
            return None
        text = text.strip()
        if not text.isdecimal() or int(text) < 1:
            self.complain(f"it holds {text[:40]!r}, not an integer >= 1")
            return None
        return int(text)

    def complain(self, why: str) -> None:
        """Warn once per run: the file is read before every step."""
        if not self.complained:
            log.warning(f"callbacks.threads_file: {self.path}: {why}; the threads stay {torch.get_num_threads()}")
            self.complained = True

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        threads = self.wanted()
        if threads is not None and threads != torch.get_num_threads():
            log.info(f"callbacks.threads_file: {torch.get_num_threads()} -> {threads} CPU threads from "
                     f"{self.path} at step {trainer.global_step}")
            torch.set_num_threads(threads)
