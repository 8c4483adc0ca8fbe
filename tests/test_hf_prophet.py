"""A prophet head for Hugging Face targets: the hidden states the HF cache keeps, the head's window
loss and shared frozen weights, drafting through `generate` (greedy exactness against the target's
own `generate()`, batch invariance; its chi-square losslessness test is test_hf_decode's, next
to the draft's). Tiny random Llama and GPT-NeoX models built from config objects, as in
test_hf_decode."""

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

from specdec_models import SpecdecError
from specdec_models.decode import GREEDY, HeadDrafter, SamplingConfig, generate
from specdec_models.heads.hf_prophet import HFProphet, HFProphetConfig
from specdec_models.hf import HFDecoder
from specdec_models.losses import next_token_loss


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    d = tmp_path_factory.mktemp("targets")
    return {"llama": build(d / "llama", "llama", 1, 30.0), "neox": build(d / "neox", "neox", 0, 20.0)}


def head_for(target, seed=0, **sizes):
    torch.manual_seed(seed)
    sizes = {"dim": 32, "dim_head": 16, "depth": 2, "prophet_train_length": 6, **sizes}
    return HFProphet(HFProphetConfig.for_target(target, **sizes), target)


# ---------------------------------------------------------------- hidden states in the HF cache

@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_hidden_states_are_the_input_of_the_targets_head(targets, arch):
    # the decision the head rests on: hidden_states[-1] is the final-norm output the head maps to logits
    model = targets[arch]
    x = torch.randint(0, V, (2, 9))
    out = HFDecoder(model)(x, embeds=True)
    torch.testing.assert_close(model.get_output_embeddings()(out.embeds), out.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "neox"])
@pytest.mark.parametrize("slack", [0, 64], ids=["compact-always", "keep-holes"])
def test_cache_keeps_each_rows_hidden_states_through_ragged_rollbacks(targets, arch, slack):
    model = targets[arch]
    dec = HFDecoder(model, slack=slack)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (3, 60), generator=g)
    full = dec(x, embeds=True).embeds                          # each row's uncached forward
    cache = dec.new_cache(3, 60, keep_embeds=True)
    dec(x[:, :12], cache=cache)
    cache.rollback(torch.tensor([12, 5, 3]))
    for step in range(14):
        n = 1 + step % 4
        start = cache.lengths.clone()
        dec(torch.stack([x[i, start[i]:start[i] + n] for i in range(3)]), cache=cache)
        keep = start + torch.randint(0, n + 1, (3,), generator=g)
        cache.rollback(keep)
        count = min(3, int(keep.min()))
        expected = torch.stack([full[i, keep[i] - count:keep[i]] for i in range(3)])
        torch.testing.assert_close(cache.last_embeds(count), expected, rtol=1e-5, atol=1e-5)
    assert cache.embeds.shape[1] == cache.slots


@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_dropping_finished_rows_keeps_the_others_keys_values_and_hidden_states(targets, arch):
    model = targets[arch]
    dec = HFDecoder(model, slack=64)
    x = torch.randint(0, V, (4, 30), generator=torch.Generator().manual_seed(1))
    full = dec(x, embeds=True)
    cache = dec.new_cache(4, 30, keep_embeds=True)
    dec(x[:, :10], cache=cache)
    cache.rollback(torch.tensor([10, 4, 7, 6]))
    cache.compact_rows(torch.tensor([1]), torch.tensor([3]), 3)     # row 1 finished: row 3 takes its place
    rows = [0, 3, 2]
    last = torch.stack([full.embeds[r, n - 2:n] for r, n in zip(rows, (10, 6, 7), strict=True)])
    torch.testing.assert_close(cache.last_embeds(2), last, rtol=1e-5, atol=1e-5)
    start = cache.lengths.clone()
    out = dec(torch.stack([x[r, start[i]:start[i] + 3] for i, r in enumerate(rows)]), cache=cache).logits
    for i, r in enumerate(rows):
        torch.testing.assert_close(out[i], full.logits[r, start[i]:start[i] + 3], rtol=1e-5, atol=1e-5)


