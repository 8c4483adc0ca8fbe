"""Model configurations: plain dataclasses that validate themselves and round-trip through JSON.

The same dict lives in Hydra configs, in Lightning checkpoints' hyper-parameters and in exports,
so a model can always be rebuilt from it without Hydra (as in litgpt and nanoGPT's model_args).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import SpecdecError, check, check_positive_int

# the one dtype vocabulary of configs, CLIs and file metadata: torch's own names
# the `format` field of every specdec export's config.json (specdec_models.export.specdec); here, at
# the bottom of the package order, so that loading code below `export` (hf.weights) can recognise one
EXPORT_FORMAT = "specdec-export"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: Any, what: str, allowed: tuple[str, ...] = tuple(DTYPES)) -> torch.dtype:
    """The torch dtype called `name` (one of `allowed`), or a one-line error naming the setting `what`."""
    check(name in allowed, f"{what} must be one of {', '.join(allowed)}, got {name!r}")
    return DTYPES[name]


def from_dict(cls, data: Any, what: str):
    """cls(**data) for a dataclass `cls`, refusing a non-mapping and unknown keys with one line
    that names the config node `what`."""
    if not isinstance(data, dict):
        raise SpecdecError(f"{what} must be a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    check(not unknown, f"{what}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    return cls(**data)


class JsonConfig:
    """to_dict / from_dict / to_json / from_json for a config dataclass; `what` names it in errors."""

    what = "config"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        return from_dict(cls, dict(data) if isinstance(data, Mapping) else data, cls.what)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class ModelConfig(JsonConfig):
    """Sizes of one decoder. `dim_head` must be even (rotary embeddings rotate pairs)."""

    what = "model config"

    vocab_size: int = 256
    dim: int = 512
    depth: int = 10
    heads: int = 8
    dim_head: int = 64
    ff_mult: int = 4
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_positive_int(getattr(self, f.name), f"model.{f.name}")
        check(self.dim_head % 2 == 0, f"model.dim_head must be even for rotary embeddings, got {self.dim_head}")

    @property
    def inner_dim(self) -> int:
        return self.heads * self.dim_head


@dataclass(frozen=True)
class ProphetConfig(JsonConfig):
    """The prophet: a small decoder that drafts from the main model's last-layer embeddings.

    For an anchor position t of the main model, the prophet reads the main model's embeddings
    h[t - num_leading_start_tokens + 1 .. t] (projected to the prophet's width) as leading start
    tokens, then the tokens x[t+1], x[t+2], ... It learns to predict x[t+1 .. t+prophet_train_length]:
    the first prediction comes from the last start token, so a decoding round of gamma drafts
    needs prophet_train_length >= gamma + 1.

    `windows_per_seq` trains on a random subset of anchors per sequence (None: every anchor, as
    the seed does). `detach_embeds` stops the prophet's gradient at the main model's embeddings.
    """

    what = "prophet config"

    model: ModelConfig = field(default_factory=lambda: ModelConfig(dim=512, depth=2))
    prophet_train_length: int = 7
    num_leading_start_tokens: int = 2
    detach_embeds: bool = False
    prophet_loss_weight: float = 1.0
    windows_per_seq: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            object.__setattr__(self, "model", ModelConfig.from_dict(self.model))
        check(isinstance(self.model, ModelConfig), "prophet.model must be a ModelConfig")
        check_positive_int(self.prophet_train_length, "prophet.prophet_train_length")
        check_positive_int(self.num_leading_start_tokens, "prophet.num_leading_start_tokens")
        check(isinstance(self.detach_embeds, bool), "prophet.detach_embeds must be true or false")
        check(isinstance(self.prophet_loss_weight, (int, float)) and self.prophet_loss_weight >= 0,
              f"prophet.prophet_loss_weight must be >= 0, got {self.prophet_loss_weight!r}")
        if self.windows_per_seq is not None:
            check_positive_int(self.windows_per_seq, "prophet.windows_per_seq")
        window = self.window_len
        check(window <= self.model.max_seq_len,
              f"prophet.model.max_seq_len ({self.model.max_seq_len}) must hold a training window of "
              f"num_leading_start_tokens + prophet_train_length - 1 = {window} positions")

    def anchor_count(self, seq_len: int) -> int:
        """Anchors t a training sequence of seq_len + 1 tokens holds: t needs the embeddings of
        t-S+1..t and labels up to x[t+L], so t runs from S-1 to seq_len-L."""
        return seq_len - self.prophet_train_length - self.num_leading_start_tokens + 2

    @property
    def window_len(self) -> int:
        """Positions in one prophet training window: the start tokens, then train_length - 1 tokens."""
        return self.num_leading_start_tokens + self.prophet_train_length - 1

