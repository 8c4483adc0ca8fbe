"""The drafter protocol (`decode.protocol`): a drafter defined outside the package, proposing a
block of k tokens from one table per round (as a block-drafting head proposes k tokens in one pass),
runs through `generate`'s one loop and verify path unchanged: exact at T=0 in a ragged batch with
EOS, lossless at T=1 (chi-square), and told what each round kept."""

import pytest
import torch

from test_decode import V, chi_square_p_value, exact_joint, ragged_prompts, tiny

from specdec_models.decode import GREEDY, SamplingConfig, generate
from specdec_models.decode.protocol import Draft, Drafter, Plan, Verdict
from specdec_models.sampling import sample, to_probs


class BlockTable(Drafter):
    """Proposes k tokens per round, position i drawn from row i of a fixed table of logits
    (k, vocab), whatever the context: a stand-in for a head that drafts a block in one pass."""

    method = "block_table"

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.kept: list[int] = []

    def plan(self, gamma: int) -> Plan:
        k = self.table.shape[0]
        return Plan(k, k, k)

    def propose(self, run, gamma: int) -> Draft:
        b = run.rows.batch
        q = to_probs(self.table, run.sampling).expand(b, -1, -1)          # (b, k, vocab)
        if run.sampling.greedy:
            return Draft(q.argmax(-1), self.table.shape[0])
        tokens = sample(q.reshape(-1, q.shape[-1]).contiguous(), run.generator).view(b, -1)
        return Draft(tokens, self.table.shape[0], q=q)

    def accept(self, run, verdict: Verdict) -> None:
        self.kept += verdict.kept.tolist()


def _table(k=2, vocab=V, seed=3, scale=3.0):
    return torch.randn(k, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_a_block_drafter_of_its_own_is_exact_at_t0_in_a_ragged_batch_with_eos():
    target = tiny(sharpen=4.0)
    prompts = ragged_prompts()
    plain, _ = generate(target, prompts, 12, sampling=GREEDY)
    eos = int(plain[1][4])
    want, _ = generate(target, prompts, 12, sampling=GREEDY, eos_id=eos)
    drafter = BlockTable(_table(k=3))
    got, stats = generate(target, prompts, 12, drafter, sampling=GREEDY, eos_id=eos)
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    assert stats.method == "block_table" and len(stats.per_position_acceptance) == 3
    assert stats.drafted == sum(stats.drafted_at) and sum(drafter.kept) == stats.accepted
    assert all(0 <= k <= 3 for k in drafter.kept)


@pytest.mark.parametrize("verify", ["block", "token"])
def test_a_block_drafter_of_its_own_is_lossless_chi_square(verify):
    # 3 new tokens of a 6-token target (216 joint outcomes), 6,000 samples, a 2-token block drawn
    # from a fixed table each round. Threshold p < 1e-4: a correct sampler fails at most once in
    # 10^4 runs (the seeds are fixed); test_decode's planted bugs show this test can fail
    vocab, n = 6, 6000
    target = tiny(vocab=vocab, seed=11, sharpen=3.0)
    prompt = torch.tensor([1, 4, 2])
    drafter = BlockTable(_table(k=2, vocab=vocab, seed=5, scale=1.5))
    cfg = SamplingConfig(temperature=1.0)
    g = torch.Generator().manual_seed(1234)
    tokens, stats = generate(target, prompt.expand(n, -1), 3, drafter, sampling=cfg, generator=g, verify=verify)
    index = (torch.stack(tokens) * torch.tensor([vocab ** 2, vocab, 1])).sum(1)
    observed = torch.bincount(index, minlength=vocab ** 3).float()
    assert 0.05 < stats.acceptance_rate < 0.95, "the table must be neither perfect nor useless"
    assert chi_square_p_value(observed, exact_joint(target, prompt, 3, cfg), n) > 1e-4
