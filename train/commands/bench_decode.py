"""Benchmark plain vs speculative decoding (draft model, prophet, lucidrains' prophet) side by side.

    specdec bench decode                                   # seed sizes, random weights
    specdec bench decode --methods base,draft,prophet,lucidrains  # + lucidrains' prophet decoding
    specdec bench decode --gamma 2,3,4,5,6,7,8,auto        # fixed gammas against gamma auto
    specdec bench decode --target-export DIR --gamma 2,3,4,5,6,auto,stored
                                     # stored: gamma auto from the profile training stored in the export
    specdec bench decode --target-export DIR [--draft-export DIR]

Settings run interleaved in one process (base, draft, prophet, ..., base, ...) and c and v come
from the model calls timed inside the same runs (see `train.bench.decode`). Writes
bench/decode.json, bench/decode.md and bench/decode.png (`--out`) and prints the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from specdec_models.cli_args import Parser, comma_list
from specdec_models.decode.inputs import parse_gamma
from specdec_models.errors import check, cli_main, prog
from train.bench.decode import METHODS, DecodeBench, markdown, run, write_report
from train.bench.report import check_report

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "bench" / "decode.json"


def gamma_setting(text: str) -> int | str:
    return text if text == "stored" else parse_gamma(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog=prog("specdec bench decode"), description=__doc__.splitlines()[0])
    parser.add_argument("--target-export", metavar="DIR", help="trained target (decoder or model_with_prophet)")
    parser.add_argument("--draft-export", metavar="DIR", help="trained draft decoder (needs --target-export)")
    parser.add_argument("--methods", type=comma_list(str, "--methods", choices=METHODS),
                        default=["base", "draft", "prophet"],
                        metavar="{" + ",".join(METHODS) + "},...",
                        help="base always runs; lucidrains = lucidrains' prophet decoding, as published and with "
                             "its feed-forward blocks applied")
    parser.add_argument("--gamma", type=comma_list(gamma_setting, "--gamma"), default=[5],
                        help="comma-separated gammas, auto, or stored (auto from the export's stored profile)")
    parser.add_argument("--batch", type=comma_list(int, "--batch"), default=[1, 8],
                        help="batch sizes, comma-separated (default 1,8)")
    parser.add_argument("--max-new-tokens", type=int, default=200,
                        help="tokens generated per answer (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per setting (merged)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature, 0 greedy (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=None, help="default: none (the whole vocabulary)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on shared cores, extra threads wait on each other)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output; .md and .png go next to it (default bench/decode.json, replaced)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out report")
    return parser.parse_args(argv)


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check(args.threads >= 1, f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    bench = DecodeBench(batches=args.batch, methods=args.methods, gammas=args.gamma,
                        max_new_tokens=args.max_new_tokens, repeats=args.repeats, temperature=args.temperature,
                        top_k=args.top_k, seed=args.seed, target_export=args.target_export,
                        draft_export=args.draft_export)
    # bench/ is the benchmarks' own folder: its reports are replaced; one elsewhere only with --force
    check_report(args.out or DEFAULT_OUT, force=args.force or args.out is None,
                 inputs=[args.target_export, args.draft_export])
    args.out = args.out or DEFAULT_OUT
    report = run(bench)
    paths = write_report(report, args.out)
    print(markdown(report))
    print(f"\nwrote {', '.join(map(str, paths))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
