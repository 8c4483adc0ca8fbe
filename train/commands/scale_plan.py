"""An EAGLE-3 head for a large target, on paper: cache size, hours and memory per device.

    specdec scale-plan                                # Llama-3.1-8B and Llama-3.1-70B
    specdec scale-plan --config DIR/config.json ...   # targets of your own (Hugging Face configs)
    specdec scale-plan --ranks 16                     # the sharded target over 16 ranks

Prints, as markdown, the tables of docs/scale.md ("Llama-3.1-8B and 70B, on paper") for 100M
tokens of conversation rows (real tokens: prompts and answers, padding not counted):
- the embeddings cache's size in bf16 and int8, from `row_bytes` (the bytes the cache writes per
  row) of rows of SEQ_LEN positions filled as the SmolLM2 ShareGPT cache was (FILL);
- the hours of the answers, the cache's teacher-forced pass and one epoch of training: the rates
  measured here on SmolLM2-135M are turned into FLOP/s (2 x the target's multiplying parameters
  per token forward, 6 x the head's trained ones per token forward and backward), then scaled by
  FLOPs to the target, on these CPU cores and on an H100 at an assumed MFU;
- memory per device offline (the lean trainer: embedding, final norm, LM head, one layer for
  head.init_layer, the head and its Adam state) and online (the whole target on each device, or,
  split by target.shard across N ranks, its embedding, final norm and LM head whole, 1/N of its
  decoder layers, and two layers whole: the one running and the next being gathered).
Every figure is an estimate from the constants and the FLOPs model of `train.plan` (which `specdec
plan` sizes the recipe with), not a measurement; activations, attention FLOPs and framework overhead
are left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdec_models.cli_args import Parser
from specdec_models.errors import SpecdecError, check, cli_main, prog
from train.plan import (  # noqa: F401  (the measured and assumed constants: tests read them here too)
    ANSWER_SHARE,
    ANSWERS_PER_S,
    CACHE_POSITIONS_PER_S,
    FILL,
    H100_FLOPS,
    LLAMA_3_1,
    MFU,
    SEQ_LEN,
    SMOLLM2,
    TRAIN_ROWS,
    TRAIN_SECONDS,
    TRAIN_STEPS,
    Target,
    cpu_flops,
    gb,
)

# assumed for the tables
DRAFT_VOCAB = 32_000               # the head's LM head rows for Llama 3 (SpecForge's and speculators' configs)
TTT_STEPS = 4                      # unrolled draft steps when training (smollm2_eagle3's task.ttt_steps)
TOKENS = 100e6                     # real tokens of conversation rows


def step_flops(t: Target) -> dict[str, float]:
    """FLOPs of each step for TOKENS real tokens: the answers generate the answer share, the cache's
    pass runs every position of the padded rows, an epoch trains on every real token."""
    return {"answers": TOKENS * ANSWER_SHARE * t.forward_flops(),
            "cache": TOKENS / FILL * t.forward_flops(),
            "train": TOKENS * t.train_flops(DRAFT_VOCAB, TTT_STEPS)}


def tb(size: float) -> str:
    return f"{size / 1e12:,.2f} TB"


def hours(seconds: float) -> str:
    h = seconds / 3600
    return f"{h:,.0f}" if h >= 100 else f"{h:,.1f}" if h >= 1 else f"{h:.2f}"


def tables(targets: list[Target], ranks: int) -> str:
    """The markdown tables of docs/scale.md for `targets`, the online target sharded over `ranks`."""
    names = " | ".join(t.name for t in targets)
    rule = "|---" * (len(targets) + 1) + "|"
    lines = [f"| cache per 100M tokens | {names} |", rule]
    for label, dtype in (("bf16", "bfloat16"), ("int8", "int8")):
        lines.append(f"| {label} | " + " | ".join(
            f"{tb(TOKENS * t.cache_bytes_per_token(dtype))} ({t.cache_bytes_per_token(dtype) / 1024:,.1f} KiB a token)"
            for t in targets) + " |")

    cpu = cpu_flops()
    work = {"answers": f"answers: {TOKENS * ANSWER_SHARE / 1e6:,.1f}M tokens generated",
            "cache": f"cache pass: {TOKENS / FILL / 1e6:,.1f}M positions",
            "train": f"training: one epoch, {TTT_STEPS} draft steps"}
    measured = {"answers": f"{ANSWERS_PER_S:,.0f} tokens/s",
                "cache": f"{CACHE_POSITIONS_PER_S:,.0f} positions/s",
                "train": f"{sum(TRAIN_STEPS.values()):,} steps of {TRAIN_ROWS} x {SEQ_LEN} in "
                         f"{TRAIN_SECONDS / 60:.1f} min"}
    flops = {t.name: step_flops(t) for t in targets}
    lines += ["", f"| per 100M tokens | SmolLM2 here | FLOP/s here | H100 MFU | {names} |",
              "|---" * (len(targets) + 4) + "|"]
    for step in ("answers", "cache", "train"):
        lines.append(f"| {work[step]} | {measured[step]} | {cpu[step] / 1e9:,.0f} G | {MFU[step]:.0%} | " + " | ".join(
            f"{hours(flops[t.name][step] / (H100_FLOPS * MFU[step]))} H100-h "
            f"({hours(flops[t.name][step] / cpu[step])} h here)" for t in targets) + " |")

    memory = {t.name: t.memory(ranks, DRAFT_VOCAB) for t in targets}
    lines += ["", f"| memory per device | {names} |", rule,
              "| target parameters | " + " | ".join(f"{t.params() / 1e9:,.2f} B" for t in targets) + " |",
              "| head parameters: fc + layer, LM head | " + " | ".join(
                  "{:,.0f} M + {:,.0f} M".format(*(p / 1e6 for p in t.head_params(DRAFT_VOCAB)))
                  for t in targets) + " |"]
    for key, label in (("offline", "offline, lean: embedding, final norm, LM head, one layer"),
                       ("online", "online: the whole target"),
                       ("sharded", f"online, sharded over {ranks} ranks (target.shard): embedding and heads whole, "
                                   f"1/{ranks} of the layers, two in full")):
        lines.append(f"| {label} | " + " | ".join(
            f"{gb(memory[t.name][key])} ({gb(memory[t.name][key] + memory[t.name]['head'])} with the head)"
            for t in targets) + " |")
    lines.append("| the head + Adam, every rank | " + " | ".join(gb(memory[t.name]["head"]) for t in targets) + " |")
    return "\n".join(lines)


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog=prog("specdec scale-plan"), description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", metavar="FILE", help="Hugging Face config.json files (default: "
                                                                     "Llama-3.1-8B and 70B)")
    parser.add_argument("--ranks", type=int, default=8, help="ranks the online target is sharded over (default 8)")
    args = parser.parse_args(argv)
    check(args.ranks >= 1, f"--ranks must be >= 1, got {args.ranks}")
    if args.config:
        targets = []
        for name in args.config:
            path = Path(name).expanduser()
            check(path.is_file(), f"--config {name}: no such file")
            try:
                config = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
                raise SpecdecError(f"--config {name}: not a JSON config ({error})") from None
            check(isinstance(config, dict), f"--config {name}: not a JSON object")
            targets.append(Target.from_config(path.parent.name or name, config))
    else:
        targets = [Target.from_config(name, c) for name, c in LLAMA_3_1.items()]
    print(tables(targets, args.ranks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
