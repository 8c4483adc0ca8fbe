"""P-EAGLE heads in speculators' layout (`export.peagle`): what the files hold (mask_hidden (1, 1, A*H),
the target's embedding table with the mask row replaced, SHA256SUMS), a round trip drafting the same
block, and the one-line refusals: another head kind, a layout without P-EAGLE, a trained embedding
table, a missing mask_hidden, a flipped weight byte. Tiny random Llama targets; parity with
speculators' own class is tests/test_peagle_interop.py's."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file

from test_eagle3_export import flip_a_weight_byte
from test_hf_decode import V, _one_thread, build  # noqa: F401  (autouse here too: offline, one thread)
from test_peagle import head_for, states

from specdec_models import SpecdecError
from specdec_models.export.eagle3 import save_eagle3
from specdec_models.export.peagle import detect_layout, load_peagle, save_peagle
from specdec_models.heads.eagle3 import Eagle3Config, Eagle3Head

DRAFT = 40


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build(tmp_path_factory.mktemp("t") / "llama", "llama", 1, 30.0)


@pytest.fixture(scope="module")
def head(llama):
    return head_for(llama, draft=DRAFT, ids=torch.randperm(V)[:DRAFT].sort().values, mask_token_id=V - 3)


def block(head, target, tokens):
    """The logits (b, K, draft) of one drafting pass after the context tokens (b, n)."""
    aux, _ = states(target, tokens, head.aux_layers)
    cache = head.new_cache(tokens.shape[0], tokens.shape[1] + 1)
    with torch.no_grad():
        head.extend(tokens[:, 1:], aux[:, :-1], cache)
        return head.draft_block(tokens[:, -1], cache)


def test_the_speculators_layout_holds_what_peagle_draft_model_loads(llama, head, tmp_path):
    out = save_peagle(tmp_path / "spec", head, "speculators", verifier="tiny/llama")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["mask_token_id"] == V - 3 and config["speculators_config"]["algorithm"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4     # K
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and config["draft_vocab_size"] == DRAFT
    tensors = load_file(str(out / "model.safetensors"))
    H = head.config.hidden_size
    assert tensors["mask_hidden"].shape == (1, 1, 3 * H)
    assert torch.equal(tensors["mask_hidden"].flatten(), head.mask_hidden.detach())
    table, own = tensors["embed_tokens.weight"], llama.get_input_embeddings().weight.detach()
    assert torch.equal(table[V - 3], head.mask_embed.detach())
    assert torch.equal(table[: V - 3], own[: V - 3]) and torch.equal(table[V - 2:], own[V - 2:])
    assert "mask_embed" not in tensors and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= set(tensors)
    assert (out / "SHA256SUMS").read_text().endswith("  model.safetensors\n")
    assert detect_layout(out) == "speculators"


@pytest.mark.parametrize("layout", ["specdec", "speculators"])
def test_a_round_trip_drafts_the_same_block(llama, head, tmp_path, layout):
    out = save_peagle(tmp_path / layout, head, layout)
    back = load_peagle(out, llama)
    assert back.config == head.config and detect_layout(out) == layout
    tokens = torch.randint(0, V - 3, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(block(back, llama, tokens), block(head, llama, tokens))


def test_another_head_kind_or_layout_is_one_line(llama, head, tmp_path):
    eagle3 = Eagle3Head(Eagle3Config.for_target(llama, aux_layers=[0, 1, 2]), llama)
    with pytest.raises(SpecdecError, match="hold a PEagleHead, got Eagle3Head") as err:
        save_peagle(tmp_path / "a", eagle3, "speculators")
    assert "\n" not in str(err.value)
    with pytest.raises(SpecdecError, match="has no 'sglang' layout") as err:
        save_peagle(tmp_path / "b", head, "sglang")
    with pytest.raises(SpecdecError, match="not a P-EAGLE head"):
        save_eagle3(tmp_path / "c", head, "speculators")
    with pytest.raises(SpecdecError, match="at least 2 tokens per pass"):
        save_peagle(tmp_path / "d", head, "speculators", speculative_tokens=1)
    assert not any((tmp_path / d).exists() for d in "abcd")
    eagle3_dir = save_eagle3(tmp_path / "e3", eagle3, "speculators")
    with pytest.raises(SpecdecError, match="a speculators eagle3 model, not an peagle head"):
        load_peagle(eagle3_dir, llama)


def _rewrite(out, change):
    """Rewrite out/model.safetensors through change(tensors) and drop its SHA256SUMS (a foreign trainer's folder)."""
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    (out / "SHA256SUMS").unlink()


def test_a_head_speculators_could_not_have_given_specdec_is_one_line(llama, head, tmp_path):
    out = save_peagle(tmp_path / "trained", head, "speculators")
    _rewrite(out, lambda t: t["embed_tokens.weight"][5].add_(0.5))       # speculators trained the whole table
    with pytest.raises(SpecdecError, match="differs from the target's embedding outside the mask token's row") as err:
        load_peagle(out, llama)
    assert "\n" not in str(err.value)
    out = save_peagle(tmp_path / "nomask", head, "speculators")
    _rewrite(out, lambda t: t.pop("mask_hidden"))
    with pytest.raises(SpecdecError, match="mask_hidden is missing"):
        load_peagle(out, llama)
    out = save_peagle(tmp_path / "verifiers", head, "speculators")           # no table: the verifier's is used
    _rewrite(out, lambda t: t.pop("embed_tokens.weight"))
    back = load_peagle(out, llama)
    assert torch.equal(back.mask_embed, llama.get_input_embeddings().weight[V - 3])
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "mask_token_id": V + 4}))
    with pytest.raises(SpecdecError, match="mask_token_id must be a token id in the target's vocabulary"):
        load_peagle(out, llama)


def test_a_flipped_byte_is_refused_in_one_line(llama, head, tmp_path):
    out = save_peagle(tmp_path / "spec", head, "speculators")
    flip_a_weight_byte(out / "model.safetensors")
    with pytest.raises(SpecdecError, match="SHA256SUMS") as err:
        load_peagle(out, llama)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("layout", ["specdec", "speculators"])
def test_the_export_command_refuses_an_sglang_layout_for_a_peagle_head_in_one_line_exit_2(head, tmp_path, capsys,
                                                                                         layout):
    from conftest import command

    source = save_peagle(tmp_path / "head", head, layout)
    status = command("export_head").main([str(source), str(tmp_path / "out"), "--layout", "sglang"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "a peagle head has no sglang layout (SGLang has no P-EAGLE layout" in err
    assert err.rstrip().endswith("--layout specdec or speculators") and not (tmp_path / "out").exists()


def test_the_export_command_writes_a_peagle_head_in_speculators_layout_drafting_the_same_block(llama, head, tmp_path,
                                                                                               capsys):
    from conftest import command

    source = save_peagle(tmp_path / "head", head, "specdec", target_path=llama.name_or_path)
    out = tmp_path / "vllm"
    assert command("export_head").main([str(source), str(out), "--layout", "speculators"]) == 0
    printed = capsys.readouterr().out
    assert "speculative tokens 4 (not given: the whole block, drafted in one pass)" in printed       # K = 4
    assert detect_layout(out) == "speculators"
    back, tokens = load_peagle(out, llama), torch.randint(0, V, (2, 9))
    torch.testing.assert_close(block(back, llama, tokens), block(head, llama, tokens))


