"""`specdec plan` (train/plan.py): the sizes the EAGLE-3 recipe will use, from a target's config.json
alone (the real configs of four published models, written here) and the device: batches that fit an
80 GB GPU beside the weights, smaller ones on a smaller GPU, a 70B target refused on one GPU, the
draft vocabulary and aux layers from the target, the recipe taking the plan's sizes unless told
otherwise, and bad input in one line, exit 2."""

from __future__ import annotations

import json

import pytest

from train import plan

# the published config.json files (the keys the plan reads, and a few it does not)
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "head_dim": 128,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}
SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
CONFIGS = {"Llama-3.1-8B-Instruct": LLAMA_8B, "Llama-3.1-70B-Instruct": LLAMA_70B, "Qwen3-8B": QWEN3_8B,
           "SmolLM2-135M-Instruct": SMOLLM2_135M}
GB80 = 80 * 10**9                  # an "80 GB" H100 counted in decimal GB, 7% less than the 80 GiB planned with


@pytest.fixture
def folders(tmp_path):
    """Each model as a folder holding its config.json only (no weights)."""
    for name, config in CONFIGS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    return tmp_path


def gpu_plan(folder, memory="80GiB", gpus=1, **kwargs):
    return plan.plan_recipe(plan.read_target(str(folder)), plan.choose_hardware("cuda", memory, gpus), **kwargs)


@pytest.mark.parametrize("name, params, draft, aux", [
    ("Llama-3.1-8B-Instruct", 8_030_261_248, 32768, [2, 16, 29, 32]),
    ("Qwen3-8B", 8_190_726_144, 32768, [2, 18, 33, 36]),          # 8.19 B: Qwen3's q/k norms (9,216) left out
    ("SmolLM2-135M-Instruct", 134_515_008, 8192, [2, 15, 27, 30]),
])
def test_the_batches_fit_an_80_gb_gpu_beside_the_bf16_weights(folders, name, params, draft, aux):
    p = gpu_plan(folders / name)
    t = p.target
    assert t.params() == params and p["weights"] == 2 * params
    answer_row = (p.seq_len + 1) * t.kv_bytes_per_token() + t.vocab * 4
    cache_row = p.seq_len * t.pass_bytes_per_token()
    for rows in (p["answer_chunk"] * answer_row, p["cache_batch"] * cache_row):
        assert p["weights"] + rows < GB80 and p["weights"] + rows <= (1 - plan.RESERVED) * 80 * 2**30
    for key in ("answer_chunk", "cache_batch"):
        assert p[key] & (p[key] - 1) == 0 and p[key] >= 64             # powers of two, not starved
    assert p["answer_batch"] == 4 * p["answer_chunk"]
    assert p["draft_vocab_size"] == draft and p["aux_layers"] == aux
    assert p["train_minutes"] >= 5 and p["train_steps"] > 0 and p["cache_bytes"] > 0 and 0 < p["hours"] < 24


def test_llama_8b_keys_and_values_are_128_kib_a_token_and_a_smaller_gpu_gets_smaller_batches(folders):
    big, small = gpu_plan(folders / "Llama-3.1-8B-Instruct"), gpu_plan(folders / "Llama-3.1-8B-Instruct", "24GiB")
    assert big.target.kv_bytes_per_token() == 32 * 8 * 128 * 2 * 2 == 128 * 1024
    assert (big["answer_chunk"], big["answer_batch"], big["cache_batch"]) == (512, 2048, 256)
    # 24 GiB less 15% is 21.9 GB: 5.8 GB beside 16.1 GB of weights, 86 answering rows of 67.8 MB, 30 cache rows
    assert (small["answer_chunk"], small["answer_batch"], small["cache_batch"]) == (64, 256, 16)
    eight = gpu_plan(folders / "Llama-3.1-8B-Instruct", gpus=8)
    assert eight["train_minutes"] <= big["train_minutes"] and eight["hours"] < big["hours"]
    assert "trainer=ddp" in eight.flags() and "trainer.devices=8" in eight.flags()


