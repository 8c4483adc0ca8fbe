"""A target without its body (`specdec_models.hf.lean`): the hash of the whole model computed tensor
by tensor from its files equals the loaded model's (tied, untied, sharded safetensors, SmolLM2's
GGUF), the lean model holds only the embedding, final norm, LM head and the layers asked for, and a
head trained from a cache never builds the target's decoder layers (task=hf_eagle3 and hf_prophet
end to end through run(cfg), with the whole-model loader made to fail)."""

# ruff: noqa: E402, F811  (the imports follow pytest.importorskip; pytest fixtures imported from sibling
# test modules are named again as test arguments)
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_hf_eagle3_task import caches, cfg  # noqa: F401  (the eagle3 caches of the tiny Llama target)
from test_hf_prophet_task import hf  # noqa: F401  (the tiny targets over a word-level tokenizer)

import train.run as train_run
from specdec_models.errors import SpecdecError
from specdec_models.hf.lean import (
    AbsentLayer,
    lean_causal_lm,
    lean_info,
    loaded_layers,
    meta_model,
    streamed_weights_sha256,
    tensor_source,
)
from specdec_models.hf.weights import load_causal_lm, weights_sha256
from train.tasks import hf_target


def llama(path, *, tied, depth=3, shard=None, seed=0):
    """A seeded random tiny Llama saved as safetensors (`shard`: save_pretrained's max_shard_size)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=211, hidden_size=32, intermediate_size=64, num_hidden_layers=depth,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return path


@pytest.mark.parametrize("tied, shard", [(True, None), (False, None), (False, "40KB")])
def test_the_streamed_hash_is_the_loaded_models(tmp_path, tied, shard):
    path = llama(tmp_path / "m", tied=tied, shard=shard)
    assert (path / "model.safetensors.index.json").is_file() == bool(shard)
    whole = load_causal_lm(path)
    meta = meta_model(path)
    assert streamed_weights_sha256(meta, tensor_source(path, meta)) == weights_sha256(whole)
    # any value changed beyond bfloat16's precision changes it
    other = llama(tmp_path / "other", tied=tied, shard=shard, seed=1)
    meta = meta_model(other)
    assert streamed_weights_sha256(meta, tensor_source(other, meta)) != weights_sha256(whole)


@pytest.mark.parametrize("tied", [True, False])
def test_a_lean_target_holds_the_embedding_norm_head_and_the_layers_asked_for(tmp_path, tied):
    path = llama(tmp_path / "m", tied=tied)
    whole = load_causal_lm(path)
    lean = lean_causal_lm(path, layers=[1])
    assert lean_info(lean).layers == (1,) and lean_info(whole) is None
    assert loaded_layers(lean) == 1 and loaded_layers(whole) == 3
    assert [type(x) is AbsentLayer for x in lean.model.layers] == [True, False, True]
    assert weights_sha256(lean) == weights_sha256(whole)
    for name, value in lean.state_dict().items():              # every tensor held is the file's, none on meta
        assert not value.is_meta and torch.equal(value, whole.state_dict()[name]), name
    H, V = 32, 211
    layer = sum(p.numel() for p in whole.model.layers[1].parameters())
    assert sum(p.numel() for p in lean.parameters()) == V * H * (1 if tied else 2) + H + layer
    assert (lean.lm_head.weight is lean.model.embed_tokens.weight) == tied
    with pytest.raises(SpecdecError, match="without its body"):
        lean(input_ids=torch.tensor([[1, 2, 3]]))
    assert loaded_layers(lean_causal_lm(path)) == 0


def test_a_target_without_an_lm_head_tensor_is_refused_in_one_line(hf, caches, tmp_path):
    from safetensors.torch import load_file, save_file

    path = llama(tmp_path / "m", tied=False)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpecdecError, match="holds no LM-head tensor") as error:
        lean_causal_lm(path)
    assert "\n" not in str(error.value)
    # through the task, before any work: the cache's target is hf's tiny Llama, copied without its head
    from shutil import copytree

    headless = copytree(hf["llama"], tmp_path / "headless")
    tensors = load_file(headless / "model.safetensors")
    del tensors["lm_head.weight"]                               # hf's targets do not tie their heads
    save_file(tensors, headless / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpecdecError, match="holds no LM-head tensor"):
        train_run.validate(cfg(hf, tmp_path / "run", "data=hf_embeddings", f"data.cache={caches['full']}",
                               f"target.path={headless}"))


@pytest.mark.parametrize("experiment, extra", [
    ("hf_eagle3", ("head.init_layer=true",)),
    ("hf_prophet", ("head.dim_head=16",)),
])
def test_a_head_trained_from_a_cache_never_builds_the_targets_decoder_layers(hf, caches, tmp_path, monkeypatch,
                                                                            experiment, extra):
    from test_hf_prophet_task import cfg as head_cfg

    from specdec_models.export import read_export_config

    whole = load_causal_lm(hf["llama"])
    expected = weights_sha256(whole)
    hf_target._LOADED.clear()

    def refuse(*args, **kwargs):
        raise AssertionError("the whole target was loaded")

    monkeypatch.setattr(hf_target, "load_causal_lm", refuse)
    head = ("head.draft_vocab_size=null", "head.aux_layers=[0,1,2]", "task.ttt_steps=3") if experiment == "hf_eagle3" \
        else ()
    result = train_run.run(head_cfg(hf, tmp_path / "run", "data=hf_embeddings", f"data.cache={caches['full']}",
                                    "callbacks.speculative_eval=null", *extra, experiment=experiment, head=head))
    assert result["global_step"] == 6
    assert read_export_config(result["export_dir"])["target"]["weights_sha256"] == expected
    (model, sha), = hf_target._LOADED.values()
    assert sha == expected and lean_info(model) is not None
    kept = [1] if experiment == "hf_eagle3" else []             # init_layer: the layer reading aux layer 2
    assert lean_info(model).layers == tuple(kept) and loaded_layers(model) == len(kept) < len(whole.model.layers)
    parts = [whole.model.embed_tokens, whole.model.norm, whole.lm_head, *(whole.model.layers[i] for i in kept)]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for m in parts for p in m.parameters())


@pytest.mark.real
@pytest.mark.slow     # about 37 s with SmolLM2's load; the lean form's tests above run on tiny targets by default
def test_smollm2s_gguf_hashes_alike_streamed_and_loaded_and_its_lean_form_holds_one_layer(smollm2):
    model, _, source = smollm2
    lean = lean_causal_lm(source, layers=[27])
    assert weights_sha256(lean) == weights_sha256(model)
    assert loaded_layers(lean) == 1 and lean.lm_head.weight is lean.model.embed_tokens.weight
    for name, value in lean.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name       # the q/k permutation of GGUF's layout included
    assert sum(p.numel() for p in lean.parameters()) < 0.25 * sum(p.numel() for p in model.parameters())
