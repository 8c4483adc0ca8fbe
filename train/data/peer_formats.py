"""specdec's embeddings cache in the offline-data formats of two peer EAGLE-3 trainers.

The peers train the same head (Li et al. 2025, "EAGLE-3") from the same kind of data, the
target's hidden states of training rows, each in its own files. These pure functions write a
specdec cache made with `--layers A,B,C,L` (three aux layers as Hugging Face `hidden_states`
indices, then L = the target's depth: its last layer AFTER the final norm) in their formats, so
both train on exactly the rows, features and answer tokens specdec's head trains on.

vLLM's `speculators` (0.9.0, `speculators train`; read from speculators/train/data.py,
models/eagle3/{data,core,metrics}.py and hs_connectors/transfer.py):

    DIR/                                  `datasets.save_to_disk`, torch format, columns
        input_ids (T,) int64, loss_mask (T,) int64, seq_len int
    DIR/hidden_states/hs_{i}.safetensors  row i: hidden_states (T, 4, H), token_ids (T,) int64
    DIR/d2t-{D}.npy, DIR/t2d-{D}.npy      the draft vocabulary (`vocab_files`), found there by name

  `ArrowDataset` reads slots 0..2 of `hidden_states` as the fc's input and slot 3 as
  `verifier_last_hidden_states`, to which the model applies the verifier's final RMSNorm (its
  `verifier_norm`, gain g) and LM head. Slot 3 is therefore the last layer BEFORE the final norm.
  The cache holds `post` = RMSNorm(x)·g, not x; `post / g` is stored instead
  (`before_final_norm`), which that norm maps back onto `post` (rms(post / g) = rms(x / rms(x)) =
  1, up to eps: a relative eps / (2 mean(x^2))), so the teacher's logits are the cache's. With a
  bf16 or int8 cache the stored `post` is rounded, its rms off 1 by the rounding, and the norm
  rescales it: the teacher's
  logits are the cache's times 1 / rms(post / g), a factor within about 0.5% (bf16) or 1% (int8)
  of 1 per position. `shift_batch` then pairs, at position t, the feature of t, token t + 1,
  the verifier state of t + 1 and loss_mask[t + 1]: loss_mask[j] weighs the prediction the
  target makes at position j (of token j + 1).

SpecForge (0.2.0, offline EAGLE-3; read from specforge/data/preprocessing.py
`OfflineEagle3Dataset`, modeling/target/target_head.py `TargetHead.preprocess`,
algorithms/eagle3/model.py):

    DIR/row_{i:06d}.ckpt                  `torch.save` of {input_ids (T,) int64, loss_mask (T,)
                                          int64, hidden_state (1, T, H) bf16 the last layer AFTER
                                          the final norm, aux_hidden_state (1, T, 3H) the aux
                                          layers concatenated in order, in the draft's dtype}
    DIR/vocab_mapping.pt                  {"d2t", "t2d"} of the draft vocabulary (`vocab_files`)

  Its trainer applies the target's LM head to `hidden_state` and shifts the logits and the
  tokens left by one (`padding(..., left=False)`), the loss mask not: at position t it pairs
  the feature of t, token t + 1, the target's logits of t + 1 and loss_mask[t]; it zeroes the
  last loss_mask entry. So loss_mask[i] weighs the prediction the target makes at position i + 1.

Which predictions count is specdec's (`train.tasks.hf_eagle3.label_mask`): the target's
prediction at position j counts when token j + 1 is an answer token, at or past the row's
`prompt_len` and before its `valid_len`. Each row is cut to T = valid_len positions (the padding
after an answer's stop token carries no label; rows without `valid_len` keep all seq_len).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specdec_models.errors import check
from specdec_models.files import check_writable_dir, staged_dir

from .embeddings_cache import cache_rows, check_cache, open_cache

FORMATS = ("speculators", "specforge")
SPECFORGE_VOCAB = "vocab_mapping.pt"


def answer_mask(n: int, prompt_len: int | None, valid_len: int | None, loss_mask: Tensor | None = None) -> Tensor:
    """(n,) bool: whether the target's prediction at position j (of token j + 1) is trained on,
    as specdec's eagle3 task decides (`train.data.hf_embeddings.label_mask`); `loss_mask` (n + 1,):
    a conversation row's per-token mask."""
    from .hf_embeddings import label_mask

    batch: dict[str, Tensor] = {"tokens": torch.zeros(1, n + 1, dtype=torch.long)}
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask[None]
    if prompt_len is not None:
        batch["prompt_len"] = torch.tensor([prompt_len])
    if valid_len is not None:
        batch["valid_len"] = torch.tensor([valid_len])
    mask = label_mask(batch, n)
    return torch.ones(n, dtype=torch.bool) if mask is None else mask[0]


