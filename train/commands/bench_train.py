"""Training benchmarks, each side by side in one process, interleaved (A, B, A, B, ...).

    specdec bench train [--precisions 32-true bf16-mixed]          # pipeline vs plain loop
    specdec bench train --lucidrains [--sizes 512x10+512x2] [--windows-per-seq 64]
    specdec bench train --quality [--threshold 0.4] [--max-steps 200]
    specdec bench train --eagle3-step CACHE --draft-vocab COUNTS.json --threads 1   # which precision

Default: the Lightning pipeline (`model=mid`, task=prophet) against a plain PyTorch loop on the
same batches (`train.bench.pipeline`; goal >= 0.97). `--lucidrains`: our joint train step (fp32 AdamW, seq 512,
batch 4) against lucidrains' `ModelWithProphetWrapper`, as published and with its feed-forward
applied, live in the same process (`train.bench.train_step`). `--quality`: train time
until the prophet's T=0 acceptance on validation prompts reaches a threshold, ours against
lucidrains', trained interleaved (`train.bench.train_quality`). `--eagle3-step`: an eagle3 head's
training step on a hidden-state cache in each precision, interleaved, beside the precision
specdec_models/cpu's flag rule picks (`train.bench.eagle3_step`). Reports: bench/train*.json,
.md and .png (`--out` sets the stem). Data: `--data`, else the shared text file, else synthetic.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec_models.cli_args import Parser, comma_list
from specdec_models.errors import check, cli_main, prog
from train.bench import eagle3_step, pipeline, train_quality, train_step
from train.bench.data import byte_batches, data_file, validation_rows
from train.bench.report import check_report, load_note, machine, write_report

REPO = Path(__file__).resolve().parents[2]

DEFAULT_DATA = REPO.parent / "shared" / "data" / "textmix100m.gz"


def run_lucidrains(args, path: Path) -> dict:
    for size in args.sizes:
        train_step.size_configs(size)             # a bad size fails before any work
    batch_of, _ = byte_batches(path, 512, 4, args.seed)
    sizes = []
    for size in args.sizes:
        print(f"[{size}] {args.warmup} warm-up + {args.steps} rounds", file=sys.stderr)
        sizes.append(train_step.bench_steps(size, batch_of, 512, 4, args.windows_per_seq, args.lucidrains_variants,
                                            args.steps, args.warmup, args.seed))
    return {"mode": "lucidrains", "sizes": sizes}


def run_quality(args, path: Path) -> dict:
    bench = train_quality.QualityBench(size=args.size, seq_len=args.seq_len, lr=args.lr,
                                       windows_per_seq=args.windows_per_seq, variants=args.lucidrains_variants,
                                       threshold=args.threshold, also_report=args.also_report,
                                       eval_every=args.eval_every,
                                       max_steps=args.max_steps, seed=args.seed)
    batch_of, valid = byte_batches(path, bench.seq_len, bench.batch_size, args.seed)
    windows, prompts = validation_rows(valid, bench.seq_len, args.prompts, args.prompt_len)
    return train_quality.bench_quality(bench, batch_of, windows, prompts, log=lambda s: print(s, file=sys.stderr))


def build_parser() -> Parser:
    """The command line, every flag with its help."""
    parser = Parser(prog=prog("specdec bench train"), description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--data", help=f"byte file (.gz, .zip or raw); default {DEFAULT_DATA} if present")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lucidrains", action="store_true", help="our train step vs lucidrains' (its package, live)")
    mode.add_argument("--quality", action="store_true", help="time-to-quality, ours vs lucidrains'")
    mode.add_argument("--eagle3-step", metavar="CACHE",
                      help="an eagle3 head's training step on this hidden-state cache, per precision, interleaved")
    parser.add_argument("--draft-vocab", help="--eagle3-step: token counts of specdec draft-vocab")
    parser.add_argument("--draft-vocab-size", type=int, default=8192,
                        help="--eagle3-step: draft vocabulary size (0: the target's whole vocabulary)")
    parser.add_argument("--batch-size", type=int, default=4, help="--eagle3-step: cache rows a step")
    parser.add_argument("--ttt-steps", type=int, default=4, help="--eagle3-step: unrolled draft steps")
    parser.add_argument("--aux-layers", type=comma_list(int, "--aux-layers"),
                        help="--eagle3-step: fused layers (default [2, L//2, L-3])")
    parser.add_argument("--model", default="mid", help="pipeline: conf/model group (default: mid)")
    parser.add_argument("--precisions", type=comma_list(str, "--precisions"), default=list(pipeline.PRECISIONS),
                        help="pipeline: Lightning precisions, comma-separated")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (pipeline 2, --lucidrains 1)")
    parser.add_argument("--steps", type=int, default=4, help="pipeline: steps per round; --lucidrains: timed rounds")
    parser.add_argument("--rounds", type=int, default=None,
                        help="pipeline: timed rounds, each side (default 3); --eagle3-step: timed rounds (default 12)")
    parser.add_argument("--override", nargs="*", default=[], help="pipeline: extra Hydra overrides")
    parser.add_argument("--sizes", type=comma_list(str, "--sizes"), default=list(train_step.SIZES),
                        help="--lucidrains: sizes, comma-separated")
    parser.add_argument("--windows-per-seq", type=comma_list(int, "--windows-per-seq"), default=[64],
                        help="--lucidrains/--quality: also ours with K random prophet windows per sequence")
    parser.add_argument("--lucidrains-variants", type=comma_list(str, "--lucidrains-variants"),
                        default=list(train_step.LUCIDRAINS_VARIANTS),
                        help="--lucidrains/--quality: lucidrains' variants (as published; +ff: feed-forward applied)")
    parser.add_argument("--size", default="256x4+256x1", help="--quality: size")
    parser.add_argument("--seq-len", type=int, default=256, help="--quality: training sequence length")
    parser.add_argument("--lr", type=float, default=1e-3, help="--quality: Adam learning rate")
    parser.add_argument("--threshold", type=float, default=1.6,
                        help="--quality: stop at this many tokens per call (T=0, teacher-forced on validation)")
    parser.add_argument("--also-report", type=comma_list(float, "--also-report"), default=[],
                        help="--quality: more thresholds, read off the same curves")
    parser.add_argument("--eval-every", type=int, default=20, help="--quality: steps between evaluations")
    parser.add_argument("--max-steps", type=int, default=200, help="--quality: steps at most")
    parser.add_argument("--prompts", type=int, default=8, help="--quality: validation windows and prompts")
    parser.add_argument("--prompt-len", type=int, default=64, help="--quality: prompt bytes")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed (default %(default)s)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 on an oversubscribed CPU)")
    parser.add_argument("--out", help="report stem (default bench/train, bench/train_lucidrains, bench/train_quality, "
                                      "bench/train_eagle3_step: replaced)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out report")
    return parser


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds is None:
        args.rounds = 12 if args.eagle3_step else 3
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    check(args.data is None or Path(args.data).is_file(), f"--data {args.data} is not a file")
    check(args.threads is None or args.threads >= 1, "--threads must be >= 1")
    if args.out:                 # bench/ is the benchmarks' own folder: a report elsewhere is replaced with --force
        check_report(Path(args.out), force=args.force, inputs=[args.data, args.eagle3_step, args.draft_vocab])
    if args.threads:
        torch.set_num_threads(args.threads)
    check(min(args.steps, args.rounds, args.prompts, args.prompt_len) >= 1
          and (args.warmup is None or args.warmup >= 0), "--steps, --rounds, --prompts, --prompt-len must be "
          ">= 1 and --warmup >= 0")
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        path, desc = data_file(args.data, DEFAULT_DATA, Path(tmp))
        if args.eagle3_step:
            check(args.draft_vocab_size >= 0, "--draft-vocab-size must be >= 0 (0: the whole vocabulary)")
            report = eagle3_step.bench_eagle3_step(
                args.eagle3_step, args.draft_vocab, precisions=tuple(args.precisions), rounds=args.rounds,
                warmup=1 if args.warmup is None else args.warmup, batch_size=args.batch_size,
                ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size or None,
                aux_layers=args.aux_layers, seed=args.seed,
                log=lambda line: print(line, file=sys.stderr))
            md, plot, stem, desc = eagle3_step.markdown, None, "train_eagle3_step", f"cache {args.eagle3_step}"
        elif args.lucidrains:
            args.warmup = 1 if args.warmup is None else args.warmup
            report, md, plot, stem = (run_lucidrains(args, path), train_step.markdown, train_step.plot,
                                      "train_lucidrains")
        elif args.quality:
            report, md, plot, stem = (run_quality(args, path), train_quality.markdown, train_quality.plot,
                                      "train_quality")
        else:
            bench = pipeline.PipelineBench(args.model, args.precisions, 2 if args.warmup is None else args.warmup,
                                           args.steps, args.rounds, args.override)
            report = pipeline.bench_pipeline(bench, path, desc, Path(tmp))
            md, plot, stem = pipeline.markdown, None, "train"
    report.update(data=desc, wall_seconds=time.perf_counter() - started, machine=machine(load_before),
                  command=" ".join(["specdec", "bench", "train", *(sys.argv[1:] if argv is None else argv)]))
    text = md(report) + load_note(report)
    paths = write_report(report, Path(args.out) if args.out else REPO / "bench" / stem, text, plot)
    print(text + "\n\nwritten: " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
