"""Block verification (`decode.block`) by exact enumeration: no sampling, so no error rate.

A round's output is lossless when the tokens it emits, continued by the target itself to a fixed
length, are distributed exactly as the target's own sequences of that length. On a 3-token
vocabulary with distributions that depend on the whole prefix, every draft chain (weighted by
q), every stopping point (weighted by its probability under the round's uniforms) and every next
token are enumerated, and the resulting distribution is compared with the target's.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec_models.decode.block import block_verify, block_weights

V = 3


class Tables:
    """Next-token distributions of a target (p) and a draft (q) that depend on the whole prefix."""

    def __init__(self, seed: int, concentration: float = 0.7):
        self.g = torch.Generator().manual_seed(seed)
        self.concentration = concentration
        self.tables: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def dist(self, who: str, prefix: tuple[int, ...]) -> torch.Tensor:
        if (who, prefix) not in self.tables:
            gamma = torch._standard_gamma(torch.full((V,), self.concentration, dtype=torch.float64), generator=self.g)
            self.tables[who, prefix] = gamma / gamma.sum()
        return self.tables[who, prefix]

    def p(self, prefix):
        return self.dist("p", tuple(prefix))

    def q(self, prefix):
        return self.dist("q", tuple(prefix))

    def target_prob(self, seq) -> float:
        return float(torch.tensor([self.p(seq[:i])[x] for i, x in enumerate(seq)], dtype=torch.float64).prod())


def block_outcomes(t: Tables, draft: tuple[int, ...]) -> list[tuple[float, tuple[int, ...]]]:
    """Every (probability, emitted tokens) of one block-verified round on `draft`."""
    g = len(draft)
    p = torch.stack([t.p(draft[:i]) for i in range(g + 1)])[None]
    q = torch.stack([t.q(draft[:i]) for i in range(g)])[None]
    _, h = block_weights(p, q, torch.tensor([draft]))
    h = [1.0] + h[0].tolist()                            # h[0]: keeping nothing needs no test
    out = []
    for tau in range(g + 1):
        prob = h[tau] * float(torch.tensor([1 - x for x in h[tau + 1:]], dtype=torch.float64).prod())
        if prob <= 0:
            continue
        # the next-token distribution block_verify draws from when the round stops at tau
        got_tau, final = _verify_at(p, q, draft, tau)
        assert got_tau == tau
        out += [(prob * float(final[y]), draft[:tau] + (y,)) for y in range(V) if final[y] > 0]
    return out


def _verify_at(p, q, draft, tau):
    """block_verify with uniforms that stop the round at tau: 0 at tau (its test passes where h > 0)
    and 1 elsewhere (no other test passes: h <= 1)."""
    g = len(draft)
    u = torch.ones(1, g, dtype=torch.float64)
    u[0, tau - 1] = 0.0 if tau else 1.0
    got, final = block_verify(p, q, torch.tensor([draft]), u)
    return int(got), final[0]


def token_outcomes(t: Tables, draft: tuple[int, ...]) -> list[tuple[float, tuple[int, ...]]]:
    """Every (probability, emitted tokens) of one token-verified round (Leviathan et al.) on `draft`."""
    out, alive = [], 1.0
    for i, x in enumerate(draft):
        p, q = t.p(draft[:i]), t.q(draft[:i])
        accept = min(1.0, float(p[x] / q[x]))
        rest = (p - q).clamp(min=0)
        if rest.sum() > 0:
            out += [(alive * (1 - accept) * float(rest[y] / rest.sum()), draft[:i] + (y,)) for y in range(V)]
        alive *= accept
    p = t.p(draft)
    return out + [(alive * float(p[y]), draft + (y,)) for y in range(V)]


def fixed_length(g):
    return lambda t, x: g


def floored(g, floor):
    """The tree's probability floor: the chain stops after the first draft whose cumulative q falls below `floor`."""
    def length(t, x):
        mass = 1.0
        for i in range(g):
            mass *= float(t.q(x[:i])[x[i]])
            if mass < floor:
                return i + 1
        return g
    return length


