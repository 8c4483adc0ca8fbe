"""Serving layouts as data (`specdec_models.export.layouts`): a head's weights named once
(`heads.eagle3.EAGLE3_WEIGHTS`), each layout a name map, a tap numbering and a config writer.

The files each layout writes are pinned: a tiny eagle3 head with weights made from integers (the
same bits on every machine) is written in speculators', SGLang's and specdec's layouts, and its
config.json, its tensor names, shapes and dtypes and the sha256 of model.safetensors must be what
the code wrote before the layouts became data (the literals below were generated once by that
code), with two changes made on purpose (issue 70): the speculators config's `speculative_tokens` is
5 (specdec's default, the gamma-5 chain every evaluation measures) where it was 3, and each foreign
layout also writes SHA256SUMS, which must name the pinned hash. Loading each export gives the head's
logits exactly. The name maps and the numbering are
checked on their own, and a made-up head kind goes through the same writer and reader with a map of
its own, as DFlash's and P-EAGLE's will."""

import dataclasses
import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from specdec_models import SpecdecError
from specdec_models.export.eagle3 import EAGLE3_LAYOUTS, SGLANG, detect_layout, load_eagle3, save_eagle3
from specdec_models.export.layouts import (
    HeadKind,
    Layout,
    NameMap,
    Rename,
    TapNumbering,
    detect,
    layout_tensors,
    read_config,
    read_layout,
    rename,
    save_head,
    save_layout,
)
from specdec_models.export.specdec import read_export_config, read_export_tensors
from specdec_models.heads.eagle3 import EAGLE3_WEIGHTS, Eagle3Config, Eagle3Head
from specdec_models.heads.weights import Weight, WeightTable

transformers = pytest.importorskip("transformers")
VOCAB = 96

# ------------------------------------------------------------------------------ what the code wrote before

LAYER = {"attention_bias": False, "head_dim": 8, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64,
         "max_position_embeddings": 256, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 4,
         "num_hidden_layers": 1, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
         "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "rope_scaling": None,
         "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": 96}
SPECULATORS_CONFIG = {
    "architectures": ["Eagle3Speculator"], "draft_vocab_size": 40, "eagle_aux_hidden_state_layer_ids": [2, 3, 5],
    "embed_requires_grad": False, "fc_norm": False, "norm_before_fc": False, "norm_before_residual": False,
    "norm_output": False,
    "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                           "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                 "speculative_tokens": 5, "verifier_accept_k": 1}],
                           "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "org/target-model"}},
    "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "target_hidden_size": None,
    "tie_word_embeddings": False, "torch_dtype": "float32", "transformer_layer_config": LAYER}
SGLANG_CONFIG = {"architectures": ["LlamaForCausalLMEagle3"], **LAYER, "draft_vocab_size": 40,
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4], "use_aux_hidden_state": True},
                 "torch_dtype": "float32"}
# each case's changes to the configs above: a full draft vocabulary with other taps, and bf16 weights
CONFIG_CHANGES = {
    ("partial", "speculators"): {}, ("partial", "sglang"): {},
    ("full", "speculators"): {"draft_vocab_size": 96, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]},
    ("full", "sglang"): {"draft_vocab_size": 96, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3],
                                                                  "use_aux_hidden_state": True}},
    ("bf16", "speculators"): {"torch_dtype": "bfloat16"}, ("bf16", "sglang"): {"torch_dtype": "bfloat16"},
}
SHAPES = {"fc.weight": (32, 96), "layers.0.input_layernorm.weight": (32,), "layers.0.hidden_norm.weight": (32,),
          "layers.0.self_attn.q_proj.weight": (32, 64), "layers.0.self_attn.k_proj.weight": (16, 64),
          "layers.0.self_attn.v_proj.weight": (16, 64), "layers.0.self_attn.o_proj.weight": (32, 32),
          "layers.0.post_attention_layernorm.weight": (32,), "layers.0.mlp.gate_proj.weight": (64, 32),
          "layers.0.mlp.up_proj.weight": (64, 32), "layers.0.mlp.down_proj.weight": (32, 64), "norm.weight": (32,)}