def test_a_cache_without_hidden_states_says_so(targets):
    cache = HFDecoder(targets["llama"]).new_cache(1, 8)
    with pytest.raises(SpecdecError, match="keep_embeds"):
        cache.last_embeds(1)


@pytest.mark.parametrize("supported", [True, False], ids=["logits_to_keep", "full-head"])
def test_logits_at_one_position_per_row_equal_the_full_logits_there(targets, supported):
    dec = HFDecoder(targets["llama"], vocab_size=90)
    dec._keeps_logits = supported                 # models without transformers' logits_to_keep
    x = torch.randint(0, V, (4, 7))
    at = torch.tensor([6, 2, 2, 0])
    full = dec(x).logits
    torch.testing.assert_close(dec(x, logits_at=at).logits[:, 0], full[torch.arange(4), at])
    cache = dec.new_cache(4, 16)
    torch.testing.assert_close(dec(x, cache=cache, logits_at=at).logits[:, 0], full[torch.arange(4), at],
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the head

def test_head_holds_only_its_own_weights_and_leaves_the_target_without_gradient(targets):
    target = targets["neox"]                                   # hidden 64, head 32: both projections
    head = head_for(target)
    names = set(head.state_dict())
    assert all(not n.startswith("_") and "embed" not in n for n in names)
    assert {"to_prophet_start.weight", "prophet.token_emb.proj.weight", "prophet.to_logits.proj.weight",
            "prophet.norm.weight"} <= names
    own = sum(p.numel() for p in head.parameters())
    assert own < sum(p.numel() for p in target.parameters())
    assert not any(p is q for p in head.parameters() for q in target.parameters())
    seq = torch.randint(0, V, (2, 25))
    head.loss(seq).backward()
    assert all(p.grad is not None for p in head.parameters())
    assert all(p.grad is None for p in target.parameters())
    same_width = head_for(targets["llama"])                    # hidden 32 = head 32: no projections
    assert not any("proj" in n for n in same_width.state_dict())


def test_a_float32_head_trains_and_drafts_next_to_a_bfloat16_target(tmp_path):
    target = build(tmp_path / "t", "llama", 1, 30.0).to(torch.bfloat16)
    head = head_for(target)
    assert head.to_prophet_start.weight.dtype == torch.bfloat16        # decoding: the target's dtype
    head.float()
    loss = head.loss(torch.randint(0, V, (2, 25)))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad.dtype == torch.float32 for p in head.parameters())
    assert target.lm_head.weight.dtype == torch.bfloat16 and target.lm_head.weight.grad is None
    tokens, stats = generate(target, ragged_prompts(), 8, HeadDrafter(head.eval()), sampling=GREEDY, gamma=3)
    assert [len(t) for t in tokens] == [8] * 5 and stats.drafted > 0


@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_batched_window_loss_equals_running_the_head_on_each_window(targets, arch):
    head = head_for(targets[arch], prophet_train_length=5)
    seq = torch.randint(0, V, (3, 25))
    hidden, _ = head.target_hidden(seq[:, :-1])
    anchors = head.anchors(24, 3)
    fast = head.prophet_loss(seq, hidden, anchors)
    start, tokens, labels = head.window_inputs(seq, hidden, anchors)
    S = head.num_start_tokens
    one_by_one = torch.stack([
        next_token_loss(head.prophet(tokens[i:i + 1], start=start[i:i + 1]).logits[:, S - 1:], labels[i:i + 1])
        for i in range(len(tokens))]).mean()
    torch.testing.assert_close(fast, one_by_one, rtol=1e-5, atol=1e-5)


def test_head_drafts_at_decoding_from_exactly_what_it_is_trained_on(targets):
    # the target's cache ends at anchor t, x[t+1] is pending; the head reads the cached hidden
    # states of t-S+1..t and x[t+1] and predicts x[t+2], as the training window at t does
    target = targets["llama"]
    head = head_for(target).eval()
    seq = torch.randint(0, V, (1, 21))
    t = 11
    with torch.no_grad():
        hidden, _ = head.target_hidden(seq[:, :-1])
        start, tokens, _ = head.window_inputs(seq, hidden, torch.tensor([[t]]))
        trained = head.prophet(tokens, start=start).logits[0, 2]
        dec = HFDecoder(target, slack=0)
        cache = dec.new_cache(1, 32, keep_embeds=True)
        dec(seq[:, : t + 4], cache=cache)
        cache.rollback(torch.tensor([t + 1]))                 # as after a verify that kept t + 1 tokens
        decoded = head.prophet(seq[:, t + 1: t + 2], start=head.start_tokens(cache.last_embeds(2))).logits[0, -1]
    torch.testing.assert_close(decoded, trained, rtol=1e-5, atol=1e-5)


