"""A target without its body: the parts a head trained from a cache reads, loaded tensor by tensor.

A head trained offline (from an embeddings cache) reads its target's token embedding, final norm and
LM head, and with `head.init_layer` one decoder layer to start from; it never runs the target. For
Llama-3.1-8B those parts are 2 x 128,256 x 4,096 values (2.1 GB in bf16) of the model's 16 GB.

    model = lean_causal_lm("Llama-3.1-8B/", dtype=torch.bfloat16, layers=[29])
    model.get_input_embeddings(), model.get_output_embeddings()   # real tensors
    model.model.layers[29]                                        # the one layer kept
    weights_sha256(model)                                         # the whole model's hash

The model is the target's own class, built on the meta device (no memory) from its config. Its
decoder layers other than `layers` are replaced by `AbsentLayer` placeholders (no parameters, a
forward that refuses in one line); the kept parts are read from the files one tensor at a time: a
safetensors file or a sharded set (its `model.safetensors.index.json`), memory-mapped, or a GGUF
file, each tensor dequantized and laid out as transformers' GGUF loader does (its own name map and
per-tensor processor). Peak memory is the kept parts plus one tensor.

`streamed_weights_sha256` computes `weights.weights_sha256` of the full model the same way, one
tensor at a time, without ever holding the model: the state_dict's names, shapes and ties come from
the meta model, the values from the files. The lean model carries that hash
(`model.specdec_lean`), so `weights_sha256(model)` and every identity check (a cache's, an export's,
a checkpoint's) sees the full target's.

Not every checkpoint can be read so: pickled `.bin` weights, a state_dict entry the files do not
hold under its name (a persistent buffer, a name transformers converts on load), and a GGUF
architecture whose transformers processor joins tensors (mixture-of-experts) raise
`LeanUnavailable`; the caller then loads the whole model (`load_causal_lm`) and says so. A target
whose files hold no LM-head tensor and do not tie it to the embedding is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import SpecdecError, check
from .adapter import text_config
from .weights import check_source, load_config

INDEX = "model.safetensors.index.json"


class LeanUnavailable(Exception):
    """This checkpoint cannot be read tensor by tensor (the message says why): load the whole model."""


@dataclass(frozen=True)
class LeanInfo:
    """What a lean model records: its source, the full model's weights hash, the decoder layers kept."""

    path: str
    weights_sha256: str
    layers: tuple[int, ...]


def _cannot_run(*args: Any, **kwargs: Any) -> Any:
    raise SpecdecError("this target was loaded without its body (only its embedding, final norm, LM head and at most "
                       "one layer): it serves a head trained from a cache and cannot run; load it with load_causal_lm")


