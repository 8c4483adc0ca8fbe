"""The embeddings cache: a frozen model's hidden states of training rows, on disk.

A prophet trained on a frozen model (task=prophet_frozen on a specdec export, task=hf_prophet on a
Hugging Face target) reads that model's last-layer hidden states of each training row; an
EAGLE-3-class head also reads a few earlier layers ("aux" layers). They can be computed on the
fly, or once, ahead of training, by `specdec cache`, which runs the model over N rows
and stores, per row, the hidden states of `layers` (Hugging Face `hidden_states` indices, 0..depth:
i is the input of decoder layer i, 0 the embedding output, depth the last layer after the final
norm, the head's input; default [depth] only), all from one forward pass (regenerated rows:
from the passes that generated them, `RowSource`):

    tokens        seq_len + 1 token ids (uint8 for bytes, uint16 up to 65,536 tokens, else int32)
    embeds        (seq_len, len(layers), dim) hidden states of tokens[:seq_len], row-major,
                  flattened: bfloat16 (stored as its uint16 bits), float16, or int8 with
    scales        (seq_len, len(layers)) float32, int8 only: per token and per layer, embeds =
                  int8 x scale with scale = the absmax of that layer's dim values / 127 (each
                  layer its own scale: middle layers carry a few massive activations, which one
                  shared scale would let flatten every other layer's values to a few levels)
    topk_values   (seq_len, K) the model's K largest logits per position (float16), optional
    topk_indices  (seq_len, K) their token ids
    offset        where the row came from: a byte offset in the training split, a text window's
                  index, a prompt's index (int64)
    prompt_len    for rows that are a prompt and the model's continuation (`train.data.regenerate`):
                  the prompt's length in tokens (int32)
    valid_len     for those rows too: the real tokens among the seq_len + 1 (prompt + answer up to
                  and including its end-of-turn token); the rest is padding (int32)
    loss_mask     for conversation rows (`train.data.chat_rows`): seq_len + 1 uint8, 1 on every
                  assistant turn's tokens (its end-of-turn token included), 0 elsewhere

A batch (`cache_rows`) holds "embeds" (b, seq_len, len(layers) * dim), the layers concatenated in
cache.json's order, so a one-layer cache reads as (b, seq_len, dim). cache.json records "layers"
(non-negative, in the order given), "dim" (the hidden size, per layer) and "depth" (the model's
number of layers); a format-3 cache (last layer only, no "layers") reads as layers [depth].

What the rows are is the source's (`RowSource`): random byte windows of a text for a specdec
export (`build_cache`), token windows of text files or prompts continued by the target itself for
a Hugging Face model (`train.data.regenerate.build_hf_cache`). The model is identified by the sha256 of
its weights (the export's weights file; `specdec_models.hf.weights_sha256` of a Hugging Face model): a
cache is refused for any other model.

On disk, Hugging Face `datasets` Arrow files read memory-mapped:

    CACHE_DIR/cache.json                  format, version, the model's identity, settings, file sizes
    CACHE_DIR/dataset/data-00000.arrow    shards of consecutive rows

A build writes into CACHE_DIR.partial (`partial`: the protocol the answers share): build.json
first (the settings and the model's identity), then each shard under a temporary name, renamed
when complete, cache.json last, and the directory is renamed to CACHE_DIR (`files.replace_dir`).
So CACHE_DIR is absent or complete, and a killed build keeps its finished shards: the same command
resumes it and computes only the missing ones. Rows are a pure function of the settings, so a
resumed build writes what an uninterrupted one does. A partial build made with other settings is
refused in one line (overwrite starts over).

`train.data.embeddings.EmbeddingsDataModule` (`data=enwik8_embeddings`) and
`train.data.hf_embeddings.HFEmbeddingsDataModule` (`data=hf_embeddings`) train from it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from specdec_models.errors import SpecdecError, check
from specdec_models.export import read_json_object
from specdec_models.files import temp_path, write_file

from .enwik8 import ENWIK8_BYTES, read_bytes, split_bounds
from .partial import finalize, open_partial
from .streams import window_batch

CACHE_FORMAT = "specdec-embeddings-cache"
CACHE_VERSION = 4          # 4: several layers per row (int8 scales per token and layer), valid_len of regenerated rows
READ_VERSIONS = (3, 4)     # 3: any vocabulary, int8 with per-token scales, the model's identity, resumable builds
META_NAME = "cache.json"
DATASET_DIR = "dataset"
MASK = "mask"              # a RowSource column kind: seq_len + 1 uint8 per row (a per-token loss mask)
DTYPES = ("bfloat16", "float16", "int8")      # names as in specdec_models.config.DTYPES, plus int8
HOW_TO_BUILD = ("build one with specdec cache (--export MAIN_EXPORT --data DATA, or --hf-model DIR / "
                "--gguf FILE) --out CACHE_DIR")


# ---------------------------------------------------------------- stored columns

def token_type(vocab_size: int) -> str:
    """The smallest Arrow integer type that holds every token id of a vocabulary."""
    return "uint8" if vocab_size <= 256 else "uint16" if vocab_size <= 65536 else "int32"


def pack_embeds(embeds: torch.Tensor, dtype: str, layers: int = 1) -> dict[str, np.ndarray]:
    """(b, n, layers * d) hidden states -> stored columns: {"embeds": (b, n * layers * d)} as
    bfloat16 bits (uint16), float16 or int8, and for int8 {"scales": (b, n * layers)} float32, one
    per token and layer."""
    b, n = embeds.shape[:2]
    if dtype == "int8":
        x = embeds.detach().float().view(b, n, layers, -1)                                   # (b, n, k, d)
        scale = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127    # (b, n, k, 1)
        values = (x / scale).round().clamp(-127, 127).to(torch.int8)
        return {"embeds": values.cpu().numpy().reshape(b, -1), "scales": scale.cpu().numpy().reshape(b, -1)}
    if dtype == "bfloat16":
        bits = embeds.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    else:
        bits = embeds.detach().to(torch.float16).cpu().numpy()
    return {"embeds": bits.reshape(b, -1)}


def unpack_embeds(values: np.ndarray, dtype: str, seq_len: int, scales: np.ndarray | None = None,
                  layers: int = 1) -> torch.Tensor:
    """Stored columns -> (b, n, layers * d): bfloat16 or float16 exactly as stored; int8
    dequantized to float32 with each token's and layer's scale."""
    values = np.array(values, copy=True)                      # Arrow buffers are read-only
    if dtype == "bfloat16":
        tensor = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(values)
    tensor = tensor.view(values.shape[0], seq_len, -1)
    if dtype == "int8":
        check(scales is not None, "an int8 cache needs its scales column")
        b = values.shape[0]
        scale = torch.from_numpy(np.array(scales, dtype=np.float32)).view(b, seq_len, layers, 1)
        tensor = (tensor.view(b, seq_len, layers, -1).float() * scale).view(b, seq_len, -1)
    return tensor


def row_bytes(seq_len: int, dim: int, dtype: str, top_k: int, vocab_size: int, columns: dict[str, str],
              layers: int = 1) -> int:
    """Bytes one row takes in the Arrow files (values only)."""
    width = {"uint8": 1, "uint16": 2, "int32": 4, "int64": 8, MASK: seq_len + 1}
    tokens = (seq_len + 1) * width[token_type(vocab_size)]
    embeds = seq_len * layers * (dim * (1 if dtype == "int8" else 2) + (4 if dtype == "int8" else 0))
    topk = seq_len * top_k * (2 + (1 if vocab_size <= 256 else 4))          # float16 values, uint8 / int32 ids
    return tokens + embeds + topk + sum(width[t] for t in columns.values())


def _features(seq_len: int, dim: int, dtype: str, top_k: int, vocab_size: int, columns: dict[str, str],
              layers: int = 1):
    from datasets import Features, List, Value

    stored = {"bfloat16": "uint16", "float16": "float16", "int8": "int8"}[dtype]
    features = {"tokens": List(Value(token_type(vocab_size)), length=seq_len + 1),
                "embeds": List(Value(stored), length=seq_len * layers * dim)}
    if dtype == "int8":
        features["scales"] = List(Value("float32"), length=seq_len * layers)
    if top_k:
        features["topk_values"] = List(Value("float16"), length=seq_len * top_k)
        features["topk_indices"] = List(Value("uint8" if vocab_size <= 256 else "int32"), length=seq_len * top_k)
    features.update({name: List(Value("uint8"), length=seq_len + 1) if kind == MASK else Value(kind)
                     for name, kind in columns.items()})
    return Features(features)


def _fixed_lists(rows: np.ndarray):
    """(b, L) array -> Arrow fixed-size-list array of b rows (no copy of the values)."""
    import pyarrow as pa

    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(rows).reshape(-1)), rows.shape[1])


# ---------------------------------------------------------------- what is cached

def normalize_layers(layers: Sequence[int], depth: int) -> list[int]:
    """Hidden-state indices of a model of `depth` layers (0..depth; negative ones counted from the
    end, as Python does: -1 is depth), checked (one line) and made non-negative, in the order given."""
    check(len(layers) > 0, "layers must name at least one hidden-state index")
    check(all(isinstance(i, int) and not isinstance(i, bool) for i in layers),
          f"layers must be integers, got {list(layers)!r}")
    check(all(-(depth + 1) <= i <= depth for i in layers),
          f"layers {list(layers)} out of range: a model of {depth} layers has hidden states 0..{depth} "
          f"(or -{depth + 1}..-1)")
    found = [i % (depth + 1) for i in layers]
    check(len(set(found)) == len(found), f"layers {list(layers)} name a hidden state twice ({found})")
    return found


@dataclass(frozen=True)
class CacheModel:
    """The frozen model a cache is made by. identity: {"kind", "path", "weights_sha256", ...} (what
    cache.json records and a run checks); hidden(tokens (b, n)) -> (b, n, len(layers) * dim), the
    hidden states of `layers` (normalized indices 0..depth) concatenated in that order;
    logits(hidden) -> (b, n, vocab) or None when the cache offers no top-k logits for this kind of
    model (top-k logits need layers == [depth])."""

    identity: dict[str, Any]
    dim: int
    vocab_size: int
    max_seq_len: int
    hidden: Callable[[torch.Tensor], torch.Tensor]
    logits: Callable[[torch.Tensor], torch.Tensor] | None = None
    depth: int = 0
    layers: tuple[int, ...] = ()


class RowSource:
    """The rows a cache holds: `rows(start, count)` -> (tokens (count, seq_len + 1) int64, extra
    columns {name: (count,) array} of the types in `columns`), a pure function of the source's
    settings (`describe()`, plain JSON) and `start`, so a resumed build recomputes the same rows.
    A source that runs the model itself (regenerated rows) may add "embeds" to the extra columns:
    the hidden states (count, seq_len, len(layers) * dim) of tokens[:, :seq_len] at the cache's
    layers, which `write_cache` then stores as they are, without calling the model's hidden()."""

    vocab_size: int
    columns: ClassVar[dict[str, str]] = {"offset": "int64"}

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def rows(self, start: int, count: int) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        raise NotImplementedError


