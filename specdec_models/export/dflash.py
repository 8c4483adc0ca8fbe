"""DFlash heads in the layouts that serve them: specdec's own and speculators' (vLLM's).

A `heads.dflash.DFlashHead` is written by `save_dflash(DIR, head, layout)` and read back for a given
target by `load_dflash(DIR, target)`, whatever the layout (`detect_layout` tells them apart):

- "specdec": an export of kind `hf_dflash` (`export.specdec.save_export`: config.json with the head's
  DFlashConfig and its target's identity). Loading checks the target by the hash of its weights.
- "speculators", what speculators 0.9.0's `DFlashDraftModel` loads (and vLLM serves from it):
  config.json with `speculators_model_type: "dflash"`, `transformer_layer_config` (a Qwen3 config
  of the draft layers: per-head q_norm and k_norm, `num_hidden_layers` the draft's depth,
  `vocab_size` the target's), `draft_vocab_size`, `block_size`, `mask_token_id`,
  `aux_hidden_state_layer_ids` (the taps, numbered as speculators numbers EAGLE-3's: the
  Hugging Face `hidden_states` index, `num_layers` itself the last layer's output),
  `sample_from_anchor: false` (slot 0 is the anchor: block_size - 1 drafts),
  `sliding_window_non_causal: false` (every layer full attention), `speculators_config` naming the
  verifier and a greedy proposal of block_size - 1 tokens; `model.safetensors` holding `fc.weight`,
  `hidden_norm.weight`, `layers.{i}.*`, `norm.weight`, `lm_head.weight` and, with a draft
  vocabulary smaller than the target's, `d2t` / `t2d`. `embed_tokens.weight` is not written:
  speculators copies the verifier's.

speculators' DFlash over the whole vocabulary takes its LM head from the verifier (frozen), so a
full-vocabulary head is written only when its LM head is still the target's (`head.train_lm_head:
false`); another is refused in one line (train with a draft vocabulary, or the LM head frozen).
SGLang's DFlash reads z-lab's own checkpoint layout, which specdec does not write: no SGLang layout
here. Importing a head with a sliding window, `sample_from_anchor`, another target's hidden size or
vocabulary, or taps beyond the target's depth is refused in one line.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import SpecdecError, check, check_positive_int
from ..heads.dflash import DFlashConfig, DFlashHead, dflash_weights
from ..hf.adapter import logits_width, text_config
from .eagle3 import SPECULATORS_VERSION, VERIFIER_COPIES
from .layouts import SPECDEC, HeadKind, Layout, NameMap, detect, load_head, save_head, save_layout

LAYOUTS = (SPECDEC, "speculators")
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"


# ------------------------------------------------------------------------------ config writer

def _layer_config(c: DFlashConfig) -> dict[str, Any]:
    """The Qwen3 config of the head's draft layers, every field the loaders read written out."""
    return {"model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "num_hidden_layers": c.num_layers, "hidden_act": c.hidden_act, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "max_position_embeddings": c.max_seq_len, "vocab_size": c.target_vocab_size, "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False}


