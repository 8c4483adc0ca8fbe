"""A main decoder and its prophet, trained jointly (or with the main model frozen).

The prophet idea (see lucidrains/speculative-decoding, "speculative decoding with prophet"):
a small decoder drafts the next tokens from the main model's last-layer embeddings instead of
from scratch. For an anchor position t, the prophet's input is

    [ P(h[t-S+1]), ..., P(h[t]),  x[t+1], x[t+2], ..., x[t+L-1] ]

where h are the main model's last-layer embeddings, P a projection to the prophet's width (the
identity when the widths agree), S = num_leading_start_tokens and L = prophet_train_length. Its
outputs from the last start token on predict x[t+1 .. t+L]. Decoding uses exactly this layout:
after a verify step the target's cache ends at the anchor t, x[t+1] is the token the target just
emitted, and the prophet drafts x[t+2], ... from it.

`ProphetHead` (a `DraftHead`) is the base class of every prophet head: it holds the window
layout and the batched window loss; `ModelWithProphet` adds the main model. The joint loss is the
main model's next-token loss plus `prophet_loss_weight` times the prophet's loss averaged over
every anchor of every sequence, computed as one batched forward over all windows (no Python loop),
or over `windows_per_seq` random anchors per sequence.

`drafted_hits` and `simulated_tokens_per_call` give the acceptance length other trainers report
from teacher-forced windows alone (docs/DECODING.md): window output i = 1..gamma
predicts the token decoding drafts at position i (output 0 predicts the token the target emits
itself), so with a_i the top-1 accuracy there, a round would emit 1 + sum_k prod_{i<=k} a_i
tokens if acceptance at each position depended on nothing but the earlier ones' success.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..config import ModelConfig, ProphetConfig
from ..errors import check
from ..losses import next_token_loss
from ..model import Decoder
from .base import DraftHead


def drafted_hits(logits: Tensor, labels: Tensor, gamma: int) -> Tensor:
    """Teacher-forced top-1 hits of prophet windows at the drafted positions: logits (W, L, vocab)
    and labels (W, L) as `ProphetHead.prophet_logits` returns them; the count (gamma,) of
    windows whose argmax at output i = 1..gamma equals the label (its true token, every earlier
    one fed). Divided by W, the per-position accuracies a_1..a_gamma."""
    check(1 <= gamma < logits.shape[1], f"gamma ({gamma}) must be in [1, {logits.shape[1] - 1}]: window "
                                        f"outputs 1..gamma are the drafted positions")
    hits = logits[:, 1:gamma + 1].argmax(-1) == labels[:, 1:gamma + 1]          # (W, gamma)
    return hits.sum(0)


def simulated_tokens_per_call(accuracy: Tensor | list[float]) -> float:
    """1 + sum_{k=1..gamma} prod_{i<=k} a_i for per-position accuracies a_1..a_gamma: the tokens
    per target call a round would give (bonus or correction token included) if draft i were
    accepted with probability a_i given drafts 1..i-1 were (see the module docstring)."""
    a = torch.as_tensor(accuracy, dtype=torch.float64)
    return float(1 + a.cumprod(0).sum())


class ProphetLoss(NamedTuple):
    loss: Tensor
    main_loss: Tensor
    prophet_loss: Tensor
    prophet_logits: Tensor | None = None      # (b W, L, vocab): the windows' logits ...
    labels: Tensor | None = None              # (b W, L): ... and labels (for `drafted_hits`)


class ProphetHead(DraftHead):
    """The base class of every prophet head (`ModelWithProphet` here, the prophet head of a Hugging
    Face target in `hf_prophet`): the window layout and loss they share.

    A subclass sets `prophet_cfg` (a ProphetConfig), `prophet` (a `Decoder`: its `token_emb`,
    `layers`, `rotary` and `logits` are what the windows run through) and `to_prophet_start` (the
    projection of the main model's last-layer embeddings to the prophet's width)."""

    prophet_cfg: ProphetConfig
    prophet: Decoder
    to_prophet_start: nn.Module

    @property
    def num_start_tokens(self) -> int:
        return self.prophet_cfg.num_leading_start_tokens

    @property
    def max_gamma(self) -> int:
        """The most tokens a decoding round can draft: a window predicts prophet_train_length
        tokens, the first of which the target emits itself."""
        return self.prophet_cfg.prophet_train_length - 1

    def start_tokens(self, embeds: Tensor) -> Tensor:
        """Project main-model embeddings (..., main dim) to prophet start tokens (..., prophet dim)."""
        return self.to_prophet_start(embeds)

    def anchors(self, seq_len: int, batch: int, generator: torch.Generator | None = None,
                device: torch.device | None = None, valid_len: Tensor | None = None) -> Tensor:
        """Anchor positions (batch, W) whose windows fit in a training sequence of seq_len + 1 tokens.
        With `windows_per_seq` and `valid_len` (batch,), the real tokens of each row (a regenerated
        row is padded after its end-of-turn token), the windows whose labels all lie before
        valid_len are drawn first: one reaching into the padding only when a row has fewer than
        `windows_per_seq` others."""
        S, L = self.num_start_tokens, self.prophet_cfg.prophet_train_length
        first, count = S - 1, self.prophet_cfg.anchor_count(seq_len)       # anchors S-1 .. seq_len-L
        check(count >= 1, f"seq_len {seq_len} is too short for prophet windows of "
                          f"{S} start tokens + {L} predicted tokens")
        k = self.prophet_cfg.windows_per_seq
        if k is None or k >= count:
            return torch.arange(first, first + count, device=device).expand(batch, count)
        scores = torch.rand(batch, count, generator=generator, device=generator.device if generator else device)
        if valid_len is not None:            # window at anchor a: labels a + 1 .. a + L, real while < valid_len
            anchor = first + torch.arange(count, device=scores.device)
            scores = scores + 2.0 * (anchor + L >= valid_len.to(scores.device)[:, None])
        return scores.argsort(dim=-1)[:, :k].to(device) + first

    def teacher_positions(self, anchors: Tensor) -> Tensor:
        """Positions (b, W, L) whose main-model outputs predict what window output i = 0..L-1 of
        the window at each anchor (b, W) does: anchor + i (what a distillation compares them with)."""
        return anchors[..., None] + torch.arange(self.prophet_cfg.prophet_train_length, device=anchors.device)

    def prophet_loss(self, seq: Tensor, main_embeds: Tensor, anchors: Tensor) -> Tensor:
        """Prophet loss over the windows at `anchors` (b, W) of `seq` (b, n + 1), given the main
        model's embeddings (b, n, dim) of seq[:, :n]."""
        return next_token_loss(*self.prophet_logits(seq, main_embeds, anchors))

    def prophet_logits(self, seq: Tensor, main_embeds: Tensor, anchors: Tensor) -> tuple[Tensor, Tensor]:
        """The prophet's logits (b W, L, vocab) on the windows at `anchors` (b, W) and their labels
        (b W, L): row w's position i predicts seq[anchor + 1 + i], as the main model's position
        anchor + i does (what a distillation loss compares them with).

        Same result as running `self.prophet` on each window (see `window_inputs`), with two
        savings: the first layer's query/key/value projection depends on each position alone, so
        it runs once per sequence position instead of once per window position (the windows
        overlap about train_length-fold); and the last layer computes outputs only from the last
        start token on, the positions that have labels."""
        S, L = self.num_start_tokens, self.prophet_cfg.prophet_train_length
        b, n = main_embeds.shape[:2]
        P = S + L - 1                                                          # positions per window
        prophet = self.prophet
        # per-position inputs: start tokens for positions 0..n-1, token embeddings for 0..n
        inputs = torch.cat([self.start_tokens(main_embeds), prophet.token_emb(seq)], 1)  # (b, 2n + 1, d)
        index = self._window_index(anchors, n, S, L)                           # (b, W, P) into dim 1
        flat = (index + torch.arange(b, device=seq.device)[:, None, None] * inputs.shape[1]).flatten()
        gather = lambda t: t.flatten(0, 1).index_select(0, flat).view(b * anchors.shape[1], P, -1)  # noqa: E731
        x = gather(inputs)                                                     # (b W, P, d)
        qkv = gather(prophet.layers[0].qkv(inputs))                            # (b W, P, 3 inner)
        cos, sin = prophet.rotary(P, x.dtype)
        depth = len(prophet.layers)
        for i, block in enumerate(prophet.layers):
            x = block(x, cos, sin, qkv=qkv if i == 0 else None, queries_from=S - 1 if i == depth - 1 else 0)
        targets = seq.gather(1, (anchors[..., None] + torch.arange(1, L + 1, device=seq.device)).flatten(1))
        return prophet.logits(x), targets.view(-1, L)

    @staticmethod
    def _window_index(anchors: Tensor, n: int, S: int, L: int) -> Tensor:
        """Index (b, W, S + L - 1) into [start tokens (n); token embeddings (n + 1)] for each window:
        start tokens of positions t-S+1..t, then the tokens at positions t+1..t+L-1."""
        offsets = torch.cat([torch.arange(1 - S, 1), n + torch.arange(1, L)]).to(anchors.device)
        return anchors[..., None] + offsets

    def window_inputs(self, seq: Tensor, main_embeds: Tensor, anchors: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The plain form of the prophet's training windows: (start (bW, S, d), tokens (bW, L-1),
        labels (bW, L)), for a prophet call `self.prophet(tokens, start=start)` whose outputs from
        position S-1 on predict the labels. Used by tests to check `prophet_loss`."""
        S, L = self.num_start_tokens, self.prophet_cfg.prophet_train_length
        rows = torch.arange(seq.shape[0], device=seq.device)[:, None, None]
        start = self.start_tokens(main_embeds)[rows, anchors[..., None] + torch.arange(1 - S, 1, device=seq.device)]
        labels = seq[rows, anchors[..., None] + torch.arange(1, L + 1, device=seq.device)]
        return start.flatten(0, 1), labels[..., :-1].flatten(0, 1), labels.flatten(0, 1)


class ModelWithProphet(ProphetHead):
    """A main `Decoder` and its prophet, trained jointly (`forward` gives the joint loss)."""

    def __init__(self, main: ModelConfig, prophet: ProphetConfig) -> None:
        super().__init__()
        check(main.vocab_size == prophet.model.vocab_size,
              f"prophet vocabulary ({prophet.model.vocab_size}) differs from the main model's ({main.vocab_size})")
        self.main_cfg = main
        self.prophet_cfg = prophet
        self.model = Decoder(main)
        self.prophet = Decoder(prophet.model)
        self.to_prophet_start = (nn.Identity() if main.dim == prophet.model.dim
                                 else nn.Linear(main.dim, prophet.model.dim, bias=False))
        if isinstance(self.to_prophet_start, nn.Linear):
            nn.init.normal_(self.to_prophet_start.weight, std=main.dim ** -0.5)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, seq: Tensor, generator: torch.Generator | None = None) -> ProphetLoss:
        """Joint loss on token sequences `seq` (b, n + 1): inputs seq[:, :-1], labels seq[:, 1:]."""
        embeds = self.model.hidden(seq[:, :-1])
        main_loss = next_token_loss(self.model.logits(embeds), seq[:, 1:])
        if self.prophet_cfg.detach_embeds:
            embeds = embeds.detach()
        anchors = self.anchors(seq.shape[1] - 1, seq.shape[0], generator, seq.device)
        logits, labels = self.prophet_logits(seq, embeds, anchors)
        prophet_loss = next_token_loss(logits, labels)
        loss = main_loss + self.prophet_cfg.prophet_loss_weight * prophet_loss
        return ProphetLoss(loss, main_loss, prophet_loss, logits, labels)
