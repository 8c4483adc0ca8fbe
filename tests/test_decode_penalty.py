"""Repetition penalty: the same processing as transformers' RepetitionPenaltyLogitsProcessor,
greedy speculative decoding equal to greedy plain decoding (and to a slow reference loop), and
losslessness with the penalty depending on drafted tokens (chi-square)."""

import pytest
import torch

from test_decode import chi_square_p_value, ragged_prompts, tiny, tiny_prophet, toy_pair

from specdec_models import SpecdecError
from specdec_models.decode import GREEDY, DraftModel, HeadDrafter, generate
from specdec_models.sampling import SamplingConfig, process_logits, to_probs


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def seen_mask(ids, vocab):
    return torch.zeros(ids.shape[0], vocab, dtype=torch.bool).scatter_(1, ids, True)


@pytest.mark.parametrize("penalty", [1.3, 0.6, 2.0])
def test_penalty_equals_transformers_repetition_penalty_processor(penalty):
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (4, 12), generator=g)
    scores = torch.randn(4, 50, generator=g) * 3
    expected = transformers.RepetitionPenaltyLogitsProcessor(penalty)(ids, scores.clone())
    cfg = SamplingConfig(temperature=1.0, repetition_penalty=penalty)
    got = process_logits(scores, cfg, seen_mask(ids, 50))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # then temperature, as transformers' processors run before its warpers
    hot = process_logits(scores, SamplingConfig(temperature=0.7, repetition_penalty=penalty), seen_mask(ids, 50))
    torch.testing.assert_close(hot, expected / 0.7)
    greedy = to_probs(scores, SamplingConfig(temperature=0, repetition_penalty=penalty), seen_mask(ids, 50))
    assert greedy.argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_penalty_needs_the_context_and_a_positive_value():
    with pytest.raises(SpecdecError, match="needs the context"):
        process_logits(torch.randn(2, 5), SamplingConfig(repetition_penalty=1.2))
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(SpecdecError, match="repetition_penalty must be a number > 0"):
            SamplingConfig(repetition_penalty=bad)
    # 1 and None are no penalty: no context needed
    x = torch.randn(2, 5)
    torch.testing.assert_close(process_logits(x, SamplingConfig(repetition_penalty=1)), x)


def reference_greedy(target, prompt, n, penalty):
    """Plain greedy decoding by full forwards, the penalty computed from the explicit context."""
    seq = prompt.tolist()
    cfg = SamplingConfig(temperature=0, repetition_penalty=penalty)
    for _ in range(n):
        logits = target(torch.tensor([seq])).logits[0, -1]
        seen = torch.zeros(target.vocab_size, dtype=torch.bool)
        seen[seq] = True
        seq.append(int(to_probs(logits, cfg, seen).argmax()))
    return seq[prompt.numel():]


@pytest.mark.parametrize("method", ["draft", "prophet"])
def test_greedy_speculative_with_penalty_equals_greedy_base_and_the_reference(method):
    mp = tiny_prophet(sharpen=6.0)
    target = mp.model
    drafter = DraftModel(tiny(dim=16, depth=1, seed=3, sharpen=6.0)) if method == "draft" else HeadDrafter(mp)
    penalised = SamplingConfig(temperature=0, repetition_penalty=1.5)
    prompts = ragged_prompts()
    with torch.no_grad():
        expected = [reference_greedy(target, p, 25, 1.5) for p in prompts]
    base, _ = generate(target, prompts, 25, sampling=penalised)
    assert [t.tolist() for t in base] == expected
    unpenalised, _ = generate(target, prompts, 25, sampling=GREEDY)
    assert [t.tolist() for t in unpenalised] != expected          # the penalty changes the text
    for gamma in (1, 3, 5):
        got, stats = generate(target, prompts, 25, drafter, sampling=penalised, gamma=gamma)
        assert [t.tolist() for t in got] == expected
        assert stats.drafted > 0


