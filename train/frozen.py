"""task=prophet_frozen: train a prophet on a frozen main model read from an export.

`python -m train experiment=enwik8_prophet_frozen main.export=DIR`. The main model (an export of
kind decoder, or the `.model` of a model_with_prophet export) gets no gradient and stays in eval
mode; only the prophet and its start projection train (a linear projection when the widths
differ, see `specdec_models.ModelWithProphet`), on the prophet's loss alone. The prophet idea is
lucidrains/speculative-decoding's; drafts are verified as in Leviathan et al. 2023.

The main model's embeddings come either `online` (computed under no_grad at every step) or
`cached`, read from a cache written once by `scripts/cache_embeddings.py` (see
`train.cached_data`). Validation always computes them online on the fixed enwik8 windows, so its
numbers compare between runs and modes; val/main_loss and val/bpc are the frozen main model's.

`main.distill` (fkl, rkl, jsd or tvd; DistillSpec, Zhou et al. 2023, see
`specdec_models.distill`) trains the prophet toward the main model's next-token distribution
instead of (distill_weight 1) or besides (weight in (0, 1)) the data's next tokens: prophet
window position i is compared with the main model's position anchor + i, which predicts the same
token. The teacher is the main model's full distribution online, its top-K renormalised from a
cache written with --top-k-logits K; validation compares with the full distribution.

The module keeps plain values only (the main config, read from the export's config.json, the
export's path and weights hash); `setup()` loads the main weights from the export and refuses an
export whose weights changed since the run was configured. Checkpoints hold the main weights too,
so `export_checkpoint` rebuilds the module without the export; the export is a
model_with_prophet: the frozen main model with its new prophet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from specdec_models import ModelConfig, ModelWithProphet, ProphetConfig
from specdec_models.losses import DIVERGENCES, divergence
from specdec_models.errors import SpecdecError, check
from specdec_models.export import export_hash, load_export, read_export_config
from specdec_models.losses import next_token_loss

from .cached_data import EMBEDDINGS, HOW_TO_BUILD, check_cache
from .module import LN2, OptimConfig, ProphetLitModule, check_prophet_fits, metadata_of, to_plain

CACHED_DATAMODULE = "train.cached_data.CachedDataModule"
DISTILL = tuple(d for d in DIVERGENCES if d != "ce")     # ce is the undistilled loss: main.distill=null
HOW_TO_EXPORT = "pass main.export=DIR, an export of the main model to freeze (python -m train or scripts/export.py)"


def main_export(cfg: DictConfig) -> tuple[Path, dict[str, Any]]:
    """The export named by main.export and its checked config.json."""
    node = cfg.get("main")
    check(isinstance(node, DictConfig), f"task=prophet_frozen needs a main node (experiment=enwik8_prophet_frozen); "
                                        f"{HOW_TO_EXPORT}")
    check(not OmegaConf.is_missing(node, "export") and bool(node.get("export")), f"main.export is not set: {HOW_TO_EXPORT}")
    export = Path(str(node.export)).expanduser()
    try:
        config = read_export_config(export)
    except SpecdecError as error:
        raise SpecdecError(f"main.export: {error}") from None
    return export, config


def validate_task(cfg: DictConfig) -> dict[str, Any]:
    """task=prophet_frozen: check main.*, the prophet, the optimiser and their fit with the data
    (reads the export's config.json and the cache's cache.json, no weights); return the keyword
    arguments of FrozenMainLitModule."""
    export, config = main_export(cfg)
    try:
        main = ModelConfig.from_dict(config["main"])
    except (SpecdecError, TypeError) as error:
        raise SpecdecError(f"main.export {export}: bad main model config ({error}): re-export the model") from None
    prophet = ProphetConfig.from_dict(to_plain(cfg.model.prophet))
    OptimConfig.from_dict(to_plain(cfg.optim))
    check(config["tokenizer"]["kind"] == "bytes" and main.vocab_size == 256,
          f"main.export {export} has a {config['tokenizer']['kind']} vocabulary of {main.vocab_size}; byte-level "
          f"data needs the bytes tokenizer with vocab_size 256")
    check(prophet.model.vocab_size == main.vocab_size,
          f"model.prophet.model.vocab_size ({prophet.model.vocab_size}) differs from the main model's "
          f"({main.vocab_size}) in main.export {export}")
    check_prophet_fits(cfg, main, prophet, f"the max_seq_len of main.export {export}")

    embeddings = cfg.main.get("embeddings", "online")
    check(embeddings in EMBEDDINGS, f"main.embeddings must be one of {', '.join(EMBEDDINGS)}, got {embeddings!r}")
    distill, weight = cfg.main.get("distill"), cfg.main.get("distill_weight", 1.0)
    check(distill is None or distill in DISTILL,
          f"main.distill must be null or one of {', '.join(DISTILL)}, got {distill!r}")
    check(isinstance(weight, (int, float)) and not isinstance(weight, bool) and 0 < weight <= 1,
          f"main.distill_weight must be in (0, 1], got {weight!r}")
    sha = config["weights_sha256"]
    if embeddings == "cached":
        cache = cfg.main.get("cache")
        check(bool(cache), f"main.embeddings=cached needs main.cache=CACHE_DIR ({HOW_TO_BUILD})")
        check(cfg.data.get("_target_") == CACHED_DATAMODULE,
              f"main.embeddings=cached needs data._target_={CACHED_DATAMODULE} (as in "
              f"experiment=enwik8_prophet_frozen), got {cfg.data.get('_target_')}")
        meta = check_cache(cache, export_sha256=sha, seq_len=cfg.data.seq_len, dim=main.dim)
        check(distill is None or meta["top_k_logits"] > 0,
              f"main.distill={distill} with main.embeddings=cached needs a cache with top-k logits: rebuild "
              f"{cache} with scripts/cache_embeddings.py --top-k-logits K")
    metadata = {**metadata_of(cfg), "main_export": str(export.resolve()), "main_export_sha256": sha,
                "embeddings": embeddings, "distill": distill}
    return dict(main=main.to_dict(), prophet=prophet.to_dict(), export=str(export.resolve()), export_sha256=sha,
                embeddings=embeddings, distill=distill, distill_weight=float(weight), optim=to_plain(cfg.optim),
                seed=cfg.seed, metadata=metadata, compile=cfg.compile)


class FrozenMainLitModule(ProphetLitModule):
    task = "prophet_frozen"

    def __init__(self, main: dict[str, Any], prophet: dict[str, Any], export: str, export_sha256: str,
                 embeddings: str = "online", distill: str | None = None, distill_weight: float = 1.0,
                 optim: dict[str, Any] | None = None, seed: int = 0, metadata: dict[str, Any] | None = None,
                 compile: bool = False) -> None:
        """`main`: the ModelConfig dict of the export's main model; `prophet`: a ProphetConfig
        dict; `export`, `export_sha256`: where `setup()` loads the main weights from and the
        weights hash they must have; `embeddings`: online or cached (what the training batches
        carry: token windows, or dicts of tokens and embeddings); `distill`: null or a divergence
        toward the main model's distribution, weighted `distill_weight` against the data's
        next-token loss; `compile`: torch.compile the prophet's blocks (state dicts unchanged)."""
        L.LightningModule.__init__(self)        # not ProphetLitModule's: it builds a joint model
        self.save_hyperparameters(dict(main=main, prophet=prophet, export=export, export_sha256=export_sha256,
                                       embeddings=embeddings, distill=distill, distill_weight=distill_weight,
                                       optim=optim, seed=seed, metadata=metadata, compile=compile))
        self.optim_cfg = OptimConfig.from_dict(dict(optim or {}))
        self.net = ModelWithProphet(ModelConfig.from_dict(dict(main)), ProphetConfig.from_dict(dict(prophet)))
        self.net.model.requires_grad_(False)
        self.net.model.eval()
        if compile:
            for block in self.net.prophet.layers:
                block.compile()

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
        check(sha == self.hparams.export_sha256,
              f"main.export {path} now holds another model (weights sha256 {sha[:16]}...) than the one this run was "
              f"configured with ({self.hparams.export_sha256[:16]}...): restore that export or start a new run")
        loaded = load_export(path)            # re-hashes the weights file against config.json
        main = loaded.model if isinstance(loaded, ModelWithProphet) else loaded
        check(main.cfg == self.net.main_cfg, f"main.export {path}: its main model config differs from this run's")
        self.net.model.load_state_dict(main.state_dict())
        self.net.model.requires_grad_(False)
        self.net.model.eval()

    def train(self, mode: bool = True) -> FrozenMainLitModule:
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
            # cached bf16/fp16 embeddings: into the prophet's dtype (autocast still applies)
            return batch["tokens"], batch["embeds"].to(self.net.prophet.token_emb.weight.dtype)
        return batch, self.main_embeddings(batch)

    def _teacher_logits(self, anchors: torch.Tensor, main_logits: torch.Tensor | None,
                        batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        """The main model's logits (b W, L, vocab) at the positions anchor + i that predict what
        prophet window position i does: from `main_logits` (b, n, vocab), or from the cached top-K
        (others -inf, so the softmax renormalises over the top K)."""
        length = self.net.prophet_cfg.prophet_train_length
        positions = anchors[..., None] + torch.arange(length, device=anchors.device)    # (b, W, L)
        rows = torch.arange(anchors.shape[0], device=anchors.device)[:, None, None]
        if main_logits is None:
            values = batch["topk_values"][rows, positions].float()                        # (b, W, L, K)
            indices = batch["topk_indices"][rows, positions]
            dense = values.new_full((*values.shape[:-1], self.net.main_cfg.vocab_size), float("-inf"))
            teacher = dense.scatter_(-1, indices, values)
        else:
            teacher = main_logits[rows, positions]                                        # (b, W, L, vocab)
        return teacher.flatten(0, 1)

    def _losses(self, seq: torch.Tensor, embeds: torch.Tensor, micro: int, main_logits: torch.Tensor | None,
                batch: torch.Tensor | dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, {"prophet_loss": next-token loss, "distill_loss": divergence if main.distill})."""
        anchors = self.net.anchors(seq.shape[1] - 1, seq.shape[0], self._generator(seq, micro), seq.device)
        distill = self.hparams.distill
        if distill is None:
            loss = self.net.prophet_loss(seq, embeds, anchors)
            return loss, {"prophet_loss": loss}
        logits, labels = self.net.prophet_logits(seq, embeds, anchors)
        ce = next_token_loss(logits, labels)
        with torch.no_grad():
            teacher = self._teacher_logits(anchors, main_logits, batch)
        div = divergence(distill, logits, teacher)
        w = self.hparams.distill_weight
        loss = div if w == 1 else (1 - w) * ce + w * div
        return loss, {"prophet_loss": ce, "distill_loss": div}

    # -- steps -----------------------------------------------------------------------------------

    def training_step(self, batch: torch.Tensor | dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        micro = batch_idx % self.trainer.accumulate_grad_batches
        seq, embeds = self._inputs(batch)
        main_logits = None
        if self.hparams.distill is not None and not isinstance(batch, dict):
            with torch.no_grad():
                main_logits = self.net.model.logits(embeds)                             # (b, n, vocab)
        loss, parts = self._losses(seq, embeds, micro, main_logits, batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log_dict({f"train/{k}": v for k, v in parts.items()})
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def _evaluate(self, batch: torch.Tensor | dict[str, torch.Tensor], prefix: str) -> None:
        seq = batch["tokens"] if isinstance(batch, dict) else batch
        embeds = self.main_embeddings(seq)                   # online, so runs and modes compare
        with torch.no_grad():
            main_logits = self.net.model.logits(embeds)
            main_loss = next_token_loss(main_logits, seq[:, 1:])
        _, parts = self._losses(seq, embeds, 0, main_logits, batch)
        b = seq.shape[0]
        self.log(f"{prefix}/prophet_loss", parts.pop("prophet_loss"), prog_bar=True, sync_dist=True, batch_size=b)
        self.log_dict({f"{prefix}/{k}": v for k, v in parts.items()}, sync_dist=True, batch_size=b)
        self.log(f"{prefix}/main_loss", main_loss, sync_dist=True, batch_size=b)
        self.log(f"{prefix}/bpc", main_loss / LN2, sync_dist=True, batch_size=b)    # the frozen main's bits per byte


LitModule = FrozenMainLitModule
