"""EAGLE-3 heads in the three layouts that serve them: specdec's own, vLLM's (speculators) and SGLang's.

An `heads.eagle3.Eagle3Head` is written by `save_eagle3(DIR, head, layout)` and read back for a given
target by `load_eagle3(DIR, target)`, whatever the layout (`detect_layout` tells them apart):

- "specdec": an export of kind `hf_eagle3` (`export.specdec.save_export`: config.json with the head's
  Eagle3Config and its target's identity, weights named after their hash). Loading checks the
  target by the hash of its weights.
- "speculators", what vLLM loads (Li et al. 2025's head as vLLM's `speculators` 0.9.0 writes it):
  config.json with `speculators_model_type: "eagle3"`, `transformer_layer_config` (a Llama config of
  the one decoder layer, `vocab_size` the target's), `draft_vocab_size`,
  `eagle_aux_hidden_state_layer_ids`, every norm flag written out (vLLM reads a missing
  `norm_before_residual` as true, speculators as false), `speculators_config` naming the verifier
  and a greedy proposal of `speculative_tokens` tokens (a chain: give the drafting that was
  evaluated, `SPECULATIVE_TOKENS` when none is given; vLLM's `num_speculative_tokens` on its
  command line decides what it drafts, docs/serving.md); `model.safetensors` holding `fc.weight`,
  `layers.0.*`, `norm.weight`, `lm_head.weight` and, with a draft vocabulary smaller than the
  target's, `d2t` / `t2d`. `embed_tokens.weight` is not written: speculators ignores it when missing (it copies the
  verifier's), vLLM then shares the target's.
- "sglang", what SGLang's `LlamaForCausalLMEagle3` (python/sglang/srt/models/llama_eagle3.py)
  loads: a flat Llama config.json with `architectures: ["LlamaForCausalLMEagle3"]`,
  `num_hidden_layers: 1`, `tie_word_embeddings: false`, `draft_vocab_size`, the aux layers in
  `eagle_config.eagle_aux_hidden_state_layer_ids`; weights `fc.weight`, `midlayer.*`,
  `norm.weight`, `lm_head.weight`, `d2t`, `t2d`.

Each foreign layout is data (`export.layouts.Layout`): a name map from the head's canonical weight
names (`heads.eagle3.EAGLE3_WEIGHTS`, those of speculators) to the layout's (SGLang: `layers.0.` ->
`midlayer.`), a tap numbering (SGLang's below), and its config writer and reader. `EAGLE3` (a
`HeadKind`) gathers them with the head's builder; writing, detecting and reading are the generic
`save_head`, `detect` and `load_head` of `export.layouts`, the same for every head kind and layout.

Aux-layer numbering. specdec and vLLM/speculators number an aux layer by its Hugging Face
`hidden_states` index: i is the input of decoder layer i (0 the embeddings). SGLang numbers the
output of a layer: `set_eagle3_layers_to_capture` (python/sglang/srt/models/llama.py) captures at
`val + 1` for each configured id, and its `LlamaModel.forward` captures `hidden_states + residual`
before running layer i, the input of layer i. So SGLang id = `hidden_states` index - 1; only
indices 1..L-1 can be expressed there (index 0 would capture before the first residual exists,
index L after the last layer the loop runs), and SGLang's `fc` takes exactly 3 aux layers.

All the head's maths is the speculators default (`norm_before_residual`, `norm_before_fc`,
`fc_norm`, `norm_output` all false); importing a head with any other setting is refused in one
line, as are a head for another target's hidden size or vocabulary, aux ids beyond the target's
depth, a missing `d2t` with a draft vocabulary smaller than the target's, and pickled weights.

The speculators and SGLang layouts carry SHA256SUMS, their weights' checksums, which loading
verifies when present (`export.checksums`), as specdec's own export verifies its weights' hash.

Writes are atomic: the directory is built beside its destination and renamed over it whole
(`files.staged_dir`). An existing directory is replaced only when it is empty or holds the same
layout's head for the same config (shapes, aux layers, vocabularies, verifier; the tokens drafted
per step may differ); anything else needs `force=True` (`--force`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import SpecdecError, check, check_positive_int
from ..heads.eagle3 import EAGLE3_WEIGHTS, Eagle3Config, Eagle3Head, default_aux_layers
from ..heads.peagle import PEagleHead
from ..heads.weights import WeightTable
from ..hf.adapter import logits_width, text_config
from .layouts import SPECDEC, HeadKind, Layout, NameMap, Rename, TapNumbering, detect, load_head, save_head

LAYOUTS = (SPECDEC, "speculators", "sglang")
SPECULATORS_VERSION = "0.9.0"       # the speculators release whose format is written (tests/test_eagle3_interop.py)
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# speculators' `speculative_tokens` when no drafting is given: the chain every specdec evaluation of an
# eagle3 head measures (specdec evaluate's and the recipe's gamma 5)
SPECULATIVE_TOKENS = 5
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# what a speculators checkpoint may hold beside the head: the verifier's copies, read and dropped
VERIFIER_COPIES = frozenset({"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"})


# ------------------------------------------------------------------------------ numbering

def sglang_layer_ids(aux_layers: list[int], target_layers: int) -> list[int]:
    """SGLang's ids of the aux layers given as `hidden_states` indices (module docstring): index - 1,
    refused in one line where SGLang cannot capture it."""
    return SGLANG.numbering.to_layout(list(aux_layers), target_layers)


def layer_ids_from_sglang(ids: list[int]) -> list[int]:
    """`hidden_states` indices of SGLang's aux-layer ids (id + 1)."""
    return SGLANG.numbering.from_layout(ids)


