"""The checks `generate` runs on its arguments before any work: one-line `SpecdecError`s that say
what to fix, a batch too large for the memory free (`check_memory`) among them."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch import Tensor

from ..errors import check
from ..heads import Eagle3Head, ModelWithProphet, ProphetHead
from ..hf import HFDecoder, text_config
from ..model import Decoder
from .cost import SpeedProfile

AUTO = "auto"


def parse_gamma(text: str) -> int | str:
    """A command line's gamma: an integer or "auto" (argparse `type=`; range checks come later)."""
    if text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid gamma {text!r}: give an integer >= 1 or auto") from None


def available_memory(device: torch.device | str) -> int | None:
    """Bytes free for new tensors on `device`: a CUDA device's free memory, the host's
    MemAvailable (/proc/meminfo) for the CPU; None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]) if torch.cuda.is_available() else None
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _position_bytes(model: Any) -> int:
    """Bytes a model's KV cache holds per position and row (0 where its sizes are unknown)."""
    if isinstance(model, Decoder):
        cfg, size = model.cfg, model.to_logits.weight.element_size()
        return cfg.depth * cfg.heads * cfg.dim_head * 2 * size
    if isinstance(model, HFDecoder):
        config = text_config(model.model.config)
        heads = getattr(config, "num_attention_heads", 0) or 0
        kv = getattr(config, "num_key_value_heads", None) or heads
        dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
        size = model.model.get_input_embeddings().weight.element_size()
        return int(getattr(config, "num_hidden_layers", 0) or 0) * kv * dim * 2 * size
    return 0


def check_memory(prompt: Any, max_new_tokens: Any, models: dict[str, Any]) -> None:
    """`check_batch_memory` for generate's prompt (a (rows, longest) tensor or a list of rows,
    read by shape only: a huge batch is refused before it is split into rows)."""
    if isinstance(prompt, Tensor) and prompt.ndim == 2:
        rows, longest = prompt.shape
    elif isinstance(prompt, (list, tuple)) and all(isinstance(r, Tensor) for r in prompt):
        rows, longest = len(prompt), max((r.numel() for r in prompt), default=0)
    else:
        return                                       # prompt_rows says what is wrong with it
    if isinstance(max_new_tokens, int):
        check_batch_memory(int(rows), int(longest) + max(max_new_tokens, 0), models)


def check_batch_memory(rows: int, positions: int, models: dict[str, Any]) -> None:
    """Refuse, before any work, a batch whose KV caches and logits cannot fit: `rows` x
    `positions` of every model's keys and values (`Decoder`s or `HFDecoder`s; None skipped), and a
    row of fp32 logits per row and model, against the memory free on the target's device: a lower
    bound of what decoding allocates (a batch past it would be killed for memory far into the work)."""
    target = models["target"]
    free = available_memory(target.device)
    need = rows * sum(positions * _position_bytes(m) + 4 * m.vocab_size for m in models.values() if m is not None)
    check(free is None or need <= free,
          f"a batch of {rows:,} rows of up to {positions:,} positions needs at least {need / 2**30:,.1f} GiB for its "
          f"KV caches and logits, more than the {free / 2**30 if free else 0:,.1f} GiB free on {target.device}: "
          f"decode fewer rows at once")


def prompt_rows(prompt: Tensor | list[Tensor], vocab_size: int, max_seq_len: int) -> list[Tensor]:
    """The prompt as a list of 1-D rows, checked: integer ids in the vocabulary, 1..max_seq_len tokens."""
    if isinstance(prompt, Tensor):
        check(prompt.ndim == 2,
              f"prompt must be a (batch, len) tensor or a list of 1-D tensors, got shape {tuple(prompt.shape)}")
        rows = list(prompt)
    else:
        check(isinstance(prompt, (list, tuple)) and len(prompt) > 0,
              "prompt must be a (batch, len) tensor or a non-empty list of 1-D tensors")
        rows = list(prompt)
    check(len(rows) > 0, "prompt has no rows")
    for i, r in enumerate(rows):
        check(isinstance(r, Tensor) and r.ndim == 1, f"prompt row {i} must be a 1-D tensor")
        check(not r.is_floating_point() and not r.is_complex(), f"prompt row {i} must hold integer token ids")
        check(r.numel() > 0, f"prompt row {i} is empty: give at least one token")
        check(r.numel() <= max_seq_len,
              f"prompt row {i} has {r.numel()} tokens, more than the model's max_seq_len {max_seq_len}")
        lo, hi = int(r.min()), int(r.max())
        check(lo >= 0 and hi < vocab_size,
              f"prompt row {i} has token ids outside the vocabulary [0, {vocab_size}): min {lo}, max {hi}")
    return rows


