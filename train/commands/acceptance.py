"""Acceptance of trained prophets (or drafts) on validation prompts: a table, one row per export.

    specdec bench acceptance --export outputs/a/export outputs/b/export [--draft DIR] \\
        --data ../shared/data/textmix100m.gz --prompts 32 --max-new-tokens 128

Each model_with_prophet export decodes `--prompts` fixed validation prompts (the evaluation
callback's, from the enwik8 DataModule) with its own prophet, batched, at temperature 0 and 1,
seeded; with `--draft DIR` every export's main model is drafted by that decoder instead. Reports
acceptance rate, tokens per target call and alpha (counts, not timings: load on the machine does
not change them).
"""

from __future__ import annotations

import sys

import torch

from specdec_models import ModelWithProphet, SpecdecError, load_export
from specdec_models.cli_args import Parser, comma_list
from specdec_models.decode import DraftModel, HeadDrafter, SamplingConfig, generate
from specdec_models.errors import check_positive_int, cli_main, prog


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog=prog("specdec bench acceptance"), description=__doc__.splitlines()[0])
    parser.add_argument("--export", nargs="+", required=True,
                        help="model_with_prophet exports (or targets with --draft)")
    parser.add_argument("--draft", help="a decoder export drafting for every target instead of its prophet")
    parser.add_argument("--data", required=True, help="enwik8 or a stand-in (.zip, .gz or raw)")
    parser.add_argument("--prompts", type=int, default=32,
                        help="prompts decoded (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=64,
                        help="prompt bytes (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="tokens generated per answer (default %(default)s)")
    parser.add_argument("--gamma", type=int, default=5,
                        help="tokens drafted per round (default %(default)s)")
    parser.add_argument("--temperatures", type=comma_list(float, "--temperatures"), default=[0.0, 1.0],
                        help="sampling temperatures, comma-separated (default 0,1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed (default %(default)s)")
    args = parser.parse_args(argv)
    from train.data.enwik8 import validation_prompts

    for flag, value in (("--prompts", args.prompts), ("--prompt-len", args.prompt_len),
                        ("--max-new-tokens", args.max_new_tokens), ("--gamma", args.gamma)):
        check_positive_int(value, flag)
    for temperature in args.temperatures:
        SamplingConfig(temperature)                  # a finite number >= 0
    prompts = validation_prompts(args.data, args.prompts, args.prompt_len)
    draft = load_export(args.draft) if args.draft else None
    print("| export | temperature | acceptance rate | tokens / call | alpha |\n|---|---|---|---|---|")
    for directory in args.export:
        model = load_export(directory)
        if draft is None and not isinstance(model, ModelWithProphet):
            raise SpecdecError(f"{directory} has no prophet: pass --draft DIR")
        target = model.model if isinstance(model, ModelWithProphet) else model
        drafter = DraftModel(draft) if draft is not None else HeadDrafter(model)
        for temperature in args.temperatures:
            _, stats = generate(target, prompts, args.max_new_tokens, drafter, gamma=args.gamma,
                                sampling=SamplingConfig(temperature),
                                generator=torch.Generator().manual_seed(args.seed))
            print(f"| {directory} | {temperature:g} | {stats.acceptance_rate:.3f} | {stats.tokens_per_call:.2f} | "
                  f"{stats.alpha:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
