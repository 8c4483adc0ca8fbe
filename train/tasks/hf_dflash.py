"""task=hf_dflash: a DFlash head trained against a frozen Hugging Face target.

`python -m train experiment=smollm2_dflash data.cache=DIR head.draft_vocab=COUNTS.json` (from the
cache task=hf_eagle3 reads, `data=hf_embeddings`: the head taps the same layers, EAGLE-3's
[2, L//2, L-3] by default), or online (`data=hf_text`, `data=hf_chat`). The head is
`specdec_models.heads.dflash.DFlashHead`: a fc over the tapped layers, `head.num_layers` decoder
layers at the target's shapes that fill a block of `head.block_size` slots in one pass
(bidirectional within the block), an LM head over a draft vocabulary; it shares (frozen) the
target's token embedding.

The paper's recipe (`DFlashHead.block_loss`): each step draws up to `task.anchors` random anchors
per row among the answer tokens, runs every block of the batch in one pass (each block sees its
row's context before its anchor and its own slots only), and takes the forward KL from the
target's distribution renormalised over the draft vocabulary at each drafted slot, weighted
exp(-(i - 1) / `task.decay`) at slot i (null: the paper's decay for the block size). A block never
crosses a row's end, an answer's end or a turn's: a slot counts only while every label from its
anchor to it is an answer token (`heads.dflash.anchor_weights`). The anchors come from a
generator seeded by (seed, step, micro-batch, rank), so a resumed run draws the same ones;
validation draws the same anchors at every validation.

`train/loss` and `val/loss` are the weighted mean KL; validation logs per slot i the KL and the
accuracy of the draft's argmax against the target's greedy token (a greedy token outside the draft
vocabulary a miss: `val/block_accuracy/pos{i}`) and the tokens per call a greedy chain of the
whole block would give (`val/simulated_tokens_per_call`: 1 + the mean run of right slots from the
anchor). The draft vocabulary is chosen as task=hf_eagle3 chooses it (token counts,
`head.draft_vocab`). `head.init_layers`: that many draft layers start as the target's last layers.
The export is the head with its target's identity (kind hf_dflash).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from specdec_models.config import from_dict
from specdec_models.errors import check, check_positive_int
from specdec_models.heads.dflash import DFlashConfig, DFlashHead, paper_decay
from specdec_models.heads.eagle3 import choose_draft_vocab
from specdec_models.hf import HFDecoder, logits_width

from ..data.chat_rows import HFChatDataModule
from ..data.hf_embeddings import HFEmbeddingsDataModule, label_mask
from ..data.hf_text import HFTextDataModule
from ..data.settings import read_settings
from .base import FrozenModel, Task, TaskModule, to_plain
from .hf_eagle3 import cached_layers, check_cache_layers, read_token_counts
from .hf_target import HFTargetHead, check_head_kind, check_target


@dataclass(frozen=True)
class DFlashOptions:
    """The `task:` node of task=hf_dflash."""

    anchors: int = 16                 # blocks drawn per row and step (fewer where a row has fewer valid anchors)
    decay: float | None = None        # slot i weighs exp(-(i - 1) / decay); null: the paper's for the block size

    def __post_init__(self) -> None:
        check_positive_int(self.anchors, "task.anchors")
        check(self.decay is None or (isinstance(self.decay, (int, float)) and not isinstance(self.decay, bool)
                                     and 0 < self.decay < float("inf")),
              f"task.decay must be a number > 0 or null, got {self.decay!r}")


@dataclass(frozen=True)
class DFlashSizes:
    """The `head:` node: its kind, taps (null: EAGLE-3's [2, L//2, L-3]), block size, mask token
    (null: the last id of the vocabulary), draft layers and how many start from the target's, the
    draft vocabulary and its source."""

    kind: str = "dflash"
    aux_layers: list[int] | None = None
    block_size: int = 8
    mask_token_id: int | None = None
    num_layers: int = 1
    init_layers: int = 0
    draft_vocab_size: int | None = 8192
    draft_vocab: str | None = None
    train_lm_head: bool = True

    def __post_init__(self) -> None:
        check_head_kind(self.kind, "dflash")
        if self.draft_vocab_size is not None:
            check_positive_int(self.draft_vocab_size, "head.draft_vocab_size")
        check(self.aux_layers is None or (isinstance(self.aux_layers, (list, tuple)) and len(self.aux_layers) >= 1
                                          and all(isinstance(i, int) and not isinstance(i, bool)
                                                  for i in self.aux_layers)),
              f"head.aux_layers must be a list of layer indices or null, got {self.aux_layers!r}")
        check(isinstance(self.train_lm_head, bool),
              f"head.train_lm_head must be true or false, got {self.train_lm_head!r}")


def validate(cfg: DictConfig, options: DFlashOptions) -> dict[str, Any]:
    """Check the target, the head, the draft vocabulary and the data before any work."""
    sizes = from_dict(DFlashSizes, to_plain(cfg.get("head")), "head")
    target, path, tokenizer, model, sha, cached = check_target(cfg, [])
    vocab = min(len(tokenizer), logits_width(model))
    draft_size = vocab if sizes.draft_vocab_size is None else sizes.draft_vocab_size
    check(draft_size <= vocab, f"head.draft_vocab_size ({draft_size}) exceeds the target's vocabulary ({vocab})")
    seq_len = cfg.data.seq_len
    check(isinstance(sizes.block_size, int) and 2 <= sizes.block_size <= seq_len,
          f"head.block_size must be an integer in [2, data.seq_len = {seq_len}] (a block must fit a row), "
          f"got {sizes.block_size!r}")
    head = DFlashConfig.for_target(model, block_size=sizes.block_size, mask_token_id=sizes.mask_token_id,
                                   aux_layers=sizes.aux_layers, draft_vocab_size=draft_size,
                                   num_layers=sizes.num_layers, init_layers=sizes.init_layers, vocab_size=vocab)
    draft_ids = None
    if draft_size < vocab:
        check(sizes.draft_vocab is not None, f"head.draft_vocab is not set: a draft vocabulary of {draft_size} < "
                                             f"{vocab} tokens is chosen from token counts (scripts/draft_vocab.py)")
        draft_ids = choose_draft_vocab(read_token_counts(sizes.draft_vocab, tokenizer, vocab), draft_size).tolist()
    limit = HFDecoder(model).cfg.max_seq_len
    check(seq_len <= limit, f"data.seq_len ({seq_len}) exceeds the target's {limit} positions")
    cache_layers = check_cache_layers(cfg, head, sha, seq_len) if cached else None
    metadata = {"target": str(path.resolve()), "target_weights_sha256": sha,
                "embeddings": "cached" if cached else "online", "draft_vocab_size": draft_size,
                "aux_layers": head.aux_layers, "block_size": head.block_size}
    return dict(target_path=str(path.resolve()), weights_sha256=sha, target_dtype=target.dtype, head=head.to_dict(),
                draft_ids=draft_ids, train_lm_head=sizes.train_lm_head, anchors=options.anchors,
                decay=float(paper_decay(head.block_size) if options.decay is None else options.decay),
                cache_layers=cache_layers, target_shard=target.shard, metadata=metadata)


@dataclass(frozen=True)
class HFDFlashSettings:
    """What `validate` gives HFDFlashModule, the hyper-parameters its checkpoints record: the
    target's source and weights' hash, the head (a DFlashConfig dict) and its draft vocabulary
    (None: the whole vocabulary), `anchors` and `decay` (`DFlashOptions`, decay resolved),
    `cache_layers` (None: hidden states online) and `target_shard`."""

    target_path: str
    weights_sha256: str
    head: dict[str, Any]
    target_dtype: str = "float32"
    draft_ids: list[int] | None = None
    train_lm_head: bool = True
    anchors: int = 16
    decay: float = 4.0
    cache_layers: list[int] | None = None
    target_shard: bool = False


class HFDFlashModule(HFTargetHead, TaskModule):
    task = "hf_dflash"

    def __init__(self, optim: dict[str, Any] | None = None, seed: int = 0, metadata: dict[str, Any] | None = None,
                 compile: bool = False, **settings: Any) -> None:
        """`settings`: the fields of `HFDFlashSettings` (plain values: a checkpoint rebuilds the
        module without Hydra); the target is loaded here, the head built on it."""
        super().__init__(optim, seed, metadata, compile)
        s = read_settings(HFDFlashSettings, type(self), settings)
        self.save_settings(s, optim, seed, metadata, compile)
        self._target = self._frozen_target(s.target_shard)
        self._parts = FrozenModel(self._load_parts) if s.cache_layers else self._target
        ids = None if s.draft_ids is None else torch.tensor(s.draft_ids, dtype=torch.long)
        self.head = DFlashHead(DFlashConfig.from_dict(s.head), self._parts.get(torch.device("cpu")), ids).float()
        self.head.lm_head.weight.requires_grad_(s.train_lm_head)
        if compile:
            self.head.layers.compile()
        self._tracked: dict[str, torch.Tensor] = {}

    def trainable(self) -> nn.Module:
        return self.head

    def head_on(self, target: Any) -> nn.Module:
        copy = DFlashHead(self.head.config, target, self.head.draft_ids.cpu(), init_from_target=False)
        copy.to(self.head.fc.weight).load_state_dict(self.head.state_dict())
        return copy.train(self.head.training)

    def head_layers(self) -> list[int]:
        """The target's last `init_layers` layers, which the head's first layers start from."""
        c = DFlashConfig.from_dict(self.hparams.head)
        return list(range(c.target_layers - c.init_layers, c.target_layers))

    # -- steps -----------------------------------------------------------------------------------

    def _inputs(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(tokens (b, n + 1), taps (b, n, A*H), last (b, n, H), label mask (b, n) or None)."""
        layers, last_layer = self.head.aux_layers, self.head.config.target_layers
        if isinstance(batch, dict) and "embeds" in batch:
            aux, last = cached_layers(batch["embeds"], self.hparams.cache_layers or [last_layer], layers, last_layer)
            return batch["tokens"], aux, last, label_mask(batch, batch["embeds"].shape[1])
        tokens = batch["tokens"] if isinstance(batch, dict) else batch     # online: data=hf_text or data=hf_chat
        with torch.no_grad():
            out = self.target(input_ids=tokens[:, :-1], output_hidden_states=True, use_cache=False, logits_to_keep=1)
        mask = label_mask(batch, tokens.shape[1] - 1) if isinstance(batch, dict) else None
        return tokens, torch.cat([out.hidden_states[i] for i in layers], -1), out.hidden_states[last_layer], mask

    def _loss(self, batch, generator: torch.Generator, greedy: bool = False):
        """(`DFlashHead.block_loss` on the batch with anchors drawn by `generator`, rows)."""
        _ = self.parts                                                # on the module's device
        tokens, aux, last, mask = self._inputs(batch)
        ok = self.head.greedy_in_vocab(last) if greedy else None
        return self.head.block_loss(tokens, aux, last, mask, anchors=self.hparams.anchors, decay=self.hparams.decay,
                                    generator=generator, greedy_in_vocab=ok), tokens.shape[0]

    def training_step(self, batch: torch.Tensor | dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out, _ = self._loss(batch, self.generator(self.micro_batch(batch_idx)))
        acc = out.slot_correct / out.slot_count.clamp(min=1)
        self.log_train(out.loss.detach(), {"kl/pos1": out.slot_kl[0], "accuracy/pos1": acc[0],
                                           f"accuracy/pos{len(acc)}": acc[-1]})
        return out.loss

    def evaluate(self, batch: torch.Tensor | dict[str, torch.Tensor], prefix: str) -> None:
        """`{prefix}/loss`, and per-slot sums tracked over the epoch (`_log_tracked`); the same
        anchors at every validation (a generator seeded by the seed alone)."""
        g = torch.Generator(device=self.device).manual_seed(self.seed)
        out, b = self._loss(batch, g, greedy=True)
        self.log(f"{prefix}/loss", out.loss, prog_bar=True, sync_dist=True, batch_size=b)
        sums = torch.cat([out.slot_kl * out.slot_count, out.slot_correct, out.slot_count,
                          torch.stack([out.accepted, out.blocks])]).double()           # (3 g + 2,)
        self._tracked[prefix] = self._tracked.get(prefix, 0) + sums

    def _log_tracked(self, prefix: str) -> None:
        """Per-slot KL and accuracy, and the simulated tokens per call, over the epoch's rows, all ranks'."""
        if prefix not in self._tracked:
            return
        sums = self._tracked.pop(prefix)
        sums = self.trainer.strategy.reduce(sums.to(self.device), reduce_op="sum") if self._trainer else sums
        g = (sums.numel() - 2) // 3
        kl_sum, correct, count = sums[:3 * g].cpu().view(3, g)
        accepted, blocks = sums[3 * g:].cpu()
        for i in range(g):
            self.log(f"{prefix}/block_kl/pos{i + 1}", float(kl_sum[i] / count[i].clamp(min=1)))
            self.log(f"{prefix}/block_accuracy/pos{i + 1}", float(correct[i] / count[i].clamp(min=1)))
        self.log(f"{prefix}/simulated_tokens_per_call", float(1 + accepted / blocks.clamp(min=1)))

    def start_epoch(self, prefix: str) -> None:
        self._tracked.pop(prefix, None)

    def end_epoch(self, prefix: str) -> None:
        self._log_tracked(prefix)

    def export_metadata(self) -> dict[str, Any]:
        return {"target_path": self.hparams.target_path, "target_weights_sha256": self.hparams.weights_sha256,
                "anchors": self.hparams.anchors, "decay": self.hparams.decay,
                "train_lm_head": self.hparams.train_lm_head}


TASK = Task(name="hf_dflash", config=DFlashOptions, module=HFDFlashModule,
            data=(HFTextDataModule, HFChatDataModule, HFEmbeddingsDataModule), validate=validate,
            can_shard_target=True)

__all__ = ["DFlashOptions", "DFlashSizes", "HFDFlashModule", "HFDFlashSettings", "TASK", "validate"]
