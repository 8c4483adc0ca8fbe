"""The P-EAGLE head: its parallel training computes what one decoding pass computes, the depth
sampling shrinks with depth and never crosses a row's or conversation's edge (a planted leak is
caught), the loss learns, and its bad configs. Tiny random Llama targets built from configs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_decode import (
    V,
    _one_thread,  # noqa: F401  (autouse here too: offline, one thread)
    build,
    hf_greedy,
    ragged_prompts,
)

import specdec_models.heads.peagle as peagle_module
from specdec_models import SpecdecError
from specdec_models.decode import GREEDY, HeadDrafter, generate
from specdec_models.heads.peagle import PEagleConfig, PEagleHead, depth_chains


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build(tmp_path_factory.mktemp("t") / "llama", "llama", 1, 30.0)


def head_for(target, seed=0, draft=None, depths=4, layers=(0, 1, 2), ids=None, **kw):
    torch.manual_seed(seed)
    cfg = PEagleConfig.for_target(target, draft_vocab_size=draft, aux_layers=list(layers), parallel_depths=depths,
                                  **kw)
    head = PEagleHead(cfg, target, ids).float()
    with torch.no_grad():                       # no zero-ish weights: every path must matter
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head.eval()


def states(target, tokens, layers):
    with torch.no_grad():
        out = target(input_ids=tokens, output_hidden_states=True)
    norm = target.model.norm
    return torch.cat([out.hidden_states[i] for i in layers], -1), norm(out.hidden_states[-1])


def test_parallel_training_computes_what_one_decoding_pass_computes(llama):
    # depth d at anchor t in training equals the output at mask position t + d of a decoding pass
    # whose cache holds the target's features of positions 0..t, then K - 1 mask positions
    head = head_for(llama, draft=40, ids=torch.randperm(V)[:40].sort().values)
    tokens = torch.randint(0, V - 1, (2, 14))
    aux, _ = states(llama, tokens[:, :-1], head.aux_layers)
    T = aux.shape[1] - 1
    with torch.no_grad():
        f0, k0, v0 = head.teacher_forced(tokens, aux)
        anchors = torch.arange(T).expand(2, T)
        real = torch.ones(2, T, dtype=torch.bool)
        depth = [f0] + [head.depth_features(k0, v0, anchors, real, d)[0].view(2, T, -1) for d in range(1, 4)]
        for t in (0, 3, 8, T - 1):
            cache = head.new_cache(2, 32)
            out = head.extend_and_draft(tokens[:, 1:t + 2], head.fuse(aux[:, :t + 1]), cache)
            assert out.shape[1] == t + 1 + 3 and int(cache.lengths[0]) == t + 4
            for d in range(4):
                torch.testing.assert_close(head.logits(out[:, t + d]), head.logits(depth[d][:, t]),
                                           rtol=1e-4, atol=1e-4)


def test_a_real_occurrence_of_the_mask_token_reads_the_learned_row(llama):
    head = head_for(llama, mask_token_id=5)
    x = head.embed(torch.tensor([[4, 5, 6]]))
    torch.testing.assert_close(x[0, 1], head.mask_embed)
    torch.testing.assert_close(x[0, 0], llama.get_input_embeddings().weight[4])


def test_depth_sampling_keeps_a_shrinking_share_of_nested_chains():
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(3, 200, dtype=torch.bool)
    mask[:, 20:180] = True
    chains = depth_chains(mask, 6, ratio=0.7, ratio_min=0.2, generator=g)
    counts = [int(c[0].sum()) for c in chains]
    expected = [int((160 - d) * max(0.7 ** d, 0.2)) for d in range(1, 6)]
    assert counts == expected                                   # 111, 77, 53, 36, 31
    for d, c in enumerate(chains, 1):
        anchors = c.nonzero()
        assert bool(mask[anchors[:, 0], anchors[:, 1] + d].all())   # every label on the chain counts
        if d > 1:
            assert not bool((c & ~chains[d - 2]).any())            # nested: depth d extends depth d - 1
    every = depth_chains(mask, 6, ratio=1.0, ratio_min=1.0)
    assert [int(c[0].sum()) for c in every] == [161 - d for d in range(1, 6)]


def _edge_rows(llama, head):
    """Two conversation rows of 20 positions: row 0's answer ends at 12 (padding after), row 1's
    two answers are split by a user turn (labels 8..10 do not count)."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V - 1, (2, 21), generator=g)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0, 4:12] = True
    mask[1, 3:8] = True
    mask[1, 11:20] = True
    return tokens, mask


def _loss_with(llama, head, tokens, mask):
    aux, last = states(llama, tokens[:, :-1], head.aux_layers)
    return head.parallel_loss(tokens, aux, last, mask, ratio=1.0, ratio_min=1.0)


def _leaks(llama, head):
    """Whether a loss term reads past a row's conversation or across a user turn: change the
    tokens past row 0's end, and row 1's user turn and what follows it, and compare the depth
    losses of everything before (row 0's all, row 1's before the turn)."""
    tokens, mask = _edge_rows(llama, head)
    cut = tokens.clone()
    g = torch.Generator().manual_seed(9)
    cut[0, 13:] = torch.randint(0, V - 1, (8,), generator=g)
    cut[1, 9:] = torch.randint(0, V - 1, (12,), generator=g)
    early = mask.clone()
    early[1, 8:] = False                                        # row 1: only its first answer
    a, b = _loss_with(llama, head, tokens, early), _loss_with(llama, head, cut, early)
    return not torch.allclose(a.depth_kl, b.depth_kl, atol=1e-6) or not torch.equal(a.depth_count, b.depth_count)


