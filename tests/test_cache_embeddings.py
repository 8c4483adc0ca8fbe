"""The embeddings cache (scripts/cache_embeddings.py, train.data.embeddings_cache): it holds exactly the
online path's embeddings in bfloat16 or float16 (and top-k logits), is written atomically, is refused
when made by another main model, truncated or for another seq_len, and feeds reproducible
training batches."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from conftest import REPO, command

from specdec_models import Decoder, ModelConfig, ModelWithProphet, ProphetConfig, save_export
from specdec_models.errors import SpecdecError
from specdec_models.export import export_hash
from train.data.embeddings import CachedWindows, EmbeddingsDataModule
from train.data.embeddings_cache import (
    BuildRun,
    CacheSettings,
    build_cache,
    cache_rows,
    check_cache,
    open_cache,
    read_cache_meta,
)
from train.data.enwik8 import split_bounds
from train.data.streams import window_batch

pytestmark = pytest.mark.usefixtures("offline", "one_thread")

MAIN = ModelConfig(dim=32, depth=2, heads=2, dim_head=16, max_seq_len=256)
SEQ = 64



@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    torch.manual_seed(0)
    save_export(root / "main", Decoder(MAIN))
    save_export(root / "other", Decoder(MAIN))
    prophet = ProphetConfig(model=ModelConfig(dim=16, depth=1, heads=1, dim_head=16, max_seq_len=64))
    save_export(root / "pair", ModelWithProphet(MAIN, prophet))
    return root


@pytest.fixture(scope="module")
def cache(exports, tiny_corpus, tmp_path_factory):
    """40 windows, bfloat16, top-4 logits, several shards."""
    path = tmp_path_factory.mktemp("cache") / "bfloat16"
    meta = build_cache(exports / "main", tiny_corpus, path, CacheSettings(seq_len=SEQ, windows=40, top_k_logits=4,
                                                                          shard_size="64KB", seed=3, batch_size=8))
    return path, meta


def train_split(corpus) -> np.ndarray:
    data = np.frombuffer(gzip.decompress(corpus.read_bytes()), dtype=np.uint8)
    return data[:split_bounds(len(data))[0]]


def online(model: Decoder, tokens: torch.Tensor, batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The online path's embeddings and logits of tokens[:, :-1], in the cache's batches."""
    with torch.inference_mode():
        embeds = torch.cat([model.hidden(tokens[i:i + batch_size, :-1]) for i in range(0, len(tokens), batch_size)])
        return embeds, model.logits(embeds)


# ---------------------------------------------------------------- the round trip

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cache_holds_the_online_embeddings_rounded_to_its_dtype(exports, tiny_corpus, tmp_path, dtype):
    from specdec_models import load_export

    meta = build_cache(exports / "main", tiny_corpus, tmp_path / "cache",
                       CacheSettings(seq_len=SEQ, windows=20, dtype=dtype, shard_size="32KB", seed=1, batch_size=8))
    checked = check_cache(tmp_path / "cache", weights_sha256=export_hash(exports / "main"), seq_len=SEQ)
    assert checked == read_cache_meta(tmp_path / "cache")
    assert len([f for f in meta["files"] if f.endswith(".arrow")]) > 1                 # sharded
    dataset = open_cache(tmp_path / "cache")
    batch = cache_rows(dataset, np.arange(20), meta)
    offsets = np.random.default_rng(1).integers(0, len(train_split(tiny_corpus)) - SEQ, size=20)
    tokens = window_batch(train_split(tiny_corpus), offsets, SEQ + 1)
    assert torch.equal(batch["tokens"], tokens)
    assert np.array_equal(dataset[:]["offset"].to_numpy(), offsets)
    embeds, _ = online(load_export(exports / "main"), tokens)
    expected = embeds.to(torch.bfloat16 if dtype == "bfloat16" else torch.float16)
    assert batch["embeds"].dtype == expected.dtype and batch["embeds"].shape == (20, SEQ, MAIN.dim)
    assert torch.equal(batch["embeds"], expected)


