"""Parity of specdec's eagle3 head with the real `speculators` package (0.9.0, vLLM's format), on
the real SmolLM2-135M-Instruct's hidden states, in fp32.

Runs in its own environment (`make test-interop`: .venv-interop, where speculators' pin of
transformers <= 5.19 does not touch the project's); skipped where speculators or the real weights
are missing. Marked `interop`, outside the default run.

- specdec's speculators-format export loads into speculators' `Eagle3DraftModel` (built from its
  config, `load_state_dict`; every tensor it does not get is one it ignores when missing) and its
  draft logits equal specdec's at every position of training-time-test steps 0 (the target's
  features in), 1 and 2 (its own features fed back): argmax identical, max |logit difference|
  <= 1e-4.
- a head built by speculators (its own random init, d2t / t2d set, saved with its own
  `save_pretrained`) imports into specdec and drafts the tokens speculators' forward predicts at
  every position and step; greedy decoding with it equals plain greedy decoding.
"""

import json

import pytest
import torch

pytestmark = pytest.mark.interop

speculators = pytest.importorskip("speculators")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

from specdec_models.decode import GREEDY, HeadDrafter, generate
from specdec_models.export.eagle3 import detect_layout, load_eagle3, save_eagle3
from specdec_models.heads.eagle3 import Eagle3Config, Eagle3Head
from train.bench.hf import chat_prompts

STEPS = 3
DRAFT = 8192
TOLERANCE = 1e-4
# what Eagle3DraftModel ignores when missing from a checkpoint and specdec does not write
IGNORED_WHEN_MISSING = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}


@pytest.fixture(scope="module")
def rows(smollm2):
    """A real chat prompt and the target's greedy continuation: tokens (1, n + 1)."""
    model, tokenizer, _ = smollm2
    prompt = chat_prompts(tokenizer, 1)[0]
    out, _ = generate(model, [prompt], 16, sampling=GREEDY)
    return torch.cat([prompt, out[0]])[None]


def aux_states(model, tokens, layers):
    """The target's hidden states at `layers` (hidden_states indices) of tokens[:, :-1], concatenated."""
    with torch.no_grad():
        out = model(input_ids=tokens[:, :-1], output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], -1)


def speculators_model(directory, target):
    """speculators' Eagle3DraftModel of the head in `directory`, attention sdpa (its default flex
    attention fails on CPU for short rows), the target's embedding copied in."""
    config = Eagle3SpeculatorConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel(config)
    missing, unexpected = model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=False)
    assert unexpected == [] and set(missing) <= IGNORED_WHEN_MISSING, (missing, unexpected)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return model.float().eval()


def speculators_logits(model, tokens, aux, steps=STEPS):
    """speculators' draft logits of each TTT step (its forward returns only their argmax): rows of
    T = n - 1 head positions, feature t with token t + 1 (its `shift_batch` alignment)."""
    T = aux.shape[1] - 1
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    try:
        with torch.no_grad():
            drafts = model(hidden_states=aux[:, :T], input_ids=tokens[:, 1:T + 1],
                           document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=steps)
    finally:
        hook.remove()
    assert len(seen) == steps
    return seen, drafts


def test_specdecs_speculators_export_computes_speculators_own_logits(smollm2, rows, tmp_path):
    model, _, _ = smollm2
    torch.manual_seed(0)
    ids = torch.randperm(model.config.vocab_size)[:DRAFT].sort().values
    head = Eagle3Head(Eagle3Config.for_target(model, draft_vocab_size=DRAFT), model, ids).float()
    with torch.no_grad():                       # every weight away from its initial value
        for p in head.parameters():
            p.add_(0.02 * torch.randn_like(p))
    head.eval()
    out = save_eagle3(tmp_path / "spec", head, "speculators", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    theirs = speculators_model(out, model)
    assert theirs.config.eagle_aux_hidden_state_layer_ids == head.aux_layers == [2, 15, 27]
    assert theirs.draft_vocab_size == DRAFT and torch.equal(theirs.d2t, head.d2t) and torch.equal(theirs.t2d, head.t2d)

    aux = aux_states(model, rows, head.aux_layers)
    with torch.no_grad():
        ours = head.ttt_logits(rows, aux, STEPS)
    seen, _ = speculators_logits(theirs, rows, aux)
    report = []
    for k in range(STEPS):
        a, b = ours[k][0], seen[k][0, :ours[k].shape[1]]          # step k: positions 0..T-1-k
        diff = float((a - b).abs().max())
        report.append(diff)
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"step {k}: argmax differs"
        assert diff <= TOLERANCE, f"step {k}: max |logit difference| {diff:.2e}"
    print(f"\nspeculators parity, {rows.shape[1] - 2} positions, max |logit diff| per TTT step: "
          + ", ".join(f"{d:.2e}" for d in report))


def test_a_head_built_by_speculators_drafts_the_same_tokens_in_specdec(smollm2, rows, tmp_path):
    model, _, _ = smollm2
    c = model.config
    layer = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     intermediate_size=c.intermediate_size, num_hidden_layers=1,
                                     num_attention_heads=c.num_attention_heads,
                                     num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                                     rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_parameters["rope_theta"],
                                     max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False)
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT, norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[3, 14, 26],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
                                    architectures=["LlamaForCausalLM"])))
    torch.manual_seed(1)
    theirs = Eagle3DraftModel(config)                                   # speculators' own random init
    ids = torch.randperm(c.vocab_size)[:DRAFT].sort().values
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    theirs.load_vocab_mappings(t2d, ids - torch.arange(DRAFT))
    with torch.no_grad():   # the verifier's weights, as its load_verifier_weights sets them
        theirs.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        theirs.lm_head.weight.copy_(model.lm_head.weight[ids])
        theirs.verifier_lm_head.weight.copy_(model.lm_head.weight[ids])
        theirs.verifier_norm.weight.copy_(model.model.norm.weight)
        theirs.norm.weight.copy_(model.model.norm.weight)
    theirs.eval()
    theirs.save_pretrained(tmp_path / "theirs")
    written = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert written["norm_before_residual"] is False and written["speculators_version"] == "0.9.0"

    assert detect_layout(tmp_path / "theirs") == "speculators"
    head = load_eagle3(tmp_path / "theirs", model)
    assert head.aux_layers == [3, 14, 26] and head.draft_ids.tolist() == ids.tolist()

    aux = aux_states(model, rows, head.aux_layers)
    seen, drafts = speculators_logits(theirs, rows, aux)
    with torch.no_grad():
        ours = head.ttt_logits(rows, aux, STEPS)
    report = []
    for k in range(STEPS):
        n = ours[k].shape[1]
        assert torch.equal(ours[k][0].argmax(-1), drafts[k][0, :n]), f"step {k}: drafted tokens differ"
        report.append(float((ours[k][0] - seen[k][0, :n]).abs().max()))
    assert max(report) <= TOLERANCE
    print("\nspeculators-built head in specdec, max |logit diff| per TTT step: "
          + ", ".join(f"{d:.2e}" for d in report))

    prompt = rows[0, :-16]
    plain, _ = generate(model, [prompt], 16, sampling=GREEDY)
    drafted, stats = generate(model, [prompt], 16, HeadDrafter(head), sampling=GREEDY, gamma=3)
    assert drafted[0].tolist() == plain[0].tolist()
    assert stats.method == "eagle3" and stats.drafted > 0
