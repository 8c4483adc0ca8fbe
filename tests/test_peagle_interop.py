"""Parity of specdec's P-EAGLE head with the real `speculators` package (0.9.0, its `PEagleDraftModel`),
on a tiny random Llama target and on the real SmolLM2-135M-Instruct (the export's direction; its
fixture loads the GGUF once for every interop test), in fp32.

Runs in its own environment (`make test-interop`: .venv-interop); skipped where speculators is
missing. Marked `interop`, outside the default run.

speculators' forward is its training step: it samples (anchor, depth) pairs by COD sampling, lays
them out in one row (depth 0 at every position, reading the token and the target's taps; depth d
at anchor a reading the mask token and `mask_hidden` at rotary position a + d, seeing the depth-0
positions <= a and its own chain) and returns only the loss. Its logits are caught on `lm_head`,
with eager attention (a dense float mask: its default flex attention compiles for a GPU) and a 100%
sampling share (down_sample_ratio = down_sample_ratio_min = 1), and compared with specdec's
decoding pass at each sampled pair: `draft_block` after the context 0..a gives depths 0..K-1 at
anchor a. Pairs speculators anchors at -1 (its sampler wraps around the row) have no context and
are left out.

- specdec's speculators-layout export loads into `PEagleDraftModel` (built from its config,
  `load_state_dict` strict but for the verifier's weights it ignores when missing): argmax
  identical, max |logit difference| <= 1e-4 (fp32; bf16 noise would be about 1e-2); a head served
  with another mask token than it was trained with is seen to differ.
- a head built by speculators (its own random init, its `save_pretrained`) imports into specdec and
  computes the same logits; greedy decoding with it equals plain greedy decoding.
"""

import pytest
import torch

pytestmark = pytest.mark.interop

speculators = pytest.importorskip("speculators")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

from test_hf_decode import V, _one_thread, build  # noqa: F401  (autouse here too: offline, one thread)

from specdec_models.decode import GREEDY, HeadDrafter, generate
from specdec_models.export.peagle import detect_layout, load_peagle, save_peagle
from specdec_models.heads.peagle import PEagleConfig, PEagleHead

K = 4
DRAFT = 40
MASK = V - 3
TOLERANCE = 1e-4
IGNORED_WHEN_MISSING = {"verifier_norm.weight", "verifier_lm_head.weight"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build(tmp_path_factory.mktemp("t") / "llama", "llama", 1, 30.0)


@pytest.fixture(scope="module")
def rows():
    """Tokens (1, n + 1) of a row (no mask token among them)."""
    return torch.randint(0, MASK, (1, 25), generator=torch.Generator().manual_seed(0))


def taps(target, tokens, layers):
    """The target's hidden states at `layers` of tokens (1, n), concatenated: (1, n, A*H)."""
    with torch.no_grad():
        out = target(input_ids=tokens, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], -1)


def speculators_model(directory):
    """speculators' PEagleDraftModel of the head in `directory`, eager attention, every tensor loaded."""
    config = PEagleSpeculatorConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"
    model = PEagleDraftModel(config)
    missing, unexpected = model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=False)
    assert unexpected == [] and set(missing) <= IGNORED_WHEN_MISSING, (missing, unexpected)
    return model.float().eval()


def speculators_pairs(model, rows, aux):
    """{(anchor, depth): draft logits} of every pair speculators' forward samples at a 100% share
    (anchors >= 0), over head positions t = 0..n-1 reading token t + 1 and taps of t."""
    n = aux.shape[1]
    last = aux[..., :model.hidden_size]            # any (1, n, H): only speculators' loss reads it
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            model(aux, rows[:, 1:n + 1], torch.zeros(1, n, dtype=torch.long), verifier_last_hidden_states=last,
                  num_depths=K, down_sample_ratio=1.0, down_sample_ratio_min=1.0,
                  loss_config=resolve_loss_config("kl_div", "eager"))       # its fused loss needs Triton
    finally:
        hook.remove()
    return seen[0][0]


def cod_pairs(n):
    """speculators' COD sampling of a row of n positions at a 100% share (seeded as `speculators_pairs`)."""
    from speculators.models.peagle.data import generate_cod_sample_indices

    torch.manual_seed(0)
    return generate_cod_sample_indices(n, torch.ones(1, n), num_depths=K, down_sample_ratio=1.0,
                                       down_sample_ratio_min=1.0)


def specdec_blocks(head, rows, aux, anchors):
    """{anchor: logits (K, draft)}: specdec's one decoding pass after the context 0..anchor."""
    out = {}
    with torch.no_grad():
        for a in anchors:
            cache = head.new_cache(1, a + 2)
            head.extend(rows[:, 1:a + 2], aux[:, :a + 1], cache)
            out[a] = head.draft_block(rows[:, a + 1], cache)[0]
    return out


