"""The hf_prophet export: the head's own weights and the identity of its target (round trip,
refusal of another target in one line, atomic replacement), and the target identity itself
(`specdec_models.hf.weights_sha256`). Tiny random Llama and GPT-NeoX models from config objects."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_decode import V, build, ragged_prompts

import specdec_models.export.specdec as export_mod
from specdec_models import Decoder, SpecdecError, export_hash, load_export, save_export
from specdec_models.decode import GREEDY, HeadDrafter, generate
from specdec_models.export import read_export_config
from specdec_models.heads.hf_prophet import HFProphet, HFProphetConfig
from specdec_models.hf.weights import weights_sha256


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build(tmp_path_factory.mktemp("t") / "neox", "neox", 0, 20.0)


def make_head(target, seed=0):
    torch.manual_seed(seed)
    return HFProphet(HFProphetConfig.for_target(target, dim=32, dim_head=16, depth=2), target).eval()


def test_round_trip_keeps_the_head_and_records_its_target(target, tmp_path):
    head = make_head(target)
    save_export(tmp_path, head, target_path="/models/neox", metadata={"step": 3})
    config = read_export_config(tmp_path)
    assert config["kind"] == "hf_prophet" and config["main"] is None
    assert config["tokenizer"] == {"kind": "hf_target"}
    assert config["target"] == {"path": "/models/neox", "architecture": "GPTNeoXForCausalLM", "hidden_size": 64,
                                "vocab_size": V, "weights_sha256": weights_sha256(target)}
    assert HFProphetConfig.from_dict(config["prophet"]) == head.config
    # the weights file holds the head's own tensors: no embedding, no output head of the target
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / config["weights"]))
    assert set(tensors) == set(head.state_dict())
    assert sum(t.numel() for t in tensors.values()) == sum(p.numel() for p in head.parameters())
    loaded = load_export(tmp_path, target=target)
    assert isinstance(loaded, HFProphet) and loaded.target is target and not loaded.training
    for name, t in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], t, rtol=0, atol=0)
    prompts = ragged_prompts()
    a, sa = generate(target, prompts, 12, HeadDrafter(head), sampling=GREEDY, gamma=3)
    b, sb = generate(target, prompts, 12, HeadDrafter(loaded), sampling=GREEDY, gamma=3)
    assert [t.tolist() for t in a] == [t.tolist() for t in b] and sa.accepted == sb.accepted


def test_the_default_target_path_is_where_transformers_loaded_it_from(target, tmp_path):
    save_export(tmp_path, make_head(target))
    assert read_export_config(tmp_path)["target"]["path"] == target.name_or_path


def test_loading_a_head_with_another_target_or_none_is_refused_in_one_line(target, tmp_path):
    save_export(tmp_path / "head", make_head(target), target_path="/models/neox")
    other = build(tmp_path / "other", "neox", 1, 20.0)              # same architecture and sizes
    for kw, message in ((dict(target=other), "trained for another target.*/models/neox"),
                        (dict(), "load_export\\(DIR, target="),
                        (dict(target=torch.nn.Linear(2, 2)), "Hugging Face causal LM")):
        with pytest.raises(SpecdecError, match=message) as err:
            load_export(tmp_path / "head", **kw)
        assert "\n" not in str(err.value)
    save_export(tmp_path / "native", Decoder(make_head(target).prophet.cfg))    # a plain Decoder export
    with pytest.raises(SpecdecError, match="only for an hf_prophet"):
        load_export(tmp_path / "native", target=target)


def test_save_refuses_a_tokenizer_or_a_target_path_where_they_do_not_belong(target, tmp_path):
    with pytest.raises(SpecdecError, match="target's tokenizer"):
        save_export(tmp_path, make_head(target), tokenizer="bytes")
    with pytest.raises(SpecdecError, match="target_path"):
        save_export(tmp_path, Decoder(make_head(target).prophet.cfg), target_path="x")


def test_a_tampered_target_record_is_a_clear_error(target, tmp_path):
    save_export(tmp_path, make_head(target))
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for bad in ({**config, "target": None}, {**config, "tokenizer": {"kind": "bytes"}},
                {**config, "target": {**config["target"], "weights_sha256": "abc"}}):
        path.write_text(json.dumps(bad))
        with pytest.raises(SpecdecError, match="re-export the head") as err:
            read_export_config(tmp_path)
        assert "\n" not in str(err.value)


def test_crash_while_replacing_a_head_leaves_the_old_one_loadable(target, tmp_path, monkeypatch):
    old, new = make_head(target, seed=0), make_head(target, seed=1)
    save_export(tmp_path, old)
    old_hash = export_hash(tmp_path)
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if "config.json" in os.fspath(dst):
            raise OSError("simulated crash")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(export_mod.os, "replace", replace)
    with pytest.raises(SpecdecError, match="cannot write the export.*simulated crash"):
        save_export(tmp_path, new)
    monkeypatch.undo()
    assert export_hash(tmp_path, verify=True) == old_hash
    loaded = load_export(tmp_path, target=target)
    torch.testing.assert_close(loaded.to_prophet_start.weight, old.to_prophet_start.weight, rtol=0, atol=0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# ---------------------------------------------------------------- the target's identity

def test_weights_hash_changes_with_any_value_and_ignores_the_load_dtype(tmp_path):
    model = build(tmp_path / "llama", "llama", 1, 30.0)
    digest = weights_sha256(model)
    assert digest == weights_sha256(model) and len(digest) == 64
    with torch.no_grad():
        w = model.model.layers[1].mlp.down_proj.weight
        old = w[3, 5].item()
        w[3, 5] = old * 1.01 + 1e-3                            # beyond bfloat16's precision
        assert weights_sha256(model) != digest
        w[3, 5] = old
    # one model hashes alike in fp32 and in bf16 (a head trained next to a bf16 target decodes with
    # the fp32 one), and bf16 weights hash the same whether held in bf16 or fp32
    assert weights_sha256(model) == weights_sha256(build(tmp_path / "l2", "llama", 1, 30.0).to(torch.bfloat16))
    half = build(tmp_path / "half", "llama", 2, 30.0).to(torch.bfloat16)
    assert weights_sha256(half) == weights_sha256(build(tmp_path / "h2", "llama", 2, 30.0).to(torch.bfloat16).float())
    assert weights_sha256(half) != digest


def test_weights_hash_counts_a_tied_head_once_but_tells_tied_from_untied(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    tied = transformers.LlamaForCausalLM(cfg)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg.to_dict(), "tie_word_embeddings": False}))
    untied.load_state_dict(tied.state_dict())
    assert weights_sha256(tied) != weights_sha256(untied)
