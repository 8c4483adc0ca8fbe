"""task=prophet_frozen: train a prophet on a frozen main model read from an export.

`specdec train experiment=enwik8_prophet_frozen main.export=DIR`. The main model (an export of
kind decoder, or the `.model` of a model_with_prophet export) gets no gradient and stays in eval
mode; only the prophet and its start projection train (a linear projection when the widths
differ, see `specdec_models.ModelWithProphet`), on the prophet's loss alone. The prophet idea is
lucidrains/speculative-decoding's; drafts are verified as in Leviathan et al. 2023.

The main model's embeddings come either online (computed under no_grad at every step, with
`data=enwik8`) or from an embeddings cache written once by `specdec cache`
(`data=enwik8_embeddings data.cache=DIR`, see `train.data.embeddings_cache`). Validation always
computes them online on the fixed enwik8 windows, so its numbers compare between runs and modes;
val/main_loss and val/bpc are the frozen main model's.

`task.distill` (fkl, rkl, jsd or tvd; DistillSpec, Zhou et al. 2023, see
`specdec_models.losses`) trains the prophet toward the main model's next-token distribution
instead of (distill_weight 1) or besides (weight in (0, 1)) the data's next tokens: prophet
window position i is compared with the main model's position anchor + i, which predicts the same
token. The teacher is the main model's full distribution online, its top-K renormalised from a
cache written with --top-k-logits K; validation compares with the full distribution.

The module keeps plain values only (the main config, read from the export's config.json, the
export's path and weights hash); `setup()` loads the main weights from the export and refuses an
export whose weights changed since the run was configured. Checkpoints hold the main weights too,
so `train.checkpoints` rebuilds the module without the export; the export is a
model_with_prophet: the frozen main model with its new prophet.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from specdec_models import ModelConfig, ModelWithProphet, ProphetConfig
from specdec_models.errors import SpecdecError, check
from specdec_models.export import export_hash, load_export, read_main_config
from specdec_models.losses import DIVERGENCES, next_token_loss

from ..data.embeddings import EmbeddingsDataModule
from ..data.embeddings_cache import HOW_TO_BUILD, check_cache
from ..data.enwik8 import Enwik8DataModule
from .base import LN2, Task, data_class, required, to_plain
from .prophet import ProphetNetModule, check_prophet_fits

DISTILL = tuple(d for d in DIVERGENCES if d != "ce")     # ce is the undistilled loss: task.distill=null
HOW_TO_EXPORT = "DIR, an export of the main model to freeze (specdec train or specdec export)"


@dataclass(frozen=True)
class FrozenProphetOptions:
    """The `task:` node of task=prophet_frozen."""

    distill: str | None = None        # null: the data's next tokens | fkl, rkl, jsd, tvd: the main model's
    distill_weight: float = 1.0       # loss = (1 - w) x next-token loss + w x divergence

    def __post_init__(self) -> None:
        check(self.distill is None or self.distill in DISTILL,
              f"task.distill must be null or one of {', '.join(DISTILL)}, got {self.distill!r}")
        w = self.distill_weight
        check(isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w <= 1,
              f"task.distill_weight must be in (0, 1], got {w!r}")


def main_export(cfg: DictConfig) -> tuple[Path, ModelConfig, dict[str, Any]]:
    """The export named by main.export, its main model's config and its checked config.json."""
    export = Path(str(required(cfg, "main.export", HOW_TO_EXPORT))).expanduser()
    try:
        main, config = read_main_config(export)
    except SpecdecError as error:
        raise SpecdecError(f"main.export: {error}") from None
    return export, main, config


