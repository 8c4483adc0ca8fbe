"""The DFlash head and block drafting (`heads.dflash`, `decode.block_draft`): training computes
what decoding computes, a block reads nothing past its anchor nor another row (with a planted leak
that must be caught), blocks stop at an answer's or a row's end, greedy decoding is the target's
own (chain and tree, full and sub-vocabulary), sampling is lossless (chi-square, with planted-bug
twins that must fail), the cost model charges a block one pass, and bad input is one line. Tiny
random Llama and GPT-NeoX targets built from configs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_decode import chi_square_p_value, correction_from_p
from test_hf_decode import (
    V,
    _one_thread,  # noqa: F401  (autouse here too: offline, one thread)
    build,
    hf_greedy,
    ragged_prompts,
)

from specdec_models import SpecdecError
from specdec_models.decode import GREEDY, HeadDrafter, SamplingConfig, SpeedProfile, TreeSpec, generate
from specdec_models.decode.block_draft import BlockDrafter
from specdec_models.heads import dflash
from specdec_models.heads.dflash import (
    DFlashConfig,
    DFlashHead,
    anchor_weights,
    dflash_weights,
    paper_decay,
    sample_anchors,
)
from specdec_models.sampling import to_probs


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build(tmp_path_factory.mktemp("t") / "llama", "llama", 1, 30.0)


def head_for(target, seed=0, ids=None, **sizes):
    torch.manual_seed(seed)
    draft = None if ids is None else ids.numel()
    cfg = DFlashConfig.for_target(target, draft_vocab_size=draft, **sizes)
    head = DFlashHead(cfg, target, ids).eval()
    with torch.no_grad():                      # no zero-ish weights: every path must matter
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


def taps(target, tokens, layers):
    with torch.no_grad():
        out = target(input_ids=tokens, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], -1), out.hidden_states[-1]


def decoded_block(head, tokens, aux, a):
    """The logits (block_size - 1, draft) decoding computes for the block anchored at a of one row."""
    cache = head.new_cache(1, aux.shape[1] + 1)
    head.extend(tokens[None, 1:a + 1], aux[None, :a], cache)
    return head.draft_block(tokens[None, a], cache)[0]


def test_training_blocks_compute_what_decoding_computes(llama):
    # every block of block_logits (several per row, side by side in one pass) equals the pass
    # decoding makes after extending the head's cache with that row's context before the anchor
    head = head_for(llama, ids=torch.randperm(V)[:40].sort().values, aux_layers=[0, 1, 2], block_size=4,
                    num_layers=2, mask_token_id=7)
    tokens = torch.randint(0, V, (2, 15))
    aux, _ = taps(llama, tokens[:, :-1], head.aux_layers)
    anchors = torch.tensor([[1, 5, 9], [3, 4, 10]])
    with torch.no_grad():
        trained = head.block_logits(tokens, aux, anchors)
        assert trained.shape == (2, 3, 3, 40)
        for r in range(2):
            for j, a in enumerate(anchors[r].tolist()):
                torch.testing.assert_close(trained[r, j], decoded_block(head, tokens[r], aux[r], a),
                                           rtol=1e-4, atol=1e-4)


def _reads_only_its_context(head, tokens, aux, anchors):
    """Whether each block's logits are unchanged when everything it must not read changes: the
    row's tokens and taps at and after its anchor (the anchor's token excepted) and the other rows."""
    with torch.no_grad():
        before = head.block_logits(tokens, aux, anchors)
        for r in range(tokens.shape[0]):
            for j, a in enumerate(anchors[r].tolist()):
                t2, a2 = tokens.clone(), aux.clone()
                a2[r, a:] += torch.randn_like(a2[r, a:])
                t2[r, a + 1:] = (t2[r, a + 1:] + 1) % V
                others = torch.arange(tokens.shape[0]) != r
                a2[others] += torch.randn_like(a2[others])
                t2[others] = (t2[others] + 3) % V
                if not torch.allclose(head.block_logits(t2, a2, anchors)[r, j], before[r, j], atol=1e-5):
                    return False
    return True


def test_a_block_reads_nothing_past_its_anchor_nor_another_row_and_a_planted_leak_is_caught(llama, monkeypatch):
    head = head_for(llama, aux_layers=[1, 2], block_size=4, num_layers=2)
    tokens = torch.randint(0, V, (2, 13))
    aux, _ = taps(llama, tokens[:, :-1], head.aux_layers)
    anchors = torch.tensor([[2, 6], [4, 9]])
    assert _reads_only_its_context(head, tokens, aux, anchors)
    # the leak SpecForge #470 describes: a block that also sees its anchor's own position (whose
    # taps decoding does not have yet) and the ones after it
    real = dflash.block_mask
    monkeypatch.setattr(dflash, "block_mask", lambda visible, bs: real(torch.ones_like(visible), bs))
    assert not _reads_only_its_context(head, tokens, aux, anchors)


def test_anchor_weights_stop_a_block_at_an_answers_end_and_the_rows_end():
    # labels of 12 positions: answer tokens 3..7 (labels 2..6 count), a user turn, then 10..11
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, 2:7] = True
    mask[0, 9:12] = True
    valid, w = anchor_weights(mask, 4, 2.0)
    # an anchor must be an answer token (label a - 1) whose slot 1 counts (label a)
    assert valid[0].nonzero()[:, 0].tolist() == [3, 4, 5, 6, 10, 11]
    decay = torch.exp(-torch.arange(3.0) / 2.0)
    torch.testing.assert_close(w[0, 3], decay)                             # labels 3, 4, 5 all count
    torch.testing.assert_close(w[0, 5], decay * torch.tensor([1.0, 1.0, 0.0]))   # label 7 is the user's
    torch.testing.assert_close(w[0, 6], decay * torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(w[0, 10], decay * torch.tensor([1.0, 1.0, 0.0]))  # the row ends after label 11
    assert w[0, 9].sum() == 0 and w[0, 7].sum() == 0
    assert paper_decay(16) == 7 and paper_decay(8) == 4 and paper_decay(10) == 5


def _loss_reads_the_label_past_a_turn(head, tokens, aux, last, mask, label):
    """Whether block_loss changes when the target's state at `label`, a lone answer label after a
    user turn that no block may reach without crossing that turn, changes."""
    def loss(states):
        return head.block_loss(tokens, aux, states, mask, anchors=16, generator=torch.Generator().manual_seed(0)).loss

    with torch.no_grad():
        moved = last.clone()
        moved[:, label] += 3 * torch.randn_like(moved[:, label])
        return not torch.allclose(loss(last), loss(moved))


def test_a_block_never_crosses_a_turns_end_and_a_planted_crossing_is_caught(llama, monkeypatch):
    # answer labels 2..6, a user turn (labels 7, 8), a lone answer label 9: no anchor sits at 9 (its
    # token 9 is the user's), so a block reaches label 9 only by crossing the turn, as one of 5
    # anchored at 6 would (labels 6, 7, 8, 9) if a slot counted by its own label alone
    head = head_for(llama, block_size=5)
    tokens = torch.randint(0, V, (1, 13))
    aux, last = taps(llama, tokens[:, :-1], head.aux_layers)
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, 2:7] = True
    mask[0, 9] = True
    assert not _loss_reads_the_label_past_a_turn(head, tokens, aux, last, mask, 9)

    def crossing(label_mask, block_size, decay):          # the planted bug: no cumulative product
        b, n = label_mask.shape
        g = block_size - 1
        padded = torch.cat([label_mask, label_mask.new_zeros(b, g)], 1)
        labels = padded.unfold(1, g, 1)[:, :n].float()
        prev = torch.cat([label_mask.new_zeros(b, 1), label_mask[:, :-1]], 1)
        valid = labels[..., 0].bool() & prev
        return valid, labels * torch.exp(-torch.arange(g) / decay) * valid[..., None]

    monkeypatch.setattr(dflash, "anchor_weights", crossing)
    assert _loss_reads_the_label_past_a_turn(head, tokens, aux, last, mask, 9)


def test_sampled_anchors_are_distinct_valid_and_padded():
    valid = torch.zeros(3, 10, dtype=torch.bool)
    valid[0, [1, 4, 6, 8]] = True
    valid[1, [2]] = True
    at, real = sample_anchors(valid, 3, torch.Generator().manual_seed(0))
    assert at.shape == (3, 3) and real.sum(1).tolist() == [3, 1, 0]
    for r in range(3):
        picked = at[r][real[r]].tolist()
        assert picked == sorted(set(picked)) and all(valid[r, a] for a in picked)


def test_block_loss_masks_its_labels_and_learns(llama):
    head = head_for(llama, block_size=4).float()
    tokens = torch.randint(0, V, (2, 17))
    aux, last = taps(llama, tokens[:, :-1], head.aux_layers)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, 5:12] = True
    # labels 5..11 count: anchors 6..11 are valid (6 a row, all taken), slot i counts up to anchor 12 - i
    out = head.block_loss(tokens, aux, last, mask, anchors=8, generator=torch.Generator().manual_seed(0))
    assert out.blocks == 12 and out.slot_count.tolist() == [12, 10, 8]
    assert torch.isfinite(out.loss) and 0 <= out.accepted <= 30
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for step in range(40):
        loss = head.block_loss(tokens, aux, last, mask, anchors=8, generator=torch.Generator().manual_seed(step)).loss
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * first
    assert head.target.get_input_embeddings().weight.grad is None          # the shared embedding is frozen


def test_the_weight_table_names_every_tensor_the_head_saves(llama):
    head = head_for(llama, ids=torch.arange(50), num_layers=2)
    table = dflash_weights(2)
    assert list(head.state_dict()) == table.names
    assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == table.shapes(head.config)


def test_a_head_started_from_the_targets_last_layers_copies_them(llama):
    torch.manual_seed(0)
    head = DFlashHead(DFlashConfig.for_target(llama, num_layers=2, init_layers=1), llama)
    source = llama.model.layers[1]
    assert torch.equal(head.layers[0].self_attn.q_proj.weight, source.self_attn.q_proj.weight)
    assert torch.equal(head.layers[0].mlp.down_proj.weight, source.mlp.down_proj.weight)
    assert not torch.equal(head.layers[1].mlp.down_proj.weight[:4], source.mlp.down_proj.weight[:4])
    assert torch.equal(head.hidden_norm.weight, source.input_layernorm.weight)


@pytest.mark.parametrize("ids", [None, torch.arange(0, V, 2)], ids=["full-vocab", "sub-vocab"])
def test_greedy_block_decoding_equals_the_targets_generate(llama, ids):
    head = head_for(llama, ids=ids, block_size=5, num_layers=2)
    prompts = ragged_prompts()
    alone, _ = hf_greedy(llama, prompts, 16)
    for gamma in (1, 4, "auto"):
        got, stats = generate(llama, prompts, 16, HeadDrafter(head), sampling=GREEDY, gamma=gamma)
        assert [t.tolist() for t in got] == alone
        assert stats.method == "dflash" and stats.drafted > 0
    for spec in (TreeSpec(4, 2, 2), TreeSpec(3, 3, 1, min_prob=0.2)):
        got, stats = generate(llama, prompts, 16, BlockDrafter(head, spec), sampling=GREEDY)
        assert [t.tolist() for t in got] == alone
        assert stats.method == "dflash_tree"


def make_toy(d):
    """An 8-token GPT-NeoX target and a block-3 DFlash head over 5 of its tokens, sharpened so
    that it is accepted part of the time."""
    target = build(d / "t", "neox", 11, 6.0, vocab=8)
    head = head_for(target, seed=3, ids=torch.tensor([0, 2, 3, 5, 6]), block_size=3, mask_token_id=1)
    with torch.no_grad():
        head.lm_head.weight.mul_(3.0)
    return target, head


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory.mktemp("toy"))


def _samples(target, head, n, tree=None, **kw):
    """n samples of 3 new tokens after (1, 4, 2), chain drafting at gamma 2 or the `tree`: (counts
    of the 512 outcomes, their exact probabilities under the target, stats)."""
    prompt = torch.tensor([1, 4, 2])
    g = torch.Generator().manual_seed(1234)
    drafter = BlockDrafter(head, tree)
    tokens, stats = generate(target, prompt.expand(n, -1), 3, drafter, sampling=SamplingConfig(**kw),
                             gamma=2 if tree is None else 5, generator=g)
    index = (torch.stack(tokens) * torch.tensor([64, 8, 1])).sum(1)
    with torch.no_grad():
        seqs = torch.cartesian_prod(*[torch.arange(8)] * 3)
        x = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
        probs = to_probs(target(x[:, :-1]).logits[:, prompt.numel() - 1:], SamplingConfig(**kw))
        exact = probs.gather(-1, seqs[..., None])[..., 0].prod(-1)
    return torch.bincount(index, minlength=512).float(), exact, stats


@pytest.mark.parametrize("setting", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}],
                         ids=["t1", "t0.7-topp0.9"])
def test_block_chain_sampling_with_a_sub_vocabulary_is_lossless_chi_square(toy, setting):
    # 3 tokens of an 8-token target (512 joint outcomes), 6,000 samples, both drafts of a block of
    # 3 from one pass; q = 0 on the 3 tokens outside the head's vocabulary. Threshold p < 1e-4: a
    # correct sampler fails at most once in 10^4 runs (the seeds are fixed); a correction drawn
    # from p instead of the residual gives p < 1e-20 (next test).
    target, head = toy
    observed, exact, stats = _samples(target, head, 6000, **setting)
    assert stats.method == "dflash" and 0.05 < stats.acceptance_rate < 0.95, "neither perfect nor useless"
    assert chi_square_p_value(observed, exact, 6000) > 1e-4


def test_block_chain_chi_square_catches_a_correction_drawn_from_p(toy, monkeypatch):
    correction_from_p(monkeypatch)
    target, head = toy
    observed, exact, _ = _samples(target, head, 6000, temperature=1.0)
    assert chi_square_p_value(observed, exact, 6000) < 1e-20


def test_block_tree_sampling_is_lossless_chi_square(toy):
    # a tree of depth 2, 3 children per node (drawn without replacement from that depth's q), both
    # nodes of the first depth expanded, 2,000 rows one at a time. Threshold p < 1e-4: a correct
    # sampler fails at most once in 10^4 runs (fixed seeds); the broken variant below gives p < 1e-8
    # from 1,000 rows (measured: about 1e-13).
    target, head = toy
    observed, exact, stats = _samples(target, head, 2000, tree=TreeSpec(2, 3, 2), temperature=1.0)
    assert stats.method == "dflash_tree" and 0.05 < stats.per_position_acceptance[0] < 0.95
    assert stats.per_position_acceptance[1] > 0
    assert chi_square_p_value(observed, exact, 2000) > 1e-4


def test_block_tree_chi_square_catches_children_drawn_with_replacement(toy, monkeypatch):
    # the recursive rejection assumes a later child is drawn from q without the earlier ones:
    # testing it against q without them while it was drawn from all of q biases the output
    from specdec_models.decode import tree

    original = tree._TreeDecoding.children

    def with_replacement(self, logits, k):
        tokens, scores, q = original(self, logits, 1)
        for _ in range(k - 1):
            tokens.append(int(tree.sample(q, self.generator)))
            scores.append(scores[0])
        return tokens, scores, q

    monkeypatch.setattr(tree._TreeDecoding, "children", with_replacement)
    target, head = toy
    observed, exact, _ = _samples(target, head, 1000, tree=TreeSpec(2, 3, 2), temperature=1.0)
    assert chi_square_p_value(observed, exact, 1000) < 1e-8


def test_every_rounds_block_is_the_teacher_forced_heads_across_rejections(toy):
    # at T=1 rounds accept and reject; each round's pass must be what the head computes on the
    # final sequence's committed context (a stale context would still be lossless: chi-square
    # cannot see it)
    target, head = toy
    seen = []
    real = head.draft_block

    def record(anchor, cache):
        out = real(anchor, cache)
        seen.append((int(cache.lengths[0]), out[0].clone()))
        return out

    prompt = torch.tensor([3, 1, 4, 1, 5])
    head.draft_block = record
    try:
        out, stats = generate(target, [prompt], 14, BlockDrafter(head), sampling=SamplingConfig(temperature=1.0),
                              gamma=2, generator=torch.Generator().manual_seed(0))
    finally:
        del head.draft_block
    assert 0 < stats.accepted < stats.drafted and len(seen) >= 4
    full = torch.cat([prompt, out[0]])
    aux, _ = taps(target, full[None], head.aux_layers)
    for L, logits in seen:
        torch.testing.assert_close(logits, decoded_block(head, full, aux[0], L), rtol=1e-4, atol=1e-4)


def test_the_cost_model_charges_a_block_one_pass():
    ppa = [0.8, 0.6, 0.4, 0.3]
    chain = SpeedProfile(0.2, {1: 1.1, 4: 1.3}, ppa)
    block = SpeedProfile(0.2, {1: 1.1, 4: 1.3}, ppa, one_pass=True)
    assert block.predicted(4) == pytest.approx((1 + sum(ppa)) / (0.2 + 1.3))
    assert chain.predicted(4) == pytest.approx((1 + sum(ppa)) / (4 * 0.2 + 1.3))
    assert block.best_gamma() == 4 and chain.best_gamma() < 4
    assert SpeedProfile.from_dict(block.to_dict()) == block


@pytest.mark.parametrize("case, message", [
    ("block_size", "block_size must be an integer >= 2"),
    ("taps", "out of range"),
    ("mask_token", "mask_token_id must be a token id"),
    ("init_layers", "init_layers must be in"),
    ("gamma", "exceeds the 3 drafts"),
    ("tree_depth", "exceeds the 3 positions"),
    ("other_target", "another target"),
])
def test_bad_input_is_one_line(llama, tmp_path, case, message):
    with pytest.raises(SpecdecError, match=message) as err:
        if case == "block_size":
            DFlashConfig.for_target(llama, block_size=1)
        elif case == "taps":
            DFlashConfig.for_target(llama, aux_layers=[1, 3])
        elif case == "mask_token":
            DFlashConfig.for_target(llama, mask_token_id=V)
        elif case == "init_layers":
            DFlashConfig.for_target(llama, num_layers=1, init_layers=2)
        elif case == "gamma":
            generate(llama, [torch.tensor([1, 2])], 4, HeadDrafter(head_for(llama, block_size=4)), gamma=4)
        elif case == "tree_depth":
            BlockDrafter(head_for(llama, block_size=4), TreeSpec(4, 2, 1))
        else:
            other = build(tmp_path / "o", "llama", 5, 30.0)
            generate(other, [torch.tensor([1, 2])], 4, HeadDrafter(head_for(llama)))
    assert "\n" not in str(err.value)


def test_measure_costs_times_a_blocks_one_pass(llama):
    from specdec_models.decode.cost import DRAFT, measure_costs
    from specdec_models.hf import HFDecoder

    times = measure_costs(HFDecoder(llama), 2, 8, [1, 3], HeadDrafter(head_for(llama, block_size=4)), steps=2,
                          warmup=1)
    assert times.calls[DRAFT] == 2 and times.calls["verify/3"] == 2
