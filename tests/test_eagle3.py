"""The EAGLE-3 head: its training-time test computes what decoding computes, drafting through
`generate` is exact at T=0 and lossless at T=1 with a sub-vocabulary (chi-square), the draft
vocabulary maps, and its bad inputs. Tiny random Llama and GPT-NeoX targets built from configs."""

import pytest
import torch
import torch.nn.functional as F

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
from specdec_models.decode import GREEDY, HeadDrafter, TreeDrafter, generate
from specdec_models.heads.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    choose_draft_vocab,
    coverage,
    needed_chains,
    vocab_maps,
)
from specdec_models.sampling import SamplingConfig, to_probs


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build(tmp_path_factory.mktemp("t") / "llama", "llama", 1, 30.0)


def head_for(target, seed=0, draft=None, layers=None, ids=None):
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(target, draft_vocab_size=draft, aux_layers=layers)
    return Eagle3Head(cfg, target, ids).eval()


def aux_states(target, tokens, layers):
    with torch.no_grad():
        out = target(input_ids=tokens, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], -1), out.hidden_states[-1]


def test_training_time_test_computes_what_decoding_computes(llama):
    # every TTT step's logits at head position t equal draft step k+1 of a decoding round whose
    # head cache holds the target's features of positions 0..t, fed its own features after
    head = head_for(llama, draft=40, layers=[0, 1, 2], ids=torch.randperm(V)[:40].sort().values)
    with torch.no_grad():
        for p in head.parameters():            # no zero-ish weights: every path must matter
            p.add_(0.05 * torch.randn_like(p))
    tokens = torch.randint(0, V, (2, 14))
    aux, _ = aux_states(llama, tokens[:, :-1], head.aux_layers)
    with torch.no_grad():
        steps = head.ttt_logits(tokens, aux, steps=4)
        assert [s.shape[1] for s in steps] == [12, 11, 10, 9]
        for t in (0, 3, 8):
            cache = head.new_cache(2, 32)
            h = head.extend(tokens[:, 1:t + 2], head.fuse(aux[:, :t + 1]), cache)
            feature = h[:, -1:]
            for k in range(4):
                if t + k >= steps[k].shape[1]:
                    break
                torch.testing.assert_close(head.logits(feature[:, 0]), steps[k][:, t], rtol=1e-4, atol=1e-4)
                feature = head.extend(tokens[:, t + 2 + k:t + 3 + k], feature, cache)


def test_ttt_loss_masks_labels_and_learns(llama):
    head = head_for(llama, draft=48, layers=[0, 1, 2]).float().train()
    tokens = torch.randint(0, V, (3, 17))
    aux, last = aux_states(llama, tokens[:, :-1], head.aux_layers)
    mask = torch.ones(3, 16, dtype=torch.bool)
    mask[:, :6] = False                                    # a prompt: its predictions do not count
    out = head.ttt_loss(tokens, aux, last, mask, steps=3)
    assert out.step_count.tolist() == [3 * 10, 3 * 10, 3 * 10]      # labels at positions 6..15, per step
    assert bool((out.step_hits <= out.step_correct).all())
    assert out.vocab_mass is None                           # the full head runs in validation only
    evaluated = head.ttt_loss(tokens, aux, last, mask, steps=3, greedy_in_vocab=head.greedy_in_vocab(last[:, 1:]))
    assert 0 < float(evaluated.vocab_mass) < 1              # 48 of 96 tokens
    assert torch.equal(evaluated.loss, out.loss)
    # step 0's KL is KL(p || q) over the draft vocabulary, p the target's renormalised there
    with torch.no_grad():
        logq = torch.log_softmax(head.ttt_logits(tokens, aux, 1)[0][:, 6 - 1:], -1)       # labels 6..15
        logp = torch.log_softmax(head.target_draft_logits(last[:, 6:]), -1)
        direct = (logp.exp() * (logp - logq)).sum(-1).mean()
    torch.testing.assert_close(out.step_kl[0], direct, rtol=1e-5, atol=1e-6)
    # a masked-out label cannot move the loss
    aux2 = aux.clone()
    late = head.ttt_loss(tokens, aux2, last, mask, steps=3).loss
    last2 = last.clone()
    last2[:, :6] = torch.randn_like(last2[:, :6])          # labels of positions 1..5 changed: all masked
    assert torch.allclose(head.ttt_loss(tokens, aux2, last2, mask, steps=3).loss, late)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = head.ttt_loss(tokens, aux, last, mask, steps=3).loss
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * first


