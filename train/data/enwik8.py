"""The enwik8 DataModule: bytes as tokens (vocabulary 256), the standard 90M / 5M / 5M split.

enwik8 is the first 10^8 bytes of an English Wikipedia XML dump (Hutter prize; Mahoney's
"Large Text Compression Benchmark"). The file comes from `path` (a raw `enwik8`, an
`enwik8.zip` or any `.gz`), or is downloaded once into `download_dir`.

Training draws random windows of seq_len + 1 bytes. Batch k of process `rank` is a pure
function of (seed, rank, k), and a resumed run starts at k = global_step * accumulate_grad_batches,
so resuming from a checkpoint reproduces the data stream without storing any RNG state.
Validation and test use fixed, evenly spaced windows, so numbers compare between runs.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from specdec_models import byte_tokenizer
from specdec_models.errors import SpecdecError, check, check_positive_int

from .settings import read_settings
from .streams import SpecdecDataModule, StepBatches, evenly_spaced_windows, stream_position, window_batch

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
ENWIK8_BYTES = 10**8
SPLIT = (0.90, 0.05, 0.05)          # 90M / 5M / 5M of 10^8 bytes; the same fractions for short files

# No published hash of enwik8 is recorded here (none we could verify). The download is checked
# by the zip member's CRC-32 and by its size (exactly 10^8 bytes); `sha256` adds a full check.
HOW_TO_PROVIDE = ("download http://mattmahoney.net/dc/enwik8.zip on a machine with network and pass "
                  "data.path=/path/to/enwik8.zip (a raw enwik8 file or a .gz works too)")


def download(url: str, dest: Path) -> Path:
    """Download `url` to `dest` with a progress bar (written to a temporary name, then renamed)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f"{dest.name}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {dest.name}") as bar:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
        part.replace(dest)
    except (urllib.error.URLError, OSError) as error:
        part.unlink(missing_ok=True)
        raise SpecdecError(f"could not download {url} ({error}); {HOW_TO_PROVIDE}") from None
    return dest