def target_samples(target, n, length, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, V, (n, 3), generator=g)
    tokens, _ = generate(target, prompts, length, sampling=SamplingConfig(temperature=1.0), generator=g)
    return torch.cat([prompts, torch.stack(tokens)], 1)


@pytest.fixture(scope="module")
def trained_heads(targets):
    """A head per target, trained briefly on the target's samples, so it agrees with the target
    part of the time (a random head almost never does)."""
    heads = {}
    torch.set_num_threads(1)
    for arch, target in targets.items():
        head = head_for(target, seed=3)
        opt = torch.optim.Adam(head.parameters(), lr=3e-3)
        data = target_samples(target, 64, 29, seed=7)                     # (64, 32)
        g = torch.Generator().manual_seed(0)
        for _ in range(120):
            seq = data[torch.randint(0, len(data), (16,), generator=g)]
            loss = head.loss(seq)
            opt.zero_grad()
            loss.backward()
            opt.step()
        heads[arch] = head.eval()
    return heads


@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_greedy_prophet_decoding_of_an_hf_target_matches_its_own_generate(targets, trained_heads, arch):
    target, head = targets[arch], trained_heads[arch]
    prompts = ragged_prompts()
    alone, batched = hf_greedy(target, prompts, 24)
    assert batched == alone
    for gamma in (1, 4):
        got, stats = generate(target, prompts, 24, HeadDrafter(head), sampling=GREEDY, gamma=gamma)
        assert [t.tolist() for t in got] == alone
        assert 0.0 < stats.acceptance_rate < 1.0               # ragged acceptance really happened
    one, _ = generate(target, [prompts[1]], 24, HeadDrafter(head), sampling=GREEDY, gamma=3)
    assert one[0].tolist() == alone[1]                         # batch 1


def test_training_the_head_raises_its_acceptance(targets, trained_heads):
    target = targets["llama"]
    prompts = ragged_prompts(seed=9)
    _, fresh = generate(target, prompts, 24, HeadDrafter(head_for(target, seed=3)), sampling=GREEDY, gamma=4)
    _, trained = generate(target, prompts, 24, HeadDrafter(trained_heads["llama"]), sampling=GREEDY, gamma=4)
    assert trained.acceptance_rate > fresh.acceptance_rate + 0.2


def test_each_row_alone_gives_the_tokens_it_gives_in_a_batch(targets, trained_heads):
    target, head = targets["neox"], trained_heads["neox"]
    prompts = ragged_prompts(seed=5, lengths=(4, 11, 2, 7, 1, 5))
    g = torch.Generator().manual_seed(0)
    batch, _ = generate(target, prompts, 30, HeadDrafter(head), sampling=GREEDY, gamma=5, generator=g)
    for i, p in enumerate(prompts):
        alone, _ = generate(target, [p], 30, HeadDrafter(head), sampling=GREEDY, gamma=5)
        assert alone[0].tolist() == batch[i].tolist()


# ---------------------------------------------------------------- bad input

def test_a_head_with_another_target_or_vocabulary_is_refused_in_one_line(targets, tmp_path):
    head = head_for(targets["llama"])
    other = build(tmp_path / "other", "llama", 5, 30.0)         # same sizes, other weights
    prompt = torch.tensor([[1, 2, 3]])
    for kw, message in ((dict(target=other), "another target"),
                        (dict(target=targets["llama"], vocab_size=90), "vocabulary")):
        with pytest.raises(SpecdecError, match=message) as err:
            generate(prompt=prompt, max_new_tokens=4, drafter=HeadDrafter(head), **kw)
        assert "\n" not in str(err.value)
    with pytest.raises(SpecdecError, match="hidden size"):
        HFProphet(head.config, targets["neox"])
