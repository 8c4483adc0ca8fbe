"""The drafter objects `generate` takes (`specdec_models.decode.drafters`): each checks its own
arguments when built, in one line, and names the decoding it runs."""

import pytest
import torch
from test_decode import ragged_prompts, tiny, tiny_prophet

from specdec_models import SpecdecError
from specdec_models.decode import GREEDY, Datastore, DraftModel, HeadDrafter, TreeDrafter, TreeSpec, generate
from specdec_models.decode.cost import measure_costs


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
