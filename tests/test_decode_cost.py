"""The cost model (`specdec_models.decode.cost`): expected tokens per call, step times recorded
inside generate, cost ratios, the micro-benchmark, and `DecodeStats.merge`."""

import copy

import pytest
import torch

from test_decode import perturbed, ragged_prompts, tiny, tiny_prophet

from specdec_models.decode import GREEDY, DecodeStats, DraftModel, HeadDrafter, generate
from specdec_models.decode.cost import (
    DRAFT,
    PREFILL,
    TARGET,
    SpeedProfile,
    StepTimes,
    choose_gamma,
    cost_ratios,
    expected_tokens,
    expected_tokens_from_acceptance,
    measure_costs,
    predicted_speedup,
    verify_key,
)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def test_closed_form_equals_the_per_position_sum_under_iid_acceptance():
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for gamma in (1, 4, 8):
            ppa = [alpha ** k for k in range(1, gamma + 1)]      # i.i.d.: all of the first k accepted
            assert expected_tokens(alpha, gamma) == pytest.approx(expected_tokens_from_acceptance(ppa, gamma))
    # DECODING.md's example: alpha 0.8, gamma 8, c 0.05, v 1 -> about 3.1x
    assert predicted_speedup(expected_tokens(0.8, 8), 8, 0.05, 1.0) == pytest.approx(3.09, abs=0.01)


def test_expected_tokens_from_acceptance_refuses_too_few_positions():
    with pytest.raises(ValueError, match="covers 2 positions"):
        expected_tokens_from_acceptance([0.9, 0.8], 3)


def test_timing_records_every_model_call_of_each_kind():
    target, draft = tiny(sharpen=2.0), tiny(dim=16, depth=1, seed=3, sharpen=2.0)
    prompts = ragged_prompts()
    _, base = generate(target, prompts, 12, timing=True)
    t = base.step_times
    assert t.calls[PREFILL] == 1 and t.calls[TARGET] == 11 and base.target_calls == 12
    assert all(s > 0 for s in t.seconds.values())
    _, spec = generate(target, prompts, 30, DraftModel(draft), gamma=3, timing=True)
    t = spec.step_times
    rounds = spec.target_calls - 1
    assert t.calls[PREFILL] == 2                        # target and draft prefill
    calls = lambda key: t.calls.get(key, 0) + t.calls.get("tail/" + key, 0)  # noqa: E731  (rows end apart)
    assert calls(verify_key(3)) == rounds and calls(DRAFT) == 3 * rounds
    c, v = cost_ratios(t, base.step_times)
    assert c > 0 and set(v) == {3} and v[3] > 0
    _, untimed = generate(target, prompts, 5)
    assert untimed.step_times is None


def test_prophet_rounds_time_gamma_prophet_steps():
    mp = tiny_prophet(sharpen=2.0)
    _, stats = generate(mp.model, ragged_prompts(), 20, HeadDrafter(mp), gamma=4, timing=True)
    rounds = stats.step_times.calls[verify_key(4)]
    assert stats.step_times.calls[DRAFT] == 4 * rounds
    # the prompt of length 1 needs one plain step before the prophet has its 2 start tokens
    assert stats.step_times.calls[TARGET] == 1


def test_measure_costs_times_target_verify_and_draft_steps():
    mp = tiny_prophet()
    times = measure_costs(mp.model, 2, 10, [1, 3], HeadDrafter(mp), steps=4, warmup=1)
    assert times.calls == {TARGET: 4, verify_key(1): 4, verify_key(3): 4, DRAFT: 4}
    c, v = cost_ratios(times)
    assert c > 0 and set(v) == {1, 3}
    times = measure_costs(mp.model, 1, 10, [2], DraftModel(tiny(dim=16, depth=1)), steps=2, warmup=0)
    assert times.calls[DRAFT] == 2