SGLANG_SHAPES = {k.replace("layers.0.", "midlayer."): v for k, v in SHAPES.items()}
MAPS = {"d2t": ((40,), torch.int64), "t2d": ((96,), torch.bool)}
# sha256 of model.safetensors; a safetensors release that serialises otherwise fails here alone: then the
# names, shapes, dtypes and tensors above still pin the export, and these are regenerated
SHA256 = {
    ("partial", "speculators"): "41b79dcd530df573956c8a447d947236e6bdc81052ed5133fa8236c8848f1a62",
    ("partial", "sglang"): "7c7e032f06d042dc81ee28b5696a4e7f11482e7de0fbf3dc21814fabbabc8b9b",
    ("full", "speculators"): "14c5a49608c89a1f03ca68bbe2e2322fc46013b2ad80e80d428bbd4a4b8dc6ff",
    ("full", "sglang"): "b1ce6492ed4a1f98f044864db0214243e475e497d234ecb7efebcee3666dd773",
    ("bf16", "speculators"): "05d5fe37eb573ee34df47081c7293e8428ea1fa49230e7e12960ce846841b9d6",
    ("bf16", "sglang"): "48e3b790150004ede9c1d90346b28ad17648e04e7f178721e0d3b325abb6aa83",
}
CASES = {"partial": (40, [2, 3, 5], torch.float32), "full": (VOCAB, [1, 3, 4], torch.float32),
         "bf16": (40, [2, 3, 5], torch.bfloat16)}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def integer_head(target, case):
    """An eagle3 head whose every weight is made from integers (no random numbers: the same bits
    anywhere); draft vocabulary the even ids, or the whole vocabulary."""
    draft, aux, dtype = CASES[case]
    config = Eagle3Config(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                          target_vocab_size=VOCAB, draft_vocab_size=draft, target_layers=6, aux_layers=aux,
                          rms_norm_eps=1e-6, rope_theta=10000.0, max_seq_len=256)
    head = Eagle3Head(config, target, None if draft == VOCAB else torch.arange(0, 2 * draft, 2))
    with torch.no_grad():
        for i, (_, p) in enumerate(head.named_parameters()):
            p.copy_((((torch.arange(p.numel()) * 7) % 97 - 48).float() / 64 / (i + 1)).reshape(p.shape))
    return head.to(dtype).eval()


def expected_config(case, layout):
    base = SPECULATORS_CONFIG if layout == "speculators" else SGLANG_CONFIG
    return {**base, **CONFIG_CHANGES[(case, layout)]}


def expected_tensors(case, layout):
    """{name: (shape, dtype)} of the layout's model.safetensors."""
    dtype = CASES[case][2]
    out = {k: (v, dtype) for k, v in (SHAPES if layout != "sglang" else SGLANG_SHAPES).items()}
    out["lm_head.weight"] = ((CASES[case][0], 32), dtype)
    if case != "full" or layout == "specdec":
        out.update({k: ((CASES[case][0],) if k == "d2t" else v[0], v[1]) for k, v in MAPS.items()})
    return out


def ttt(head, target):
    torch.manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        out = target(input_ids=tokens[:, :-1], output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in head.aux_layers], -1)
        return head.ttt_logits(tokens, aux, steps=3)


# ------------------------------------------------------------------------------ the table

@pytest.mark.parametrize("case", list(CASES))
def test_the_weight_table_names_every_tensor_the_head_saves(target, case):
    head = integer_head(target, case)
    state = head.state_dict()
    assert EAGLE3_WEIGHTS.names == list(state)
    assert EAGLE3_WEIGHTS.shapes(head.config) == {k: tuple(v.shape) for k, v in state.items()}
    assert EAGLE3_WEIGHTS.vocab_maps == {"d2t", "t2d"}
    assert EAGLE3_WEIGHTS.full_vocab(head.config) == (case == "full")
    assert all(w.meaning for w in EAGLE3_WEIGHTS.weights)


# ------------------------------------------------------------------------------ the files, as before

