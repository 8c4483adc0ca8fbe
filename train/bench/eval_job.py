"""scripts/evaluate.py as a library call: `EvalJob` (what the command line gives), `check_job`
(every input checked before any model loads, one line), `run_evaluation` (load, decode, write).

The recipe (`train.eagle3_recipe`) checks its evaluation's job with `check_job` before its first
step and runs it with `run_evaluation` as its evaluate step; scripts/evaluate.py parses a command
line into the same job. What is scored and how: `train.bench.evaluate`; the report:
`train.bench.eval_report`.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from specdec_models.errors import SpecdecError, check

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "auto": "auto"}
RESERVED = ("plain", "lookup")


@dataclass(frozen=True)
class EvalJob:
    """scripts/evaluate.py's inputs, as its --help describes them: the target, the heads
    ("NAME=PATH" each), the tree SPEC and chain gamma they draft with, prompt lookup ("N[..MAX]"),
    the benchmarks and their subset, the temperatures ("0,1"), the answers' length, dtype
    (fp32|bf16|auto), device, threads, chat template kwargs (JSON), seed and the output folder."""

    target: str
    heads: tuple[str, ...] = ()
    tree: str | None = None
    gamma: int = 5
    lookup: str | None = None
    benchmarks: str = "mt_bench,humaneval"
    subset: str | None = None
    temperatures: str = "0,1"
    max_new_tokens: int = 256
    dtype: str = "auto"
    device: str = "cpu"
    threads: int | None = None
    chat_template_kwargs: str | None = None
    seed: int = 0
    out: str = "outputs/evaluation"
    force: bool = False


@dataclass
class CheckedEval:
    """An `EvalJob`'s inputs parsed and checked: benchmark names, temperatures, chat template
    kwargs, tree, lookup, {head name: path}, device, dtype, the output folder, each benchmark's
    prompts (`train.bench.benchmarks.load_benchmark`)."""

    names: list[str]
    temperatures: list[float]
    kwargs: dict | None
    tree: Any
    lookup: tuple[int, int] | None
    heads: dict[str, str]
    device: Any
    dtype: Any
    out: Path
    prompts: dict[str, list]


def parse_heads(specs) -> dict[str, str]:
    """--head NAME=PATH ...: {name: path}, each path holding an EAGLE-3 head in one of the three
    layouts (`export.eagle3.detect_layout`, which reads only its config)."""
    from specdec_models.export.eagle3 import detect_layout

    heads: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name = name.strip()
        check(sep and name and path, f"--head is NAME=PATH, got {spec!r}")
        check(name not in RESERVED and not name.endswith("+tree"),
              f"--head name {name!r} is reserved: plain, lookup and NAME+tree name other columns")
        check(name not in heads, f"--head {name} is given twice")
        detect_layout(path)
        heads[name] = path
    return heads


def parse_temperatures(text: str) -> list[float]:
    """--temperatures '0,1': distinct finite numbers >= 0, in the order given."""
    values = []
    for part in text.split(","):
        try:
            t = float(part)
        except ValueError:
            raise SpecdecError(f"--temperatures is comma-separated numbers >= 0 (e.g. 0,1), got {text!r}") from None
        check(math.isfinite(t) and t >= 0, f"--temperatures: each must be a finite number >= 0, got {part.strip()!r}")
        check(t not in values, f"--temperatures: {part.strip()} is given twice")
        values.append(t)
    return values


def parse_json_object(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecdecError(f"--chat-template-kwargs is not JSON: {e.msg}") from None
    check(isinstance(value, dict), f"--chat-template-kwargs must be a JSON object, got {text!r}")
    return value


def check_job(job: EvalJob, *, load_prompts: bool = True, heads_exist: bool = True) -> CheckedEval:
    """Every input of `job` checked, nothing loaded or written (one-line SpecdecError).
    `heads_exist=False`: the heads are checked as NAME=PATH only (the recipe checks its evaluation
    before the head is trained); `load_prompts=False`: the benchmarks' files are not read."""
    from specdec_models.cpu import resolve_device, resolve_dtype
    from specdec_models.decode.__main__ import parse_lookup
    from specdec_models.decode.tree import TreeSpec
    from specdec_models.files import check_output
    from specdec_models.hf import check_source
    from train.bench import eval_report
    from train.bench.benchmarks import SOURCES, load_benchmark, parse_subset

    names = [n.strip() for n in job.benchmarks.split(",")]
    for name in names:
        check(name in SOURCES, f"unknown benchmark {name!r}: choose from {', '.join(sorted(SOURCES))}")
    check(len(set(names)) == len(names), f"--benchmarks names one twice: {job.benchmarks}")
    temperatures = parse_temperatures(job.temperatures)
    check(job.gamma >= 1, f"--gamma must be >= 1, got {job.gamma}")
    check(job.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {job.max_new_tokens}")
    check(job.threads is None or job.threads >= 1, f"--threads must be >= 1, got {job.threads}")
    check(job.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {job.dtype!r}")
    kwargs = parse_json_object(job.chat_template_kwargs)
    tree = TreeSpec.parse(job.tree) if job.tree is not None else None
    lookup = parse_lookup(job.lookup) if job.lookup is not None else None
    heads = parse_heads(job.heads) if heads_exist else {s.partition("=")[0]: s.partition("=")[2] for s in job.heads}
    check(heads or lookup, "nothing to score against plain decoding: give --head NAME=PATH or --lookup")
    check(tree is None or heads, "--tree drafts with the heads: give --head NAME=PATH")
    check(tree is None or tree.lookup == 0,
          f"--tree {job.tree} adds a prompt-lookup path, which would count in the heads' tau: drop it from SPEC; "
          "--lookup scores prompt lookup as its own column")
    device = resolve_device(job.device, "--device")
    dtype = resolve_dtype(DTYPES[job.dtype], device)
    check_source(job.target, "--target")
    out = Path(job.out)
    check_output(out, "--out", kind=eval_report.KIND, force=job.force, inputs=[job.target, *heads.values()])
    subsets = parse_subset(job.subset, names)
    prompts = {name: load_benchmark(name, subsets[name]) for name in names} if load_prompts else {}
    return CheckedEval(names, temperatures, kwargs, tree, lookup, heads, device, dtype, out, prompts)


def run_evaluation(job: EvalJob, command: str) -> list[Path]:
    """Check every input (and find the benchmarks' files), then load, decode and write the report
    (`command`: the command line it records). Returns the files written."""
    import torch

    from train.bench import eval_report

    c = check_job(job)
    if job.threads is not None:
        torch.set_num_threads(job.threads)
    hf, drafters = load(job.target, c.heads, c.tree, c.lookup, c.device, c.dtype)
    strict = c.dtype == torch.float32
    results = {}
    for name in c.names:
        def progress(line: str, name: str = name) -> None:
            print(f"{name}: {line}", file=sys.stderr, flush=True)

        scored = evaluate(hf, drafters, c.prompts[name], c, job, strict, progress)
        results[name] = {eval_report.temperature_key(t): groups for t, groups in scored.items()}
    report = make_report(command, job, c, strict, drafters, results)
    return eval_report.write(report, c.out)


def load(target: str, heads: dict[str, str], tree, lookup, device, dtype):
    """The target (`export.load_hf_run`), each head on it (`export.eagle3.load_eagle3`), readied
    for the device; the drafters in column order: each head's chain (and tree), then lookup."""
    from transformers.utils import logging

    from specdec_models.cpu import prepare_for_device
    from specdec_models.decode import HeadDrafter, Lookup, TreeDrafter
    from specdec_models.export import load_hf_run
    from specdec_models.export.eagle3 import load_eagle3

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    hf = load_hf_run(target, dtype=dtype)
    check(getattr(hf.tokenizer, "chat_template", None), f"--target {target}: its tokenizer has no chat template; "
                                                        "MT-Bench and HumanEval are asked as chat turns")
    loaded = {name: load_eagle3(path, hf.target) for name, path in heads.items()}
    prepare_for_device([hf.target, *loaded.values()], device, dtype)
    drafters = {}
    for name, head in loaded.items():
        drafters[name] = HeadDrafter(head)
        if tree is not None:
            drafters[f"{name}+tree"] = TreeDrafter(head, tree)
    if lookup is not None:
        drafters["lookup"] = Lookup(*lookup)
    sizes = {head.vocab_size for head in loaded.values()}
    check(len(sizes) <= 1, f"the heads draft in different vocabularies ({sorted(sizes)}): one target, one vocabulary")
    return hf._replace(vocab_size=sizes.pop() if sizes else hf.vocab_size), drafters


def evaluate(hf, drafters, prompts, c: CheckedEval, job: EvalJob, strict: bool, progress):
    from train.bench.evaluate import evaluate as score

    return score(hf.target, hf.tokenizer, drafters, prompts, c.temperatures, job.max_new_tokens, job.seed, c.kwargs,
                 gamma=job.gamma, vocab_size=hf.vocab_size, strict=strict, progress=progress)


def make_report(command: str, job: EvalJob, c: CheckedEval, strict: bool, drafters, results) -> dict:
    import torch

    from specdec_models.cpu import host_report

    dtype_name = str(c.dtype).removeprefix("torch.")
    if strict:
        check_text = "enforced: every drafter's greedy output equalled plain decoding's (float32)"
    else:
        mismatches = sum(groups["overall"][m].get("greedy_mismatches", 0) for by_t in results.values()
                         for groups in by_t.values() for m in drafters)
        check_text = (f"not enforced in {dtype_name}: a verify call's logits may differ from a one-token step's in the "
                      f"last bit and flip a near tie, so a differing turn is not a bug; {mismatches} turns differed "
                      f"(run --dtype fp32 to enforce the check)")
    return {"command": command, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__, "host": host_report(),
            "gpu": torch.cuda.get_device_name(c.device) if c.device.type == "cuda" else None,
            "device": str(c.device), "dtype": dtype_name, "greedy_check": check_text,
            "settings": {"target": job.target, "heads": c.heads, "tree": job.tree, "gamma": job.gamma,
                         "lookup": job.lookup, "subset": job.subset, "max_new_tokens": job.max_new_tokens,
                         "seed": job.seed, "chat_template_kwargs": c.kwargs, "batch": 1},
            "methods": ["plain", *drafters], "prompts": {name: len(p) for name, p in c.prompts.items()},
            "results": results}
