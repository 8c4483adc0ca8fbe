"""DFlash heads in specdec's and speculators' layouts (`export.dflash`): a head written in either
comes back computing the same blocks and decoding exactly; speculators' config holds what its
DFlashDraftModel reads; bad input is one line. Tiny random Llama targets built from configs (the
parity with speculators' own class is tests/test_dflash_interop.py, marked interop)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_dflash import head_for, taps
from test_hf_decode import (
    V,
    _one_thread,  # noqa: F401  (autouse here too: offline, one thread)
    build,
    hf_greedy,
    ragged_prompts,
)

from specdec_models import SpecdecError
from specdec_models.decode import GREEDY, HeadDrafter, generate
from specdec_models.export.dflash import detect_layout, load_dflash, save_dflash


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build(tmp_path_factory.mktemp("t") / "llama", "llama", 1, 30.0)


@pytest.mark.parametrize("layout", ["specdec", "speculators"])
def test_a_written_head_reads_back_computing_the_same_blocks_and_decoding_exactly(llama, tmp_path, layout):
    head = head_for(llama, ids=torch.arange(0, V, 3), aux_layers=[0, 1, 2], block_size=4, num_layers=2,
                    mask_token_id=5)
    out = save_dflash(tmp_path / layout, head, layout)
    assert detect_layout(out) == layout
    back = load_dflash(out, llama)
    assert back.config == head.config
    tokens = torch.randint(0, V, (2, 12))
    aux, _ = taps(llama, tokens[:, :-1], head.aux_layers)
    anchors = torch.tensor([[2, 6], [3, 9]])
    with torch.no_grad():
        torch.testing.assert_close(back.block_logits(tokens, aux, anchors), head.block_logits(tokens, aux, anchors))
    prompts = ragged_prompts()
    alone, _ = hf_greedy(llama, prompts, 12)
    got, stats = generate(llama, prompts, 12, HeadDrafter(back), sampling=GREEDY, gamma=3)
    assert [t.tolist() for t in got] == alone and stats.method == "dflash"


def test_the_speculators_config_holds_what_its_dflash_model_reads(llama, tmp_path):
    head = head_for(llama, ids=torch.arange(0, V, 2), aux_layers=[1, 2], block_size=6, num_layers=2,
                    mask_token_id=9)
    out = save_dflash(tmp_path / "s", head, "speculators", verifier="org/target")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    assert (config["block_size"], config["mask_token_id"], config["draft_vocab_size"]) == (6, 9, V // 2)
    assert config["aux_hidden_state_layer_ids"] == [1, 2] and config["sample_from_anchor"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["vocab_size"] == V
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == 5 and config["speculators_config"]["verifier"]["name_or_path"] == \
        "org/target"
    assert (out / "SHA256SUMS").is_file()


@pytest.mark.parametrize("case, message", [
    ("trained_full_vocab_lm_head", "takes a full-vocabulary head's LM head from the verifier"),
    ("other_target", "hidden size"),
    ("sample_from_anchor", "sample_from_anchor is true"),
    ("speculative_tokens", "exceeds the 3 drafts"),
    ("not_a_head", "holds no dflash head"),
])
def test_bad_input_is_one_line(llama, tmp_path, case, message):
    head = head_for(llama, ids=torch.arange(0, V, 2), block_size=4)
    with pytest.raises(SpecdecError, match=message) as err:
        if case == "trained_full_vocab_lm_head":
            save_dflash(tmp_path / "s", head_for(llama, block_size=4), "speculators")
        elif case == "other_target":
            out = save_dflash(tmp_path / "s", head, "speculators")
            load_dflash(out, build(tmp_path / "neox", "neox", 2, 30.0))
        elif case == "sample_from_anchor":
            out = save_dflash(tmp_path / "s", head, "speculators")
            config = json.loads((out / "config.json").read_text())
            (out / "config.json").write_text(json.dumps({**config, "sample_from_anchor": True}))
            load_dflash(out, llama)
        elif case == "speculative_tokens":
            save_dflash(tmp_path / "s", head, "speculators", speculative_tokens=4)
        else:
            (tmp_path / "empty").mkdir()
            load_dflash(tmp_path / "empty", llama)
    assert "\n" not in str(err.value)


def test_a_full_vocabulary_head_with_the_targets_lm_head_is_written_without_it_mattering(llama, tmp_path):
    torch.manual_seed(0)
    from specdec_models.heads.dflash import DFlashConfig, DFlashHead

    head = DFlashHead(DFlashConfig.for_target(llama, block_size=4), llama).eval()     # LM head = the target's
    back = load_dflash(save_dflash(tmp_path / "s", head, "speculators"), llama)
    assert torch.equal(back.lm_head.weight, head.lm_head.weight) and torch.equal(back.d2t, head.d2t)


def test_the_export_command_writes_the_speculators_layout_drafting_the_block_and_refuses_sglang(llama, tmp_path,
                                                                                              capsys):
    from conftest import command

    head = head_for(llama, ids=torch.arange(0, V, 3), aux_layers=[0, 1, 2], block_size=4, mask_token_id=5)
    source = save_dflash(tmp_path / "head", head, "specdec", target_path=llama.name_or_path)
    export = command("export_head").main
    assert export([str(source), str(tmp_path / "sglang"), "--layout", "sglang"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a dflash head has no sglang layout (SGLang's DFlash reads z-lab's" in err, err
    assert not (tmp_path / "sglang").exists()
    out = tmp_path / "vllm"
    assert export([str(source), str(out), "--layout", "speculators"]) == 0
    assert "speculative tokens 3 (not given: the whole block, drafted in one pass)" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    back = load_dflash(out, llama)
    tokens = torch.randint(0, V, (2, 12))
    aux, _ = taps(llama, tokens[:, :-1], head.aux_layers)
    anchors = torch.tensor([[2, 6], [3, 9]])
    with torch.no_grad():
        torch.testing.assert_close(back.block_logits(tokens, aux, anchors), head.block_logits(tokens, aux, anchors))