def read_bytes(path: Path) -> np.ndarray:
    """The bytes of a raw, .zip (first member) or .gz file as a uint8 array (a memmap when raw)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return np.frombuffer(f.read(), dtype=np.uint8)
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as z:
                names = [n for n in z.namelist() if not n.endswith("/")]
                check(bool(names), f"{path} is an empty zip archive")
                return np.frombuffer(z.read(names[0]), dtype=np.uint8)   # read() checks the CRC-32
        check(path.stat().st_size > 0, f"{path} is empty")
        return np.memmap(path, dtype=np.uint8, mode="r")
    except SpecdecError:
        raise
    except (OSError, EOFError, zlib.error, zipfile.BadZipFile, gzip.BadGzipFile) as error:   # zlib: corrupt .gz data
        raise SpecdecError(f"cannot read {path}: {error}") from None


def split_bounds(total: int) -> tuple[int, int, int]:
    """End offsets of train, valid and test in the first `total` bytes (90 / 5 / 5)."""
    train = round(total * SPLIT[0])
    valid = train + round(total * SPLIT[1])
    return train, valid, total


class RandomWindows(StepBatches):
    """Batches (batch_size, seq_len + 1) of random training windows; batch k depends only on
    (seed, rank, k)."""

    def __init__(self, data: np.ndarray, seq_len: int, batch_size: int, seed: int, rank: int, start: int) -> None:
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.seed, self.rank, self.start = seed, rank, start

    def batch(self, k: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, self.rank, k])
        offsets = rng.integers(0, len(self.data) - self.seq_len, size=self.batch_size)
        return window_batch(self.data, offsets, self.seq_len + 1)


class FixedWindows(Dataset):
    """`count` windows of `length` bytes, evenly spaced over `data`."""

    def __init__(self, data: np.ndarray, length: int, count: int) -> None:
        self.data, self.length = data, length
        self.offsets = np.linspace(0, len(data) - length, count).round().astype(np.int64)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> torch.Tensor:
        return window_batch(self.data, self.offsets[i:i + 1], self.length)[0]


@dataclass(frozen=True)
class Enwik8Settings:
    """The `data:` node of data=enwik8: the file (`path`, else enwik8 from `download_dir`,
    downloaded there unless `download` is false), its `sha256` if checked, `allow_short` to split a
    shorter file 90/5/5; training windows of `seq_len` bytes in batches of `batch_size`,
    `val_windows` validation windows in batches of `val_batch_size`, loader workers and seed."""

    path: str | None = None
    download_dir: str = "~/.cache/specdec"
    download: bool = True
    sha256: str | None = None
    allow_short: bool = False
    seq_len: int = 512
    batch_size: int = 4
    val_windows: int = 64
    val_batch_size: int = 8
    num_workers: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "val_windows", "val_batch_size"):
            check_positive_int(getattr(self, name), f"data.{name}")
        check(isinstance(self.num_workers, int) and self.num_workers >= 0,
              f"data.num_workers must be >= 0, got {self.num_workers!r}")
        check(self.sha256 is None or (isinstance(self.sha256, str) and len(self.sha256) == 64),
              f"data.sha256 must be 64 hex digits or null, got {self.sha256!r}")


class Enwik8DataModule(SpecdecDataModule):
    def __init__(self, **settings: Any) -> None:
        """`settings`: the fields of `Enwik8Settings` (the `data:` node, checked there)."""
        super().__init__()
        s = read_settings(Enwik8Settings, type(self), settings)
        self.path = Path(s.path).expanduser() if s.path else None
        self.download_dir = Path(s.download_dir).expanduser()
        self.download, self.sha256, self.allow_short = s.download, s.sha256, s.allow_short
        self.seq_len, self.batch_size, self.val_windows = s.seq_len, s.batch_size, s.val_windows
        self.val_batch_size, self.num_workers, self.seed = s.val_batch_size, s.num_workers, s.seed
        self._splits: dict[str, np.ndarray] | None = None

    # -- the file -------------------------------------------------------------------------------

    def source(self) -> Path:
        """The file to read: `path`, else the cached enwik8 (downloaded here on first use)."""
        if self.path is not None:
            check(self.path.is_file(), f"data.path {self.path} does not exist or is not a file")
            return self.path
        cached = self.download_dir / "enwik8.zip"
        if cached.is_file():
            return cached
        check(self.download, f"enwik8 is not in {self.download_dir} and data.download=false; {HOW_TO_PROVIDE}")
        return download(ENWIK8_URL, cached)

    def prepare_data(self) -> None:
        self.source()

    def load(self) -> dict[str, np.ndarray]:
        """train / valid / test byte arrays, read and checked once."""
        if self._splits is None:
            path = self.source()
            try:
                data = read_bytes(path)
                if len(data) < ENWIK8_BYTES:
                    check(self.allow_short, f"{path} holds {len(data):,} bytes; enwik8 has {ENWIK8_BYTES:,} "
                                            f"(set data.allow_short=true to split a shorter file 90/5/5)")
            except SpecdecError as error:
                if self.path is None:           # a bad download: say how to get a fresh one
                    raise SpecdecError(f"{error}; delete {path} to download it again") from None
                raise
            data = data[:ENWIK8_BYTES]
            if self.sha256 is not None:
                digest = hashlib.sha256(memoryview(data)).hexdigest()
                check(digest == self.sha256.lower(),
                      f"{path}: sha256 of its first {len(data):,} bytes is {digest}, expected {self.sha256}")
            train, valid, test = split_bounds(len(data))
            splits = {"train": data[:train], "valid": data[train:valid], "test": data[valid:test]}
            for name, part in splits.items():
                check(len(part) > self.seq_len + 1, f"{path}: the {name} split ({len(part):,} bytes) is shorter "
                                                    f"than one window of data.seq_len + 1 = {self.seq_len + 1}")
            self._splits = splits
        return self._splits

    def setup(self, stage: str | None = None) -> None:
        self.load()

    # -- loaders --------------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        rank, start = stream_position(self.trainer)
        windows = RandomWindows(self.load()["train"], self.seq_len, self.batch_size, self.seed, rank, start)
        return DataLoader(windows, batch_size=None, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def _fixed(self, split: str) -> DataLoader:
        windows = FixedWindows(self.load()[split], self.seq_len + 1, self.val_windows)
        return DataLoader(windows, batch_size=self.val_batch_size, shuffle=False, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return self._fixed("valid")

    def test_dataloader(self) -> DataLoader:
        return self._fixed("test")

    def prompts(self, count: int, length: int) -> torch.Tensor:
        """`count` fixed prompts (count, length) from the validation split, for decoding evaluations."""
        return evenly_spaced_windows(self.load()["valid"], count, length)

    def decode_text(self, tokens: torch.Tensor) -> str:
        return byte_tokenizer.decode(tokens)


def validation_prompts(path: str | Path, count: int, length: int) -> torch.Tensor:
    """The evaluation callback's `count` fixed prompts of `length` bytes from the validation split
    of an enwik8-shaped file (scripts use them without a DataModule)."""
    data = read_bytes(Path(path).expanduser())[:ENWIK8_BYTES]
    train, valid, _ = split_bounds(len(data))
    return evenly_spaced_windows(data[train:valid], count, length)
