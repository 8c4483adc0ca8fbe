"""Training streams every DataModule shares: batch k is a pure function of (seed, rank, k).

A resumed run starts at k = global_step * accumulate_grad_batches (`stream_position`), so it
reproduces the uninterrupted run's data without storing any RNG state; DataLoader workers each
take every W-th batch and the loader interleaves them back into order (`StepBatches`).
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


class SpecdecDataModule(L.LightningDataModule):
    """A DataModule the evaluation callback draws fixed prompts from, and whose tokens it shows
    as text in its samples."""

    def prompts(self, count: int, length: int) -> torch.Tensor:
        """`count` fixed validation prompts (count, length): the same at every call."""
        raise NotImplementedError

    def decode_text(self, tokens: torch.Tensor) -> str:
        """Token ids (n,) as text."""
        raise NotImplementedError


def window_batch(data: np.ndarray, offsets: np.ndarray, length: int) -> torch.Tensor:
    """Windows data[o : o + length] for each offset -> LongTensor (len(offsets), length)."""
    index = offsets[:, None] + np.arange(length)              # (b, length)
    return torch.from_numpy(data[index].astype(np.int64))


def stream_position(trainer: L.Trainer | None) -> tuple[int, int]:
    """(rank, first batch index) of this process's training stream: on resume, batch
    k = global_step * accumulate_grad_batches is the first one not yet trained on."""
    if trainer is None:
        return 0, 0
    return trainer.global_rank, trainer.global_step * trainer.accumulate_grad_batches


class StepBatches(IterableDataset):
    """Endless batches from `batch(k)`, a pure function of the batch index k, from k = `start` on.
    Worker i of W yields k = start + i, start + i + W, ..., which the DataLoader interleaves back
    into order."""

    start: int

    def batch(self, k: int) -> torch.Tensor:
        raise NotImplementedError

    def __iter__(self):
        info = get_worker_info()
        k, step = (self.start, 1) if info is None else (self.start + info.id, info.num_workers)
        while True:
            yield self.batch(k)
            k += step


def evenly_spaced_windows(tokens: np.ndarray, count: int, length: int) -> torch.Tensor:
    """`count` windows (count, length) of `tokens` centred in `count` equal slices: fixed prompts
    for decoding evaluations, offset from the evenly spaced validation windows."""
    from specdec_models.errors import check

    check(1 <= length <= len(tokens), f"prompt length {length} does not fit the {len(tokens)} validation tokens")
    offsets = ((np.arange(count) + 0.5) * (len(tokens) - length) / count).astype(np.int64)
    return window_batch(tokens, offsets, length)
