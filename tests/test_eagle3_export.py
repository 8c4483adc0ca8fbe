"""An eagle3 head in its three layouts (`specdec_models.export.eagle3`): specdec's hf_eagle3 export,
vLLM's speculators format and SGLang's. Each round-trips to the same drafts, the SGLang layout
carries the names, shapes and config fields SGLang's loader reads, the decoding CLI takes each
through `--eagle3 DIR`, and bad input is one line, exit 2, nothing written. The speculators layout
records the drafting the export was given (and the export says where the number comes from), and
the foreign layouts' SHA256SUMS makes a flipped weight byte a one-line refusal. Tiny random Llama
targets built in the test; the parity against the real `speculators` package is
tests/test_eagle3_interop.py."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from safetensors.torch import load_file, save_file

from conftest import command
from test_decode_cli import cli
from test_hf_decode import hf_greedy, ragged_prompts
from test_hf_decode_cli import VOCAB, char_tokenizer

from specdec_models import SpecdecError, load_export
from specdec_models.decode import GREEDY, HeadDrafter, generate
from specdec_models.export.eagle3 import (
    detect_layout,
    layer_ids_from_sglang,
    load_eagle3,
    save_eagle3,
    sglang_layer_ids,
)
from specdec_models.heads.eagle3 import Eagle3Config, Eagle3Head


def export_script():
    return command("export_head")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def deep_llama(path, layers=6, vocab=VOCAB, hidden=32, seed=1):
    """A random Llama of `layers` layers (SGLang can capture hidden_states indices 1..L-1 only),
    saved with a character tokenizer so the decoding CLI can load it."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden,
                                   max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
                                   eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).float().eval()


def perturbed_head(target, draft=None, aux=None, seed=0):
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target, draft_vocab_size=draft, aux_layers=aux), target,
                      None if draft is None else torch.randperm(VOCAB)[:draft].sort().values)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_export")
    target = deep_llama(root / "target")
    head = perturbed_head(target, draft=40, aux=[2, 3, 5])
    return root, target, head


def ttt(head, target, seed=3):
    torch.manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        out = target(input_ids=tokens[:, :-1], output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in head.aux_layers], -1)
        return head.ttt_logits(tokens, aux, steps=3)


@pytest.mark.parametrize("layout", ["specdec", "speculators", "sglang"])
def test_each_layout_round_trips_to_the_same_head(setup, layout):
    root, target, head = setup
    out = save_eagle3(root / f"rt-{layout}", head, layout, **({"target_path": root / "target"}
                                                               if layout == "specdec" else {}))
    assert detect_layout(out) == layout
    back = load_eagle3(out, target)
    assert back.config == head.config
    assert back.draft_ids.tolist() == head.draft_ids.tolist()
    for name, t in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    for a, b in zip(ttt(head, target), ttt(back, target), strict=True):
        assert torch.equal(a, b)
    # a second save of the same head replaces it (atomically, whole); no temps are left
    save_eagle3(out, back, layout)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp")]


def test_the_specdec_layout_is_an_hf_eagle3_export_bound_to_its_target(setup, tmp_path):
    root, target, head = setup
    out = save_eagle3(root / "native", head, "specdec", target_path=root / "target")
    config = json.loads((out / "config.json").read_text())
    assert config["kind"] == "hf_eagle3" and config["prophet"]["aux_layers"] == [2, 3, 5]
    assert config["target"]["path"] == str(root / "target") and len(config["target"]["weights_sha256"]) == 64
    assert isinstance(load_export(out, target=target), Eagle3Head)
    other = deep_llama(tmp_path / "other", seed=7)
    with pytest.raises(SpecdecError, match="another target") as err:
        load_export(out, target=other)
    assert "\n" not in str(err.value)


def test_the_speculators_layout_writes_every_field_vllm_reads(setup):
    root, _, head = setup
    out = save_eagle3(root / "spec", head, "speculators", verifier="org/target-model")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == 40 and config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad"):
        # written out: vLLM reads a missing norm_before_residual as true
        assert config[flag] is False
    tl = config["transformer_layer_config"]
    assert (tl["model_type"], tl["vocab_size"], tl["num_hidden_layers"], tl["hidden_size"]) == ("llama", VOCAB, 1, 32)
    assert (tl["num_attention_heads"], tl["num_key_value_heads"], tl["head_dim"]) == (4, 2, 8)
    assert tl["rope_theta"] == tl["rope_parameters"]["rope_theta"] == head.config.rope_theta
    spec = config["speculators_config"]
    assert spec["verifier"] == {"name_or_path": "org/target-model", "architectures": ["LlamaForCausalLM"]}
    assert spec["algorithm"] == "eagle3" and spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert config["speculators_version"] == "0.9.0"
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(head.state_dict())        # fc, layers.0.*, norm, lm_head, d2t, t2d; no embed_tokens
    assert tensors["d2t"].dtype == torch.long and tensors["t2d"].dtype == torch.bool
    assert (tensors["d2t"] + torch.arange(40)).tolist() == head.draft_ids.tolist()


