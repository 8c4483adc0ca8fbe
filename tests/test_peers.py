"""The peers' EAGLE-3 trainers live: specdec's cache in their data formats, their trainers run
on this CPU, their heads drafting in specdec (`train.data.peer_formats`, scripts/peers/,
scripts/train_peers.py).

A tiny random Llama target (hidden 32, 4 layers, a word-level tokenizer) and an int8 cache of its
own continuations of chat prompts at layers [1, 2, 3, 4] (3 aux layers and the last, after the
final norm). Runs in the interop environment (`make test-interop`), marked `interop`; the
converter tests need only `datasets`, the trainer test skips where `speculators` is missing.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from conftest import hf_cache
from test_hf_data import build_tokenizer, write_corpus
from test_hf_distill import save_model

from specdec_models.heads.eagle3 import _final_norm_weight
from specdec_models.hf.weights import load_causal_lm
from train.data.embeddings_cache import cache_rows, open_cache, read_cache_meta
from train.data.peer_formats import answer_mask, before_final_norm, cache_layout, to_specforge, to_speculators

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("offline", "one_thread")]

SEQ = 32
LAYERS = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("peers")
    tok = build_tokenizer(d / "tok")
    prompts = d / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": line}]})
                                 for line in write_corpus(d / "p.txt", docs=12, seed=1)) + "\n")
    target = save_model(d / "llama", tok, "llama", 1, depth=4)
    model = load_causal_lm(target)
    with torch.no_grad():                           # final-norm gains away from 1, so post / g matters, and
        model.model.norm.weight.copy_(0.5 + torch.rand(32, generator=torch.Generator().manual_seed(0)))
        model.model.embed_tokens.weight.mul_(50)    # activations of a real LM's size (rms ~1, not 0.02: eps is 1e-6)
    model.save_pretrained(target)
    hf_cache(target, d / "cache", layers=LAYERS, seq_len=SEQ, windows=16, shard_size="64KB", batch_size=4,
                   seed=2, prompts=prompts, chat=True, temperatures=[0.0, 1.0], dtype="int8")
    return {"root": d, "target": target, "cache": d / "cache", "model": load_causal_lm(target)}


def cached(cache):
    meta = read_cache_meta(cache)
    return meta, cache_rows(open_cache(cache, meta), np.arange(meta["windows"]), meta)


def test_the_state_before_the_final_norm_maps_back_onto_the_last_layer(tiny):
    """post / g under the target's own final RMSNorm is post (the last hidden state, fp32)."""
    model = tiny["model"]
    tokens = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        post = model(input_ids=tokens, output_hidden_states=True).hidden_states[-1]      # after the final norm
        back = model.model.norm(before_final_norm(post, _final_norm_weight(model)))
    assert not torch.allclose(model.model.norm.weight, torch.ones(32))
    assert float((back - post).abs().max()) <= 1e-5


def test_speculators_data_holds_the_aux_layers_and_the_state_before_the_final_norm(tiny, tmp_path):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    model = tiny["model"]
    norm = model.model.norm
    summary = to_speculators(tiny["cache"], tmp_path / "spec", _final_norm_weight(model), dtype=torch.float32)
    meta, batch = cached(tiny["cache"])
    assert summary["aux_layers"] == [1, 2, 3] and summary["rows"] == meta["windows"]
    data = load_from_disk(str(tmp_path / "spec"))
    assert set(data.column_names) == {"input_ids", "loss_mask", "seq_len"}
    embeds = batch["embeds"].view(meta["windows"], SEQ, len(LAYERS), -1)
    g = _final_norm_weight(model)
    worst = 0.0
    for i in range(meta["windows"]):
        valid, prompt = int(batch["valid_len"][i]), int(batch["prompt_len"][i])
        T = min(valid, SEQ)
        row = data[i]
        hs = load_file(str(tmp_path / "spec" / "hidden_states" / f"hs_{i}.safetensors"))
        assert hs["hidden_states"].shape == (T, 4, 32) and int(row["seq_len"]) == T
        assert torch.equal(hs["token_ids"], row["input_ids"]) and torch.equal(row["input_ids"], batch["tokens"][i, :T])
        assert torch.equal(hs["hidden_states"][:, :3], embeds[i, :T, :3])            # the aux layers as cached
        assert torch.allclose(hs["hidden_states"][:, 3], embeds[i, :T, 3] / g, rtol=1e-6, atol=0)
        with torch.no_grad():          # under the verifier's norm: the cached state, up to int8 rounding of its rms
            back = norm(hs["hidden_states"][:, 3])
            worst = max(worst, float(((back - embeds[i, :T, 3]).norm(dim=-1) / embeds[i, :T, 3].norm(dim=-1)).max()))
        # loss_mask[j] weighs the target's prediction at j, of token j + 1: an answer token
        want = [int(prompt <= j + 1 < valid) for j in range(T)]
        assert row["loss_mask"].tolist() == want == answer_mask(SEQ, prompt, valid)[:T].long().tolist()
        assert 0 < sum(want) < T
    assert worst <= 0.02, worst             # int8: a few 1/127 steps of relative rounding