def loss_term_rows(llama):
    """A 3-layer head on 2 rows of 15 tokens, their aux and last states, the first 4 labels masked."""
    head = head_for(llama, draft=48, layers=[0, 1, 2]).float()
    tokens = torch.randint(0, V, (2, 15))
    aux, last = aux_states(llama, tokens[:, :-1], head.aux_layers)
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[:, :4] = False
    return head, tokens, aux, last, mask


def test_tv_weight_adds_the_rejection_probability_of_a_sampled_draft(llama):
    # tv_weight w adds w * (1 - sum_x min(p, q)) per counted position to each step's KL, weighted alike
    head, tokens, aux, last, mask = loss_term_rows(llama)
    with torch.no_grad():
        plain = head.ttt_loss(tokens, aux, last, mask, steps=2, decay=0.5)
        mixed = head.ttt_loss(tokens, aux, last, mask, steps=2, decay=0.5, tv_weight=2.0)
        p = torch.softmax(head.target_draft_logits(last[:, 1:]), -1)                  # labels 1..13
        tv = []
        for k, logits in enumerate(head.ttt_logits(tokens, aux, 2)):
            q = torch.softmax(logits.float(), -1)                                     # predicts label t + 1 + k
            label = mask[:, 1 + k:]
            tv.append((1 - torch.minimum(p[:, k:], q).sum(-1))[label].mean())
    assert torch.equal(mixed.step_kl, plain.step_kl)                                 # the KL is still reported alone
    assert 0 < float(tv[0]) < 1
    torch.testing.assert_close(mixed.loss, plain.loss + 2.0 * (tv[0] + 0.5 * tv[1]), rtol=1e-5, atol=1e-6)