class ByteWindows(RowSource):
    """Random windows of seq_len + 1 bytes of the 90% training split of a text (enwik8's split):
    offsets drawn as `RandomWindows` does, seeded."""

    vocab_size = 256

    def __init__(self, data: Path, seq_len: int, windows: int, seed: int) -> None:
        self.data, self.seed = Path(data).expanduser(), seed
        check(self.data.is_file(), f"data {self.data} does not exist or is not a file")
        tokens = read_bytes(self.data)[:ENWIK8_BYTES]
        self.data_bytes = len(tokens)
        self.train = tokens[:split_bounds(len(tokens))[0]]
        check(len(self.train) > seq_len + 1, f"{data}: the training split ({len(self.train):,} bytes) is shorter than "
                                             f"one window of seq_len + 1 = {seq_len + 1}")
        self.seq_len = seq_len
        self.offsets = np.random.default_rng(seed).integers(0, len(self.train) - seq_len, size=windows)

    def describe(self) -> dict[str, Any]:
        return {"kind": "byte_windows", "data": str(self.data.resolve()), "data_bytes": self.data_bytes,
                "split": "train"}

    def rows(self, start: int, count: int) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        part = self.offsets[start:start + count]
        return window_batch(self.train, part, self.seq_len + 1), {"offset": part.astype(np.int64)}