def test_the_sglang_layout_has_the_names_shapes_and_fields_sglangs_loader_reads(setup):
    """What SGLang's loader reads, from python/sglang/srt/models/llama_eagle3.py
    (`LlamaForCausalLMEagle3`, `LlamaModel`, `LlamaDecoderLayer`, `load_weights`) and
    python/sglang/srt/models/llama.py (`set_eagle3_layers_to_capture`, `LlamaModel.forward`):

    - config.json: `architectures == ["LlamaForCausalLMEagle3"]` (its EntryClass); `model_type`
      "llama"; `num_hidden_layers == 1` (a second layer would be built as `additional_layers`);
      `tie_word_embeddings is False` (true makes `lm_head` the embedding); `draft_vocab_size`
      (the `ParallelLMHead` rows and the logits processor's vocabulary; None would load the LM head
      from the target); `vocab_size` the target's (the `VocabParallelEmbedding` SGLang shares with
      the target); `hidden_size`, `intermediate_size`, `num_attention_heads`,
      `num_key_value_heads`, `head_dim`, `rms_norm_eps`, `rope_theta`, `max_position_embeddings`,
      `hidden_act` (the `LlamaDecoderLayer` it subclasses); no `target_hidden_size` (then `fc` reads
      `hidden_size * 3`); `eagle_config.eagle_aux_hidden_state_layer_ids`, which ModelRunner passes
      to `set_eagle3_layers_to_capture`, which captures at `id + 1`, the input of that layer: SGLang
      id = hidden_states index - 1.
    - weights, by `load_weights` (stacked q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, other
      names tried bare then under `model.`): `fc.weight` (H, 3H); `midlayer.input_layernorm`,
      `midlayer.hidden_norm`, `midlayer.post_attention_layernorm` (H); `midlayer.self_attn.q_proj`
      (heads*head_dim, 2H), `k_proj` / `v_proj` (kv_heads*head_dim, 2H) (`QKVParallelLinear(2 *
      hidden_size, ...)`), `o_proj` (H, heads*head_dim); `midlayer.mlp.gate_proj` / `up_proj` (I, H),
      `down_proj` (H, I); `norm.weight` (H); `lm_head.weight` (draft_vocab_size, H); `d2t` (draft,)
      integers, read as `hot_token_id = d2t + arange`; `t2d` (skipped by SGLang). Nothing else: no
      `layers.0.*`, no `embed_tokens` (set from the target by the EAGLE worker).
    """
    root, target, head = setup
    c = head.config
    out = save_eagle3(root / "sgl", head, "sglang")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == VOCAB == target.config.vocab_size
    assert "target_hidden_size" not in config
    for key, want in (("hidden_size", 32), ("intermediate_size", 64), ("num_attention_heads", 4),
                      ("num_key_value_heads", 2), ("head_dim", 8), ("hidden_act", "silu"),
                      ("rms_norm_eps", c.rms_norm_eps), ("rope_theta", c.rope_theta),
                      ("max_position_embeddings", c.max_seq_len)):
        assert config[key] == want, key
    # hidden_states indices [2, 3, 5] (inputs of layers 2, 3, 5) are SGLang's outputs of layers 1, 2, 4
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert layer_ids_from_sglang([1, 2, 4]) == [2, 3, 5]
    H, F, q, kv = 32, 64, 4 * 8, 2 * 8
    shapes = {"fc.weight": (H, 3 * H), "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
              "midlayer.post_attention_layernorm.weight": (H,), "midlayer.self_attn.q_proj.weight": (q, 2 * H),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * H), "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, q), "midlayer.mlp.gate_proj.weight": (F, H),
              "midlayer.mlp.up_proj.weight": (F, H), "midlayer.mlp.down_proj.weight": (H, F),
              "norm.weight": (H,), "lm_head.weight": (40, H), "d2t": (40,), "t2d": (VOCAB,)}
    tensors = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert not tensors["d2t"].is_floating_point()
    assert (tensors["d2t"] + torch.arange(40)).tolist() == head.draft_ids.tolist()    # SGLang's hot_token_id
    # the hidden_states indices SGLang cannot capture (0: before the first residual; L: after its loop)
    for aux in ([0, 2, 3], [2, 3, 6], [2, 3]):
        with pytest.raises(SpecdecError):
            sglang_layer_ids(aux, 6)


