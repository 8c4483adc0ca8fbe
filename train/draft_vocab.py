"""The draft vocabulary of an EAGLE-3 head: which target tokens its LM head covers.

The draft only has to match the target, so the tokens worth covering are the target's own greedy
choices on the training data, not the data's raw token frequencies: `count_greedy_tokens` runs
the target's LM head over the last-layer hidden states a cache holds (at answer positions, up to
`positions` of them spread evenly over the rows) and counts each argmax. `write_counts` stores the
counts with the fingerprint of the tokenizer they were counted with (task=hf_eagle3 refuses a
count file of another tokenizer, `train.tasks.hf_eagle3.read_token_counts`), atomically.

`scripts/draft_vocab.py` reports, for each candidate size N, the coverage (the share of held-out
greedy tokens inside the N most counted) and the draft cost c (one head step with an N-row LM
head over one target step, timed side by side), so the default size comes from measurements.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec_models.errors import check
from specdec_models.files import write_file
from specdec_models.hf import tokenizer_fingerprint, vocabulary_fingerprint

from .data.embeddings_cache import cache_rows, check_cache, open_cache
from .data.hf_embeddings import label_mask
from .tasks.hf_eagle3 import COUNTS_FORMAT


@torch.no_grad()
def count_greedy_tokens(cache: str | os.PathLike, target: Any, rows: np.ndarray, *, positions: int = 65536,
                        batch: int = 16, progress=None) -> torch.Tensor:
    """Counts (vocab,) of the target's greedy tokens at the answer positions of cache rows `rows`
    (every position of text windows), at most `positions` of them (every k-th). Of a cache with
    more than 4 x `positions` token positions only every j-th row is read (evenly spaced, at least
    4 x `positions` positions): a large cache costs no more than a small one."""
    meta = check_cache(cache)
    rows = np.asarray(rows)[:: max(1, len(rows) * int(meta["seq_len"]) // (4 * positions))]
    layers = [int(i) for i in meta["layers"]]
    depth = int(meta.get("depth", layers[-1]))
    check(depth in layers, f"{cache} holds hidden states of layers {layers}, not the last one ({depth}): the "
                           f"target's greedy tokens need it (rebuild with --layers ... {depth})")
    dataset = open_cache(cache, meta)
    head = target.get_output_embeddings()
    vocab = int(head.weight.shape[0])
    counts = torch.zeros(vocab, dtype=torch.long)
    total = len(rows) * meta["seq_len"]
    stride = max(1, total // positions)
    seen = 0
    for i in range(0, len(rows), batch):
        b = cache_rows(dataset, rows[i:i + batch], meta)
        last = b["embeds"].unflatten(-1, (len(layers), -1))[..., layers.index(depth), :]        # (b, n, H)
        mask = label_mask(b, last.shape[1])
        keep = torch.ones(last.shape[:2], dtype=torch.bool) if mask is None else mask
        flat = last[keep]
        index = torch.arange(seen, seen + flat.shape[0])
        seen += flat.shape[0]
        flat = flat[index % stride == 0]
        if flat.numel():
            greedy = torch.nn.functional.linear(flat.to(head.weight), head.weight).argmax(-1)
            counts += torch.bincount(greedy.cpu(), minlength=vocab)
        if progress is not None:
            progress(len(rows[i:i + batch]))
    return counts


def write_counts(path: str | os.PathLike, counts: torch.Tensor, tokenizer: Any, source: dict[str, Any]) -> Path:
    """Write a token-count file (read by task=hf_eagle3's head.draft_vocab) atomically."""
    path = Path(path).expanduser()
    data = {"format": COUNTS_FORMAT, "vocabulary_sha256": vocabulary_fingerprint(tokenizer),
            "tokenizer_sha256": tokenizer_fingerprint(tokenizer), "source": source, "total": int(counts.sum()),
            "counts": counts.tolist()}
    text = json.dumps(data)
    write_file(path, lambda f: f.write(text.encode("utf-8")))
    return path