# ---------------------------------------------------------------- writing

def _shard_name(k: int) -> str:
    return f"{DATASET_DIR}/data-{k:05d}.arrow"


def shard_size_bytes(shard_size: str | int) -> int:
    """A shard size given as bytes or like 500MB / 1GB."""
    from datasets.utils.py_utils import convert_file_size_to_int

    try:
        size = convert_file_size_to_int(int(shard_size) if str(shard_size).isdigit() else shard_size)
    except (ValueError, AttributeError):
        raise SpecdecError(f"shard size must be bytes or like 500MB / 1GB, got {shard_size!r}") from None
    check(size > 0, f"shard size must be > 0, got {size}")
    return size


def check_build(out: str | os.PathLike, *, seq_len: int, windows: int, dtype: str, top_k_logits: int,
                batch_size: int, overwrite: bool) -> Path:
    """The settings every build shares and its output folder, checked before any work (one line)."""
    out = Path(out).expanduser()
    for name, value in [("seq_len", seq_len), ("windows", windows), ("batch_size", batch_size)]:
        check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
              f"{name} must be a positive integer, got {value!r}")
    check(dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check(isinstance(top_k_logits, int) and top_k_logits >= 0, f"top-k-logits must be >= 0, got {top_k_logits!r}")
    if out.exists():
        check(overwrite, f"{out} already exists: pass --overwrite to replace it, or another --out")
        check(out.is_dir() and ((out / META_NAME).is_file() or not any(out.iterdir())),
              f"{out} is not an embeddings cache: --overwrite replaces only a cache, choose another --out")
    return out


def last_batch_rows(seconds_left: float, batch_seconds: float, batch_rows: int, batch_size: int) -> int:
    """The rows of a last batch that should end within `seconds_left`, at the time per row of the
    previous batch (`batch_rows` rows in `batch_seconds`) less a tenth for safety (a smaller batch
    may take longer a row: the cost of a generating step falls less than its rows), or 0 where
    under an eighth of a batch fits: so few rows are not worth a call."""
    fit = int(0.9 * max(seconds_left, 0.0) / batch_seconds * batch_rows) if batch_seconds > 0 else 0
    fit = min(fit, batch_size)
    return fit if fit >= max(1, batch_size // 8) else 0


@dataclass(frozen=True)
class CacheSettings:
    """What a build writes, the same for every process and every resume (build.json records it):
    `windows` rows of seq_len + 1 tokens, hidden states stored as `dtype`, the `top_k_logits`
    largest logits (specdec exports only), Arrow shards of at most `shard_size` (bytes or like
    500MB) unless one batch is larger, rows drawn with `seed`, `batch_size` rows per forward pass."""

    seq_len: int = 512
    windows: int = 1024
    dtype: str = "bfloat16"
    top_k_logits: int = 0
    shard_size: str | int = "500MB"
    seed: int = 0
    batch_size: int = 8

    def check(self, out: str | os.PathLike, overwrite: bool) -> Path:
        """`check_build` of these settings and the output folder; the shard size too."""
        out = check_build(out, seq_len=self.seq_len, windows=self.windows, dtype=self.dtype,
                          top_k_logits=self.top_k_logits, batch_size=self.batch_size, overwrite=overwrite)
        shard_size_bytes(self.shard_size)
        return out


@dataclass(frozen=True)
class BuildRun:
    """How one call builds: `overwrite` a cache (or a partial build of other settings, one process
    only), `progress(tokens)` after each batch, `report(line)` the size before any work and what a
    resume keeps, `max_seconds` a time budget (one process only: `write_cache`), as process `rank`
    of `world` (`partial`: the parts-lock-finalize protocol)."""

    overwrite: bool = False
    progress: Callable[[int], Any] | None = None
    report: Callable[[str], Any] | None = None
    max_seconds: float | None = None
    rank: int = 0
    world: int = 1

    def say(self, line: str) -> None:
        if self.report is not None:
            self.report(line)

    def check(self) -> None:
        check(self.world >= 1 and 0 <= self.rank < self.world, f"rank {self.rank} of {self.world} processes is not "
                                                               f"a rank")
        check(self.max_seconds is None or self.world == 1,
              "a time budget stops one process; with several, give none")
        check(self.max_seconds is None or self.max_seconds > 0,
              f"the cache's time budget must be > 0 seconds, got {self.max_seconds!r}")


@dataclass(frozen=True)
class _Plan:
    """A build laid out: bytes per row, rows per shard (whole batches), shards, the layers, what
    build.json records and the Arrow features."""

    per_row: int
    per_shard: int
    shards: int
    layers: list[int]
    build: dict[str, Any]
    features: Any


class _Budget:
    """`max_seconds` of work from `t0`: a batch starts only if, taking as long as the previous one,
    it would end within it (the first always runs); else a last, smaller batch (`last_batch_rows`)."""

    def __init__(self, t0: float, max_seconds: float | None) -> None:
        self.t0, self.max_seconds, self.seconds, self.rows = t0, max_seconds, 0.0, 0

    def fit(self, start: int, count: int, batch_size: int) -> tuple[int, bool]:
        """The rows of the batch at row `start` (0: out of time) and whether it is the last."""
        elapsed = time.perf_counter() - self.t0
        if self.max_seconds is None or start == 0 or elapsed + self.seconds <= self.max_seconds:
            return count, False
        return min(count, last_batch_rows(self.max_seconds - elapsed, self.seconds, self.rows, batch_size)), True

    def record(self, seconds: float, rows: int) -> None:
        self.seconds, self.rows = seconds, rows


def write_cache(model: CacheModel, source: RowSource, out: Path, settings: CacheSettings,
                run: BuildRun = BuildRun()) -> dict[str, Any]:
    """Run `model` over `settings.windows` rows of `source` and write the cache to `out` (see the
    module docstring), resuming a killed build of the same settings. `run.report(line)` hears the
    size the cache will take before any work, and what a resume keeps; `run.progress(tokens)`
    follows each batch. `run.max_seconds`: a time budget for this call (`_Budget`; none where
    under an eighth of a batch fits). The cache holds the rows written by then, the first rows of
    the full build (cache.json records "windows" written and "requested_windows"; a smaller last
    batch's sampled rows are drawn by other draws than the full batch's): a slow machine gets fewer
    rows rather than a longer build. Returns cache.json's contents, with the seconds this call took.

    As one of `run.world` processes (`run.rank`), it writes shards rank, rank + world, ... into the
    same CACHE_DIR.partial/ (a shared filesystem); whichever process finds every shard written when
    it ends writes cache.json and renames the folder (`partial.finalize`); the others return
    {"finalized": False}. Shards are pure functions of the settings, so the cache is the one a single
    process writes. A partial build of other settings is refused then, even with `overwrite` (a
    process would remove what another is writing)."""
    t0 = time.perf_counter()
    run.check()
    plan = _plan(model, source, settings)
    run.say(f"the cache will take about {plan.per_row * settings.windows / 1e6:,.1f} MB: {settings.windows:,} rows x "
            f"{plan.per_row:,} bytes ({plan.per_row / settings.seq_len:,.0f} bytes per token: {settings.dtype} hidden "
            f"states of {len(plan.layers)} layer(s) {plan.layers} of dim {model.dim}), {plan.shards} shard(s)")
    partial = open_partial(out, plan.build, rank=run.rank, world=run.world, overwrite=run.overwrite,
                           start_over="pass --overwrite to start over", temps=DATASET_DIR)
    check(run.world <= plan.shards, f"{run.world} processes for a cache of {plan.shards} shard(s): some would have "
                                    f"nothing to write; use at most {plan.shards} processes or a smaller --shard-size")
    kept = [k for k in range(plan.shards) if (partial / _shard_name(k)).is_file()]
    if kept:
        run.say(f"resuming {partial}: {len(kept)} of {plan.shards} shard(s) already written")
    written = settings.windows                           # rows in the cache: fewer when the time budget runs out
    budget = _Budget(t0, run.max_seconds)
    for k in range(plan.shards):
        if k not in kept and k % run.world == run.rank:
            written = _write_shard(model, source, partial / _shard_name(k), k, plan, settings, run, budget)
            if written < settings.windows:              # (shards are written in order: none lies past it)
                run.say(f"the time budget ({run.max_seconds / 60:.1f} min) ran out after {written:,} of "
                        f"{settings.windows:,} rows: the cache holds those")
                break
    if run.world > 1:
        missing = [k for k in range(plan.shards) if not (partial / _shard_name(k)).is_file()]
        if missing:
            run.say(f"rank {run.rank} wrote its shards; {len(missing)} of other ranks are not written yet: the last "
                    f"rank to finish writes {out}")
            return {**plan.build, "finalized": False, "rank": run.rank}
    done, meta = finalize(out, lambda partial: _write_meta(partial, plan, settings, written))
    if not done:
        return {**plan.build, "finalized": False, "rank": run.rank}
    meta["seconds"] = time.perf_counter() - t0
    return meta


def _plan(model: CacheModel, source: RowSource, s: CacheSettings) -> _Plan:
    """The model's fit to the settings checked (one line), and the build laid out."""
    check(model.logits is not None or not s.top_k_logits,
          "top-k logits are cached for specdec exports only: a Hugging Face target's logits are its head applied "
          "to the cached hidden states (task=hf_prophet computes them)")
    check(s.seq_len <= model.max_seq_len, f"seq_len ({s.seq_len}) exceeds the model's {model.max_seq_len} positions")
    check(s.top_k_logits <= model.vocab_size,
          f"top-k-logits ({s.top_k_logits}) exceeds the vocabulary ({model.vocab_size})")
    layers = list(model.layers)
    check(layers and layers == normalize_layers(layers, model.depth),
          f"the model's layers {layers} are not normalized hidden-state indices of its {model.depth} layers")
    check(not s.top_k_logits or layers == [model.depth], "top-k logits are cached with the last layer only")
    per_row = row_bytes(s.seq_len, model.dim, s.dtype, s.top_k_logits, model.vocab_size, source.columns, len(layers))
    # a batch never spans two shards, so a shard holds whole batches: at least one, however small
    # shard_size is (a 4,096-row GPU batch is 4.8 GB at seq_len 256), else batches would be cut to it
    per_shard = max(1, shard_size_bytes(s.shard_size) // per_row // s.batch_size) * s.batch_size
    settings = {"seq_len": s.seq_len, "windows": s.windows, "dim": model.dim, "dtype": s.dtype,
                "top_k_logits": s.top_k_logits, "seed": s.seed, "batch_size": s.batch_size,
                "rows_per_shard": per_shard, "vocab_size": model.vocab_size, "layers": layers, "depth": model.depth}
    build = {"format": CACHE_FORMAT, "format_version": CACHE_VERSION, "model": model.identity,
             "source": source.describe(), **settings}
    features = _features(s.seq_len, model.dim, s.dtype, s.top_k_logits, model.vocab_size, source.columns, len(layers))
    return _Plan(per_row, per_shard, -(-s.windows // per_shard), layers, build, features)


def _write_shard(model: CacheModel, source: RowSource, final: Path, k: int, plan: _Plan, s: CacheSettings,
                 run: BuildRun, budget: _Budget) -> int:
    """Shard k, written to a temp renamed to `final` when it holds rows. Returns the rows the cache
    holds: s.windows, or fewer where the time budget ran out inside this shard."""
    from datasets.arrow_writer import ArrowWriter

    tmp = temp_path(final)
    writer = ArrowWriter(features=plan.features, path=str(tmp))
    first, last = k * plan.per_shard, min((k + 1) * plan.per_shard, s.windows)
    written = s.windows
    try:
        with torch.inference_mode():
            for start in range(first, last, s.batch_size):
                began = time.perf_counter()
                count, ending = budget.fit(start, min(s.batch_size, last - start), s.batch_size)
                if ending:
                    written = start + count                 # the last batch (or none): rows 0..written-1 are the cache
                if not count:
                    break
                writer.write_table(_batch_table(model, source, start, count, plan, s))
                if run.progress is not None:
                    run.progress(count * s.seq_len)
                budget.record(time.perf_counter() - began, count)
                if ending and written < s.windows:
                    break
        if written > first:                             # the shard holds rows: a resume keeps it
            writer.finalize()
            os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return written


def _batch_table(model: CacheModel, source: RowSource, start: int, count: int, plan: _Plan, s: CacheSettings):
    """Rows start..start+count-1 as an Arrow table of the cache's columns."""
    import pyarrow as pa

    width = len(plan.layers) * model.dim
    tokens, extra = source.rows(start, count)                                   # (b, n + 1)
    hidden = extra.pop("embeds", None)                                          # (b, n, k d)
    if hidden is None:                                  # the source computed none: one pass over its rows
        hidden = model.hidden(tokens[:, :-1])
    expected = (len(tokens), s.seq_len, width)
    check(hidden.shape == expected, f"the hidden states of rows {start}.. have shape {tuple(hidden.shape)}, not "
                                    f"{expected}")
    columns = {name: _fixed_lists(v) for name, v in pack_embeds(hidden, s.dtype, len(plan.layers)).items()}
    columns["tokens"] = _fixed_lists(tokens.numpy().astype(token_type(model.vocab_size)))
    if s.top_k_logits:
        values, indices = model.logits(hidden).float().topk(s.top_k_logits, dim=-1)       # (b, n, k)
        columns["topk_values"] = _fixed_lists(values.half().cpu().numpy().reshape(len(tokens), -1))
        columns["topk_indices"] = _fixed_lists(indices.cpu().numpy().astype(
            np.uint8 if model.vocab_size <= 256 else np.int32).reshape(len(tokens), -1))
    for name, kind in source.columns.items():
        columns[name] = (_fixed_lists(extra[name].astype(np.uint8)) if kind == MASK
                         else pa.array(extra[name].astype(kind)))
    return pa.table({name: columns[name] for name in plan.features})


def _write_meta(partial: Path, plan: _Plan, s: CacheSettings, written: int) -> dict[str, Any]:
    """cache.json of the `written` rows, into the partial folder (`partial.finalize`'s join)."""
    files = {_shard_name(k): (partial / _shard_name(k)).stat().st_size for k in range(-(-written // plan.per_shard))}
    meta = {**plan.build, "windows": written, "tokens": written * s.seq_len, "files": files,
            "bytes": sum(files.values())}
    if written < s.windows:
        meta["requested_windows"] = s.windows
    write_file(partial / META_NAME, lambda f: f.write((json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()))
    return meta


def build_cache(export: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike,
                settings: CacheSettings = CacheSettings(), run: BuildRun = BuildRun(),
                device: str | torch.device = "cpu") -> dict[str, Any]:
    """Cache the embeddings of a specdec export's main model on `settings.windows` random byte
    windows of the training split of `data` (see the module docstring and `write_cache`; a time
    budget and several processes are for Hugging Face targets)."""
    from specdec_models import ModelWithProphet
    from specdec_models.export import load_export, read_main_config

    s = settings
    out = s.check(out, run.overwrite)
    check(Path(data).expanduser().is_file(), f"data {data} does not exist or is not a file")
    cfg, config = read_main_config(export)                # cheap checks first: the weights load last
    check(s.seq_len <= cfg.max_seq_len,
          f"seq_len ({s.seq_len}) exceeds the main model's max_seq_len ({cfg.max_seq_len})")
    check(s.top_k_logits <= cfg.vocab_size,
          f"top-k-logits ({s.top_k_logits}) exceeds the vocabulary ({cfg.vocab_size})")
    source = ByteWindows(Path(data), s.seq_len, s.windows, s.seed)
    loaded = load_export(export, map_location=device)    # re-hashes the weights against config.json
    main = loaded.model if isinstance(loaded, ModelWithProphet) else loaded
    identity = {"kind": "export", "path": str(Path(export).resolve()), "weights_sha256": config["weights_sha256"]}
    model = CacheModel(identity, cfg.dim, cfg.vocab_size, cfg.max_seq_len, lambda t: main.hidden(t.to(device)),
                       main.logits, depth=cfg.depth, layers=(cfg.depth,))
    return write_cache(model, source, out, s, run)


# ---------------------------------------------------------------- reading

def read_cache_meta(cache: str | os.PathLike) -> dict[str, Any]:
    """The validated cache.json of a cache directory (cheap: reads one small file)."""
    cache = Path(cache).expanduser()
    check(cache.is_dir(), f"embeddings cache {cache} does not exist: {HOW_TO_BUILD}")
    path = cache / META_NAME
    check(path.is_file(), f"{path} is missing: {cache} is not a complete embeddings cache; {HOW_TO_BUILD}")
    meta = read_json_object(path, f"rebuild the cache; {HOW_TO_BUILD}")
    check(meta.get("format") == CACHE_FORMAT,
          f"{path} is not a specdec embeddings cache; {HOW_TO_BUILD}")
    check(meta.get("format_version") in READ_VERSIONS,
          f"{path} has format_version {meta.get('format_version')!r}, this specdec reads "
          f"{', '.join(map(str, READ_VERSIONS))}: rebuild it")
    if "layers" not in meta:                      # format 3: the last layer only, its depth in the model's config
        meta["depth"] = _model_depth(meta["model"], cache)
        meta["layers"] = [meta["depth"]]
    return meta


def _model_depth(identity: dict[str, Any], cache: Path) -> int:
    """The number of layers of the model a format-3 cache was made by, from its config (no weights)."""
    try:
        if identity["kind"] == "export":
            from specdec_models.export import read_main_config

            return int(read_main_config(identity["path"])[0].depth)
        from specdec_models.hf import text_config
        from specdec_models.hf.weights import load_config

        return int(text_config(load_config(identity["path"])).num_hidden_layers)
    except SpecdecError as error:
        raise SpecdecError(f"embeddings cache {cache} (format 3) does not record its layers, and its model's config "
                           f"cannot be read to find them ({error}): rebuild it") from None


def check_cache(cache: str | os.PathLike, *, weights_sha256: str | None = None, seq_len: int | None = None,
                dim: int | None = None, layers: Sequence[int] | None = None, model: str = "the model"
                ) -> dict[str, Any]:
    """Refuse (SpecdecError, one line) a cache that is missing, truncated, made by another model
    than `model` (named so in the message, e.g. "main.export"), for another seq_len or width, or
    lacking any of the hidden-state indices `layers` a head needs (negative ones count from the
    end); return its metadata (with "layers"). Checks file sizes, not contents."""
    cache = Path(cache).expanduser()
    meta = read_cache_meta(cache)
    if weights_sha256 is not None:
        found = meta["model"]["weights_sha256"]
        check(found == weights_sha256,
              f"embeddings cache {cache} was made by another model than {model} (weights sha256 {found[:16]}..., "
              f"{model} has {weights_sha256[:16]}...): rebuild it from {model}")
    if seq_len is not None:
        check(meta["seq_len"] == seq_len,
              f"embeddings cache {cache} holds windows of seq_len {meta['seq_len']}, data.seq_len is {seq_len}: "
              f"set data.seq_len={meta['seq_len']} or rebuild the cache with --seq-len {seq_len}")
    if dim is not None:
        check(meta["dim"] == dim, f"embeddings cache {cache} holds embeddings of dim {meta['dim']}, {model}'s "
                                  f"is {dim}: rebuild it from {model}")
    if layers is not None:
        need = normalize_layers(list(layers), meta["depth"])
        check(set(need) <= set(meta["layers"]), f"embeddings cache {cache} holds layers {meta['layers']}; the head "
                                                f"needs {need}: rebuild it with --layers {','.join(map(str, need))}")
    for name, size in meta["files"].items():
        path = cache / name
        check(path.is_file(), f"embeddings cache {cache} is incomplete: {name} is missing; rebuild it")
        check(path.stat().st_size == size, f"embeddings cache {cache} is truncated or corrupt: {name} has "
                                           f"{path.stat().st_size:,} bytes, {size:,} were written; rebuild it")
    return meta


def open_cache(cache: str | os.PathLike, meta: dict[str, Any] | None = None):
    """The cache's rows, memory-mapped, in Arrow format (rows come back as pyarrow tables)."""
    from datasets import Dataset, concatenate_datasets

    cache = Path(cache).expanduser()
    meta = meta or read_cache_meta(cache)
    try:
        shards = [Dataset.from_file(str(cache / name)) for name in sorted(meta["files"])]
        dataset = concatenate_datasets(shards) if len(shards) > 1 else shards[0]
    except Exception as error:  # noqa: BLE001  Arrow errors from a damaged file
        raise SpecdecError(f"cannot read embeddings cache {cache} ({' '.join(str(error).split())}): "
                           f"rebuild it") from None
    check(len(dataset) == meta["windows"], f"embeddings cache {cache} holds {len(dataset)} windows, "
                                           f"cache.json records {meta['windows']}: rebuild it")
    return dataset.with_format("arrow")


def cache_rows(dataset, rows: np.ndarray, meta: dict[str, Any], top_k: bool = False) -> dict[str, torch.Tensor]:
    """Rows `rows` of an opened cache as a training batch {"tokens" (b, n + 1) int64, "embeds"
    (b, n, len(layers) * d), the layers in meta["layers"]' order} (+ "prompt_len" and "valid_len"
    (b,) int64 and "loss_mask" (b, n + 1) bool when the rows have them; with `top_k`, "topk_values"
    (b, n, K) float16 and "topk_indices" (b, n, K) int64)."""
    table = dataset[rows.tolist()]
    n = meta["seq_len"]

    def column(name: str) -> np.ndarray:
        values = table.column(name).combine_chunks().values.to_numpy(zero_copy_only=False)
        return values.reshape(len(rows), -1)

    scales = column("scales") if meta["dtype"] == "int8" else None
    batch = {"tokens": torch.from_numpy(column("tokens").astype(np.int64)),
             "embeds": unpack_embeds(column("embeds"), meta["dtype"], n, scales, len(meta["layers"]))}
    for name in ("prompt_len", "valid_len"):
        if name in table.column_names:
            batch[name] = torch.from_numpy(table.column(name).to_numpy().astype(np.int64))
    if "loss_mask" in table.column_names:
        batch["loss_mask"] = torch.from_numpy(column("loss_mask").astype(bool))
    if top_k:
        check(meta["top_k_logits"] > 0, "the embeddings cache holds no top-k logits: rebuild it with --top-k-logits K")
        batch["topk_values"] = torch.from_numpy(column("topk_values").copy()).view(len(rows), n, -1)
        batch["topk_indices"] = torch.from_numpy(column("topk_indices").astype(np.int64)).view(len(rows), n, -1)
    return batch
