"""Tree drafting for EAGLE-3 heads (`decode.tree`): the tree's verify call scores every node as
its own path, greedy output is the target's at any tree shape, with or without a prompt-lookup
path, sampling is lossless (chi-square, recursive rejection sampling, looked-up tokens as
point-mass candidates), and bad input is one line. Tiny random targets built from configs."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_decode import chi_square_p_value
from test_eagle3 import _samples, head_for
from test_hf_decode import (
    V,
    _one_thread,  # noqa: F401  (autouse here too: offline, one thread)
    build,
    hf_greedy,
    ragged_prompts,
)

from specdec_models import SpecdecError
from specdec_models.decode import GREEDY, HeadDrafter, SamplingConfig, TreeDrafter, TreeSpec, generate
from specdec_models.decode.tree import _Tree, lookup_continuation
from specdec_models.hf import HFDecoder

LOOP = (3, 2, 0, 4, 5, 4, 5)
N = 2000           # rows sampled by each chi-square test of a correct sampler


def toy_prompts() -> list[torch.Tensor]:
    """The toy's four prompts of the greedy tests."""
    return [torch.tensor([1, 4, 2]), torch.tensor([3, 3, 0, 7, 1]), torch.tensor([6]), torch.tensor([7, 7, 2, 1])]


def _greedy(target, head, prompts, n, *specs):
    """(tokens as lists, stats) of greedy tree decoding with each spec."""
    runs = [generate(target, prompts, n, TreeDrafter(head, spec), sampling=GREEDY) for spec in specs]
    # a prompt ending in a loop: prompt lookup proposes 4, 5, 4, 5
    return [([t.tolist() for t in out], stats) for out, stats in runs]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tree")
    return {"llama": build(d / "llama", "llama", 1, 30.0), "neox": build(d / "neox", "neox", 2, 30.0)}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """An 8-token target and a head over 5 of its tokens (as test_eagle3's toy): with 3 children
    per node the target's choice is often among them, so long paths are accepted."""
    target = build(tmp_path_factory.mktemp("toy") / "t", "neox", 11, 6.0, vocab=8)
    head = head_for(target, seed=3, draft=5, ids=torch.tensor([0, 2, 3, 5, 6]))
    with torch.no_grad():
        head.lm_head.weight.mul_(3.0)
    return target, head


@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_the_tree_verify_scores_every_node_as_its_own_path(models, arch):
    # a tree of 7 nodes after a 5-token context: each node's logits equal a plain forward pass of
    # context + its path, and after keeping one path the cache continues as if only it was fed
    model = models[arch]
    target = HFDecoder(model)
    context = torch.randint(0, V, (5,))
    tokens = torch.randint(0, V, (8,))                    # the pending token, then 7 nodes
    parent = [-1, -1, 0, 0, 1, 2, 5]                      # node i's parent (-1: the pending token)
    depth = []
    for p in parent:
        depth.append(1 if p < 0 else depth[p] + 1)
    allowed = torch.eye(8, dtype=torch.bool)
    allowed[:, 0] = True
    for i, p in enumerate(parent):
        if p >= 0:
            allowed[i + 1] |= allowed[p + 1]
    cache = target.new_cache(1, 32)
    target(context[None], cache=cache)
    logits = target(tokens[None], cache=cache, tree=(torch.tensor([0] + depth), allowed)).logits[0]

    def path(i):                                           # verify index i -> its tokens from the pending one
        out = []
        while i > 0:
            out.append(i)
            i = parent[i - 1] + 1
        return [0] + out[::-1]

    with torch.no_grad():
        for i in range(8):
            plain = model(torch.cat([context, tokens[path(i)]])[None]).logits[0, -1]
            torch.testing.assert_close(logits[i], plain, rtol=1e-4, atol=1e-4)
    keep = torch.zeros(1, 8, dtype=torch.bool)
    assert path(7) == [0, 1, 3, 6, 7]                      # pending, nodes 0, 2, 5, 6: not contiguous
    keep[0, path(7)] = True
    cache.keep_new(keep)
    assert cache.lengths.tolist() == [5 + 5]
    nxt = torch.randint(0, V, (1, 2))
    got = target(nxt, cache=cache).logits[0]
    with torch.no_grad():
        plain = model(torch.cat([context, tokens[path(7)], nxt[0]])[None]).logits[0, -2:]
    torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch, draft", [("llama", None), ("llama", 60), ("neox", 50)])
def test_greedy_tree_decoding_equals_the_targets_generate(models, arch, draft):
    model = models[arch]
    head = head_for(model, draft=draft, layers=[1, 2, 0] if arch == "llama" else None)
    prompts = ragged_prompts()
    alone, _ = hf_greedy(model, prompts, 16)
    specs = (TreeSpec(1, 1, 1), TreeSpec(3, 2, 2), TreeSpec(5, 3, 3), TreeSpec(3, 2, 1, 5), TreeSpec(1, 1, 1, 2),
             TreeSpec(5, 3, 3, min_prob=0.3), TreeSpec(4, 2, 2, 2, lookup_max=8, min_prob=0.2))
    for spec in specs:
        got, stats = generate(model, prompts, 16, TreeDrafter(head, spec), sampling=GREEDY)
        assert [t.tolist() for t in got] == alone, spec
        rounds = stats.target_calls - len(prompts)
        assert stats.method == "eagle3_tree" and sum(stats.drafted_at) == spec.max_depth * rounds
        # drafted/accepted count nodes: each round verifies 1..max_nodes of them and accepts its path
        assert rounds <= stats.drafted <= spec.max_nodes * rounds and stats.accepted == sum(stats.accepted_at)
        assert stats.acceptance_rate == stats.accepted / stats.drafted