def test_feature_weight_adds_the_distance_to_the_targets_normed_last_layer(llama):
    # feature_weight w adds w * smooth-L1(norm(f), last at the label), averaged over channels, per counted
    # position to each step's KL, weighted alike; and its gradient reaches the layer
    head, tokens, aux, last, mask = loss_term_rows(llama)
    with torch.no_grad():
        plain = head.ttt_loss(tokens, aux, last, mask, steps=2, decay=0.5)
        feats = head.ttt_features(tokens, aux, 2)
        dist = []
        for k, f in enumerate(feats):                                  # head position t predicts label t + 1 + k
            n = 14 - 1 - k
            d = F.smooth_l1_loss(head.norm(f[:, :n]), last[:, 1 + k:], reduction="none").mean(-1)
            dist.append(d[mask[:, 1 + k:]].mean())
    mixed = head.ttt_loss(tokens, aux, last, mask, steps=2, decay=0.5, feature_weight=3.0)
    assert torch.equal(mixed.step_kl.detach(), plain.step_kl)                        # the KL is still reported alone
    assert float(dist[0]) > 0
    torch.testing.assert_close(mixed.loss.detach(), plain.loss + 3.0 * (dist[0] + 0.5 * dist[1]), rtol=1e-5, atol=1e-6)
    head.zero_grad()
    (mixed.loss - plain.loss).backward()
    assert head.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_unrolled_steps_compute_only_the_chains_with_a_counted_label_ahead(llama):
    # steps 1.. computed for the needed chains only, and step 0's outputs for the positions read
    # only, give exactly the full computation's outputs there, and its gradients
    head = head_for(llama, draft=48, layers=[0, 1, 2]).float()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tokens = torch.randint(0, V, (3, 31))
    aux, _ = aux_states(llama, tokens[:, :-1], head.aux_layers)
    mask = torch.zeros(3, 29, dtype=torch.bool)            # label t + 1 counts (T = 29 head positions)
    mask[0, 10:20] = True
    mask[1, 3:29] = True
    chains, real = needed_chains(mask, 4)
    assert real.sum(1).tolist() == [12, 28, 0]               # labels 1..3 steps ahead: t in 7..18, 0..27
    assert chains[0, :12].tolist() == list(range(7, 19)) and chains[1, :28].tolist() == list(range(28))
    queries = mask.clone()
    queries[0, 7:20] = True
    queries[1, :] = True
    full = head.ttt_features(tokens, aux, 4)
    some = head.ttt_features(tokens, aux, 4, chains, real, queries)
    torch.testing.assert_close(some[0][queries], full[0][queries], rtol=1e-5, atol=1e-5)
    assert not some[0][~queries].any()                      # never computed
    weights = [torch.randn_like(f) for f in some]
    for k in (1, 2, 3):
        assert not some[k][~real].any()
        for r in range(3):
            n = int(real[r].sum())
            torch.testing.assert_close(some[k][r, :n], full[k][r, chains[r, :n]], rtol=1e-5, atol=1e-5)
    # the same weighted sum of the outputs read, through both: the same gradients
    params = [p for name, p in head.named_parameters() if name.startswith(("fc.", "layers."))]
    gathered = [full[0]] + [f.gather(1, chains[..., None].expand(-1, -1, f.shape[-1])) for f in full[1:]]
    keep = [queries] + [real] * 3
    dense = sum((w * f * m[..., None]).sum() for w, f, m in zip(weights, gathered, keep, strict=True))
    packed = sum((w * f * m[..., None]).sum() for w, f, m in zip(weights, some, keep, strict=True))
    for a, b in zip(torch.autograd.grad(dense, params), torch.autograd.grad(packed, params), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_the_target_embedding_is_shared_and_frozen(llama):
    head = head_for(llama, draft=32)
    names = set(head.state_dict())
    assert names == {"fc.weight", "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
                     "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                     "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
                     "layers.0.post_attention_layernorm.weight", "layers.0.mlp.gate_proj.weight",
                     "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight", "norm.weight",
                     "lm_head.weight", "d2t", "t2d"}
    # the LM head starts from the target's rows of the draft vocabulary, the norm from its final norm
    torch.testing.assert_close(head.lm_head.weight, llama.lm_head.weight[head.draft_ids])
    torch.testing.assert_close(head.norm.weight, llama.model.norm.weight)


def test_a_head_started_from_the_targets_layer_computes_that_layer(llama):
    # fc = identity on the highest aux layer (hidden_states[0], the embeddings, here) and the layer
    # copied from the target's layer 0: with the embedding's half of q/k/v at zero, the head's
    # output at every position is the target's hidden_states[1], attention over the context included
    torch.manual_seed(0)
    cfg = Eagle3Config.for_target(llama, draft_vocab_size=32, aux_layers=[1, 0])
    head = Eagle3Head(cfg, llama, init_layer_from_target=True).eval()
    H = cfg.hidden_size
    attn = head.layers[0].self_attn
    assert attn.q_proj.weight[:, :H].abs().max() > 0                  # the embedding's half stays random
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[:, :H] = 0
    tokens = torch.randint(0, V, (2, 12))
    aux, _ = aux_states(llama, tokens[:, :-1], head.aux_layers)
    with torch.no_grad():
        out = llama(input_ids=tokens[:, :-1], output_hidden_states=True)
        h = head.extend(tokens[:, 1:], head.fuse(aux), head.new_cache(2, 32))
    torch.testing.assert_close(h, out.hidden_states[1], rtol=1e-4, atol=1e-4)
    # without the copy the head computes something else
    plain = head_for(llama, draft=32, layers=[1, 0])
    with torch.no_grad():
        other = plain.extend(tokens[:, 1:], plain.fuse(aux), plain.new_cache(2, 32))
    assert (other - out.hidden_states[1]).abs().max() > 1e-2


def test_vocab_maps_follow_the_d2t_convention():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    ids = choose_draft_vocab(counts, 4)
    assert ids.tolist() == [0, 2, 3, 5]
    assert coverage(counts, ids) == pytest.approx(30 / 33)
    d2t, t2d = vocab_maps(ids, 8)
    assert (d2t + torch.arange(4)).tolist() == ids.tolist()       # d2t[i] = target_id - i
    assert t2d.nonzero()[:, 0].tolist() == ids.tolist()
    with pytest.raises(SpecdecError, match="increasing"):
        vocab_maps(torch.tensor([3, 1]), 8)


@pytest.mark.parametrize("draft", [None, 60], ids=["full-vocab", "sub-vocab"])
def test_greedy_eagle3_decoding_equals_the_targets_generate(llama, draft):
    head = head_for(llama, draft=draft, layers=[1, 2, 0])
    prompts = ragged_prompts()
    alone, _ = hf_greedy(llama, prompts, 16)
    for gamma in (1, 3, "auto"):
        got, stats = generate(llama, prompts, 16, HeadDrafter(head), sampling=GREEDY, gamma=gamma)
        assert [t.tolist() for t in got] == alone
        assert stats.method == "eagle3" and stats.drafted > 0


def test_a_perfect_feature_path_is_accepted(llama):
    # a head whose draft equals the target's own next-token choice would be accepted every time;
    # here: the batch of one row and its own copies give identical outputs and counts
    head = head_for(llama, draft=50)
    p = ragged_prompts()[1]
    one, s1 = generate(llama, [p], 12, HeadDrafter(head), sampling=GREEDY, gamma=3)
    many, s3 = generate(llama, [p, p, p], 12, HeadDrafter(head), sampling=GREEDY, gamma=3)
    assert all(t.tolist() == one[0].tolist() for t in many)
    assert s3.accepted == 3 * s1.accepted and s3.drafted == 3 * s1.drafted


def make_toy(d):
    """An 8-token GPT-NeoX target (saved under d) and an eagle3 head over 5 of its tokens,
    sharpened so that it is accepted part of the time."""
    target = build(d / "t", "neox", 11, 6.0, vocab=8)
    head = head_for(target, seed=3, draft=5, ids=torch.tensor([0, 2, 3, 5, 6]))
    with torch.no_grad():
        head.lm_head.weight.mul_(3.0)
    return target, head


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory.mktemp("toy"))


