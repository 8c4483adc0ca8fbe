"""P-EAGLE heads in the layouts that serve them: specdec's own and speculators' (vLLM's).

A `heads.peagle.PEagleHead` is written by `save_peagle(DIR, head, layout)` and read back for a given
target by `load_peagle(DIR, target)`, whatever the layout (`detect_layout` tells them apart):

- "specdec": an export of kind `hf_peagle` (`export.specdec.save_export`). Loading checks the target
  by the hash of its weights.
- "speculators", what speculators 0.9.0's `PEagleDraftModel` (`speculators.models.peagle`) loads:
  speculators' EAGLE-3 config (`export.eagle3.speculators_config`: the Llama layer, the norm flags
  all false, the aux layers, the draft vocabulary) with `speculators_model_type: "peagle"`,
  `architectures: ["PEagleSpeculator"]`, `mask_token_id`, `embed_requires_grad: true` (the
  class's default) and a greedy proposal of `speculative_tokens` tokens (default K, the head's
  `parallel_depths`, which reading takes back as K); `model.safetensors` holding EAGLE-3's weights
  (`fc.weight`, `layers.0.*`, `norm.weight`, `lm_head.weight`, and `d2t` / `t2d` with a draft
  vocabulary smaller than the target's), `mask_hidden` as speculators stores it, (1, 1, A*H), and
  `embed_tokens.weight`: the target's embedding table with the mask token's row replaced by the
  head's learned `mask_embed`.

Where the semantics differ. speculators trains the whole embedding table (`embed_requires_grad`);
specdec's head learns only the mask token's row and reads the target's frozen table elsewhere. A
speculators head whose table differs from the target's in any other row would compute other
logits here, so it is refused in one line (a head speculators built from the verifier, and one
trained with `embed_requires_grad: false` but for the mask row, load). speculators leaves
`mask_hidden` random when missing (`_keys_to_ignore_on_load_missing`); here a missing one is
refused. The forward of speculators' class is its training step (COD-sampled positions, returns only
the loss); the logits of a drafted block are the same function of the same weights: depth 0 at
position t reads [E(x_t); fc(taps_t)], depth d reads [E(m); fc(mask_hidden)] at rotary position
t + d and sees the context's depth-0 positions <= t and its own chain (tests/test_peagle_interop.py
compares them). SGLang has no P-EAGLE layout, and an EAGLE-3 layout cannot hold the mask inputs:
writing another head kind, or a P-EAGLE head in a layout other than these two, is refused in one line.

Writes are atomic and checked as every layout's (`export.layouts`: SHA256SUMS beside the weights,
verified on reading; an existing directory replaced only when it holds the same head or `force`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import SpecdecError, check, check_positive_int
from ..heads.peagle import PEAGLE_WEIGHTS, PEagleConfig, PEagleHead
from .eagle3 import VERIFIER_COPIES
from .eagle3 import _build as build_eagle3
from .eagle3 import _config_from_speculators as eagle3_config
from .eagle3 import speculators_config as eagle3_speculators_config
from .layouts import SPECDEC, HeadKind, Layout, NameMap, detect, load_head, save_head

LAYOUTS = (SPECDEC, "speculators")
SPECULATORS_ARCHITECTURE = "PEagleSpeculator"
# PEagleDraftModel's `num_depths` default: K for a speculators config without a greedy proposal
SPECULATORS_DEPTHS = 8


# ------------------------------------------------------------------------------ config

def speculators_config(head: PEagleHead, layout: Layout | None = None, *, verifier: str | os.PathLike | None = None,
                       speculative_tokens: int | None = None) -> dict[str, Any]:
    """The config.json of the head in speculators' P-EAGLE format (module docstring). `verifier`: the
    name or path recorded for the target (default its `name_or_path`); `speculative_tokens`: the
    greedy proposal's length, read back as K (default the head's K; at least 2)."""
    c = head.config
    tokens = c.parallel_depths if speculative_tokens is None else speculative_tokens
    check_positive_int(tokens, "speculative_tokens")
    check(tokens >= 2, f"speculative_tokens {tokens}: a P-EAGLE head drafts at least 2 tokens per pass (reading the "
                       f"layout takes it back as parallel_depths)")
    config = eagle3_speculators_config(head, SPECULATORS if layout is None else layout, verifier=verifier,
                                       speculative_tokens=tokens)
    config["speculators_config"]["algorithm"] = "peagle"
    return {**config, "speculators_model_type": "peagle", "architectures": [SPECULATORS_ARCHITECTURE],
            "mask_token_id": c.mask_token_id, "embed_requires_grad": True}


def _config_from_speculators(config: dict[str, Any], target: Any, layout: Layout, where: str) -> PEagleConfig:
    base = eagle3_config(config, target, layout, where)
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or []
    tokens = next((m.get("speculative_tokens") for m in methods if isinstance(m, dict)), SPECULATORS_DEPTHS)
    mask = config.get("mask_token_id")
    check(isinstance(mask, int) and not isinstance(mask, bool),
          f"{where}: mask_token_id is missing or not an integer ({mask!r}): the head cannot fill its mask positions")
    try:
        return PEagleConfig(**base.to_dict(), parallel_depths=tokens, mask_token_id=mask)
    except SpecdecError as error:
        raise SpecdecError(f"{where}: {error}") from None


def _is_speculators(config: dict[str, Any]) -> bool:
    return config.get("speculators_model_type") == "peagle"


def _without_proposal(config: dict[str, Any]) -> dict[str, Any]:
    """A speculators config.json less its proposal (the tokens drafted per step: a serving setting)."""
    spec = config.get("speculators_config")
    if not isinstance(spec, dict):
        return config
    return {**config, "speculators_config": {k: v for k, v in spec.items() if k != "proposal_methods"}}


# ------------------------------------------------------------------------------ weights

def _stored(head: PEagleHead, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The head's tensors as speculators stores them: mask_hidden (1, 1, A*H), and mask_embed written
    into the target's embedding table (V, H), V the target's vocabulary (its logits' width), as the
    mask token's row (`embed_tokens.weight`)."""
    out = {k: v for k, v in tensors.items() if k not in ("mask_hidden", "mask_embed")}
    out["mask_hidden"] = tensors["mask_hidden"].reshape(1, 1, -1)
    rows = head.config.target_vocab_size          # speculators sizes its table by the layer config's vocab_size
    table = head.target.get_input_embeddings().weight[:rows].detach().to("cpu", tensors["mask_embed"].dtype).clone()
    table[head.config.mask_token_id] = tensors["mask_embed"]
    out["embed_tokens.weight"] = table
    return out


