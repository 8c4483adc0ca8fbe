"""specdec evaluate as a library call: `EvalJob` (what the command line gives), `check_job`
(every input checked before any model loads, one line), `run_evaluation` (load, decode, write).

The recipe (`train.eagle3_recipe`) checks its evaluation's job with `check_job` before its first
step and runs it with `run_evaluation` as its evaluate step; specdec evaluate parses a command
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

RESERVED = ("plain", "lookup")
CHAIN = 5                # an EAGLE-3 head's chain without --gamma (the export's SPECULATIVE_TOKENS)
TREE_COLUMNS = ("+tree", "+tree+lookup")     # NAME+tree: the head's own tree; NAME+tree+lookup: with SPEC's lookup


@dataclass(frozen=True)
class EvalJob:
    """specdec evaluate's inputs, as its --help describes them: the target, the heads
    ("NAME=PATH" each), the tree SPEC and chain gamma they draft with, prompt lookup ("N[..MAX]"),
    the benchmarks and their subset, the speed part's prompts per benchmark ("K|NAME=K,..."),
    the acceptance part's rows per chain call, the temperatures ("0,1"), the answers' length, dtype
    (auto|fp32|bf16|fp16, `specdec_models.cpu.parse_dtype`), device, threads, chat template kwargs
    (JSON), seed and the output folder."""

    target: str
    heads: tuple[str, ...] = ()
    tree: str | None = None
    gamma: int | None = None        # None: each head's own chain (`own_gamma`)
    lookup: str | None = None
    benchmarks: str = "mt_bench,humaneval"
    subset: str | None = None
    speed_subset: str | None = None
    tau_batch: int = 16
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
    prompts (`train.bench.benchmarks.load_benchmark`) and the speed part's prompt count per
    benchmark (the first of `prompts` taken across categories, `benchmarks.across_categories`)."""

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
    speed: dict[str, int]


