"""The LightningModule that trains a main decoder and its prophet jointly, and the one function
that turns its checkpoint into an export.

The loss is `specdec_models.ModelWithProphet`'s: the main model's next-token loss plus the
prophet's loss over its training windows (the prophet idea of lucidrains/speculative-decoding;
drafts are verified as in Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"). The module takes plain values (the dicts of `ModelConfig` and
`ProphetConfig`) and builds the network itself, so `load_from_checkpoint` needs no Hydra.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

from omegaconf import DictConfig, OmegaConf

from specdec_models import ModelConfig, ModelWithProphet, ProphetConfig
from specdec_models.errors import SpecdecError, check

LN2 = math.log(2.0)


def dataclass_from_dict(cls, data: dict[str, Any], where: str):
    """cls(**data), refusing unknown keys with one line naming the config node `where`."""
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    check(not unknown, f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**data)


@dataclass(frozen=True)
class OptimConfig:
    """Adam or AdamW; the learning rate warms up linearly for `warmup_steps`, then follows a
    cosine from `lr` down to `min_lr_ratio * lr` at the trainer's `max_steps`."""

    name: str = "adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        check(self.name in ("adam", "adamw"), f"optim.name must be adam or adamw, got {self.name!r}")
        check(isinstance(self.lr, (int, float)) and self.lr > 0, f"optim.lr must be > 0, got {self.lr!r}")
        betas = tuple(self.betas)
        check(len(betas) == 2 and all(0 <= b < 1 for b in betas),
              f"optim.betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", betas)
        check(self.eps > 0, f"optim.eps must be > 0, got {self.eps!r}")
        check(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay!r}")
        check(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
              f"optim.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        check(0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OptimConfig":
        return dataclass_from_dict(cls, data, "optim")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of `lr` at optimizer step `step` of `total_steps`."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay = max(1, total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def to_plain(node: Any) -> Any:
    """A Hydra node as plain Python values (resolved); plain values pass through."""
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def metadata_of(cfg: DictConfig) -> dict[str, Any]:
    """What a run keeps in its checkpoint and export: run name, task, gamma, seq_len, tags."""
    return {"name": cfg.name, "task": cfg.get("task", "prophet"), "gamma": cfg.gamma, "seq_len": cfg.data.seq_len,
            "tags": list(cfg.tags)}


def check_prophet_fits(cfg: DictConfig, main: ModelConfig, prophet: ProphetConfig, main_name: str) -> None:
    """The prophet drafts cfg.gamma tokens and its windows fit the data; the data fits the main
    model (called `main_name` in the message)."""
    check(prophet.prophet_train_length >= cfg.gamma + 1,
          f"model.prophet.prophet_train_length ({prophet.prophet_train_length}) must be >= gamma + 1 = "
          f"{cfg.gamma + 1}: the prophet drafts gamma tokens after the one the main model emits")
    check(cfg.data.seq_len <= main.max_seq_len,
          f"data.seq_len ({cfg.data.seq_len}) exceeds {main_name} ({main.max_seq_len})")
    check(cfg.data.seq_len >= prophet.window_len,
          f"data.seq_len ({cfg.data.seq_len}) must hold one prophet window of num_leading_start_tokens + "
          f"prophet_train_length - 1 = {prophet.window_len} positions")


def validate_task(cfg: DictConfig) -> dict[str, Any]:
    """task=prophet: check the model, optimiser and their fit with the data; return the keyword
    arguments of ProphetLitModule (plain values)."""
    main = ModelConfig.from_dict(to_plain(cfg.model.main))
    prophet = ProphetConfig.from_dict(to_plain(cfg.model.prophet))
    OptimConfig.from_dict(to_plain(cfg.optim))
    check(main.vocab_size == 256 and prophet.model.vocab_size == 256,
          f"byte-level data needs vocab_size 256, got main {main.vocab_size} and prophet {prophet.model.vocab_size}")
    check_prophet_fits(cfg, main, prophet, "model.main.max_seq_len")
    return dict(main=main.to_dict(), prophet=prophet.to_dict(), optim=to_plain(cfg.optim), seed=cfg.seed,
                metadata=metadata_of(cfg), compile=cfg.compile)


def configure_adam(model: torch.nn.Module, cfg: OptimConfig, total_steps: int | None) -> dict[str, Any]:
    """Adam(W) over the trainable parameters of `model` with the warmup + cosine schedule, as
    LightningModule.configure_optimizers returns it. Weight decay applies to matrices (linear and
    embedding weights), never to norm gains or biases."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    optimizer_cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    optimizer = optimizer_cls(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    check(total_steps is not None and total_steps > 0, "trainer.max_steps must be set (> 0): it sets the cosine schedule")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cfg.lr_factor(step, total_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def step_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (seed, step, micro-batch, rank)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


class ProphetLitModule(L.LightningModule):
    task = "prophet"

    def __init__(self, main: dict[str, Any], prophet: dict[str, Any], optim: dict[str, Any] | None = None,
                 seed: int = 0, metadata: dict[str, Any] | None = None, compile: bool = False) -> None:
        """`main`, `prophet`: the dicts of ModelConfig and ProphetConfig; `optim`: of OptimConfig;
        `metadata`: plain values kept in the checkpoint and copied into the export (run name, gamma);
        `compile`: torch.compile the joint loss (once, about 1-2 minutes on a 2-core CPU; then
        about 1.3x faster steps there from fused element-wise work). State dicts are unchanged."""
        super().__init__()
        self.save_hyperparameters()
        self.optim_cfg = OptimConfig.from_dict(dict(optim or {}))
        self.net = ModelWithProphet(ModelConfig.from_dict(dict(main)), ProphetConfig.from_dict(dict(prophet)))
        if compile:
            self.net.compile()      # compiles the module's forward in place: parameter names stay

    def _generator(self, batch: torch.Tensor, micro: int) -> torch.Generator | None:
        """Seeded generator for the prophet's window subset (None when it trains on every window)."""
        if self.net.prophet_cfg.windows_per_seq is None:
            return None
        g = torch.Generator(device=batch.device)
        return g.manual_seed(step_seed(self.hparams.seed, self.global_step, micro, self.global_rank))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        micro = batch_idx % self.trainer.accumulate_grad_batches
        out = self.net(batch, generator=self._generator(batch, micro))
        self.log("train/loss", out.loss, prog_bar=True)
        self.log_dict({"train/main_loss": out.main_loss, "train/prophet_loss": out.prophet_loss})
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return out.loss

    def _evaluate(self, batch: torch.Tensor, prefix: str) -> None:
        out = self.net(batch, generator=self._generator(batch, 0))
        b = batch.shape[0]
        self.log_dict({f"{prefix}/main_loss": out.main_loss, f"{prefix}/prophet_loss": out.prophet_loss},
                      sync_dist=True, batch_size=b)
        # bits per byte: the main model's nats per byte / ln 2
        self.log(f"{prefix}/bpc", out.main_loss / LN2, prog_bar=True, sync_dist=True, batch_size=b)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        return configure_adam(self.net, self.optim_cfg, self.trainer.max_steps)

    # -- checkpoints and export ------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["specdec_task"] = self.task          # export_checkpoint rebuilds the right module

    def speculative_models(self) -> dict[str, torch.nn.Module]:
        """What the evaluation callback decodes with: the main model as target, drafted by its prophet."""
        return {"target": self.net.model, "prophet": self.net}

    def export_model(self) -> torch.nn.Module:
        """What the export holds: the main model with its prophet."""
        return self.net


LitModule = ProphetLitModule


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write the export (safetensors + JSON, see `specdec_models.export`) of a training
    checkpoint of any task; the one writer used by `train.run` and `scripts/export.py`. Returns
    the directory. The checkpoint's `specdec_task` picks the LightningModule (see train.run.TASKS)."""
    from specdec_models.export import save_export

    from .run import task_module

    ckpt_path = Path(ckpt_path)
    check(ckpt_path.is_file(), f"checkpoint {ckpt_path} does not exist")
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle or zip errors: report the file, not the stack
        raise SpecdecError(f"cannot read checkpoint {ckpt_path}: {error}") from None
    check("hyper_parameters" in ckpt and "state_dict" in ckpt, f"{ckpt_path} is not a specdec training checkpoint")
    hparams = ckpt["hyper_parameters"]
    module = task_module(ckpt.get("specdec_task", "prophet")).LitModule(**hparams)
    module.load_state_dict(ckpt["state_dict"])
    meta = {**(hparams.get("metadata") or {}), "global_step": int(ckpt.get("global_step", 0)),
            "optim": asdict(module.optim_cfg), "checkpoint": str(ckpt_path.resolve()),
            **(module.export_metadata() if hasattr(module, "export_metadata") else {}), **(metadata or {})}
    if hasattr(module, "write_export"):     # hf_draft_distill: a save_pretrained directory, not a specdec export
        return Path(module.write_export(out_dir, meta))
    return Path(save_export(out_dir, module.export_model().eval(), tokenizer="bytes", metadata=meta))