def test_speculators_pairs_each_feature_with_the_mask_of_the_label_it_predicts(tiny, tmp_path):
    pytest.importorskip("speculators")
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset

    to_speculators(tiny["cache"], tmp_path / "spec", _final_norm_weight(tiny["model"]), dtype=torch.float32)
    _, batch = cached(tiny["cache"])
    dataset = ArrowDataset(max_len=512, datapath=tmp_path / "spec", on_missing="raise",
                           hidden_states_dtype=torch.float32)
    for i in range(3):
        item = shift_batch(dataset[i])                                 # what the trainer reads, position t
        T = item["input_ids"].shape[0] + 1
        label = answer_mask(SEQ, int(batch["prompt_len"][i]), int(batch["valid_len"][i]))
        assert item["loss_mask"].bool().tolist() == label[1:T].tolist()  # the verifier state of t + 1 predicts t + 2
        assert torch.equal(item["input_ids"], batch["tokens"][i, 1:T])


def test_specforge_data_holds_the_post_norm_state_and_its_shifted_mask(tiny, tmp_path):
    summary = to_specforge(tiny["cache"], tmp_path / "sf", dtype=torch.float32)
    meta, batch = cached(tiny["cache"])
    embeds = batch["embeds"].view(meta["windows"], SEQ, len(LAYERS), -1)
    files = sorted((tmp_path / "sf").glob("*.ckpt"))
    assert len(files) == summary["rows"] == meta["windows"]
    for i, path in enumerate(files):
        row = torch.load(path, weights_only=True)
        valid, prompt = int(batch["valid_len"][i]), int(batch["prompt_len"][i])
        T = min(valid, SEQ)
        assert torch.equal(row["input_ids"], batch["tokens"][i, :T])
        assert torch.equal(row["hidden_state"], embeds[i, :T, 3][None].bfloat16())   # SpecForge's TargetHead is bf16
        assert torch.equal(row["aux_hidden_state"], embeds[i, :T, :3].reshape(1, T, -1))
        # SpecForge shifts the target's logits left by one, not the mask: loss_mask[i] weighs position i + 1
        want = [int(prompt <= j + 2 < valid) for j in range(T - 1)] + [0]
        assert row["loss_mask"].tolist() == want


def test_a_cache_without_the_last_layer_or_three_aux_layers_is_refused_in_one_line():
    from specdec_models.errors import SpecdecError

    for layers, message in [([1, 2, 3], "not the last"), ([1, 2, 4], "exactly 3")]:
        with pytest.raises(SpecdecError, match=message) as err:
            cache_layout({"layers": layers, "depth": 4})
        assert "\n" not in str(err.value)


