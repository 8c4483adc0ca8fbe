"""The decoding CLI with a Hugging Face target (`--hf-model DIR`, `--gguf FILE`): prompts through
the target's tokenizer and chat template, plain, draft and prophet-head decoding equal to the
target's own greedy `generate()`, and one line with exit status 2 for bad input, before any
model loads. Tiny random Llama models with a character-level tokenizer, built in the test."""

import json
import string

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from test_decode_cli import assert_usage_error, cli
from test_hf_decode import build

import specdec_models.export.load as export_load
from specdec_models import save_export
from specdec_models.heads.hf_prophet import HFProphet, HFProphetConfig

SPECIALS = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<unk>"]
CHARS = list(string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,!?'-:;()\n")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def char_tokenizer(chars=CHARS):
    """A character-level tokenizer (one token per character, no merges) with an EOS token and a chat template."""
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = tokenizers.decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                               unk_token="<unk>", additional_special_tokens=SPECIALS[2:4])
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok


VOCAB = len(SPECIALS) + len(CHARS)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_cli")
    tok = char_tokenizer()
    target = build(root / "target", "llama", 1, 30.0, vocab=VOCAB)
    build(root / "draft", None, 4, None, noise=(target, 0.002))               # agrees part of the time
    build(root / "other", "llama", 6, 30.0, vocab=VOCAB)
    build(root / "mismatch", None, 4, None, noise=(target, 0.002))
    for name in ("target", "draft", "other"):
        tok.save_pretrained(root / name)
    char_tokenizer(CHARS[1:] + CHARS[:1]).save_pretrained(root / "mismatch")  # same size, other ids
    torch.manual_seed(0)
    head = HFProphet(HFProphetConfig.for_target(target, dim=32, dim_head=16), target)
    save_export(root / "head", head, target_path=root / "target")
    save_export(root / "head_elsewhere", head, target_path=root / "nowhere")
    return root


def hf_greedy_ids(directory, ids, n):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def run_json(capsys, *argv):
    status, out, err = cli(capsys, *argv, "--json")
    assert status == 0, err
    return json.loads(out)


COMMON = ("--temperature", 0, "--max-new-tokens", 12, "--ignore-eos", "--dtype", "float32")


def test_plain_draft_and_prophet_decoding_equal_the_targets_own_generate(dirs, capsys):
    tok = transformers.AutoTokenizer.from_pretrained(dirs / "target")
    expected = tok.decode(hf_greedy_ids(dirs / "target", tok("The fox")["input_ids"], 12), skip_special_tokens=True)
    plain = run_json(capsys, "--hf-model", dirs / "target", "--prompt", "The fox", *COMMON)
    draft = run_json(capsys, "--hf-model", dirs / "target", "--draft", dirs / "draft", "--prompt", "The fox",
                     "--batch", 3, "--gamma", 3, *COMMON)
    head = run_json(capsys, "--hf-model", dirs / "target", "--prophet", dirs / "head", "--prompt", "The fox", *COMMON)
    recorded = run_json(capsys, "--prophet", dirs / "head", "--prompt", "The fox", *COMMON)   # the export's target path
    assert plain["method"] == "base" and draft["method"] == "draft" and head["method"] == "prophet"
    assert plain["continuations"] == [expected] and draft["continuations"] == [expected] * 3
    assert head["continuations"] == [expected] and recorded["continuations"] == [expected]
    assert draft["stats"]["drafted"] > 0 and head["stats"]["drafted"] > 0
    assert plain["stats"]["new_tokens"] == 12
    # float32 on the CPU: prepared for it (few-row linear layers); torch's own give the same tokens
    from specdec_models.cpu import pieces_off

    with pieces_off({"linear"}):
        again = run_json(capsys, "--hf-model", dirs / "target", "--prompt", "The fox", "--device", "cpu", *COMMON)
    assert again["continuations"] == [expected]


