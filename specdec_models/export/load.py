"""Loading an export for decoding on a Hugging Face target: the target, its tokenizer, and a draft
or a head, loaded and checked, with every bad input reported in one line before decoding starts.

`load_hf_run(target, draft=None, prophet=None, eagle3=None)` takes a target source (a local
`save_pretrained` directory or a GGUF file), an optional draft source (the same kinds), an optional
`hf_prophet` export directory or an optional eagle3 head directory in any of the layouts of
`specdec_models.export.eagle3` (specdec's hf_eagle3 export, vLLM's speculators format, SGLang's). Cheap checks
come first (paths exist, the head's config is readable), then the tokenizers (target and draft must
share one), then the models (the head must have been made for this target: `load_export` compares
the hash of its weights, `load_eagle3` a foreign layout's shapes). Without a target source, the
path a head records is used (a specdec export's target path, a speculators head's verifier when it
is a local path).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..errors import SpecdecError, check
from ..heads import Eagle3Head, HFProphet
from ..hf import check_same_tokenizer, check_source, load_causal_lm, load_tokenizer, logits_width
from .eagle3 import detect_layout, load_eagle3
from .specdec import load_export, read_export_config, read_json_object


class HFRun(NamedTuple):
    target: Any                    # a transformers causal LM, eval mode
    tokenizer: Any                 # the target's tokenizer
    draft: Any | None              # a transformers causal LM sharing the tokenizer, or None
    prophet: HFProphet | Eagle3Head | None   # a prophet or eagle3 head made for the target, or None
    vocab_size: int                # the vocabulary target and draft (or head) share: logits are sliced to it


def load_hf_run(target: str | os.PathLike | None, draft: str | os.PathLike | None = None,
                prophet: str | os.PathLike | None = None, *, eagle3: str | os.PathLike | None = None,
                dtype: torch.dtype = torch.float32) -> HFRun:
    """Load and check a Hugging Face decoding run (see the module docstring), every model in
    `dtype` and eval mode; preparing them for a device is the caller's."""
    check(sum(x is not None for x in (draft, prophet, eagle3)) <= 1,
          "give one of a draft, a prophet head or an eagle3 head, not several")
    if eagle3 is not None and target is None:
        target = recorded_target(eagle3, detect_layout(eagle3))
    head_config = read_export_config(prophet) if prophet is not None else None
    if head_config is not None:
        check(head_config["kind"] == "hf_prophet",
              f"--prophet {prophet} holds a {head_config['kind']} export, not a prophet head for a Hugging Face "
              f"target (kind hf_prophet); a native prophet export decodes with --export DIR")
        if target is None:
            recorded = head_config["target"].get("path")
            check(recorded is not None,
                  f"the head in {prophet} records no target path: give --hf-model DIR or --gguf FILE")
            target = recorded
    check(target is not None, "give the target: --hf-model DIR or --gguf FILE")
    target_path = check_source(target, "target")
    draft_path = check_source(draft, "draft") if draft is not None else None

    tokenizer = load_tokenizer(target_path, "target")
    if draft_path is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(draft_path, "draft"), f"target {target_path}",
                             f"draft {draft_path}")
    target_model = load_causal_lm(target_path, dtype=dtype, what="target")
    draft_model = load_causal_lm(draft_path, dtype=dtype, what="draft") if draft_path is not None else None
    head = load_export(prophet, target=target_model) if prophet is not None else None
    if eagle3 is not None:
        head = load_eagle3(eagle3, target_model)
    sizes = [logits_width(target_model), len(tokenizer)]
    if draft_model is not None:
        sizes.append(logits_width(draft_model))
    vocab_size = head.vocab_size if head is not None else min(sizes)
    return HFRun(target_model, tokenizer, draft_model, head, vocab_size)


def recorded_target(directory: str | os.PathLike, layout: str) -> str:
    """The target a head of any kind in `layout` names (`export.heads.detect_head` tells the
    layout): a specdec export's target path, a speculators head's verifier if it is a local path;
    else a one-line error asking for the target."""
    ask = "give the target: --hf-model DIR or --gguf FILE"
    if layout == "specdec":
        recorded = read_export_config(directory)["target"].get("path")
        check(recorded is not None, f"the head in {directory} records no target path: {ask}")
        return recorded
    if layout == "speculators":
        config = read_json_object(Path(directory, "config.json"), "give a head directory")
        name = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        check(isinstance(name, str) and os.path.exists(name),
              f"the head in {directory} names its verifier {name!r}, not a local path: {ask}")
        return name
    raise SpecdecError(f"an SGLang-layout head ({directory}) does not name its target: {ask}")


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
