"""Text through a Hugging Face tokenizer: the DataModule of task=hf_draft_distill.

Documents come from local files read with Hugging Face `datasets` (`.txt`: one document per row
of the `text` builder, a line by default; `.json` / `.jsonl`: one per record) or from a
`save_to_disk` dataset directory. Each document is `text_field`, or, with `chat=true`,
`messages_field` (a list of {"role", "content"}; a document with only text becomes one user
turn) formatted with the tokenizer's chat template, as instruct models expect. Documents are
tokenized (plain text with the tokenizer's own special tokens, e.g. Llama's BOS), each followed by
EOS, concatenated in order and cut into windows of seq_len + 1 tokens (the last partial window
is dropped).

The windows are computed once and kept as one Arrow file, memory-mapped on every later use:
`<windows_dir>/<key>/windows.arrow`, where the key hashes the tokenizer (its vocabulary, merges,
special tokens and chat template), the data files (path, size, modification time) and every
setting that changes the tokens. The file is written under a temporary name and renamed, so a
crashed build leaves no half file. The last `val_windows` windows are the fixed validation set;
training draws random windows from the rest, batch k of rank r a pure function of (seed, r, k),
so a resumed run continues the same stream (as `train.data.Enwik8DataModule` does).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from specdec_models.errors import SpecdecError, check, check_positive_int
from specdec_models.hf import load_tokenizer, tokenizer_fingerprint

from .settings import read_settings
from .streams import SpecdecDataModule, StepBatches, evenly_spaced_windows, stream_position

CACHE_VERSION = 1
WINDOWS_FILE = "windows.arrow"
TEXT_SUFFIXES = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json"}


def _files_of(files: str | Sequence[str] | None) -> list[Path]:
    check(files is not None and len(files) > 0,
          "data.files must name local text/JSON(L) files or a save_to_disk directory")
    paths = ([Path(files).expanduser()] if isinstance(files, (str, os.PathLike))
             else [Path(f).expanduser() for f in files])
    for path in paths:
        check(path.exists(), f"data file {path} does not exist")
    if any(p.is_dir() for p in paths):
        check(len(paths) == 1, "data.files: a save_to_disk directory must be the only entry")
    else:
        kinds = {TEXT_SUFFIXES.get(p.suffix.lower()) for p in paths}
        check(None not in kinds, f"data.files: use .txt, .json or .jsonl files (or a save_to_disk directory), got "
                                 f"{', '.join(p.name for p in paths if p.suffix.lower() not in TEXT_SUFFIXES)}")
        check(len(kinds) == 1, "data.files: text and JSON files cannot be mixed in one run")
    return paths


def _files_fingerprint(paths: list[Path]) -> list[list[Any]]:
    """(path, size, mtime) of every file, directories walked in order."""
    out = []
    for path in paths:
        members = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for p in members:
            stat = p.stat()
            out.append([str(p.resolve()), stat.st_size, stat.st_mtime_ns])
    return out


def read_documents(paths: list[Path], work_dir: Path, sample_by: str):
    """The raw documents as a `datasets.Dataset` (one split)."""
    import datasets

    if paths[0].is_dir():
        try:
            data = datasets.load_from_disk(str(paths[0]))
        except (FileNotFoundError, ValueError) as error:
            raise SpecdecError(f"{paths[0]} is not a save_to_disk dataset: {str(error).splitlines()[0]}") from None
        if isinstance(data, datasets.DatasetDict):
            check("train" in data, f"{paths[0]} holds splits {', '.join(data)}; it needs a 'train' split")
            data = data["train"]
        return data
    builder = TEXT_SUFFIXES[paths[0].suffix.lower()]
    kwargs = {"sample_by": sample_by} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=[str(p) for p in paths], split="train",
                                     cache_dir=str(work_dir / "datasets"), **kwargs)
    except Exception as error:  # noqa: BLE001  parse errors of the builders: name the files, one line
        raise SpecdecError(f"cannot read {', '.join(map(str, paths))}: {str(error).splitlines()[0]}") from None


def tokenize_documents(documents, tokenizer: Any, *, text_field: str, chat: bool, messages_field: str,
                       add_eos: bool, num_proc: int | None):
    """documents -> a Dataset with one column `input_ids` (each document's ids, EOS appended)."""
    columns = set(documents.column_names)
    if chat:
        check(messages_field in columns or text_field in columns,
              f"data: chat documents need a {messages_field!r} or {text_field!r} field, found {sorted(columns)}")
        check(getattr(tokenizer, "chat_template", None), "data.chat=true needs a tokenizer with a chat template")
    else:
        check(text_field in columns,
              f"data.text_field {text_field!r} is not a field of the data; found {sorted(columns)}")
    eos = tokenizer.eos_token_id
    check(not add_eos or eos is not None, "data.add_eos=true needs a tokenizer with an eos_token")

    def encode(batch: dict[str, list]) -> dict[str, list]:
        n = len(next(iter(batch.values())))
        if chat:
            texts = []
            for i in range(n):
                messages = batch[messages_field][i] if messages_field in batch else None
                if not messages:
                    messages = [{"role": "user", "content": batch[text_field][i]}]
                texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]    # the template holds them
        else:
            ids = tokenizer([t or "" for t in batch[text_field]])["input_ids"]
        return {"input_ids": [x + [eos] if add_eos else x for x in ids]}

    return documents.map(encode, batched=True, remove_columns=documents.column_names, num_proc=num_proc,
                         load_from_cache_file=False, desc="tokenizing")


