"""The DataModule of a prophet head trained from a Hugging Face target's hidden-state cache
(`data=hf_embeddings`, task=hf_prophet).

The cache (`train.data.embeddings_cache`, written by `specdec cache --hf-model DIR |
--gguf FILE`) holds rows of token ids and the target's hidden states at the layers it was built
with (`cache_meta()["layers"]`: `hidden_states` indices, default the last layer only): token
windows of text, or prompts continued by the target itself (`train.data.regenerate`). Its last
`val_windows` rows are the fixed validation set (the same at every validation, so numbers compare
across steps), the others the training rows, followed by every row of the `extra_caches` (more
caches of the same target and settings, e.g. fresh answers built with `--exclude-prompts-of`; one
that continues a validation row's prompt is refused); `train_windows` keeps the first that many.
Batch k of rank r is a pure function of (seed, r, k), so a resumed run continues the same stream
(`train.data.embeddings.CachedWindows`). Batches are
dicts {"tokens": (b, seq_len + 1) int64, "embeds": (b, seq_len, len(layers) * dim), the layers
concatenated in cache_meta()["layers"]' order} (bfloat16 or float16 as stored; an int8 cache
dequantized to float32 with its per-token, per-layer scales), plus "prompt_len" and "valid_len"
(b,) for regenerated rows (the prompt's tokens; the real tokens, prompt + answer up to its stop
token, the rest being padding).

The evaluation callback's prompts: for regenerated rows, each of `count` evenly spaced validation
rows' own prompt (its first prompt_len tokens, e.g. a chat prompt up to the assistant's turn), so
the callback decodes what the target is asked at inference; for text windows, fixed windows of
the validation tokens. Text is shown with the tokenizer of `tokenizer` (default: the target the
cache was made by).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from specdec_models.errors import check, check_positive_int
from specdec_models.hf import load_tokenizer

from .embeddings import CachedWindows
from .embeddings_cache import HOW_TO_BUILD, cache_rows, check_cache, open_cache
from .streams import SpecdecDataModule, evenly_spaced_windows, stream_position


class ValidationRows(Dataset):
    """The cache's last `count` rows, in batches of `batch_size` (one item per batch)."""

    def __init__(self, cache: Path, meta: dict[str, Any], count: int, batch_size: int) -> None:
        self.cache, self.meta = cache, meta
        first = meta["windows"] - count
        self.batches = [np.arange(i, min(i + batch_size, meta["windows"])) for i in range(first, meta["windows"],
                                                                                           batch_size)]
        self._dataset = None

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self._dataset is None:
            self._dataset = open_cache(self.cache, self.meta)
        return cache_rows(self._dataset, self.batches[i], self.meta)


class TrainingRows(CachedWindows):
    """Training batches from one cache or several (`CachedWindows`' stream over all their training
    rows): training row i is row i of the first cache while i < its rows less the `val_windows`
    held out at its end, then the rows of the others in turn (all of them train)."""

    def __init__(self, caches: list[Path], metas: list[dict[str, Any]], val_windows: int, batch_size: int, seed: int,
                 rank: int, world: int, start: int, count: int) -> None:
        super().__init__(caches[0], metas[0], batch_size, seed, rank, world, start, count=count)
        self.caches, self.metas = caches, metas
        self.first_train = metas[0]["windows"] - val_windows
        self.val_windows = val_windows

    def batch(self, k: int) -> dict[str, Any]:
        if self._dataset is None:                         # opened per worker: memory maps do not pickle
            from datasets import concatenate_datasets

            parts = [open_cache(cache, meta) for cache, meta in zip(self.caches, self.metas, strict=True)]
            self._dataset = parts[0] if len(parts) == 1 else concatenate_datasets(parts).with_format("arrow")
        rows = self.rows(k)
        rows = np.where(rows < self.first_train, rows, rows + self.val_windows)   # past the first's held-out rows
        return cache_rows(self._dataset, rows, self.meta)


