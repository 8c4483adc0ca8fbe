"""Score drafters as EAGLE-3, SpecForge and speculators report them: `specdec evaluate`.

A Hugging Face target (`--target DIR|FILE.gguf`) decodes MT-Bench (80 questions, both turns, the
second after the target's own greedy answer) and HumanEval (164 problems) at T=0 and T=1 in two
parts (`train.bench.evaluate`; the command is `train.bench.eval_job`, which the recipe's evaluate
step calls too): tau and per-position acceptance from every prompt (or `--subset`'s), decoded by
each drafter only, chains `--tau-batch` turns per call; speed-up and tokens/s from the first
`--speed-subset` prompts (8 per benchmark by default), decoded plainly and with each drafter, batch
1, interleaved prompt by prompt. Drafters: each `--head NAME=PATH` (a head of any kind
`specdec_models.export.heads` loads, told by its export: EAGLE-3 in specdec's hf_eagle3,
speculators' or SGLang's layout, so heads trained by speculators or SpecForge too; DFlash in
specdec's or speculators' layout) as a chain of `--gamma` tokens (capped at a block head's block;
without it, 5 for an EAGLE-3 head and the whole block for a block head), with `--tree SPEC` also as
the head's own tree (column NAME+tree; a block head's: top-k per position, the depth capped at its
block) and, when SPEC has a lookup part, as that tree with a
looked-up path (NAME+tree+lookup; skipped, said on stderr, for a block head, whose tree takes none);
with `--lookup` prompt lookup is its own baseline column. The report names each head's kind. OUT
(`--out`) gets evaluation.json, evaluation.md and evaluation.png (`train.bench.eval_report`) per
benchmark, temperature and category. Progress lines go to stderr, and so does the device `--device
auto` (the default) chose. In fp32 every greedy output of the speed part must equal plain decoding's
(an error otherwise); in bf16 the turns that differ are counted instead.
Bad input: one line, exit status 2, before any model loads; nothing written.

    specdec evaluate --target SmolLM2-135M-Instruct.Q4_1.gguf --head recipe=outputs/eagle3/eagle3/export \\
        --head specforge=outputs/eagle3/peers/specforge/head --tree 6,3,1,4..16,0.3 --lookup --subset 2 \\
        --out outputs/evaluation
"""

from __future__ import annotations

import argparse
import shlex
import sys

from specdec_models.cli_args import Parser
from specdec_models.errors import cli_main, prog


def build_parser() -> argparse.ArgumentParser:
    from specdec_models.cpu import add_dtype_argument
    from specdec_models.decode.tree import add_tree_argument
    from specdec_models.device import HELP

    p = Parser(prog=prog("specdec evaluate"), description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, metavar="DIR|FILE.gguf",
                   help="the target: a save_pretrained directory or a GGUF file, with a chat template")
    p.add_argument("--head", action="append", default=[], metavar="NAME=PATH",
                   help="a head for the target, any kind and layout specdec loads (eagle3: specdec, speculators or "
                        "SGLang layout; dflash and peagle: specdec or speculators layout); repeatable")
    add_tree_argument(p, "also draft each head as a tree: column NAME+tree without the tree's lookup part, and "
                         "NAME+tree+lookup with it (e.g. 6,3,1,4..16,0.3)")
    p.add_argument("--gamma", type=int, default=None,
                   help="tokens a head's chain drafts per round, capped at a block head's block (default: 5 "
                        "for an EAGLE-3 head, one per pass; a block head's whole block, drafted in one pass)")
    p.add_argument("--lookup", nargs="?", const="4..16", metavar="N[..MAX]",
                   help="prompt lookup as a baseline drafter, its own column (default 4..16 when given bare)")
    p.add_argument("--benchmarks", default="mt_bench,humaneval", help="comma-separated (default mt_bench,humaneval)")
    p.add_argument("--subset", default=None, metavar="K|NAME=K,...",
                   help="the set scored: the first K prompts of each category (MT-Bench has 10 per category, HumanEval "
                        "164 in one), or per benchmark, e.g. mt_bench=1,humaneval=8 (default: every prompt)")
    p.add_argument("--speed-subset", default=None, metavar="K|NAME=K,...",
                   help="the speed part's prompts: the first K of the set taken across categories (MT-Bench's 8: "
                        "one per category), or per benchmark, e.g. mt_bench=8,humaneval=16; each >= 1 (default 8, "
                        "all of the set when it is smaller)")
    p.add_argument("--tau-batch", type=int, default=16, metavar="N",
                   help="turns per generate call when a chain is scored for tau, and for the target's answers "
                        "that open MT-Bench's second turns (default 16; trees and lookup: 1)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated, each >= 0 (default 0,1)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per answer (default 256)")
    add_dtype_argument(p, what="the target's and the heads' dtype (the greedy equality check needs fp32)")
    p.add_argument("--device", default="auto", help=f"auto (default; {HELP}), cpu or cuda[:N]")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help='passed to the chat template, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled runs (default 0)")
    p.add_argument("--out", default="outputs/evaluation",
                   help="the folder to write (default outputs/evaluation); each benchmark is kept in OUT.partial "
                        "as soon as it is scored, so the same command after a kill resumes")
    p.add_argument("--force", action="store_true",
                   help="replace --out whatever it holds (never an input), and start over instead of resuming")
    return p


def job_of(args: argparse.Namespace):
    """The parsed command line as a `train.bench.eval_job.EvalJob`."""
    from train.bench.eval_job import EvalJob

    return EvalJob(target=args.target, heads=tuple(args.head), tree=args.tree or None, gamma=args.gamma,
                   lookup=args.lookup,
                   benchmarks=args.benchmarks, subset=args.subset, speed_subset=args.speed_subset,
                   tau_batch=args.tau_batch, temperatures=args.temperatures,
                   max_new_tokens=args.max_new_tokens, dtype=args.dtype, device=args.device, threads=args.threads,
                   chat_template_kwargs=args.chat_template_kwargs, seed=args.seed, out=args.out, force=args.force)


@cli_main
def main(argv: list[str] | None = None) -> int:
    from train.bench.eval_job import run_evaluation

    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = build_parser().parse_args(argv)
    paths = run_evaluation(job_of(args), prog("specdec evaluate") + " " + shlex.join(argv))
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