def write_windows(tokens, length: int, path: Path) -> int:
    """Concatenate the documents' ids and write windows of `length` tokens to an Arrow stream
    file at `path` (via a temporary name). Returns the number of windows."""
    import pyarrow as pa

    schema = pa.schema([("input_ids", pa.list_(pa.int32(), length))])
    tmp = path.with_name(f".tmp-{uuid.uuid4().hex}-{path.name}")
    count, carry = 0, np.zeros(0, dtype=np.int32)
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for batch in tokens.with_format("arrow").iter(batch_size=1024):
                flat = batch.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
                stream = np.concatenate([carry, flat.astype(np.int32)])
                whole = len(stream) // length
                if whole:
                    rows = pa.FixedSizeListArray.from_arrays(pa.array(stream[: whole * length]), length)
                    writer.write_batch(pa.record_batch([rows], schema=schema))
                    count += whole
                carry = stream[whole * length:]
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return count


class RandomRows(StepBatches):
    """Endless batches (batch_size, seq_len + 1) of random training windows (rows < `rows`);
    batch k depends only on (seed, rank, k)."""

    def __init__(self, windows, rows: int, batch_size: int, seed: int, rank: int, start: int) -> None:
        self.windows, self.rows, self.batch_size = windows, rows, batch_size
        self.seed, self.rank, self.start = seed, rank, start

    def batch(self, k: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, self.rank, k])
        index = rng.integers(0, self.rows, size=self.batch_size)
        return torch.from_numpy(self.windows[index.tolist()]["input_ids"].astype(np.int64))


class Rows(Dataset):
    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.array[i].astype(np.int64))


@dataclass(frozen=True)
class HFTextSettings:
    """The `data:` node of data=hf_text. `files`: local .txt / .json / .jsonl files or one
    save_to_disk directory; `tokenizer`: the model directory whose tokenizer to use (the
    teacher's); `sample_by`: line, paragraph or document (how the text builder splits .txt files
    into documents); `text_field`, or with `chat` the conversations of `messages_field`; `add_eos`
    after each document; the tokenized windows are kept in `windows_dir` (built with `num_proc`
    processes); training windows of `seq_len` + 1 tokens in batches of `batch_size`, `val_windows`
    validation windows in batches of `val_batch_size`, loader workers and seed."""

    files: str | Sequence[str] | None = None
    tokenizer: str | None = None
    seq_len: int = 512
    batch_size: int = 4
    val_windows: int = 64
    val_batch_size: int = 8
    text_field: str = "text"
    chat: bool = False
    messages_field: str = "messages"
    add_eos: bool = True
    sample_by: str = "line"
    windows_dir: str = "~/.cache/specdec/hf_text"
    num_proc: int | None = None
    num_workers: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "val_windows", "val_batch_size"):
            check_positive_int(getattr(self, name), f"data.{name}")
        check(isinstance(self.chat, bool) and isinstance(self.add_eos, bool),
              "data.chat and data.add_eos must be true or false")
        check(self.sample_by in ("line", "paragraph", "document"),
              f"data.sample_by must be line, paragraph or document, got {self.sample_by!r}")
        check(self.tokenizer is not None, "data.tokenizer must be a model directory (the teacher's)")
        check(isinstance(self.num_workers, int) and self.num_workers >= 0,
              f"data.num_workers must be >= 0, got {self.num_workers!r}")