def check_context(rows: list[Tensor], max_new_tokens: int, models: dict[str, object]) -> None:
    """Refuse decoding past a model's trained context: the longest prompt row plus max_new_tokens
    must fit every model's max_seq_len (rotary positions past it were never trained, so the output
    degrades without any error), as a prompt that long alone is refused."""
    longest = max(r.numel() for r in rows)
    for role, model in models.items():
        if model is None:
            continue
        limit = model.cfg.max_seq_len
        check(longest + max_new_tokens <= limit,
              f"the longest prompt row ({longest} tokens) + max_new_tokens {max_new_tokens} = "
              f"{longest + max_new_tokens} "
              f"positions exceed the {role}'s max_seq_len {limit}, the context it was trained for (past it the "
              f"output degrades silently): ask for at most {max(limit - longest, 0)} new tokens or shorten the prompt")


def check_inputs(target, draft, head, gamma, max_new_tokens, eos_id, speed_profile) -> str:
    """Check generate's arguments before any work, the drafter's against the target (`draft`: its
    draft model, wrapped; `head`: its draft head); return the method ("base", "draft", "prophet"
    or "eagle3")."""
    check(isinstance(target, (Decoder, HFDecoder)),
          f"target must be a specdec_models Decoder or a Hugging Face causal LM, got {type(target).__name__}")
    check(gamma == AUTO or (isinstance(gamma, int) and not isinstance(gamma, bool) and gamma >= 1),
          f"gamma must be an integer >= 1 or 'auto', got {gamma!r}")
    if speed_profile is not None:
        check(gamma == AUTO, f"a speed_profile chooses gamma: pass gamma='auto', not gamma={gamma!r}")
        check(isinstance(speed_profile, SpeedProfile),
              f"speed_profile must be a cost.SpeedProfile, got {type(speed_profile).__name__}")
    check(isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and max_new_tokens >= 0,
          f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if eos_id is not None:
        check(isinstance(eos_id, int) and 0 <= eos_id < target.vocab_size,
              f"eos_id must be a token id in [0, {target.vocab_size}), got {eos_id!r}")
    if draft is not None:
        check(draft.vocab_size == target.vocab_size,
              f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size})")
        return "draft"
    # an EAGLE-3 head, or a head that drafts a block in one pass (decode.block_draft's protocol)
    if isinstance(head, Eagle3Head) or callable(getattr(head, "draft_block", None)):
        kind = getattr(head, "kind", "eagle3")
        check(isinstance(target, HFDecoder) and target.model is head.target,
              f"this {kind} head was built for another target: pass the Hugging Face model it was loaded with "
              f"(head.target) as the target")
        check(head.vocab_size == target.vocab_size,
              f"the {kind} head's vocabulary ({head.vocab_size}) differs from the target's "
              f"({target.vocab_size}): pass vocab_size={head.vocab_size}")
        return kind
    if head is not None:
        check(isinstance(head, ProphetHead),
              f"a draft head must be a ModelWithProphet, an HFProphet or an Eagle3Head, got {type(head).__name__}")
        if isinstance(head, ModelWithProphet):
            check(isinstance(target, Decoder), "prophet decoding needs the specdec Decoder the prophet was built for, "
                  "not a Hugging Face target (a Hugging Face target drafts with an HFProphet head)")
            check(head.model is target, "prophet was not built for this target: pass prophet.model as the target")
        else:      # an HFProphet: drafts from the hidden states of the Hugging Face model it shares weights with
            check(isinstance(target, HFDecoder) and target.model is getattr(head, "target", None),
                  "this prophet head was built for another target: pass the Hugging Face model it was loaded "
                  "with (head.target) as the target")
            check(head.vocab_size == target.vocab_size,
                  f"the prophet head's vocabulary ({head.vocab_size}) differs from the target's "
                  f"({target.vocab_size}): pass vocab_size={head.vocab_size}")
        top = head.prophet_cfg.prophet_train_length - 1
        check(gamma == AUTO or gamma <= top,
              f"gamma {gamma} exceeds what the prophet was trained for: prophet_train_length "
              f"{top + 1} covers drafts 1..{top} (its first prediction is the token the target already "
              f"emitted), drafts past that are untrained and accept almost nothing; use gamma <= {top} or auto")
        return "prophet"
    return "base"
