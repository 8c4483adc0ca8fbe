"""Compare specdec's speculative decoding with Hugging Face's own on a pair of local causal LMs.

Run `python scripts/compare_hf.py --target DIR --draft DIR` with two `save_pretrained` directories
(or hub snapshots already on disk; nothing is downloaded) sharing one tokenizer, e.g. Pythia 1.4B
and 160M (seed 001). Greedy, fp32 by default, batch 1 (transformers' assisted generation refuses
larger batches). It times, best of `--repeats`:
- hf: `target.generate(do_sample=False)`, the reference tokens;
- hf_assisted: `target.generate(assistant_model=draft)` (Hugging Face's speculative decoding);
- specdec_base and specdec_draft: `specdec_models.decode.generate` without and with the draft;
and reports tokens/s, whether each output equals the reference, and specdec's tokens per target
call and acceptance. `--batch N` adds specdec rows at batch N (ragged prompts), which Hugging Face
cannot run assisted. A skeleton: no plot, one prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specdec_models import SpecdecError
from specdec_models.decode import generate

PROMPT = "Speculative decoding: a small model drafts, the large model verifies in one pass."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, type=Path, help="directory of the target causal LM")
    parser.add_argument("--draft", required=True, type=Path, help="directory of the draft causal LM")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="also time specdec at this batch (ragged prompts)")
    parser.add_argument("--vocab-size", default=None, help="shared vocabulary: an integer or 'min' (padded heads)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return parser.parse_args(argv)


def load(path: Path, args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=getattr(torch, args.dtype))
    return model.to(args.device).eval()


def prompt_ids(path: Path, vocab: int) -> torch.Tensor:
    """The prompt through the target's tokenizer, or fixed random ids when the directory has none."""
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(path, local_files_only=True)(PROMPT, return_tensors="pt").input_ids[0]
        if ids.numel() > 0:
            return ids
    except (OSError, ValueError, TypeError):
        pass
    return torch.randint(0, vocab, (16,), generator=torch.Generator().manual_seed(0))


def best_time(fn, repeats: int, device: str):
    best, result = float("inf"), None
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, result


def run(args: argparse.Namespace) -> dict:
    target, draft = load(args.target, args), load(args.draft, args)
    vocab_size = int(args.vocab_size) if args.vocab_size not in (None, "min") else args.vocab_size
    n = args.max_new_tokens
    ids = prompt_ids(args.target, min(target.config.vocab_size, draft.config.vocab_size)).to(args.device)
    hf_kw = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False, "pad_token_id": 0,
             "attention_mask": torch.ones_like(ids[None])}
    results = {}
    t, out = best_time(lambda: target.generate(ids[None], **hf_kw), args.repeats, args.device)
    reference = out[0, ids.numel():].tolist()
    results["hf"] = {"tokens_per_second": n / t, "equal": True}
    t, out = best_time(lambda: target.generate(ids[None], assistant_model=draft, **hf_kw), args.repeats, args.device)
    results["hf_assisted"] = {"tokens_per_second": n / t, "equal": out[0, ids.numel():].tolist() == reference}
    for name, kw in (("specdec_base", {}), ("specdec_draft", {"draft": draft, "gamma": args.gamma})):
        t, (tokens, stats) = best_time(lambda kw=kw: generate(target, [ids], n, temperature=0, vocab_size=vocab_size, **kw),
                                       args.repeats, args.device)
        results[name] = {"tokens_per_second": n / t, "equal": tokens[0].tolist() == reference,
                         "tokens_per_call": stats.tokens_per_call, "acceptance_rate": stats.acceptance_rate}
    if args.batch > 1:
        g = torch.Generator().manual_seed(1)
        rows = [ids[: int(torch.randint(4, ids.numel() + 1, (1,), generator=g))] for _ in range(args.batch)]
        for name, kw in (("base", {}), ("draft", {"draft": draft, "gamma": args.gamma})):
            t, (_, stats) = best_time(lambda kw=kw: generate(target, rows, n, temperature=0, vocab_size=vocab_size, **kw),
                                      args.repeats, args.device)
            results[f"specdec_{name}_batch{args.batch}"] = {"tokens_per_second": stats.new_tokens / t,
                                                             "tokens_per_call": stats.tokens_per_call}
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        results = run(args)
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for name, r in results.items():
        print(f"{name:28s} " + "  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