def _build(cfg: PEagleConfig, target: Any, tensors: dict[str, Tensor], copies: dict[str, Tensor],
           directory: Path) -> PEagleHead:
    """A PEagleHead for `target` from speculators' tensors (canonical names; `copies` the verifier's
    weights, `embed_tokens.weight` among them): mask_hidden back to (A*H,), mask_embed the table's
    mask row; a table that differs from the target's elsewhere is refused (module docstring)."""
    tensors = dict(tensors)
    hidden = tensors.pop("mask_hidden", None)
    check(hidden is not None, f"{directory}: mask_hidden is missing (speculators would start it at random): the head "
                              f"cannot draft past depth 0 without it")
    width = len(cfg.aux_layers) * cfg.hidden_size
    check(hidden.numel() == width and hidden.shape[-1] == width,
          f"{directory}: mask_hidden is {tuple(hidden.shape)}, the config makes it (1, 1, {width})")
    tensors["mask_hidden"] = hidden.reshape(width)
    own = target.get_input_embeddings().weight[:cfg.target_vocab_size].detach().cpu()
    copies = dict(copies)
    table = copies.pop("embed_tokens.weight", None)
    m = cfg.mask_token_id
    if table is None:                                 # speculators copies the verifier's table
        tensors["mask_embed"] = own[m].clone()
    else:
        check(tuple(table.shape) == tuple(own.shape), f"{directory}: embed_tokens.weight is {tuple(table.shape)}, "
                                                      f"the target's embedding {tuple(own.shape)}: a head for another "
                                                      f"target")
        rows = torch.ones(own.shape[0], dtype=torch.bool)
        rows[m] = False
        same = torch.equal(table[rows], own[rows].to(table.dtype))
        check(same, f"{directory}: embed_tokens.weight differs from the target's embedding outside the mask token's "
                    f"row {m} (speculators trained the whole table); specdec's P-EAGLE head learns only the mask row "
                    f"and reads the target's table elsewhere, so it would not compute this head's logits")
        tensors["mask_embed"] = table[m].clone()
    return build_eagle3(cfg, target, tensors, copies, directory, head_type=PEagleHead, table=PEAGLE_WEIGHTS)


# mask_hidden and the embedding table change shape (`_stored`); the other names are canonical
SPECULATORS = Layout("speculators", PEAGLE_WEIGHTS, NameMap(), speculators_config, _config_from_speculators,
                     _is_speculators, "a speculators peagle model", options=("verifier", "speculative_tokens"),
                     ignored=VERIFIER_COPIES, settings=_without_proposal, stored=_stored)
PEAGLE = HeadKind("peagle", PEagleHead, "hf_peagle", (SPECULATORS,), _build)


# ------------------------------------------------------------------------------ writing and reading

def save_peagle(directory: str | os.PathLike, head: PEagleHead, layout: str = SPECDEC, *,
                target_path: str | os.PathLike | None = None, verifier: str | os.PathLike | None = None,
                speculative_tokens: int | None = None, metadata: dict[str, Any] | None = None,
                force: bool = False) -> Path:
    """Write `head` into `directory` in `layout` ("specdec" or "speculators"; module docstring) and
    return its path. Refuses in one line another head kind, another layout, and a directory holding
    another model unless `force`."""
    check(isinstance(head, PEagleHead), f"the P-EAGLE layouts ({', '.join(LAYOUTS)}) hold a PEagleHead, got "
                                        f"{type(head).__name__}: write it with its own kind's export")
    check(layout in LAYOUTS, f"a P-EAGLE head has no {layout!r} layout (SGLang has none); layout must be one of "
                             f"{', '.join(LAYOUTS)}")
    given = {"verifier": verifier, "speculative_tokens": speculative_tokens}
    options = {k: v for k, v in given.items() if v is not None}
    return save_head(directory, head, PEAGLE, layout, target_path=target_path, metadata=metadata, force=force,
                     **options)


def detect_layout(directory: str | os.PathLike) -> str:
    """Which layout the head in `directory` has: "specdec" or "speculators" (one line for anything else)."""
    return detect(directory, PEAGLE)


def load_peagle(directory: str | os.PathLike, target: Any) -> PEagleHead:
    """The P-EAGLE head in `directory` (any layout) attached to the Hugging Face causal LM `target`, in
    eval mode; a head for another target, or one specdec's head does not compute, is refused in one line."""
    return load_head(directory, target, PEAGLE)


__all__ = ["LAYOUTS", "PEAGLE", "SPECULATORS", "detect_layout", "load_peagle", "save_peagle", "speculators_config"]