def test_lookup_continues_the_latest_longest_match():
    # the last 3 tokens (5, 6, 7) occur once before: what followed them; a 2-token tail matching
    # twice: the later occurrence; no earlier occurrence of the last token: nothing
    assert lookup_continuation([5, 6, 7, 8, 9, 1, 5, 6, 7], 3) == [8, 9, 1]
    assert lookup_continuation([5, 6, 7, 8, 9, 1, 5, 6, 7], 9) == [8, 9, 1, 5, 6, 7, 8, 9, 1]   # read as a loop
    assert lookup_continuation([1, 2, 3, 1, 2, 4, 9, 1, 2], 2) == [4, 9]
    assert lookup_continuation([0, 4, 5, 4, 5, 4], 5) == [5, 4, 5, 4, 5]               # a loop of period 2
    assert lookup_continuation([3, 9, 1, 2, 3, 9, 4, 2, 3, 9], 2) == [4, 2]     # 3-gram 2,3,9 beats 3,9 later
    assert lookup_continuation([1, 2, 3], 4) == [] and lookup_continuation([1, 2, 1], 0) == []
    assert lookup_continuation([7], 4) == [] and lookup_continuation([], 4) == []


def test_a_looked_up_path_goes_beneath_head_nodes_with_its_tokens():
    tree = _Tree()
    tree.add(-1, [4, 6], [-0.1, -0.5], None)             # the head's two children of the root
    tree.add(0, [8], [-0.3], None)                       # and one grandchild under token 4
    tree.add_path([4, 8, 1, 2])
    assert tree.tokens == [4, 6, 8, 1, 2] and tree.parent == [-1, -1, 0, 2, 3]
    assert tree.looked_up == {3, 4} and tree.depth == [1, 1, 2, 3, 4]
    tree.add_path([6, 3])                                # another round's path: beside the head's grandchild
    assert tree.children[1] == [5] and tree.looked_up == {3, 4, 5}


def test_greedy_lookup_accepts_the_targets_loops_and_stays_exact(toy):
    # the toy target's greedy output loops: copying its earlier turns adds accepted tokens to the
    # head's tree (seeded, greedy: deterministic), and the output is the target's token for token
    target, head = toy
    prompts = toy_prompts()
    alone, _ = hf_greedy(target, prompts, 32)
    plain_tree, base = generate(target, prompts, 32, TreeDrafter(head, TreeSpec(2, 2, 1)), sampling=GREEDY)
    got, stats = generate(target, prompts, 32, TreeDrafter(head, TreeSpec(2, 2, 1, 6)), sampling=GREEDY)
    assert [t.tolist() for t in got] == alone == [t.tolist() for t in plain_tree]
    assert stats.tokens_per_call > base.tokens_per_call + 0.5
    assert len(stats.per_position_acceptance) == 6 and stats.per_position_acceptance[4] > 0.2


def test_an_adaptive_lookup_doubles_after_a_full_accept_and_falls_back_after_a_miss():
    spec = TreeSpec(3, 2, 1, 4, lookup_max=16)
    assert [spec.next_lookup(4, True), spec.next_lookup(16, True), spec.next_lookup(8, False)] == [8, 16, 4]
    assert spec.next_lookup(2, False) == 4 and spec.next_lookup(4, True) == 8
    assert spec.next_lookup(8, None) == 8                         # nothing was looked up: no evidence
    assert TreeSpec(3, 2, 1, 4).next_lookup(4, True) == 4          # a fixed lookup stays fixed
    assert spec.max_nodes == 2 + 2 * 2 + 16 and spec.max_depth == 16


def test_greedy_adaptive_lookup_follows_the_targets_loops_further(toy):
    # the toy target's greedy output loops: a lookup that doubles after each fully accepted path
    # accepts more per call than a fixed 2-token lookup, and the output stays the target's
    # (seeded, greedy: deterministic)
    target, head = toy
    prompts = toy_prompts()
    alone, _ = hf_greedy(target, prompts, 48)
    fixed, base = generate(target, prompts, 48, TreeDrafter(head, TreeSpec(2, 2, 1, 2)), sampling=GREEDY)
    got, stats = generate(target, prompts, 48, TreeDrafter(head, TreeSpec(2, 2, 1, 2, lookup_max=12)), sampling=GREEDY)
    assert [t.tolist() for t in got] == alone == [t.tolist() for t in fixed]
    assert stats.tokens_per_call > base.tokens_per_call + 0.5
    assert stats.per_position_acceptance[4] > 0.1                # paths beyond the fixed lookup's 2 + 1


def _exact_runs(toy, *specs):
    """The stats of greedy tree decoding of the toy's prompts (24 tokens, the long-path head) with
    each spec, after checking that every output is the target's own greedy output."""
    target, head = toy[0], _long_path_head(toy[0])
    prompts = toy_prompts()
    alone, _ = hf_greedy(target, prompts, 24)
    runs = _greedy(target, head, prompts, 24, *specs)
    assert all(out == alone for out, _ in runs)
    return [stats for _, stats in runs]


def test_min_prob_stops_the_tree_where_the_head_is_unsure(toy):
    # no node of this toy head reaches q = 0.999, so the tree never grows past the root's children:
    # no round accepts two head nodes; without the floor some do. Output exact either way
    # (seeded, greedy: deterministic)
    deep_stats, cut_stats = _exact_runs(toy, TreeSpec(4, 3, 3), TreeSpec(4, 3, 3, min_prob=0.999))
    assert deep_stats.per_position_acceptance[1] > 0.2 and cut_stats.per_position_acceptance[1:] == [0.0] * 3