def validate(cfg: DictConfig, options: FrozenProphetOptions) -> dict[str, Any]:
    """Check main.export, the prophet and their fit with the data (reads the export's config.json
    and the cache's cache.json, no weights)."""
    export, main, config = main_export(cfg)
    prophet = ProphetConfig.from_dict(to_plain(cfg.model.prophet))
    check(config["tokenizer"]["kind"] == "bytes",
          f"main.export {export} has a {config['tokenizer']['kind']} tokenizer; byte-level data needs the bytes "
          f"tokenizer with vocab_size 256")
    check_prophet_fits(cfg, main, prophet, f"the max_seq_len of main.export {export}")
    check(prophet.model.vocab_size == main.vocab_size,
          f"model.prophet.model.vocab_size ({prophet.model.vocab_size}) differs from the main model's "
          f"({main.vocab_size}) in main.export {export}")
    sha = config["weights_sha256"]
    cached = issubclass(data_class(cfg), EmbeddingsDataModule)             # data=enwik8_embeddings
    if cached:
        meta = check_cache(required(cfg, "data.cache", f"CACHE_DIR ({HOW_TO_BUILD})"), weights_sha256=sha,
                           seq_len=cfg.data.seq_len, dim=main.dim, model="main.export")
        check(options.distill is None or meta["top_k_logits"] > 0,
              f"task.distill={options.distill} with data=enwik8_embeddings needs a cache with top-k logits: rebuild "
              f"{cfg.data.cache} with specdec cache --top-k-logits K")
    metadata = {"main_export": str(export.resolve()), "main_weights_sha256": sha,
                "embeddings": "cached" if cached else "online", "distill": options.distill}
    return dict(main=main.to_dict(), prophet=prophet.to_dict(), export=str(export.resolve()), weights_sha256=sha,
                distill=options.distill, distill_weight=float(options.distill_weight), metadata=metadata)