def check_extra_cache(extra: Path, meta: dict[str, Any], cache: Path, seq_len: int) -> dict[str, Any]:
    """The checked metadata of an extra training cache: it must hold what `cache` (metadata
    `meta`) holds, the same target's hidden states at the same layers, dtype and seq_len, in rows
    of the same kind (regenerated answers or text windows), else one line says what differs."""
    found = check_cache(extra, seq_len=seq_len)
    for key, what in [("layers", "layers"), ("dtype", "dtype"), ("dim", "width")]:
        check(found[key] == meta[key], f"data.extra_caches: {extra} holds {what} {found[key]}, data.cache {cache} "
                                       f"{meta[key]}: an extra cache must be built with the same settings")
    check(found["model"].get("weights_sha256") == meta["model"].get("weights_sha256"),
          f"data.extra_caches: {extra} was made by another target than data.cache {cache} (weights sha256 "
          f"{str(found['model'].get('weights_sha256'))[:16]}... "
          f"against {str(meta['model'].get('weights_sha256'))[:16]}...)")
    kinds = [m.get("source", {}).get("kind") for m in (found, meta)]
    check(kinds[0] == kinds[1], f"data.extra_caches: {extra} holds {kinds[0]} rows, data.cache {cache} {kinds[1]} "
                                f"rows: train from caches of one kind")
    return found


