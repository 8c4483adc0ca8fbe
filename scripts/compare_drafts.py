"""Which draft should a trained target use? Train the candidates at equal student compute, then
decode with each and compare tokens per target call and speed-up at temperature 0 and 1.

    python scripts/compare_drafts.py --target-export outputs/<run>/export --data ../shared/data/textmix100m.gz

The target is a `model_with_prophet` export of `python -m train`. The candidates (see
`train.compare`): `ce` (a draft trained on corpus next tokens), `<div>/<data>` (the same draft
distilled with fkl, rkl, jsd or tvd on corpus windows or on-policy), `prophet/frozen` (a prophet
trained against the frozen target) and `prophet/joint` (the target's own prophet). Every trained
candidate sees `--steps` x batch x seq_len tokens. Each decodes `--prompts` validation prompts x
`--max-new-tokens` bytes at batch 1 with gamma `--gamma`, interleaved with plain decoding
(`--repeats` rounds). Runs are kept under `--out`/runs and reused (`--retrain` trains again).
Writes `--out`/compare.json, compare.md and compare.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from specdec_models.errors import SpecdecError, check
from specdec_models.files import write_file

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "textmix100m.gz"
POSITIVE = ("steps", "seq_len", "batch_size", "prompt_len", "gamma", "prompts", "prompt_bytes", "max_new_tokens",
            "repeats")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from train.compare import DIVERGENCES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-export", required=True, metavar="DIR", help="a model_with_prophet export")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="enwik8 (or a stand-in): .zip, .gz or raw")
    parser.add_argument("--student", default="small", help="conf/student option of the drafts (default small)")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of every trained candidate")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32, help="on-policy rows: corpus prefix length")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--divergences", nargs="*", default=list(DIVERGENCES), choices=DIVERGENCES)
    parser.add_argument("--data-sources", nargs="*", default=["corpus", "student"], choices=["corpus", "student"])
    parser.add_argument("--no-frozen-prophet", action="store_true", help="skip the frozen-target prophet")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-bytes", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved decoding rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch threads while decoding (default torch's)")
    parser.add_argument("--retrain", action="store_true", help="train again even where a run's export exists")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "compare_drafts")
    args = parser.parse_args(argv)
    for name in POSITIVE:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompt_len >= args.seq_len:
        parser.error("--prompt-len must be shorter than --seq-len")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specdec_models import ModelWithProphet, load_export
    from specdec_models.bench.drafts import compare_drafters
    from train import compare
    from train.data.enwik8 import validation_prompts
    from train.run import run

    budget = compare.Budget(args.data, args.student, args.steps, args.seq_len, args.batch_size, args.prompt_len,
                            args.lr, args.gamma)
    try:
        pair = load_export(args.target_export)
        check(isinstance(pair, ModelWithProphet), f"{args.target_export} is a decoder export: the comparison needs "
                                                  "a model_with_prophet export (its prophet is a candidate)")
        prompts = list(validation_prompts(args.data, args.prompts, args.prompt_bytes))
        args.out.mkdir(parents=True, exist_ok=True)
        entries, n_target, draft_weights = [], compare.weights(pair.model), 0
        for name, kind, overrides in compare.candidates(args.target_export, budget, args.divergences,
                                                        args.data_sources, not args.no_frozen_prophet):
            export, info = compare.train_candidate(name, overrides, args.out / "runs" / name.replace("/", "_"),
                                                   run, args.retrain)
            model = load_export(export).eval()
            if kind == "draft":
                draft_weights = n = compare.weights(model)
            else:
                check(torch.equal(model.model.to_logits.weight, pair.model.to_logits.weight),
                      f"{export}: the frozen prophet's main model is not the target")
                model.model = pair.model                      # decode with the very same target object
                n = compare.weights(model.prophet) + compare.weights(model.to_prophet_start)
            entries.append({"name": name, "kind": kind, "model": model, "export": str(export), **info,
                            **compare.flops(kind, name, budget, n, n_target)})
        entries.append({"name": "prophet/joint", "kind": "prophet", "model": pair, "export": args.target_export})
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        drafters = {e["name"]: {"draft" if e["kind"] == "draft" else "prophet": e["model"]} for e in entries}
        rows = compare_drafters(pair.model, prompts, drafters, gamma=args.gamma, batches={1: len(prompts)},
                                max_new_tokens=args.max_new_tokens, rounds=args.repeats)
    finally:
        torch.set_num_threads(threads)
    compare.entries_from_rows(entries, rows)
    result = {"target": str(Path(args.target_export).resolve()), "target_weights": n_target,
              "draft_weights": draft_weights, "args": {k: str(v) if isinstance(v, Path) else v
                                                       for k, v in vars(args).items()},
              "entries": [{k: v for k, v in e.items() if k != "model"} for e in entries],
              "verdict": compare.verdict(entries),
              "machine": {"cpus": os.cpu_count(), "threads": args.threads or threads,
                          "load_average_1m": os.getloadavg()[0]}}
    write_file(args.out / "compare.json", lambda f: f.write(json.dumps(result, indent=2).encode()))
    table = compare.markdown(result)
    write_file(args.out / "compare.md", lambda f: f.write((table + "\n").encode()))
    compare.plot(result, args.out / "compare.png")
    print(table)
    print(f"\nwritten: {args.out / 'compare.json'}, compare.md, compare.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