def _train_peers(tiny, tmp_path, peers):
    """scripts/train_peers.py on the tiny cache, draft vocabulary the 24 most counted tokens, 3 steps."""
    from conftest import command

    train_peers = command("train_peers")
    from specdec_models.hf.weights import load_tokenizer, tokenizer_fingerprint
    from train.tasks.hf_eagle3 import COUNTS_FORMAT

    counts = tmp_path / "counts.json"
    meta = read_cache_meta(tiny["cache"])
    counts.write_text(json.dumps({"format": COUNTS_FORMAT, "tokenizer_sha256": tokenizer_fingerprint(
        load_tokenizer(tiny["target"])), "counts": list(range(meta["vocab_size"]))}))
    out = tmp_path / "peers"
    status = train_peers.main(["--cache", str(tiny["cache"]), "--target", str(tiny["target"]), "--draft-vocab",
                               str(counts), "--draft-vocab-size", "24", "--max-steps", "3", "--out", str(out),
                               "--python", sys.executable, "--data-dtype", "float32", "--peers", ",".join(peers)])
    logs = "\n".join((out / p / "train.log").read_text()[-3000:] for p in peers if (out / p / "train.log").is_file())
    assert status == 0, logs
    return out, meta


@pytest.mark.parametrize("peer, layout", [("speculators", "speculators"), ("specforge", "sglang")])
def test_a_peers_trainer_runs_on_cpu_and_its_head_drafts_in_specdec(tiny, tmp_path, peer, layout):
    """The peer's own trainer, patched at run time, 3 optimizer steps; its head (speculators':
    its own layout; SpecForge's: exported by its own SGLang exporter) loads in specdec with
    specdec's draft vocabulary and aux layers, and greedy decoding with it equals plain greedy
    (train_peers checks that)."""
    pytest.importorskip(peer)
    from specdec_models.export.eagle3 import load_eagle3

    out, meta = _train_peers(tiny, tmp_path, [peer])
    report = json.loads((out / "peers.json").read_text())["peers"][peer]
    assert report["steps"] == 3 and report["stopped_by"] == "max_steps" and report["tokens_per_s"] > 0
    assert report["in_specdec"]["layout"] == layout and report["in_specdec"]["drafted"] > 0
    head = load_eagle3(out / peer / "head", tiny["model"])
    assert head.aux_layers == [1, 2, 3] and head.config.draft_vocab_size == 24
    assert head.draft_ids.tolist() == list(range(meta["vocab_size"] - 24, meta["vocab_size"]))  # the most counted
    assert torch.isfinite(head.fc.weight).all()


def test_the_torch_stand_in_for_specforges_triton_loss_computes_its_maths():
    """scripts/peers/specforge_loss.py against the formula SpecForge's kernels compute, written out
    position by position: per unmasked row -sum_v p_v log softmax(z)_v, masked rows 0, the mean over
    all B T rows; and its gradient against the kernels' backward, (softmax(z) sum_v p_v - p) / (B T)
    on unmasked rows, 0 on masked ones. Random logits with a non-finite masked row (the kernels
    skip it)."""
    from conftest import load_script

    LogSoftmaxLoss = load_script("peers/specforge_loss").LogSoftmaxLoss

    g = torch.Generator().manual_seed(0)
    B, T, V = 2, 5, 11
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    target = torch.softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    mask = (torch.rand(B, T, 1, generator=g) < 0.6).long()
    mask[0, 0], mask[1, 2] = 1, 0
    logits[1, 2] = float("inf")                                         # a masked row the kernels never read
    z = logits.clone().requires_grad_()
    loss = LogSoftmaxLoss.apply(z, target, mask)
    loss.backward()
    want, grad = torch.zeros((), dtype=torch.float64), torch.zeros_like(logits)
    for b in range(B):
        for t in range(T):
            if mask[b, t, 0]:
                m = logits[b, t].max()
                logp = logits[b, t] - m - torch.log(torch.exp(logits[b, t] - m).sum())
                want -= (target[b, t] * logp).sum()
                grad[b, t] = (torch.exp(logp) * target[b, t].sum() - target[b, t]) / (B * T)
    assert torch.allclose(loss.double(), want / (B * T), rtol=1e-6, atol=0)
    assert torch.isfinite(z.grad).all() and torch.allclose(z.grad, grad, rtol=1e-5, atol=1e-7)
