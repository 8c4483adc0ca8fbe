"""Configs, the decoder and the prophet's joint loss."""

import json

import pytest
import torch

from specdec_models import Decoder, ModelConfig, ModelWithProphet, ProphetConfig, SpecdecError
from specdec_models.losses import next_token_loss


def small_pair(S=2, L=5, prophet_depth=2, windows_per_seq=None, detach=False):
    torch.manual_seed(0)
    return ModelWithProphet(
        ModelConfig(vocab_size=64, dim=48, depth=2, heads=3, dim_head=16, max_seq_len=128),
        ProphetConfig(model=ModelConfig(vocab_size=64, dim=32, depth=prophet_depth, heads=2, dim_head=16,
                                        max_seq_len=32),
                      prophet_train_length=L, num_leading_start_tokens=S, windows_per_seq=windows_per_seq,
                      detach_embeds=detach))


def test_configs_round_trip_through_json():
    cfg = ProphetConfig(model=ModelConfig(dim=64, depth=1), prophet_train_length=6, windows_per_seq=8)
    assert ProphetConfig.from_json(cfg.to_json()) == cfg
    assert ModelConfig.from_dict(json.loads(ModelConfig(dim=128).to_json())) == ModelConfig(dim=128)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dim=0), "model.dim"), (dict(depth=-1), "model.depth"), (dict(dim_head=15), "even"),
    (dict(heads=2.5), "model.heads"), (dict(vocab_size=True), "vocab_size"),
])
def test_bad_model_config_is_a_one_line_error(kwargs, message):
    with pytest.raises(SpecdecError, match=message):
        ModelConfig(**kwargs)


def test_unknown_config_field_is_an_error():
    with pytest.raises(SpecdecError, match="unknown field"):
        ModelConfig.from_dict({"dim": 64, "width": 3})


def test_prophet_window_must_fit_the_prophet_context():
    with pytest.raises(SpecdecError, match="max_seq_len"):
        ProphetConfig(model=ModelConfig(max_seq_len=4), prophet_train_length=7, num_leading_start_tokens=2)


def test_prophet_vocabulary_must_match():
    with pytest.raises(SpecdecError, match="vocabulary"):
        ModelWithProphet(ModelConfig(vocab_size=10, dim=32, depth=1, heads=2, dim_head=16),
                         ProphetConfig(model=ModelConfig(vocab_size=11, dim=32, depth=1, heads=2, dim_head=16)))


def test_feed_forward_block_is_applied_in_every_layer():
    m = Decoder(ModelConfig(vocab_size=16, dim=32, depth=2, heads=2, dim_head=16))
    x = torch.randint(0, 16, (1, 8))
    before = m(x).logits
    with torch.no_grad():
        m.layers[1].ff[2].bias.add_(1.0)
    assert not torch.allclose(before, m(x).logits)


@pytest.mark.parametrize("S, L, depth", [(1, 4, 1), (2, 5, 2), (3, 6, 1), (2, 7, 3)])
def test_batched_prophet_loss_equals_running_the_prophet_on_each_window(S, L, depth):
    m = small_pair(S=S, L=L, prophet_depth=depth)
    seq = torch.randint(0, 64, (3, 33))
    h = m.model.hidden(seq[:, :-1])
    anchors = m.anchors(32, 3)
    assert anchors.shape == (3, 32 - L - S + 2)
    fast = m.prophet_loss(seq, h, anchors)
    start, tokens, labels = m.window_inputs(seq, h, anchors)
    one_by_one = torch.stack([
        next_token_loss(m.prophet(tokens[i:i + 1], start=start[i:i + 1]).logits[:, S - 1:], labels[i:i + 1])
        for i in range(len(tokens))]).mean()
    torch.testing.assert_close(fast, one_by_one, rtol=1e-5, atol=1e-5)


def test_prophet_sees_at_decoding_exactly_what_it_is_trained_on():
    # Decoding: the target's cache ends at anchor t, x[t+1] is pending; the prophet reads the
    # cached embeddings of t-S+1..t and x[t+1] and predicts x[t+2]. Training window at t: the same.
    m = small_pair(S=2, L=5).eval()
    seq = torch.randint(0, 64, (1, 21))
    t = 11
    with torch.no_grad():
        h = m.model.hidden(seq[:, :-1])
        start, tokens, _ = m.window_inputs(seq, h, torch.tensor([[t]]))
        trained = m.prophet(tokens, start=start).logits[0, 2]            # position S: predicts x[t+2]
        cache = m.model.new_cache(1, 32, keep_embeds=True)
        m.model(seq[:, : t + 1], cache=cache)
        decode_start = m.start_tokens(cache.last_embeds(2))
        decoded = m.prophet(seq[:, t + 1: t + 2], start=decode_start).logits[0, -1]
    torch.testing.assert_close(decoded, trained, rtol=1e-5, atol=1e-5)