def test_a_full_vocabulary_head_has_no_vocabulary_maps_in_foreign_layouts(setup, tmp_path):
    _, target, _ = setup
    head = perturbed_head(target, aux=[1, 3, 4])
    for layout in ("speculators", "sglang"):
        out = save_eagle3(tmp_path / layout, head, layout)
        assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
        back = load_eagle3(out, target)
        assert back.draft_ids.tolist() == list(range(VOCAB))


@pytest.mark.parametrize("layout", ["specdec", "speculators", "sglang"])
def test_greedy_decoding_with_an_imported_head_equals_the_targets_greedy(setup, layout):
    root, target, head = setup
    out = save_eagle3(root / f"dec-{layout}", head, layout)
    back = load_eagle3(out, target)
    prompts = [p % VOCAB for p in ragged_prompts()]
    alone, _ = hf_greedy(target, prompts, 12)
    got, stats = generate(target, prompts, 12, HeadDrafter(back), sampling=GREEDY, gamma=3)
    assert [t.tolist() for t in got] == alone and stats.method == "eagle3" and stats.drafted > 0


@pytest.mark.parametrize("layout", ["specdec", "speculators", "sglang"])
def test_the_decoding_cli_takes_an_eagle3_head_in_each_layout(setup, capsys, layout):
    root, _, head = setup
    out = save_eagle3(root / f"cli-{layout}", head, layout)
    common = ("--hf-model", root / "target", "--prompt", "hello there", "--temperature", 0, "--max-new-tokens", 10,
              "--ignore-eos", "--json", "--dtype", "float32")
    status, stdout, err = cli(capsys, *common, "--eagle3", out, "--gamma", 3)
    assert status == 0, err
    result = json.loads(stdout)
    assert result["method"] == "eagle3" and result["stats"]["method"] == "eagle3"
    status, plain, err = cli(capsys, *common)
    assert status == 0, err
    assert json.loads(plain)["continuations"] == result["continuations"]
    status, tree, err = cli(capsys, *common, "--eagle3", out, "--tree", "3,2,1")      # tree drafting, same output
    assert status == 0, err
    assert json.loads(tree)["stats"]["method"] == "eagle3_tree"
    assert json.loads(tree)["continuations"] == result["continuations"]
    status, _, err = cli(capsys, *common, "--tree", "3,2,1")
    assert status == 2 and "give --eagle3 DIR" in err and err.count("\n") == 1
    sampled = [*common[:5], 1.0, *common[6:], "--eagle3", out, "--gamma", 3, "--seed", 0]
    status, token, err = cli(capsys, *sampled, "--verify", "token")
    assert status == 0, err
    status, block, err = cli(capsys, *sampled)                                    # block verification, the default
    assert status == 0, err
    assert json.loads(token)["stats"]["method"] == json.loads(block)["stats"]["method"] == "eagle3"
    status, _, err = cli(capsys, *sampled, "--verify", "both")
    assert status == 2 and "invalid choice: 'both'" in err


