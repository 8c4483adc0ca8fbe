"""train.bench.decode_rev: an earlier revision's decoding loop imported beside this checkout's, and
the race between them on one target and head (greedy tokens equal, both timed)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_eagle3_export import VOCAB, deep_llama, perturbed_head  # noqa: E402

from specdec_models import SpecdecError  # noqa: E402
from specdec_models.export.eagle3 import save_eagle3  # noqa: E402
from train.bench.decode_rev import load_revision, race, side  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_a_revision_is_imported_under_its_own_name_beside_this_checkout():
    import specdec_models

    old = load_revision("HEAD")
    assert old.__name__.startswith("specdec_models_") and old is not specdec_models
    import importlib

    old_decode = importlib.import_module(f"{old.__name__}.decode")
    assert old_decode.generate is not importlib.import_module("specdec_models.decode").generate
    assert load_revision("HEAD") is old                  # imported once per process
    with pytest.raises(SpecdecError, match="not a commit"):
        load_revision("no-such-revision-anywhere")


def test_both_loops_race_on_the_same_target_and_emit_the_same_greedy_tokens(tmp_path):
    import specdec_models

    target = deep_llama(tmp_path / "target")
    head_dir = save_eagle3(tmp_path / "head", perturbed_head(target, draft=40, aux=[2, 3, 5]), "speculators")
    sides = [side("base", load_revision("HEAD"), target, str(head_dir), "3,2,1"),
             side("this", specdec_models, target, str(head_dir), "3,2,1")]
    torch.manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (n,)) for n in (5, 9, 7)]
    lines = []
    for method in ("chain", "tree"):
        result = race(sides, target, prompts, method, max_new_tokens=12, eos_id=VOCAB - 1, gamma=3, log=lines.append)
        assert result["differ"] == 0
        assert result["base"] > 0 and result["this"] > 0
        assert sides[0].tokens == sides[1].tokens > 3      # the same tokens, and some: EOS may cut a prompt short
    assert len(lines) == 6 and lines[-1].startswith("[tree] prompt 3/3: base ")