@pytest.mark.parametrize("setting", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}],
                         ids=["t1", "t0.7-topp0.9"])
def test_eagle3_sampling_with_a_sub_vocabulary_is_lossless_chi_square(toy, setting):
    # 3 tokens of an 8-token target (512 joint outcomes), 6,000 samples, gamma 2; the head drafts
    # from 5 of the 8 tokens (q = 0 on the other 3). Threshold p < 1e-4: a correct sampler fails
    # at most once in 10^4 runs (the seeds are fixed); a correction drawn from p instead of the
    # residual gives p < 1e-20 (next test).
    target, head = toy
    n = 6000
    observed, exact, stats = _samples(target, head, n, **setting)
    assert stats.method == "eagle3" and stats.drafted > 0
    assert 0.05 < stats.acceptance_rate < 0.95, "the toy head must be neither perfect nor useless"
    assert chi_square_p_value(observed, exact, n) > 1e-4


def test_eagle3_chi_square_catches_a_correction_drawn_from_p(toy, monkeypatch):
    correction_from_p(monkeypatch)                    # block verification's, the default, and token's
    target, head = toy
    observed, exact, _ = _samples(target, head, 6000, temperature=1.0)
    assert chi_square_p_value(observed, exact, 6000) < 1e-20


def _samples(target, head, n, tree=None, prompt=(1, 4, 2), datastore=None, **kw):
    """n samples of 3 new tokens after `prompt` (chain drafting at gamma 2, or the `tree`, with
    the `datastore` if given): (counts of the 512 outcomes, their exact probabilities under the
    target, stats)."""
    prompt = torch.tensor(prompt)
    g = torch.Generator().manual_seed(1234)
    drafter = HeadDrafter(head) if tree is None else TreeDrafter(head, tree, datastore)
    tokens, stats = generate(target, prompt.expand(n, -1), 3, drafter, sampling=SamplingConfig(**kw), gamma=2,
                             generator=g)
    index = (torch.stack(tokens) * torch.tensor([64, 8, 1])).sum(1)
    with torch.no_grad():
        seqs = torch.cartesian_prod(*[torch.arange(8)] * 3)
        x = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
        probs = to_probs(target(x[:, :-1]).logits[:, prompt.numel() - 1:], SamplingConfig(**kw))
        exact = probs.gather(-1, seqs[..., None])[..., 0].prod(-1)
    return torch.bincount(index, minlength=512).float(), exact, stats


