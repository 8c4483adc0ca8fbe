"""Count a target's greedy tokens on a hidden-state cache, and measure draft vocabularies.

    python scripts/draft_vocab.py --cache CACHE_DIR --out counts.json --sizes 2048 4096 8192 16384 32768

Writes the token-count file task=hf_eagle3 reads (`head.draft_vocab=counts.json`: the head covers
the `head.draft_vocab_size` most counted tokens) and prints, for each size N, the coverage (the
share of the target's greedy tokens on the cache's validation rows that lie in the N tokens most
counted on its training rows: the best greedy acceptance a draft over them can reach) and the draft
cost c (one EAGLE-3 head step with an N-row LM head over one target step, batch 1, timed side by
side in --dtype), beside the full vocabulary. `--report FILE` also writes them as JSON. The cache
needs the target's last layer (scripts/cache_embeddings.py --layers ... L).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specdec_models.errors import SpecdecError, check


def time_costs(target, sizes: list[int], context: int = 200, repeats: int = 20) -> dict[int, float]:
    """{N: c} for an EAGLE-3 head whose LM head has N rows (N = the target's vocabulary too),
    interleaved with 1-token target steps on a `context`-token cache; medians of `repeats`."""
    import torch

    from specdec_models.hf import HFDecoder
    from specdec_models.heads.eagle3 import Eagle3Config, Eagle3Head

    dec = HFDecoder(target)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, dec.vocab_size, (1, context), generator=g)
    cache = dec.new_cache(1, context + 2, keep_layers=[0, 1, 2])
    dec(ctx, cache=cache)
    heads = {}
    for n in sizes:
        head = Eagle3Head(Eagle3Config.for_target(target, draft_vocab_size=n, aux_layers=[0, 1, 2]), target).eval()
        hcache = head.new_cache(1, context + 2)
        feature = head.extend(ctx[:, 1:], head.fuse(cache.layer_states[:, :-1]), hcache)[:, -1:]
        heads[n] = (head, hcache, feature)
    times: dict[str, list[float]] = {}
    tok = ctx[:, :1]
    with torch.inference_mode():
        for _ in range(repeats + 2):
            length = cache.lengths.clone()
            t0 = time.perf_counter()
            dec(tok, cache=cache, logits_at=torch.zeros(1, dtype=torch.long))
            times.setdefault("target", []).append(time.perf_counter() - t0)
            cache.rollback(length)
            for n, (head, hcache, feature) in heads.items():
                length = hcache.lengths.clone()
                t0 = time.perf_counter()
                head.logits(head.extend(tok, feature, hcache)[:, -1])
                times.setdefault(n, []).append(time.perf_counter() - t0)
                hcache.rollback(length)
    step = statistics.median(times["target"][2:])
    return {n: statistics.median(times[n][2:]) / step for n in sizes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True, help="a hidden-state cache holding the target's last layer")
    parser.add_argument("--target", help="model directory or GGUF file (default: the one the cache records)")
    parser.add_argument("--out", required=True, help="the token-count file to write (.json)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--val-windows", type=int, default=16, help="the cache's last rows, held out for coverage")
    parser.add_argument("--positions", type=int, default=65536, help="answer positions counted, spread over the rows")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="for the timing of c; default auto: the dtype decoding runs in here (bfloat16 with bf16 "
                             "instructions, else float32: specdec_models/cpu)")
    parser.add_argument("--no-timing", action="store_true", help="skip measuring c")
    parser.add_argument("--report", help="also write coverage and c as JSON here")
    parser.add_argument("--force", action="store_true", help="replace an existing --out (and --report) file")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    try:
        from specdec_models.files import check_output

        out = Path(args.out).expanduser()
        check(not out.is_dir(), f"--out {args.out} is a directory: give the .json file to write")
        check_output(args.out, "--out", force=args.force, inputs=[args.cache, args.target])
        if args.report:
            check(out.resolve() != Path(args.report).expanduser().resolve(), "--report must be another file than --out")
            check_output(args.report, "--report", force=args.force, inputs=[args.cache, args.target])
        check(all(n >= 1 for n in args.sizes), "--sizes must be positive")
        check(args.positions >= 1 and args.val_windows >= 1, "--positions and --val-windows must be >= 1")
        check(args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}")
        import numpy as np
        import torch
        from tqdm import tqdm

        from specdec_models.heads.eagle3 import choose_draft_vocab
        from specdec_models.hf.weights import load_causal_lm, load_tokenizer
        from train.data.embeddings_cache import check_cache
        from train.draft_vocab import count_greedy_tokens, write_counts

        if args.threads:
            torch.set_num_threads(args.threads)
        meta = check_cache(args.cache)
        check(meta["windows"] > args.val_windows, f"--val-windows {args.val_windows} leaves no training rows")
        too_big = [n for n in args.sizes if n >= meta.get("vocab_size", n + 1)]
        check(not too_big, f"--sizes {' '.join(map(str, too_big))}: a draft vocabulary is smaller than the target's "
                           f"{meta.get('vocab_size')} tokens (the full vocabulary is measured anyway)")
        target_path = args.target or meta["model"].get("path")
        check(target_path, "the cache records no target path: give --target")
        tokenizer = load_tokenizer(target_path, "target")
        from specdec_models.cpu import resolve_dtype

        dtype = resolve_dtype(args.dtype, "cpu")
        target = load_causal_lm(target_path, dtype=dtype, what="target")
        train_rows = np.arange(meta["windows"] - args.val_windows)
        val_rows = np.arange(meta["windows"] - args.val_windows, meta["windows"])
        bar = tqdm(total=meta["windows"], unit="row", desc="counting greedy tokens")
        counts = count_greedy_tokens(args.cache, target, train_rows, positions=args.positions, progress=bar.update)
        held = count_greedy_tokens(args.cache, target, val_rows, positions=1 << 30, progress=bar.update)
        bar.close()
        vocab = counts.numel()
        sizes = sorted({n for n in args.sizes if n < vocab})
        costs = {} if args.no_timing else time_costs(target, sizes + [vocab])
        rows = []
        for n in sizes + [vocab]:
            ids = choose_draft_vocab(counts, n)
            covered = float(held[ids].sum()) / max(float(held.sum()), 1.0)
            rows.append({"size": n, "coverage": covered, "c": costs.get(n)})
        write_counts(out, counts, tokenizer, {"cache": str(Path(args.cache).resolve()), "rows": len(train_rows)})
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{int(counts.sum()):,} greedy tokens counted on {len(train_rows)} rows, {int(held.sum()):,} held out "
          f"on {len(val_rows)} -> {args.out}")
    print(f"| draft vocabulary | coverage of held-out greedy tokens | c ({'bf16' if dtype == torch.bfloat16 else 'fp32'} "
          "step ratio) |")
    print("|---|---|---|")
    for r in rows:
        c = "" if r["c"] is None else f"{r['c']:.3f}"
        print(f"| {r['size']:,}{' (full)' if r['size'] == vocab else ''} | {r['coverage']:.3f} | {c} |")
    if args.report:
        from specdec_models.files import write_file

        text = json.dumps({"dtype": str(dtype).removeprefix("torch."), "rows": rows}, indent=2)
        write_file(Path(args.report), lambda f: f.write(text.encode("utf-8")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
