"""The drafter objects `generate` takes (`specdec_models.decode.drafters`): each checks its own
arguments when built, in one line, and names the decoding it runs."""

import pytest
import torch

from test_decode import chi_square_p_value, ragged_prompts, tiny, tiny_prophet

from specdec_models import SpecdecError
from specdec_models.decode import (
    GREEDY,
    Datastore,
    DraftModel,
    HeadDrafter,
    Lookup,
    SamplingConfig,
    TreeDrafter,
    TreeSpec,
    generate,
)
from specdec_models.decode.cost import measure_costs
from specdec_models.sampling import to_probs


def test_each_drafter_names_its_method_and_the_module_that_drafts():
    draft, mp = tiny(dim=16, depth=1), tiny_prophet()
    assert (DraftModel(draft).method, DraftModel(draft).module) == ("draft", draft)
    assert (HeadDrafter(mp).method, HeadDrafter(mp).module) == ("prophet", mp)
    assert repr(DraftModel(draft)) == "DraftModel(Decoder)"
    _, stats = generate(mp.model, ragged_prompts(), 6, HeadDrafter(mp), sampling=GREEDY, gamma=2)
    assert stats.method == "prophet"


@pytest.mark.parametrize("build, message", [
    (lambda: DraftModel(torch.nn.Linear(2, 2)), "DraftModel drafts with a specdec_models Decoder"),
    (lambda: HeadDrafter(tiny()), "HeadDrafter drafts with a draft head"),
    (lambda: TreeDrafter(tiny_prophet(), TreeSpec()), "tree drafting needs an EAGLE-3 head"),
    (lambda: TreeDrafter(None, "3,2,1"), "tree must be a decode.tree.TreeSpec"),
    (lambda: TreeDrafter(None, None, Datastore([[1, 2, 3]])), "with a tree whose lookup is on"),
    (lambda: Lookup(0), "lookup must be an integer >= 1"),
    (lambda: Lookup(True), "lookup must be an integer >= 1"),
    (lambda: Lookup(4, 2), "lookup_max must be 0"),
    (lambda: Lookup(4, datastore=[[1, 2, 3]]), "datastore must be a decode.datastore.Datastore"),
    (lambda: generate(tiny(), [torch.tensor([1, 2])], 4, Lookup(2), gamma="auto"), "prompt lookup has its own depth"),
    (lambda: generate(tiny(), [torch.tensor([1, 2])], 4, Lookup(2), sampling=SamplingConfig(repetition_penalty=1.2)),
     "prompt lookup does not take a repetition penalty"),
])
def test_a_drafter_refuses_bad_arguments_when_built_in_one_line(build, message):
    with pytest.raises(SpecdecError, match=message) as err:
        build()
    assert "\n" not in str(err.value)


def test_measure_costs_takes_the_chain_drafters_and_refuses_other_objects():
    mp = tiny_prophet()
    with pytest.raises(SpecdecError, match="pass a DraftModel or a HeadDrafter") as err:
        measure_costs(mp.model, 1, 8, [1], mp, steps=1, warmup=0)
    assert "\n" not in str(err.value)


def repeating_prompts():
    """Ragged rows, two of them with a repeated phrase, so prompt lookup finds matches at once."""
    phrase = [5, 9, 13, 2, 7]
    return [torch.tensor([1, 2, 3]), torch.tensor(phrase + [4] + phrase[:3]), torch.tensor([6]),
            torch.tensor([8, 1] + phrase + phrase + phrase[:2])]


@pytest.mark.parametrize("drafter", [Lookup(3), Lookup(2, lookup_max=8)], ids=["fixed", "adaptive"])
def test_greedy_prompt_lookup_equals_greedy_decoding_in_a_ragged_batch(drafter):
    target, prompts = tiny(sharpen=4.0), repeating_prompts()
    base, _ = generate(target, prompts, 24, sampling=GREEDY)
    got, stats = generate(target, prompts, 24, drafter, sampling=GREEDY)
    assert [t.tolist() for t in got] == [t.tolist() for t in base]
    assert stats.method == "lookup" and repr(drafter).startswith("Lookup(") and drafter.module is None
    assert stats.accepted > 0 and stats.drafted >= stats.accepted
    assert stats.target_calls < stats.new_tokens == 4 * 24
    assert stats.per_position_acceptance[0] > 0


