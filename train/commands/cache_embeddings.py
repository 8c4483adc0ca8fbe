"""Cache a frozen model's hidden states for prophet and EAGLE-3 heads (see train/data/embeddings_cache.py).

    # a specdec export's main model on byte windows (task=prophet_frozen, data=enwik8_embeddings)
    specdec cache --export DIR --data PATH --out CACHE_DIR [--top-k-logits K]
    # a Hugging Face target (task=hf_prophet, data=hf_embeddings): its own continuations of prompts ...
    specdec cache --gguf FILE --prompts prompts.jsonl --chat --temperatures 0,1 --out CACHE_DIR
    # ... or token windows of text files
    specdec cache --hf-model DIR --text a.txt b.jsonl --out CACHE_DIR
    # an EAGLE-3-class head of a 30-layer target: aux layers 2, 15, 27 and the last one
    specdec cache --gguf FILE --prompts prompts.jsonl --chat --layers 2,15,27,-1 --out CACHE_DIR
    common: [--seq-len N] [--windows N] [--dtype bf16|fp16|int8] [--shard-size 500MB] [--seed 0] [--overwrite]

--layers (HF only) picks the `hidden_states` indices stored (i: the input of decoder layer i, 0 the
embedding output, -1 or L the last layer after the final norm; default: the last only). Regenerated
rows (--prompts) end at the target's end-of-turn token (the chat template's, else its EOS) and are
padded after it; their valid_len column counts the real tokens. Their hidden states are those the
generating calls computed (no second pass over the rows; train/data/regenerate.py).

It prints the size the cache will take before it starts. Shards are written one by one into
CACHE_DIR.partial and the finished cache is renamed to CACHE_DIR; a killed build keeps its
finished shards, and running the same command again resumes it. Size per token and layer: 2 x dim
bytes (bfloat16, float16) or dim + 4 bytes (int8 with a scale per token and layer), plus the token
id; e.g. for SmolLM2-135M (dim 576) 1,154 bytes (bfloat16) or 582 bytes (int8) per token for one
layer, 4,610 or 2,330 bytes for four.
"""

from __future__ import annotations

import sys

from specdec_models.cli_args import Parser, comma_list
from specdec_models.errors import check, cli_main, prog


