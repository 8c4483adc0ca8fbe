"""The Hugging Face side of the decoding CLI: the target, its tokenizer, and a draft or a prophet
head, loaded and checked, with every bad input reported in one line before decoding starts.

`load_hf_run(target, draft=None, prophet=None)` takes a target source (a local `save_pretrained`
directory or a GGUF file), an optional draft source (the same kinds) and an optional `hf_prophet`
export directory. Cheap checks come first (paths exist, the head's config is readable), then the
tokenizers (target and draft must share one), then the models (the head must have been trained for
this target: `load_export` compares the hash of its weights). Without a target source, the path
a head's export records is used.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..errors import check
from ..export import load_export, read_export_config
from ..hf import _logits_width
from ..hf_prophet import HFProphet
from ..hf_weights import check_same_tokenizer, check_source, load_causal_lm, load_tokenizer


class HFRun(NamedTuple):
    target: Any                    # a transformers causal LM, eval mode
    tokenizer: Any                 # the target's tokenizer
    draft: Any | None              # a transformers causal LM sharing the tokenizer, or None
    prophet: HFProphet | None      # a prophet head trained for the target, or None
    vocab_size: int                # the vocabulary target and draft (or head) share: logits are sliced to it


def load_hf_run(target: str | os.PathLike | None, draft: str | os.PathLike | None = None,
                prophet: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32) -> HFRun:
    """Load and check a Hugging Face decoding run (see the module docstring)."""
    check(draft is None or prophet is None, "give either a draft or a prophet head, not both")
    head_config = read_export_config(prophet) if prophet is not None else None
    if head_config is not None:
        check(head_config["kind"] == "hf_prophet",
              f"--prophet {prophet} holds a {head_config['kind']} export, not a prophet head for a Hugging Face "
              f"target (kind hf_prophet); a native prophet export decodes with --export DIR")
        if target is None:
            recorded = head_config["target"].get("path")
            check(recorded is not None, f"the head in {prophet} records no target path: give --hf-model DIR or --gguf FILE")
            target = recorded
    check(target is not None, "give the target: --hf-model DIR or --gguf FILE")
    target_path = check_source(target, "target")
    draft_path = check_source(draft, "draft") if draft is not None else None

    tokenizer = load_tokenizer(target_path, "target")
    if draft_path is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(draft_path, "draft"), f"target {target_path}", f"draft {draft_path}")
    target_model = load_causal_lm(target_path, dtype=dtype, what="target")
    draft_model = load_causal_lm(draft_path, dtype=dtype, what="draft") if draft_path is not None else None
    head = load_export(prophet, target=target_model) if prophet is not None else None
    sizes = [_logits_width(target_model), len(tokenizer)]
    if draft_model is not None:
        sizes.append(_logits_width(draft_model))
    vocab_size = head.vocab_size if head is not None else min(sizes)
    return HFRun(target_model, tokenizer, draft_model, head, vocab_size)


def encode_prompt(tokenizer: Any, text: str, chat: bool, vocab_size: int, max_len: int) -> Tensor:
    """Token ids (n,) of the prompt: the text as is, or as one user turn of the tokenizer's chat
    template with the assistant's turn opened (`chat`)."""
    if chat:
        check(getattr(tokenizer, "chat_template", None), "--chat: the target's tokenizer has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(text)["input_ids"]
    tokens = torch.tensor(ids, dtype=torch.long).reshape(-1)
    check(tokens.numel() > 0, "the prompt encodes to no tokens")
    check(tokens.numel() <= max_len, f"the prompt is {tokens.numel()} tokens, more than the target's {max_len}")
    check(int(tokens.max()) < vocab_size, f"the prompt holds token ids >= {vocab_size}, outside the target's head")
    return tokens