class HFTextDataModule(SpecdecDataModule):
    def __init__(self, **settings: Any) -> None:
        """`settings`: the fields of `HFTextSettings` (the `data:` node, checked there)."""
        super().__init__()
        s = read_settings(HFTextSettings, type(self), settings)
        self.files, self.tokenizer_path = s.files, Path(s.tokenizer).expanduser()
        self.seq_len, self.batch_size, self.val_windows = s.seq_len, s.batch_size, s.val_windows
        self.val_batch_size = s.val_batch_size
        self.text_field, self.chat, self.messages_field = s.text_field, s.chat, s.messages_field
        self.add_eos = s.add_eos
        self.sample_by, self.windows_dir, self.num_proc = s.sample_by, Path(s.windows_dir).expanduser(), s.num_proc
        self.num_workers, self.seed = s.num_workers, s.seed
        self._tokenizer = None
        self._windows = None
        self.windows_path: Path | None = None
        self.built = False                   # whether this instance tokenized (False: the windows were reused)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_path, "tokenizer")
        return self._tokenizer

    def windows_key(self) -> str:
        settings = {"version": CACHE_VERSION, "length": self.seq_len + 1, "text_field": self.text_field,
                    "chat": self.chat, "messages_field": self.messages_field if self.chat else None,
                    "add_eos": self.add_eos, "sample_by": self.sample_by}
        key = {"tokenizer": tokenizer_fingerprint(self.tokenizer), "files": _files_fingerprint(_files_of(self.files)),
               "settings": settings}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]

    def prepare_data(self) -> None:
        """Tokenize and write the windows unless windows_dir already holds them."""
        paths = _files_of(self.files)
        directory = self.windows_dir / self.windows_key()
        path = directory / WINDOWS_FILE
        if not path.is_file():
            directory.mkdir(parents=True, exist_ok=True)
            documents = read_documents(paths, self.windows_dir, self.sample_by)
            tokens = tokenize_documents(documents, self.tokenizer, text_field=self.text_field, chat=self.chat,
                                        messages_field=self.messages_field, add_eos=self.add_eos,
                                        num_proc=self.num_proc)
            count = write_windows(tokens, self.seq_len + 1, path)
            info = {"windows": count, "length": self.seq_len + 1, "files": [str(p.resolve()) for p in paths],
                    "tokenizer": str(self.tokenizer_path.resolve())}
            (directory / "info.json").write_text(json.dumps(info, indent=1))
            self.built = True
        self.windows_path = path

    def windows(self):
        """All windows, memory-mapped: a numpy-formatted `datasets.Dataset` with `input_ids`."""
        if self._windows is None:
            import datasets

            if self.windows_path is None:
                self.prepare_data()
            windows = datasets.Dataset.from_file(str(self.windows_path)).with_format("numpy")
            check(len(windows) > self.val_windows,
                  f"data.files give {len(windows)} windows of {self.seq_len + 1} tokens; they must give more than "
                  f"data.val_windows = {self.val_windows} (some for training)")
            self._windows = windows
        return self._windows

    @property
    def train_rows(self) -> int:
        return len(self.windows()) - self.val_windows

    def validation_windows(self) -> np.ndarray:
        """The fixed validation windows (val_windows, seq_len + 1): the last ones of the data."""
        return self.windows()[self.train_rows:]["input_ids"]

    def setup(self, stage: str | None = None) -> None:
        self.windows()

    def train_dataloader(self) -> DataLoader:
        rank, start = stream_position(self.trainer)
        rows = RandomRows(self.windows(), self.train_rows, self.batch_size, self.seed, rank, start)
        return DataLoader(rows, batch_size=None, num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Rows(self.validation_windows()), batch_size=self.val_batch_size, shuffle=False)

    def prompts(self, count: int, length: int) -> torch.Tensor:
        """`count` fixed prompts (count, length) from the validation windows, for decoding evaluations."""
        return evenly_spaced_windows(self.validation_windows().reshape(-1), count, length)

    def decode_text(self, tokens: torch.Tensor) -> str:
        """Token ids (n,) as text (samples of the evaluation callback)."""
        return self.tokenizer.decode(tokens.tolist())