def test_pruning_keeps_the_most_probable_nodes_as_a_tree():
    tree = _Tree()
    q_root, q_4, q_8 = torch.full((3,), 1 / 3), torch.full((2,), 0.5), torch.ones(1)
    tree.add(-1, [4, 6, 7], [-0.1, -0.5, -2.0], q_root)     # nodes 0-2, cumulative log-probs
    tree.add(0, [8, 9], [-0.3, -1.0], q_4)                   # nodes 3-4 beneath token 4
    tree.add(3, [2], [-0.4], q_8)                            # node 5 beneath token 8
    kept = tree.pruned(4)                                    # nodes 0, 3, 5, 1: the best four
    assert kept.tokens == [4, 6, 8, 2] and kept.parent == [-1, -1, 0, 2] and kept.depth == [1, 1, 2, 3]
    assert kept.score == [-0.1, -0.5, -0.3, -0.4] and kept.children == {-1: [0, 1], 0: [2], 2: [3]}
    assert kept.q[-1] is q_root and kept.q[0] is q_4 and kept.q[2] is q_8
    assert tree.pruned(0) is tree and tree.pruned(6) is tree
    sure = _Tree()                                           # ties (q = 1): the earlier node, so the parent
    sure.add(-1, [1, 3], [0.0, 0.0], None)
    sure.add(0, [2], [0.0], None)
    assert sure.pruned(2).tokens == [1, 3] and sure.pruned(2).parent == [-1, -1]
    # a floor on the nodes' own scores (`keep`): the ones at or above it, as a tree; with a budget, both
    kept = tree.pruned(0, -0.45)                             # nodes 0, 3, 5 (1 is at -0.5, 2 and 4 lower)
    assert kept.tokens == [4, 8, 2] and kept.parent == [-1, 0, 1] and kept.children == {-1: [0], 0: [1], 1: [2]}
    assert tree.pruned(2, -0.45).tokens == [4, 8] and tree.pruned(0, -2.0) is tree
    assert tree.pruned(0, 0.0).tokens == []                 # nothing is sure: an empty tree, a plain step


def test_keep_verifies_only_the_likely_nodes_and_stays_exact(toy, monkeypatch):
    # greedy: with `keep` the verify call holds only head nodes of cumulative draft probability >=
    # keep (fewer than the full tree's), and the output is still the target's (seeded, deterministic)
    from specdec_models.decode import tree as tree_module

    full_stats, cut_stats = _exact_runs(toy, TreeSpec(4, 3, 3), TreeSpec(4, 3, 3, keep=0.3))
    assert cut_stats.drafted < full_stats.drafted
    target, head = toy[0], _long_path_head(toy[0])
    scores = []
    draft = tree_module._TreeDecoding.draft

    def recorded(self, *args, **kwargs):
        tree = draft(self, *args, **kwargs)
        scores.extend(tree.score)
        return tree

    monkeypatch.setattr(tree_module._TreeDecoding, "draft", recorded)
    generate(target, toy_prompts(), 24, TreeDrafter(head, TreeSpec(4, 3, 3, keep=0.3)), sampling=GREEDY)
    assert scores and min(scores) >= math.log(0.3)


def test_a_node_budget_verifies_at_most_its_nodes_and_stays_exact(toy):
    # 4,3,3 grows 30 nodes a round: a budget of 5 verifies at most 5 and the output is still the
    # target's; a budget of the whole tree changes nothing (seeded, greedy: deterministic). Which
    # 5 are kept: the next test. (This toy head is untrained: its deep chains are surer than its
    # root's third child, so acceptance per call is no measure of the choice.)
    full_stats, cut_stats, same_stats = _exact_runs(toy, TreeSpec(4, 3, 3), TreeSpec(4, 3, 3, nodes=5),
                                                    TreeSpec(4, 3, 3, nodes=30))
    assert cut_stats.drafted <= 5 * (cut_stats.row_calls - len(toy_prompts())) < full_stats.drafted
    assert full_stats.drafted == 30 * (full_stats.row_calls - len(toy_prompts()))
    assert ((same_stats.drafted, same_stats.per_position_acceptance)
            == (full_stats.drafted, full_stats.per_position_acceptance))


def test_a_budget_skips_head_steps_whose_children_cannot_enter_it(toy, monkeypatch):
    # greedy: a frontier node ranking below the budget's last node is not expanded. Each round's
    # verified tree equals the full tree's top 5, and the head runs fewer times (deterministic)
    from specdec_models.decode import tree as tree_module

    target, head = toy[0], _long_path_head(toy[0])
    prompts = toy_prompts()
    trees, calls = [], [0]
    draft, logits = tree_module._TreeDecoding.draft, head.logits

    def counted(*args, **kwargs):
        calls[0] += 1
        return logits(*args, **kwargs)

    def recorded(self, *args, **kwargs):
        tree = draft(self, *args, **kwargs).pruned(5)          # the full tree's top 5 (the budget's: as is)
        trees.append((tree.tokens, tree.parent))
        return tree

    monkeypatch.setattr(head, "logits", counted)
    monkeypatch.setattr(tree_module._TreeDecoding, "draft", recorded)
    runs = {}
    for spec in (TreeSpec(4, 3, 3, nodes=5), TreeSpec(4, 3, 3)):
        trees.clear()
        calls[0] = 0
        out, _ = generate(target, prompts, 24, TreeDrafter(head, spec), sampling=GREEDY)
        runs[spec.nodes] = ([t.tolist() for t in out], list(trees), calls[0])
    assert runs[5][:2] == runs[0][:2]
    assert runs[5][2] < runs[0][2]


def _long_path_head(target):
    """A head over 5 of the toy's 8 tokens holding the ones its greedy output loops on."""
    head = head_for(target, seed=4, draft=5, ids=torch.tensor([1, 2, 3, 4, 5]))
    with torch.no_grad():
        head.lm_head.weight.mul_(3.0)
    return head


