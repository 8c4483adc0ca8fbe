"""Which draft should a trained target use? Train the candidates at equal student compute, then
decode with each and compare tokens per target call and speed-up at temperature 0 and 1.

    specdec bench compare-drafts --target-export outputs/<run>/export --data ../shared/data/textmix100m.gz

The target is a `model_with_prophet` export of `python -m train`. The candidates (see
`train.bench.compare_drafts`): `ce` (a draft trained on corpus next tokens), `<div>/<data>` (the same draft
distilled with fkl, rkl, jsd or tvd on corpus windows or on-policy), `prophet/frozen` (a prophet
trained against the frozen target) and `prophet/joint` (the target's own prophet). Every trained
candidate sees `--steps` x batch x seq_len tokens. Each decodes `--prompts` validation prompts x
`--max-new-tokens` bytes at batch 1 with gamma `--gamma`, interleaved with plain decoding
(`--repeats` rounds). Runs are kept under `--out`/runs and reused (`--retrain` trains again).
Writes `--out`/compare.json, compare.md and compare.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec_models.cli_args import Parser, comma_list
from specdec_models.errors import cli_main, prog

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "textmix100m.gz"
POSITIVE = ("steps", "seq_len", "batch_size", "prompt_len", "gamma", "prompts", "prompt_bytes", "max_new_tokens",
            "repeats")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from train.bench.compare_drafts import DIVERGENCES

    parser = Parser(prog=prog("specdec bench compare-drafts"), description=__doc__.splitlines()[0])
    parser.add_argument("--target-export", required=True, metavar="DIR", help="a model_with_prophet export")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="enwik8 (or a stand-in): .zip, .gz or raw")
    parser.add_argument("--student", default="small", help="conf/student option of the drafts (default small)")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of every trained candidate")
    parser.add_argument("--seq-len", type=int, default=128,
                        help="training sequence length (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="rows per training step (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=32, help="on-policy rows: corpus prefix length")
    parser.add_argument("--lr", type=float, default=2e-3,
                        help="learning rate (default %(default)s)")
    parser.add_argument("--divergences", type=comma_list(str, "--divergences", choices=DIVERGENCES),
                        default=list(DIVERGENCES), help="the divergences trained, comma-separated")
    parser.add_argument("--data-sources", type=comma_list(str, "--data-sources", choices=("corpus", "student")),
                        default=["corpus", "student"], help="corpus, student or both, comma-separated")
    parser.add_argument("--no-frozen-prophet", action="store_true", help="skip the frozen-target prophet")
    parser.add_argument("--gamma", type=int, default=5,
                        help="tokens drafted per round (default %(default)s)")
    parser.add_argument("--prompts", type=int, default=8,
                        help="prompts decoded (default %(default)s)")
    parser.add_argument("--prompt-bytes", type=int, default=64,
                        help="prompt bytes (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="tokens generated per answer (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved decoding rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch threads while decoding (default torch's)")
    parser.add_argument("--retrain", action="store_true", help="train again even where a run's export exists")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "compare_drafts",
                        help="the folder written")
    parser.add_argument("--force", action="store_true",
                        help="write into an --out folder that holds files specdec did not write as a comparison")
    args = parser.parse_args(argv)
    for name in POSITIVE:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompt_len >= args.seq_len:
        parser.error("--prompt-len must be shorter than --seq-len")
    return args


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specdec_models.files import check_output
    from train.bench.compare_drafts import KIND, compare, write_result

    # its runs are kept there and reused: a folder of other files is refused (compare.json: one
    # written before folders were marked)
    check_output(args.out, "--out", kind=KIND, force=args.force, inputs=[args.target_export, args.data],
                 force_does="write into it", records=["compare.json"])
    table = write_result(compare(args), args.out)
    print(table)
    print(f"\nwritten: {args.out / 'compare.json'}, compare.md, compare.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