@pytest.mark.parametrize("layout", ["speculators", "sglang"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_foreign_layout_writes_the_files_it_wrote_before(target, tmp_path, case, layout):
    head = integer_head(target, case)
    out = save_eagle3(tmp_path / "out", head, layout, **({"verifier": "org/target-model"}
                                                           if layout == "speculators" else {}))
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "config.json", "model.safetensors"]
    want = expected_config(case, layout)
    assert json.loads((out / "config.json").read_text()) == want
    assert (out / "config.json").read_text() == json.dumps(want, indent=2, sort_keys=True) + "\n"
    tensors = load_file(str(out / "model.safetensors"))
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == expected_tensors(case, layout)
    state = head.state_dict()
    for name, t in tensors.items():
        assert torch.equal(t, state[name.replace("midlayer.", "layers.0.")]), name
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == SHA256[(case, layout)]
    assert (out / "SHA256SUMS").read_text() == f"{SHA256[(case, layout)]}  model.safetensors\n"    # sha256sum's format


@pytest.mark.parametrize("case", list(CASES))
def test_the_specdec_layout_writes_the_state_dict_and_config_it_wrote_before(target, tmp_path, case):
    head = integer_head(target, case)
    out = save_eagle3(tmp_path / "out", head, "specdec")
    config = read_export_config(out)
    draft, aux, _ = CASES[case]
    assert config["kind"] == "hf_eagle3" and config["prophet"] == {
        "aux_layers": aux, "draft_vocab_size": draft, "head_dim": 8, "hidden_act": "silu", "hidden_size": 32,
        "intermediate_size": 64, "max_seq_len": 256, "num_heads": 4, "num_kv_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "target_layers": 6, "target_vocab_size": 96}
    tensors = read_export_tensors(out, config)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == expected_tensors(case, "specdec")
    for name, t in head.state_dict().items():
        assert torch.equal(tensors[name], t), name


@pytest.mark.parametrize("layout", ["specdec", "speculators", "sglang"])
@pytest.mark.parametrize("case", list(CASES))
def test_loading_each_layout_gives_the_heads_logits_exactly(target, tmp_path, case, layout):
    """A head loads in its target's dtype (float32 here): a bf16 export's weights come back exact, and
    its logits are those of the same weights in a head made in float32 (whose rotary tables are not
    rounded to bf16)."""
    head = integer_head(target, case)
    out = save_eagle3(tmp_path / "out", head, layout)
    assert detect_layout(out) == layout
    back = load_eagle3(out, target)
    assert back.config == head.config and back.draft_ids.tolist() == head.draft_ids.tolist()
    for name, t in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], t.to(back.state_dict()[name].dtype)), name
    if head.fc.weight.dtype != back.fc.weight.dtype:
        same = Eagle3Head(head.config, target, head.draft_ids, init_from_target=False)
        same.load_state_dict(head.state_dict())
        head = same.eval()
    for ours, theirs in zip(ttt(head, target), ttt(back, target), strict=True):
        assert torch.equal(ours, theirs)


# ------------------------------------------------------------------------------ the maps

@pytest.mark.parametrize("layout", list(EAGLE3_LAYOUTS))
def test_each_name_map_round_trips_the_table_one_to_one(layout):
    names = EAGLE3_LAYOUTS[layout].names
    canonical = {name: name for name in EAGLE3_WEIGHTS.names}
    there = rename(canonical, names, to_layout=True)
    assert len(set(there)) == len(canonical)
    assert list(rename(there, names, to_layout=False)) == EAGLE3_WEIGHTS.names
    assert list(there.values()) == EAGLE3_WEIGHTS.names                # order kept


def test_sglang_renames_the_layer_and_numbers_taps_from_the_layers_output():
    assert SGLANG.names.convert("layers.0.mlp.up_proj.weight", to_layout=True) == "midlayer.mlp.up_proj.weight"
    assert SGLANG.names.convert("midlayer.hidden_norm.weight", to_layout=False) == "layers.0.hidden_norm.weight"
    assert SGLANG.names.convert("fc.weight", to_layout=True) == "fc.weight"
    assert SGLANG.numbering.to_layout([2, 3, 5], 6) == [1, 2, 4]
    assert SGLANG.numbering.from_layout([1, 2, 4]) == [2, 3, 5]
    for aux, match in (([0, 2, 3], "indices 1..5"), ([2, 3, 6], "indices 1..5"), ([2, 3], "exactly 3")):
        with pytest.raises(SpecdecError, match=match):
            SGLANG.numbering.to_layout(aux, 6)
    with pytest.raises(SpecdecError, match="list of integers"):
        SGLANG.numbering.from_layout(["1", 2, 4])


def test_an_indexed_rule_renumbers_layers_both_ways_and_a_collision_is_one_line():
    names = NameMap((Rename("layers.{i}.", "model.layers.{i}.", offset=1), Rename("norm.", "model.norm.")))
    tensors = {"layers.0.w": 0, "layers.11.w": 1, "norm.weight": 2, "fc.weight": 3}
    there = rename(tensors, names, to_layout=True)
    assert there == {"model.layers.1.w": 0, "model.layers.12.w": 1, "model.norm.weight": 2, "fc.weight": 3}
    assert rename(there, names, to_layout=False) == tensors
    # a layout index below the offset has no canonical layer: it keeps its name (and is reported unexpected)
    assert names.convert("model.layers.0.w", to_layout=False) == "model.layers.0.w"
    with pytest.raises(SpecdecError, match="both name layers.0.w") as err:
        rename({"layers.0.w": 0, "model.layers.1.w": 1}, names, to_layout=False, where="DIR")
    assert str(err.value).startswith("DIR: ") and "\n" not in str(err.value)
    for bad in (("layers.{i}.", "midlayer."), ("layers.0.", "midlayer.{i}."), ("a.", "b.", 1)):
        with pytest.raises(SpecdecError, match="name rule"):
            Rename(*bad)


