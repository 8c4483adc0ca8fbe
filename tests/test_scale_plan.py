"""scripts/scale_plan.py: its parameter counts equal the published sizes and a built model's, its
cache bytes the writer's, and its CLI prints the tables or refuses bad input in one line."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from conftest import command

plan = command("scale_plan")


def test_llama_parameter_counts_are_the_published_ones():
    small, large = (plan.Target.from_config(name, c) for name, c in plan.LLAMA_3_1.items())
    assert small.params() == 8_030_261_248          # the model cards' 8.03B
    assert large.params() == 70_553_706_496         # and 70.6B
    smol = plan.Target.from_config("SmolLM2-135M", plan.SMOLLM2)
    assert smol.params() == 134_515_008 and smol.forward_flops() == 2 * 134_515_008   # tied: the LM head multiplies
    assert small.forward_flops() == 2 * (small.params() - 128256 * 4096)             # untied: the embedding is a lookup


def test_counts_equal_a_built_llama_and_its_eagle3_head():
    import torch

    from specdec_models.heads.eagle3 import Eagle3Config, Eagle3Head

    config = {"hidden_size": 32, "num_hidden_layers": 4, "vocab_size": 96, "intermediate_size": 48,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    head = Eagle3Head(Eagle3Config.for_target(target, draft_vocab_size=40), target)
    t = plan.Target.from_config("tiny", config)
    assert t.params() == sum(p.numel() for p in target.parameters())
    assert t.layer_params() == sum(p.numel() for p in target.model.layers[0].parameters())
    body, lm_head = t.head_params(40)
    assert lm_head == head.lm_head.weight.numel()
    assert body + lm_head == sum(p.numel() for p in head.parameters() if p.requires_grad)


def test_cache_bytes_per_token_are_the_writers_rows_over_the_filled_share():
    from train.data.chat_rows import ChatRows
    from train.data.embeddings_cache import row_bytes

    t = plan.Target.from_config("Llama-3.1-8B", plan.LLAMA_3_1["Llama-3.1-8B"])
    n = plan.SEQ_LEN
    # 4 layers ([2, 16, 29] and the last) of 4,096 bf16 values per position; int32 tokens (128,256 ids), the
    # loss mask, and offset, prompt_len, valid_len per row
    per_row = n * 4 * 4096 * 2 + (n + 1) * 4 + (n + 1) + 8 + 4 + 4
    assert row_bytes(n, 4096, "bfloat16", 0, 128256, ChatRows.columns, 4) == per_row
    assert t.cache_bytes_per_token("bfloat16") == pytest.approx(per_row / n / plan.FILL)
    int8_row = n * 4 * (4096 + 4) + (n + 1) * 5 + 16                                 # a float32 scale per layer
    assert t.cache_bytes_per_token("int8") == pytest.approx(int8_row / n / plan.FILL)
    assert 0.66 < plan.FILL < 0.68 and 0.69 < plan.ANSWER_SHARE < 0.70


def test_memory_holds_the_lean_parts_or_the_target_whole_or_sharded():
    t = plan.Target.from_config("Llama-3.1-8B", plan.LLAMA_3_1["Llama-3.1-8B"])
    m = t.memory(8, 32_000)
    assert m["offline"] == (2 * 128256 * 4096 + 4096) * 2 + t.layer_params() * 2
    assert m["online"] == t.params() * 2
    kept = (2 * t.vocab * t.hidden + t.hidden) * 2
    assert m["sharded"] == kept + (t.params() * 2 - kept) / 8 + 2 * t.layer_params() * 2
    assert m["head"] == sum(t.head_params(32_000)) * 16


def test_the_cli_prints_the_tables(capsys, tmp_path):
    assert plan.main([]) == 0
    out = capsys.readouterr().out
    assert "| cache per 100M tokens | Llama-3.1-8B | Llama-3.1-70B |" in out
    assert "| bf16 | 4.90 TB" in out and "| int8 | 2.45 TB" in out and "8.03 B | 70.55 B" in out
    assert out.count(" H100-h (") == 6 and "sharded over 8 ranks" in out
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text(json.dumps(plan.SMOLLM2))
    assert plan.main(["--config", str(tmp_path / "mine" / "config.json"), "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "| cache per 100M tokens | mine |" in out and "sharded over 2 ranks" in out


@pytest.mark.parametrize("argv, match", [
    (["--ranks", "0"], "--ranks must be >= 1"),
    (["--config", "MISSING.json"], "MISSING.json: no such file"),
    (["--config", "{bad}"], "not a JSON config"),
    (["--config", "{partial}"], "lacks intermediate_size, num_attention_heads"),
    (["--config", "{zero}"], "hidden_size must be a positive integer"),
])
def test_bad_input_is_one_line(capsys, tmp_path, argv, match):
    (tmp_path / "bad").write_text("{not json")
    (tmp_path / "partial").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10}))
    (tmp_path / "zero").write_text(json.dumps({**plan.SMOLLM2, "hidden_size": 0}))
    argv = [a.format(bad=tmp_path / "bad", partial=tmp_path / "partial", zero=tmp_path / "zero") for a in argv]
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1
