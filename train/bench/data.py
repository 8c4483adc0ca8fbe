"""The bytes the training benchmarks read (specdec bench train): `data_file` (a byte file, else
the shared text file, else synthetic bytes), `byte_batches` (training batches by index and the
validation split, split as the enwik8 DataModule splits a file) and `validation_rows` (fixed
validation windows and prompts from that split)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from specdec_models.errors import check

from ..data.enwik8 import FixedWindows, RandomWindows, read_bytes, split_bounds


def data_file(path: str | None, default: Path, workdir: Path) -> tuple[Path, str]:
    """The byte file to train on: `path`, else `default` if present, else synthetic bytes in workdir."""
    if path:
        check(Path(path).is_file(), f"--data {path} is not a file")
        return Path(path), str(path)
    if default.is_file():
        return default, str(default)
    synthetic = workdir / "synthetic.bin"
    synthetic.write_bytes(np.random.default_rng(0).integers(32, 127, 4_000_000, dtype=np.uint8).tobytes())
    return synthetic, "synthetic bytes (4 MB)"


def byte_batches(path: Path, seq_len: int, batch: int, seed: int) -> tuple[Callable[[int], torch.Tensor], np.ndarray]:
    """(batch_of(k) over the training split, the validation split) of the byte file."""
    data = read_bytes(path)
    train_end, valid_end, _ = split_bounds(len(data))
    check(train_end > 4 * (seq_len + 1), f"{path} is too short for windows of {seq_len + 1} bytes")
    return RandomWindows(data[:train_end], seq_len, batch, seed=seed, rank=0, start=0).batch, data[train_end:valid_end]


def validation_rows(valid, seq_len: int, count: int, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` fixed windows of seq_len + 1 bytes from the first half of the validation split and
    `count` prompts of prompt_len bytes from the second half: (windows, prompts)."""
    half = len(valid) // 2
    windows = FixedWindows(valid[:half], seq_len + 1, count)
    prompts = FixedWindows(valid[half:], prompt_len, count)
    return torch.stack([windows[i] for i in range(count)]), torch.stack([prompts[i] for i in range(count)])
