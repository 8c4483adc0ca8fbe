"""An EAGLE-3 head for a large target, on paper: cache size, hours and memory per device.

    python scripts/scale_plan.py                                # Llama-3.1-8B and Llama-3.1-70B
    python scripts/scale_plan.py --config DIR/config.json ...   # targets of your own (Hugging Face configs)
    python scripts/scale_plan.py --ranks 16                     # the sharded target over 16 ranks

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
Every figure is an estimate from the constants below, not a measurement; activations, attention
FLOPs and framework overhead are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

from specdec_models.errors import SpecdecError, check, check_positive_int, cli_main

# the models' published config.json (meta-llama/Llama-3.1-8B and meta-llama/Llama-3.1-70B; the -Instruct
# variants have the same shapes), untied embeddings
LLAMA_3_1 = {
    "Llama-3.1-8B": {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256, "intermediate_size": 14336,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "Llama-3.1-70B": {"hidden_size": 8192, "num_hidden_layers": 80, "vocab_size": 128256, "intermediate_size": 28672,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False},
}
# SmolLM2-135M-Instruct (its config.json), the target of the measurements below
SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "intermediate_size": 1536,
           "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}

# measured here: the recipe on SmolLM2 (scripts/eagle3.py --data sharegpt, 2 CPU cores, bf16; docs/results.md)
SEQ_LEN = 512                      # the cache's rows
FILL = 118_940 / (347 * 512)       # real tokens of the cache's positions (347 rows: 118,940 real tokens)
ANSWER_SHARE = 82_604 / 118_940    # answer tokens of the real ones (the loss mask's 1s)
ANSWERS_PER_S = 82_961 / 1082.2    # tokens generated per second (multi-turn, batch 128, T=0 and 1)
CACHE_POSITIONS_PER_S = 347 * 512 / 234.5    # the cache step: 347 rows of 512 positions in 234.5 s
TRAIN_SECONDS = 1582.9             # the training step: 1,643 steps of 4 rows in 26.4 minutes
TRAIN_ROWS = 4
# unrolled draft steps -> optimizer steps: task.ttt_ramp=0.5 trains draft step 1 alone for the first half of the
# time budget (the training loss jumps at step ~1,200, when all 4 start)
TRAIN_STEPS = {1: 1200, 4: 443}
SMOLLM2_DRAFT_VOCAB = 8192

# assumed
DRAFT_VOCAB = 32_000               # the head's LM head rows for Llama 3 (SpecForge's and speculators' configs)
TTT_STEPS = 4                      # unrolled draft steps when training (smollm2_eagle3's task.ttt_steps)
TOKENS = 100e6                     # real tokens of conversation rows
H100_FLOPS = 989e12                # H100 SXM dense bf16 peak
MFU = {"answers": 0.10,            # HF generate loop, batch 128, decode-bound
       "cache": 0.40,              # teacher-forced forward, prefill-like (SpecForge measured ~43% on prefill)
       "train": 0.30}              # one decoder layer, fc and a 32k LM head, forward and backward
ADAM_BYTES = 16                    # per trained parameter: fp32 weight, gradient, two Adam moments (bf16-mixed)
BF16 = 2
CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads")


class Target(NamedTuple):
    """A Llama-shaped target's sizes (a Hugging Face config's names, shortened)."""

    name: str
    hidden: int
    layers: int
    vocab: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_config(cls, name: str, config: dict) -> Target:
        config = config.get("text_config", config)
        missing = [k for k in CONFIG_KEYS if k not in config]
        check(not missing, f"{name}: the config lacks {', '.join(missing)}")
        heads = config["num_attention_heads"]
        values = [config[k] for k in CONFIG_KEYS] + [config.get("num_key_value_heads") or heads,
                                                     config.get("head_dim") or config["hidden_size"] // heads]
        for key, value in zip((*CONFIG_KEYS, "num_key_value_heads", "head_dim"), values, strict=True):
            check_positive_int(value, f"{name}: {key}")
        h, n, v, i, heads, kv, hd = values
        return cls(name, h, n, v, i, heads, kv, hd, bool(config.get("tie_word_embeddings", False)))

    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o, the SwiGLU feed-forward, two norms."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv + 3 * h * self.inter + 2 * h

    def params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden

    def forward_flops(self) -> float:
        """Per token: 2 x every parameter that multiplies (the input embedding is a lookup, unless it
        is also the LM head)."""
        return 2.0 * (self.params() - (0 if self.tied else self.vocab * self.hidden))

    def head_params(self, draft_vocab: int) -> tuple[int, int]:
        """(fc + decoder layer + norm, LM head) of its EAGLE-3 head: the layer's q, k, v read 2H."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = 2 * h * q + 2 * 2 * h * kv + q * h + 3 * h * self.inter + 3 * h      # 3 norms: embedding, feature, mlp
        return 3 * h * h + layer + h, h * draft_vocab

    def train_flops(self, draft_vocab: int, steps: int) -> float:
        """Per real token of a row, forward and backward: step 0 runs the fc and the layer everywhere,
        steps 1.. only on answer chains; both LM heads (the head's, trained, and the target's rows
        of the draft vocabulary, forward only) run at answer positions."""
        body, lm_head = self.head_params(draft_vocab)
        return (6.0 * body * (1 + (steps - 1) * ANSWER_SHARE) + 6.0 * lm_head * steps * ANSWER_SHARE
                + 2.0 * self.hidden * draft_vocab * ANSWER_SHARE)

    def cache_bytes_per_token(self, dtype: str) -> float:
        """Bytes per real token of a conversation cache of the head's layers ([2, L//2, L-3] and the
        last), padding included."""
        from specdec_models.heads.eagle3 import default_aux_layers
        from train.data.chat_rows import ChatRows
        from train.data.embeddings_cache import row_bytes

        layers = len(default_aux_layers(self.layers)) + 1
        return row_bytes(SEQ_LEN, self.hidden, dtype, 0, self.vocab, ChatRows.columns, layers) / SEQ_LEN / FILL

    def memory(self, ranks: int, draft_vocab: int) -> dict[str, float]:
        """Bytes per device of weights and optimizer state: the target's part in each mode, and the
        head with its Adam state (on every rank in every mode: the head trains data-parallel)."""
        layer = self.layer_params() * BF16
        kept = (2 * self.vocab * self.hidden + self.hidden) * BF16       # embedding, final norm, LM head
        # target.shard keeps those whole on every rank, splits the layers, and holds two in full (the one
        # running, the next being gathered)
        return {"offline": kept + layer,
                "online": self.params() * BF16,
                "sharded": kept + (self.params() * BF16 - kept) / ranks + 2 * layer,
                "head": sum(self.head_params(draft_vocab)) * ADAM_BYTES}


def cpu_flops() -> dict[str, float]:
    """The FLOP/s the measured SmolLM2 rates stand for, per step."""
    smol = Target.from_config("SmolLM2-135M", SMOLLM2)
    tokens_per_step = TRAIN_ROWS * SEQ_LEN * FILL
    train = sum(n * smol.train_flops(SMOLLM2_DRAFT_VOCAB, k) for k, n in TRAIN_STEPS.items()) * tokens_per_step
    return {"answers": ANSWERS_PER_S * smol.forward_flops(),
            "cache": CACHE_POSITIONS_PER_S * smol.forward_flops(),
            "train": train / TRAIN_SECONDS}


def step_flops(t: Target) -> dict[str, float]:
    """FLOPs of each step for TOKENS real tokens: the answers generate the answer share, the cache's
    pass runs every position of the padded rows, an epoch trains on every real token."""
    return {"answers": TOKENS * ANSWER_SHARE * t.forward_flops(),
            "cache": TOKENS / FILL * t.forward_flops(),
            "train": TOKENS * t.train_flops(DRAFT_VOCAB, TTT_STEPS)}


def gb(size: float) -> str:
    return f"{size / 1e9:,.1f} GB"


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
