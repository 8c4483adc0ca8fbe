"""Count a target's greedy tokens on a hidden-state cache, and measure draft vocabularies.

    specdec draft-vocab --cache CACHE_DIR --out counts.json --sizes 2048,4096,8192,16384,32768

Writes the token-count file task=hf_eagle3 reads (`head.draft_vocab=counts.json`: the head covers
the `head.draft_vocab_size` most counted tokens) and prints, for each size N, the coverage (the
share of the target's greedy tokens on the cache's validation rows that lie in the N tokens most
counted on its training rows: the best greedy acceptance a draft over them can reach) and the draft
cost c (one EAGLE-3 head step with an N-row LM head over one target step, batch 1, timed side by
side in --dtype), beside the full vocabulary. `--report FILE` also writes them as JSON. The cache
needs the target's last layer (specdec cache --layers ... L). The work is
`train.draft_vocab.draft_vocab`, which the recipe (specdec eagle3) calls too.
"""

from __future__ import annotations

import argparse
import sys

from specdec_models.cli_args import Parser, comma_list
from specdec_models.errors import check, cli_main, prog


def parser() -> argparse.ArgumentParser:
    from specdec_models.cpu import add_dtype_argument
    from train.draft_vocab import DRAFT_VOCAB_SIZES

    p = Parser(prog=prog("specdec draft-vocab"), description=__doc__.splitlines()[0])
    p.add_argument("--cache", required=True, help="a hidden-state cache holding the target's last layer")
    p.add_argument("--target", help="model directory or GGUF file (default: the one the cache records)")
    p.add_argument("--out", required=True, help="the token-count file to write (.json)")
    p.add_argument("--sizes", type=comma_list(int, "--sizes"), default=list(DRAFT_VOCAB_SIZES),
                   help="draft vocabulary sizes measured, comma-separated")
    p.add_argument("--val-windows", type=int, default=16, help="the cache's last rows, held out for coverage")
    p.add_argument("--positions", type=int, default=65536, help="answer positions counted, spread over the rows")
    add_dtype_argument(p, what="the dtype c is timed in")
    p.add_argument("--no-timing", action="store_true", help="skip measuring c")
    p.add_argument("--report", help="also write coverage and c as JSON here")
    p.add_argument("--force", action="store_true", help="replace an existing --out (and --report) file")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default %(default)s; none: torch's)")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from train.draft_vocab import DraftVocabJob, draft_vocab

    check(args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}")
    job = DraftVocabJob(cache=args.cache, out=args.out, target=args.target, sizes=tuple(args.sizes),
                        val_windows=args.val_windows, positions=args.positions, dtype=args.dtype,
                        timing=not args.no_timing, report=args.report, force=args.force)
    meta = job.check()
    import torch
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    bar = tqdm(total=meta["windows"], unit="row", desc="counting greedy tokens")
    result = draft_vocab(job, progress=bar.update)
    bar.close()
    print(f"{result.counted:,} greedy tokens counted on {result.train_rows} rows, {result.held_out:,} held out "
          f"on {result.val_rows} -> {args.out}")
    print(result.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
