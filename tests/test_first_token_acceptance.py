"""train.bench.acceptance: the expected acceptance of recursive rejection sampling against an exact
enumeration, the first-token measures' bounds on a tiny random target and head, and the
command's bad input (one line, exit 2, before any model loads)."""

import itertools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import command
from test_eagle3 import head_for, make_toy
from test_hf_decode import (
    V,
    _one_thread,  # noqa: F401  (autouse here too: offline, one thread)
    build,
)

from specdec_models import SpecdecError
from train.bench.acceptance import first_token_acceptance, heldout_acceptance, rrs_acceptance, rrs_acceptance_rows


def exact_rrs(p: list[float], q: list[float], k: int) -> float:
    """P(accept) of k candidates drawn from q without replacement, recursive rejection sampling
    against p, by enumerating every ordered draw."""
    total = 0.0
    for draw in itertools.permutations(range(len(q)), k):
        chance, p_i, q_i, missed, accepted = 1.0, list(p), list(q), 1.0, 0.0
        for x in draw:
            mass = sum(q_i)
            if mass <= 0:
                break
            q_i = [v / mass for v in q_i]
            chance *= q_i[x]
            accept = min(1.0, p_i[x] / q_i[x]) if q_i[x] > 0 else 0.0
            accepted += missed * accept
            missed *= 1 - accept
            left = [max(0.0, a - b) for a, b in zip(p_i, q_i, strict=True)]
            p_i = [v / sum(left) for v in left] if sum(left) > 0 else p_i
            q_i[x] = 0.0
        total += chance * accepted
    return total


@pytest.mark.parametrize("k", [1, 2, pytest.param(3, marks=pytest.mark.slow)])   # k=3: about 8 s
def test_rrs_acceptance_matches_an_exact_enumeration(k):
    # each draw's value lies in [0, 1] (sd <= 0.5): with 4,000 draws the standard error is <= 0.0079,
    # so a tolerance of 0.04 (5 standard errors) fails a correct estimator less than once in 10^6 runs
    p = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.5, 0.05, 0.3, 0.05])
    want = exact_rrs(p.tolist(), q.tolist(), k)
    got = rrs_acceptance(p, q, k, 4000, torch.Generator().manual_seed(0))
    assert abs(got - want) < 0.04, (got, want)
    rows = rrs_acceptance_rows(torch.stack([p, q]), torch.stack([q, q]), k, 4000, torch.Generator().manual_seed(1))
    assert abs(float(rows[0]) - want) < 0.04, (rows, want)          # the same bound, row by row
    assert float(rows[1]) == pytest.approx(1.0)                     # q against itself: always accepted
    if k == 1:
        assert want == pytest.approx(float(torch.minimum(p, q).sum()))
    if k == 3:
        assert want > exact_rrs(p.tolist(), q.tolist(), 1) + 0.1     # more candidates, more accepted


def test_a_head_equal_to_the_target_is_always_accepted():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert rrs_acceptance(p, p.clone(), 2, 50) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build(tmp_path_factory.mktemp("acc") / "llama", "llama", 1, 8.0)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory.mktemp("toy"))


def test_first_token_measures_are_probabilities_within_their_bounds(target):
    prompts = [torch.tensor([1, 4, 2, 9]), torch.tensor([3, 3, 0])]
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:40].sort().values
    head = head_for(target, seed=2, draft=40, ids=ids)
    m = first_token_acceptance(target, head, prompts, max_new_tokens=12, k=3, draws=4, taus=(0.5,))
    assert m["positions"] == 2 * 11                  # every answer token after the first is drafted for
    assert set(m) == {"positions", "target_top_1", "mass_in_vocab", "drawn_1", "top_1", "drawn_3", "top_3",
                      "drawn_1/tau0.5", "rounds", "decoded_1", "round_drawn_1", "round_logit_error",
                      "round_kept_token", "round_kept_block"}
    assert 0 < m["round_kept_token"] <= 4 and 0 < m["round_kept_block"] <= 4          # chains of gamma 4
    assert 2 <= m["rounds"] <= m["positions"] and 0 <= m["decoded_1"] <= 1 and 0 < m["round_drawn_1"] < 1
    assert m["round_logit_error"] < 1e-4             # the head's cache in decoding is the teacher-forced one
    assert 0 < m["top_1"] <= m["top_3"] <= m["mass_in_vocab"] < 1
    assert 0 < m["drawn_1"] <= m["drawn_3"] <= m["mass_in_vocab"]
    assert m["top_1"] <= m["target_top_1"]
    full = first_token_acceptance(target, head_for(target, seed=2), prompts, max_new_tokens=6, draws=2)
    assert full["mass_in_vocab"] == pytest.approx(1.0)
    with pytest.raises(SpecdecError, match="is for sampling"):
        first_token_acceptance(target, head, prompts, temperature=0.0)