class FrozenProphetModule(ProphetNetModule):
    task = "prophet_frozen"

    def __init__(self, main: dict[str, Any], prophet: dict[str, Any], export: str, weights_sha256: str,
                 distill: str | None = None, distill_weight: float = 1.0, optim: dict[str, Any] | None = None,
                 seed: int = 0, metadata: dict[str, Any] | None = None, compile: bool = False) -> None:
        """`main`: the ModelConfig dict of the export's main model; `prophet`: a ProphetConfig
        dict; `export`, `weights_sha256`: where `setup()` loads the main weights from and the
        weights hash they must have; `distill`: null or a divergence toward the main model's
        distribution, weighted `distill_weight` against the data's next-token loss; `compile`:
        torch.compile the prophet's blocks (state dicts unchanged). Training batches are token
        windows (online embeddings) or dicts of tokens and cached embeddings."""
        super().__init__(main, prophet, optim, seed, metadata, compile)
        self.save_hyperparameters()
        self.net.model.requires_grad_(False)
        self.net.model.eval()
        if compile:
            for block in self.net.prophet.layers:
                block.compile()

    def trainable(self) -> nn.Module:
        return self.net            # the main model's parameters have requires_grad False

    # -- the frozen main model -------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        self.load_main()

    def load_main(self) -> None:
        """Copy the main weights from the export, after checking it is the one configured."""
        path = Path(self.hparams.export)
        try:
            sha = export_hash(path)
        except SpecdecError as error:
            raise SpecdecError(f"main.export: {error}") from None
        check(sha == self.hparams.weights_sha256,
              f"main.export {path} now holds another model (weights sha256 {sha[:16]}...) than the one this run was "
              f"configured with ({self.hparams.weights_sha256[:16]}...): restore that export or start a new run")
        loaded = load_export(path)            # re-hashes the weights file against config.json
        main = loaded.model if isinstance(loaded, ModelWithProphet) else loaded
        check(main.cfg == self.net.main_cfg, f"main.export {path}: its main model config differs from this run's")
        self.net.model.load_state_dict(main.state_dict())
        self.net.model.requires_grad_(False)
        self.net.model.eval()

    def train(self, mode: bool = True) -> FrozenProphetModule:
        """Lightning switches the module to train mode at each fit and after each validation:
        the main model stays in eval mode."""
        super().train(mode)
        self.net.model.eval()
        return self

    def main_embeddings(self, seq: torch.Tensor) -> torch.Tensor:
        """The frozen main model's last-layer embeddings (b, n, dim) of seq[:, :-1], no gradient."""
        with torch.no_grad():
            return self.net.model.hidden(seq[:, :-1])

    def _inputs(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (b, n + 1), embeddings (b, n, dim)) from a window batch or a cached batch."""
        if isinstance(batch, dict):
            # cached bfloat16/float16 embeddings: into the prophet's dtype (autocast still applies)
            return batch["tokens"], batch["embeds"].to(self.net.prophet.token_emb.weight.dtype)
        return batch, self.main_embeddings(batch)

    def _teacher_logits(self, anchors: torch.Tensor, main_logits: torch.Tensor | None,
                        batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        """The main model's logits (b W, L, vocab) at the positions anchor + i that predict what
        prophet window position i does: from `main_logits` (b, n, vocab), or from the cached top-K
        (others -inf, so the softmax renormalises over the top K)."""
        positions = self.net.teacher_positions(anchors)                                   # (b, W, L)
        rows = torch.arange(anchors.shape[0], device=anchors.device)[:, None, None]
        if main_logits is None:
            values = batch["topk_values"][rows, positions].float()                        # (b, W, L, K)
            indices = batch["topk_indices"][rows, positions]
            dense = values.new_full((*values.shape[:-1], self.net.main_cfg.vocab_size), float("-inf"))
            teacher = dense.scatter_(-1, indices, values)
        else:
            teacher = main_logits[rows, positions]                                        # (b, W, L, vocab)
        return teacher.flatten(0, 1)

    def _losses(self, seq: torch.Tensor, embeds: torch.Tensor, micro: int | None, main_logits: torch.Tensor | None,
                batch: torch.Tensor | dict[str, torch.Tensor], prefix: str | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, {"prophet_loss": next-token loss, "distill_loss": divergence if task.distill});
        with a `prefix` ("val", "test") the windows' drafted accuracy is tracked too."""
        return self.prophet_objective(self.net, seq, embeds, micro,
                                      lambda anchors: self._teacher_logits(anchors, main_logits, batch), prefix)

    # -- steps -----------------------------------------------------------------------------------

    def training_step(self, batch: torch.Tensor | dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        micro = self.micro_batch(batch_idx)
        seq, embeds = self._inputs(batch)
        main_logits = None
        if self.hparams.distill is not None and not isinstance(batch, dict):
            with torch.no_grad():
                main_logits = self.net.model.logits(embeds)                             # (b, n, vocab)
        loss, parts = self._losses(seq, embeds, micro, main_logits, batch)
        self.log_train(loss, parts)
        return loss

    def evaluate(self, batch: torch.Tensor | dict[str, torch.Tensor], prefix: str) -> None:
        seq = batch["tokens"] if isinstance(batch, dict) else batch
        embeds = self.main_embeddings(seq)                   # online, so runs and modes compare
        with torch.no_grad():
            main_logits = self.net.model.logits(embeds)
            main_loss = next_token_loss(main_logits, seq[:, 1:])
        _, parts = self._losses(seq, embeds, None, main_logits, batch, prefix)
        b = seq.shape[0]
        self.log(f"{prefix}/prophet_loss", parts.pop("prophet_loss"), prog_bar=True, sync_dist=True, batch_size=b)
        self.log_dict({f"{prefix}/{k}": v for k, v in parts.items()}, sync_dist=True, batch_size=b)
        self.log(f"{prefix}/main_loss", main_loss, sync_dist=True, batch_size=b)
        self.log(f"{prefix}/bpc", main_loss / LN2, sync_dist=True, batch_size=b)    # the frozen main's bits per byte


TASK = Task(name="prophet_frozen", config=FrozenProphetOptions, module=FrozenProphetModule,
            data=(Enwik8DataModule, EmbeddingsDataModule), validate=validate)
