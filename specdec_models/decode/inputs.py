"""The checks `generate` runs on its arguments before any work: one-line `SpecdecError`s that say
what to fix."""

from __future__ import annotations

import argparse

from torch import Tensor

from ..errors import check
from ..heads import Eagle3Head, ModelWithProphet, ProphetHead
from ..hf import HFDecoder
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
    if isinstance(head, Eagle3Head):
        check(isinstance(target, HFDecoder) and target.model is head.target,
              "this eagle3 head was built for another target: pass the Hugging Face model it was loaded with "
              "(head.target) as the target")
        check(head.vocab_size == target.vocab_size,
              f"the eagle3 head's vocabulary ({head.vocab_size}) differs from the target's "
              f"({target.vocab_size}): pass vocab_size={head.vocab_size}")
        return "eagle3"
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