def test_no_chain_crosses_a_conversations_end_or_a_user_turn(llama):
    head = head_for(llama)
    tokens, mask = _edge_rows(llama, head)
    out = _loss_with(llama, head, tokens, mask)
    # runs of 8, 5 and 9 counted labels; a depth-d chain needs d of them in a row after its anchor
    runs = [8, 5, 9]
    assert out.depth_count.tolist() == [sum(runs)] + [sum(max(r - d + 1, 0) for r in runs) for d in range(1, 4)]
    assert not _leaks(llama, head)


def test_the_edge_check_catches_a_planted_leak(llama, monkeypatch):
    # the twin: a sampler that lets a chain run on past a label that does not count (as a sampler
    # wrapping around the row or ignoring the conversation's end would)
    real = peagle_module.depth_chains

    def leaky(mask, depths, *args, **kw):
        ones = torch.zeros_like(mask)
        ones[:, :] = mask.cumsum(1) > 0                        # everything after the first answer token
        return real(ones, depths, *args, **kw)

    monkeypatch.setattr(peagle_module, "depth_chains", leaky)
    assert _leaks(llama, head_for(llama))


def test_parallel_loss_learns(llama):
    head = head_for(llama, draft=48).train()
    tokens = torch.randint(0, V - 1, (3, 17))
    aux, last = states(llama, tokens[:, :-1], head.aux_layers)
    mask = torch.ones(3, 16, dtype=torch.bool)
    mask[:, :5] = False
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(0)
    first = None
    for _ in range(25):
        out = head.parallel_loss(tokens, aux, last, mask, generator=g)
        first = float(out.loss.detach()) if first is None else first
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert head.mask_hidden.grad is not None and head.mask_embed.grad is not None
    assert float(out.loss.detach()) < 0.8 * first
    assert out.depth_count[0] == 3 * 11 and bool((out.depth_count[1:] <= out.depth_count[:-1]).all())


@pytest.mark.parametrize("kw, message", [
    ({"parallel_depths": 1}, "parallel_depths must be an integer >= 2"),
    ({"mask_token_id": V}, "mask_token_id must be a token id"),
    ({"aux_layers": [0, 9]}, "out of range"),
    ({"layers_from_target": 2}, "layers_from_target must be 0 or 1"),
])
def test_bad_config_is_one_line(llama, kw, message):
    base = PEagleConfig.for_target(llama).to_dict()
    with pytest.raises(SpecdecError, match=message) as err:
        PEagleConfig.from_dict({**base, **kw})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("draft", [None, 60], ids=["full-vocab", "sub-vocab"])
def test_greedy_peagle_decoding_equals_the_targets_generate(llama, draft):
    head = head_for(llama, draft=draft)
    prompts = ragged_prompts()
    alone, _ = hf_greedy(llama, prompts, 16)
    for gamma in (1, 4, "auto"):
        got, stats = generate(llama, prompts, 16, HeadDrafter(head), sampling=GREEDY, gamma=gamma)
        assert [t.tolist() for t in got] == alone
        assert stats.method == "peagle" and stats.drafted > 0
    one, _ = generate(llama, [prompts[1]], 16, HeadDrafter(head), sampling=GREEDY, gamma=4)   # one pass a round
    assert one[0].tolist() == alone[1]


def test_draft_block_is_one_pass_over_the_context_and_leaves_the_cache_as_it_was(llama):
    # the block protocol: extend with the target's raw taps of a ragged batch, then one draft_block
    # call gives each row the K depths of a pass anchored at its own last committed position
    head = head_for(llama)
    tokens = torch.randint(0, V - 1, (2, 12))
    aux, _ = states(llama, tokens[:, :-1], head.aux_layers)
    lengths = torch.tensor([7, 11])
    with torch.no_grad():
        cache = head.new_cache(2, 16)
        head.extend(tokens[:, 1:], aux, cache)
        cache.rollback(lengths)
        k = cache.k.clone()
        got = head.draft_block(tokens[torch.arange(2), lengths], cache)
        assert torch.equal(cache.lengths, lengths) and torch.equal(cache.k[..., :7, :], k[..., :7, :])
        for r, n in enumerate(lengths.tolist()):
            alone = head.new_cache(1, 32)
            out = head.extend_and_draft(tokens[r:r + 1, 1:n + 1], head.fuse(aux[r:r + 1, :n]), alone)
            torch.testing.assert_close(got[r], head.logits(out[0, n - 1:]), rtol=1e-4, atol=1e-4)


def test_gamma_above_the_heads_depths_is_one_line(llama):
    head = head_for(llama, depths=3)
    with pytest.raises(SpecdecError, match="gamma 4 exceeds the 3 drafts one pass") as err:
        generate(llama, [torch.tensor([1, 2, 3])], 4, HeadDrafter(head), sampling=GREEDY, gamma=4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("layout", ["speculators", "sglang"])
def test_the_eagle3_layouts_refuse_a_peagle_head_in_one_line(llama, tmp_path, layout):
    from specdec_models.export.eagle3 import save_eagle3

    with pytest.raises(SpecdecError, match="not a P-EAGLE head") as err:
        save_eagle3(tmp_path / "out", head_for(llama), layout)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