def test_greedy_prompt_lookup_with_a_datastore_proposes_its_continuation_and_stays_exact():
    target, prompts = tiny(sharpen=4.0), [torch.tensor([3, 1, 4]), torch.tensor([2, 7])]
    base, _ = generate(target, prompts, 16, sampling=GREEDY)
    # the target's own answers as the store: its 3-grams continue exactly as the target does
    answers = [p.tolist() + t.tolist() for p, t in zip(prompts, base, strict=True)]
    got, stats = generate(target, prompts, 16, Lookup(4, datastore=Datastore(answers)), sampling=GREEDY)
    assert [t.tolist() for t in got] == [t.tolist() for t in base]
    _, alone = generate(target, prompts, 16, Lookup(4), sampling=GREEDY)
    assert stats.accepted > alone.accepted and stats.target_calls < alone.target_calls
    assert repr(Lookup(4, 8, Datastore(answers))) == "Lookup(4..8, Datastore)"


def test_prompt_lookup_stops_rows_at_eos_and_decodes_nothing_for_zero_tokens():
    target, prompts = tiny(sharpen=4.0), repeating_prompts()
    base, _ = generate(target, prompts, 16, sampling=GREEDY)
    eos = int(base[1][5])
    want, _ = generate(target, prompts, 16, sampling=GREEDY, eos_id=eos)
    got, _ = generate(target, prompts, 16, Lookup(3), sampling=GREEDY, eos_id=eos)
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    none, stats = generate(target, prompts, 0, Lookup(3), sampling=GREEDY)
    assert all(t.numel() == 0 for t in none) and stats.target_calls == 0


@pytest.mark.slow     # about 40 s; a lookup chain is verified by block verification, whose exact enumeration
# runs by default (test_block_verify.py), and the tree's looked-up path keeps its chi-square there
def test_prompt_lookup_sampling_is_lossless_chi_square():
    # 3 new tokens of an 8-token target (512 joint outcomes; cells expected below 5 pooled), 2,000
    # samples after a prompt that ends in a loop, so every round has a looked-up path (point-mass
    # drafts, accepted with p(x), else drawn from p without x). Threshold p < 1e-4: a correct
    # sampler fails at most once in 10^4 runs (the seeds are fixed); the broken twin below must
    # give p < 1e-12
    observed, exact, stats = _lookup_samples(2000)
    assert stats.method == "lookup" and 0 < stats.accepted < stats.drafted
    assert chi_square_p_value(observed, exact, 2000) > 1e-4


@pytest.mark.slow     # the twin of the test above, run with it
def test_prompt_lookup_chi_square_catches_a_rejected_token_left_in_p(monkeypatch):
    from specdec_models.decode import tree

    monkeypatch.setattr(tree, "_rejected", lambda p, x: p)     # the rejected looked-up token drawn again
    observed, exact, _ = _lookup_samples(1000)
    assert chi_square_p_value(observed, exact, 1000) < 1e-12


def _lookup_samples(n, prompt=(3, 2, 0, 4, 5, 4, 5)):
    """n samples of 3 new tokens after `prompt` by `Lookup(2)` at T=1 from an 8-token target:
    (counts of the 512 outcomes, their exact probabilities under the target, stats)."""
    target, prompt = tiny(vocab=8, seed=11, sharpen=3.0), torch.tensor(prompt)
    g = torch.Generator().manual_seed(1234)
    tokens, stats = generate(target, prompt.expand(n, -1), 3, Lookup(2), sampling=SamplingConfig(), generator=g)
    index = (torch.stack(tokens) * torch.tensor([64, 8, 1])).sum(1)
    with torch.no_grad():
        seqs = torch.cartesian_prod(*[torch.arange(8)] * 3)
        x = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
        probs = to_probs(target(x[:, :-1]).logits[:, prompt.numel() - 1:], SamplingConfig())
        exact = probs.gather(-1, seqs[..., None])[..., 0].prod(-1)
    return torch.bincount(index, minlength=512).float(), exact, stats


def test_greedy_prompt_lookup_on_a_hugging_face_target_equals_its_own_generate(tmp_path):
    pytest.importorskip("transformers")
    from test_hf_decode import build, hf_greedy

    model = build(tmp_path / "llama", "llama", 1, 30.0)
    prompts = repeating_prompts()
    got, stats = generate(model, prompts, 16, Lookup(3), sampling=GREEDY)
    assert [t.tolist() for t in got] == hf_greedy(model, prompts, 16)[0]
    assert stats.method == "lookup" and stats.accepted > 0 and stats.target_calls < stats.new_tokens