def compare(head, theirs, rows, aux):
    """(max |logit difference|, argmax equal) over every sampled pair with an anchor >= 0."""
    logits = speculators_pairs(theirs, rows, aux)
    anchor, depth = cod_pairs(aux.shape[1])
    keep = anchor >= 0
    assert int((depth[keep] > 0).sum()) > 0 and int(depth.max()) == K - 1
    ours = specdec_blocks(head, rows, aux, sorted(set(anchor[keep].tolist())))
    mine = torch.stack([ours[int(a)][int(d)] for a, d in zip(anchor[keep], depth[keep], strict=True)])
    seen = logits[keep]
    return float((mine - seen).abs().max()), torch.equal(mine.argmax(-1), seen.argmax(-1))


def test_specdecs_speculators_export_computes_speculators_own_logits(llama, rows, tmp_path):
    torch.manual_seed(0)
    ids = torch.randperm(V)[:DRAFT].sort().values
    config = PEagleConfig.for_target(llama, draft_vocab_size=DRAFT, aux_layers=[0, 1, 2], parallel_depths=K,
                                     mask_token_id=MASK)
    head = PEagleHead(config, llama, ids).float()
    with torch.no_grad():                       # every weight away from its initial value
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    head.eval()
    out = save_peagle(tmp_path / "spec", head, "speculators", verifier="tiny/llama")
    theirs = speculators_model(out)
    assert theirs.mask_token_id == MASK and theirs.mask_hidden.shape == (1, 1, 3 * config.hidden_size)
    assert torch.equal(theirs.d2t, head.d2t) and torch.equal(theirs.t2d, head.t2d)
    aux = taps(llama, rows[:, :-1], head.aux_layers)
    diff, same = compare(head, theirs, rows, aux)
    assert same, "argmax differs"
    assert diff <= TOLERANCE, f"max |logit difference| {diff:.2e}"
    print(f"\nspeculators P-EAGLE parity, K={K}: max |logit diff| {diff:.2e}")
    # the comparison sees a serving mismatch (the mask token differs from training's)
    theirs.mask_token_id = MASK - 1
    assert compare(head, theirs, rows, aux)[0] > 100 * TOLERANCE


def test_a_head_built_by_speculators_computes_the_same_logits_in_specdec(llama, rows, tmp_path):
    c = llama.config
    layer = transformers.LlamaConfig(vocab_size=V, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                     num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                                     num_key_value_heads=c.num_key_value_heads,
                                     head_dim=c.hidden_size // c.num_attention_heads, rms_norm_eps=c.rms_norm_eps,
                                     max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False)
    layer._attn_implementation = "eager"
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT, norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[0, 1, 2], mask_token_id=MASK,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=K)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    torch.manual_seed(1)
    theirs = PEagleDraftModel(config)                                    # speculators' own random init
    ids = torch.randperm(V)[:DRAFT].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    theirs.load_vocab_mappings(t2d, ids - torch.arange(DRAFT))
    with torch.no_grad():   # the verifier's table, as its load_verifier_weights sets it; every other weight random
        theirs.embed_tokens.weight.copy_(llama.get_input_embeddings().weight)
        for name, p in theirs.named_parameters():
            if name not in {"embed_tokens.weight", *IGNORED_WHEN_MISSING}:
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if "norm" in name else 0.0))
    theirs.eval()
    theirs.save_pretrained(tmp_path / "theirs")
    assert detect_layout(tmp_path / "theirs") == "speculators"
    head = load_peagle(tmp_path / "theirs", llama)
    assert head.aux_layers == [0, 1, 2] and head.config.parallel_depths == K and head.config.mask_token_id == MASK
    theirs = speculators_model(tmp_path / "theirs")
    aux = taps(llama, rows[:, :-1], head.aux_layers)
    diff, same = compare(head.float(), theirs, rows, aux)
    assert same and diff <= TOLERANCE, diff
    prompt = rows[0, :10]
    plain, _ = generate(llama, [prompt], 12, sampling=GREEDY)
    spec, stats = generate(llama, [prompt], 12, HeadDrafter(head), sampling=GREEDY, gamma=K)
    assert spec[0].tolist() == plain[0].tolist() and stats.method == "peagle" and stats.drafted > 0


def test_the_export_computes_speculators_logits_on_the_real_smollm2(smollm2, tmp_path):
    from train.bench.hf import chat_prompts

    model, tokenizer, _ = smollm2
    prompt = chat_prompts(tokenizer, 1)[0][:24]
    out, _ = generate(model, [prompt], 8, sampling=GREEDY)
    rows = torch.cat([prompt, out[0]])[None]
    torch.manual_seed(2)
    ids = torch.randperm(model.config.vocab_size)[:8192].sort().values
    head = PEagleHead(PEagleConfig.for_target(model, draft_vocab_size=8192, parallel_depths=K), model, ids).float()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.02 * torch.randn_like(p))
    head.eval()
    theirs = speculators_model(save_peagle(tmp_path / "spec", head, "speculators",
                                           verifier="HuggingFaceTB/SmolLM2-135M-Instruct"))
    diff, same = compare(head, theirs, rows, taps(model, rows[:, :-1], head.aux_layers))
    assert same and diff <= TOLERANCE, diff
    print(f"\nspeculators P-EAGLE parity on SmolLM2, K={K}: max |logit diff| {diff:.2e}")
