"""Shared fixtures: a tiny repetitive byte corpus, Hydra composition of conf/, offline settings."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import lightning as L
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
TEXTMIX = REPO.parent / "shared" / "data" / "textmix100m.gz"   # 10^8 bytes of text; never committed


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are fastest on one thread, and the 2 cores here are shared."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class StopAt(L.Callback):
    """Ends fit after optimizer step `step`, like an interrupted job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.fixture
def offline(monkeypatch):
    """No W&B and no Hugging Face network calls."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """~240 KB of four sentences in random order (.gz): a corpus a tiny model learns in steps."""
    sentences = [b"the quick brown fox jumps over the lazy dog. ",
                 b"<page><title>Speculative decoding</title></page>\n",
                 b"a prophet drafts, the main model verifies. ",
                 b"0123456789 abcdefghij "]
    order = np.random.default_rng(0).integers(0, len(sentences), 6000)
    path = tmp_path_factory.mktemp("corpus") / "tiny.gz"
    path.write_bytes(gzip.compress(b"".join(sentences[i] for i in order)))
    return path


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.fixture(scope="session")
def compose():
    """compose(overrides): conf/train.yaml composed as `python -m train` would (struct mode)."""
    return _compose


@pytest.fixture(scope="session")
def tiny_cfg(tiny_corpus):
    """tiny_cfg(output_dir, *overrides): experiment=tiny on the tiny corpus, writing into
    output_dir; with the evaluation callback only once train.callbacks exists."""
    def make(output_dir: Path, *extra: str):
        overrides = ["experiment=tiny", f"data.path={tiny_corpus}", "data.allow_short=true", f"output_dir={output_dir}"]
        if importlib.util.find_spec("train.callbacks") is None:
            overrides.append("callbacks.speculative_eval=null")
        return _compose(overrides + list(extra))
    return make


@pytest.fixture(scope="session")
def tiny_decoder_export(tmp_path_factory) -> Path:
    """The export of a random tiny Decoder (dim 32, depth 2, bytes): a teacher or frozen main model
    for tests of the pipeline's mechanics."""
    import torch

    from specdec_models import Decoder, ModelConfig, save_export

    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=256, dim=32, depth=2, heads=2, dim_head=16, max_seq_len=1024))
    return Path(save_export(tmp_path_factory.mktemp("tiny_decoder") / "export", model))
