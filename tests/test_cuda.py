"""The Hugging Face pipeline on a CUDA device: skipped where there is none (CI has none), run on a
GPU machine before its figures are trusted. A tiny random Llama over a word-level tokenizer (the
fixtures of test_hf_prophet_task): decoding with an eagle3 head (chain and tree, greedy and
sampled, with a CUDA generator) gives plain greedy decoding's tokens on the GPU; the cache of the
target's own answers builds on the GPU with the states a CPU build stores; the eagle3 task trains
with `trainer.accelerator=gpu` and its export decodes; the comparison script runs with
`--device cuda`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.usefixtures("offline")]

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from conftest import command, hf_cache
from test_hf_eagle3_task import cfg
from test_hf_prophet_task import SEQ, hf  # noqa: F401  (the tiny targets, tokenizer and prompts)

from specdec_models.decode import GREEDY, HeadDrafter, SamplingConfig, TreeDrafter, TreeSpec, generate
from specdec_models.heads.eagle3 import Eagle3Config, Eagle3Head
from specdec_models.hf.weights import load_causal_lm
from train.data.embeddings_cache import cache_rows, open_cache, read_cache_meta
from train.run import run

PROMPTS = [torch.tensor([4, 9, 12]), torch.tensor([7, 5, 20, 21, 6])]


@pytest.fixture(scope="module")
def cuda_pair(hf):
    torch.manual_seed(0)
    target = load_causal_lm(hf["llama"]).eval().cuda()
    head = Eagle3Head(Eagle3Config.for_target(target, draft_vocab_size=None, aux_layers=[0, 1, 2]), target).eval()
    return target, head


def test_a_head_on_the_gpu_decodes_the_targets_greedy_tokens_chain_and_tree(cuda_pair):
    target, head = cuda_pair
    assert head.device.type == "cuda"
    plain, _ = generate(target, PROMPTS, 12, sampling=GREEDY)
    for drafter in (HeadDrafter(head), TreeDrafter(head, TreeSpec.parse("3,2,1,4"))):
        tokens, stats = generate(target, PROMPTS, 12, drafter, sampling=GREEDY, gamma=3)
        assert [t.tolist() for t in tokens] == [t.tolist() for t in plain], drafter
        assert stats.tokens_per_call >= 1


def test_sampling_on_the_gpu_draws_from_a_cuda_generator_chain_and_tree(cuda_pair):
    target, head = cuda_pair
    for drafter in (HeadDrafter(head), TreeDrafter(head, TreeSpec.parse("3,2,1,4"))):
        g = torch.Generator(device="cuda").manual_seed(0)
        tokens, _ = generate(target, PROMPTS, 12, drafter, sampling=SamplingConfig(temperature=1.0), gamma=3,
                             generator=g)
        again, _ = generate(target, PROMPTS, 12, drafter, sampling=SamplingConfig(temperature=1.0), gamma=3,
                            generator=torch.Generator(device="cuda").manual_seed(0))
        assert [len(t) for t in tokens] == [12, 12], drafter
        assert [t.tolist() for t in tokens] == [t.tolist() for t in again], drafter      # the seed decides


def test_the_cache_builds_on_the_gpu_with_the_states_of_its_rows(hf, tmp_path):
    # the states the generating calls on the GPU stored are those a teacher-forced pass over the
    # stored rows gives on the CPU (bf16 storage), up to each row's last real token
    from specdec_models.heads.eagle3 import target_hidden_states

    hf_cache(hf["llama"], tmp_path / "gpu", seq_len=SEQ, windows=8, shard_size="64KB", batch_size=4, seed=2,
                   prompts=hf["prompts"], chat=True, temperatures=[0.0, 1.0], layers=[0, 1, 2], dtype="bfloat16",
                   device="cuda")
    meta = read_cache_meta(tmp_path / "gpu")
    rows = cache_rows(open_cache(tmp_path / "gpu", meta), np.arange(8), meta)
    reference = target_hidden_states(load_causal_lm(hf["llama"]).eval(), rows["tokens"][:, :-1], [0, 1, 2])
    for i, valid in enumerate(rows["valid_len"].tolist()):
        assert valid > int(rows["prompt_len"][i])                                   # an answer was generated
        torch.testing.assert_close(rows["embeds"][i, : valid - 1].float(), reference[i, : valid - 1],
                                   rtol=0.02, atol=0.02)


def test_the_eagle3_task_trains_on_the_gpu_and_its_export_decodes(hf, tmp_path):
    from specdec_models.export import load_eagle3

    out = run(cfg(hf, tmp_path / "run", "trainer.accelerator=gpu", "trainer.precision=bf16-mixed",
                  "callbacks.speculative_eval.tree='2,2,1'"))
    assert out["global_step"] == 6
    m = out["metrics"]
    for key in ("train/loss", "val/loss", "val/simulated_tokens_per_call", "val/tokens_per_call/t0",
                "val/tree/tokens_per_call/t1"):
        assert math.isfinite(m[key]), key
    target = load_causal_lm(hf["llama"]).eval().cuda()
    head = load_eagle3(out["export_dir"], target)
    plain, _ = generate(target, PROMPTS, 12, sampling=GREEDY)
    tokens, _ = generate(target, PROMPTS, 12, HeadDrafter(head), sampling=GREEDY, gamma=3)
    assert [t.tolist() for t in tokens] == [t.tolist() for t in plain]


def test_the_comparison_runs_on_the_gpu(hf, tmp_path, capsys):
    out = run(cfg(hf, tmp_path / "run", "trainer.max_steps=2", "callbacks.speculative_eval=null"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick fox\nthe lazy dog\n")
    status = command("compare_hf_drafts").main([
        "compare", "--target", str(hf["llama"]), "--eagle3", f"x={out['export_dir']}", "--tree", "2,2,1",
        "--prompts", str(prompts), "--count", "2", "--batch1-count", "1", "--batch1-only", "--max-new-tokens", "8",
        "--rounds", "1", "--gamma", "3", "--check-count", "1", "--device", "cuda", "--out", str(tmp_path / "cmp")])
    assert status == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert report["device_name"] == torch.cuda.get_device_name()
    assert all(report["greedy_equals_transformers_generate"].values())
    assert {r["method"] for r in report["rows"]} == {"plain", "eagle3 x", "eagle3 x tree 2,2,1"}


def test_the_decoding_cli_decodes_on_the_gpu_with_device_cuda(hf, tmp_path, capsys):
    # an eagle3 export and its Hugging Face target, moved there by --device; auto picks the GPU's dtype
    from specdec_models.cpu import fast_dtype
    from specdec_models.decode.__main__ import main

    out = run(cfg(hf, tmp_path / "run", "trainer.max_steps=2", "callbacks.speculative_eval=null"))
    capsys.readouterr()                                                      # the training's own output
    args = ["--hf-model", str(hf["llama"]), "--eagle3", str(out["export_dir"]), "--prompt", "the quick fox",
            "--max-new-tokens", "8", "--ignore-eos", "--device", "cuda", "--json"]
    results = []
    for extra in (["--temperature", "0", "--dtype", "float32"], ["--temperature", "1", "--seed", "3"],
                  ["--temperature", "1", "--seed", "3"]):
        assert main([*args, *extra]) == 0, capsys.readouterr().err
        results.append(json.loads(capsys.readouterr().out))
    assert results[0]["method"] == "eagle3" and results[0]["stats"]["new_tokens"] == 8
    assert results[1]["continuations"] == results[2]["continuations"]          # a CUDA generator, seeded
    assert fast_dtype("cuda") in (torch.bfloat16, torch.float32)