def test_top_k_logits_are_the_main_models_largest(exports, tiny_corpus, cache):
    from specdec_models import load_export

    path, meta = cache
    rows = np.array([5, 0, 17])
    batch = cache_rows(open_cache(path), rows, meta, top_k=True)
    offsets = np.random.default_rng(3).integers(0, len(train_split(tiny_corpus)) - SEQ, size=40)
    tokens = window_batch(train_split(tiny_corpus), offsets, SEQ + 1)
    _, logits = online(load_export(exports / "main"), tokens)
    values, indices = logits[rows].topk(4, dim=-1)
    assert batch["topk_values"].dtype == torch.float16 and torch.equal(batch["topk_values"], values.half())
    assert torch.equal(batch["topk_indices"], indices)


def test_a_model_with_prophet_export_is_cached_by_its_main_model(exports, tiny_corpus, tmp_path):
    from specdec_models import load_export

    meta = build_cache(exports / "pair", tiny_corpus, tmp_path / "cache", CacheSettings(seq_len=SEQ, windows=8))
    assert meta["dim"] == MAIN.dim and meta["model"]["weights_sha256"] == export_hash(exports / "pair")
    batch = cache_rows(open_cache(tmp_path / "cache"), np.arange(8), meta)
    embeds, _ = online(load_export(exports / "pair").model, batch["tokens"])
    assert torch.equal(batch["embeds"], embeds.to(torch.bfloat16))


def test_shards_hold_whole_batches_however_small_shard_size_is(exports, tiny_corpus, tmp_path):
    """A batch is never cut at a shard's end: a GPU build's 4,096-row batch (4.8 GB at seq_len
    256) is larger than the default 500MB shard, and was cut to the shard's 423 rows."""
    tokens = []
    meta = build_cache(exports / "main", tiny_corpus, tmp_path / "cache",
                       CacheSettings(seq_len=SEQ, windows=20, shard_size="1KB", seed=1, batch_size=8),
                       BuildRun(progress=tokens.append))
    assert meta["rows_per_shard"] == 8 and tokens == [8 * SEQ, 8 * SEQ, 4 * SEQ]
    assert len([f for f in meta["files"] if f.endswith(".arrow")]) == 3
    meta = build_cache(exports / "main", tiny_corpus, tmp_path / "big",
                       CacheSettings(seq_len=SEQ, windows=20, shard_size="100KB", seed=1, batch_size=8))
    per_row = meta["bytes"] / meta["windows"]
    assert meta["rows_per_shard"] % 8 == 0 and meta["rows_per_shard"] * per_row <= 100_000 * 1.1


# ---------------------------------------------------------------- refusals

def test_a_cache_from_another_main_model_or_seq_len_is_refused(exports, cache):
    path, _ = cache
    with pytest.raises(SpecdecError, match="made by another model than main.export"):
        check_cache(path, weights_sha256=export_hash(exports / "other"), seq_len=SEQ, model="main.export")
    with pytest.raises(SpecdecError, match="holds windows of seq_len 64, data.seq_len is 32"):
        check_cache(path, weights_sha256=export_hash(exports / "main"), seq_len=32)
    module = EmbeddingsDataModule(cache=str(path), export=str(exports / "other"), path=str(REPO / "README.md"),
                                  allow_short=True, seq_len=SEQ)
    with pytest.raises(SpecdecError, match="made by another model than main.export"):
        module.cache_meta()


