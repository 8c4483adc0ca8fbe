"""A datastore of the target's own answers as a draft tree's looked-up path (`decode.datastore`):
its continuation is the one most occurrences of the context's last n-gram share, a tree drafts it
where it matches a longer n-gram than prompt lookup, greedy output stays the target's, sampling stays lossless
(chi-square), and bad input is one line. Tiny random targets built from configs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_decode import chi_square_p_value
from test_eagle3 import _samples, head_for
from test_eagle3_tree import N, toy  # noqa: F401  (the toy target and head fixture)
from test_hf_decode import (
    _one_thread,  # noqa: F401  (autouse here too: offline, one thread)
    build,
    hf_greedy,
)

from specdec_models import SpecdecError
from specdec_models.decode import GREEDY, TreeDrafter, TreeSpec, generate
from specdec_models.decode.datastore import Datastore
from specdec_models.decode.tree import looked_up_path, lookup_continuation, lookup_match


def test_the_continuation_is_the_one_most_occurrences_share():
    store = Datastore([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 8], [9, 1, 2, 3, 7]])
    # after 1, 2, 3: 4 twice, 7 once; after 1, 2, 3, 4: 5 and 6 once each, the later one wins
    assert store.continuation([0, 1, 2, 3], 3) == [4, 6, 8]
    assert store.continuation([0, 1, 2, 3], 1) == [4]
    assert store.continuation([1, 2, 3, 4], 5) == [6, 8]         # ends where its occurrences end
    assert store.continuation([5, 2, 3], 4) == []                # no 3-gram 5, 2, 3
    assert store.continuation([1, 2, 3], 0) == [] and store.continuation([2, 3], 4) == []
    shorter = Datastore([[1, 2, 3, 4, 5], [8, 2, 3, 9]], min_ngram=2)
    assert shorter.continuation([7, 2, 3], 2) == [9]             # 2-gram 2, 3: a tie, the later occurrence
    assert shorter.continuation([1, 2, 3], 2) == [4, 5]          # the 3-gram first
    assert Datastore([[1, 2, 3, 4]]).tokens == 4


def test_the_longer_match_proposes_the_path_and_a_tie_goes_to_prompt_lookup():
    store = Datastore([[7, 8, 9, 1, 2], [5, 8, 9, 3, 4]], min_ngram=2)
    assert store.match([7, 8, 9], 2) == (3, [1, 2]) and store.match([6, 8, 9], 2) == (2, [3, 4])
    assert lookup_match([9, 0, 7, 8, 9], 2) == (1, [0, 7])
    assert looked_up_path([9, 0, 7, 8, 9], 2, store) == [1, 2]           # its 3-gram beats the context's 1-gram
    assert looked_up_path([8, 9, 0, 6, 8, 9], 2, store) == [0, 6]        # 2-gram against 2-gram: the context's
    assert looked_up_path([9, 0, 7, 8, 9], 2) == [0, 7]                  # no datastore: prompt lookup
    assert looked_up_path([1, 2, 3], 2, store) == []                     # neither matches


def test_each_ngram_keeps_its_latest_occurrences():
    rows = [[1, 2, 3, 10 + i] for i in range(100)]
    store = Datastore(rows, keep=8)
    assert len(store.index[(1, 2, 3)]) == 8
    assert store.index[(1, 2, 3)][-1] == (99, 3)
    assert store.continuation([1, 2, 3], 1) == [109]             # every vote 1: the latest


def _prompt_new_to_its_answer(target, n):
    """A prompt of distinct tokens whose greedy answer starts with a token the prompt lacks (so
    prompt lookup finds nothing at the first round), and that answer."""
    for start in range(0, 60, 3):
        prompt = torch.tensor([start + 1, start + 2, start + 3])
        answer = hf_greedy(target, [prompt], n)[0][0]
        if answer[0] not in prompt.tolist():
            return prompt, answer
    raise AssertionError("no prompt whose greedy answer starts with a new token")


def test_a_tree_drafts_the_datastore_where_prompt_lookup_finds_nothing(tmp_path):
    # the datastore holds the target's greedy answer to the prompt (as if it had answered it
    # before): where the context's last token is new, prompt lookup proposes nothing and the tree
    # drafts the stored continuation, which the target accepts whole; greedy output is unchanged
    target = build(tmp_path / "t", "llama", 3, 30.0)
    head = head_for(target, seed=1)
    prompt, answer = _prompt_new_to_its_answer(target, 24)
    assert lookup_continuation(prompt.tolist() + answer[:1], 4) == []
    store = Datastore([prompt.tolist() + answer])
    spec = TreeSpec(2, 2, 1, 4, lookup_max=16)
    without, base = generate(target, [prompt], 24, TreeDrafter(head, spec), sampling=GREEDY)
    got, stats = generate(target, [prompt], 24, TreeDrafter(head, spec, store), sampling=GREEDY)
    assert got[0].tolist() == without[0].tolist() == answer
    assert stats.tokens_per_call > base.tokens_per_call
    assert stats.per_position_acceptance[3] > 0                   # a path of 4 accepted: the stored one


# with `make test-slow` (about 30 s on 2 cores): a datastore's path is tested as any looked-up path,
# a point-mass candidate under the residual, whose chi-square test at T=1 stays in the default run
# (test_eagle3_tree.py, the adaptive lookup)
@pytest.mark.slow
def test_a_datastore_path_samples_losslessly_chi_square(toy):  # noqa: F811
    # after the prompt 1, 4, 2 a new token leaves prompt lookup empty, so the round's looked-up
    # path is the datastore's, a stored continuation for each token after 4, 2 (some outside the
    # head's vocabulary: point masses after its drawn children). Threshold p < 1e-4: a correct
    # sampler fails at most once in 10^4 runs (fixed seeds); the chi-square test catches a
    # rejected looked-up token left in p at p ~ 1e-24 (test_eagle3_tree)
    target, head = toy
    store = Datastore([[4, 2, x, (x + 3) % 8, (5 * x + 1) % 8, x] for x in range(8)])
    assert store.continuation([1, 4, 2, 7], 2) == [2, 4] and lookup_continuation([1, 4, 2, 7], 2) == []
    # every first round after a drawn token x drafts the datastore's path (its 3-gram 4, 2, x beats
    # prompt lookup's 1-gram where x is in the prompt)
    assert all(looked_up_path([1, 4, 2, x], 2, store) == store.continuation([1, 4, 2, x], 2) != [] for x in range(8))
    observed, exact, stats = _samples(target, head, N, tree=TreeSpec(2, 2, 1, 2), datastore=store, temperature=1.0)
    assert stats.method == "eagle3_tree" and stats.per_position_acceptance[1] > 0
    assert chi_square_p_value(observed, exact, N) > 1e-4


@pytest.mark.parametrize("kwargs, message", [
    ({}, "with a tree whose lookup is on"),
    ({"tree": TreeSpec(2, 2, 1)}, "with a tree whose lookup is on"),
    ({"tree": TreeSpec(2, 2, 1, 4), "datastore": [[1, 2, 3]]}, "must be a decode.datastore.Datastore"),
])
def test_a_datastore_without_a_looked_up_path_is_refused_in_one_line(toy, kwargs, message):  # noqa: F811
    target, head = toy
    kwargs = {"datastore": Datastore([[1, 2, 3, 4]]), **kwargs}
    with pytest.raises(SpecdecError, match=message) as err:
        generate(target, [torch.tensor([1, 2])], 4, TreeDrafter(head, kwargs.get("tree"), kwargs["datastore"]),
                 sampling=GREEDY)
    assert "\n" not in str(err.value)


def test_a_datastore_file_round_trips_and_a_bad_one_is_one_line(tmp_path):
    store = Datastore([[1, 2, 3, 4], [5, 6, 7, 8, 9]], keep=4)
    store.save(tmp_path / "s.npz", {"cache": "C"})
    back = Datastore.load(tmp_path / "s.npz")
    assert back.rows == store.rows and back.keep == 4 and back.source == {"cache": "C"}
    assert back.continuation([1, 2, 3], 1) == [4] and not list(tmp_path.glob(".tmp-*"))
    (tmp_path / "bad.npz").write_bytes(b"not a datastore")
    for path, message in ((tmp_path / "none.npz", "does not exist"), (tmp_path / "bad.npz", "not a datastore file")):
        with pytest.raises(SpecdecError, match=message) as err:
            Datastore.load(path)
        assert "\n" not in str(err.value)


def test_bad_datastore_settings_are_one_line():
    for kwargs, message in (({"min_ngram": 0}, "min_ngram"), ({"min_ngram": 3, "max_ngram": 2}, "max_ngram"),
                            ({"keep": 0}, "keep")):
        with pytest.raises(SpecdecError, match=message):
            Datastore([[1, 2, 3]], **kwargs)