def parse_heads(specs) -> dict[str, str]:
    """--head NAME=PATH ...: {name: path}, each path holding a head of a kind `export.heads.HEADS`
    lists, in one of its layouts (`export.heads.detect_head`, which reads only its config)."""
    from specdec_models.export.heads import detect_head

    heads: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name = name.strip()
        check(sep and name and path, f"--head is NAME=PATH, got {spec!r}")
        check(name not in RESERVED and not name.endswith(TREE_COLUMNS),
              f"--head name {name!r} is reserved: plain, lookup, NAME+tree and NAME+tree+lookup name other columns")
        check(name not in heads, f"--head {name} is given twice")
        detect_head(path)
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
    from specdec_models.cpu import parse_dtype, resolve_device, resolve_dtype
    from specdec_models.decode.lookup import parse_lookup
    from specdec_models.decode.tree import TreeSpec
    from specdec_models.device import auto_device
    from specdec_models.files import check_output
    from specdec_models.hf import check_source
    from train.bench import eval_report
    from train.bench.benchmarks import SOURCES, load_benchmark, parse_speed_subset, parse_subset

    names = [n.strip() for n in job.benchmarks.split(",")]
    for name in names:
        check(name in SOURCES, f"unknown benchmark {name!r}: choose from {', '.join(sorted(SOURCES))}")
    check(len(set(names)) == len(names), f"--benchmarks names one twice: {job.benchmarks}")
    temperatures = parse_temperatures(job.temperatures)
    check(job.gamma is None or job.gamma >= 1, f"--gamma must be >= 1, got {job.gamma}")
    check(job.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {job.max_new_tokens}")
    check(job.tau_batch >= 1, f"--tau-batch must be >= 1, got {job.tau_batch}")
    check(job.threads is None or job.threads >= 1, f"--threads must be >= 1, got {job.threads}")
    dtype_name = parse_dtype(job.dtype)
    kwargs = parse_json_object(job.chat_template_kwargs)
    tree = TreeSpec.parse(job.tree) if job.tree is not None else None
    lookup = parse_lookup(job.lookup) if job.lookup is not None else None
    heads = parse_heads(job.heads) if heads_exist else {s.partition("=")[0]: s.partition("=")[2] for s in job.heads}
    check(heads or lookup, "nothing to score against plain decoding: give --head NAME=PATH or --lookup")
    check(tree is None or heads, "--tree drafts with the heads: give --head NAME=PATH")
    device = resolve_device(auto_device(job.device), "--device")      # auto: said once the checks pass
    dtype = resolve_dtype(dtype_name, device)
    check_source(job.target, "--target")
    out = Path(job.out)
    check_output(out, "--out", kind=eval_report.KIND, force=job.force, inputs=[job.target, *heads.values()])
    subsets = parse_subset(job.subset, names)
    speed = parse_speed_subset(job.speed_subset, names)
    prompts = {name: load_benchmark(name, subsets[name]) for name in names} if load_prompts else {}
    return CheckedEval(names, temperatures, kwargs, tree, lookup, heads, device, dtype, out, prompts, speed)


def run_evaluation(job: EvalJob, command: str) -> list[Path]:
    """Check every input (and find the benchmarks' files), then load, decode and write the report
    (`command`: the command line it records). Returns the files written."""
    import torch

    from specdec_models.device import AUTO, auto_line
    from train.bench import eval_report, eval_resume

    c = check_job(job)
    wanted = eval_resume.settings(job, c)
    done = {name: kept for name, kept in eval_resume.resume(c.out, wanted, job.force).items() if name in c.names}
    if job.device == AUTO:
        print(auto_line(c.device), file=sys.stderr, flush=True)
    if job.threads is not None:
        torch.set_num_threads(job.threads)
    hf, loaded, found = load(job.target, c.heads, c.device, c.dtype)
    drafters = drafters_for(loaded, c.tree, c.lookup)
    columns = head_columns(loaded, found, c.heads, job.gamma, c.tree)
    for column, why in columns["skipped"].items():
        print(f"{column}: skipped, {why}", file=sys.stderr, flush=True)
    strict = c.dtype == torch.float32
    results, parts = {}, {}
    for name in c.names:
        def progress(line: str, name: str = name) -> None:
            print(f"{name}: {line}", file=sys.stderr, flush=True)

        if name in done:
            progress(f"resumed: scored by an earlier run of this command ({eval_resume.partial_dir(c.out)})")
            results[name], parts[name] = done[name]["results"], done[name]["parts"]
            continue
        results[name], parts[name] = score_benchmark(hf, drafters, name, c, job, strict, progress,
                                                     {k: v["gamma"] for k, v in columns["heads"].items()})
        eval_resume.save(c.out, wanted, name, results[name], parts[name])
    report = make_report(command, job, c, strict, drafters, results, parts)
    report["settings"].update(columns)
    report["resumed"] = sorted(done)
    written = eval_report.write(report, c.out)
    eval_resume.finish(c.out)
    return written


def load(target: str, heads: dict[str, str], device, dtype):
    """The target (`export.load_hf_run`) and each head on it, whatever its kind and layout
    (`export.heads`), readied for the device. Returns (the run, {name: head}, {name: `FoundHead`})."""
    from transformers.utils import logging

    from specdec_models.cpu import prepare_for_device
    from specdec_models.export import load_hf_run
    from specdec_models.export.heads import detect_head
    from specdec_models.export.layouts import load_head

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    hf = load_hf_run(target, dtype=dtype)
    check(getattr(hf.tokenizer, "chat_template", None), f"--target {target}: its tokenizer has no chat template; "
                                                        "MT-Bench and HumanEval are asked as chat turns")
    found = {name: detect_head(path) for name, path in heads.items()}
    loaded = {name: load_head(path, hf.target, found[name].kind) for name, path in heads.items()}
    prepare_for_device([hf.target, *loaded.values()], device, dtype)
    sizes = {head.vocab_size for head in loaded.values()}
    check(len(sizes) <= 1, f"the heads draft in different vocabularies ({sorted(sizes)}): one target, one vocabulary")
    return hf._replace(vocab_size=sizes.pop() if sizes else hf.vocab_size), loaded, found


def block_tree(tree, head):
    """A block head's tree (`decode.block_draft.BlockDrafter`): `tree`'s top-k per position and
    frontier width, its depth capped at the head's block, without the lookup path, node budget or
    keep that only an EAGLE-3 head's tree takes."""
    from specdec_models.decode.tree import TreeSpec

    return TreeSpec(depth=min(tree.depth, head.max_gamma), topk=tree.topk, width=tree.width, min_prob=tree.min_prob)


def drafters_for(heads: dict, tree, lookup: tuple[int, int] | None) -> dict:
    """{column: Drafter} in column order: each head's chain (NAME), its own tree (NAME+tree: `tree`
    with its lookup part removed, so the column is the head's alone; a block head's is `block_tree`)
    and, when `tree` has a lookup part and the head's tree drafter takes one (an EAGLE-3 head's, not a
    block head's: `head_columns` says it is skipped), the full tree (NAME+tree+lookup: the head's
    paths and a looked-up one in one verify call); then prompt lookup alone (lookup)."""
    from dataclasses import replace

    from specdec_models.decode import HeadDrafter, Lookup, TreeDrafter
    from specdec_models.decode.block_draft import BlockDrafter, is_block_head

    drafters = {}
    for name, head in heads.items():
        drafters[name] = HeadDrafter(head)
        if tree is None:
            continue
        if is_block_head(head):
            drafters[f"{name}+tree"] = BlockDrafter(head, block_tree(tree, head))
            continue
        drafters[f"{name}+tree"] = TreeDrafter(head, replace(tree, lookup=0, lookup_max=0))
        if tree.lookup:
            drafters[f"{name}+tree+lookup"] = TreeDrafter(head, tree)
    if lookup is not None:
        drafters["lookup"] = Lookup(*lookup)
    return drafters


def own_gamma(head, gamma: int | None) -> int:
    """The chain head `head` drafts per round: `gamma` (--gamma), capped at a block head's block;
    without it, a block head's whole block (one pass drafts every position, so a shorter chain saves
    no drafting) and an EAGLE-3 head's `CHAIN` (each token one more pass of the head)."""
    from specdec_models.decode.block_draft import is_block_head

    if is_block_head(head):
        return head.max_gamma if gamma is None else min(gamma, head.max_gamma)
    return CHAIN if gamma is None else gamma


def head_columns(heads: dict, found: dict, paths: dict[str, str], gamma: int | None, tree) -> dict:
    """What the report says of each head: {"heads": {name: {"path", "kind", "layout", "gamma" (its
    chain's length, `own_gamma`), "tree_depth" (its tree's, with --tree)}},
    "skipped": {column: why}} (a block head's NAME+tree+lookup, when --tree has a lookup part)."""
    from specdec_models.decode.block_draft import is_block_head

    described, skipped = {}, {}
    for name, head in heads.items():
        block = is_block_head(head)
        kind = found[name].kind.name
        entry = {"path": str(paths[name]), "kind": kind, "layout": found[name].layout,
                 "gamma": own_gamma(head, gamma)}
        if tree is not None:
            entry["tree_depth"] = block_tree(tree, head).depth if block else tree.depth
            if block and tree.lookup:
                skipped[f"{name}+tree+lookup"] = (f"a {kind} head drafts its tree from one pass and takes no "
                                                  f"lookup path")
        described[name] = entry
    return {"heads": described, "skipped": skipped}


def score_benchmark(hf, drafters, name: str, c: CheckedEval, job: EvalJob, strict: bool, progress,
                    gammas: dict[str, int] | None = None):
    """One benchmark's two parts (`train.bench.evaluate`), each head's chain `gammas[name]` long
    (default --gamma): the contexts built once with the
    target's batched greedy answers, the speed part on `c.speed[name]` of the prompts taken across
    categories, then the acceptance part on every prompt (the speed part's drafter calls count
    there too, not decoded twice). Returns ({temperature key: {"acceptance": groups, "speed":
    groups}}, {"acceptance": prompts, "speed": prompts}), each prompts entry saying which prompts
    (ids) and how many turns its figures rest on."""
    from train.bench import eval_report
    from train.bench.benchmarks import across_categories
    from train.bench.evaluate import acceptance, contexts, evaluate

    prompts = c.prompts[name]
    common = {"gamma": CHAIN if job.gamma is None else job.gamma, "gammas": gammas, "vocab_size": hf.vocab_size,
              "batch": job.tau_batch, "progress": progress}
    turns = contexts(hf.target, hf.tokenizer, prompts, job.max_new_tokens, c.kwargs, **common)
    picked = across_categories(prompts, c.speed[name])
    decoded: dict = {}
    speed = evaluate(hf.target, hf.tokenizer, drafters, [prompts[i] for i in picked], c.temperatures,
                     job.max_new_tokens, job.seed, c.kwargs, turns=[turns[i] for i in picked], strict=strict,
                     decoded=decoded, **common)
    scored = {"acceptance": acceptance(hf.target, hf.tokenizer, drafters, prompts, c.temperatures, job.max_new_tokens,
                                       job.seed, c.kwargs, turns=turns, decoded=decoded, **common),
              "speed": speed}
    results = {eval_report.temperature_key(t): {part: by_t[t] for part, by_t in scored.items()}
               for t in c.temperatures}
    parts = {"acceptance": _described(prompts, range(len(prompts))), "speed": _described(prompts, picked)}
    return results, parts


def _described(prompts, indices) -> dict:
    chosen = [prompts[i] for i in indices]
    return {"prompts": len(chosen), "turns": sum(len(p.turns) for p in chosen), "ids": [p.id for p in chosen]}


def make_report(command: str, job: EvalJob, c: CheckedEval, strict: bool, drafters, results, parts) -> dict:
    import torch

    from specdec_models.cpu import host_report

    dtype_name = str(c.dtype).removeprefix("torch.")
    if strict:
        check_text = "enforced: every drafter's greedy output equalled plain decoding's (float32)"
    else:
        mismatches = sum(by_part["speed"]["overall"][m].get("greedy_mismatches", 0) for by_t in results.values()
                         for by_part in by_t.values() for m in drafters)
        check_text = (f"not enforced in {dtype_name}: a verify call's logits may differ from a one-token step's in the "
                      f"last bit and flip a near tie, so a differing turn is not a bug; {mismatches} turns differed "
                      f"(run --dtype fp32 to enforce the check)")
    return {"command": command, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__, "host": host_report(),
            "gpu": torch.cuda.get_device_name(c.device) if c.device.type == "cuda" else None,
            "device": str(c.device), "dtype": dtype_name, "greedy_check": check_text,
            "settings": {"target": job.target, "heads": c.heads, "tree": job.tree, "gamma": job.gamma,
                         "lookup": job.lookup, "subset": job.subset, "speed_subset": c.speed,
                         "tau_batch": job.tau_batch, "max_new_tokens": job.max_new_tokens,
                         "seed": job.seed, "chat_template_kwargs": c.kwargs, "batch": 1},
            "parts": PARTS, "methods": ["plain", *drafters], "prompts": parts, "results": results}


# what each part of `results` rests on, for a reader of evaluation.json
PARTS = {"acceptance": "tau and per-position acceptance: every prompt and turn of the set (--subset), decoded by "
                       "each drafter only, chains --tau-batch turns per call, trees and lookup one at a time (the "
                       "speed part's turns counted from its batch-1 calls); no plain decoding, no timing",
         "speed": "tokens/s and speed-up over plain decoding: the first --speed-subset prompts taken across "
                  "categories, decoded plainly and by each drafter, batch 1, interleaved and timed; the greedy check"}