def test_heldout_acceptance_reads_each_unroll_steps_prediction_against_the_cached_target(target):
    # a cache batch made here: the hidden states of layers [0, 1, 2] and the last, answer tokens from 4 on
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:40].sort().values
    head = head_for(target, seed=3, draft=40, layers=[0, 1, 2], ids=ids).float()
    tokens = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(2))
    last_layer = head.config.target_layers
    with torch.no_grad():
        states = target(input_ids=tokens[:, :-1], output_hidden_states=True).hidden_states
    layers = [0, 1, 2, last_layer]
    rows = {"tokens": tokens, "embeds": torch.cat([states[i] for i in layers], -1),
            "prompt_len": torch.tensor([4, 6]), "valid_len": torch.tensor([13, 11])}
    got = heldout_acceptance(head, rows, layers, steps=2, k=3, draws=4, taus=(0.5,))
    assert [r["step"] for r in got] == [0, 1]
    # step k's head position t (0..10 - k) predicts token t + 2 + k, counted in [prompt_len, valid_len):
    # step 0: t in 2..10 and 4..8; step 1: t in 1..9 and 3..7
    assert [r["positions"] for r in got] == [9 + 5, 9 + 5]
    with torch.no_grad():
        aux = torch.cat([states[i] for i in [0, 1, 2]], -1)
        full = torch.nn.functional.linear(states[last_layer], target.get_output_embeddings().weight[:V]).float()
        for step, logits in enumerate(head.ttt_logits(tokens, aux, 2)):
            overlap = []
            for b, (start, end) in enumerate([(4, 13), (6, 11)]):
                for t in range(logits.shape[1]):
                    if start <= t + 2 + step < end:
                        p = torch.softmax(full[b, t + 1 + step], -1)
                        q = torch.softmax(head.to_target_vocab(logits[b, t].float()), -1)
                        overlap.append(float(torch.minimum(p, q).sum()))
            assert got[step]["drawn_1"] == pytest.approx(sum(overlap) / len(overlap), rel=1e-4)
    for r in got:
        # drawn_3 is a Monte Carlo mean of exact acceptances given the drawn candidates: one draw's can
        # exceed the mass in the vocabulary (only the expectation cannot), so its bounds are [0, 1]
        assert 0 < r["drawn_1"] <= r["mass_in_vocab"] < 1 and 0 < r["drawn_3"] <= 1
        assert 0 < r["drawn_1/tau0.5"] < 1 and r["H_p"] > 0 and r["H_q"] > 0


@pytest.mark.parametrize("args, message", [
    (["--prompts", "x.jsonl"], "acceptance needs --eagle3 NAME=DIR"),
    (["--eagle3", "a=b", "--prompts", "x.jsonl", "--temperatures", "0"], "a --temperatures value > 0"),
    (["--eagle3", "a=b", "--prompts", "x.jsonl", "--draws", "0"], "--candidates and --draws must be >= 1"),
    (["--eagle3", "a=b", "--prompts", "nowhere.jsonl"], "--prompts nowhere.jsonl does not exist"),
])
def test_the_acceptance_command_refuses_bad_input_in_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.jsonl").write_text('{"text": "hi"}\n')
    assert command("compare_hf_drafts").main(["acceptance", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--eagle3", "a=b"], "heldout needs --cache CACHE_DIR"),
    (["--cache", "c"], "heldout needs --eagle3 NAME=DIR"),
    (["--cache", "c", "--eagle3", "a=b", "--taus", "0"], "--taus must be > 0"),
    (["--cache", "c", "--eagle3", "a=b", "--steps", "0"], "--val-windows and --steps must be >= 1"),
])
def test_the_heldout_command_refuses_bad_input_in_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "cache.json").write_text("{}")
    assert command("compare_hf_drafts").main(["heldout", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow     # about 16 s on 2 cores; in the default run the enumerations above check the formula exactly
def test_a_chains_first_draft_is_accepted_as_often_as_its_overlap_at_the_round_starts(toy):
    # decoded_1 (accepted first drafts / rounds) estimates round_drawn_1 (the mean of sum min(p, q)
    # at the same round starts): each round accepts with its own probability, so the difference has
    # a standard deviation of at most 0.5 / sqrt(rounds); 5 of them fail a right sampler less than
    # once in 10^6 runs. Verification testing u < p / (q / 2) instead (accepting too readily) moved
    # decoded_1 by 0.12 here, past the tolerance (0.08).
    target, head = toy
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 8, (int(n),), generator=g) for n in torch.randint(1, 6, (150,), generator=g)]
    m = first_token_acceptance(target, head, prompts, max_new_tokens=10, draws=1, taus=(), gamma=2)
    assert m["rounds"] >= 400 and 0.1 < m["round_drawn_1"] < 0.9
    assert abs(m["decoded_1"] - m["round_drawn_1"]) < 5 * 0.5 / m["rounds"] ** 0.5, m
    assert m["round_logit_error"] < 1e-4