def test_greedy_tree_accepts_long_paths_and_stays_exact(toy):
    # a head over 5 of the 8 tokens, holding the ones the target's greedy output loops on: its top
    # 3 often hold the target's choice, rounds accept paths of several nodes whose slots are not
    # contiguous in the verify call, and the output stays exact (deterministic: seeded, greedy)
    target, _ = toy
    head = _long_path_head(target)
    prompts = toy_prompts()
    alone, _ = hf_greedy(target, prompts, 24)
    chain, chain_stats = generate(target, prompts, 24, HeadDrafter(head), sampling=GREEDY, gamma=4)
    got, stats = generate(target, prompts, 24, TreeDrafter(head, TreeSpec(4, 3, 3)), sampling=GREEDY)
    assert [t.tolist() for t in got] == alone == [t.tolist() for t in chain]
    assert stats.tokens_per_call > chain_stats.tokens_per_call
    assert stats.per_position_acceptance[1] > 0.2             # two or more accepted in >20% of rounds
    assert stats.per_position_acceptance == sorted(stats.per_position_acceptance, reverse=True)


# both settings with `make test-slow`: these tests decode 2,000 rows one at a time (30-50 s each on
# 2 cores, and the default run must stay under 10 minutes). In the default run, tree sampling keeps
# its chi-square tests at T=1 through the node-budget and adaptive-lookup tests below, and top-p
# keeps its own through the sub-vocabulary chain's (test_eagle3.py)
@pytest.mark.parametrize("setting", [
    pytest.param({"temperature": 1.0}, id="t1", marks=pytest.mark.slow),
    pytest.param({"temperature": 0.7, "top_p": 0.9}, id="t0.7-topp0.9", marks=pytest.mark.slow),
])
def test_tree_sampling_is_lossless_chi_square(toy, setting):
    # 3 tokens of an 8-token target (512 joint outcomes; cells expected below 5 pooled), 2,000
    # samples, a tree of depth 2 with 3 children per node drawn without replacement. Threshold
    # p < 1e-4: a correct sampler fails at most once in 10^4 runs (the seeds are fixed); the broken
    # variants below give p < 1e-20 from 1,000 samples (measured: about 1e-280 from 3,000).
    target, head = toy
    observed, exact, stats = _samples(target, head, N, tree=TreeSpec(2, 3, 2), **setting)
    assert stats.method == "eagle3_tree"
    assert 0.05 < stats.per_position_acceptance[0] < 0.95, "the toy head must be neither perfect nor useless"
    assert chi_square_p_value(observed, exact, N) > 1e-4


# both settings with `make test-slow` (2,000 rows decoded one at a time: about 30 s each on 2 cores):
# in the default run the adaptive-lookup test below tests looked-up point masses at T=1
@pytest.mark.parametrize("setting", [
    pytest.param({"temperature": 1.0}, id="t1", marks=pytest.mark.slow),
    pytest.param({"temperature": 0.7, "top_p": 0.9}, id="t0.7-topp0.9", marks=pytest.mark.slow),
])
def test_tree_with_lookup_sampling_is_lossless_chi_square(toy, setting):
    # as above, after a prompt that ends in a loop (4, 5, 4, 5), so every round has a looked-up
    # path; its 4s lie outside the head's vocabulary, so they are tested as point masses after the
    # head's drawn children. Threshold p < 1e-4: a correct sampler fails at most once in 10^4 runs
    # (fixed seeds); the broken variant below gives p ~ 1e-24 from 1,000 samples (measured)
    target, head = toy
    assert lookup_continuation(list(LOOP), 4) == [4, 5, 4, 5] and 4 not in head.draft_ids.tolist()
    observed, exact, stats = _samples(target, head, N, tree=TreeSpec(2, 2, 1, 4), prompt=LOOP, **setting)
    assert stats.method == "eagle3_tree" and len(stats.per_position_acceptance) == 4
    assert chi_square_p_value(observed, exact, N) > 1e-4


def test_adaptive_lookup_and_min_prob_sampling_is_lossless_chi_square(toy):
    # the round's lookup length depends on earlier rounds' outcomes and the tree's depth on the
    # drafted nodes' own q: neither may bias the output. Same test and threshold as above (p < 1e-4:
    # a correct sampler fails at most once in 10^4 runs; fixed seeds), at T=1
    target, head = toy
    spec = TreeSpec(3, 2, 1, 1, lookup_max=4, min_prob=0.2)
    observed, exact, stats = _samples(target, head, N, tree=spec, prompt=LOOP, temperature=1.0)
    assert len(stats.per_position_acceptance) == 4 and stats.per_position_acceptance[1] > 0
    assert chi_square_p_value(observed, exact, N) > 1e-4


# one setting in the default run (each sampling mechanism keeps a chi-square test there), the other
# with `make test-slow`: these tests decode 2,000 rows one at a time (about 30 s each on 2 cores)
@pytest.mark.parametrize("setting", [
    pytest.param({"temperature": 1.0}, id="t1"),
    pytest.param({"temperature": 0.7, "top_p": 0.9}, id="t0.7-topp0.9", marks=pytest.mark.slow),
])
def test_node_budget_sampling_is_lossless_chi_square(toy, setting):
    # sampling spends the budget as the tree grows (4 of the up to 3 + 2 * 2 * 3 nodes of a 3,3,2
    # tree): the later children of a node are cut by the budget left, never for their own draws.
    # Same test and threshold as above (p < 1e-4: a correct sampler fails at most once in 10^4
    # runs; fixed seeds)
    target, head = toy
    observed, exact, stats = _samples(target, head, N, tree=TreeSpec(3, 3, 2, nodes=4), **setting)
    assert stats.drafted <= 4 * (stats.row_calls - N)
    assert stats.per_position_acceptance[1] > 0
    assert chi_square_p_value(observed, exact, N) > 1e-4