def build_parser() -> Parser:
    """The command line, every flag with its help."""
    from specdec_models.cpu import STORAGE_DTYPES, add_dtype_argument
    from specdec_models.device import HELP

    parser = Parser(prog=prog("specdec cache"),
                                     description=__doc__.splitlines()[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--export", help="export directory of a specdec main model (decoder or model_with_prophet)")
    model.add_argument("--hf-model", metavar="DIR", help="a local Hugging Face causal LM directory")
    model.add_argument("--gguf", metavar="FILE", help="a GGUF file of a Hugging Face causal LM")
    parser.add_argument("--data", help="--export: the training text (raw, .zip or .gz; split 90/5/5 as in training)")
    parser.add_argument("--text", nargs="+", metavar="FILE", help="HF: .txt/.json/.jsonl files cut into token windows")
    parser.add_argument("--prompts", metavar="FILE", help="HF: prompts (.txt lines, or .jsonl with 'messages', "
                                                         "'prompt' or 'text') the target continues itself")
    parser.add_argument("--chat", action="store_true", help="HF: format prompts (or text) with the chat template")
    parser.add_argument("--exclude-prompts-of", nargs="+", metavar="CACHE", default=[],
                        help="HF with --prompts: leave out the prompts these regenerated caches continued (fresh "
                             "answers for a head trained on with head.init_from)")
    parser.add_argument("--temperatures", type=comma_list(float, "--temperatures"), default=[1.0],
                        help="--prompts: sampling temperatures, row i uses the (i mod count)-th; default 1")
    parser.add_argument("--out", required=True, help="the cache directory to write (must not exist, or --overwrite)")
    parser.add_argument("--seq-len", type=int, default=512, help="row length (data.seq_len of the run); default 512")
    parser.add_argument("--windows", type=int, default=1024,
                        help="number of rows (each a window of --seq-len tokens); default 1024")
    add_dtype_argument(parser, default="bf16", allowed=STORAGE_DTYPES,
                       what="the stored hidden states' dtype (int8: absmax per token, with its scale)")
    parser.add_argument("--top-k-logits", type=int, default=0, help="--export: also store the K largest logits")
    parser.add_argument("--layers", type=comma_list(int, "--layers"), default=None, metavar="I,J,...",
                        help="HF: hidden_states indices to store, comma-separated (negative from the end); "
                             "default: the last one")
    parser.add_argument("--shard-size", default="500MB",
                        help="largest Arrow shard, unless one --batch-size of rows is larger; default 500MB")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rows (and of sampling); default 0")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward pass (and per generate call)")
    parser.add_argument("--device", default="auto", help=f"auto (default; {HELP}), cpu, cuda[:N] or mps")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_dtype_argument(parser, "--model-dtype", what="HF: the dtype the target runs in")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="HF: a time budget for making the rows once the target is loaded: a batch starts only "
                             "if it should end within it (as long as the last one took), else a smaller last batch of "
                             "the rows that should, and the cache holds the rows made by then (the first rows of the "
                             "full build)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing cache at --out")
    return parser


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import torch  # after argument parsing: --help stays fast
    from tqdm import tqdm

    from specdec_models.cpu import resolve_device, resolve_dtype
    from specdec_models.device import pick_device
    from specdec_models.files import check_not_input
    from train.data.embeddings_cache import BuildRun, CacheSettings, build_cache
    from train.data.regenerate import HFRows, build_hf_cache

    check(args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = str(resolve_device(pick_device(args.device), "--device"))     # not here: one line, before any work
    bars = []                              # the bar opens with the first batch: bad input prints one line

    def progress(tokens: int) -> None:
        if not bars:
            bars.append(tqdm(total=args.windows * args.seq_len, unit="tok", unit_scale=True, desc="caching"))
        bars[0].update(tokens)

    settings = CacheSettings(seq_len=args.seq_len, windows=args.windows, dtype=args.dtype,
                             top_k_logits=args.top_k_logits, shard_size=args.shard_size, seed=args.seed,
                             batch_size=args.batch_size)
    # --overwrite replaces a cache at --out, never one of the command's inputs
    inputs = [args.export, args.hf_model, args.gguf, args.data, args.prompts, *(args.text or []),
              *args.exclude_prompts_of]
    try:
        check(args.max_minutes is None or args.max_minutes > 0, f"--max-minutes must be > 0, got {args.max_minutes}")
        if args.export:
            check(args.data is not None and not (args.text or args.prompts or args.layers or args.max_minutes
                                                 or args.exclude_prompts_of),
                  "--export reads --data PATH (not --text, --prompts, --layers, --max-minutes or "
                  "--exclude-prompts-of)")
            check_not_input(args.out, inputs, "--out", "--overwrite")
            meta = build_cache(args.export, args.data, args.out, settings,
                               BuildRun(args.overwrite, progress, print), device)
        else:
            check(args.data is None and not args.top_k_logits, "--data and --top-k-logits are for --export; a "
                                                                "Hugging Face target reads --text FILE ... or "
                                                                "--prompts FILE")
            check_not_input(args.out, inputs, "--out", "--overwrite")
            rows = HFRows(text=args.text, prompts=args.prompts, chat=args.chat, temperatures=args.temperatures,
                          layers=args.layers, exclude_prompts_of=args.exclude_prompts_of)
            run = BuildRun(args.overwrite, progress, print,
                           None if args.max_minutes is None else 60 * args.max_minutes)
            meta = build_hf_cache(args.hf_model or args.gguf, args.out, rows, settings, run, device,
                                  resolve_dtype(args.model_dtype, device))
    finally:
        for bar in bars:
            bar.close()
    mb_per_million = meta["bytes"] / meta["tokens"]        # bytes per token = MB per million tokens
    rows = f"{meta['windows']} windows"
    if "requested_windows" in meta:
        rows += f" of the {meta['requested_windows']} asked: --max-minutes ran out"
    print(f"cache: {args.out} ({rows}, {meta['tokens']:,} tokens, {meta['bytes'] / 1e6:,.1f} MB, "
          f"{mb_per_million:,.1f} MB per million tokens, {meta['tokens'] / meta['seconds']:,.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
