"""task=prophet: a main decoder and its prophet trained jointly (`experiment=enwik8_prophet`).

The loss is `specdec_models.ModelWithProphet`'s: the main model's next-token loss plus the
prophet's loss over its training windows (the prophet idea of lucidrains/speculative-decoding;
drafts are verified as in Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"). The module takes plain values (the dicts of `ModelConfig` and
`ProphetConfig`) and builds the network itself, so a checkpoint rebuilds it without Hydra.
`ProphetNetModule` is what this task and task=prophet_frozen share: the network, the seeded
window subsets, decoding with the prophet, and the export (a model_with_prophet).
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from specdec_models import ModelConfig, ModelWithProphet, ProphetConfig
from specdec_models.errors import check

from ..data.enwik8 import Enwik8DataModule
from .base import LN2, NoOptions, SpeculativeModels, Task, to_plain
from .prophet_common import ProphetTaskModule


def check_prophet_fits(cfg: DictConfig, main: ModelConfig, prophet: ProphetConfig, main_name: str) -> None:
    """The prophet drafts cfg.gamma tokens, its windows fit the data, the data fits the main model
    (called `main_name` in the messages), and both read bytes."""
    check(main.vocab_size == 256 and prophet.model.vocab_size == 256,
          f"byte-level data needs vocab_size 256, got main {main.vocab_size} and prophet {prophet.model.vocab_size}")
    check(prophet.prophet_train_length >= cfg.gamma + 1,
          f"model.prophet.prophet_train_length ({prophet.prophet_train_length}) must be >= gamma + 1 = "
          f"{cfg.gamma + 1}: the prophet drafts gamma tokens after the one the main model emits")
    check(cfg.data.seq_len <= main.max_seq_len,
          f"data.seq_len ({cfg.data.seq_len}) exceeds {main_name} ({main.max_seq_len})")
    check(cfg.data.seq_len >= prophet.window_len,
          f"data.seq_len ({cfg.data.seq_len}) must hold one prophet window of num_leading_start_tokens + "
          f"prophet_train_length - 1 = {prophet.window_len} positions")


class ProphetNetModule(ProphetTaskModule):
    """A `ModelWithProphet` (`self.net`) and what both prophet tasks do with it."""

    def __init__(self, main: dict[str, Any], prophet: dict[str, Any], optim: dict[str, Any] | None, seed: int,
                 metadata: dict[str, Any] | None, compile: bool) -> None:
        super().__init__(optim, seed, metadata, compile)
        self.net = ModelWithProphet(ModelConfig.from_dict(main), ProphetConfig.from_dict(prophet))

    def speculative_models(self) -> SpeculativeModels:
        """The main model as target, drafted by its prophet."""
        return SpeculativeModels(target=self.net.model, prophet=self.net)

    def export_model(self) -> ModelWithProphet:
        return self.net


class ProphetModule(ProphetNetModule):
    task = "prophet"

    def __init__(self, main: dict[str, Any], prophet: dict[str, Any], optim: dict[str, Any] | None = None,
                 seed: int = 0, metadata: dict[str, Any] | None = None, compile: bool = False) -> None:
        """`main`, `prophet`: the dicts of ModelConfig and ProphetConfig; `optim`: of OptimConfig;
        `metadata`: plain values kept in the checkpoint and copied into the export (run name, gamma);
        `compile`: torch.compile the joint loss (minutes once, then faster CPU steps from fused
        element-wise work: docs/prophet.md). State dicts are unchanged."""
        super().__init__(main, prophet, optim, seed, metadata, compile)
        self.save_hyperparameters()
        if compile:
            self.net.compile()      # compiles the module's forward in place: parameter names stay

    def trainable(self) -> ModelWithProphet:
        return self.net

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        out = self.net(batch, generator=self.window_generator(self.net, batch.device, self.micro_batch(batch_idx)))
        self.log_train(out.loss, {"main_loss": out.main_loss, "prophet_loss": out.prophet_loss})
        return out.loss

    def evaluate(self, batch: torch.Tensor, prefix: str) -> None:
        out = self.net(batch, generator=self.window_generator(self.net, batch.device, None))
        self.track_drafted(prefix, out.prophet_logits, out.labels)
        b = batch.shape[0]
        self.log_dict({f"{prefix}/main_loss": out.main_loss, f"{prefix}/prophet_loss": out.prophet_loss},
                      sync_dist=True, batch_size=b)
        # bits per byte: the main model's nats per byte / ln 2
        self.log(f"{prefix}/bpc", out.main_loss / LN2, prog_bar=True, sync_dist=True, batch_size=b)



def validate(cfg: DictConfig, options: NoOptions) -> dict[str, Any]:
    """Check the main and prophet sizes and their fit with the data and gamma."""
    main = ModelConfig.from_dict(to_plain(cfg.model.main))
    prophet = ProphetConfig.from_dict(to_plain(cfg.model.prophet))
    check_prophet_fits(cfg, main, prophet, "model.main.max_seq_len")
    return dict(main=main.to_dict(), prophet=prophet.to_dict())


TASK = Task(name="prophet", config=NoOptions, module=ProphetModule, data=(Enwik8DataModule,), validate=validate)