# ------------------------------------------------------------------------------ another head kind

class TwoLayerHead(nn.Module):
    """A made-up head kind: two linear layers and a vocabulary map, sizes in `config`."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([nn.Linear(config["dim"], config["dim"], bias=False) for _ in range(2)])
        self.register_buffer("d2t", torch.zeros(config["draft"], dtype=torch.long))


TWO_LAYER_WEIGHTS = WeightTable("two_layer", (
    Weight("d2t", ("D",), "target id - draft id", vocab_map=True),
    Weight("layers.0.weight", ("H", "H"), "first layer"),
    Weight("layers.1.weight", ("H", "H"), "second layer"),
), lambda c: {"H": c["dim"], "D": c["draft"], "V": c["vocab"]})


def _two_layer_config(head, layout):
    return {"model_type": "two_layer", "dim": head.config["dim"], "draft": head.config["draft"],
            "vocab": head.config["vocab"]}


def _read_two_layer(config, target, layout, where):
    return {k: config[k] for k in ("dim", "draft", "vocab")}


# a server that numbers the head's layers from 1 and keeps the vocabulary map under another name
TWO_LAYER_SERVED = Layout("served", TWO_LAYER_WEIGHTS,
                          NameMap((Rename("layers.{i}.", "blocks.{i}.", offset=1), Rename("d2t", "hot_ids"))),
                          _two_layer_config, _read_two_layer, lambda c: c.get("model_type") == "two_layer",
                          "a served two-layer head", ignored=frozenset({"embed.weight"}))
TWO_LAYER = HeadKind("two_layer", TwoLayerHead, "hf_two_layer", (TWO_LAYER_SERVED,), build=None)


@pytest.mark.parametrize("draft", [5, 8])
def test_a_new_head_kind_needs_only_its_table_and_a_layout(tmp_path, draft):
    head = TwoLayerHead({"dim": 4, "draft": draft, "vocab": 8})
    out = save_head(tmp_path / "served", head, TWO_LAYER, "served")
    assert detect(out, TWO_LAYER) == "served"
    tensors = load_file(str(out / "model.safetensors"))
    full = draft == 8                                  # the identity map is left out with a full vocabulary
    assert set(tensors) == {"blocks.1.weight", "blocks.2.weight"} | (set() if full else {"hot_ids"})
    assert torch.equal(tensors["blocks.2.weight"], head.layers[1].weight.detach())
    config = read_config(out, TWO_LAYER_SERVED, None, "a two-layer head")
    assert config == head.config
    back, ignored = read_layout(out, TWO_LAYER_SERVED)
    assert set(back) == set(TWO_LAYER_WEIGHTS.names) - ({"d2t"} if full else set()) and ignored == {}
    fresh = TwoLayerHead(config)
    fresh.load_state_dict(back, strict=not full)
    for name, t in head.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    with pytest.raises(SpecdecError, match="verifier= is not an option of the served layout"):
        save_layout(tmp_path / "other", head, TWO_LAYER_SERVED, verifier="x")
    with pytest.raises(SpecdecError, match="layout must be one of specdec, served"):
        save_head(tmp_path / "other", head, TWO_LAYER, "sglang")
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(SpecdecError, match="neither a specdec hf_two_layer export, nor a served two-layer head"):
        detect(out, TWO_LAYER)
    keeping = dataclasses.replace(TWO_LAYER_SERVED, name="keeping", omit_with_full_vocab=frozenset())
    kept = load_file(str(save_layout(tmp_path / "keeping", head, keeping) / "model.safetensors"))
    assert set(kept) == {"blocks.1.weight", "blocks.2.weight", "hot_ids"}     # a layout may keep the identity map
    head.extra = nn.Linear(1, 1)                        # a weight the table does not name
    with pytest.raises(SpecdecError, match="not its weight table's"):
        layout_tensors(head, TWO_LAYER_SERVED)


def test_a_layout_numbering_refuses_taps_it_cannot_express():
    numbering = TapNumbering(offset=2, first=1, last=0, reader="a server")
    assert numbering.to_layout([1, 4], 4) == [3, 6] and numbering.from_layout([3, 6]) == [1, 4]
    with pytest.raises(SpecdecError, match="cannot be captured by a server, which captures hidden_states indices "
                                           r"1\.\.4 \(its ids 3\.\.6\)"):
        numbering.to_layout([0], 4)