def test_merged_stats_add_the_counts_and_derive_the_rates_again():
    target = tiny(sharpen=2.0)
    draft = perturbed(target, 0.05)
    g = torch.Generator().manual_seed(0)
    parts = [generate(target, ragged_prompts(seed=s), n, DraftModel(draft), gamma=gamma, generator=g, timing=True)[1]
             for s, n, gamma in ((1, 20, 3), (2, 31, 3), (3, 9, 5))]
    m = DecodeStats.merge(parts)
    assert m.method == "draft" and m.batch == 5 and m.gamma is None          # gammas differ
    for name in ("new_tokens", "target_calls", "row_calls", "drafted", "accepted"):
        assert getattr(m, name) == sum(getattr(s, name) for s in parts)
    assert m.wall_seconds == pytest.approx(sum(s.wall_seconds for s in parts))
    assert m.tokens_per_second == pytest.approx(m.new_tokens / m.wall_seconds)
    assert m.acceptance_rate == pytest.approx(m.accepted / m.drafted)
    assert m.alpha == pytest.approx(sum(s.alpha_sum for s in parts) / sum(s.alpha_count for s in parts))
    # positions 4 and 5 were drafted by the gamma-5 call alone
    assert len(m.per_position_acceptance) == 5
    assert m.per_position_acceptance[4] == pytest.approx(parts[2].per_position_acceptance[4])
    first = sum(s.accepted_at[0] for s in parts) / sum(s.drafted_at[0] for s in parts)
    assert m.per_position_acceptance[0] == pytest.approx(first)
    assert m.step_times.calls[DRAFT] == sum(s.step_times.calls[DRAFT] for s in parts)
    assert m.step_times.calls[verify_key(3)] == parts[0].step_times.calls[verify_key(3)] + \
        parts[1].step_times.calls[verify_key(3)]


def test_merging_stats_of_one_call_changes_nothing_and_mixed_methods_are_refused():
    target = tiny()
    _, s = generate(target, ragged_prompts(), 7, DraftModel(tiny(dim=16, depth=1)), gamma=2)
    assert DecodeStats.merge([s]).to_dict() == s.to_dict()
    _, base = generate(target, ragged_prompts(), 7)
    with pytest.raises(ValueError, match="different methods"):
        DecodeStats.merge([s, base])


def test_step_times_merge_and_round_trip():
    a, b = StepTimes(), StepTimes()
    a.add(TARGET, 1.0)
    a.add(TARGET, 3.0)
    b.add(TARGET, 2.0)
    b.add(verify_key(4), 5.0)
    m = StepTimes.merge([a, None, b])
    assert m.mean(TARGET) == 2.0 and m.calls[verify_key(4)] == 1 and m.verify_gammas() == [4]
    assert StepTimes.from_dict(m.to_dict()) == m
    assert m.mean(DRAFT) is None
    with pytest.raises(ValueError, match="no draft step"):
        cost_ratios(m)


# ---------------------------------------------------------------- choosing gamma

def brute_force_best(ppa, c, v_full):
    """argmax over gamma of (1 + sum ppa[:gamma]) / (gamma c + v(gamma)), written out by hand."""
    best, best_s = None, -1.0
    for gamma in range(1, len(v_full) + 1):
        s = (1 + sum(ppa[:gamma])) / (gamma * c + v_full[gamma - 1])
        if s > best_s + 1e-12:
            best, best_s = gamma, s
    return best, best_s


def test_choose_gamma_is_the_brute_force_argmax():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 11, (1,), generator=g))
        # decreasing acceptance (a prophet's shape), sometimes i.i.d., sometimes flat
        steps = torch.rand(n, generator=g)
        ppa = torch.cumprod(steps if trial % 3 else torch.full((n,), float(steps[0])), 0).tolist()
        c = float(torch.rand(1, generator=g)) * 0.6
        v_full = (1 + torch.cumsum(torch.rand(n, generator=g) * 0.4, 0)).tolist()
        gamma, speedup = choose_gamma(ppa, c, {i + 1: v for i, v in enumerate(v_full)})
        assert (gamma, pytest.approx(speedup)) == brute_force_best(ppa, c, v_full)


def test_v_between_measured_gammas_is_interpolated_from_one_target_step():
    profile = SpeedProfile(0.1, {4: 2.0, 8: 3.0}, [0.9] * 8)
    assert [profile.v(g) for g in (1, 2, 4, 6, 8)] == [1.25, 1.5, 2.0, 2.5, 3.0]
    v_full = [profile.v(g) for g in range(1, 9)]
    assert profile.best_gamma() == brute_force_best([0.9] * 8, 0.1, v_full)[0]
    with pytest.raises(ValueError, match="up to gamma 8"):
        profile.v(9)


