"""What the EAGLE-3 recipe will use for a target on a device, each size with its reason: `specdec plan`.

    specdec plan --target DIR|FILE.gguf|config.json [--device auto|cpu|cuda] [--gpu-memory 80GiB] [--gpus N]

Only the target's shape is read (a model folder's config.json, a config.json, or a GGUF file's
header through the `gguf` package): no weights are loaded, nothing is written. `plan_recipe` sizes
what the recipe (specdec eagle3, `train.eagle3_recipe`) uses, and the recipe calls it too for
every size its command line does not give:
- on a GPU, the answers step's engine rows (--answer-chunk) and written parts (--answer-batch) and
  the cache step's rows per teacher-forced pass (--cache-batch), from the memory left once the
  target's bf16 weights are in and RESERVED of the device is kept free: an answering row holds
  seq_len + 1 positions of keys and values (layers x kv_heads x head_dim x 2 x 2 bytes each) and a
  step's logits; a cache row holds every layer's hidden states (transformers keeps them all) and one
  layer's activations, seq_len positions of them. Each is a power of two, at most the GPU
  experiment's (conf/experiment/hf_eagle3_gpu.yaml's `recipe` block). A target whose weights do not
  fit, or a memory that fits no row, is refused: the answers and cache steps hold the whole target
  on each GPU. On a CPU, the sizes measured on 2 cores (CPU_SIZES, `train.eagle3_recipe.Settings`' defaults);
- the draft vocabulary from the target's (`draft_vocab_size`) and the aux layers (EAGLE-3's
  [2, L//2, L-3] and the last, `specdec_models.heads.eagle3.default_aux_layers`);
- the training minutes on a GPU from the rows (TRAIN_EPOCHS epochs), the cache's bytes, and the
  hours of each step.
Every time is an estimate from FLOPs: 2 x the target's multiplying parameters per token forward, 6
x the head's trained ones forward and backward (`Target`), at an H100's peak and an assumed MFU per
step on a GPU, or at the rates measured on SmolLM2-135M on 2 CPU cores (`cpu_flops`) on a CPU.
specdec scale-plan prints docs/scale.md's tables from the same model.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from specdec_models.cli_args import Parser
from specdec_models.errors import SpecdecError, check, check_positive_int, cli_main, prog

REPO = Path(__file__).resolve().parents[1]
GPU_EXPERIMENT = REPO / "conf" / "experiment" / "hf_eagle3_gpu.yaml"     # the recipe's GPU training and its caps
CPU_EXPERIMENT = REPO / "conf" / "experiment" / "smollm2_eagle3.yaml"    # the recipe's CPU training

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

# measured here: the recipe on SmolLM2 (specdec eagle3 --data sharegpt, 2 CPU cores, bf16; docs/results.md)
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
H100_FLOPS = 989e12                # H100 SXM dense bf16 peak
MFU = {"answers": 0.10,            # HF generate loop, batch 128, decode-bound
       "cache": 0.40,              # teacher-forced forward, prefill-like (SpecForge measured ~43% on prefill)
       "train": 0.30}              # one decoder layer, fc and a 32k LM head, forward and backward
ADAM_BYTES = 16                    # per trained parameter: fp32 weight, gradient, two Adam moments (bf16-mixed)
BF16 = 2
CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads")
# the draft vocabularies the recipe's draft_vocab step measures (coverage on the cache, `train.draft_vocab`)
DRAFT_VOCAB_SIZES = (2048, 4096, 8192, 16384, 32768)
# the draft vocabulary holds at least 1/DRAFT_VOCAB_SHARE of the target's: SmolLM2's 49,152 -> 8,192 (coverage 0.95
# measured, docs/eagle3.md), Llama 3's 128,256 -> 32,768 (speculators' and SpecForge's Llama 3 heads: 32,000)
DRAFT_VOCAB_SHARE = 6
# a GPU's memory kept free of weights and rows: CUDA's context, the allocator's fragmentation, the activations of a
# 4,096-token prefill (`train.data.answer_engine.PREFILL_TOKENS`)
RESERVED = 0.15
TRAIN_EPOCHS = 10                  # assumed: EAGLE-3's trainers run several epochs over their rows
# the recipe's sizes on a CPU, measured on 2 cores (docs/eagle3.md): `train.eagle3_recipe.Settings`' defaults
CPU_SIZES = {"conversations": 1200, "answer_chunk": 64, "answer_batch": 64, "cache_batch": 16, "train_minutes": 30.0}
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


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

    def kv_bytes_per_token(self, dtype_bytes: int = BF16) -> int:
        """Keys and values of one position: layers x kv_heads x head_dim x 2 (key, value) x dtype."""
        return self.layers * self.kv_heads * self.head_dim * 2 * dtype_bytes

    def pass_bytes_per_token(self, dtype_bytes: int = BF16) -> int:
        """What a teacher-forced pass that returns its hidden states holds per position: every
        layer's output and the embedding's (L + 1 of them, kept to the end), and one layer's
        activations at a time (q, k, v, o, the feed-forward's gate, up and product)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return ((self.layers + 1) * self.hidden + 2 * q + 2 * kv + 3 * self.inter) * dtype_bytes

    def aux_layers(self) -> list[int]:
        """The `hidden_states` indices the recipe caches: EAGLE-3's aux layers and the last."""
        from specdec_models.heads.eagle3 import default_aux_layers

        return sorted({*default_aux_layers(self.layers), self.layers})

    def row_bytes(self, seq_len: int, dtype: str = "bfloat16") -> int:
        """Bytes one row of the recipe's cache takes (its aux layers and the last, the tokens and
        the chat columns: `train.data.embeddings_cache.row_bytes`)."""
        from train.data.chat_rows import ChatRows
        from train.data.embeddings_cache import row_bytes

        return row_bytes(seq_len, self.hidden, dtype, 0, self.vocab, ChatRows.columns, len(self.aux_layers()))

    def cache_bytes_per_token(self, dtype: str) -> float:
        """Bytes per real token of a conversation cache of the head's layers ([2, L//2, L-3] and the
        last), padding included."""
        return self.row_bytes(SEQ_LEN, dtype) / SEQ_LEN / FILL

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


# ---------------------------------------------------------------- the target's shape, the device

def read_target(source: str, what: str = "--target") -> Target:
    """The shape of the target `source` names: a model folder (its config.json), a GGUF file (its
    header) or a config.json; nothing else is read. Anything else is one SpecdecError line."""
    path = Path(source).expanduser()
    if path.is_dir():
        config = path / "config.json"
        check(config.is_file(), f"{what} {source}: the folder holds no config.json (a Hugging Face model folder has "
                                "one)")
        return Target.from_config(path.name, _read_json(config, what))
    if path.suffix == ".gguf":
        check(path.is_file(), f"{what} {source}: no such GGUF file")
        return Target.from_config(path.stem, gguf_config(path, what))
    if path.suffix == ".json":
        check(path.is_file(), f"{what} {source}: no such file")
        return Target.from_config(path.stem if path.stem != "config" else path.resolve().parent.name,
                                  _read_json(path, what))
    raise SpecdecError(f"{what} {source} is neither a model folder, a GGUF file (.gguf) nor a config.json")


def _read_json(path: Path, what: str) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SpecdecError(f"{what} {path}: not a JSON config ({error})") from None
    check(isinstance(config, dict), f"{what} {path}: not a JSON object")
    return config


def gguf_config(path: Path, what: str = "--target") -> dict[str, Any]:
    """A GGUF file's shape under a Hugging Face config's names, read from its header (the tensors'
    data stay unread: the reader maps the file). Tied embeddings: no `output.weight` tensor."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise SpecdecError(f"{what} {path}: reading a GGUF header needs the gguf package (pip install gguf)") from None
    try:
        reader = GGUFReader(path)
    except Exception as error:  # noqa: BLE001  a damaged file can fail any way the reader parses it
        raise SpecdecError(f"{what} {path}: not a readable GGUF file ({' '.join(str(error).split())})") from None

    def value(key: str) -> Any:
        found = reader.fields.get(key)
        if found is None:
            return None
        content = found.contents()
        return max(content) if isinstance(content, list) and content else content    # per-layer counts: the largest

    arch = value("general.architecture")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    config = {"hidden_size": value(f"{arch}.embedding_length"), "num_hidden_layers": value(f"{arch}.block_count"),
              "intermediate_size": value(f"{arch}.feed_forward_length"),
              "num_attention_heads": value(f"{arch}.attention.head_count"),
              "num_key_value_heads": value(f"{arch}.attention.head_count_kv"),
              "head_dim": value(f"{arch}.attention.key_length"),
              "vocab_size": value(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None),
              "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}
    return {k: v if isinstance(v, bool) else int(v) for k, v in config.items() if v is not None}


def parse_memory(text: str, what: str = "--gpu-memory") -> int:
    """Bytes of a size like 80GiB, 80GB or 81920MiB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    check(match is not None and unit in UNITS and float(match.group(1)) > 0,
          f"{what} {text}: give a size like 80GiB or 80GB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(float(match.group(1)) * UNITS[unit])


@dataclass(frozen=True)
class Hardware:
    """Where the recipe runs: "cuda" or "cpu", each GPU's memory in bytes (None on a CPU), the GPUs
    (the answers and cache steps run one process per GPU, each holding the whole target) and where
    the memory figure came from."""

    device: str
    memory: int | None = None
    gpus: int = 1
    memory_from: str = ""


def choose_hardware(device: str = "auto", memory: str | None = None, gpus: int = 1) -> Hardware:
    """The Hardware a command line names. `device` auto: cuda when --gpu-memory is given or a CUDA
    device is here (`specdec_models.device.pick_device`), else cpu. On cuda the memory is
    --gpu-memory, else the memory of this machine's first CUDA device."""
    check_positive_int(gpus, "--gpus")
    if device == "auto" and memory is not None:
        device = "cuda"
    elif device == "auto":
        from specdec_models.device import pick_device

        device = pick_device(device)
    check(device in ("cpu", "cuda"), f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cpu":
        check(memory is None and gpus == 1, "--gpu-memory and --gpus size GPUs: give --device cuda")
        return Hardware("cpu")
    if memory is not None:
        return Hardware("cuda", parse_memory(memory), gpus, "--gpu-memory")
    import torch

    check(torch.cuda.is_available(), "--device cuda: no CUDA device is available here to read its memory from: give "
                                     "--gpu-memory (e.g. 80GiB)")
    return Hardware("cuda", int(torch.cuda.get_device_properties(0).total_memory), gpus, "cuda:0 here")


# ---------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Choice:
    """One planned size: its value, the value as printed, and why."""

    value: Any
    text: str
    reason: str


@dataclass(frozen=True)
class RecipePlan:
    """What the recipe will use (`plan_recipe`): choices by name (the recipe's flag names with
    underscores, e.g. answer_chunk), in the order `lines` prints them."""

    target: Target
    hardware: Hardware
    seq_len: int
    choices: dict[str, Choice]

    def __getitem__(self, name: str) -> Any:
        return self.choices[name].value

    def lines(self) -> list[str]:
        t, hw = self.target, self.hardware
        where = (f"{hw.gpus} GPU{'s' * (hw.gpus > 1)} of {gib(hw.memory)} ({hw.memory_from})" if hw.device == "cuda"
                 else "the CPU")
        lines = [f"target: {t.name}, {t.layers} layers, hidden {t.hidden:,}, {t.kv_heads} kv heads of {t.head_dim}, "
                 f"vocabulary {t.vocab:,}, {t.params() / 1e9:,.2f} B parameters; on {where}, rows of {self.seq_len} "
                 "tokens"]
        for name, choice in self.choices.items():
            label = f"--{name.replace('_', '-')}" if name in RECIPE_FLAGS else name.replace("_", " ")
            lines.append(f"{label}: {choice.text} ({choice.reason})")
        lines.append(f"the recipe: {' '.join(self.flags())}")
        return lines

    def flags(self) -> list[str]:
        """The recipe's command line with these sizes (specdec eagle3 / `specdec eagle3`)."""
        flags = ["--device", self.hardware.device]
        flags += [part for name in RECIPE_FLAGS for part in (f"--{name.replace('_', '-')}", number(self[name]))]
        train_args = [f"head.draft_vocab_size={self['draft_vocab_size'] or 'null'}"]
        if self.hardware.gpus > 1:
            train_args += ["trainer=ddp", f"trainer.devices={self.hardware.gpus}"]
        return [*flags, "--train-args", *train_args]


RECIPE_FLAGS = ("conversations", "answer_chunk", "answer_batch", "cache_batch", "train_minutes")


def experiment_sizes(device: str) -> dict[str, Any]:
    """The recipe's sizes before the target is seen: on cuda hf_eagle3_gpu.yaml's (its `recipe`
    block, the caps of the batches; its rows per step, draft steps and max_time), on cpu CPU_SIZES
    with smollm2_eagle3.yaml's rows per step and draft steps."""
    import yaml

    gpu = device == "cuda"
    cfg = yaml.safe_load((GPU_EXPERIMENT if gpu else CPU_EXPERIMENT).read_text())
    if gpu:
        r = cfg["recipe"]
        sizes = {"conversations": r["conversations"], "answer_chunk": r["answer_chunk"],
                 "answer_batch": r["answer_batch"], "cache_batch": r["chat_cache_batch"],
                 "train_minutes": max_time_minutes(cfg["trainer"]["max_time"])}
    else:
        sizes = dict(CPU_SIZES)
    return {**sizes, "rows_per_step": cfg["data"]["batch_size"], "ttt_steps": cfg["task"]["ttt_steps"],
            "name": (GPU_EXPERIMENT if gpu else CPU_EXPERIMENT).stem}


def max_time_minutes(text: str) -> float:
    """trainer.max_time (DD:HH:MM:SS) in minutes."""
    days, hours, minutes, seconds = (int(x) for x in str(text).split(":"))
    return (days * 24 + hours) * 60 + minutes + seconds / 60


def max_time(minutes: float) -> str:
    """trainer.max_time for a budget in minutes (DD:HH:MM:SS, as Lightning's Timer reads it)."""
    seconds = round(minutes * 60)
    days, seconds = divmod(seconds, 86400)
    return f"{days:02d}:{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def draft_vocab_size(vocab: int) -> int | None:
    """The draft vocabulary of a head for a target of `vocab` tokens: the smallest of
    DRAFT_VOCAB_SIZES that holds 1/DRAFT_VOCAB_SHARE of it (the largest beyond), or None (the
    whole vocabulary) when that is not smaller than the target's."""
    want = -(-vocab // DRAFT_VOCAB_SHARE)
    size = next((n for n in DRAFT_VOCAB_SIZES if n >= want), DRAFT_VOCAB_SIZES[-1])
    return size if size < vocab else None


def plan_recipe(target: Target, hardware: Hardware, seq_len: int = SEQ_LEN,
                conversations: int | None = None) -> RecipePlan:
    """Every size the recipe will use for `target` on `hardware` with rows of `seq_len` tokens
    (module docstring), `conversations` as given or the experiment's. A target that does not fit
    one GPU, or a GPU memory that fits no row, is one SpecdecError line."""
    exp = experiment_sizes(hardware.device)
    if conversations is not None:
        exp["conversations"] = conversations
    choices = {"weights": weights_choice(target, hardware)}
    choices.update(batch_choices(target, hardware, seq_len, exp))
    draft = draft_vocab_size(target.vocab)
    choices["draft_vocab_size"] = Choice(
        draft, f"{draft:,}" if draft else f"{target.vocab:,} (the whole vocabulary)",
        f"the smallest of {', '.join(f'{n:,}' for n in DRAFT_VOCAB_SIZES)} holding 1/{DRAFT_VOCAB_SHARE} of the "
        f"target's {target.vocab:,} tokens: SmolLM2's 49,152 -> 8,192, coverage 0.95 measured (docs/eagle3.md), "
        "Llama 3's 128,256 -> 32,768 (speculators' and SpecForge's heads: 32,000); the draft_vocab step reports "
        "each size's coverage on the cache; --train-args head.draft_vocab_size=N overrides")
    layers = target.aux_layers()
    choices["aux_layers"] = Choice(
        layers, ", ".join(map(str, layers)),
        f"hidden_states EAGLE-3 reads, [2, L//2, L-3] as vLLM and SpecForge take them, and the last, "
        f"L = {target.layers}; --train-args head.aux_layers=[A,B,C] overrides")
    choices.update(training_choices(target, hardware, seq_len, exp, draft or target.vocab))
    return RecipePlan(target, hardware, seq_len, choices)


def weights_choice(target: Target, hardware: Hardware) -> Choice:
    """The target's weights in the dtype the recipe loads them in; on a GPU, refused unless they fit
    in the memory less RESERVED (the answers and cache steps hold the whole target per GPU)."""
    weights = target.params() * BF16
    if hardware.device == "cpu":
        return Choice(weights, f"{gb(weights)} in bf16", "bf16 on a CPU with bf16 instructions, else twice that in "
                                                         "fp32 (specdec_models.cpu); a GGUF file is loaded dequantized")
    usable = hardware.memory * (1 - RESERVED)
    check(weights < usable, f"{target.name}'s bf16 weights ({gb(weights)}) do not fit in one GPU's "
                            f"{gib(hardware.memory)} less {RESERVED:.0%} kept free ({gb(usable)}): the answers and "
                            "cache steps hold the whole target on each GPU; use a GPU with more memory")
    return Choice(weights, f"{gb(weights)} in bf16 per GPU",
                  f"{target.params() / 1e9:,.2f} B parameters x 2 bytes, the whole target on each GPU (a GGUF file is "
                  f"loaded dequantized); {gb(usable - weights)} left for rows once {RESERVED:.0%} of "
                  f"{gib(hardware.memory)} is kept free")


def batch_choices(target: Target, hardware: Hardware, seq_len: int, exp: dict[str, Any]) -> dict[str, Choice]:
    """--answer-chunk, --answer-batch and --cache-batch: on a GPU the largest powers of two whose
    rows fit beside the weights (module docstring), capped at the GPU experiment's; on a CPU the
    measured sizes."""
    if hardware.device == "cpu":
        why = "sized for 2 CPU cores, measured (CPU_SIZES, docs/eagle3.md)"
        return {"conversations": Choice(exp["conversations"], f"{exp['conversations']:,}", why),
                "answer_chunk": Choice(exp["answer_chunk"], str(exp["answer_chunk"]), why),
                "answer_batch": Choice(exp["answer_batch"], str(exp["answer_batch"]), why),
                "cache_batch": Choice(exp["cache_batch"], str(exp["cache_batch"]), why)}
    free = int(hardware.memory * (1 - RESERVED) - target.params() * BF16)
    kv = target.kv_bytes_per_token()
    answer_row = (seq_len + 1) * kv + target.vocab * 4          # keys and values, and a step's fp32 logits
    cache_row = seq_len * target.pass_bytes_per_token()
    fit = {"answer": free // answer_row, "cache": free // cache_row}
    for step, row in (("answer", answer_row), ("cache", cache_row)):
        check(fit[step] >= 1, f"--gpu-memory {gib(hardware.memory)}: {target.name}'s weights leave {mb(max(free, 0))} "
                              f"for rows, less than one row of the {step} step ({mb(row)}): use a GPU with more memory "
                              "or a shorter --seq-len")
    chunk = pow2_floor(min(fit["answer"], exp["answer_chunk"]))
    cache = pow2_floor(min(fit["cache"], exp["cache_batch"]))
    per_part = exp["answer_batch"] // exp["answer_chunk"]
    cap = f"a power of two, at most {exp['name']}'s"
    return {
        "conversations": Choice(exp["conversations"], f"{exp['conversations']:,}",
                                f"{exp['name']}'s recipe block; more train a better head, at the hours below"),
        "answer_chunk": Choice(chunk, str(chunk), (
            f"rows the answering engine decodes together: a row holds {seq_len + 1} positions x {kib(kv)} of keys and "
            f"values ({target.layers} layers x {target.kv_heads} kv heads x {target.head_dim} x 2 x 2 bytes) and a "
            f"step's logits, {mb(answer_row)}; {fit['answer']:,} fit in {gb(free)}; {cap} ({exp['answer_chunk']})")),
        "answer_batch": Choice(chunk * per_part, str(chunk * per_part),
                               f"{per_part} x --answer-chunk, as {exp['name']}: conversations per written part, "
                               "what a killed run keeps"),
        "cache_batch": Choice(cache, str(cache), (
            f"rows per teacher-forced pass: a row holds {seq_len} positions x {kib(target.pass_bytes_per_token())} "
            f"({target.layers + 1} hidden states kept, one layer's activations, bf16), {mb(cache_row)}; "
            f"{fit['cache']:,} fit; {cap} ({exp['cache_batch']})")),
    }


def training_choices(target: Target, hardware: Hardware, seq_len: int, exp: dict[str, Any],
                     draft: int) -> dict[str, Choice]:
    """The rows, --train-minutes, the optimizer steps, the cache's bytes and each step's hours."""
    rows = exp["conversations"]
    tokens = rows * seq_len * FILL
    gpu = hardware.device == "cuda"
    rates = ({step: H100_FLOPS * MFU[step] * hardware.gpus for step in MFU} if gpu else cpu_flops())
    flops = {"answers": rows * seq_len * FILL * ANSWER_SHARE * target.forward_flops(),
             "cache": rows * seq_len * target.forward_flops(),
             "train": TRAIN_EPOCHS * tokens * target.train_flops(draft, exp["ttt_steps"])}
    seconds = {step: flops[step] / rates[step] for step in flops}
    minutes = max(exp["train_minutes"], math.ceil(seconds["train"] / 60)) if gpu else exp["train_minutes"]
    epochs = TRAIN_EPOCHS * minutes * 60 / max(seconds["train"], 1e-9)
    devices = hardware.gpus if gpu else 1
    steps = math.ceil(epochs * rows / (exp["rows_per_step"] * devices))
    cache_bytes = rows * target.row_bytes(seq_len)
    rate = ("an H100's 989 TFLOP/s bf16 at MFU " + ", ".join(f"{MFU[s]:.0%}" for s in MFU) + " per step"
            if gpu else "the rates measured on SmolLM2-135M on 2 CPU cores, scaled by FLOPs")
    per_device = {s: rates[s] / devices / (target.train_flops(draft, exp["ttt_steps"]) if s == "train"
                                           else target.forward_flops()) for s in rates}
    return {
        "rows": Choice(rows, f"about {rows:,}", "a conversation cut at turns fills about one row; the held-out ones "
                                                "validate"),
        "train_minutes": Choice(minutes, f"{minutes:g}", (
            f"{TRAIN_EPOCHS} epochs of the rows take about {seconds['train'] / 60:,.1f} min, at least {exp['name']}'s "
            f"{exp['train_minutes']:g}" if gpu else f"{exp['name']}'s budget on a CPU: about {epochs:.2g} epochs")),
        "train_steps": Choice(steps, f"about {steps:,}", f"{epochs:.2g} epochs of {rows:,} rows at "
                                                         f"{exp['rows_per_step']} a step per device ({exp['name']})"),
        "cache_bytes": Choice(cache_bytes, gb(cache_bytes), f"{rows:,} rows x {mb(target.row_bytes(seq_len))}: "
                                                            f"{len(target.aux_layers())} layers x {target.hidden:,} "
                                                            f"x {seq_len} positions in bf16, and the tokens"),
        "hours": Choice((seconds["answers"] + seconds["cache"]) / 3600 + minutes / 60, hours_text(seconds, minutes), (
            f"estimates: {rate}: {per_device['answers']:,.0f} answer tokens/s, {per_device['cache']:,.0f} cache "
            f"positions/s, {per_device['train']:,.0f} training tokens/s per device; the answers step stops at "
            "--answer-minutes (30 by default: --answer-minutes 0 for none)")),
    }


def hours_text(seconds: dict[str, float], train_minutes: float) -> str:
    """Each step's hours, the training at its --train-minutes."""
    parts = [f"answers {seconds['answers'] / 3600:.2g} h", f"cache {seconds['cache'] / 3600:.2g} h",
             f"training {train_minutes / 60:.2g} h"]
    total = (seconds["answers"] + seconds["cache"]) / 3600 + train_minutes / 60
    return f"{', '.join(parts)}: about {total:.2g} h"


def number(value: float) -> str:
    """A size as a command line takes it: 26 for 26.0, 5.5 as it is."""
    return str(int(value)) if float(value).is_integer() else str(value)


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (0 for n < 1)."""
    return 1 << (int(n).bit_length() - 1) if n >= 1 else 0


def gb(size: float) -> str:
    return f"{size / 1e9:,.1f} GB"


def gib(size: float) -> str:
    return f"{size / 2**30:,.4g} GiB"


def mb(size: float) -> str:
    return f"{size / 1e6:,.1f} MB"


def kib(size: float) -> str:
    return f"{size / 2**10:,.0f} KiB"


# ---------------------------------------------------------------- the command

def parser() -> argparse.ArgumentParser:
    p = Parser(prog=prog("specdec plan"), description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, metavar="DIR|FILE.gguf|config.json",
                   help="the target: a Hugging Face model folder, a GGUF file or its config.json alone")
    p.add_argument("--device", default="auto", help="auto (cuda when --gpu-memory is given or a CUDA device is here, "
                                                    "else cpu), cpu or cuda")
    p.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="each GPU's memory, e.g. 80GiB or 141GB (default: this machine's first CUDA device's)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the recipe's steps run on (default 1)")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help=f"tokens per row (the recipe's, default {SEQ_LEN})")
    p.add_argument("--conversations", type=int, default=None,
                   help="conversations taken from the data (default: the recipe's for the device)")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    """`specdec plan`: print what the recipe will use, each size with its reason; no work."""
    a = parser().parse_args(None if argv is None else [str(x) for x in argv])
    check_positive_int(a.seq_len, "--seq-len")
    if a.conversations is not None:
        check_positive_int(a.conversations, "--conversations")
    target = read_target(a.target)
    hardware = choose_hardware(a.device, a.gpu_memory, a.gpus)
    print("\n".join(plan_recipe(target, hardware, a.seq_len, a.conversations).lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
