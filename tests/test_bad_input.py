"""Issue 70's bad input, through the `specdec` command: each is one line on stderr, exit status 2,
before any work, nothing written (an unknown verb or flag, `--device cuda` without CUDA, a
`--gpu-memory` that fits no batch, `plan` on a file that is no model). An `--experiment` whose task
is not hf_eagle3 and a `--train-args` override that does not compose are refused by the recipe's
checks, before step 1, on a real tiny target: tests/test_eagle3_recipe.py
(test_bad_input_is_one_line_and_exit_2_before_any_work)."""

from __future__ import annotations

import json

import pytest

from train import cli

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
            "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def one_line_exit_2(capsys, argv, message: str) -> str:
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, (code, err)
    return err


def _every_verb() -> list[list[str]]:
    verbs = [[v] for v in {**cli.VERBS, **cli.TOOLS} if v not in ("bench",)]
    return verbs + [["bench", name] for name in cli.BENCH]


@pytest.mark.parametrize("verb", _every_verb(), ids=lambda v: " ".join(v))
def test_an_unknown_flag_is_one_line_and_exit_2_for_every_verb(verb, capsys):
    one_line_exit_2(capsys, [*verb, "--no-such-flag"], "--no-such-flag")


@pytest.mark.parametrize("argv, message", [(["fly"], "unknown verb 'fly'"), (["bench", "fly"], "unknown verb 'fly'")])
def test_an_unknown_verb_is_one_line_and_exit_2(argv, message, capsys):
    one_line_exit_2(capsys, argv, message)


@pytest.fixture
def llama(tmp_path):
    """Llama-3.1-8B-Instruct as a folder holding its config.json only."""
    folder = tmp_path / "Llama-3.1-8B-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    return folder


@pytest.mark.parametrize("verb", ["eagle3", "evaluate", "decode", "cache"])
def test_device_cuda_without_cuda_is_one_line_and_exit_2(verb, llama, tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    argv = {"eagle3": ["--target", llama, "--data", "sharegpt", "--out", out],
            "evaluate": ["--target", llama, "--lookup", "--out", out],
            "decode": ["--hf-model", llama, "--prompt", "hi"],
            "cache": ["--hf-model", llama, "--text", tmp_path / "t.txt", "--out", out]}[verb]
    one_line_exit_2(capsys, [verb, *argv, "--device", "cuda"], "CUDA")
    assert not out.exists()


def test_a_gpu_memory_that_fits_no_batch_is_one_line_and_exit_2(llama, capsys):
    one_line_exit_2(capsys, ["plan", "--target", llama, "--device", "cuda", "--gpu-memory", "17.6GiB"],
                    "less than one row of the answer step")


def test_plan_on_a_file_that_is_no_model_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    one_line_exit_2(capsys, ["plan", "--target", tmp_path / "notes.txt"], "is neither a model folder")


def test_specdec_train_refuses_an_unknown_flag_in_one_line(capsys):
    one_line_exit_2(capsys, ["train", "--no-such-flag"], "unknown flag '--no-such-flag'")
