"""The draft vocabulary of an EAGLE-3 head: which target tokens its LM head covers.

The draft only has to match the target, so the tokens worth covering are the target's own greedy
choices on the training data, not the data's raw token frequencies: `count_greedy_tokens` runs
the target's LM head over the last-layer hidden states a cache holds (at answer positions, up to
`positions` of them spread evenly over the rows) and counts each argmax. `write_counts` stores the
counts with the fingerprint of the tokenizer they were counted with (task=hf_eagle3 refuses a
count file of another tokenizer, `train.tasks.hf_eagle3.read_token_counts`), atomically.

`draft_vocab(DraftVocabJob(...))` (specdec draft-vocab, the recipe's draft_vocab step) counts
and writes them and reports, for each candidate size N, the coverage (the share of held-out greedy
tokens inside the N most counted) and the draft cost c (one head step with an N-row LM head over
one target step, timed side by side: `time_costs`), so the default size comes from measurements.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec_models.errors import check
from specdec_models.files import write_file
from specdec_models.hf import tokenizer_fingerprint, vocabulary_fingerprint

from .data.embeddings_cache import cache_rows, check_cache, open_cache
from .data.hf_embeddings import label_mask
from .plan import DRAFT_VOCAB_SIZES
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


@dataclass(frozen=True)
class DraftVocabJob:
    """What `draft_vocab` counts and writes: the cache (holding the target's last layer), the
    token-count file `out`, the target (None: the one the cache records), the candidate `sizes`,
    the cache's last `val_windows` rows held out for coverage, `positions` counted, the dtype c is
    timed in ("auto": the one decoding runs in here), `timing` (False: no c), `report` (also write
    coverage and c as JSON there), `force` (replace --out and --report)."""

    cache: str
    out: str
    target: str | None = None
    sizes: tuple[int, ...] = DRAFT_VOCAB_SIZES
    val_windows: int = 16
    positions: int = 65536
    dtype: str = "auto"
    timing: bool = True
    report: str | None = None
    force: bool = False

    def check(self) -> dict[str, Any]:
        """Every input checked before any model loads (one line); returns the cache's meta."""
        from specdec_models.cpu import parse_dtype
        from specdec_models.files import check_output

        out = Path(self.out).expanduser()
        check(not out.is_dir(), f"--out {self.out} is a directory: give the .json file to write")
        check_output(self.out, "--out", force=self.force, inputs=[self.cache, self.target])
        if self.report:
            check(out.resolve() != Path(self.report).expanduser().resolve(), "--report must be another file than --out")
            check_output(self.report, "--report", force=self.force, inputs=[self.cache, self.target])
        parse_dtype(self.dtype)
        check(all(n >= 1 for n in self.sizes), "--sizes must be positive")
        check(self.positions >= 1 and self.val_windows >= 1, "--positions and --val-windows must be >= 1")
        meta = check_cache(self.cache)
        check(meta["windows"] > self.val_windows, f"--val-windows {self.val_windows} leaves no training rows")
        too_big = [n for n in self.sizes if n >= meta.get("vocab_size", n + 1)]
        check(not too_big, f"--sizes {' '.join(map(str, too_big))}: a draft vocabulary is smaller than the target's "
                           f"{meta.get('vocab_size')} tokens (the full vocabulary is measured anyway)")
        check(self.target or meta["model"].get("path"), "the cache records no target path: give --target")
        return meta


@dataclass
class DraftVocabResult:
    """What `draft_vocab` wrote and measured: the count file, the dtype c was timed in, one row
    {"size", "coverage", "c" (None untimed)} per size (the last the full vocabulary), the greedy
    tokens counted on the `train_rows` and the `val_rows`."""

    counts: Path
    dtype: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    train_rows: int = 0
    val_rows: int = 0
    counted: int = 0
    held_out: int = 0

    def table(self) -> str:
        """The coverage and c of each size as a markdown table."""
        vocab = self.rows[-1]["size"]
        lines = [f"| draft vocabulary | coverage of held-out greedy tokens | c ({self.dtype} step ratio) |",
                 "|---|---|---|"]
        for r in self.rows:
            c = "" if r["c"] is None else f"{r['c']:.3f}"
            lines.append(f"| {r['size']:,}{' (full)' if r['size'] == vocab else ''} | {r['coverage']:.3f} | {c} |")
        return "\n".join(lines)


def draft_vocab(job: DraftVocabJob, progress=None) -> DraftVocabResult:
    """Count the target's greedy tokens on the cache's training rows (the count file) and on its
    held-out rows (the coverage of each size), time c, write job.out (and job.report)."""
    from specdec_models.cpu import resolve_dtype
    from specdec_models.heads.eagle3 import choose_draft_vocab
    from specdec_models.hf.weights import load_causal_lm, load_tokenizer

    meta = job.check()
    target_path = job.target or meta["model"].get("path")
    tokenizer = load_tokenizer(target_path, "target")
    dtype = resolve_dtype(job.dtype, "cpu")
    target = load_causal_lm(target_path, dtype=dtype, what="target")
    train_rows = np.arange(meta["windows"] - job.val_windows)
    val_rows = np.arange(meta["windows"] - job.val_windows, meta["windows"])
    counts = count_greedy_tokens(job.cache, target, train_rows, positions=job.positions, progress=progress)
    held = count_greedy_tokens(job.cache, target, val_rows, positions=1 << 30, progress=progress)
    vocab = counts.numel()
    sizes = sorted({n for n in job.sizes if n < vocab})
    costs = time_costs(target, sizes + [vocab]) if job.timing else {}
    result = DraftVocabResult(Path(job.out), "bf16" if dtype == torch.bfloat16 else "fp32",
                              train_rows=len(train_rows), val_rows=len(val_rows), counted=int(counts.sum()),
                              held_out=int(held.sum()))
    for n in sizes + [vocab]:
        covered = float(held[choose_draft_vocab(counts, n)].sum()) / max(float(held.sum()), 1.0)
        result.rows.append({"size": n, "coverage": covered, "c": costs.get(n)})
    write_counts(job.out, counts, tokenizer, {"cache": str(Path(job.cache).resolve()), "rows": len(train_rows)})
    if job.report:
        text = json.dumps({"dtype": str(dtype).removeprefix("torch."), "rows": result.rows}, indent=2)
        write_file(Path(job.report), lambda f: f.write(text.encode("utf-8")))
    return result


def time_costs(target, sizes: list[int], context: int = 200, repeats: int = 20) -> dict[int, float]:
    """{N: c} for an EAGLE-3 head whose LM head has N rows (N = the target's vocabulary too),
    interleaved with 1-token target steps on a `context`-token cache; medians of `repeats`."""
    from specdec_models.heads.eagle3 import Eagle3Config, Eagle3Head
    from specdec_models.hf import HFDecoder

    dec = HFDecoder(target)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, dec.vocab_size, (1, context), generator=g)
    cache = dec.new_cache(1, context + 2, keep_layers=[0, 1, 2])
    dec(ctx, cache=cache)
    heads = {}
    for n in sizes:
        head = Eagle3Head(Eagle3Config.for_target(target, draft_vocab_size=n, aux_layers=[0, 1, 2]), target).eval()
        hcache = head.new_cache(1, context + 2)
        feature = head.extend(ctx[:, 1:], head.fuse(cache.layer_states[:, :-1]), hcache)[:, -1:]
        heads[n] = (head, hcache, feature)
    times: dict[str, list[float]] = {}
    tok = ctx[:, :1]
    with torch.inference_mode():
        for _ in range(repeats + 2):
            length = cache.lengths.clone()
            t0 = time.perf_counter()
            dec(tok, cache=cache, logits_at=torch.zeros(1, dtype=torch.long))
            times.setdefault("target", []).append(time.perf_counter() - t0)
            cache.rollback(length)
            for n, (head, hcache, feature) in heads.items():
                length = hcache.lengths.clone()
                t0 = time.perf_counter()
                head.logits(head.extend(tok, feature, hcache)[:, -1])
                times.setdefault(n, []).append(time.perf_counter() - t0)
                hcache.rollback(length)
    step = statistics.median(times["target"][2:])
    return {n: statistics.median(times[n][2:]) / step for n in sizes}