def _write(directory, config, tensors):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("case, match", [
    ("hidden", "hidden size 48"),
    ("vocab", "vocabulary of 90 tokens"),
    ("no_d2t", "d2t is missing"),
    ("aux_depth", "beyond the target's depth"),
    ("sglang_aux_depth", "beyond the target's depth"),
    ("norm_flag", "norm_output is true"),
    ("no_residual_flag", "norm_before_residual is missing"),
    ("pickle", "reads no pickle"),
    ("extra_layer", "unexpected layers.1"),
    ("not_a_head", "neither"),
])
def test_bad_heads_are_refused_in_one_line(setup, tmp_path, case, match):
    root, target, head = setup
    spec = save_eagle3(root / "bad-src-spec", head, "speculators", force=True)
    sgl = save_eagle3(root / "bad-src-sgl", head, "sglang", force=True)
    config = json.loads((spec / "config.json").read_text())
    tensors = load_file(str(spec / "model.safetensors"))
    d = tmp_path / "bad"
    if case == "hidden":
        config["transformer_layer_config"]["hidden_size"] = 48
    elif case == "vocab":
        config["transformer_layer_config"]["vocab_size"] = 90
    elif case == "no_d2t":
        del tensors["d2t"]
    elif case == "aux_depth":
        config["eagle_aux_hidden_state_layer_ids"] = [2, 3, 7]
    elif case == "norm_flag":
        config["norm_output"] = True
    elif case == "no_residual_flag":
        del config["norm_before_residual"]
    elif case == "extra_layer":
        tensors["layers.1.mlp.up_proj.weight"] = tensors["layers.0.mlp.up_proj.weight"].clone()
    elif case == "not_a_head":
        config = {"architectures": ["LlamaForCausalLM"]}
    if case == "sglang_aux_depth":
        config = json.loads((sgl / "config.json").read_text())
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 6]      # 6 + 1 > 6 layers
        _write(d, config, load_file(str(sgl / "model.safetensors")))
    elif case == "pickle":
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        torch.save(tensors, d / "pytorch_model.bin")
    else:
        _write(d, config, tensors)
    with pytest.raises(SpecdecError, match=match) as err:
        load_eagle3(d, target)
    assert "\n" not in str(err.value)


def test_writing_over_another_models_files_needs_force(setup, tmp_path, capsys):
    root, target, head = setup
    spec = save_eagle3(root / "force-src", head, "speculators", force=True)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    for layout in ("speculators", "sglang", "specdec"):
        with pytest.raises(SpecdecError, match="force") as err:
            save_eagle3(busy, head, layout)
        assert "\n" not in str(err.value)
    # another layout's head, or another model's head in the same layout, is another model's files
    with pytest.raises(SpecdecError, match="not this sglang head"):
        save_eagle3(spec, head, "sglang")
    other = perturbed_head(target, draft=40, aux=[1, 2, 3])
    with pytest.raises(SpecdecError, match="not this speculators head"):
        save_eagle3(spec, other, "speculators")
    # the CLI: exit 2, one line, nothing written
    main = export_script().main
    before = sorted(p.name for p in busy.iterdir())
    status = main([str(spec), str(busy), "--layout", "sglang", "--hf-model", str(root / "target")])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: ") and err.count("\n") == 1 and "--force" in err
    assert sorted(p.name for p in busy.iterdir()) == before and (busy / "notes.txt").read_text() == "mine"
    assert main([str(spec), str(busy), "--layout", "sglang", "--hf-model", str(root / "target"), "--force"]) == 0
    assert detect_layout(busy) == "sglang" and not (busy / "notes.txt").exists()
    assert load_eagle3(busy, target).config == head.config


# ------------------------------------------------------------------------------ the drafting a server is told

