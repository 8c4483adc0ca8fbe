"""task=hf_prophet: a prophet head trained against a frozen Hugging Face target.

`specdec train experiment=hf_prophet target.path=DIR|FILE.gguf data.files=[...]` (hidden states
online) or `... data=hf_embeddings data.cache=DIR` (from a cache). The head is
`specdec_models.heads.hf_prophet.HFProphet`: the prophet's window layout and loss (`ProphetHead`,
lucidrains' prophet idea) reading the target's last-layer hidden states after its final norm, and
sharing (frozen) the target's token embedding and output head, as EAGLE does (Li et al. 2024), so
its own weights are a few transformer blocks even for a 49k-token vocabulary.

The hidden states come online (the target runs under no_grad at every step, `data=hf_text`) or
from a cache (`data=hf_embeddings`, written by `specdec cache`; best from prompts
the target continues itself, `train.data.regenerate`, so the head learns the target's own
distribution). `task.distill` (fkl, rkl, jsd or tvd; DistillSpec, Zhou et al. 2023) trains toward
the target's full next-token distribution instead of (distill_weight 1) or besides the data's
tokens: window output i is compared with the target's logits at anchor + i, its head applied to
the hidden state there (exact online; from a cache, at the cache's precision).

The target is loaded from a local model directory or a GGUF file (`specdec_models.hf.weights`),
frozen and held outside the module (`FrozenModel`): absent from the state_dict, checkpoints and
the export. `validate` loads it once (`train.tasks.hf_target.load_target`, shared with the module)
to hash its weights: a cache or a checkpoint of another target is refused in one line before any
work, and a checkpoint reloads the target and checks the hash. Every validation logs the window loss, the
teacher-forced accuracy per drafted position and the simulated tokens per call
(`ProphetTaskModule.track_drafted`); the evaluation callback decodes with the target and the head at
temperatures 0 and 1. The export is the head alone with its target's identity (kind hf_prophet:
`load_export(DIR, target=model)`, the decode CLI's `--prophet DIR`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from specdec_models.config import from_dict
from specdec_models.errors import check, check_positive_int
from specdec_models.heads.hf_prophet import HFProphet, HFProphetConfig
from specdec_models.hf import HFDecoder, logits_width, text_config

from ..data.embeddings_cache import HOW_TO_BUILD, check_cache
from ..data.hf_embeddings import HFEmbeddingsDataModule
from ..data.hf_text import HFTextDataModule
from ..data.settings import read_settings
from .base import FrozenModel, Task, required, to_plain
from .hf_target import HFTargetHead, check_head_kind, check_target
from .prophet_common import ProphetTaskModule
from .prophet_frozen import FrozenProphetOptions


@dataclass(frozen=True)
class HeadSizes:
    """The `head:` node: its kind and `HFProphetConfig.for_target`'s sizes (dim null: the target's width)."""

    kind: str = "prophet"
    dim: int | None = None
    depth: int = 1
    heads: int | None = None
    dim_head: int = 64
    ff_mult: int = 4
    prophet_train_length: int = 6
    num_leading_start_tokens: int = 2
    windows_per_seq: int | None = None

    def __post_init__(self) -> None:
        check_head_kind(self.kind, "prophet")
        for name in ("depth", "dim_head", "ff_mult", "prophet_train_length", "num_leading_start_tokens"):
            check_positive_int(getattr(self, name), f"head.{name}")
        for name in ("dim", "heads", "windows_per_seq"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), f"head.{name}")


def validate(cfg: DictConfig, options: FrozenProphetOptions) -> dict[str, Any]:
    """Check the target, the head's sizes, the data's tokenizer or cache, and gamma; loads the
    target (once, see `hf_target.load_target`) to identify its weights."""
    sizes = from_dict(HeadSizes, to_plain(cfg.get("head")), "head")
    check(sizes.prophet_train_length >= cfg.gamma + 1,
          f"head.prophet_train_length ({sizes.prophet_train_length}) must be >= gamma + 1 = {cfg.gamma + 1}: the head "
          f"drafts gamma tokens after the one the target emits")
    target, path, tokenizer, model, sha, cached = check_target(cfg)
    vocab = min(len(tokenizer), logits_width(model))
    head = HFProphetConfig.for_target(model, dim=sizes.dim, depth=sizes.depth, heads=sizes.heads,
                                      dim_head=sizes.dim_head, ff_mult=sizes.ff_mult,
                                      prophet_train_length=sizes.prophet_train_length,
                                      num_leading_start_tokens=sizes.num_leading_start_tokens,
                                      windows_per_seq=sizes.windows_per_seq, vocab_size=vocab)
    seq_len = cfg.data.seq_len
    limit = HFDecoder(model).cfg.max_seq_len
    check(seq_len <= limit, f"data.seq_len ({seq_len}) exceeds the target's {limit} positions")
    check(seq_len >= head.prophet.window_len, f"data.seq_len ({seq_len}) must hold one window of "
                                              f"num_leading_start_tokens + prophet_train_length - 1 = "
                                              f"{head.prophet.window_len} positions")
    cache_layers = None
    if cached:
        depth = int(text_config(model.config).num_hidden_layers)
        cache = required(cfg, "data.cache", f"CACHE_DIR ({HOW_TO_BUILD})")
        meta = check_cache(cache, weights_sha256=sha, seq_len=seq_len, dim=head.target_dim, layers=[depth],
                           model="target.path")
        cache_layers = [int(i) for i in meta["layers"]]          # the head reads the last one of them
    if options.distill is not None:
        check(getattr(text_config(model.config), "final_logit_softcapping", None) is None,
              f"task.distill: {type(model).__name__} soft-caps its logits after the head, which the head of the "
              f"hidden states does not reproduce: train without task.distill")
    metadata = {"target": str(path.resolve()), "target_weights_sha256": sha,
                "embeddings": "cached" if cached else "online", "distill": options.distill}
    return dict(target_path=str(path.resolve()), weights_sha256=sha, target_dtype=target.dtype, head=head.to_dict(),
                distill=options.distill, distill_weight=float(options.distill_weight), metadata=metadata,
                cache_layers=cache_layers, target_shard=target.shard)


@dataclass(frozen=True)
class HFProphetSettings:
    """What `validate` gives HFProphetModule, the hyper-parameters its checkpoints record.
    `target_path`, `weights_sha256`: the target's source and the hash its weights must have
    (loaded by the module: the head is built on its embedding and head); `head`: an
    HFProphetConfig dict; the head trains in float32 whatever the target's `target_dtype`;
    `distill`, `distill_weight`: `FrozenProphetOptions`'; `cache_layers`: the layers a cache's
    "embeds" concatenate (the head reads the last one, the target's depth; a cache made for an
    eagle3 head serves a prophet head too); `target_shard`: split the target across the
    processes at fit start (target.shard)."""

    target_path: str
    weights_sha256: str
    head: dict[str, Any]
    target_dtype: str = "float32"
    distill: str | None = None
    distill_weight: float = 1.0
    cache_layers: list[int] | None = None
    target_shard: bool = False


class HFProphetModule(HFTargetHead, ProphetTaskModule):
    task = "hf_prophet"

    def __init__(self, optim: dict[str, Any] | None = None, seed: int = 0, metadata: dict[str, Any] | None = None,
                 compile: bool = False, **settings: Any) -> None:
        """`settings`: the fields of `HFProphetSettings` (plain values: a checkpoint rebuilds the
        module without Hydra)."""
        super().__init__(optim, seed, metadata, compile)
        s = read_settings(HFProphetSettings, type(self), settings)
        self.save_settings(s, optim, seed, metadata, compile)
        head, cache_layers, target_shard = s.head, s.cache_layers, s.target_shard
        self._target = self._frozen_target(target_shard)
        self._parts = FrozenModel(self._load_parts) if cache_layers else self._target     # online: the whole one
        self.head = HFProphet(HFProphetConfig.from_dict(head), self._parts.get(torch.device("cpu"))).float()
        if compile:
            for block in self.head.prophet.layers:
                block.compile()

    def trainable(self) -> nn.Module:
        return self.head

    def head_on(self, target: Any) -> nn.Module:
        copy = HFProphet(self.head.config, target).to(self.head.to_prophet_start.weight)
        copy.load_state_dict(self.head.state_dict())
        return copy.train(self.head.training)

    # -- steps -----------------------------------------------------------------------------------

    def _inputs(self, batch: torch.Tensor | dict[str, torch.Tensor],
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tokens (b, n + 1), the target's hidden states (b, n, dim), each row's real tokens (b,)
        or None): cached, or computed now."""
        _ = self.parts                                                     # on the module's device
        if isinstance(batch, dict):
            layers = self.hparams.cache_layers
            valid = batch.get("valid_len")
            if not layers or len(layers) == 1:
                return batch["tokens"], batch["embeds"], valid
            parts = batch["embeds"].unflatten(-1, (len(layers), -1))
            return batch["tokens"], parts[..., layers.index(max(layers)), :], valid
        return batch, self.head.target_hidden(batch[:, :-1], logits=False)[0], None

    def _losses(self, seq: torch.Tensor, hidden: torch.Tensor, micro: int | None, prefix: str | None = None,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, {"prophet_loss": next-token loss, "distill_loss": divergence if task.distill});
        with a `prefix` the windows' drafted accuracy is tracked too; windows inside each row's
        `valid` tokens are drawn first (the padding after a regenerated answer holds no states)."""
        head = self.head

        def teacher(anchors: torch.Tensor) -> torch.Tensor:
            rows = torch.arange(seq.shape[0], device=seq.device)[:, None, None]
            return head.target_logits(hidden[rows, head.teacher_positions(anchors)]).flatten(0, 1)  # (b W, L, vocab)

        return self.prophet_objective(head, seq, hidden, micro, teacher, prefix, valid)

    def training_step(self, batch: torch.Tensor | dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        seq, hidden, valid = self._inputs(batch)
        loss, parts = self._losses(seq, hidden, self.micro_batch(batch_idx), valid=valid)
        self.log_train(loss, parts)
        return loss

    def evaluate(self, batch: torch.Tensor | dict[str, torch.Tensor], prefix: str) -> None:
        seq, hidden, valid = self._inputs(batch)
        _, parts = self._losses(seq, hidden, None, prefix, valid)
        b = seq.shape[0]
        self.log(f"{prefix}/prophet_loss", parts.pop("prophet_loss"), prog_bar=True, sync_dist=True, batch_size=b)
        self.log_dict({f"{prefix}/{k}": v for k, v in parts.items()}, sync_dist=True, batch_size=b)

    # -- decoding and export ---------------------------------------------------------------------

    def export_metadata(self) -> dict[str, Any]:
        return {"target_path": self.hparams.target_path, "target_weights_sha256": self.hparams.weights_sha256,
                "distill": self.hparams.distill}


TASK = Task(name="hf_prophet", config=FrozenProphetOptions, module=HFProphetModule,
            data=(HFTextDataModule, HFEmbeddingsDataModule), validate=validate, can_shard_target=True)