# ------------------------------------------------------------------------------ config writers

def _dtype_name(head: Eagle3Head) -> str:
    return str(head.fc.weight.dtype).removeprefix("torch.")


def _layer_config(c: Eagle3Config) -> dict[str, Any]:
    """The Llama config of the head's one decoder layer, every field the loaders read written out;
    `vocab_size` is the target's (the embedding the layer reads)."""
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "num_hidden_layers": 1, "hidden_act": c.hidden_act, "rms_norm_eps": c.rms_norm_eps,
            # rope_theta for transformers 4 readers, rope_parameters for transformers 5 (both mean the same)
            "rope_theta": c.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "max_position_embeddings": c.max_seq_len, "vocab_size": c.target_vocab_size,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}


def _verifier(head: Eagle3Head, verifier: str | os.PathLike | None) -> dict[str, Any]:
    target = head.target
    name = verifier if verifier is not None else (getattr(target, "name_or_path", None) or None)
    architectures = list(getattr(target.config, "architectures", None) or [type(target).__name__])
    return {"name_or_path": None if name is None else str(name), "architectures": architectures}


def _layout_ids(c: Eagle3Config, layout: Layout) -> list[int]:
    """The aux layers in the layout's numbering."""
    return layout.numbering.to_layout(list(c.aux_layers), c.target_layers)


