"""A draft causal LM exported as a Hugging Face model directory: what transformers' assisted
generation (`target.generate(..., assistant_model=draft)`), `AutoModelForCausalLM` and vLLM load.

`save_hf_draft(DIR, model, tokenizer, metadata, dtype=...)` writes `save_pretrained` of the model
(its weights cast to `dtype`, tied weights kept one tensor, `use_cache` on), the tokenizer, and
`specdec_distill.json` (HF_DRAFT_METADATA: what trained it). Its generation config's
`num_assistant_tokens` is the gamma the caller gives (`assistant_generation_config`): training
passes the best gamma its evaluation measured at batch 1 and the config's own temperature
(`sampling_temperature`), read by `decode.cost.stored_profile`, which this package never imports.
The directory is built beside `DIR` and renamed into place whole (`files.staged_dir`), so a crash
leaves the previous export. `check_hf_draft_dir` says whether `DIR` may be written: new, empty, or
an earlier draft export (its HF_DRAFT_METADATA); anything else needs `force=True`.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import check
from ..files import staged_dir

HF_DRAFT_METADATA = "specdec_distill.json"         # next to the model's files in the export


def check_hf_draft_dir(out_dir: str | os.PathLike, force: bool = False) -> str | None:
    """An export directory must be new, empty, or hold a Hugging Face draft export (its
    `specdec_distill.json`); `force` allows any folder. Returns what it would replace."""
    out_dir = Path(out_dir)
    check(not out_dir.exists() or out_dir.is_dir(), f"export path {out_dir} exists and is not a directory")
    if not out_dir.is_dir():
        return None
    if (out_dir / HF_DRAFT_METADATA).is_file():
        return f"a Hugging Face draft export ({out_dir / HF_DRAFT_METADATA})"
    others = sorted(p.name for p in out_dir.iterdir() if not p.name.startswith(".tmp"))
    check(force or not others, f"{out_dir} is not a draft export of this task (it holds {', '.join(others[:3])}"
                               f"{', ...' if len(others) > 3 else ''}): choose an empty or new export directory, "
                               f"or replace it on purpose (force, specdec export --force)")
    return None


def save_hf_draft(out_dir: str | os.PathLike, model: Any, tokenizer: Any, metadata: dict[str, Any], *,
                  dtype: torch.dtype, num_assistant_tokens: int | None = None, force: bool = False) -> Path:
    """`model` (a transformers causal LM) as a model directory in `out_dir`: save_pretrained with
    its weights in `dtype`, the tokenizer, and `specdec_distill.json` holding `metadata`, built
    beside `out_dir` and renamed into place (`staged_dir`); `num_assistant_tokens` (a gamma) goes
    into its generation config. The model itself is left as it was."""
    out_dir = Path(out_dir)
    check_hf_draft_dir(out_dir, force)
    with staged_dir(out_dir) as tmp:
        state, cast = {}, {}
        for key, value in model.state_dict().items():
            ident = (value.data_ptr(), value.shape, value.dtype)          # tied weights stay one tensor
            if ident not in cast:
                value = value.detach()
                cast[ident] = value.to("cpu", dtype) if value.is_floating_point() else value.cpu()
            state[key] = cast[ident]
        config_dtype, use_cache = model.config.dtype, model.config.use_cache
        generation = model.generation_config
        model.config.dtype, model.config.use_cache = dtype, True
        model.generation_config = assistant_generation_config(generation, num_assistant_tokens)
        try:
            model.save_pretrained(tmp, state_dict=state)
        finally:
            model.config.dtype, model.config.use_cache = config_dtype, use_cache
            model.generation_config = generation
        config = json.loads((tmp / "config.json").read_text())     # save_pretrained writes the module's dtype
        config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")   # torch_dtype: transformers 4
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(tmp)
        (tmp / HF_DRAFT_METADATA).write_text(json.dumps(metadata, indent=1, default=str))
    return out_dir


def sampling_temperature(config: Any) -> float:
    """The temperature a GenerationConfig decodes at: its own when it samples, 0 when it does not."""
    return float(config.temperature or 1.0) if config.do_sample else 0.0


def assistant_generation_config(config: Any, num_assistant_tokens: int | None) -> Any:
    """A copy of the draft's GenerationConfig whose `num_assistant_tokens` (the gamma transformers'
    assisted generation drafts per round, read from the assistant model's config) is the one
    given, kept constant; the config itself when none is given (nothing was measured)."""
    if num_assistant_tokens is None:
        return config
    check(isinstance(num_assistant_tokens, int) and num_assistant_tokens >= 1,
          f"num_assistant_tokens must be a gamma >= 1, got {num_assistant_tokens!r}")
    config = copy.deepcopy(config)
    config.num_assistant_tokens = num_assistant_tokens
    config.num_assistant_tokens_schedule = "constant"
    return config
