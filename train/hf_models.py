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


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in a model directory (nothing is downloaded)."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    check(path.is_dir(), f"tokenizer directory {path} does not exist")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise SpecdecError(f"cannot load a tokenizer from {path}: {str(error).splitlines()[0]}") from None


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


def special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The special tokens a tokenizer declares, with their ids: {"eos_token": ["</s>", 2], ...}."""
    out: dict[str, Any] = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        token = getattr(tokenizer, name, None)
        if token is not None:
            out[name] = [str(token), tokenizer.convert_tokens_to_ids(str(token))]
    out["additional"] = sorted(str(t) for t in tokenizer.all_special_tokens)
    return out


def model_dir(path: Any, role: str) -> Path:
    """The local model directory `path` of the `role` model, checked (nothing is downloaded)."""
    check(path, f"{role}.path is not set: needs {role}.path=DIR, a local Hugging Face causal LM directory "
                f"(save_pretrained or a hub snapshot on disk)")
    directory = Path(str(path)).expanduser()
    check((directory / "config.json").is_file(), f"{role}.path {directory} is not a model directory (no config.json)")
    return directory


def load_config(directory: Path, role: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:
        raise SpecdecError(f"cannot read the {role}'s config in {directory}: {str(error).splitlines()[0]}") from None


def load_causal_lm(directory: str | Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as error:
        raise SpecdecError(f"cannot load a causal LM from {directory}: {str(error).splitlines()[0]}") from None


def head_rows(config: Any) -> int:
    get = getattr(config, "get_text_config", None)
    return int((get() if callable(get) else config).vocab_size)


def max_positions(config: Any) -> int | None:
    get = getattr(config, "get_text_config", None)
    text = get() if callable(get) else config
    return next((getattr(text, k) for k in ("max_position_embeddings", "n_positions")
                 if isinstance(getattr(text, k, None), int)), None)


def check_same_tokenizer(teacher: Any, student: Any, teacher_dir: Path, student_dir: Path) -> int:
    """Raise a one-line SpecdecError unless the two tokenizers are the same; return their size."""
    where = f"(teacher {teacher_dir}, student {student_dir}): teacher and student must share one tokenizer"
    check(len(teacher) == len(student),
          f"the student's tokenizer has {len(student)} tokens, the teacher's {len(teacher)} {where}")
    tv, sv = teacher.get_vocab(), student.get_vocab()
    if tv != sv:
        differ = sorted(t for t in set(tv) | set(sv) if tv.get(t) != sv.get(t))
        raise SpecdecError(f"the tokenizers' vocabularies differ ({len(differ)} tokens, e.g. {differ[0]!r}: teacher id "
                           f"{tv.get(differ[0])}, student id {sv.get(differ[0])}) {where}")
    ts, ss = special_tokens(teacher), special_tokens(student)
    if ts != ss:
        name = next(k for k in [*ts, *ss] if ts.get(k) != ss.get(k))      # named tokens before the full list
        raise SpecdecError(f"the tokenizers' special tokens differ ({name}: teacher {ts.get(name)}, student "
                           f"{ss.get(name)}) {where}")
    return len(teacher)


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