def speculators_config(head: Eagle3Head, layout: Layout | None = None, *, verifier: str | os.PathLike | None = None,
                       speculative_tokens: int = SPECULATIVE_TOKENS) -> dict[str, Any]:
    """The config.json of the head in speculators' format (module docstring; `layout`: SPECULATORS,
    the default). `verifier`: the name or path recorded for the target (default: the target's
    `name_or_path`); `speculative_tokens`: the length of the greedy proposal's chain."""
    check_positive_int(speculative_tokens, "speculative_tokens")
    c = head.config
    layout = SPECULATORS if layout is None else layout
    return {"speculators_model_type": "eagle3", "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": _layer_config(c),
            "draft_vocab_size": c.draft_vocab_size, "eagle_aux_hidden_state_layer_ids": _layout_ids(c, layout),
            "target_hidden_size": None, **{flag: False for flag in NORM_FLAGS}, "embed_requires_grad": False,
            "tie_word_embeddings": False, "torch_dtype": _dtype_name(head),
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": _verifier(head, verifier)}}


def sglang_config(head: Eagle3Head, layout: Layout | None = None) -> dict[str, Any]:
    """The config.json of the head in the layout SGLang's LlamaForCausalLMEagle3 loads (module
    docstring; `layout`: SGLANG, the default); the aux layers in SGLang's numbering."""
    c = head.config
    layout = SGLANG if layout is None else layout
    return {"architectures": [SGLANG_ARCHITECTURE], **_layer_config(c), "draft_vocab_size": c.draft_vocab_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": _layout_ids(c, layout), "use_aux_hidden_state": True},
            "torch_dtype": _dtype_name(head)}


# ------------------------------------------------------------------------------ config readers

def _get(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    check(isinstance(value, int) and not isinstance(value, bool), f"{where}: {key} is missing or not an integer "
                                                                  f"({value!r})")
    return value


def _layer_fields(tl: dict[str, Any], target: Any, where: str) -> dict[str, Any]:
    """Eagle3Config fields from a Llama layer config, checked against the target's shapes."""
    check(tl.get("model_type", "llama") == "llama",
          f"{where}: the head's layer is {tl.get('model_type')!r}; specdec's eagle3 head is a Llama layer")
    check(tl.get("num_hidden_layers", 1) == 1,
          f"{where}: the head has {tl.get('num_hidden_layers')} decoder layers; specdec's eagle3 head has one")
    c = text_config(target.config)
    name = type(target).__name__
    hidden = _get(tl, "hidden_size", where)
    check(hidden == int(c.hidden_size), f"{where}: a head for a target of hidden size {hidden}, {name} has "
                                        f"{c.hidden_size}: load it with the target it was trained for")
    vocab = _get(tl, "vocab_size", where)
    check(vocab == logits_width(target), f"{where}: a head for a target vocabulary of {vocab} tokens, {name}'s head "
                                          f"has {logits_width(target)}: load it with the target it was trained for")
    for key in ("attention_bias", "mlp_bias"):
        check(not tl.get(key, False), f"{where}: {key} is set; specdec's eagle3 head has no biases")
    rope = tl.get("rope_parameters") or {}
    scaling = tl.get("rope_scaling")
    check(rope.get("rope_type", "default") == "default" and (scaling is None or scaling.get("rope_type") == "default"),
          f"{where}: rope scaling {scaling or rope} is not supported by specdec's eagle3 head (plain rotary only)")
    theta = rope.get("rope_theta", tl.get("rope_theta", 10000.0))
    heads = _get(tl, "num_attention_heads", where)
    return {"hidden_size": hidden, "num_heads": heads, "num_kv_heads": int(tl.get("num_key_value_heads") or heads),
            "head_dim": int(tl.get("head_dim") or hidden // heads),
            "intermediate_size": _get(tl, "intermediate_size", where), "target_vocab_size": vocab,
            "target_layers": int(c.num_hidden_layers), "rms_norm_eps": float(tl.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(theta), "hidden_act": str(tl.get("hidden_act", "silu")),
            "max_seq_len": int(tl.get("max_position_embeddings") or getattr(c, "max_position_embeddings", 2048))}


def _config_from_speculators(config: dict[str, Any], target: Any, layout: Layout, where: str) -> Eagle3Config:
    tl = config.get("transformer_layer_config")
    check(isinstance(tl, dict), f"{where}: transformer_layer_config is missing")
    fields = _layer_fields(tl, target, where)
    check("norm_before_residual" in config,
          f"{where}: norm_before_residual is missing (vLLM reads that as true, speculators as false): write it out")
    for flag in NORM_FLAGS:
        check(not config.get(flag, False),
              f"{where}: {flag} is true; specdec's eagle3 head computes the speculators default (all of "
              f"{', '.join(NORM_FLAGS)} false)")
    size = config.get("target_hidden_size")
    check(size is None or size == fields["hidden_size"],
          f"{where}: target_hidden_size {size} differs from the layer's hidden size; specdec's head reads the target's")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    aux = layout.numbering.from_layout(ids) if ids else default_aux_layers(fields["target_layers"])
    return _eagle3_config(fields, config.get("draft_vocab_size"), aux, where)


def _config_from_sglang(config: dict[str, Any], target: Any, layout: Layout, where: str) -> Eagle3Config:
    check(config.get("tie_word_embeddings") is False,
          f"{where}: tie_word_embeddings is {config.get('tie_word_embeddings')!r}; an EAGLE-3 head has its own LM head "
          f"(false)")
    fields = _layer_fields(config, target, where)
    eagle = config.get("eagle_config") or {}
    check(isinstance(eagle, dict), f"{where}: eagle_config must be an object")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    # without ids, SGLang captures at hidden_states indices [2, L//2, L-3] (no +1 applied)
    aux = layout.numbering.from_layout(ids) if ids else default_aux_layers(fields["target_layers"])
    draft = config.get("draft_vocab_size")
    return _eagle3_config(fields, fields["target_vocab_size"] if draft is None else draft, aux, where)


def _eagle3_config(fields: dict[str, Any], draft: Any, aux: Any, where: str) -> Eagle3Config:
    check(isinstance(draft, int) and not isinstance(draft, bool), f"{where}: draft_vocab_size is missing or not an "
                                                                  f"integer ({draft!r})")
    check(isinstance(aux, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in aux),
          f"{where}: the aux-layer ids must be a list of integers, got {aux!r}")
    depth = fields["target_layers"]
    for i in aux:
        check(0 <= i <= depth, f"{where}: aux layer {i} (hidden_states index) is beyond the target's depth: it has "
                               f"{depth} layers, hidden_states indices 0..{depth}")
    return Eagle3Config(**fields, draft_vocab_size=draft, aux_layers=aux)


def _without_proposal(config: dict[str, Any]) -> dict[str, Any]:
    """A speculators config.json less its proposal (the tokens drafted per step: a serving setting)."""
    spec = config.get("speculators_config")
    if not isinstance(spec, dict):
        return config
    return {**config, "speculators_config": {k: v for k, v in spec.items() if k != "proposal_methods"}}


def _is_speculators(config: dict[str, Any]) -> bool:
    return config.get("speculators_model_type") == "eagle3"


def _is_sglang(config: dict[str, Any]) -> bool:
    return "speculators_model_type" not in config and SGLANG_ARCHITECTURE in (config.get("architectures") or [])


# ------------------------------------------------------------------------------ the layouts

# vLLM's speculators: the canonical names as they are
SPECULATORS = Layout("speculators", EAGLE3_WEIGHTS, NameMap(), speculators_config, _config_from_speculators,
                     _is_speculators, "a speculators eagle3 model", options=("verifier", "speculative_tokens"),
                     ignored=VERIFIER_COPIES, settings=_without_proposal)
# SGLang's LlamaForCausalLMEagle3: the decoder layer is `midlayer`; a tap's id is the output of a layer,
# hidden_states index - 1, for indices 1..L-1, and its fc fuses exactly 3 (module docstring)
SGLANG = Layout("sglang", EAGLE3_WEIGHTS, NameMap((Rename("layers.0.", "midlayer."),)), sglang_config,
                _config_from_sglang, _is_sglang, f"an SGLang {SGLANG_ARCHITECTURE} head",
                numbering=TapNumbering(offset=-1, first=1, last=-1, count=3, reader=f"SGLang's {SGLANG_ARCHITECTURE}"),
                ignored=VERIFIER_COPIES)
# the layouts other servers load; "specdec" is specdec's own export (`export.specdec`, canonical names)
EAGLE3_LAYOUTS = {layout.name: layout for layout in (SPECULATORS, SGLANG)}


# ------------------------------------------------------------------------------ writing and reading

def save_eagle3(directory: str | os.PathLike, head: Eagle3Head, layout: str = SPECDEC, *,
                target_path: str | os.PathLike | None = None, verifier: str | os.PathLike | None = None,
                speculative_tokens: int | None = None, metadata: dict[str, Any] | None = None,
                force: bool = False) -> Path:
    """Write `head` into `directory` in `layout` ("specdec", "speculators" or "sglang"; see the
    module docstring) and return its path. `target_path` (specdec) and `verifier` (speculators)
    record where the target comes from (default: its `name_or_path`); `speculative_tokens`
    (speculators) the chain it drafts (default `SPECULATIVE_TOKENS`); `metadata` only in specdec's
    layout. Refuses (one line) a directory holding another model unless `force`."""
    # a P-EAGLE head is an Eagle3Head too, but its mask embedding and mask feature have no place here
    check(layout == SPECDEC or not isinstance(head, PEagleHead),
          f"the {layout} layout holds an EAGLE-3 head, not a P-EAGLE head (its mask_hidden and mask_embed have no "
          f"place there): write it in specdec's layout (kind hf_peagle)")
    given = {"verifier": verifier, "speculative_tokens": speculative_tokens}
    options = {k: v for k, v in given.items() if v is not None}
    return save_head(directory, head, EAGLE3, layout, target_path=target_path, metadata=metadata, force=force,
                     **options)


def detect_layout(directory: str | os.PathLike) -> str:
    """Which layout the head in `directory` has: "specdec", "speculators" or "sglang" (one-line
    `SpecdecError` for anything else)."""
    return detect(directory, EAGLE3)


def load_eagle3(directory: str | os.PathLike, target: Any) -> Eagle3Head:
    """The eagle3 head in `directory` (any layout, `detect_layout`) attached to the Hugging Face
    causal LM `target`, in eval mode. Refuses in one line a head for another target (hidden size,
    vocabulary, depth, or for specdec's layout the hash of its weights) and the settings specdec's
    head does not compute (module docstring)."""
    return load_head(directory, target, EAGLE3)


def _build(cfg: Eagle3Config, target: Any, tensors: dict[str, Tensor], copies: dict[str, Tensor],
           directory: Path, head_type: type[Eagle3Head] = Eagle3Head,
           table: WeightTable = EAGLE3_WEIGHTS) -> Eagle3Head:
    """An Eagle3Head for `target` holding `tensors` (canonical names), checked name by name against
    `EAGLE3_WEIGHTS`; `copies`, the verifier's weights a layout may hold, must be the target's shape.
    `head_type` and `table`: a subclass and its weight table (`export.peagle` builds a PEagleHead)."""
    emb = copies.get("embed_tokens.weight")
    if emb is not None:
        want = tuple(target.get_input_embeddings().weight.shape)
        check(tuple(emb.shape) == want, f"{directory}: embed_tokens.weight is {tuple(emb.shape)}, the target's "
                                        f"embedding {want}: a head for another target")
    full = cfg.draft_vocab_size == cfg.target_vocab_size
    d2t = tensors.get("d2t")
    if d2t is None:
        check(full, f"{directory}: d2t is missing, and the draft vocabulary ({cfg.draft_vocab_size}) is smaller than "
                    f"the target's ({cfg.target_vocab_size}): without it the draft ids cannot be mapped")
        ids = torch.arange(cfg.draft_vocab_size)
    else:
        check(d2t.shape == (cfg.draft_vocab_size,) and not d2t.is_floating_point(),
              f"{directory}: d2t must be ({cfg.draft_vocab_size},) integers, got {tuple(d2t.shape)} {d2t.dtype}")
        ids = d2t.long() + torch.arange(cfg.draft_vocab_size)
    try:
        head = head_type(cfg, target, ids, init_from_target=False)
    except SpecdecError as error:
        raise SpecdecError(f"{directory}: {error}") from None
    t2d = tensors.get("t2d")
    if t2d is not None:
        check(t2d.shape == head.t2d.shape and torch.equal(t2d.bool(), head.t2d.cpu()),
              f"{directory}: t2d does not mark the target ids d2t names")
    maps = table.vocab_maps
    state = {k: v for k, v in tensors.items() if k not in maps}
    if "lm_head.weight" not in state and full:
        # SGLang without draft_vocab_size loads the LM head from the target
        state["lm_head.weight"] = target.get_output_embeddings().weight[:cfg.target_vocab_size].detach()
    shapes = {k: shape for k, shape in table.shapes(cfg).items() if k not in maps}
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    check(not missing and not unexpected, f"{directory}: the weights do not make specdec's {table.kind} head: missing "
                                          f"{_few(missing)}, unexpected {_few(unexpected)}")
    for k, v in state.items():
        check(tuple(v.shape) == shapes[k], f"{directory}: {k} is {tuple(v.shape)}, the config makes it {shapes[k]}")
    head.load_state_dict(state, strict=False)
    return head.eval()


EAGLE3 = HeadKind("eagle3", Eagle3Head, "hf_eagle3", (SPECULATORS, SGLANG), _build)


def _few(names: list[str], limit: int = 4) -> str:
    if not names:
        return "none"
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


__all__ = ["EAGLE3", "EAGLE3_LAYOUTS", "LAYOUTS", "SGLANG", "SPECULATIVE_TOKENS", "SPECULATORS", "detect_layout",
           "layer_ids_from_sglang", "load_eagle3", "save_eagle3", "sglang_config", "sglang_layer_ids",
           "speculators_config"]