class HFEmbeddingsDataModule(SpecdecDataModule):
    def __init__(self, cache: str | None = None, tokenizer: str | None = None, seq_len: int = 256,
                 batch_size: int = 8, val_windows: int = 16, val_batch_size: int = 8, num_workers: int = 0,
                 seed: int = 0, train_windows: int | None = None, extra_caches: Sequence[str] = ()) -> None:
        """`cache`: the cache directory; `tokenizer`: a model directory or GGUF file whose
        tokenizer shows tokens as text (None: the cache's target); `val_windows`: the cache's last
        rows held out for validation; `extra_caches`: more caches of the same target, layers,
        seq_len, dtype and kind of rows (e.g. fresh answers, `specdec cache
        --exclude-prompts-of CACHE`), every row of which trains, after `cache`'s training rows;
        `train_windows`: train on the first that many of those rows only (None: all of them), e.g.
        to measure what more rows are worth against the same validation rows."""
        super().__init__()
        check(bool(cache), f"data.cache is not set: give the hidden-state cache directory ({HOW_TO_BUILD})")
        for name, value in [("seq_len", seq_len), ("batch_size", batch_size), ("val_windows", val_windows),
                            ("val_batch_size", val_batch_size)]:
            check_positive_int(value, f"data.{name}")
        if train_windows is not None:
            check_positive_int(train_windows, "data.train_windows")
        check(isinstance(num_workers, int) and num_workers >= 0, f"data.num_workers must be >= 0, got {num_workers!r}")
        check(isinstance(extra_caches, Sequence) and not isinstance(extra_caches, str),
              f"data.extra_caches must be a list of cache directories, got {extra_caches!r}")
        self.cache = Path(cache).expanduser()
        self.extra_caches = [Path(c).expanduser() for c in extra_caches]
        self.tokenizer_path = tokenizer
        self.seq_len, self.batch_size = seq_len, batch_size
        self.val_windows, self.val_batch_size = val_windows, val_batch_size
        self.num_workers, self.seed, self.train_windows = num_workers, seed, train_windows
        self._meta: dict[str, Any] | None = None
        self._extra_metas: list[dict[str, Any]] = []
        self._train_rows = 0
        self._tokenizer = None
        self._validation: dict[str, torch.Tensor] | None = None

    def cache_meta(self) -> dict[str, Any]:
        """The checked metadata of the cache (checked once), with "layers" (its hidden-state
        indices, in the order of "embeds") and "dim" (per layer); the run's task checks whose it is
        and, with `check_cache(..., layers=...)`, that it holds the layers its head reads."""
        if self._meta is None:
            meta = check_cache(self.cache, seq_len=self.seq_len)
            check(meta["model"]["kind"] == "hf", f"{self.cache} caches a specdec export's embeddings: train from it "
                                                 f"with task=prophet_frozen data=enwik8_embeddings")
            check(meta["windows"] > self.val_windows, f"data.val_windows ({self.val_windows}) must be fewer than the "
                                                      f"{meta['windows']} rows of {self.cache} (some for training)")
            extras = [check_extra_cache(extra, meta, self.cache, self.seq_len) for extra in self.extra_caches]
            if extras and meta.get("source", {}).get("kind") == "regenerated":
                self._check_no_held_out_prompt(meta)
            rows = meta["windows"] - self.val_windows + sum(m["windows"] for m in extras)
            where = str(self.cache) + (" and data.extra_caches" if extras else "")
            check(self.train_windows is None or self.train_windows <= rows,
                  f"data.train_windows ({self.train_windows}) exceeds the {rows} training rows of {where} "
                  f"(data.val_windows = {self.val_windows} of {self.cache}'s {meta['windows']} held out)")
            self._meta, self._extra_metas = meta, extras
            self._train_rows = rows if self.train_windows is None else self.train_windows
        return self._meta

    def _check_no_held_out_prompt(self, meta: dict[str, Any]) -> None:
        """Refuse an extra cache that continues a prompt of the validation rows: its answers would
        train on what validation measures."""
        from .regenerate import continued_prompts

        held = continued_prompts(self.cache, range(meta["windows"] - self.val_windows, meta["windows"]))
        for extra in self.extra_caches:
            shared = held & continued_prompts(extra)
            check(not shared, f"data.extra_caches: {extra} continues {len(shared)} of the prompts of the "
                              f"{self.val_windows} validation rows of {self.cache}: rebuild it with "
                              f"--exclude-prompts-of {self.cache}")

    @property
    def train_rows(self) -> int:
        """The rows training draws from: the first train_windows (default: all) of the cache's
        rows but the validation ones, then the extra caches' rows."""
        self.cache_meta()
        return self._train_rows

    def setup(self, stage: str | None = None) -> None:
        open_cache(self.cache, self.cache_meta())        # a damaged dataset stops the run here
        for extra, meta in zip(self.extra_caches, self._extra_metas, strict=True):
            open_cache(extra, meta)

    def train_dataloader(self) -> DataLoader:
        rank, start = stream_position(self.trainer)
        world = self.trainer.world_size if self.trainer is not None else 1
        rows = TrainingRows([self.cache, *self.extra_caches], [self.cache_meta(), *self._extra_metas],
                            self.val_windows, self.batch_size, self.seed, rank, world, start, count=self.train_rows)
        return DataLoader(rows, batch_size=None, num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        rows = ValidationRows(self.cache, self.cache_meta(), self.val_windows, self.val_batch_size)
        return DataLoader(rows, batch_size=None, shuffle=False)

    def validation_batch(self) -> dict[str, torch.Tensor]:
        """All validation rows as one batch (read once)."""
        if self._validation is None:
            meta = self.cache_meta()
            rows = np.arange(meta["windows"] - self.val_windows, meta["windows"])
            self._validation = cache_rows(open_cache(self.cache, meta), rows, meta)
        return self._validation

    def prompts(self, count: int, length: int) -> torch.Tensor | list[torch.Tensor]:
        """`count` fixed prompts: validation rows' own prompts when the rows have them (1-D
        tensors of their own lengths), else windows (count, length) of the validation tokens."""
        rows = self.validation_batch()
        if "prompt_len" in rows:
            check(count <= len(rows["tokens"]), f"{count} prompts need as many validation rows; data.val_windows is "
                                                f"{len(rows['tokens'])}")
            pick = np.linspace(0, len(rows["tokens"]) - 1, count).round().astype(int)
            return [rows["tokens"][i, : int(rows["prompt_len"][i])] for i in pick]
        return evenly_spaced_windows(rows["tokens"].numpy().reshape(-1), count, length)

    def decode_text(self, tokens: torch.Tensor) -> str:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_path or self.cache_meta()["model"]["path"], "tokenizer")
        return self._tokenizer.decode(tokens.tolist())


def label_mask(batch: dict[str, torch.Tensor], n: int) -> torch.Tensor | None:
    """(b, n) whether the target's prediction at position j (of token j + 1) is trained on: token
    j + 1 is an answer token (`loss_mask[:, j + 1]` of conversation rows; else at or past
    `prompt_len` and before `valid_len`); None: all."""
    if "loss_mask" in batch:
        return batch["loss_mask"][:, 1:n + 1].bool()
    if "prompt_len" not in batch and "valid_len" not in batch:
        return None
    b = batch["tokens"].shape[0]
    nxt = torch.arange(1, n + 1, device=batch["tokens"].device).expand(b, n)
    mask = torch.ones(b, n, dtype=torch.bool, device=nxt.device)
    if "prompt_len" in batch:
        mask &= nxt >= batch["prompt_len"].to(nxt.device)[:, None]
    if "valid_len" in batch:
        mask &= nxt < batch["valid_len"].to(nxt.device)[:, None]
    return mask