def test_best_gamma_stays_within_the_measurements_and_the_limit():
    flat = SpeedProfile(0.01, {1: 1.0, 2: 1.0, 3: 1.0, 12: 1.0}, [1.0] * 6)      # more is always better
    assert flat.gamma_max == 6 and flat.best_gamma() == 6 and flat.best_gamma(limit=4) == 4
    useless = SpeedProfile(0.3, {8: 2.0}, [0.0] * 8)
    assert useless.best_gamma() == 1 and useless.predicted(1) == pytest.approx(1 / (0.3 + 1.125))


def test_best_gamma_is_plain_decoding_when_no_gamma_beats_it():
    useless = SpeedProfile(0.3, {8: 2.0}, [0.0] * 8)
    assert useless.best_gamma(plain=True) == 0 and useless.predicted(0) == 1.0
    # batch 8 on a CPU: verify calls cost about a step per extra token; 0.53 acceptance does not pay
    batch8 = SpeedProfile(0.25, {1: 1.5, 2: 1.9, 4: 2.6}, [0.53, 0.34, 0.17, 0.07])
    assert max(batch8.predicted(g) for g in range(1, 5)) < 1 and batch8.best_gamma(plain=True) == 0
    # where one gamma pays, plain=True changes nothing
    good = SpeedProfile(0.05, {2: 1.2, 8: 1.9}, [0.9, 0.8, 0.7, 0.2, 0.1, 0.05, 0.0, 0.0])
    assert good.best_gamma(plain=True) == good.best_gamma() == 3 and good.predicted(3) > 1


def test_speed_profile_round_trips_through_json_and_refuses_nonsense():
    import json

    profile = SpeedProfile(0.2, {3: 1.4, 6: 1.9}, [0.8, 0.6, 0.5, 0.3, 0.2, 0.1], batch=8)
    assert SpeedProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    for bad, match in (((-0.1, {1: 1.0}, [0.5]), "c must"), ((0.1, {}, [0.5]), "v_by_gamma"),
                       ((0.1, {1: 1.0}, [1.5]), "per_position_acceptance"), ((0.1, {0: 1.0}, [0.5]), "v_by_gamma")):
        with pytest.raises(ValueError, match=match):
            SpeedProfile(*bad)


def test_calls_after_finished_rows_are_dropped_are_timed_apart_as_the_tail():
    # a row that meets its EOS early leaves the batch; the calls after that run on fewer rows, so
    # they are kept out of c and v (which describe the full batch) but still timed
    target = tiny(sharpen=4.0)
    prompts = ragged_prompts()
    plain = [t.tolist() for t in generate(target, prompts, 30, sampling=GREEDY)[0]]
    eos = plain[1][3]
    _, stats = generate(target, prompts, 30, DraftModel(tiny(dim=16, depth=1, seed=3, sharpen=4.0)), sampling=GREEDY,
                        gamma=3, eos_id=eos, timing=True)
    t = stats.step_times
    assert t.calls["tail/verify/3"] > 0 and t.calls["tail/draft"] == 3 * t.calls["tail/verify/3"]
    assert t.calls[verify_key(3)] + t.calls["tail/verify/3"] == stats.target_calls - 1
    assert t.verify_gammas() == [3]


# ---------------------------------------------------------------- gamma="auto" in generate

def never_agreeing_draft(target):
    draft = copy.deepcopy(target)
    with torch.no_grad():   # the draft always proposes target argmax + 1
        draft.to_logits.weight.copy_(target.to_logits.weight.roll(1, dims=0))
    return draft


def test_auto_gamma_with_a_profile_decodes_at_its_best_gamma_and_stays_exact():
    target = tiny(sharpen=4.0)
    draft = tiny(dim=16, depth=1, seed=3, sharpen=4.0)
    profile = SpeedProfile(0.05, {2: 1.2, 8: 1.9}, [0.9, 0.8, 0.7, 0.2, 0.1, 0.05, 0.0, 0.0])
    best = profile.best_gamma()
    got, stats = generate(target, ragged_prompts(), 30, DraftModel(draft), sampling=GREEDY, gamma="auto",
                          speed_profile=profile, timing=True)
    assert stats.gamma == best == 3
    assert stats.predicted_speedup == pytest.approx(profile.predicted(best))
    assert stats.speed_profile == profile.to_dict() and stats.measured_speedup is None
    assert set(stats.step_times.verify_gammas()) == {best}
    assert [t.tolist() for t in got] == [t.tolist() for t in generate(target, ragged_prompts(), 30, sampling=GREEDY)[0]]


