"""Score drafters as EAGLE-3, SpecForge and speculators report them: `python scripts/evaluate.py`.

A Hugging Face target (`--target DIR|FILE.gguf`) decodes MT-Bench (80 questions, both turns, the
second after the target's own answer) and HumanEval (164 problems), batch 1, at T=0 and T=1,
plainly and with each drafter, interleaved prompt by prompt (`train.bench.evaluate`). Drafters:
each `--head NAME=PATH` (an EAGLE-3 head in specdec's hf_eagle3, speculators' or SGLang's layout,
so heads trained by speculators or SpecForge too) as a chain of `--gamma` tokens, with `--tree SPEC`
also as a tree (column NAME+tree), and with `--lookup` prompt lookup as its own baseline column.
OUT (`--out`) gets evaluation.json, evaluation.md and evaluation.png (`train.bench.eval_report`):
tau, per-position acceptance and speed-up over plain decoding per benchmark, temperature and
category. One line per prompt and turn decoded goes to stderr. In fp32 every greedy output must
equal plain decoding's (an error otherwise); in bf16 the turns that differ are counted instead.
Bad input: one line, exit status 2, before any model loads; nothing written.

    python scripts/evaluate.py --target SmolLM2-135M-Instruct.Q4_1.gguf --head recipe=outputs/eagle3/head \\
        --head specforge=outputs/peers/specforge --tree 6,3,2 --lookup --subset 2 --out outputs/evaluation
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

from specdec_models.errors import SpecdecError, check

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "auto": "auto"}
RESERVED = ("plain", "lookup")


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line and exit 2, like every other bad input here."""

    def error(self, message: str):
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python scripts/evaluate.py", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, metavar="DIR|FILE.gguf",
                   help="the target: a save_pretrained directory or a GGUF file, with a chat template")
    p.add_argument("--head", action="append", default=[], metavar="NAME=PATH",
                   help="an EAGLE-3 head for the target (specdec hf_eagle3, speculators or SGLang layout); repeatable")
    p.add_argument("--tree", metavar="SPEC",
                   help="also draft each head as a tree (column NAME+tree), SPEC as the decoding CLI's --tree "
                        "(e.g. 6,3,2)")
    p.add_argument("--gamma", type=int, default=5, help="tokens a head's chain drafts per round (default 5)")
    p.add_argument("--lookup", nargs="?", const="4..16", metavar="N[..MAX]",
                   help="prompt lookup as a baseline drafter, its own column (default 4..16 when given bare)")
    p.add_argument("--benchmarks", default="mt_bench,humaneval", help="comma-separated (default mt_bench,humaneval)")
    p.add_argument("--subset", default=None, metavar="K|NAME=K,...",
                   help="the first K prompts of each category (MT-Bench has 10 per category, HumanEval 164 in one), or "
                        "per benchmark, e.g. mt_bench=1,humaneval=8")
    p.add_argument("--temperatures", default="0,1", help="comma-separated, each >= 0 (default 0,1)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per answer (default 256)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="auto",
                   help="auto: the faster on --device (specdec_models/cpu); the greedy equality check needs fp32")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help='passed to the chat template, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled runs (default 0)")
    p.add_argument("--out", default="outputs/evaluation", help="the folder to write (default outputs/evaluation)")
    p.add_argument("--force", action="store_true", help="replace --out whatever it holds (never an input)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    try:
        args = build_parser().parse_args(argv)
        paths = run(args, "python scripts/evaluate.py " + shlex.join(argv))
    except (_UsageError, SpecdecError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in paths))
    return 0


def parse_heads(specs: list[str]) -> dict[str, str]:
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


def run(args: argparse.Namespace, command: str) -> list[Path]:
    """Check every argument (and find the benchmarks' files), then load, decode and write."""
    import torch

    from specdec_models.cpu import resolve_device, resolve_dtype
    from specdec_models.decode.__main__ import parse_lookup
    from specdec_models.decode.tree import TreeSpec
    from specdec_models.files import check_output
    from specdec_models.hf import check_source
    from train.bench import eval_report
    from train.bench.benchmarks import SOURCES, load_benchmark, parse_subset

    # every check first: nothing loads before all the arguments pass
    names = [n.strip() for n in args.benchmarks.split(",")]
    for name in names:
        check(name in SOURCES, f"unknown benchmark {name!r}: choose from {', '.join(sorted(SOURCES))}")
    check(len(set(names)) == len(names), f"--benchmarks names one twice: {args.benchmarks}")
    temperatures = parse_temperatures(args.temperatures)
    check(args.gamma >= 1, f"--gamma must be >= 1, got {args.gamma}")
    check(args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check(args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}")
    kwargs = parse_json_object(args.chat_template_kwargs)
    tree = TreeSpec.parse(args.tree) if args.tree is not None else None
    lookup = parse_lookup(args.lookup) if args.lookup is not None else None
    heads = parse_heads(args.head)
    check(heads or lookup, "nothing to score against plain decoding: give --head NAME=PATH or --lookup")
    check(tree is None or heads, "--tree drafts with the heads: give --head NAME=PATH")
    check(tree is None or tree.lookup == 0, f"--tree {args.tree} adds a prompt-lookup path, which would count in the "
                                            "heads' tau: drop it from SPEC; --lookup scores prompt lookup as its own column")
    device = resolve_device(args.device, "--device")
    dtype = resolve_dtype(DTYPES[args.dtype], device)
    check_source(args.target, "--target")
    out = Path(args.out)
    check_output(out, "--out", kind=eval_report.KIND, force=args.force, inputs=[args.target, *heads.values()])
    subsets = parse_subset(args.subset, names)
    prompts = {name: load_benchmark(name, subsets[name]) for name in names}   # missing package, subset too large

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    hf, drafters = load(args.target, heads, tree, lookup, device, dtype)
    strict = dtype == torch.float32
    results = {}
    for name in names:
        def progress(line: str, name: str = name) -> None:
            print(f"{name}: {line}", file=sys.stderr, flush=True)

        scored = evaluate(hf, drafters, prompts[name], temperatures, args, kwargs, strict, progress)
        results[name] = {eval_report.temperature_key(t): groups for t, groups in scored.items()}
    report = make_report(command, args, device, dtype, strict, drafters, prompts, results, heads)
    return eval_report.write(report, out)


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


def evaluate(hf, drafters, prompts, temperatures, args, kwargs, strict, progress):
    from train.bench.evaluate import evaluate as score

    return score(hf.target, hf.tokenizer, drafters, prompts, temperatures, args.max_new_tokens, args.seed, kwargs,
                 gamma=args.gamma, vocab_size=hf.vocab_size, strict=strict, progress=progress)


def make_report(command, args, device, dtype, strict, drafters, prompts, results, heads) -> dict:
    import torch

    from specdec_models.cpu import host_report

    dtype_name = str(dtype).removeprefix("torch.")
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
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "device": str(device), "dtype": dtype_name, "greedy_check": check_text,
            "settings": {"target": args.target, "heads": heads, "tree": args.tree, "gamma": args.gamma,
                         "lookup": args.lookup, "subset": args.subset, "max_new_tokens": args.max_new_tokens,
                         "seed": args.seed, "chat_template_kwargs": parse_json_object(args.chat_template_kwargs),
                         "batch": 1},
            "methods": ["plain", *drafters], "prompts": {name: len(p) for name, p in prompts.items()},
            "results": results}


if __name__ == "__main__":
    sys.exit(main())