@pytest.mark.parametrize("flags, tokens, source", [
    ((), 5, "not given: specdec evaluate's default chain, gamma 5"),
    (("--speculative-tokens", 3), 3, "--speculative-tokens"),
    (("--tree", "6,3,1"), 6, "the evaluated tree 6,3,1, depth 6"),
])
def test_the_export_cli_writes_the_drafting_it_was_given_and_says_where_it_comes_from(setup, tmp_path, capsys, flags,
                                                                                      tokens, source):
    root, _, head = setup
    src = save_eagle3(root / "drafting-src", head, "specdec", target_path=root / "target", force=True)
    out = tmp_path / "vllm"
    status = export_script().main([str(src), str(out), "--layout", "speculators", *map(str, flags)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    proposal = json.loads((out / "config.json").read_text())["speculators_config"]["proposal_methods"][0]
    assert proposal["proposal_type"] == "greedy" and proposal["speculative_tokens"] == tokens
    assert f"speculative tokens {tokens} ({source})" in printed
    assert f'"num_speculative_tokens": {tokens}' in printed                       # what to give vLLM
    status = export_script().main([str(src), str(tmp_path / "sgl"), "--layout", "sglang", *map(str, flags)])
    assert status == 0 and f"SGLang: --speculative-num-steps {tokens}" in capsys.readouterr().out


@pytest.mark.parametrize("flags, match", [
    (("--speculative-tokens", 0), "--speculative-tokens must be a positive integer, got 0"),
    (("--tree", "6,x"), "a tree is DEPTH,TOPK,WIDTH"),
])
def test_a_bad_drafting_is_one_line_and_writes_nothing(setup, tmp_path, capsys, flags, match):
    root, _, head = setup
    src = save_eagle3(root / "drafting-src", head, "specdec", target_path=root / "target", force=True)
    out = tmp_path / "vllm"
    status = export_script().main([str(src), str(out), "--layout", "speculators", *map(str, flags)])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and match in err, err
    assert not out.exists()


def test_the_default_drafting_is_the_chain_the_evaluation_measures():
    from specdec_models.export.eagle3 import SPECULATIVE_TOKENS
    from train.bench.eval_job import CHAIN, EvalJob
    from train.eagle3_export import Drafting

    # without --gamma, specdec evaluate drafts an EAGLE-3 head's chain of CHAIN
    assert EvalJob.gamma is None and CHAIN == SPECULATIVE_TOKENS == Drafting.of().tokens == 5
    assert Drafting.of(2, gamma=5, tree="6,3,1").tokens == 2             # a number given wins
    assert Drafting.of(gamma=4, tree="6,3,1") == Drafting(4, "the evaluated chain, gamma 4")


# ------------------------------------------------------------------------------ SHA256SUMS

def flip_a_weight_byte(path):
    """Flip the file's last byte, inside the last tensor's data (a safetensors file is an 8-byte
    header length, the JSON header, then the tensors' bytes): the file still parses."""
    data = bytearray(path.read_bytes())
    assert len(data) > 8 + int.from_bytes(data[:8], "little")
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("layout", ["speculators", "sglang"])
def test_a_flipped_byte_in_a_foreign_layouts_weights_is_refused_in_one_line_naming_the_file(setup, tmp_path, layout):
    import hashlib

    root, target, head = setup
    out = save_eagle3(tmp_path / layout, head, layout)
    weights = out / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert (out / "SHA256SUMS").read_text() == f"{digest}  model.safetensors\n"        # as `sha256sum` writes it
    flip_a_weight_byte(weights)
    load_file(str(weights))                                   # still a readable safetensors file
    with pytest.raises(SpecdecError, match="truncated or corrupt") as err:
        load_eagle3(out, target)
    assert str(weights) in str(err.value) and "SHA256SUMS" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("layout", ["speculators", "sglang"])
def test_a_head_folder_without_sha256sums_loads_as_a_speculators_or_specforge_head_does(setup, tmp_path, layout):
    root, target, head = setup
    out = save_eagle3(tmp_path / layout, head, layout)
    bare = _write(tmp_path / "bare", json.loads((out / "config.json").read_text()),
                  load_file(str(out / "model.safetensors")))
    assert sorted(p.name for p in bare.iterdir()) == ["config.json", "model.safetensors"]
    back = load_eagle3(bare, target)
    for name, t in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


@pytest.mark.parametrize("damage, match", [
    ("line", "line 1 is not '<sha256>  <file name>'"),
    ("extra", "extra.safetensors is not listed in"),
    ("missing", "listed in .*SHA256SUMS, is missing"),
])
def test_a_damaged_sha256sums_or_an_unlisted_weights_file_is_one_line(setup, tmp_path, damage, match):
    root, target, head = setup
    out = save_eagle3(tmp_path / "spec", head, "speculators")
    sums = out / "SHA256SUMS"
    if damage == "line":
        sums.write_text("not a checksum\n")
    elif damage == "extra":
        save_file({"x": torch.zeros(2)}, str(out / "extra.safetensors"))
    else:
        sums.write_text(sums.read_text() + f"{'0' * 64}  gone.safetensors\n")
    with pytest.raises(SpecdecError, match=match) as err:
        load_eagle3(out, target)
    assert "\n" not in str(err.value)


def test_exporting_the_same_head_again_with_another_drafting_replaces_it_without_force(setup, tmp_path):
    root, target, head = setup
    out = save_eagle3(tmp_path / "vllm", head, "speculators", speculative_tokens=3)
    save_eagle3(out, head, "speculators", speculative_tokens=6)                   # the same head, a serving setting
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 6
    other = perturbed_head(target, draft=40, aux=[1, 2, 3])
    with pytest.raises(SpecdecError, match="not this speculators head"):         # another head still needs force
        save_eagle3(out, other, "speculators", speculative_tokens=6)
    with pytest.raises(SpecdecError, match="speculative_tokens= is not an option of the sglang layout"):
        save_eagle3(tmp_path / "sgl", head, "sglang", speculative_tokens=6)