def before_final_norm(post: Tensor, norm_weight: Tensor) -> Tensor:
    """A hidden state the target's final RMSNorm (gain `norm_weight` (H,)) maps onto `post` (..., H),
    its output: post / g (module docstring)."""
    return post / norm_weight.to(post)


def cache_layout(meta: dict[str, Any]) -> tuple[list[int], int]:
    """(the aux layers as `hidden_states` indices, in the cache's order; the cache's slot of each,
    then the slot of the last layer) of a cache made with `--layers A,B,C,L`, L its depth."""
    layers = [int(i) for i in meta["layers"]]
    depth = int(meta["depth"])
    check(depth in layers, f"the cache holds layers {layers}, not the last ({depth}): the peers' teacher is the "
                           f"target's last layer; rebuild it with --layers A,B,C,{depth}")
    aux = [i for i in layers if i != depth]
    check(len(aux) == 3, f"the cache holds aux layers {aux}: the peers' EAGLE-3 heads fuse exactly 3; rebuild it with "
                         f"--layers A,B,C,{depth}")
    return aux, [layers.index(i) for i in aux] + [layers.index(depth)]


def iter_rows(cache: str | os.PathLike, rows: int | None = None, batch: int = 32):
    """Per cache row (up to `rows`): {"tokens" (T,) int64, "embeds" (T, len(layers), H) float32
    in the cache's layer order, "mask" (T,) bool (`answer_mask`)}, T = valid_len (or seq_len)."""
    meta = check_cache(cache)
    data = open_cache(cache, meta)
    count = meta["windows"] if rows is None else min(rows, meta["windows"])
    n, k = meta["seq_len"], len(meta["layers"])
    for start in range(0, count, batch):
        b = cache_rows(data, np.arange(start, min(start + batch, count)), meta)
        for r in range(b["tokens"].shape[0]):
            prompt = int(b["prompt_len"][r]) if "prompt_len" in b else None
            valid = int(b["valid_len"][r]) if "valid_len" in b else None
            T = n if valid is None else max(2, min(valid, n))
            yield {"tokens": b["tokens"][r, :T], "embeds": b["embeds"][r, :T].float().view(T, k, -1),
                   "mask": answer_mask(n, prompt, valid, b["loss_mask"][r] if "loss_mask" in b else None)[:T]}


def _summary(kind: str, meta: dict[str, Any], aux: list[int], rows: int, tokens: int, answers: int) -> dict[str, Any]:
    return {"format": kind, "cache_layers": meta["layers"], "aux_layers": aux, "depth": meta["depth"], "rows": rows,
            "tokens": tokens, "answer_tokens": answers, "hidden_size": meta["dim"]}