@pytest.mark.slow     # about 14 s; the default run keeps the tree's catch of a correction drawn from p
def test_lookup_chi_square_catches_a_rejected_token_left_in_p(toy, monkeypatch):
    from specdec_models.decode import tree

    monkeypatch.setattr(tree, "_rejected", lambda p, x: p)     # the rejected looked-up token drawn again
    target, head = toy
    observed, exact, _ = _samples(target, head, 1000, tree=TreeSpec(2, 1, 1, 4), prompt=LOOP, temperature=1.0)
    assert chi_square_p_value(observed, exact, 1000) < 1e-12


# one bug in the default run, the other with `make test-slow` (about 16 s each on 2 cores)
@pytest.mark.parametrize("broken", ["correction from p", pytest.param("q not updated", marks=pytest.mark.slow)])
def test_tree_chi_square_catches_a_broken_rejection_step(toy, monkeypatch, broken):
    from specdec_models.decode import tree

    if broken == "correction from p":
        monkeypatch.setattr(tree, "residual", lambda p, q: p)
    else:                       # the later children tested against the first one's q: biased
        monkeypatch.setattr(tree, "_without", lambda q, x: q)
    target, head = toy
    observed, exact, _ = _samples(target, head, 1000, tree=TreeSpec(2, 3, 2), temperature=1.0)
    assert chi_square_p_value(observed, exact, 1000) < 1e-20


def test_tree_spec_and_bad_input(models):
    assert TreeSpec.parse("5,3,2") == TreeSpec(5, 3, 2) and TreeSpec(5, 3, 2).max_nodes == 3 + 4 * 6
    assert TreeSpec.parse("3,2,1,6") == TreeSpec(3, 2, 1, 6) and TreeSpec(3, 2, 1, 6).max_nodes == 2 + 2 * 2 + 6
    assert TreeSpec(3, 2, 1, 6).label == "3,2,1 + lookup 6" and TreeSpec(3, 2, 1, 6).max_depth == 6
    assert TreeSpec.parse("6,2,1,4..16,0.2") == TreeSpec(6, 2, 1, 4, lookup_max=16, min_prob=0.2)
    assert TreeSpec.parse("6, 2, 1, 0.25") == TreeSpec(6, 2, 1, min_prob=0.25)
    assert TreeSpec(6, 2, 1, 4, 16, 0.2).label == "6,2,1 + lookup 4..16, q >= 0.2"
    assert TreeSpec.parse("6,3,2,4..16,0.3,nodes=12") == TreeSpec(6, 3, 2, 4, 16, 0.3, nodes=12)
    assert TreeSpec.parse("6,3,2, nodes=12") == TreeSpec(6, 3, 2, nodes=12)
    assert TreeSpec(6, 3, 2, 4, nodes=12).label == "6,3,2 + lookup 4, 12 nodes"
    assert TreeSpec(6, 3, 2, 4, nodes=12).max_nodes == 12 + 4 and TreeSpec(2, 2, 1, nodes=9).max_nodes == 4
    assert TreeSpec.parse("8,4,3,4..16,0.1,keep=0.05") == TreeSpec(8, 4, 3, 4, 16, 0.1, keep=0.05)
    assert TreeSpec.parse("6,3,2,nodes=12,keep=0.1") == TreeSpec.parse("6,3,2,keep=0.1,nodes=12")
    assert TreeSpec(8, 4, 3, 4, 16, 0.1, keep=0.05).label == "8,4,3 + lookup 4..16, q >= 0.1, nodes q >= 0.05"
    model = models["llama"]
    head = head_for(model, draft=40)
    prompt = [torch.tensor([1, 2, 3])]
    cases = [
        (lambda: TreeSpec.parse("5,3"), "DEPTH,TOPK,WIDTH"),
        (lambda: TreeSpec(0, 2, 2), "tree depth"),
        (lambda: TreeSpec.parse("3,2,1,6,1"), "DEPTH,TOPK,WIDTH"),
        (lambda: TreeSpec(3, 2, 1, -1), "tree lookup"),
        (lambda: TreeSpec.parse("3,2,1,16..4"), "adaptive lookup needs"),
        (lambda: TreeSpec.parse("3,2,1,0..4"), "adaptive lookup needs"),
        (lambda: TreeSpec.parse("3,2,1,4..8..9"), "DEPTH,TOPK,WIDTH"),
        (lambda: TreeSpec.parse("3,2,1,4,1.5"), "min_prob must be in"),
        (lambda: TreeSpec.parse("3,2,1,4,0.x"), "DEPTH,TOPK,WIDTH"),
        (lambda: TreeSpec.parse("3,2,1,nodes=x"), "DEPTH,TOPK,WIDTH"),
        (lambda: TreeSpec.parse("3,2,1,nodes=4,0.3"), "DEPTH,TOPK,WIDTH"),
        (lambda: TreeSpec(3, 2, 1, nodes=-1), "tree nodes"),
        (lambda: TreeSpec(3, 2, 1, keep=1.0), "tree keep must be in"),
        (lambda: TreeSpec.parse("3,2,1,keep=x"), "DEPTH,TOPK,WIDTH"),
        (lambda: TreeSpec.parse("3,2,1,size=4"), "DEPTH,TOPK,WIDTH"),
        (lambda: TreeSpec.parse("3,2,1,nodes=4,nodes=5"), "DEPTH,TOPK,WIDTH"),
        (lambda: generate(model, prompt, 4, TreeDrafter(None, TreeSpec())), "EAGLE-3 head"),
        (lambda: generate(model, prompt, 4, TreeDrafter(head, TreeSpec()), gamma="auto"), "own depth"),
        (lambda: generate(model, prompt, 4, TreeDrafter(head, TreeSpec()),
                          sampling=SamplingConfig(repetition_penalty=1.2)), "repetition"),
    ]
    for call, message in cases:
        with pytest.raises(SpecdecError, match=message) as err:
            call()
        assert "\n" not in str(err.value)


