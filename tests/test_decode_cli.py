"""The decoding CLI (`python -m specdec_models.decode`): methods and their defaults, JSON output,
greedy exactness through the CLI, and a one-line `error: ...` with exit status 2 for bad input."""

import json
import subprocess
import sys

import pytest
import torch

from specdec_models import Decoder, ModelConfig, ModelWithProphet, ProphetConfig, save_export
from specdec_models.decode.__main__ import main

MAX_LEN = 32


def tiny_cfg(vocab=256, dim=32, depth=2):
    return ModelConfig(vocab_size=vocab, dim=dim, depth=depth, heads=2, dim_head=16, max_seq_len=MAX_LEN)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Tiny exports: a target decoder, a smaller draft, a model_with_prophet, and a vocab-100 target."""
    root = tmp_path_factory.mktemp("exports")
    torch.manual_seed(0)
    save_export(root / "target", Decoder(tiny_cfg()))
    save_export(root / "draft", Decoder(tiny_cfg(dim=16 * 2, depth=1)))
    save_export(root / "draft100", Decoder(tiny_cfg(vocab=100, depth=1)))
    save_export(root / "target100", Decoder(tiny_cfg(vocab=100)))
    prophet = ProphetConfig(model=ModelConfig(vocab_size=256, dim=16, depth=1, heads=1, dim_head=16, max_seq_len=16),
                            prophet_train_length=6, num_leading_start_tokens=2)
    save_export(root / "prophet", ModelWithProphet(tiny_cfg(), prophet))
    return root


def cli(capsys, *argv):
    """Run the CLI in-process: (exit status, stdout, stderr)."""
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def cli_json(capsys, *argv):
    status, out, err = cli(capsys, *argv, "--json")
    assert status == 0, err
    assert err == ""
    return json.loads(out)


def assert_usage_error(capsys, match, *argv):
    status, out, err = cli(capsys, *argv)
    assert status == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert match in lines[0], lines[0]
    assert "Traceback" not in err


# ---------------------------------------------------------------- decoding

@pytest.mark.parametrize("extra, method", [
    ((), "base"),
    (("--draft", "draft"), "draft"),
])
def test_json_output_has_one_continuation_per_row_and_the_stats(exports, capsys, extra, method):
    extra = tuple(exports / a if a == "draft" else a for a in extra)
    result = cli_json(capsys, "--export", exports / "target", "--prompt", "hello", "--batch", 3,
                      "--max-new-tokens", 7, "--seed", 0, *extra)
    assert set(result) == {"method", "continuations", "stats"}
    assert result["method"] == method == result["stats"]["method"]
    assert len(result["continuations"]) == 3 and all(isinstance(c, str) for c in result["continuations"])
    stats = result["stats"]
    assert stats["new_tokens"] == 3 * 7 and stats["batch"] == 3
    for key in ("target_calls", "drafted", "accepted", "acceptance_rate", "tokens_per_call", "alpha",
                "per_position_acceptance", "wall_seconds", "tokens_per_second"):
        assert key in stats, key
    if method == "base":
        assert stats["tokens_per_call"] == 1 and stats["acceptance_rate"] is None
    else:
        assert 0 <= stats["acceptance_rate"] <= 1 and len(stats["per_position_acceptance"]) == 5


def test_a_model_with_prophet_export_decodes_with_its_prophet_by_default(exports, capsys):
    result = cli_json(capsys, "--export", exports / "prophet", "--prompt", "abc", "--max-new-tokens", 9,
                      "--gamma", 3, "--seed", 1)
    assert result["method"] == "prophet" and result["stats"]["gamma"] == 3
    assert result["stats"]["new_tokens"] == 9 and result["stats"]["drafted"] > 0
    base = cli_json(capsys, "--export", exports / "prophet", "--prompt", "abc", "--max-new-tokens", 9,
                    "--method", "base")
    assert base["method"] == "base" and base["stats"]["drafted"] == 0


def test_greedy_speculative_continuations_equal_greedy_base_through_the_cli(exports, capsys):
    common = ("--prompt", "The fox", "--max-new-tokens", 12, "--temperature", 0, "--batch", 2)
    base = cli_json(capsys, "--export", exports / "prophet", "--method", "base", *common)
    prophet = cli_json(capsys, "--export", exports / "prophet", "--method", "prophet", *common)
    assert prophet["continuations"] == base["continuations"]
    target = cli_json(capsys, "--export", exports / "target", *common)
    draft = cli_json(capsys, "--export", exports / "target", "--draft", exports / "draft", *common)
    assert draft["continuations"] == target["continuations"]


def test_the_same_seed_gives_the_same_sample_and_another_seed_differs(exports, capsys):
    args = ("--export", exports / "target", "--prompt", "seed", "--max-new-tokens", 16)
    a = cli_json(capsys, *args, "--seed", 5)["continuations"]
    assert cli_json(capsys, *args, "--seed", 5)["continuations"] == a
    assert cli_json(capsys, *args, "--seed", 6)["continuations"] != a


def test_continuation_is_the_new_bytes_decoded_as_utf8(exports, capsys):
    from specdec_models import load_export
    from specdec_models.decode import GREEDY, generate

    result = cli_json(capsys, "--export", exports / "target", "--prompt", "ab", "--max-new-tokens", 10,
                      "--temperature", 0)
    tokens, _ = generate(load_export(exports / "target"), torch.tensor([list(b"ab")]), 10, sampling=GREEDY)
    assert result["continuations"] == [bytes(tokens[0].tolist()).decode("utf-8", errors="replace")]


def test_eos_id_stops_a_row_after_that_token(exports, capsys):
    from specdec_models import load_export
    from specdec_models.decode import GREEDY, generate

    tokens, _ = generate(load_export(exports / "target"), torch.tensor([list(b"stop")]), 12, sampling=GREEDY)
    full = tokens[0].tolist()
    eos = full[3]
    cut = full[: full.index(eos) + 1]
    result = cli_json(capsys, "--export", exports / "target", "--prompt", "stop", "--max-new-tokens", 12,
                      "--temperature", 0, "--eos-id", eos)
    assert result["stats"]["new_tokens"] == len(cut) < 12
    assert result["continuations"] == [bytes(cut).decode("utf-8", errors="replace")]


def test_text_output_prints_each_row_and_a_stats_summary(exports, capsys):
    status, out, err = cli(capsys, "--export", exports / "prophet", "--prompt", "hi", "--batch", 2,
                           "--max-new-tokens", 5, "--seed", 0)
    assert status == 0 and err == ""
    assert "--- row 0" in out and "--- row 1" in out
    summary = out.splitlines()[-1]
    assert summary.startswith("--- prophet: 10 new tokens") and "acceptance rate" in summary and "alpha" in summary


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, match", [
    (("--prompt", ""), "--prompt is empty"),
    (("--prompt", "x" * (MAX_LEN + 1)), f"max_seq_len {MAX_LEN}"),
    (("--prompt", "x", "--gamma", 0), "--gamma must be >= 1 or auto"),
    (("--prompt", "x", "--temperature", -0.5), "temperature must be >= 0"),
    (("--prompt", "x", "--top-p", 0), "top_p must be in (0, 1]"),
    (("--prompt", "x", "--top-p", 1.5), "top_p must be in (0, 1]"),
    (("--prompt", "x", "--top-k", 0), "top_k must be an integer >= 1"),
    (("--prompt", "x", "--batch", 0), "--batch must be >= 1"),
    (("--prompt", "x", "--max-new-tokens", -1), "--max-new-tokens must be >= 0"),
    (("--prompt", "x", "--eos-id", 256), "eos_id must be a token id in [0, 256)"),
    (("--prompt", "x", "--method", "draft"), "--method draft needs --draft"),
    (("--prompt", "x", "--method", "prophet"), "needs a model_with_prophet export"),
    (("--prompt", "x", "--gamma", "two"), "invalid gamma 'two'"),
    (("--prompt", "x", "--method", "medusa"), "invalid choice"),
    (("--prompt", "x", "--dtype", "fp8"), "--dtype must be one of auto, fp32, bf16, fp16 (or float32, bfloat16, "
                                          "float16), got 'fp8'"),
    (("--prompt", "x", "--repetition-penalty", 0), "repetition_penalty must be a number > 0"),
    (("--prompt", "xy", "--max-new-tokens", 100000), f"exceed the target's max_seq_len {MAX_LEN}"),
    (("--prompt", "x", "--lookup", "four"), "--lookup is N or N..MAX"),
    (("--prompt", "x", "--lookup", "0"), "lookup must be an integer >= 1"),
    (("--prompt", "x", "--lookup", "8..4"), "lookup_max must be 0"),
    (("--prompt", "x", "--method", "lookup"), "--method lookup needs --lookup"),
    (("--prompt", "x", "--lookup", "4", "--method", "base"), "--lookup is only used by --method lookup"),
    (("--prompt", "x", "--datastore", "store.npz"), "give --lookup N, or --tree"),
])
def test_bad_arguments_exit_2_with_one_line(exports, capsys, args, match):
    assert_usage_error(capsys, match, "--export", exports / "target", *args)


@pytest.mark.parametrize("device, match", [("tpu", "--device 'tpu' is not a torch device"),
                                           ("meta", "--device 'meta': decoding runs on cpu, cuda, mps"),
                                           ("cuda:99", "--device cuda:99: "), ("cpu:3", "the CPU is cpu")])
def test_a_device_that_is_not_here_exits_2_with_one_line_before_loading(exports, capsys, monkeypatch, device, match):
    import specdec_models.decode.__main__ as cli_module

    monkeypatch.setattr(cli_module, "load_export", lambda *a: pytest.fail("loaded a model"))
    assert_usage_error(capsys, match, "--export", exports / "target", "--prompt", "x", "--device", device)


def test_the_device_defaults_to_the_cpu_and_is_in_the_help(exports, capsys):
    help_text = subprocess.run([sys.executable, "-m", "specdec_models.decode", "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "--device" in help_text and "cpu (default), cuda, cuda:N or mps" in " ".join(help_text.split())
    args = ("--export", exports / "target", "--prompt", "ab", "--temperature", 0, "--max-new-tokens", 6)
    assert cli_json(capsys, *args)["continuations"] == cli_json(capsys, *args, "--device", "cpu")["continuations"]


def test_device_auto_decodes_on_the_cpu_without_cuda_and_says_so_on_stderr(exports, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ("--export", exports / "target", "--prompt", "ab", "--temperature", 0, "--max-new-tokens", 6, "--json")
    status, out, err = cli(capsys, *args, "--device", "auto")
    assert status == 0 and err == "device: cpu (auto)\n"
    assert json.loads(out)["continuations"] == cli_json(capsys, *args[:-1], "--device", "cpu")["continuations"]


def test_lookup_decodes_an_export_greedily_as_plain_decoding_and_takes_a_datastore(exports, capsys, tmp_path):
    from specdec_models import byte_tokenizer, load_export
    from specdec_models.decode import GREEDY, Datastore, generate

    common = ("--export", exports / "target", "--prompt", "ab, ab, a", "--max-new-tokens", 16,
              "--temperature", 0, "--batch", 2)
    base = cli_json(capsys, *common)
    lookup = cli_json(capsys, *common, "--lookup", "2..8")
    assert lookup["method"] == "lookup" and lookup["continuations"] == base["continuations"]
    assert lookup["stats"]["drafted"] > 0 and lookup["stats"]["row_calls"] <= base["stats"]["row_calls"]
    # a datastore of the target's own answer: its continuations are the target's, so all are accepted
    target = load_export(exports / "target")
    prompt = byte_tokenizer.encode("ab, ab, a", target.vocab_size, target.cfg.max_seq_len)
    answer, _ = generate(target, prompt[None], 16, sampling=GREEDY)
    Datastore([prompt.tolist() + answer[0].tolist()]).save(tmp_path / "store.npz")
    stored = cli_json(capsys, *common, "--lookup", "4", "--datastore", tmp_path / "store.npz")
    assert stored["continuations"] == base["continuations"]
    assert stored["stats"]["accepted"] > lookup["stats"]["accepted"]
    assert_usage_error(capsys, "give --lookup or --draft, not both", *common, "--lookup", "4", "--draft", tmp_path)


def test_missing_required_arguments_exit_2_with_one_line(exports, capsys):
    assert_usage_error(capsys, "--export", "--prompt", "x")
    assert_usage_error(capsys, "--prompt", "--export", exports / "target")


def test_draft_with_another_vocabulary_is_refused(exports, capsys):
    assert_usage_error(capsys, "vocabulary (100 tokens", "--export", exports / "target", "--prompt", "x",
                       "--draft", exports / "draft100")


def test_draft_given_with_another_method_is_refused(exports, capsys):
    assert_usage_error(capsys, "--draft is only used by --method draft", "--export", exports / "prophet",
                       "--prompt", "x", "--draft", exports / "draft", "--method", "prophet")


def test_prompt_bytes_outside_the_vocabulary_are_refused(exports, capsys):
    # 'e' is byte 101 and the accent's UTF-8 bytes are 0xc3 0xa9: all outside a 100-token vocabulary
    assert_usage_error(capsys, "0x65, 0xa9, 0xc3 outside the model's vocabulary of 100",
                       "--export", exports / "target100", "--prompt", "abeé")
    result = cli_json(capsys, "--export", exports / "target100", "--prompt", "ab", "--max-new-tokens", 3)
    assert result["stats"]["new_tokens"] == 3


def test_missing_export_directory_exits_2(exports, capsys, tmp_path):
    assert_usage_error(capsys, "does not exist", "--export", tmp_path / "nope", "--prompt", "x")
    assert_usage_error(capsys, "does not exist", "--export", exports / "target", "--prompt", "x",
                       "--draft", tmp_path / "nope")


def _copy_export(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst, json.loads((dst / "config.json").read_text())


def test_truncated_export_exits_2(exports, capsys, tmp_path):
    directory, config = _copy_export(exports / "target", tmp_path / "exp")
    weights = directory / config["weights"]
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_usage_error(capsys, "truncated or corrupt", "--export", directory, "--prompt", "x")


def test_unknown_format_version_exits_2(exports, capsys, tmp_path):
    directory, config = _copy_export(exports / "target", tmp_path / "exp")
    (directory / "config.json").write_text(json.dumps({**config, "format_version": 99}))
    assert_usage_error(capsys, "format_version 99", "--export", directory, "--prompt", "x")


def test_command_line_run_with_a_missing_export_prints_one_error_line_and_exits_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "specdec_models.decode", "--export", str(tmp_path / "nope"),
                             "--prompt", "hello"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: export directory") and "does not exist" in lines[0]


def test_gamma_auto_calibrates_or_uses_the_exports_speed_profile(exports, capsys, tmp_path):
    common = ("--prompt", "The fox", "--max-new-tokens", 20, "--temperature", 0, "--gamma", "auto")
    calibrated = cli_json(capsys, "--export", exports / "prophet", *common)["stats"]
    # the tiny prophet is barely trained: 0 (plain decoding, no gamma pays) is a valid choice too
    assert 0 <= calibrated["gamma"] <= 5 and calibrated["measured_speedup"] > 0
    assert len(calibrated["speed_profile"]["per_position_acceptance"]) == 5     # prophet_train_length 6
    # an export that stores a profile (as training may) decodes at the profile's best gamma
    from specdec_models import load_export
    from specdec_models.decode import SpeedProfile

    profile = SpeedProfile(0.1, {1: 1.1, 5: 1.6}, [0.9, 0.8, 0.1, 0.1, 0.0])
    save_export(tmp_path / "stored", load_export(exports / "prophet"), metadata={"speed_profile": profile.to_dict()})
    stored = cli_json(capsys, "--export", tmp_path / "stored", *common)["stats"]
    assert stored["gamma"] == profile.best_gamma() == 2 and stored["speed_profile"] == profile.to_dict()
    base = cli_json(capsys, "--export", exports / "prophet", "--method", "base", *common[:-2])
    assert cli_json(capsys, "--export", tmp_path / "stored", *common)["continuations"] == base["continuations"]


def test_repetition_penalty_through_the_cli_keeps_speculative_equal_to_base(exports, capsys):
    common = ("--prompt", "aaaa", "--max-new-tokens", 16, "--temperature", 0, "--repetition-penalty", 1.6)
    base = cli_json(capsys, "--export", exports / "prophet", "--method", "base", *common)
    prophet = cli_json(capsys, "--export", exports / "prophet", "--method", "prophet", *common)
    assert prophet["continuations"] == base["continuations"]
    plain = cli_json(capsys, "--export", exports / "prophet", "--method", "base", *common[:-2])
    assert plain["continuations"] != base["continuations"]


def test_a_gamma_past_the_prophets_training_exits_2_with_the_limit(exports, capsys):
    # the prophet export was trained with prophet_train_length 6: drafts 1..5
    assert_usage_error(capsys, "gamma 10 exceeds what the prophet was trained for", "--export",
                       exports / "prophet", "--prompt", "x", "--gamma", 10)
    result = cli_json(capsys, "--export", exports / "prophet", "--prompt", "x", "--gamma", 5, "--max-new-tokens", 6)
    assert result["stats"]["gamma"] == 5