def test_a_truncated_or_incomplete_cache_is_refused(cache, tmp_path):
    import shutil

    source, meta = cache
    shard = next(f for f in meta["files"] if f.endswith(".arrow"))
    for damage, message in [("truncate", "truncated or corrupt"), ("remove", "is missing"),
                            ("meta", "is not a complete embeddings cache")]:
        path = tmp_path / damage
        shutil.copytree(source, path)
        if damage == "truncate":
            data = (path / shard).read_bytes()
            (path / shard).write_bytes(data[:len(data) // 2])
        elif damage == "remove":
            (path / shard).unlink()
        else:
            (path / "cache.json").unlink()
        with pytest.raises(SpecdecError, match=message):
            check_cache(path)
    with pytest.raises(SpecdecError, match="does not exist"):
        check_cache(tmp_path / "nowhere")


def test_bad_settings_and_an_existing_target_are_refused_before_any_work(exports, tiny_corpus, cache, tmp_path):
    path, _ = cache
    for kwargs, message in [(dict(dtype="fp8"), "dtype must be one of bfloat16, float16, int8"),
                            (dict(seq_len=300), "exceeds the main model's max_seq_len"),
                            (dict(windows=0), "windows must be a positive integer"),
                            (dict(shard_size="lots"), "shard size must be"),
                            (dict(top_k_logits=300), "exceeds the vocabulary")]:
        with pytest.raises(SpecdecError, match=message):
            build_cache(exports / "main", tiny_corpus, tmp_path / "new", CacheSettings(**{"seq_len": SEQ, **kwargs}))
        assert not (tmp_path / "new").exists()
    with pytest.raises(SpecdecError, match="already exists"):
        build_cache(exports / "main", tiny_corpus, path, CacheSettings(seq_len=SEQ))
    assert not [p for p in tmp_path.iterdir()]                # no temporary directories left behind


# ---------------------------------------------------------------- the CLI

def test_script_writes_a_cache_atomically_and_reports_its_size(exports, tiny_corpus, tmp_path, capsys):
    script = command("cache_embeddings")
    out = tmp_path / "caches" / "c"
    argv = ["--export", str(exports / "main"), "--data", str(tiny_corpus), "--out", str(out), "--seq-len", "32",
            "--windows", "10", "--dtype", "float16", "--top-k-logits", "2", "--shard-size", "20000", "--seed", "4"]
    assert script.main(argv) == 0
    assert "MB per million tokens" in capsys.readouterr().out
    meta = json.loads((out / "cache.json").read_text())
    got = (meta["windows"], meta["seq_len"], meta["dtype"], meta["top_k_logits"], meta["seed"])
    assert got == (10, 32, "float16", 2, 4)
    assert [p.name for p in out.parent.iterdir()] == ["c"]
    assert script.main(argv) == 2 and "already exists" in capsys.readouterr().err
    assert script.main(argv + ["--overwrite", "--windows", "12"]) == 0
    assert json.loads((out / "cache.json").read_text())["windows"] == 12
    assert [p.name for p in out.parent.iterdir()] == ["c"]
    capsys.readouterr()


# ---------------------------------------------------------------- training batches

def test_cached_batches_depend_only_on_seed_rank_and_index_and_cover_every_window(cache):
    path, meta = cache
    a = CachedWindows(path, meta, batch_size=8, seed=1, rank=0, world=1, start=0)
    b = CachedWindows(path, meta, batch_size=8, seed=1, rank=0, world=1, start=3)
    first = [batch for _, batch in zip(range(5), iter(a), strict=False)]
    later = next(iter(b))
    assert all(torch.equal(first[3][k], later[k]) for k in later)
    assert sorted(np.concatenate([a.rows(k) for k in range(5)]).tolist()) == list(range(40))   # one pass
    ranks = [CachedWindows(path, meta, batch_size=4, seed=1, rank=r, world=2, start=0) for r in (0, 1)]
    seen = [set(np.concatenate([w.rows(k) for k in range(5)]).tolist()) for w in ranks]
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(40))
    assert first[0]["tokens"].shape == (8, SEQ + 1) and first[0]["embeds"].shape == (8, SEQ, MAIN.dim)


def test_cached_datamodule_keeps_enwik8_validation_and_prompts(exports, cache, tiny_corpus):
    from train.data.enwik8 import Enwik8DataModule

    path, _ = cache
    common = dict(path=str(tiny_corpus), allow_short=True, seq_len=SEQ, batch_size=4, val_windows=4)
    cached = EmbeddingsDataModule(cache=str(path), export=str(exports / "main"), **common)
    plain = Enwik8DataModule(**common)
    cached.setup("fit")
    batch = next(iter(cached.train_dataloader()))
    assert set(batch) == {"tokens", "embeds", "topk_values", "topk_indices"}       # the cache has top-4 logits
    assert batch["embeds"].dtype == torch.bfloat16 and batch["topk_indices"].shape == (4, SEQ, 4)
    assert torch.equal(next(iter(cached.val_dataloader())), next(iter(plain.val_dataloader())))
    assert torch.equal(cached.prompts(2, 16), plain.prompts(2, 16))
