"""The enwik8 DataModule: file formats, the 90/5/5 split, reproducible windows, download, and
one-line errors for a missing, short, unreadable or mismatching file."""

from __future__ import annotations

import gzip
import hashlib
import io
import urllib.error
import zipfile

import numpy as np
import pytest
import torch

from conftest import TEXTMIX

import train.data.enwik8 as data_mod
from specdec_models.errors import SpecdecError
from train.data.enwik8 import ENWIK8_BYTES, Enwik8DataModule, RandomWindows

TEXTMIX_SHA256 = "8755d6886d7f6518fda0eb56bb07a504b177906e7873ffbbd34ffc1f2aae1509"   # its README


@pytest.fixture
def raw(tmp_path, tiny_corpus):
    path = tmp_path / "enwik8"
    path.write_bytes(gzip.decompress(tiny_corpus.read_bytes()))
    return path


def module(path, **kwargs) -> Enwik8DataModule:
    return Enwik8DataModule(path=str(path), allow_short=True, seq_len=32, batch_size=4, val_windows=8, **kwargs)


def test_raw_zip_and_gz_files_give_the_same_split(raw, tmp_path, tiny_corpus):
    zipped = tmp_path / "enwik8.zip"
    with zipfile.ZipFile(zipped, "w", zipfile.ZIP_DEFLATED) as z:
        z.write(raw, "enwik8")
    splits = [module(p).load() for p in (raw, zipped, tiny_corpus)]
    total = raw.stat().st_size
    train, valid = round(0.9 * total), round(0.05 * total)
    assert [len(splits[0][k]) for k in ("train", "valid", "test")] == [train, valid, total - train - valid]
    for other in splits[1:]:
        for k in ("train", "valid", "test"):
            assert np.array_equal(splits[0][k], other[k])


def test_training_batches_depend_only_on_seed_rank_and_index(raw):
    train = module(raw).load()["train"]
    a = RandomWindows(train, 32, 4, seed=1, rank=0, start=0)
    first = [b for b, _ in zip(a, range(6), strict=False)]
    resumed = [b for b, _ in zip(RandomWindows(train, 32, 4, seed=1, rank=0, start=3), range(3), strict=False)]
    assert all(torch.equal(x, y) for x, y in zip(first[3:], resumed, strict=True))
    assert first[0].shape == (4, 33) and first[0].dtype == torch.long
    assert not torch.equal(first[0], next(iter(RandomWindows(train, 32, 4, seed=1, rank=1, start=0))))
    assert not torch.equal(first[0], next(iter(RandomWindows(train, 32, 4, seed=2, rank=0, start=0))))
    # each window is a contiguous slice of the training bytes
    row = first[0][0].numpy()
    starts = np.flatnonzero(np.lib.stride_tricks.sliding_window_view(train, 33).__eq__(row).all(1))
    assert len(starts) >= 1


def test_validation_windows_and_prompts_are_fixed(raw):
    a, b = module(raw), module(raw, seed=5)
    va, vb = (torch.cat(list(m.val_dataloader())) for m in (a, b))
    assert va.shape == (8, 33) and torch.equal(va, vb)
    pa = a.prompts(3, 16)
    assert pa.shape == (3, 16) and pa.dtype == torch.long and torch.equal(pa, b.prompts(3, 16))


def test_download_fills_the_cache_once(tmp_path, raw, monkeypatch):
    blob = io.BytesIO()
    with zipfile.ZipFile(blob, "w", zipfile.ZIP_DEFLATED) as z:
        z.write(raw, "enwik8")
    calls = []

    def fake_urlopen(url, timeout):
        calls.append(url)
        response = io.BytesIO(blob.getvalue())
        response.headers = {"Content-Length": str(len(blob.getvalue()))}
        return response

    monkeypatch.setattr(data_mod.urllib.request, "urlopen", fake_urlopen)
    cache = tmp_path / "cache"
    dm = Enwik8DataModule(download_dir=str(cache), allow_short=True, seq_len=32)
    dm.prepare_data()
    assert calls == [data_mod.ENWIK8_URL] and (cache / "enwik8.zip").is_file()
    Enwik8DataModule(download_dir=str(cache), allow_short=True, seq_len=32, download=False).load()
    assert len(calls) == 1
    assert not list(cache.glob("*.part"))


def test_no_network_and_no_path_says_how_to_provide_the_file(tmp_path, monkeypatch):
    def no_network(url, timeout):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(data_mod.urllib.request, "urlopen", no_network)
    with pytest.raises(SpecdecError, match=r"could not download .*data\.path=") as error:
        Enwik8DataModule(download_dir=str(tmp_path / "cache")).prepare_data()
    assert "\n" not in str(error.value)
    assert not list((tmp_path / "cache").glob("*"))
    with pytest.raises(SpecdecError, match=r"data\.download=false; .*data\.path="):
        Enwik8DataModule(download_dir=str(tmp_path / "cache"), download=False).prepare_data()


def test_a_short_file_is_an_error_unless_allowed(raw):
    with pytest.raises(SpecdecError, match=r"holds .* bytes; enwik8 has 100,000,000 .*allow_short"):
        Enwik8DataModule(path=str(raw)).load()


def test_a_file_too_short_for_one_window_is_an_error(tmp_path):
    path = tmp_path / "small"
    path.write_bytes(b"x" * 1000)
    with pytest.raises(SpecdecError, match="shorter than one window"):
        Enwik8DataModule(path=str(path), allow_short=True, seq_len=64).load()


def test_a_wrong_checksum_is_an_error(raw):
    digest = hashlib.sha256(raw.read_bytes()).hexdigest()
    module(raw, sha256=digest).load()
    with pytest.raises(SpecdecError, match=f"sha256 of its first .* expected {'0' * 64}"):
        module(raw, sha256="0" * 64).load()


@pytest.mark.parametrize("name,content", [
    ("bad.gz", b"this is not gzip data"),
    ("truncated.gz", gzip.compress(np.random.default_rng(0).bytes(100_000))[:2000]),
    ("bad.zip", b"PK\x03\x04 not really a zip"),
    ("empty", b""),
])
def test_an_unreadable_file_is_an_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(SpecdecError, match=f"{name}") as error:
        module(path).load()
    assert "\n" not in str(error.value)


def test_a_corrupted_zip_fails_its_crc(tmp_path, raw):
    path = tmp_path / "enwik8.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.write(raw, "enwik8")
    blob = bytearray(path.read_bytes())
    blob[1000] ^= 0xFF                       # inside the stored member
    path.write_bytes(bytes(blob))
    with pytest.raises(SpecdecError, match="cannot read"):
        module(path).load()


@pytest.mark.skipif(not TEXTMIX.is_file(), reason="../shared/data/textmix100m.gz is absent")
def test_the_full_size_stand_in_splits_90_5_5_and_matches_its_checksum():
    splits = Enwik8DataModule(path=str(TEXTMIX), sha256=TEXTMIX_SHA256, seq_len=512).load()
    assert [len(splits[k]) for k in ("train", "valid", "test")] == [90_000_000, 5_000_000, 5_000_000]
    assert sum(len(s) for s in splits.values()) == ENWIK8_BYTES