def speculators_config(head: DFlashHead, layout: Layout | None = None, *, verifier: str | os.PathLike | None = None,
                       speculative_tokens: int | None = None) -> dict[str, Any]:
    """The config.json of the head in speculators' format (module docstring). `verifier`: the name
    or path recorded for the target (default its `name_or_path`); `speculative_tokens`: the greedy
    proposal's length (default block_size - 1, what one pass drafts)."""
    c = head.config
    tokens = c.block_size - 1 if speculative_tokens is None else speculative_tokens
    check_positive_int(tokens, "speculative_tokens")
    check(tokens <= c.block_size - 1, f"speculative_tokens {tokens} exceeds the {c.block_size - 1} drafts one pass of "
                                      f"the block gives")
    _check_lm_head(head)
    target = head.target
    name = verifier if verifier is not None else (getattr(target, "name_or_path", None) or None)
    architectures = list(getattr(target.config, "architectures", None) or [type(target).__name__])
    return {"speculators_model_type": "dflash", "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": _layer_config(c),
            "draft_vocab_size": c.draft_vocab_size, "block_size": c.block_size, "target_hidden_size": None,
            "aux_hidden_state_layer_ids": list(c.aux_layers), "mask_token_id": c.mask_token_id,
            "sliding_window_non_causal": False, "sample_from_anchor": False,
            "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
            "speculators_config": {
                "algorithm": "dflash", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": None if name is None else str(name), "architectures": architectures}}}


def _check_lm_head(head: DFlashHead) -> None:
    """A full-vocabulary head's LM head must be the target's (module docstring)."""
    c = head.config
    if c.draft_vocab_size != c.target_vocab_size:
        return
    theirs = head.target.get_output_embeddings().weight[: c.target_vocab_size]
    check(torch.equal(head.lm_head.weight.detach().cpu(), theirs.detach().to(head.lm_head.weight).cpu()),
          "speculators' DFlash layout takes a full-vocabulary head's LM head from the verifier, and this head's LM "
          "head was trained: train it with a draft vocabulary (head.draft_vocab_size) or head.train_lm_head=false")


# ------------------------------------------------------------------------------ config reader

def _int(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    check(isinstance(value, int) and not isinstance(value, bool), f"{where}: {key} is missing or not an integer "
                                                                  f"({value!r})")
    return value


def _config_from_speculators(config: dict[str, Any], target: Any, layout: Layout, where: str) -> DFlashConfig:
    tl = config.get("transformer_layer_config")
    check(isinstance(tl, dict), f"{where}: transformer_layer_config is missing")
    check(not config.get("sample_from_anchor", False),
          f"{where}: sample_from_anchor is true; specdec's DFlash head drafts from the mask slots only")
    types = tl.get("layer_types") or []
    check(not tl.get("use_sliding_window", False) and all(t == "full_attention" for t in types),
          f"{where}: sliding-window layers are not supported by specdec's DFlash head (full attention only)")
    check(not tl.get("attention_bias", False), f"{where}: attention_bias is set; specdec's DFlash head has no biases")
    rope = tl.get("rope_parameters") or {}
    scaling = tl.get("rope_scaling")
    check(rope.get("rope_type", "default") == "default" and (scaling is None or scaling.get("rope_type") == "default"),
          f"{where}: rope scaling {scaling or rope} is not supported by specdec's DFlash head (plain rotary only)")
    c = text_config(target.config)
    name = type(target).__name__
    hidden, vocab = _int(tl, "hidden_size", where), _int(tl, "vocab_size", where)
    check(hidden == int(c.hidden_size) and config.get("target_hidden_size") in (None, hidden),
          f"{where}: a head for a target of hidden size {hidden}, {name} has {c.hidden_size}: load it with the "
          f"target it was trained for")
    check(vocab == logits_width(target), f"{where}: a head for a target vocabulary of {vocab} tokens, {name}'s head "
                                          f"has {logits_width(target)}: load it with the target it was trained for")
    heads = _int(tl, "num_attention_heads", where)
    depth = int(c.num_hidden_layers)
    taps = config.get("aux_hidden_state_layer_ids")
    check(isinstance(taps, list) and taps and all(isinstance(i, int) and 0 <= i <= depth for i in taps),
          f"{where}: aux_hidden_state_layer_ids must list hidden_states indices 0..{depth} of the target, got {taps!r}")
    mask = config.get("mask_token_id")
    check(isinstance(mask, int), f"{where}: mask_token_id is missing: the head cannot fill its blank slots")
    return DFlashConfig(
        hidden_size=hidden, num_heads=heads, num_kv_heads=int(tl.get("num_key_value_heads") or heads),
        head_dim=int(tl.get("head_dim") or hidden // heads), intermediate_size=_int(tl, "intermediate_size", where),
        target_vocab_size=vocab, draft_vocab_size=_int(config, "draft_vocab_size", where), target_layers=depth,
        aux_layers=taps, block_size=_int(config, "block_size", where), mask_token_id=mask,
        num_layers=_int(tl, "num_hidden_layers", where), rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", tl.get("rope_theta", 10000.0))),
        max_seq_len=int(tl.get("max_position_embeddings") or getattr(c, "max_position_embeddings", 2048)),
        hidden_act=str(tl.get("hidden_act", "silu")))


def _is_speculators(config: dict[str, Any]) -> bool:
    return config.get("speculators_model_type") == "dflash"


def _without_proposal(config: dict[str, Any]) -> dict[str, Any]:
    """A speculators config.json less its proposal (the tokens drafted per step: a serving setting)."""
    spec = config.get("speculators_config")
    if not isinstance(spec, dict):
        return config
    return {**config, "speculators_config": {k: v for k, v in spec.items() if k != "proposal_methods"}}


# the canonical names as they are; the weight table depends on the draft depth, so a head's own is used
# to write (`save_dflash`) and the builder checks a read one against its config's
SPECULATORS = Layout("speculators", dflash_weights(1), NameMap(), speculators_config, _config_from_speculators,
                     _is_speculators, "a speculators dflash model", options=("verifier", "speculative_tokens"),
                     ignored=VERIFIER_COPIES, settings=_without_proposal)


# ------------------------------------------------------------------------------ writing and reading

def save_dflash(directory: str | os.PathLike, head: DFlashHead, layout: str = SPECDEC, *,
                target_path: str | os.PathLike | None = None, verifier: str | os.PathLike | None = None,
                speculative_tokens: int | None = None, metadata: dict[str, Any] | None = None,
                force: bool = False) -> Path:
    """Write `head` into `directory` in `layout` ("specdec" or "speculators"; module docstring) and
    return its path. Refuses (one line) a directory holding another model unless `force`."""
    given = {"verifier": verifier, "speculative_tokens": speculative_tokens}
    options = {k: v for k, v in given.items() if v is not None}
    if layout == SPECULATORS.name:
        check(isinstance(head, DFlashHead), f"can only write a DFlashHead in a dflash layout, got "
                                            f"{type(head).__name__}")
        check(metadata is None and target_path is None, "the speculators layout has no place for metadata or a "
                                                        "target path")
        own = dataclasses.replace(SPECULATORS, table=dflash_weights(head.config.num_layers))
        return save_layout(directory, head, own, force=force, **options)
    return save_head(directory, head, DFLASH, layout, target_path=target_path, metadata=metadata, force=force,
                     **options)


def detect_layout(directory: str | os.PathLike) -> str:
    """Which layout the head in `directory` has: "specdec" or "speculators" (one line for anything else)."""
    return detect(directory, DFLASH)


def load_dflash(directory: str | os.PathLike, target: Any) -> DFlashHead:
    """The DFlash head in `directory` (any layout) attached to the Hugging Face causal LM `target`,
    in eval mode; a head for another target or one specdec's head does not compute is refused in one line."""
    return load_head(directory, target, DFLASH)


def _build(cfg: DFlashConfig, target: Any, tensors: dict[str, Tensor], copies: dict[str, Tensor],
           directory: Path) -> DFlashHead:
    """A DFlashHead for `target` holding `tensors` (canonical names), checked against its weight table."""
    table = dflash_weights(cfg.num_layers)
    full = cfg.draft_vocab_size == cfg.target_vocab_size
    d2t = tensors.get("d2t")
    check(d2t is not None or full, f"{directory}: d2t is missing, and the draft vocabulary ({cfg.draft_vocab_size}) is "
                                   f"smaller than the target's ({cfg.target_vocab_size})")
    if d2t is not None:
        check(d2t.shape == (cfg.draft_vocab_size,) and not d2t.is_floating_point(),
              f"{directory}: d2t must be ({cfg.draft_vocab_size},) integers, got {tuple(d2t.shape)} {d2t.dtype}")
    ids = torch.arange(cfg.draft_vocab_size) + (0 if d2t is None else d2t.long())
    try:
        head = DFlashHead(cfg, target, ids, init_from_target=False)
    except SpecdecError as error:
        raise SpecdecError(f"{directory}: {error}") from None
    state = {k: v for k, v in tensors.items() if k not in table.vocab_maps}
    if "lm_head.weight" not in state and full:          # speculators' full-vocabulary head: the verifier's
        state["lm_head.weight"] = target.get_output_embeddings().weight[: cfg.target_vocab_size].detach()
    shapes = {k: s for k, s in table.shapes(cfg).items() if k not in table.vocab_maps}
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    check(not missing and not unexpected, f"{directory}: the weights do not make specdec's DFlash head: missing "
                                          f"{', '.join(missing[:4]) or 'none'}, unexpected "
                                          f"{', '.join(unexpected[:4]) or 'none'}")
    for k, v in state.items():
        check(tuple(v.shape) == shapes[k], f"{directory}: {k} is {tuple(v.shape)}, the config makes it {shapes[k]}")
    head.load_state_dict(state, strict=False)
    return head.eval()


DFLASH = HeadKind("dflash", DFlashHead, "hf_dflash", (SPECULATORS,), _build)

__all__ = ["DFLASH", "LAYOUTS", "SPECULATORS", "detect_layout", "load_dflash", "save_dflash", "speculators_config"]
