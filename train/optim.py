"""The optimizer every task uses: Adam or AdamW with linear warm-up, then a cosine decay.

The cosine runs to the trainer's `max_steps`, or ends sooner when `max_time` stops training first:
the schedule's progress is the larger of the steps' and the time's share of their budgets (the
time from Lightning's Timer, checkpointed with the run), so a run stopped by its time budget
still anneals to `min_lr_ratio * lr`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from specdec_models.config import from_dict
from specdec_models.errors import check


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
        return from_dict(cls, data, "optim")

    def lr_factor(self, step: int, total_steps: int, time_fraction: float | None = None) -> float:
        """Multiplier of `lr` at optimizer step `step` of `total_steps`, `time_fraction` of the
        time budget spent (None: no time budget)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay = max(1, total_steps - self.warmup_steps)
        progress = min(1.0, max((step - self.warmup_steps) / decay, time_fraction or 0.0))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def configure_adam(model: torch.nn.Module, cfg: OptimConfig, total_steps: int | None,
                   time_fraction: Callable[[], float | None] | None = None) -> dict[str, Any]:
    """Adam(W) over the trainable parameters of `model` with the warmup + cosine schedule, as
    LightningModule.configure_optimizers returns it. Weight decay applies to matrices (linear and
    embedding weights), never to norm gains or biases. `time_fraction()`: the share of the time
    budget spent so far (None without one), read at every step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    optimizer_cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    optimizer = optimizer_cls(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    check(total_steps is not None and total_steps > 0,
          "trainer.max_steps must be set (> 0): it sets the cosine schedule")
    clock = time_fraction or (lambda: None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cfg.lr_factor(step, total_steps, clock()))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
