"""The DataModule of a prophet trained from the embeddings cache (`data=enwik8_embeddings`).

The enwik8 DataModule (validation, test windows and prompts unchanged, so validation numbers
compare with online runs) whose training batches are dicts {"tokens": (b, seq_len + 1) int64,
"embeds": (b, seq_len, dim) bf16 or fp16, and when cached "topk_values" (b, seq_len, K) fp16,
"topk_indices" (b, seq_len, K) int64} drawn from an embeddings cache (`train.data.embeddings_cache`,
written by `specdec cache`). Batch k of process `rank` is a pure function of
(seed, rank, k), as for enwik8, so a resumed run continues the same stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from specdec_models.errors import check

from .embeddings_cache import HOW_TO_BUILD, cache_rows, check_cache, open_cache
from .enwik8 import Enwik8DataModule
from .streams import StepBatches, stream_position


class CachedWindows(StepBatches):
    """Endless training batches from a cache's first `count` rows (default: all). Sample
    g = (k * batch_size + j) * world + rank of batch k is row perm_e[g mod N] with e = g // N and
    perm_e a permutation seeded by (seed, e): each pass over the rows visits every one once, ranks
    see disjoint rows, and batch k depends only on (seed, rank, k)."""

    def __init__(self, cache: Path, meta: dict[str, Any], batch_size: int, seed: int, rank: int, world: int,
                 start: int, count: int | None = None) -> None:
        self.cache, self.meta, self.batch_size = cache, meta, batch_size
        self.seed, self.rank, self.world, self.start = seed, rank, world, start
        self.count = meta["windows"] if count is None else count
        self._perms: dict[int, np.ndarray] = {}
        self._dataset = None

    def rows(self, k: int) -> np.ndarray:
        n = self.count
        g = (k * self.batch_size + np.arange(self.batch_size)) * self.world + self.rank
        rows = np.empty(self.batch_size, dtype=np.int64)
        for epoch in (int(e) for e in np.unique(g // n)):
            if epoch not in self._perms:              # keep one pass's permutation at a time
                self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(n)}
            here = g // n == epoch
            rows[here] = self._perms[epoch][g[here] % n]
        return rows

    def batch(self, k: int) -> dict[str, Any]:
        if self._dataset is None:                         # opened per worker: memory maps do not pickle
            self._dataset = open_cache(self.cache, self.meta)
        return cache_rows(self._dataset, self.rows(k), self.meta, top_k=self.meta["top_k_logits"] > 0)


class EmbeddingsDataModule(Enwik8DataModule):
    def __init__(self, cache: str | None = None, export: str | None = None, **kwargs: Any) -> None:
        """enwik8 (all of Enwik8DataModule's arguments) with training batches from the embeddings
        cache `cache`, which must hold data.seq_len windows and, when `export` is given, come from
        that export's main model (checked by weights hash). The batches carry the cache's top-k
        logits too when it has them."""
        super().__init__(**kwargs)
        check(bool(cache), f"data.cache is not set: give the embeddings cache directory ({HOW_TO_BUILD})")
        self.cache = Path(cache).expanduser()
        self.export = export
        self._meta: dict[str, Any] | None = None

    def cache_meta(self) -> dict[str, Any]:
        """The checked metadata of the cache (checked once)."""
        if self._meta is None:
            from specdec_models.export import export_hash

            sha = export_hash(self.export) if self.export else None
            self._meta = check_cache(self.cache, weights_sha256=sha, seq_len=self.seq_len, model="main.export")
        return self._meta

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if stage in (None, "fit"):
            open_cache(self.cache, self.cache_meta())    # a damaged dataset stops the run here

    def train_dataloader(self) -> DataLoader:
        rank, start = stream_position(self.trainer)
        world = self.trainer.world_size if self.trainer is not None else 1
        windows = CachedWindows(self.cache, self.cache_meta(), self.batch_size, self.seed, rank, world, start)
        return DataLoader(windows, batch_size=None, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)