@pytest.mark.parametrize("case, message", [
    ("aux_out_of_range", "out of range"),
    ("other_target", "another target"),
    ("map_size", "draft vocabulary map"),
])
def test_bad_input_is_one_line(llama, tmp_path, case, message):
    with pytest.raises(SpecdecError, match=message) as err:
        if case == "aux_out_of_range":
            Eagle3Config.for_target(llama, aux_layers=[1, 7])
        elif case == "other_target":
            other = build(tmp_path / "o", "llama", 5, 30.0)
            generate(other, [torch.tensor([1, 2])], 4, HeadDrafter(head_for(llama)))
        else:
            Eagle3Head(Eagle3Config.for_target(llama, draft_vocab_size=10), llama, torch.arange(12))
    assert "\n" not in str(err.value)


def _offline_first_draft(target, head, seq):
    """The head's first-draft logits (n - 1, draft) at every position t of seq (n,), teacher-forced:
    position t reads the target's features of t and token t + 1 (`ttt_logits`, step 1)."""
    aux, _ = aux_states(target, seq[None], head.aux_layers)
    with torch.no_grad():
        return head.ttt_logits(torch.cat([seq, seq[-1:]])[None], aux, 1)[0][0]


@pytest.mark.parametrize("tree", [None, "3,2,1"], ids=["chain", "tree"])
def test_every_rounds_first_draft_is_the_teacher_forced_heads_across_rejections(toy, tree):
    # At T=1 the toy head is accepted part of the time: every round starts from a head cache rolled
    # back past rejected drafts and extended with the target's features of the accepted tokens. Its
    # first draft must then be exactly what the head computes teacher-forced on the final sequence
    # (a stale cache entry would still be lossless, so the chi-square tests cannot see it).
    from specdec_models.decode import chain
    from specdec_models.decode import tree as trees

    target, head = toy
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 8, (n,), generator=g) for n in (3, 9, 6)]
    seen = []                                   # (row's prompt, tokens before the round, first-draft logits)
    if tree is None:
        original = chain.Eagle3Drafter.propose

        def record(self, run, gamma):
            logits = self.head_next[0]
            for i in (~run.rows.done).nonzero()[:, 0].tolist():
                n = int(run.rows.seq_len[i])
                seen.append((int(run.rows.orig[i]), run.rows.seq[i, :n].clone(), logits[i].clone()))
            return original(self, run, gamma)
        monkeypatch_target, name = chain.Eagle3Drafter, "propose"
    else:
        original = trees._TreeDecoding.draft

        def record(self, hcache, root_logits, root_feature, context, lookup):
            row = next(i for i, p in enumerate(prompts) if context[:p.numel()] == p.tolist())
            seen.append((row, torch.tensor(context), root_logits.clone()))
            return original(self, hcache, root_logits, root_feature, context, lookup)
        monkeypatch_target, name = trees._TreeDecoding, "draft"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(monkeypatch_target, name, record)
        drafter = HeadDrafter(head) if tree is None else TreeDrafter(head, trees.TreeSpec.parse(tree))
        out, stats = generate(target, prompts, 14, drafter, sampling=SamplingConfig(temperature=1.0), gamma=3,
                              generator=torch.Generator().manual_seed(0))
    assert 0 < stats.accepted < stats.drafted, "rounds must both accept and reject drafts"
    assert len(seen) >= 3 * len(prompts)
    for row, before, logits in seen:
        full = torch.cat([prompts[row], out[row]])
        assert torch.equal(full[:before.numel()], before)
        offline = _offline_first_draft(target, head, full[:before.numel() + 1])
        torch.testing.assert_close(logits, offline[before.numel() - 2], rtol=1e-4, atol=1e-4)