class AbsentLayer(nn.Module):
    """A decoder layer of the target that a lean model does not hold."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _cannot_run()


# ------------------------------------------------------------------------------ tensor sources

class TensorSource:
    """Named tensors of a checkpoint, read one at a time under the model's state_dict names."""

    def names(self) -> frozenset[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` (in the file's dtype, or float32 dequantized), as the model holds it."""
        raise NotImplementedError


class SafetensorsSource(TensorSource):
    """A directory's `*.safetensors` (one file, or the shards its index names)."""

    def __init__(self, directory: Path) -> None:
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise SpecdecError(f"target: {index} is not a safetensors index ({error})") from None
            self._where = {name: directory / file for name, file in weight_map.items()}
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise LeanUnavailable(f"{directory} holds no safetensors weights (pickled weights load whole)")
            from safetensors import safe_open

            self._where = {}
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    self._where.update({name: file for name in f.keys()})  # noqa: SIM118  (safe_open is not a dict)
        self._names = frozenset(self._where)

    def names(self) -> frozenset[str]:
        return self._names

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as f:
            return f.get_tensor(name)


class GGUFSource(TensorSource):
    """A GGUF file, memory-mapped; each tensor dequantized and processed as transformers' loader
    does (`load_gguf_checkpoint`), under the names its weights map gives `meta_model`'s state_dict."""

    def __init__(self, path: Path, meta_model: nn.Module) -> None:
        from gguf import GGUFReader
        from transformers import modeling_gguf_pytorch_utils as g

        self._reader = GGUFReader(path)
        architecture = str(g.read_field(self._reader, "general.architecture")[0])
        processor_class = g.TENSOR_PROCESSORS.get(architecture, g.TensorProcessor)
        # these processors lay each tensor out on its own; the others join tensors (experts) across calls
        if processor_class not in (g.TensorProcessor, g.LlamaTensorProcessor):
            raise LeanUnavailable(f"transformers reads {architecture} GGUF files with {processor_class.__name__}, "
                                  "which joins tensors across calls")
        self._parsed = g.load_gguf_checkpoint(str(path), return_tensors=False)
        self._processor = processor_class(config=self._parsed.get("config", {}))
        self._mapping = g.get_gguf_hf_weights_map(meta_model, self._processor)
        self._tensors = {self._mapping[t.name]: t for t in self._reader.tensors if t.name in self._mapping}
        self._names = frozenset(self._tensors)

    def names(self) -> frozenset[str]:
        return self._names

    def get(self, name: str) -> torch.Tensor:
        import numpy as np
        from gguf import dequantize

        tensor = self._tensors[name]
        result = self._processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                         tensor_key_mapping=self._mapping, parsed_parameters=self._parsed)
        return torch.from_numpy(np.copy(result.weights))


def meta_model(path: str | os.PathLike, what: str = "target.path") -> nn.Module:
    """The causal LM of `path`'s config, on the meta device: its modules, names and ties, no memory."""
    from transformers import AutoModelForCausalLM

    config = load_config(path, what)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def tensor_source(path: str | os.PathLike, model: nn.Module, what: str = "target.path") -> TensorSource:
    """The tensors of the checked source `path` (a GGUF file or a model directory) under `model`'s names."""
    source = check_source(path, what)
    if source.suffix == ".gguf":
        return GGUFSource(source, model)
    return SafetensorsSource(source)


def tie_groups(model: nn.Module) -> dict[str, list[str]]:
    """Each state_dict name -> the sorted names that hold the same tensor (a tied LM head and embedding)."""
    state = model.state_dict(keep_vars=True)
    by_id: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_id.setdefault(id(tensor), []).append(name)
    return {name: sorted(by_id[id(tensor)]) for name, tensor in state.items()}


def _read(source: TensorSource, group: list[str], shape: torch.Size, what: str) -> torch.Tensor:
    """The tensor of a tie group from whichever of its names the source holds, its shape checked."""
    name = next((n for n in group if n in source.names()), None)
    if name is None:
        raise LeanUnavailable(f"{what} holds no tensor {' or '.join(group)}")
    value = source.get(name)
    check(tuple(value.shape) == tuple(shape), f"{what}: tensor {name} is {tuple(value.shape)}, the model's config "
                                              f"makes it {tuple(shape)}")
    return value


# ------------------------------------------------------------------------------ the hash

def streamed_weights_sha256(model: nn.Module, source: TensorSource, what: str = "target.path") -> str:
    """`weights.weights_sha256` of the model whose structure is `model` (meta) and whose values are
    `source`'s, one tensor at a time: sorted state_dict names, a tied tensor hashed once under its
    first name, values rounded to bfloat16 as float32 bytes."""
    h = hashlib.sha256()
    groups = tie_groups(model)
    state = model.state_dict(keep_vars=True)
    for name in sorted(state):
        shape = tuple(state[name].shape)
        h.update(f"{name}:{shape}:".encode())
        first = groups[name][0]
        if state[name].numel() and first != name:
            h.update(f"tied:{first}".encode())
            continue
        value = _read(source, groups[name], state[name].shape, what)
        h.update(value.to(torch.float32).to(torch.bfloat16).to(torch.float32).contiguous().reshape(-1)
                 .view(torch.uint8).numpy().data)
    return h.hexdigest()


# ------------------------------------------------------------------------------ the lean model

def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise LeanUnavailable(f"{type(model).__name__} keeps its decoder layers elsewhere than model.layers")
    return layers


def lean_causal_lm(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, layers: list[int] | tuple = (),
                   what: str = "target.path") -> nn.Module:
    """The target of `path` with only its token embedding, final norm, LM head and decoder `layers`
    (see the module docstring), frozen, in eval mode, the kept tensors in `dtype`. Raises
    `LeanUnavailable` for a checkpoint that cannot be read tensor by tensor, and a one-line
    SpecdecError for a target whose files hold no LM head (and do not tie it to the embedding)."""
    model = meta_model(path, what)
    source = tensor_source(path, model, what)
    head = model.get_output_embeddings()
    check(head is not None, f"{what}: {type(model).__name__} has no language-model head")
    state = model.state_dict(keep_vars=True)
    groups = tie_groups(model)
    head_names = groups[next(n for n, t in state.items() if t is head.weight)]
    held = source.names()
    unread = [g for n, g in groups.items() if n == g[0] and not any(m in held for m in g)]
    extra = held - set(state)                   # tensors under names the model does not use
    if any(g != head_names for g in unread) or (unread and extra):
        raise LeanUnavailable(f"{path} holds no tensor named {unread[0][0]} (names converted on load, or buffers)")
    check(not unread, f"{what}: {path} holds no LM-head tensor ({', '.join(head_names)}) and its config does not "
          "tie the head to the token embedding (tie_word_embeddings): a target's LM head is needed to train a "
          "head for it")
    sha = streamed_weights_sha256(model, source, what)

    decoder = _decoder_layers(model)
    depth = int(text_config(model.config).num_hidden_layers)
    keep = sorted({int(i) for i in layers})
    check(all(0 <= i < depth for i in keep), f"{what}: layers {keep} out of range for a target of {depth} layers")
    for i in range(len(decoder)):
        if i not in keep:
            decoder[i] = AbsentLayer(i)
    # what is left is read one tie group at a time (a tied head and embedding stay one tensor)
    state = model.state_dict(keep_vars=True)
    groups = tie_groups(model)
    read: dict[int, nn.Parameter] = {}
    for name in sorted(state):
        tensor = state[name]
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if id(tensor) not in read:
            read[id(tensor)] = nn.Parameter(_read(source, groups[name], tensor.shape, what).to(dtype),
                                            requires_grad=False)
        if leaf in owner._parameters:
            owner._parameters[leaf] = read[id(tensor)]
        else:
            owner._buffers[leaf] = read[id(tensor)].data
    for module in model.modules():             # buffers outside the state_dict (rotary frequencies): never read
        for leaf, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[leaf] = torch.zeros(buffer.shape, dtype=buffer.dtype)
    meta_left = [n for n, p in model.named_parameters() if p.is_meta]
    check(not meta_left, f"{what}: {', '.join(meta_left[:3])} were left unread")
    model.forward = _cannot_run                 # an instance attribute: nn.Module.__call__ reads it
    model.specdec_lean = LeanInfo(str(path), sha, tuple(keep))
    return model.eval().requires_grad_(False)


def lean_info(model: Any) -> LeanInfo | None:
    """What a lean model records (`lean_causal_lm`), or None for a whole model."""
    info = getattr(model, "specdec_lean", None)
    return info if isinstance(info, LeanInfo) else None


def loaded_layers(model: nn.Module) -> int:
    """How many of the model's decoder layers hold weights (a lean model's kept ones; a whole model's all)."""
    return sum(1 for layer in _decoder_layers(model) if not isinstance(layer, AbsentLayer))
