"""task=hf_eagle3: an EAGLE-3 head trained against a frozen Hugging Face target, end to end through
run(cfg) on a tiny random Llama over a word-level tokenizer (the fixtures of test_hf_prophet_task):
training with hidden states online and from a multi-layer cache, the evaluation callback, the
export and decoding with the exported head, the draft vocabulary from token counts, the
learning-rate schedule under a time budget, and every bad input in one line before any work."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from conftest import _compose
from test_hf_prophet_task import SEQ, hf  # noqa: F401  (the tiny targets, tokenizer and corpus)

import train.run as train_run
from specdec_models.errors import SpecdecError
from specdec_models.hf_weights import load_causal_lm, load_tokenizer
from train.tasks.hf_eagle3 import COUNTS_FORMAT, label_mask, tokenizer_fingerprint

run = train_run.run


def cfg(hf, out, *extra, target="llama"):
    text = [] if "data=hf_embeddings" in extra else [f"data.files=[{hf['corpus']}]",
                                                      f"data.windows_dir={hf['root'] / 'windows'}"]
    return _compose([
        "experiment=hf_eagle3", f"target.path={hf[target]}", *text, f"output_dir={out}", "trainer=cpu",
        f"data.seq_len={SEQ}", "data.batch_size=4", "data.val_windows=4", "data.val_batch_size=4",
        "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.num_sanity_val_steps=0",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "optim.lr=3e-3", "optim.warmup_steps=1", "callbacks.progress_bar=null", "head.draft_vocab_size=null",
        "head.aux_layers=[0,1,2]", "task.ttt_steps=3",
        "callbacks.speculative_eval.num_prompts=2", "callbacks.speculative_eval.prompt_len=8",
        "callbacks.speculative_eval.max_new_tokens=8", *extra])


def counts_file(path, tokenizer, counts):
    path.write_text(json.dumps({"format": COUNTS_FORMAT, "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
                                "counts": counts}))
    return path


@pytest.fixture(scope="module")
def online(hf, tmp_path_factory):
    return run(cfg(hf, tmp_path_factory.mktemp("eagle3") / "run"))


def test_online_run_trains_evaluates_and_logs_simulated_acceptance(online):
    assert online["global_step"] == 6
    state = torch.load(online["last_ckpt"], weights_only=True)["state_dict"]
    assert state and all(k.startswith("head.") for k in state)
    assert "head.fc.weight" in state and not any("embed" in k for k in state)      # the target's embedding stays out
    m = online["metrics"]
    for key in ("train/loss", "val/loss", "val/ttt_kl/step0", "val/ttt_accuracy/pos3", "val/simulated_tokens_per_call",
                "val/tokens_per_call/t0", "val/tokens_per_call/t1", "val/per_position_acceptance/pos1/t0"):
        assert math.isfinite(m[key]), key
    assert 1.0 <= m["val/simulated_tokens_per_call"] <= 4.0          # 3 unrolled steps
    rows = [json.loads(line) for line in (online["output_dir"] / "speculative_samples.jsonl").read_text().splitlines()]
    assert all(r["matches_base"] for r in rows if r["temperature"] == 0)


def test_label_mask_counts_answer_tokens_only():
    batch = {"tokens": torch.zeros(2, 9, dtype=torch.long), "prompt_len": torch.tensor([3, 1]),
             "valid_len": torch.tensor([6, 9])}
    mask = label_mask(batch, 8)
    # position j predicts token j + 1: row 0 counts tokens 3, 4, 5; row 1 tokens 1..8
    assert mask[0].nonzero()[:, 0].tolist() == [2, 3, 4]
    assert mask[1].nonzero()[:, 0].tolist() == list(range(8))


def test_draft_vocabulary_comes_from_token_counts(hf, tmp_path):
    from train.run import validate
    tok = load_tokenizer(hf["llama"])
    vocab = len(tok)
    counts = [0] * vocab
    for i, c in zip([5, 9, 11, 2, 7], [50, 40, 30, 20, 10]):
        counts[i] = c
    f = counts_file(tmp_path / "counts.json", tok, counts)
    kwargs = validate(cfg(hf, tmp_path / "r", "head.draft_vocab_size=3", f"head.draft_vocab={f}"))
    assert kwargs["draft_ids"] == [5, 9, 11]


@pytest.mark.parametrize("case, message", [
    ("aux_out_of_range", "out of range"),
    ("counts_missing", "head.draft_vocab is not set"),
    ("counts_other_tokenizer", "another tokenizer"),
    ("ttt_steps", "task.ttt_steps"),
])
def test_bad_input_is_one_line_before_any_work(hf, tmp_path, case, message):
    from train.run import validate
    extra = {"aux_out_of_range": ["head.aux_layers=[1,2,9]"],
             "counts_missing": ["head.draft_vocab_size=8"],
             "ttt_steps": ["task.ttt_steps=0"]}.get(case, [])
    if case == "counts_other_tokenizer":
        other = load_tokenizer(hf["mismatch"])
        f = counts_file(tmp_path / "c.json", other, [1] * len(load_tokenizer(hf["llama"])))
        extra = ["head.draft_vocab_size=8", f"head.draft_vocab={f}"]
    out = tmp_path / "run"
    with pytest.raises(SpecdecError, match=message) as err:
        validate(cfg(hf, out, *extra))
    assert "\n" not in str(err.value) and not out.exists()
