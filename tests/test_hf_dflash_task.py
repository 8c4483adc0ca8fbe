"""task=hf_dflash: a DFlash head trained against a frozen Hugging Face target, end to end through
run(cfg) on a tiny random Llama over a word-level tokenizer (the fixtures of test_hf_prophet_task):
training with hidden states online and from the multi-layer cache task=hf_eagle3 reads, the
evaluation callback, the export and exact greedy decoding with the exported head, resumable anchors,
and every bad input in one line before any work."""

# ruff: noqa: E402, F811  (the imports follow pytest.importorskip; pytest fixtures imported from sibling
# test modules are named again as test arguments)
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_hf_prophet_task import SEQ, hf  # noqa: F401  (the tiny targets, tokenizer and corpus)
from test_hf_prophet_task import cfg as prophet_cfg

from specdec_models import load_export
from specdec_models.decode import GREEDY, HeadDrafter, generate
from specdec_models.errors import SpecdecError
from specdec_models.export import read_export_config
from specdec_models.heads.dflash import DFlashHead
from specdec_models.hf.weights import load_causal_lm
from train.run import run, validate

HEAD = ("head.draft_vocab_size=null", "head.aux_layers=[0,1,2]", "head.block_size=4", "gamma=3", "task.anchors=4")


def cfg(hf, out, *extra, target="llama"):
    """experiment=hf_dflash at test sizes (test_hf_prophet_task's), the whole vocabulary, blocks of 4."""
    return prophet_cfg(hf, out, *extra, target=target, experiment="hf_dflash", head=HEAD)


@pytest.fixture(scope="module")
def cache(hf, tmp_path_factory):
    """A cache of the Llama target's own continuations with its taps and last layer (task=hf_eagle3's)."""
    from conftest import hf_cache

    d = tmp_path_factory.mktemp("dflash_cache")
    hf_cache(hf["llama"], d / "full", layers=[0, 1, 2], seq_len=SEQ, windows=24, shard_size="64KB", batch_size=4,
             seed=2, prompts=hf["prompts"], chat=True, temperatures=[0.0, 1.0])
    return d / "full"


def test_an_online_run_trains_evaluates_and_logs_per_slot_figures(hf, tmp_path):
    result = run(cfg(hf, tmp_path / "run"))
    assert result["global_step"] == 6
    state = torch.load(result["last_ckpt"], weights_only=True)["state_dict"]
    assert "head.fc.weight" in state and "head.layers.0.self_attn.q_norm.weight" in state
    assert not any("embed" in k for k in state)                     # the target's embedding stays out
    m = result["metrics"]
    for key in ("train/loss", "val/loss", "val/block_kl/pos1", "val/block_accuracy/pos3",
                "val/simulated_tokens_per_call", "val/tokens_per_call/t0", "val/tokens_per_call/t1",
                "val/per_position_acceptance/pos3/t0", "val/predicted_speedup/t0"):
        assert math.isfinite(m[key]), key
    assert 1.0 <= m["val/simulated_tokens_per_call"] <= 4.0         # up to 3 drafts a block


def test_a_cached_run_trains_exports_and_the_exported_head_decodes_exactly(hf, cache, tmp_path):
    result = run(cfg(hf, tmp_path / "run", "data=hf_embeddings", f"data.cache={cache}"))
    assert result["global_step"] == 6 and math.isfinite(result["metrics"]["val/simulated_tokens_per_call"])
    config = read_export_config(result["export_dir"])
    assert config["kind"] == "hf_dflash" and config["metadata"]["embeddings"] == "cached"
    assert config["prophet"]["block_size"] == 4 and config["metadata"]["decay"] == 2.0     # block_size / 2
    model = load_causal_lm(hf["llama"]).eval()
    head = load_export(result["export_dir"], target=model)
    assert isinstance(head, DFlashHead)
    prompts = [torch.tensor([4, 9, 12]), torch.tensor([7, 5, 20, 21, 6])]
    plain, _ = generate(model, prompts, 12, sampling=GREEDY)
    spec, stats = generate(model, prompts, 12, HeadDrafter(head), sampling=GREEDY, gamma=3)
    assert [t.tolist() for t in spec] == [t.tolist() for t in plain] and stats.drafted > 0


def test_training_anchors_come_from_the_steps_own_generator(hf, cache, tmp_path):
    # a resumed run draws the anchors an uninterrupted one did: the same (seed, step, micro-batch,
    # rank) gives the same loss, another step other anchors
    from train.data.embeddings_cache import cache_rows, open_cache, read_cache_meta
    from train.tasks.hf_dflash import HFDFlashModule

    module = HFDFlashModule(**validate(cfg(hf, tmp_path / "r", "data=hf_embeddings", f"data.cache={cache}")))
    meta = read_cache_meta(cache)
    batch = cache_rows(open_cache(cache, meta), np.arange(4), meta)
    with torch.no_grad():
        first = module._loss(batch, module.generator(0))[0].loss
        again = module._loss(batch, module.generator(0))[0].loss
        other = module._loss(batch, module.generator(1))[0].loss
    assert first == again and first != other


@pytest.mark.parametrize("extra, message", [
    (["head.block_size=1"], r"head.block_size must be an integer in \[2"),
    ([f"head.block_size={SEQ + 1}"], "a block must fit a row"),
    (["head.aux_layers=[0,5]"], "out of range"),
    (["head.mask_token_id=100000"], "mask_token_id must be a token id"),
    (["head.kind=eagle3"], "trained by task=hf_eagle3"),
    (["task.anchors=0"], "task.anchors must be a positive integer"),
    (["task.decay=-1"], "task.decay must be a number > 0"),
    (["head.draft_vocab_size=8"], "head.draft_vocab is not set"),
])
def test_bad_input_fails_in_one_line_before_any_work(hf, tmp_path, extra, message):
    out = tmp_path / "run"
    with pytest.raises(SpecdecError, match=message) as err:
        validate(cfg(hf, out, *extra))
    assert "\n" not in str(err.value) and not out.exists()