def to_speculators(cache: str | os.PathLike, out: str | os.PathLike, norm_weight: Tensor, *, rows: int | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Write the cache's rows (the first `rows`) as speculators' offline data in `out` (module
    docstring): slot 3 holds post / g, `norm_weight` (H,) the target's final-norm gain g.
    Returns a summary (rows, tokens, answer tokens, layers), also written to `out`/specdec.json."""
    from datasets import Dataset
    from safetensors.torch import save_file

    meta = check_cache(cache)
    aux, slots = cache_layout(meta)
    g = norm_weight.detach().float().cpu()
    check(g.shape == (meta["dim"],), f"the final norm's gain has shape {tuple(g.shape)}, the cache's hidden size is "
                                     f"{meta['dim']}")
    check(bool((g != 0).all()), "the target's final norm has zero gains: the state before it cannot be recovered")
    out = Path(out)
    check_writable_dir(out.parent, "speculators data directory")
    columns: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    tokens = answers = 0
    with staged_dir(out) as tmp:
        (tmp / "hidden_states").mkdir()
        for i, row in enumerate(iter_rows(cache, rows)):
            states = row["embeds"][:, slots]                                     # (T, 4, H)
            states[:, 3] = before_final_norm(states[:, 3], g)
            ids = row["tokens"].long()
            save_file({"hidden_states": states.to(dtype).contiguous(), "token_ids": ids.contiguous()},
                      str(tmp / "hidden_states" / f"hs_{i}.safetensors"))
            columns["input_ids"].append(ids.tolist())
            columns["loss_mask"].append(row["mask"].long().tolist())
            columns["seq_len"].append(len(ids))
            tokens += len(ids)
            answers += int(row["mask"].sum())
        data = Dataset.from_dict(columns)
        data.set_format(type="torch")
        data.save_to_disk(str(tmp))
        summary = _summary("speculators", meta, aux, len(columns["seq_len"]), tokens, answers)
        (tmp / "specdec.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def to_specforge(cache: str | os.PathLike, out: str | os.PathLike, *, rows: int | None = None,
                 dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Write the cache's rows (the first `rows`) as SpecForge's offline EAGLE-3 `.ckpt` files in
    `out` (module docstring). SpecForge feeds each tensor to its consumer uncast: `aux_hidden_state`
    to the draft, so it is written in `dtype`, the draft's (its `model.torch_dtype`), and
    `hidden_state` to its `TargetHead`, which always runs in bf16, so it is written in bf16.
    Returns a summary, also written to `out`/specdec.json."""
    meta = check_cache(cache)
    aux, slots = cache_layout(meta)
    out = Path(out)
    check_writable_dir(out.parent, "SpecForge data directory")
    count = tokens = answers = 0
    with staged_dir(out) as tmp:
        for i, row in enumerate(iter_rows(cache, rows)):
            states = row["embeds"]
            T = states.shape[0]
            mask = torch.zeros(T, dtype=torch.long)
            mask[:-1] = row["mask"][1:].long()                 # loss_mask[i] weighs the prediction at i + 1
            torch.save({"input_ids": row["tokens"].long().contiguous(), "loss_mask": mask,
                        "hidden_state": states[:, slots[3]].to(torch.bfloat16)[None].contiguous(),
                        "aux_hidden_state": states[:, slots[:3]].reshape(T, -1).to(dtype)[None].contiguous()},
                       tmp / f"row_{i:06d}.ckpt")
            count, tokens, answers = count + 1, tokens + T, answers + int(mask.sum())
        summary = _summary("specforge", meta, aux, count, tokens, answers)
        (tmp / "specdec.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def vocab_files(draft_ids: Tensor, target_vocab_size: int, out: str | os.PathLike) -> dict[str, Path]:
    """Write the draft vocabulary `draft_ids` (sorted target ids) as each peer reads it:
    speculators' `d2t-{D}.npy` / `t2d-{D}.npy` (found in its data directory by name, or given as
    --d2t-path / --t2d-path) and SpecForge's `vocab_mapping.pt` ({"d2t", "t2d"}); d2t[i] holds
    target_id - i, t2d marks the draft ids (`specdec_models.heads.eagle3.vocab_maps`)."""
    from specdec_models.heads.eagle3 import vocab_maps

    d2t, t2d = vocab_maps(draft_ids, target_vocab_size)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    D = d2t.numel()
    files = {"d2t": out / f"d2t-{D}.npy", "t2d": out / f"t2d-{D}.npy", "specforge": out / SPECFORGE_VOCAB}
    np.save(files["d2t"], d2t.numpy())
    np.save(files["t2d"], t2d.numpy())
    torch.save({"d2t": d2t, "t2d": t2d}, files["specforge"])
    return files


__all__ = ["FORMATS", "answer_mask", "before_final_norm", "cache_layout", "iter_rows", "to_specforge", "to_speculators",
           "vocab_files"]