def exact_joint_penalised(target, prompt, n_tokens, cfg, drafted_tokens_count=True):
    """Probability of every continuation of n_tokens under the processed target, by enumeration;
    position j is penalised for the prompt and the continuation's first j tokens (or, with
    drafted_tokens_count=False, wrongly, for the prompt alone)."""
    vocab = target.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(vocab)] * n_tokens)              # (vocab^n, n)
    x = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = target(x[:, :-1]).logits[:, prompt.numel() - 1:]               # (N, n, vocab)
    seen = torch.zeros(len(seqs), n_tokens, vocab, dtype=torch.bool)
    seen[:, :, prompt] = True
    if drafted_tokens_count:
        for j in range(1, n_tokens):
            seen[:, j] |= seen[:, j - 1]
            seen[torch.arange(len(seqs)), j, seqs[:, j - 1]] = True
    probs = to_probs(logits, cfg, seen)
    return probs.gather(-1, seqs[..., None])[..., 0].prod(-1)


PENALTIES = [dict(temperature=0.8, repetition_penalty=1.8), dict(temperature=1.2, top_k=4, repetition_penalty=0.6)]


@pytest.mark.parametrize("method", ["draft", "prophet"])
@pytest.mark.parametrize("setting", PENALTIES, ids=["t0.8-rp1.8", "t1.2-topk4-rp0.6"])
def test_speculative_sampling_with_penalty_is_lossless_chi_square(method, setting):
    # As test_decode's chi-square test: vocabulary 6, position-dependent toy models, 3 emitted
    # tokens (216 outcomes), 6,000 samples, gamma 2, threshold p < 1e-4 (a correct sampler fails
    # at most once in 10^4 runs; the seeds are fixed). The prompt holds 2 of the 6 ids, so the
    # penalty at tokens 2 and 3 depends on the tokens drafted before them.
    vocab, n_tokens, n = 6, 3, 6000
    target, drafter = toy_pair(method, vocab)
    prompt = torch.tensor([1, 4, 1])
    cfg = SamplingConfig(**setting)
    g = torch.Generator().manual_seed(4321)
    tokens, stats = generate(target, prompt.expand(n, -1), n_tokens, drafter, sampling=cfg, gamma=2, generator=g)
    index = (torch.stack(tokens) * torch.tensor([vocab ** 2, vocab, 1])).sum(1)
    observed = torch.bincount(index, minlength=vocab ** n_tokens).float()
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_p_value(observed, exact_joint_penalised(target, prompt, n_tokens, cfg), n) > 1e-4
    # the test can tell: penalising for the prompt alone (drafted tokens ignored) is another law
    wrong = exact_joint_penalised(target, prompt, n_tokens, cfg, drafted_tokens_count=False)
    assert chi_square_p_value(observed, wrong, n) < 1e-20


def test_penalty_context_follows_each_row_through_a_ragged_batch_with_dropped_rows():
    # rows stop at an EOS at different steps (finished rows leave the batch); every row must
    # still get exactly the tokens it gets alone
    target = tiny(sharpen=6.0)
    draft = tiny(dim=16, depth=1, seed=3, sharpen=6.0)
    prompts = ragged_prompts()
    plain = [t.tolist() for t in generate(target, prompts, 30,
                                          sampling=SamplingConfig(temperature=0, repetition_penalty=1.4))[0]]
    eos = plain[2][4]
    got, _ = generate(target, prompts, 30, DraftModel(draft),
                      sampling=SamplingConfig(temperature=0, repetition_penalty=1.4), gamma=4, eos_id=eos)
    for prompt, row in zip(prompts, got, strict=True):
        alone, _ = generate(target, [prompt], 30, sampling=SamplingConfig(temperature=0, repetition_penalty=1.4),
                            eos_id=eos)
        assert row.tolist() == alone[0].tolist()
    assert len(got[2]) <= 5