def test_the_comparison_runs_trees_at_batch_1_and_reports_greedy_agreement(models):
    from train.bench.drafts import RaceSettings, compare_drafters

    model = models["llama"]
    head = head_for(model, draft=60, layers=[1, 2, 0])
    drafters = {"eagle3": {"drafter": HeadDrafter(head)}, "tree": {"drafter": TreeDrafter(head, TreeSpec(3, 2, 2))}}
    rows = compare_drafters(model, ragged_prompts(lengths=(3, 9, 6)), drafters,
                            RaceSettings(gamma=3, max_new_tokens=6, rounds=1), batches={1: 2, 8: 3})
    assert [(r["temperature"], r["batch"], r["method"]) for r in rows] == [
        (t, b, m) for t in (0.0, 1.0) for b in (1, 8) for m in ("plain", "eagle3", "tree") if b == 1 or m != "tree"]
    for r in rows:
        assert r["new_tokens"] == r["prompts"] * 6
        if r["temperature"] == 0:               # fp32: every method is plain greedy decoding, token for token
            assert r["greedy_equal_plain"] is True and r["greedy_agreement"] == 1.0
        else:
            assert r["greedy_agreement"] is None


def test_the_comparison_interleaves_methods_prompt_by_prompt_within_a_round(monkeypatch):
    """At batch 1 a round decodes the first prompt with every method, then the second; a method's
    round time is the sum over its prompts, and its speed-up plain's time over it."""
    from train.bench import drafts

    calls, per_prompt = [], {"plain": 1.0, "A": 0.25, "B": 2.0}

    def fake_decode(target, prompts, batch, kwargs, seed, *, max_new_tokens, **_):
        name = kwargs.get("name", "plain")
        calls.append((name, [int(p[0]) for p in prompts], seed))
        counts = dict.fromkeys(drafts.COUNTS, 1.0) | {"accepted_at": [1], "drafted_at": [1]}
        return per_prompt[name] * len(prompts), counts, [[0] * max_new_tokens for _ in prompts]

    monkeypatch.setattr(drafts, "_decode", fake_decode)
    prompts = [torch.tensor([10 + i]) for i in range(3)]
    rows = drafts.compare_drafters(None, prompts, {"A": {"name": "A"}, "B": {"name": "B"}},
                                   drafts.RaceSettings(gamma=2, max_new_tokens=8, rounds=2, seed=5),
                                   temperatures=(0.0,), batches={1: 2, 8: 3})
    warm_1, timed_1, warm_8, timed_8 = calls[:3], calls[3:15], calls[15:18], calls[18:]
    assert [c[:2] for c in warm_1] == [("plain", [10]), ("A", [10]), ("B", [10])]
    assert timed_1 == [(m, [10 + i], 5 + 1000 * r + i) for r in range(2) for i in range(2) for m in ("plain", "A", "B")]
    assert [c[:2] for c in warm_8] == [("plain", [10, 11, 12]), ("A", [10, 11, 12]), ("B", [10, 11, 12])]
    assert timed_8 == [(m, [10, 11, 12], 5 + 1000 * r) for r in range(2) for m in ("plain", "A", "B")]
    got = {(r["batch"], r["method"]): (r["seconds"], r["speedup"]) for r in rows}
    assert got == {(1, "plain"): (2.0, 1.0), (1, "A"): (0.5, 4.0), (1, "B"): (4.0, 0.5),
                   (8, "plain"): (3.0, 1.0), (8, "A"): (0.75, 4.0), (8, "B"): (6.0, 0.5)}


