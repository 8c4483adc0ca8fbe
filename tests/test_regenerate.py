"""Regenerated rows carry the hidden states of the very calls that generated them
(train.data.regenerate.continue_with_states, Regenerated): equal to a teacher-forced pass at every
position a head reads and every layer, zero after, rows stopped at EOS, greedy rows equal to
`generate`'s, no second pass in the cache writer, and a killed build resuming to the same bytes.
A tiny random Llama (4 layers, hidden 32, fp32) over a word-level tokenizer."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from conftest import forked, hf_cache
from test_hf_data import build_tokenizer, stopping_target, write_corpus

from specdec_models.decode import GREEDY, generate
from specdec_models.hf import HFDecoder
from specdec_models.hf.weights import load_causal_lm
from train.data import regenerate
from train.data.regenerate import Regenerated, read_prompts

pytestmark = pytest.mark.usefixtures("offline", "one_thread")

SEQ = 32                      # prompts take up to 15 tokens (<= SEQ // 2)
DEPTH = 4
LAYERS = list(range(DEPTH + 1))
# 4 rows (2 batches) a shard: a kill lands inside one
BUILD = {"seq_len": SEQ, "windows": 12, "shard_size": "20KB", "batch_size": 2, "seed": 3, "chat": True,
         "temperatures": [0.0, 1.0], "layers": [1, -1], "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("regenerate")
    tok = build_tokenizer(d / "tok")
    write_corpus(d / "corpus.txt", docs=40)
    prompts = d / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": line}]})
                                 for line in write_corpus(d / "p.txt", docs=8, seed=1)) + "\n")
    path = d / "target"
    stopping_target(path, tok, depth=DEPTH)               # its rows stop at EOS
    model = load_causal_lm(path).requires_grad_(False)
    return {"tok": tok, "root": d, "prompts": prompts, "path": path, "model": model, "eos": tok.eos_token_id,
            "ids": read_prompts(prompts, tok, chat=True), "corpus": d / "corpus.txt"}


@pytest.fixture(scope="module")
def rows(hf):
    """12 regenerated rows (even ones greedy, odd ones sampled at T=1) with every layer's states."""
    source = Regenerated(HFDecoder(hf["model"], len(hf["tok"])), hf["ids"], SEQ, seed=3, layers=LAYERS,
                         temperatures=[0.0, 1.0], eos_id=hf["eos"])
    tokens, extra = source.rows(0, 12)
    return tokens, extra


def test_regenerated_states_equal_a_teacher_forced_pass_at_every_read_position_and_layer(hf, rows):
    tokens, extra = rows
    states, valid = extra["embeds"], extra["valid_len"]
    assert states.shape == (12, SEQ, len(LAYERS) * 32) and states.dtype == torch.float32
    with torch.no_grad():
        forced = hf["model"](tokens[:, :-1], output_hidden_states=True).hidden_states      # depth + 1 of (b, n, 32)
    for i in range(12):
        m = int(valid[i]) - 1                     # positions 0..valid-2: those whose next token is real
        for k, layer in enumerate(LAYERS):
            got, want = states[i, :m, 32 * k: 32 * (k + 1)], forced[layer][i, :m]
            scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-12)      # this token's, this layer's (the
            error = (got - want).abs() / scale                                   # <pad> embedding is zero)
            assert error.max() <= 1e-4, (i, layer)
        assert not states[i, m:].any()            # never fed (the last token, the padding): zero
    prompt_len = torch.as_tensor(extra["prompt_len"])
    assert (torch.as_tensor(valid) - prompt_len).min() >= 1                     # every row has an answer


def test_regenerated_rows_stop_at_eos_and_are_padded_with_it(hf, rows):
    tokens, extra = rows
    eos, stopped = hf["eos"], 0
    for i in range(12):
        n, p = int(extra["valid_len"][i]), int(extra["prompt_len"][i])
        answer = tokens[i, p:n].tolist()
        assert eos not in answer[:-1] and (n == SEQ + 1 or answer[-1] == eos)
        assert tokens[i, n:].eq(eos).all()
        stopped += n < SEQ + 1
    assert 2 <= stopped < 12                      # the test sees rows that stop and rows that reach the limit


def test_greedy_regenerated_rows_equal_generates_greedy_continuation(hf, rows):
    tokens, extra = rows
    greedy = list(range(0, 12, 2))                # temperatures [0, 1]: the even rows
    prompts = [tokens[i, : int(extra["prompt_len"][i])] for i in greedy]
    for i, prompt in zip(greedy, prompts, strict=True):
        out, _ = generate(hf["model"], [prompt], SEQ + 1 - prompt.numel(), sampling=GREEDY, eos_id=hf["eos"],
                          vocab_size=len(hf["tok"]))
        expected = torch.cat([prompt, out[0]])
        assert tokens[i, : int(extra["valid_len"][i])].tolist() == expected.tolist(), i


def counting_hidden(monkeypatch):
    """Make build_hf_cache's writer count the calls of the model's hidden()."""
    from dataclasses import replace

    calls = []
    write = regenerate.write_cache

    def counted(model, source, out, *args, **kw):
        def hidden(tokens):
            calls.append(tokens.shape[0])
            return model.hidden(tokens)
        return write(replace(model, hidden=hidden), source, out, *args, **kw)

    monkeypatch.setattr(regenerate, "write_cache", counted)
    return calls


def test_the_cache_of_regenerated_rows_makes_no_second_pass(hf, tmp_path, monkeypatch):
    calls = counting_hidden(monkeypatch)
    meta = hf_cache(hf["path"], tmp_path / "regenerated", prompts=hf["prompts"], **BUILD)
    assert meta["windows"] == 12 and meta["source"]["states"] == "generation" and calls == []
    hf_cache(hf["path"], tmp_path / "text", text=[str(hf["corpus"])],
                   **{k: v for k, v in BUILD.items() if k not in ("chat", "temperatures")})
    assert sum(calls) == 12                       # text windows: one teacher-forced pass per batch, as before


def test_a_killed_regenerated_build_resumes_to_the_same_bytes(hf, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert hf_cache(hf["path"], whole, prompts=hf["prompts"], **BUILD)["rows_per_shard"] == 4
    batches = []

    def killed() -> None:
        def progress(tokens):                     # SIGKILL inside shard 1 (its first batch of two is done)
            batches.append(tokens)
            if len(batches) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        hf_cache(hf["path"], resumed, prompts=hf["prompts"], progress=progress, **BUILD)

    child = forked(killed, timeout=300)
    assert child.status == -signal.SIGKILL, child.output
    partial = tmp_path / "resumed.partial" / "dataset"
    assert not resumed.exists() and sorted(p.name for p in partial.glob("data-*.arrow")) == ["data-00000.arrow"]
    lines = []
    hf_cache(hf["path"], resumed, prompts=hf["prompts"], report=lines.append, **BUILD)
    assert any("1 of 3 shard(s) already written" in line for line in lines)
    files = sorted(p.relative_to(whole) for p in whole.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(resumed) for p in resumed.rglob("*") if p.is_file())
    for name in files:
        assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name