def test_joint_loss_trains_both_models_and_detach_stops_the_prophet_gradient_at_the_embeddings():
    seq = torch.randint(0, 64, (2, 33))
    for detach in (False, True):
        m = small_pair(detach=detach)
        out = m(seq)
        torch.testing.assert_close(out.loss, out.main_loss + out.prophet_loss)
        out.prophet_loss.backward()
        main_grad = m.model.layers[0].to_qkv.weight.grad
        reached = main_grad is not None and bool(main_grad.abs().sum() > 0)
        assert reached is (not detach)
        assert m.prophet.layers[0].to_qkv.weight.grad.abs().sum() > 0


def test_windows_per_seq_samples_distinct_random_anchors():
    m = small_pair(windows_per_seq=4)
    g = torch.Generator().manual_seed(0)
    a = m.anchors(32, 3, generator=g)
    assert a.shape == (3, 4)
    assert all(len(set(row.tolist())) == 4 for row in a)
    assert int(a.min()) >= 1 and int(a.max()) <= 32 - 5
    assert not torch.equal(a, m.anchors(32, 3, generator=g))


def test_windows_inside_each_rows_real_tokens_are_drawn_first():
    """A regenerated row is padded after its answer: with valid_len, every window's labels (anchor
    + 1 .. anchor + L) lie before it while the row has windows_per_seq such windows; a row with
    fewer keeps all of them and fills up with the others."""
    m = small_pair(windows_per_seq=4)                        # S = 2 start tokens, L = 5: anchors 1 .. 27
    L = m.prophet_cfg.prophet_train_length
    valid = torch.tensor([33, 12, 8])                        # whole row; 6 real windows (anchors 1..6); 2 (1..2)
    for seed in range(20):
        a = m.anchors(32, 3, generator=torch.Generator().manual_seed(seed), valid_len=valid)
        assert all(len(set(row.tolist())) == 4 for row in a)
        assert int(a[1].max()) + L < 12                      # row 1: every label real
        assert set(range(1, 3)) <= set(a[2].tolist())        # row 2: both real windows, then two others
    drawn = torch.cat([m.anchors(32, 3, generator=torch.Generator().manual_seed(s), valid_len=valid)[0]
                       for s in range(20)])
    assert int(drawn.max()) > 12                             # a full row still draws from all its windows


def test_sequence_too_short_for_a_window_is_an_error():
    m = small_pair(S=2, L=5)
    with pytest.raises(SpecdecError, match="too short"):
        m(torch.randint(0, 64, (1, 5)))


def test_joint_training_lowers_both_losses_on_a_repetitive_sequence():
    m = small_pair()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    seq = torch.arange(64).repeat(1, 3)[:, :65] % 64
    first = m(seq)
    for _ in range(30):
        out = m(seq)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert out.main_loss < 0.5 * first.main_loss and out.prophet_loss < 0.5 * first.prophet_loss


def test_drafted_hits_count_top_one_matches_at_drafted_positions_only():
    from specdec_models.heads.prophet import drafted_hits, simulated_tokens_per_call

    labels = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0]])           # (W=3, L=4)
    right = torch.nn.functional.one_hot(labels, 5).float()                       # argmax == label everywhere
    logits = right.clone()
    logits[0, 2] = torch.nn.functional.one_hot(torch.tensor(0), 5)               # window 0 misses output 2
    logits[1, 0] = torch.nn.functional.one_hot(torch.tensor(0), 5)               # output 0 is never drafted
    logits[2, 1] = torch.nn.functional.one_hot(torch.tensor(3), 5)
    assert drafted_hits(logits, labels, 3).tolist() == [2, 2, 3]
    assert drafted_hits(logits, labels, 1).tolist() == [2]
    with pytest.raises(SpecdecError, match="gamma"):
        drafted_hits(logits, labels, 4)                                          # output L-1 is the last
    # 1 + a1 + a1 a2 + a1 a2 a3, by hand
    assert simulated_tokens_per_call([0.5, 0.5, 1.0]) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    assert simulated_tokens_per_call([1.0] * 5) == 6.0 and simulated_tokens_per_call([0.0, 1.0]) == 1.0


def test_joint_forward_returns_the_windows_logits_its_prophet_loss_is_made_of():
    m = small_pair()
    seq = torch.randint(0, 64, (2, 20))
    out = m(seq)
    assert out.prophet_logits.shape[:2] == out.labels.shape == (2 * m.prophet_cfg.anchor_count(19), 5)
    torch.testing.assert_close(out.prophet_loss, next_token_loss(out.prophet_logits, out.labels))