def test_prompt_lookup_decoding_equals_the_targets_own_generate(dirs, capsys):
    tok = transformers.AutoTokenizer.from_pretrained(dirs / "target")
    prompt = "The fox, the fox, the fox"
    expected = tok.decode(hf_greedy_ids(dirs / "target", tok(prompt)["input_ids"], 12), skip_special_tokens=True)
    result = run_json(capsys, "--hf-model", dirs / "target", "--lookup", "3", "--prompt", prompt, "--batch", 2, *COMMON)
    assert result["method"] == "lookup" and result["continuations"] == [expected] * 2
    assert result["stats"]["drafted"] > 0 and result["stats"]["new_tokens"] == 24


def test_chat_wraps_the_prompt_in_the_chat_template_and_rows_stop_at_eos(dirs, capsys):
    tok = transformers.AutoTokenizer.from_pretrained(dirs / "target")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>")
    greedy = hf_greedy_ids(dirs / "target", ids, 12)
    result = run_json(capsys, "--hf-model", dirs / "target", "--prompt", "hi", "--chat", *COMMON)
    assert result["continuations"] == [tok.decode(greedy, skip_special_tokens=True)]
    # with its EOS: the tokenizer's EOS id ends the row (here: the first greedy token, made EOS with --eos-id)
    stopped = run_json(capsys, "--hf-model", dirs / "target", "--prompt", "hi", "--chat", "--temperature", 0,
                       "--dtype", "float32",
                       "--max-new-tokens", 12, "--eos-id", greedy[2])
    assert stopped["stats"]["new_tokens"] == greedy.index(greedy[2]) + 1


@pytest.mark.parametrize("case, match", [
    ("head_for_another_target", "trained for another target"),
    ("gguf_missing", "GGUF file"),
    ("tokenizer_mismatch", "vocabularies differ"),
    ("draft_missing", "draft: model directory"),
    ("two_targets", "give one target"),
    ("chat_with_export", "--chat is for a Hugging Face target"),
    ("native_export_as_head", "not a prophet head"),
    ("prophet_method_without_head", "needs --prophet"),
    ("recorded_target_missing", "does not exist"),
    ("not_a_model_dir", "holds no config.json"),
    ("knob_gone", "unrecognized arguments: --few-rows"),
    ("device_unknown", "--device 'tpu' is not a torch device"),
    ("device_absent", "--device cuda:99: "),
])
def test_bad_hf_input_exits_2_with_one_line_before_loading_a_model(dirs, capsys, monkeypatch, tmp_path, case, match):
    loaded = []
    real = export_load.load_causal_lm

    def load(path, **kw):
        loaded.append(path)
        return real(path, **kw)

    monkeypatch.setattr(export_load, "load_causal_lm", load)
    target = ("--hf-model", dirs / "target")
    args = {
        "head_for_another_target": ("--hf-model", dirs / "other", "--prophet", dirs / "head"),
        "gguf_missing": ("--gguf", tmp_path / "missing.gguf"),
        "tokenizer_mismatch": (*target, "--draft", dirs / "mismatch"),
        "draft_missing": (*target, "--draft", tmp_path / "nope"),
        "two_targets": (*target, "--gguf", tmp_path / "x.gguf"),
        "chat_with_export": ("--export", tmp_path, "--chat"),
        "native_export_as_head": (*target, "--prophet", tmp_path / "native"),
        "prophet_method_without_head": (*target, "--method", "prophet"),
        "recorded_target_missing": ("--prophet", dirs / "head_elsewhere"),
        "not_a_model_dir": ("--hf-model", tmp_path),
        "knob_gone": (*target, "--few-rows", "on"),
        "device_unknown": (*target, "--device", "tpu"),
        "device_absent": (*target, "--device", "cuda:99"),
    }[case]
    if case == "native_export_as_head":
        from specdec_models import Decoder, ModelConfig
        save_export(tmp_path / "native", Decoder(ModelConfig(vocab_size=VOCAB, dim=16, depth=1, heads=1, dim_head=16)))
    assert_usage_error(capsys, match, *args, "--prompt", "hi")
    # only the head's check needs the target's weights (their hash); every other error comes first
    assert loaded == ([dirs / "other"] if case == "head_for_another_target" else [])