def test_a_method_on_another_target_instance_is_compared_with_its_own_plain(monkeypatch):
    """{"target": other} decodes with another instance of the target (another dtype): its methods'
    speed-ups and greedy equality are over that instance's plain decoding, and every row's
    speedup_over_fastest_plain over the faster plain of each round."""
    from train.bench import drafts

    other = object()
    # seconds per prompt by (method, round): the other plain is faster in round 0, slower in round 1
    per_prompt = {("plain", 0): 1.0, ("A", 0): 0.5, ("plain", 1): 1.0, ("A", 1): 0.5,
                  ("plain [x]", 0): 0.5, ("A [x]", 0): 0.25, ("plain [x]", 1): 2.0, ("A [x]", 1): 1.0}
    tokens = {"plain": [1, 2], "A": [1, 2], "plain [x]": [1, 3], "A [x]": [1, 3]}

    def fake_decode(target, prompts, batch, kwargs, seed, *, max_new_tokens, **_):
        name = kwargs.get("name") or ("plain [x]" if kwargs.get("target") is other else "plain")
        assert (kwargs.get("target") is other) == name.endswith("[x]")
        counts = dict.fromkeys(drafts.COUNTS, 1.0) | {"accepted_at": [1], "drafted_at": [1]}
        if max_new_tokens < 8:                                    # the warm-up
            return 1.0, counts, [tokens[name] for _ in prompts]
        return per_prompt[name, seed // 1000] * len(prompts), counts, [tokens[name] for _ in prompts]

    monkeypatch.setattr(drafts, "_decode", fake_decode)
    prompts = [torch.tensor([10 + i]) for i in range(2)]
    methods = {"A": {"name": "A"}, "plain [x]": {"target": other},
               "A [x]": {"name": "A [x]", "target": other}}
    rows = drafts.compare_drafters(None, prompts, methods, drafts.RaceSettings(gamma=2, max_new_tokens=8, rounds=2),
                                   temperatures=(0.0,), batches={1: 2})
    got = {r["method"]: (r["speedup"], r["speedup_over_fastest_plain"], r["greedy_equal_plain"]) for r in rows}
    # round 0: fastest plain 2 tokens/s ([x]); round 1: 1 token/s (plain); medians of the two rounds
    assert got == {"plain": (1.0, (0.5 + 1.0) / 2, True), "A": (2.0, (1.0 + 2.0) / 2, True),
                   "plain [x]": (1.0, (1.0 + 0.5) / 2, True), "A [x]": (2.0, (2.0 + 1.0) / 2, True)}
    # at batch 2 the other instance's drafter is left out, its plain decoding is not (it may be the faster)
    rows = drafts.compare_drafters(None, prompts, methods, drafts.RaceSettings(gamma=2, max_new_tokens=8, rounds=2),
                                   temperatures=(0.0,), batches={1: 2, 2: 2})
    assert [(r["batch"], r["method"]) for r in rows] == [(1, m) for m in ("plain", "A", "plain [x]", "A [x]")] + [
        (2, m) for m in ("plain", "A", "plain [x]")]
    assert {r["method"]: r["speedup_over_fastest_plain"] for r in rows if r["batch"] == 2} == {
        "plain": (0.5 + 1.0) / 2, "A": (1.0 + 2.0) / 2, "plain [x]": (1.0 + 0.5) / 2}


def test_with_eos_the_comparison_stops_every_method_there_and_compares_token_rates(monkeypatch):
    """Rows stopped at EOS differ in length between methods at T > 0: each speed-up is then the
    method's tokens per second over plain decoding's, per round, and eos_id reaches every decode."""
    from train.bench import drafts

    # seconds per prompt and tokens per prompt: A emits half as many tokens in a quarter of the time
    per_prompt = {"plain": (1.0, 8), "A": (0.25, 4)}
    seen = []

    def fake_decode(target, prompts, batch, kwargs, seed, *, eos_id, **_):
        name = kwargs.get("name", "plain")
        seen.append(eos_id)
        seconds, n = per_prompt[name]
        counts = dict.fromkeys(drafts.COUNTS, 1.0) | {"accepted_at": [1], "drafted_at": [1]}
        return seconds * len(prompts), counts, [[0] * n for _ in prompts]

    monkeypatch.setattr(drafts, "_decode", fake_decode)
    prompts = [torch.tensor([10 + i]) for i in range(2)]
    rows = drafts.compare_drafters(None, prompts, {"A": {"name": "A"}},
                                   drafts.RaceSettings(max_new_tokens=8, rounds=2, eos_id=7),
                                   temperatures=(1.0,), batches={1: 2})
    assert seen and set(seen) == {7}
    got = {r["method"]: (r["tokens_per_second"], r["speedup"]) for r in rows}
    assert got == {"plain": (8.0, 1.0), "A": (16.0, 2.0)}          # by seconds alone A would be 4x


def test_the_comparison_stops_rows_at_eos_for_every_method(models):
    """A real tiny target: with eos_id every method's rows end at its first EOS (plain, chain,
    tree and transformers' prompt lookup), greedy rows still equal plain decoding's, and tokens per
    call count only the tokens before it."""
    from train.bench.drafts import RaceSettings, compare_drafters

    model = models["llama"]
    head = head_for(model, draft=60, layers=[1, 2, 0])
    prompts = ragged_prompts(lengths=(3, 9, 6))
    free, _ = generate(model, prompts, 12, sampling=GREEDY)
    eos = int(free[1][4])                                    # a token the greedy answers emit
    drafters = {"eagle3": {"drafter": HeadDrafter(head)}, "tree": {"drafter": TreeDrafter(head, TreeSpec(3, 2, 2))},
                "lookup": {"prompt_lookup": 3}}
    fixed = compare_drafters(model, prompts, drafters, RaceSettings(gamma=3, max_new_tokens=12, rounds=1),
                             batches={1: 3}, temperatures=(0.0,))
    stopped = compare_drafters(model, prompts, drafters, RaceSettings(gamma=3, max_new_tokens=12, rounds=1, eos_id=eos),
                               batches={1: 3}, temperatures=(0.0,))
    expect = sum(t.tolist().index(eos) + 1 if eos in t.tolist() else 12 for t in free)
    assert expect < 3 * 12
    for r in fixed:
        assert r["new_tokens"] == 3 * 12
    for r in stopped:
        assert r["new_tokens"] == expect, r["method"]
        assert r["greedy_equal_plain"] is True
    assert {r["method"] for r in stopped} == {"plain", "eagle3", "tree", "lookup"}


def test_verify_costs_time_chain_and_tree_calls_against_a_step(models):
    from train.bench.hf import verify_costs

    costs = verify_costs(models["llama"], 8, [1, 3], repeats=2)
    assert set(costs) == {"chain", "tree"} and costs["chain"][1] == 1.0
    assert all(set(c) == {1, 3} and all(v > 0 for v in c.values()) for c in costs.values())
    with pytest.raises(SpecdecError, match="include 1"):
        verify_costs(models["llama"], 8, [3])
    # a model prepared for the CPU is timed through its few-row layers, and left as it was given
    from specdec_models.cpu import prepare_for_device

    with prepare_for_device(models["llama"], "cpu", dtype=None) as prepared:
        assert prepared.layers and all(type(m) is not torch.nn.Linear for m in prepared.layers)
        costs = verify_costs(models["llama"], 8, [1, 3], repeats=2)
    assert costs["chain"][1] == 1.0 and all(v > 0 for c in costs.values() for v in c.values())
    linears = [m for m in models["llama"].modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)                 # switched back
    import io

    from train.bench.hf import plot_verify_costs

    png = io.BytesIO()
    plot_verify_costs({"dtype": "float32", "context": 8, **costs}, png)
    assert png.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SpecdecError, match="no verify costs"):
        plot_verify_costs({"dtype": "float32"}, io.BytesIO())