def test_auto_gamma_calibrates_and_falls_back_to_plain_decoding_for_a_draft_that_never_agrees():
    # acceptance 0 at every position: E(gamma) = 1, so every gamma is predicted slower than plain
    target = tiny(sharpen=4.0)
    draft = never_agreeing_draft(target)
    got, stats = generate(target, ragged_prompts(), 40, DraftModel(draft), sampling=GREEDY, gamma="auto", timing=True)
    assert stats.gamma == 0 and stats.predicted_speedup == 1.0
    assert stats.speed_profile["per_position_acceptance"] == [0.0] * 8
    assert set(stats.speed_profile["v_by_gamma"]) == {"1", "2", "4", "8"}  # the calibration's gammas
    assert stats.step_times.calls[verify_key(8)] == 3                       # three passes
    assert stats.measured_speedup > 0
    # the 16 tokens of the prefill, 3 plain steps and 12 rounds (one token each) calibrate; the other
    # 24 are plain steps that no longer feed the draft
    _, calibrated = generate(target, ragged_prompts(), 16, DraftModel(draft), sampling=GREEDY, gamma="auto",
                             timing=True)
    assert calibrated.step_times.calls["target"] == 3
    assert stats.step_times.calls["target"] == 3 + 24
    assert stats.step_times.calls[DRAFT] == calibrated.step_times.calls[DRAFT]
    assert [t.tolist() for t in got] == [t.tolist() for t in generate(target, ragged_prompts(), 40, sampling=GREEDY)[0]]


def test_auto_gamma_with_a_profile_that_no_gamma_pays_decodes_plainly_and_stays_exact():
    target = tiny(sharpen=4.0)
    draft = tiny(dim=16, depth=1, seed=3, sharpen=4.0)
    profile = SpeedProfile(0.25, {1: 1.5, 2: 1.9, 4: 2.6}, [0.53, 0.34, 0.17, 0.07])
    got, stats = generate(target, ragged_prompts(), 30, DraftModel(draft), sampling=GREEDY, gamma="auto",
                          speed_profile=profile, timing=True)
    assert stats.gamma == 0 and stats.drafted == 0
    assert DRAFT not in stats.step_times.calls and not stats.step_times.verify_gammas()
    assert [t.tolist() for t in got] == [t.tolist() for t in generate(target, ragged_prompts(), 30, sampling=GREEDY)[0]]


def test_auto_gamma_for_a_prophet_stays_within_what_it_was_trained_for():
    mp = tiny_prophet(sharpen=4.0)          # prophet_train_length 6: gamma <= 5
    prompts = ragged_prompts()
    got, stats = generate(mp.model, prompts, 40, HeadDrafter(mp), sampling=GREEDY, gamma="auto")
    # an untrained prophet accepts nothing, so no gamma pays: 0 (plain decoding) is a valid choice
    assert 0 <= stats.gamma <= 5 and len(stats.speed_profile["per_position_acceptance"]) == 5
    assert stats.step_times is None          # calibration timed privately
    assert [t.tolist() for t in got] == [t.tolist() for t in generate(mp.model, prompts, 40, sampling=GREEDY)[0]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(gamma="fast"), "gamma must be an integer >= 1 or 'auto'"),
    (dict(gamma=4, speed_profile=SpeedProfile(0.1, {2: 1.2}, [0.5, 0.4])), "pass gamma='auto'"),
    (dict(gamma="auto", speed_profile={"c": 0.1}), "must be a cost.SpeedProfile"),
])
def test_bad_gamma_choice_gives_a_one_line_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny(), ragged_prompts(), 4, DraftModel(tiny(dim=16, depth=1)), **kwargs)


def test_calibration_covers_both_ends_and_the_middle_and_profiles_from_medians():
    from specdec_models.decode.speculative import calibration_gammas

    assert calibration_gammas(8) == [8, 1, 4, 2] * 3
    assert calibration_gammas(5) == [5, 1, 2] * 3 and calibration_gammas(1) == [1] * 3
    samples = {TARGET: [1.0, 1.1, 9.0], DRAFT: [0.2, 0.3, 5.0], verify_key(4): [2.0, 30.0, 2.2],
               "tail/" + verify_key(2): [0.1]}
    profile = SpeedProfile.from_samples(samples, [0.5] * 4, batch=2)
    assert profile.c == pytest.approx(0.3 / 1.1) and profile.v_by_gamma == {4: pytest.approx(2.2 / 1.1)}
