"""task=hf_peagle: a P-EAGLE head trained against a frozen Hugging Face target, end to end through
run(cfg) on the tiny random Llama and word-level corpus of test_hf_prophet_task: from the cache
task=hf_eagle3 reads (its aux layers and the last), the evaluation callback's decoding, the
export and exact greedy decoding with the exported head, and bad input in one line before any work."""

# ruff: noqa: E402, F811  (the imports follow pytest.importorskip; pytest fixtures imported from sibling
# test modules are named again as test arguments)
from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_hf_eagle3_task import caches  # noqa: F401  (the cache of the aux layers and the last)
from test_hf_prophet_task import SEQ, hf  # noqa: F401  (the tiny targets, tokenizer and corpus)
from test_hf_prophet_task import cfg as prophet_cfg

import train.run as train_run
from specdec_models.errors import SpecdecError
from specdec_models.hf.weights import load_causal_lm

run = train_run.run

HEAD = ("head.draft_vocab_size=null", "head.aux_layers=[0,1,2]", "head.parallel_depths=3", "head.mask_token_id=3")


def cfg(hf, out, *extra, target="llama"):
    """experiment=hf_peagle at test sizes (test_hf_prophet_task's), the whole vocabulary, K = 3."""
    return prophet_cfg(hf, out, *extra, target=target, experiment="hf_peagle", head=HEAD)


@pytest.mark.parametrize("layers_from_target", [0, 1])
def test_a_cached_run_trains_evaluates_exports_and_the_exported_head_decodes_exactly(hf, caches, tmp_path,
                                                                                    layers_from_target):
    """With layers_from_target 1 (smollm2_peagle's) the target's layer is read by P-EAGLE's config,
    not EAGLE-3's, which has no such field."""
    from specdec_models import load_export
    from specdec_models.decode import GREEDY, HeadDrafter, generate
    from specdec_models.export import read_export_config
    from specdec_models.heads.peagle import PEagleHead

    result = run(cfg(hf, tmp_path / "run", "data=hf_embeddings", f"data.cache={caches['full']}",
                     f"head.layers_from_target={layers_from_target}"))
    m = result["metrics"]
    assert result["global_step"] == 6
    for key in ("train/loss", "val/loss", "val/ttt_kl/step0", "val/ttt_accuracy/pos3", "val/simulated_tokens_per_call",
                "val/tokens_per_call/t0", "val/tokens_per_call/t1"):
        assert math.isfinite(m[key]), key
    assert 1.0 <= m["val/simulated_tokens_per_call"] <= 4.0                     # K = 3 depths
    state = torch.load(result["last_ckpt"], weights_only=True)["state_dict"]
    assert "head.mask_hidden" in state and "head.mask_embed" in state
    assert not any(k.startswith("head.") is False for k in state)                 # the target stays out
    rows = [json.loads(line) for line in (result["output_dir"] / "speculative_samples.jsonl").read_text().splitlines()]
    assert rows and all(r["matches_base"] for r in rows if r["temperature"] == 0)
    config = read_export_config(result["export_dir"])
    assert config["kind"] == "hf_peagle" and config["prophet"]["parallel_depths"] == 3
    model = load_causal_lm(hf["llama"]).eval()
    head = load_export(result["export_dir"], target=model)
    assert isinstance(head, PEagleHead)
    prompts = [torch.tensor([4, 9, 12]), torch.tensor([7, 5, 20, 21, 6])]
    plain, _ = generate(model, prompts, 12, sampling=GREEDY)
    spec, stats = generate(model, prompts, 12, HeadDrafter(head), sampling=GREEDY, gamma=3)
    assert [t.tolist() for t in spec] == [t.tolist() for t in plain] and stats.drafted > 0
    assert stats.method == "peagle"


@pytest.mark.parametrize("extra, message", [
    (("head.parallel_depths=1",), "parallel_depths must be an integer >= 2"),
    (("head.aux_layers=[0,1,7]",), "out of range"),
    (("head.mask_token_id=100000",), "mask_token_id must be a token id"),
    (("task.down_sample_ratio=0",), r"task.down_sample_ratio must be in \(0, 1\]"),
    (("head.kind=eagle3",), "head.kind=eagle3 is trained by task=hf_eagle3"),
    (("head.layers_from_target=2",), "layers_from_target must be 0 or 1"),
])
def test_bad_input_is_one_line_before_any_work(hf, tmp_path, extra, message):
    from train.run import validate

    out = tmp_path / "run"
    with pytest.raises(SpecdecError, match=message) as err:
        validate(cfg(hf, out, *extra))
    assert "\n" not in str(err.value) and not out.exists()


def test_the_smollm2_experiment_composes_and_validates_on_the_eagle3_cache(hf, caches, tmp_path):
    """experiment=smollm2_peagle: smollm2_eagle3's cache, budget and vocabulary size, K = gamma = 4,
    a special token as the mask; on a tiny target of one's own it validates (its mask token 16 lies
    in the tiny vocabulary too)."""
    from conftest import CONF

    cfg = train_run.compose(["experiment=smollm2_peagle", f"target.path={hf['llama']}", f"data.cache={caches['full']}",
                             f"data.seq_len={SEQ}", "data.val_windows=4", "head.draft_vocab_size=null",
                             "head.aux_layers=[0,1,2]", f"output_dir={tmp_path / 'run'}"])
    assert (cfg.gamma, cfg.head.parallel_depths, cfg.head.mask_token_id, cfg.trainer.max_time) == (
        4, 4, 16, "00:00:30:00")
    kwargs = train_run.validate(cfg)
    assert kwargs["metadata"]["name"] == "smollm2_peagle" and kwargs["head"]["parallel_depths"] == 4
    assert kwargs["init_layer"] is True                              # layers_from_target: 1
    first = (CONF / "experiment" / "smollm2_peagle.yaml").read_text().splitlines()
    assert first[0] == "# @package _global_"
    assert first[1].startswith("# Run: python -m train experiment=smollm2_peagle ")
