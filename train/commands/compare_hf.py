"""Compare specdec's speculative decoding with Hugging Face's own on a pair of local causal LMs.

Run `specdec bench compare-hf --target DIR --draft DIR` with two `save_pretrained` directories
(or hub snapshots already on disk; nothing is downloaded) sharing one tokenizer, e.g. Pythia 1.4B
and 160M (seed 001). Greedy, fp32 by default, batch 1 (transformers' assisted generation refuses
larger batches). It times, best of `--repeats`:
- hf: `target.generate(do_sample=False)`, the reference tokens;
- hf_assisted: `target.generate(assistant_model=draft)` (Hugging Face's speculative decoding);
- specdec_base and specdec_draft: `specdec_models.decode.generate` without and with the draft;
and reports tokens/s, whether each output equals the reference, and specdec's tokens per target
call and acceptance. `--batch N` adds specdec rows at batch N (ragged prompts), which Hugging Face
cannot run assisted (`train.bench.hf.compare_with_assisted`). A skeleton: no plot, one prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specdec_models.cli_args import Parser
from specdec_models.errors import cli_main, prog


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from specdec_models.cpu import add_dtype_argument

    parser = Parser(prog=prog("specdec bench compare-hf"), description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, type=Path, help="directory of the target causal LM")
    parser.add_argument("--draft", required=True, type=Path, help="directory of the draft causal LM")
    parser.add_argument("--gamma", type=int, default=5,
                        help="tokens drafted per round (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens generated per answer (default %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="also time specdec at this batch (ragged prompts)")
    parser.add_argument("--vocab-size", default=None, help="shared vocabulary: an integer or 'min' (padded heads)")
    add_dtype_argument(parser, default="fp32", what="the target's and the draft's dtype")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved runs per setting (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    return parser.parse_args(argv)


def load(path: Path, args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    from specdec_models.cpu import resolve_dtype

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                 dtype=resolve_dtype(args.dtype, args.device))
    return model.to(args.device).eval()


def run(args: argparse.Namespace) -> dict:
    from specdec_models.decode.inputs import check_batch_memory
    from specdec_models.hf import HFDecoder
    from train.bench.hf import compare_with_assisted, prompt_ids

    target, draft = load(args.target, args), load(args.draft, args)
    vocab_size = int(args.vocab_size) if args.vocab_size not in (None, "min") else args.vocab_size
    ids = prompt_ids(args.target, min(target.config.vocab_size, draft.config.vocab_size)).to(args.device)
    check_batch_memory(args.batch, ids.numel() + args.max_new_tokens,      # before the batch's rows are made
                       {"target": HFDecoder(target), "draft": HFDecoder(draft)})
    return compare_with_assisted(target, draft, ids, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                                 batch=args.batch, vocab_size=vocab_size, repeats=args.repeats, device=args.device)


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out is not None:
        from specdec_models.files import check_output

        check_output(args.out, "--out", force=args.force, inputs=[args.target, args.draft])
    results = run(args)
    for name, r in results.items():
        print(f"{name:28s} " + "  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    if args.out is not None:
        from specdec_models.files import write_file

        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.out, lambda f: f.write(json.dumps(results, indent=2).encode()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
