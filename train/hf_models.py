"""Hugging Face models and tokenizers on local disk: loading, identities, compatibility checks.

Everything the Hugging Face tasks and DataModules need to read a causal LM or a tokenizer from a
local directory (`from_pretrained(..., local_files_only=True)`: nothing is downloaded), refuse
one that does not fit with a one-line `SpecdecError`, and identify it cheaply when a run resumes.
transformers is imported inside the functions: `train` imports without it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from specdec_models.errors import SpecdecError, check
from specdec_models.hf import weights as hf_weights
from specdec_models.hf.weights import check_same_tokenizer, special_tokens  # noqa: F401 (re-exported)


def model_dir(path: Any, role: str) -> Path:
    """The local model directory `path` of the `role` model, checked (nothing is downloaded)."""
    check(path, f"{role}.path is not set: needs {role}.path=DIR, a local Hugging Face causal LM directory "
                f"(save_pretrained or a hub snapshot on disk)")
    return hf_weights.check_source(str(path), f"{role}.path")


def load_config(directory: Path, role: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:
        raise SpecdecError(f"cannot read the {role}'s config in {directory}: {str(error).splitlines()[0]}") from None


def load_causal_lm(directory: str | Path, dtype: torch.dtype):
    """The causal LM in `directory` (or a GGUF file), in train mode (from_pretrained gives eval)."""
    return hf_weights.load_causal_lm(directory, dtype=dtype).train()


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a model directory or GGUF file (nothing is downloaded)."""
    return hf_weights.load_tokenizer(path, what="tokenizer")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what decides a tokenizer's ids: its full definition (vocabulary, merges,
    normalizer, ...), special tokens and chat template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(special_tokens(tokenizer), sort_keys=True).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


def head_rows(config: Any) -> int:
    get = getattr(config, "get_text_config", None)
    return int((get() if callable(get) else config).vocab_size)


def max_positions(config: Any) -> int | None:
    get = getattr(config, "get_text_config", None)
    text = get() if callable(get) else config
    return next((getattr(text, k) for k in ("max_position_embeddings", "n_positions")
                 if isinstance(getattr(text, k, None), int)), None)


def fingerprint(directory: str | Path) -> str:
    """A cheap identity of a model directory: config.json and the names and sizes of its weights."""
    directory = Path(directory)
    h = hashlib.sha256((directory / "config.json").read_bytes())
    for path in sorted(directory.iterdir()):
        if path.suffix in (".safetensors", ".bin", ".pt") or path.name.endswith(".index.json"):
            h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()


def parameter_count(config: Any) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):               # no weights are allocated
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
