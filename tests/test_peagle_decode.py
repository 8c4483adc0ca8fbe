"""Decoding with a P-EAGLE head through `decode.block_draft` (`HeadDrafter(head)` is a
`BlockDrafter`): exact at T=0 as a chain and as a top-k tree, lossless at T=1 (chi-square, with
planted-bug twins that must fail), and every round's pass is the teacher-forced head's on the
committed context (a planted stale cache is caught). Tiny random targets built from configs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_decode import chi_square_p_value, correction_from_p
from test_hf_decode import (
    _one_thread,  # noqa: F401  (autouse here too: offline, one thread)
    build,
    hf_greedy,
    ragged_prompts,
)
from test_peagle import head_for

from specdec_models import SpecdecError
from specdec_models.decode import GREEDY, BlockDrafter, HeadDrafter, SamplingConfig, TreeDrafter, TreeSpec, generate
from specdec_models.heads.peagle import PEagleHead
from specdec_models.sampling import to_probs


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build(tmp_path_factory.mktemp("t") / "llama", "llama", 1, 30.0)


@pytest.mark.parametrize("draft", [None, 60], ids=["full-vocab", "sub-vocab"])
def test_greedy_peagle_trees_equal_the_targets_generate(llama, draft):
    head = head_for(llama, draft=draft)
    assert isinstance(HeadDrafter(head), BlockDrafter)
    prompts = ragged_prompts()
    alone, _ = hf_greedy(llama, prompts, 16)
    for spec in (TreeSpec(4, 2, 2), TreeSpec(3, 3, 1, min_prob=0.2)):
        got, stats = generate(llama, prompts, 16, BlockDrafter(head, spec), sampling=GREEDY)
        assert [t.tolist() for t in got] == alone
        assert stats.method == "peagle_tree" and stats.drafted > 0


def test_the_eagle3_tree_drafter_refuses_a_peagle_head_in_one_line(llama):
    with pytest.raises(SpecdecError, match="BlockDrafter") as err:
        TreeDrafter(head_for(llama), TreeSpec(3, 2, 1))
    assert "\n" not in str(err.value)


def make_toy(d):
    """An 8-token GPT-NeoX target and a K = 3 P-EAGLE head over 5 of its tokens, accepted part of
    the time at both depths (seed 6: about a third of the drafts at T=1, a fifth at T=0.7 top-p 0.9)."""
    target = build(d / "t", "neox", 11, 6.0, vocab=8)
    head = head_for(target, seed=6, draft=5, depths=3, ids=torch.tensor([0, 2, 3, 5, 6]), mask_token_id=1)
    return target, head


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """The toy target with a sharper head (seed 3, logits x3), as dflash's tree tests use: drawing
    children with replacement then repeats tokens often enough for the twin below to be seen."""
    target, _ = make_toy(tmp_path_factory.mktemp("sharp"))
    head = head_for(target, seed=3, draft=5, depths=3, ids=torch.tensor([0, 2, 3, 5, 6]), mask_token_id=1)
    with torch.no_grad():
        head.lm_head.weight.mul_(3.0)
    return target, head


def _samples(target, head, n, tree=None, **kw):
    """n samples of 3 new tokens after (1, 4, 2), chain drafting at gamma 2 or the `tree`: (counts
    of the 512 outcomes, their exact probabilities under the target, stats)."""
    prompt = torch.tensor([1, 4, 2])
    g = torch.Generator().manual_seed(1234)
    tokens, stats = generate(target, prompt.expand(n, -1), 3, BlockDrafter(head, tree), sampling=SamplingConfig(**kw),
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
def test_peagle_chain_sampling_with_a_sub_vocabulary_is_lossless_chi_square(toy, setting):
    # 3 tokens of an 8-token target (512 joint outcomes), 6,000 samples, two drafts (depths 0 and 1)
    # of one pass; q = 0 on the 3 tokens outside the head's vocabulary. Threshold p < 1e-4: a
    # correct sampler fails at most once in 10^4 runs (the seeds are fixed); a correction drawn
    # from p instead of the residual gives p < 1e-20 (next test).
    target, head = toy
    observed, exact, stats = _samples(target, head, 6000, **setting)
    assert stats.method == "peagle" and 0.05 < stats.acceptance_rate < 0.95, "neither perfect nor useless"
    assert chi_square_p_value(observed, exact, 6000) > 1e-4


def test_peagle_chain_chi_square_catches_a_correction_drawn_from_p(toy, monkeypatch):
    correction_from_p(monkeypatch)
    target, head = toy
    observed, exact, _ = _samples(target, head, 6000, temperature=1.0)
    assert chi_square_p_value(observed, exact, 6000) < 1e-20


@pytest.mark.slow     # about 20 s; the block drafter's tree sampling keeps its chi-square and twin in test_dflash.py
def test_peagle_tree_sampling_is_lossless_chi_square(sharp):
    # a tree of depth 2, 3 children per node (drawn without replacement from that depth's q), both
    # nodes of the first depth expanded, 2,000 rows one at a time. Threshold p < 1e-4: a correct
    # sampler fails at most once in 10^4 runs (fixed seeds); the broken variant below must give p < 1e-8.
    target, head = sharp
    observed, exact, stats = _samples(target, head, 2000, tree=TreeSpec(2, 3, 2), temperature=1.0)
    assert stats.method == "peagle_tree" and 0.05 < stats.per_position_acceptance[0] < 0.95
    assert chi_square_p_value(observed, exact, 2000) > 1e-4


@pytest.mark.slow     # about 10 s; test_dflash.py's twin catches the same bug in the same drafter by default
def test_peagle_tree_chi_square_catches_children_drawn_with_replacement(sharp, monkeypatch):
    from specdec_models.decode import tree

    original = tree._TreeDecoding.children

    def with_replacement(self, logits, k):
        tokens, scores, q = original(self, logits, 1)
        for _ in range(k - 1):
            tokens.append(int(tree.sample(q, self.generator)))
            scores.append(scores[0])
        return tokens, scores, q

    monkeypatch.setattr(tree._TreeDecoding, "children", with_replacement)
    target, head = sharp
    observed, exact, _ = _samples(target, head, 1000, tree=TreeSpec(2, 3, 2), temperature=1.0)
    assert chi_square_p_value(observed, exact, 1000) < 1e-8


def _rounds_match_the_teacher_forced_head(target, head):
    """Whether every round's pass at T=1 (rounds accept and reject) equals the head's depths on the
    final sequence's committed context, computed from scratch (a stale cache stays lossless:
    chi-square cannot see it)."""
    seen = []
    real = type(head).draft_block

    def record(anchor, cache):
        out = real(head, anchor, cache)
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
    with torch.no_grad():
        hidden = target(input_ids=full[None], output_hidden_states=True).hidden_states
    aux = torch.cat([hidden[i] for i in head.aux_layers], -1)
    with torch.no_grad():
        for L, logits in seen:
            cache = head.new_cache(1, 32)
            pass_ = head.extend_and_draft(full[None, 1:L + 1], head.fuse(aux[:, :L]), cache)
            if not torch.allclose(logits, head.logits(pass_[0, L - 1:]), rtol=1e-4, atol=1e-4):
                return False
    return True


def test_every_rounds_pass_is_the_teacher_forced_heads_and_a_misplaced_pass_is_caught(toy, monkeypatch):
    target, head = toy
    assert _rounds_match_the_teacher_forced_head(target, head)

    def misplaced(self, anchor, cache):     # the pass appended after position L - 1 instead of re-reading it
        lengths = cache.lengths.clone()
        feature = cache.embeds[torch.arange(lengths.numel()), lengths - 1][:, None]
        out = self.extend_and_draft(anchor[:, None], feature, cache)
        cache.rollback(lengths)
        return self.logits(out)

    monkeypatch.setattr(PEagleHead, "draft_block", misplaced)
    assert not _rounds_match_the_teacher_forced_head(target, head)


@pytest.mark.real
@pytest.mark.slow     # about 25 s with SmolLM2's load; the greedy tests above check the same on tiny targets
def test_a_peagle_head_on_smollm2_decodes_greedily_exactly_as_a_chain_and_a_tree(smollm2):
    # the real target's shapes (grouped-query attention, 30 layers, a 49,152-token vocabulary): an
    # untrained head started from the target's layer 27, mask token <empty_output> (id 16) as in
    # experiment=smollm2_peagle, drafting a chain of 4 and a top-2 tree; greedy output is the target's
    from specdec_models.heads.peagle import PEagleConfig
    from train.bench.hf import chat_prompts

    model, tokenizer, _ = smollm2
    torch.manual_seed(0)
    config = PEagleConfig.for_target(model, parallel_depths=4, mask_token_id=16, layers_from_target=1)
    head = PEagleHead(config, model).eval()
    prompt = chat_prompts(tokenizer, 1)[0]
    plain, _ = generate(model, [prompt], 12, sampling=GREEDY)
    chain, stats = generate(model, [prompt], 12, HeadDrafter(head), sampling=GREEDY, gamma=4)
    tree, tree_stats = generate(model, [prompt], 12, BlockDrafter(head, TreeSpec(3, 2, 2)), sampling=GREEDY)
    assert chain[0].tolist() == plain[0].tolist() == tree[0].tolist()
    assert stats.method == "peagle" and tree_stats.method == "peagle_tree" and stats.drafted > 0