def round_distribution(t: Tables, g: int, length, outcomes) -> tuple[dict, float]:
    """The distribution of the first g + 1 tokens after one round (continued by the target), and
    the round's expected emitted tokens; drafts of `length(t, x)` tokens drawn from q."""
    final, expected, seen = {}, 0.0, set()
    for x in itertools.product(range(V), repeat=g):
        draft = x[: length(t, x)]
        if draft in seen:
            continue
        seen.add(draft)
        q_draft = float(torch.tensor([t.q(draft[:i])[draft[i]] for i in range(len(draft))], dtype=torch.float64).prod())
        for prob, emitted in outcomes(t, draft):
            expected += q_draft * prob * len(emitted)
            for tail in itertools.product(range(V), repeat=g + 1 - len(emitted)):
                seq = emitted + tail
                final[seq] = final.get(seq, 0.0) + q_draft * prob * t.target_prob(seq) / t.target_prob(emitted)
    return final, expected


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("g, length", [(2, fixed_length(2)), (3, fixed_length(3)), (4, floored(4, 0.25))],
                         ids=["g2", "g3", "g4-floored"])
def test_block_verification_is_exactly_lossless_and_keeps_at_least_token_verifications_tokens(seed, g, length):
    t = Tables(seed)
    block, block_tokens = round_distribution(t, g, length, block_outcomes)
    token, token_tokens = round_distribution(t, g, length, token_outcomes)
    for seq in itertools.product(range(V), repeat=g + 1):
        assert block.get(seq, 0.0) == pytest.approx(t.target_prob(seq), abs=1e-12)
        assert token.get(seq, 0.0) == pytest.approx(t.target_prob(seq), abs=1e-12)
    assert block_tokens >= token_tokens - 1e-12


def test_block_verification_gains_where_a_low_ratio_is_followed_by_high_ones():
    # seed 3's tables (g = 4, fixed length): block verification emits measurably more per round
    t = Tables(3)
    _, block_tokens = round_distribution(t, 4, fixed_length(4), block_outcomes)
    _, token_tokens = round_distribution(t, 4, fixed_length(4), token_outcomes)
    assert block_tokens > token_tokens + 0.05


def test_a_draft_equal_to_the_target_keeps_everything():
    p = torch.softmax(torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(0)), -1)
    drafts = torch.tensor([[1, 5, 2], [0, 0, 6]])
    tau, final = block_verify(p, p[:, :3], drafts, torch.full((2, 3), 0.999))
    assert tau.tolist() == [3, 3] and torch.equal(final, p[:, 3])


def test_a_draft_the_target_never_emits_keeps_nothing_and_corrects_from_the_residual():
    p = torch.tensor([[[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3]]])
    q = torch.tensor([[[0.6, 0.2, 0.2], [0.2, 0.3, 0.5]]])
    tau, final = block_verify(p, q, torch.tensor([[0, 1]]), torch.zeros(1, 2))
    assert tau.tolist() == [0]                                   # p(x_1) = 0: w_1 = w_2 = 0
    assert torch.allclose(final[0], torch.tensor([0.0, 0.5, 0.5]))


def test_the_benchmarks_expected_kept_drafts_match_the_enumeration():
    # train.bench.acceptance.expected_kept (what `compare_hf_drafts.py acceptance` reports per
    # round) against the enumerated rounds above, for every 3-token draft of seed 2's tables
    from train.bench.acceptance import expected_kept

    t = Tables(2)
    for draft in itertools.product(range(V), repeat=3):
        p = torch.stack([t.p(draft[:i]) for i in range(4)])[None]
        q = torch.stack([t.q(draft[:i]) for i in range(3)])[None]
        token, block = expected_kept(p, q, torch.tensor([draft]))
        for got, outcomes in ((token, token_outcomes), (block, block_outcomes)):
            assert float(got) == pytest.approx(sum(prob * (len(e) - 1) for prob, e in outcomes(t, draft)), abs=1e-12)