def test_a_70b_target_on_one_80_gb_gpu_is_refused_in_one_line(folders, capsys):
    with pytest.raises(plan.SpecdecError, match=r"bf16 weights \(141.1 GB\) do not fit in one GPU's 80 GiB"):
        gpu_plan(folders / "Llama-3.1-70B-Instruct")
    assert plan.main(["--target", folders / "Llama-3.1-70B-Instruct", "--gpu-memory", "80GiB", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the answers and cache steps hold the whole target on each GPU" in err


def test_the_plan_prints_each_size_with_its_reason_and_the_recipes_command_line(folders, capsys):
    target = folders / "Llama-3.1-8B-Instruct" / "config.json"         # a config.json alone is enough
    assert plan.main(["--target", target, "--device", "cuda", "--gpu-memory", "80GiB", "--gpus", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("target: Llama-3.1-8B-Instruct, 32 layers") and "8 GPUs of 80 GiB" in out[0]
    for start in ("weights: 16.1 GB in bf16 per GPU (", "--answer-chunk: 512 (", "--answer-batch: 2048 (",
                  "--cache-batch: 256 (", "draft vocab size: 32,768 (", "aux layers: 2, 16, 29, 32 (",
                  "--train-minutes: ", "cache bytes: ", "hours: "):
        assert any(line.startswith(start) and line.endswith(")") for line in out), start
    assert out[-1].startswith("the recipe: --device cuda --conversations 12000 --answer-chunk 512 --answer-batch "
                              "2048 --cache-batch 256 --train-minutes ")
    assert out[-1].endswith("--train-args head.draft_vocab_size=32768 trainer=ddp trainer.devices=8")


def test_on_a_cpu_the_plan_keeps_the_measured_sizes(folders, capsys):
    p = plan.plan_recipe(plan.read_target(str(folders / "SmolLM2-135M-Instruct")), plan.choose_hardware("cpu"))
    assert (p["conversations"], p["answer_chunk"], p["answer_batch"], p["cache_batch"], p["train_minutes"]) == (
        1200, 64, 64, 16, 30.0)
    assert p["draft_vocab_size"] == 8192 and p["weights"] == 2 * 134_515_008


def test_the_draft_vocabulary_holds_a_sixth_of_the_targets_and_is_whole_for_a_small_one():
    assert [plan.draft_vocab_size(v) for v in (49152, 128256, 151936, 262144, 32000, 1000)] == [
        8192, 32768, 32768, 32768, 8192, None]


def test_a_gguf_header_gives_the_same_shape_as_the_config():
    pytest.importorskip("gguf")
    from train.smollm2 import smollm2_gguf

    try:
        path = smollm2_gguf()
    except plan.SpecdecError:
        pytest.skip("SmolLM2's GGUF is not installed (make setup-real)")
    gguf = plan.read_target(str(path))
    config = plan.Target.from_config("SmolLM2-135M-Instruct.Q4_1", SMOLLM2_135M)
    assert gguf == config


def test_the_recipe_takes_the_plans_sizes_unless_told_and_the_draft_vocabulary_is_overridable(folders, tmp_path):
    import argparse

    from conftest import command

    from train import eagle3_recipe as recipe

    script = command("eagle3")
    small = gpu_plan(folders / "Llama-3.1-8B-Instruct", "24GiB")
    names = ("conversations", "answer_batch", "answer_chunk", "cache_batch", "train_minutes")
    args = argparse.Namespace(device="cuda", **dict.fromkeys(names))
    got = script.device_defaults(args, small)
    assert (got.answer_chunk, got.answer_batch, got.cache_batch, got.train_minutes) == (
        64, 256, 16, small["train_minutes"])
    args = argparse.Namespace(device="cuda", **{**dict.fromkeys(names), "cache_batch": 8})
    assert script.device_defaults(args, small).cache_batch == 8
    s = recipe.Settings(target="/models/target.gguf", data="sharegpt", out=tmp_path / "r", draft_vocab_size=32768)
    assert recipe.train_config(s, tmp_path, 4).head.draft_vocab_size == 32768
    s.train_args = ("head.draft_vocab_size=16384",)
    assert recipe.train_config(s, tmp_path, 4).head.draft_vocab_size == 16384


@pytest.mark.parametrize("argv, message", [
    (["--target", "{empty}"], "the folder holds no config.json"),
    (["--target", "{notes}"], "is neither a model folder, a GGUF file (.gguf) nor a config.json"),
    (["--target", "{missing}"], "no such file"),
    (["--target", "{broken}"], "not a JSON config"),
    (["--target", "{llama}", "--gpu-memory", "80XB"], "--gpu-memory 80XB: give a size like 80GiB"),
    (["--target", "{llama}", "--gpu-memory", "80"], "--gpu-memory 80: give a size like 80GiB"),
    (["--target", "{llama}", "--gpu-memory", "16GiB"], "do not fit in one GPU's 16 GiB"),
    (["--target", "{llama}", "--gpu-memory", "17.6GiB"], "less than one row of the answer step"),
    (["--target", "{llama}", "--device", "cpu", "--gpus", "8"], "--gpu-memory and --gpus size GPUs"),
    (["--target", "{llama}", "--gpus", "0"], "--gpus must be a positive integer"),
    (["--target", "{fake}.gguf"], "not a readable GGUF file"),
])
def test_bad_input_is_one_line_and_exit_2(folders, tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "fake.gguf").write_bytes(b"GGUF not really")
    paths = {"empty": tmp_path / "empty", "notes": tmp_path / "notes.txt", "missing": tmp_path / "missing.json",
             "broken": tmp_path / "broken.json", "llama": folders / "Llama-3.1-8B-Instruct", "fake": tmp_path / "fake"}
    if any("{fake}" in a for a in argv):
        pytest.importorskip("gguf")
    assert plan.main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
