"""The embeddings cache: a frozen main model's last-layer embeddings of training windows, on disk.

A prophet trained on a frozen main model (task=prophet_frozen) reads the main model's last-layer
embeddings of each training window. They can be computed on the fly, or once, ahead of training,
by `scripts/cache_embeddings.py` (`build_cache` below), which runs the main model over N random
training windows and stores, per window,

    tokens        seq_len + 1 bytes (uint8)
    embeds        (seq_len, dim) embeddings of tokens[:seq_len]: bfloat16 stored as its uint16
                  bits, or float16; row-major, flattened
    topk_values   (seq_len, K) the main model's K largest logits per position (float16), optional
    topk_indices  (seq_len, K) their token ids (uint8 for a byte vocabulary, else int32)
    offset        the window's offset in the training split (int64)

in a Hugging Face `datasets` Arrow dataset (`save_to_disk`, sharded; read memory-mapped by
`load_from_disk`) under CACHE_DIR/dataset, next to CACHE_DIR/cache.json: the export's weights hash,
the settings and each file's size. The cache is built in a temporary directory beside CACHE_DIR
and renamed into place (`specdec_models.files.staged_dir`), so CACHE_DIR is either absent or
complete, and the temp directory of a killed build is removed by the next build of CACHE_DIR.

`train.data.embeddings.EmbeddingsDataModule` trains from it (`data=enwik8_embeddings`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec_models.errors import SpecdecError, check
from specdec_models.export import read_json_object
from specdec_models.files import staged_dir

from .data.enwik8 import ENWIK8_BYTES, read_bytes, split_bounds
from .data.streams import window_batch

CACHE_FORMAT = "specdec-embeddings-cache"
CACHE_VERSION = 2          # 2: dtype names bfloat16 / float16 (1 said bf16 / fp16)
META_NAME = "cache.json"
DATASET_DIR = "dataset"
DTYPES = ("bfloat16", "float16")      # names as in specdec_models.config.DTYPES
HOW_TO_BUILD = "build one with scripts/cache_embeddings.py --export MAIN_EXPORT --data DATA --out CACHE_DIR"


# ---------------------------------------------------------------- embeddings <-> stored columns

def pack_embeds(embeds: torch.Tensor, dtype: str) -> np.ndarray:
    """(b, n, d) float embeddings -> (b, n * d) stored values: bfloat16 bits as uint16, or float16."""
    if dtype == "bfloat16":
        bits = embeds.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    else:
        bits = embeds.detach().to(torch.float16).cpu().numpy()
    return bits.reshape(bits.shape[0], -1)


def unpack_embeds(values: np.ndarray, dtype: str, seq_len: int) -> torch.Tensor:
    """(b, n * d) stored values -> (b, n, d) bfloat16 or float16 tensor (the exact stored numbers)."""
    values = np.array(values, copy=True)                      # Arrow buffers are read-only
    if dtype == "bfloat16":
        tensor = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(values)
    return tensor.view(values.shape[0], seq_len, -1)


def _features(seq_len: int, dim: int, dtype: str, top_k: int, vocab_size: int):
    from datasets import Features, List, Value

    columns = {
        "tokens": List(Value("uint8"), length=seq_len + 1),
        "embeds": List(Value("uint16" if dtype == "bfloat16" else "float16"), length=seq_len * dim),
        "offset": Value("int64"),
    }
    if top_k:
        columns["topk_values"] = List(Value("float16"), length=seq_len * top_k)
        columns["topk_indices"] = List(Value("uint8" if vocab_size <= 256 else "int32"), length=seq_len * top_k)
    return Features(columns)


def _fixed_lists(rows: np.ndarray):
    """(b, L) array -> Arrow fixed-size-list array of b rows (no copy of the values)."""
    import pyarrow as pa

    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(rows).reshape(-1)), rows.shape[1])


# ---------------------------------------------------------------- writing

def build_cache(export: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike, *, seq_len: int = 512,
                windows: int = 1024, dtype: str = "bfloat16", top_k_logits: int = 0, shard_size: str | int = "500MB",
                seed: int = 0, batch_size: int = 8, device: str | torch.device = "cpu", overwrite: bool = False,
                progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Run the export's main model over `windows` random training windows of `data` and write
    the cache to `out` (see the module docstring). `progress(tokens)` is called after each batch.
    Returns the cache's metadata (cache.json), with the seconds the whole write took."""
    from specdec_models import ModelWithProphet
    from specdec_models.export import load_export, read_main_config

    t0 = time.perf_counter()
    out, data = Path(out), Path(data).expanduser()
    for name, value in [("seq_len", seq_len), ("windows", windows), ("batch_size", batch_size)]:
        check(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
    check(dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check(isinstance(top_k_logits, int) and top_k_logits >= 0, f"top-k-logits must be >= 0, got {top_k_logits!r}")
    from datasets.utils.py_utils import convert_file_size_to_int

    try:
        shard_size = convert_file_size_to_int(int(shard_size) if str(shard_size).isdigit() else shard_size)
    except (ValueError, AttributeError):
        raise SpecdecError(f"shard size must be bytes or like 500MB / 1GB, got {shard_size!r}") from None
    check(shard_size > 0, f"shard size must be > 0, got {shard_size}")
    if out.exists():
        check(overwrite, f"{out} already exists: pass --overwrite to replace it, or another --out")
        check(out.is_dir() and ((out / META_NAME).is_file() or not any(out.iterdir())),
              f"{out} is not an embeddings cache: --overwrite replaces only a cache, choose another --out")
    check(data.is_file(), f"data {data} does not exist or is not a file")
    cfg, config = read_main_config(export)                # cheap checks first: the weights load last
    check(seq_len <= cfg.max_seq_len, f"seq_len ({seq_len}) exceeds the main model's max_seq_len ({cfg.max_seq_len})")
    check(top_k_logits <= cfg.vocab_size, f"top-k-logits ({top_k_logits}) exceeds the vocabulary ({cfg.vocab_size})")
    sha = config["weights_sha256"]
    model = load_export(export, map_location=device)      # re-hashes the weights against config.json
    main = model.model if isinstance(model, ModelWithProphet) else model
    tokens_all = read_bytes(data)[:ENWIK8_BYTES]
    train = tokens_all[:split_bounds(len(tokens_all))[0]]
    check(len(train) > seq_len + 1, f"{data}: the training split ({len(train):,} bytes) is shorter than one window "
                                    f"of seq_len + 1 = {seq_len + 1}")
    # the same draw as RandomWindows: offsets in [0, len - seq_len), windows of seq_len + 1
    offsets = np.random.default_rng(seed).integers(0, len(train) - seq_len, size=windows)

    import pyarrow as pa
    from datasets import Dataset
    from datasets.arrow_writer import ArrowWriter

    with staged_dir(out) as tmp:          # out is absent or complete; a killed build's temp goes next time
        features = _features(seq_len, cfg.dim, dtype, top_k_logits, cfg.vocab_size)
        staging = tmp / "staging.arrow"           # one file, then resharded by save_to_disk
        writer = ArrowWriter(features=features, path=str(staging))
        with torch.inference_mode():
            for i in range(0, windows, batch_size):
                part = offsets[i:i + batch_size]
                tokens = window_batch(train, part, seq_len + 1)                  # (b, n + 1)
                embeds = main.hidden(tokens[:, :-1].to(device))                  # (b, n, d)
                columns = {"tokens": _fixed_lists(tokens.numpy().astype(np.uint8)),
                           "embeds": _fixed_lists(pack_embeds(embeds, dtype)),
                           "offset": pa.array(part.astype(np.int64))}
                if top_k_logits:
                    values, indices = main.logits(embeds).float().topk(top_k_logits, dim=-1)   # (b, n, k)
                    index_type = np.uint8 if cfg.vocab_size <= 256 else np.int32
                    columns["topk_values"] = _fixed_lists(values.half().cpu().numpy().reshape(len(part), -1))
                    columns["topk_indices"] = _fixed_lists(indices.cpu().numpy().astype(index_type).reshape(len(part), -1))
                writer.write_table(pa.table(columns))
                if progress is not None:
                    progress(len(part) * seq_len)
        writer.finalize()
        Dataset.from_file(str(staging)).save_to_disk(str(tmp / DATASET_DIR), max_shard_size=shard_size)
        staging.unlink()
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted((tmp / DATASET_DIR).iterdir())}
        meta = {
            "format": CACHE_FORMAT, "format_version": CACHE_VERSION,
            "export": str(Path(export).resolve()), "export_sha256": sha, "main": cfg.to_dict(),
            "data": str(data.resolve()), "data_bytes": len(tokens_all), "split": "train",
            "seq_len": seq_len, "windows": windows, "tokens": windows * seq_len, "dim": cfg.dim,
            "dtype": dtype, "top_k_logits": top_k_logits, "seed": seed, "files": files,
            "bytes": sum(files.values()),
        }
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    meta["seconds"] = time.perf_counter() - t0
    return meta


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
    check(meta.get("format_version") == CACHE_VERSION,
          f"{path} has format_version {meta.get('format_version')!r}, this specdec reads {CACHE_VERSION}: rebuild it")
    return meta


def check_cache(cache: str | os.PathLike, *, export_sha256: str | None = None, seq_len: int | None = None,
                dim: int | None = None) -> dict[str, Any]:
    """Refuse (SpecdecError, one line) a cache that is missing, truncated, made by another main
    model or for another seq_len; return its metadata. Checks file sizes, not contents."""
    cache = Path(cache).expanduser()
    meta = read_cache_meta(cache)
    if export_sha256 is not None:
        check(meta["export_sha256"] == export_sha256,
              f"embeddings cache {cache} was made by another main model (weights sha256 "
              f"{meta['export_sha256'][:16]}..., main.export has {export_sha256[:16]}...): rebuild it from main.export")
    if seq_len is not None:
        check(meta["seq_len"] == seq_len,
              f"embeddings cache {cache} holds windows of seq_len {meta['seq_len']}, data.seq_len is {seq_len}: "
              f"set data.seq_len={meta['seq_len']} or rebuild the cache with --seq-len {seq_len}")
    if dim is not None:
        check(meta["dim"] == dim, f"embeddings cache {cache} holds embeddings of dim {meta['dim']}, the main model's "
                                  f"is {dim}: rebuild it from main.export")
    for name, size in meta["files"].items():
        path = cache / name
        check(path.is_file(), f"embeddings cache {cache} is incomplete: {name} is missing; rebuild it")
        check(path.stat().st_size == size, f"embeddings cache {cache} is truncated or corrupt: {name} has "
                                           f"{path.stat().st_size:,} bytes, {size:,} were written; rebuild it")
    return meta


def open_cache(cache: str | os.PathLike, meta: dict[str, Any] | None = None):
    """The cache's dataset, memory-mapped, in Arrow format (rows come back as pyarrow tables)."""
    from datasets import load_from_disk

    cache = Path(cache).expanduser()
    meta = meta or read_cache_meta(cache)
    try:
        dataset = load_from_disk(str(cache / DATASET_DIR))
    except Exception as error:  # Arrow or JSON errors from a damaged directory
        raise SpecdecError(f"cannot read embeddings cache {cache} ({' '.join(str(error).split())}): rebuild it") from None
    check(len(dataset) == meta["windows"], f"embeddings cache {cache} holds {len(dataset)} windows, "
                                           f"cache.json records {meta['windows']}: rebuild it")
    return dataset.with_format("arrow")


def cache_rows(dataset, rows: np.ndarray, meta: dict[str, Any], top_k: bool = False) -> dict[str, torch.Tensor]:
    """Rows `rows` of an opened cache as a training batch {"tokens", "embeds"} (and, with `top_k`,
    "topk_values" (b, n, K) float16 and "topk_indices" (b, n, K) int64)."""
    table = dataset[rows.tolist()]
    n = meta["seq_len"]

    def column(name: str) -> np.ndarray:
        values = table.column(name).combine_chunks().values.to_numpy(zero_copy_only=False)
        return values.reshape(len(rows), -1)

    batch = {"tokens": torch.from_numpy(column("tokens").astype(np.int64)),
             "embeds": unpack_embeds(column("embeds"), meta["dtype"], n)}
    if top_k:
        check(meta["top_k_logits"] > 0, "the embeddings cache holds no top-k logits: rebuild it with --top-k-logits K")
        batch["topk_values"] = torch.from_numpy(column("topk_values").copy()).view(len(rows), n, -1)
        batch["topk_indices"] = torch.from_numpy(column("topk_indices").astype(np.int64)).view(len(rows), n, -1)
    return batch
