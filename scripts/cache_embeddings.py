"""Cache a frozen main model's embeddings for prophet training (task=prophet_frozen, data=enwik8_embeddings).

    python scripts/cache_embeddings.py --export DIR --data PATH --out CACHE_DIR [--seq-len 512]
        [--windows N] [--dtype bfloat16|float16] [--top-k-logits K] [--shard-size 500MB] [--seed 0]

Runs the export's main model once over N random training windows (seq_len + 1 bytes of the
90% training split of PATH, seeded) and writes the tokens, the last-layer embeddings and
optionally the top-K logits as a Hugging Face `datasets` Arrow dataset (see
`train.embeddings_cache`), built next to CACHE_DIR and renamed into place. Then train with

    python -m train experiment=enwik8_prophet_frozen main.export=DIR data=enwik8_embeddings data.cache=CACHE_DIR

Size: about seq_len x dim x 2 bytes per window (bfloat16 or float16) plus 3 x K bytes per token for
top-K logits, e.g. 512 MB per million tokens for dim 256.
"""

from __future__ import annotations

import argparse
import sys

from specdec_models.errors import SpecdecError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", required=True, help="export directory of the main model (decoder or model_with_prophet)")
    parser.add_argument("--data", required=True, help="the training text (raw, .zip or .gz; split 90/5/5 as in training)")
    parser.add_argument("--out", required=True, help="the cache directory to write (must not exist, or --overwrite)")
    parser.add_argument("--seq-len", type=int, default=512, help="window length (data.seq_len of the run); default 512")
    parser.add_argument("--windows", type=int, default=1024, help="number of random training windows; default 1024")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                        help="stored embedding type; default bfloat16")
    parser.add_argument("--top-k-logits", type=int, default=0, help="also store the K largest logits per position")
    parser.add_argument("--shard-size", default="500MB", help="largest Arrow shard (save_to_disk); default 500MB")
    parser.add_argument("--seed", type=int, default=0, help="seed of the window offsets; default 0")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass; default 8")
    parser.add_argument("--device", default=None, help="torch device; default cuda when available, else cpu")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing cache at --out")
    args = parser.parse_args(argv)

    import torch  # after argument parsing: --help stays fast
    from tqdm import tqdm

    from train.embeddings_cache import build_cache

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bars = []                              # the bar opens with the first batch: bad input prints one line

    def progress(tokens: int) -> None:
        if not bars:
            bars.append(tqdm(total=args.windows * args.seq_len, unit="tok", unit_scale=True, desc="caching embeddings"))
        bars[0].update(tokens)

    try:
        meta = build_cache(args.export, args.data, args.out, seq_len=args.seq_len, windows=args.windows,
                           dtype=args.dtype, top_k_logits=args.top_k_logits, shard_size=args.shard_size,
                           seed=args.seed, batch_size=args.batch_size, device=device, overwrite=args.overwrite,
                           progress=progress)
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        for bar in bars:
            bar.close()
    mb_per_million = meta["bytes"] / meta["tokens"]        # bytes per token = MB per million tokens
    print(f"cache: {args.out} ({meta['windows']} windows, {meta['tokens']:,} tokens, {meta['bytes'] / 1e6:,.1f} MB, "
          f"{mb_per_million:,.1f} MB per million tokens, {meta['tokens'] / meta['seconds']:,.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