# with `make test-slow` (about 40 s on 2 cores): in the default run block verification keeps its
# chi-square tests through the chains' (test_decode, test_eagle3) and its exact enumeration (test_block_verify)
@pytest.mark.slow
def test_a_sampled_chain_tree_is_block_verified_and_lossless_chi_square(toy):
    # topk 1 makes the tree one chain of drawn nodes, cut by the 0.2 floor on its own drafted
    # prefix: each round is block verified (decode.block). Same test and threshold as above
    # (p < 1e-4: a correct sampler fails at most once in 10^4 runs; fixed seeds), at T=1
    target, head = toy
    observed, exact, stats = _samples(target, head, N, tree=TreeSpec(3, 1, 1, min_prob=0.2), temperature=1.0)
    assert stats.per_position_acceptance[1] > 0
    assert chi_square_p_value(observed, exact, N) > 1e-4


# with `make test-slow` (1,000 rows one at a time, about 17 s): in the default run the chain's catch
# tests (test_decode, test_eagle3) patch the same bug into block verification
@pytest.mark.slow
def test_chain_tree_chi_square_catches_a_correction_from_p_in_block_verification(toy, monkeypatch):
    # the test above can fail, and its rounds go through block verification: the bug patched into
    # decode.block alone (the tree's own walk keeps its residual) gives p ~ 2e-18 from 1,000 samples
    # (measured), far below the 1e-4 a correct sampler passes
    from specdec_models.decode import block

    monkeypatch.setattr(block, "residual", lambda p, q: p)
    target, head = toy
    observed, exact, _ = _samples(target, head, 1000, tree=TreeSpec(3, 1, 1), temperature=1.0)
    assert chi_square_p_value(observed, exact, 1000) < 1e-12


def test_the_greedy_check_decodes_a_chain_at_its_own_gamma(models):
    # compare_hf_drafts.py --eagle3-gamma gives the eagle3 chain its own gamma: the greedy check
    # against transformers' generate() takes it (it once passed gamma twice and crashed)
    from train.bench.drafts import greedy_matches_transformers

    model = models["llama"]
    head = head_for(model, draft=60, layers=[1, 2, 0])
    prompts = [torch.tensor([1, 4, 2, 9]), torch.tensor([3, 3, 0])]
    got = greedy_matches_transformers(model, prompts, {"chain": {"drafter": HeadDrafter(head), "gamma": 3}}, gamma=5,
                                      max_new_tokens=8)
    assert got == {"plain": True, "chain": True}


def test_tree_stats_count_the_heads_nodes_by_their_draft_probability(toy):
    # every verified head node lands in one bin of its cumulative draft probability q, with whether
    # the target accepted it; without a lookup that is every drafted and accepted node (deterministic)
    from specdec_models.decode.stats import NODE_Q_EDGES, DecodeStats, node_q_bins
    from train.bench.drafts import node_table

    target, head = toy
    ((_, stats),) = _greedy(target, head, toy_prompts(), 24, TreeSpec(3, 3, 2))
    assert len(stats.nodes_by_q) == len(stats.accepted_by_q) == len(NODE_Q_EDGES) + 1 == len(node_q_bins())
    assert sum(stats.nodes_by_q) == stats.drafted and sum(stats.accepted_by_q) == stats.accepted > 0
    assert all(0 <= a <= n for a, n in zip(stats.accepted_by_q, stats.nodes_by_q, strict=True))
    merged = DecodeStats.merge([stats, stats])
    assert merged.nodes_by_q == [2 * n for n in stats.nodes_by_q]
    assert merged.accepted_by_q == [2 * a for a in stats.accepted_by_q]
    ((_, looked),) = _greedy(target, head, [torch.tensor(LOOP)], 24, TreeSpec(3, 3, 2, 4))
    assert sum(looked.nodes_by_q) < looked.drafted                  # looked-up nodes have no q: not counted
    row = {"temperature": 0.0, "method": "eagle3 tree", "nodes_by_q": [4, 0] + [0] * 6 + [2],
           "accepted_by_q": [1, 0] + [0] * 6 + [2]}
    lines = node_table([row, {"temperature": 0.0, "method": "plain"}])
    assert lines[-1] == "| 0 | eagle3 tree | 4, 0.250 | – | – | – | – | – | – | – | 2, 1.000 |"
    assert "q <0.01" in lines[-3] and "q >=0.7" in lines[-3] and node_table([{"method": "plain"}]) == []


def test_the_comparisons_plot_gives_each_method_its_own_bars_and_a_dtype_twin_its_colour_hatched():
    # the recipe's comparison races two dtypes: 13 methods and their [float32] twins, 26 bars a group;
    # a colormap indexed past its end gave every method from the 21st on one colour
    from train.bench.drafts import bar_styles

    bases = ["plain"] + [f"eagle3 tree {k}" for k in range(12)]
    methods = bases + [f"{m} [float32]" for m in bases]
    styles = bar_styles(methods)
    assert len(set(styles.values())) == len(methods)                  # no two methods look alike
    for m in bases:
        (color, hatch), (twin_color, twin_hatch) = styles[m], styles[f"{m} [float32]"]
        assert color == twin_color and hatch is None and twin_hatch == "//"
    many = bar_styles([f"m{k}" for k in range(25)])                  # past tab20: colours again, dotted
    assert len(set(many.values())) == 25 and many["m20"] == (many["m0"][0], "..")
    assert bar_styles(["tree [x]", "tree [x] [bfloat16]"])["tree [x] [bfloat16]"][1] == "//"
