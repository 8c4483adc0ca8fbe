"""Turning logits into the distributions that decoding samples from: the one implementation.

The draft, the target and plain decoding all call `process_logits` and `to_probs` with the same
settings, so speculative decoding reproduces exactly the processed target distribution (a
frequent bug in public implementations is processing one side only). Order, as in Hugging Face
transformers: repetition penalty, then temperature, then top-k, then top-p. Temperature 0 is
greedy: a one-hot on the argmax of the penalised logits (first index on ties, `torch.argmax`'s
rule, used everywhere), never a division by a small number.

The repetition penalty (Keskar et al. 2019, CTRL; transformers' `repetition_penalty`) depends on
the context: for every token id present in the row's context so far, logit / penalty if the
logit is >= 0, else logit * penalty. Callers pass `seen`, a boolean mask (..., vocab) of the ids
in the context of each position, so a draft position and the target's verify position that
predict the same token see the same prefix (drafted tokens included) and the same processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import check


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        check(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < float("inf"),
              f"temperature must be >= 0 and finite, got {t!r}")
        if self.top_k is not None:
            check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 1,
                  f"top_k must be an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None:
            check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
                  f"top_p must be in (0, 1], got {self.top_p!r}")
        r = self.repetition_penalty
        if r is not None:
            check(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r < float("inf"),
                  f"repetition_penalty must be a number > 0 (1 is none), got {r!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether the processing depends on the context (a repetition penalty other than 1)."""
        return self.repetition_penalty is not None and self.repetition_penalty != 1


GREEDY = SamplingConfig(temperature=0.0)      # argmax decoding, no filtering or penalty


def penalise(logits: Tensor, cfg: SamplingConfig, seen: Tensor | None) -> Tensor:
    """fp32 logits (..., vocab) after the repetition penalty for the ids marked in `seen`
    (bool, broadcastable to logits); unchanged without a penalty."""
    logits = logits.float()
    if not cfg.penalised:
        return logits
    check(seen is not None, "a repetition penalty needs the context's tokens (seen) at every position")
    r = cfg.repetition_penalty
    return torch.where(seen, torch.where(logits < 0, logits * r, logits / r), logits)


def process_logits(logits: Tensor, cfg: SamplingConfig, seen: Tensor | None = None) -> Tensor:
    """fp32 logits (..., vocab) after the repetition penalty (see `penalise`), temperature, top-k
    and top-p; filtered entries are -inf."""
    logits = penalise(logits, cfg, seen)
    if cfg.temperature not in (0, 1):
        logits = logits / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # keep a token while the mass before it is below top_p (so the top token always stays)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def greedy_tokens(logits: Tensor, cfg: SamplingConfig, seen: Tensor | None = None) -> Tensor:
    """The argmax (...) of the penalised logits (..., vocab): the token greedy decoding picks, on
    which `to_probs` puts its one-hot. Read from the logits in their own dtype (a widening cast
    changes no value, so no index either): decoding at temperature 0 builds no (..., vocab)
    tensor, whose copy and one-hot cost a large share of a CPU verify call (docs/DECODING.md)."""
    return (penalise(logits, cfg, seen) if cfg.penalised else logits).argmax(dim=-1)


def to_probs(logits: Tensor, cfg: SamplingConfig, seen: Tensor | None = None) -> Tensor:
    """The processed distribution (..., vocab) in fp32; a one-hot on the (penalised) argmax when
    greedy (top-k and top-p never drop the argmax). `seen`: see `penalise`."""
    if cfg.greedy:
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return probs.scatter_(-1, greedy_tokens(logits, cfg, seen).unsqueeze(-1), 1.0)
    return process_logits(logits, cfg, seen).softmax(dim=-1)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of probs (..., vocab) -> (...), by inverse transform sampling: the first
    token whose cumulative probability exceeds u * total, u uniform in [0, 1). A zero-probability
    token spans an empty interval, so it is never drawn. One uniform per row, where
    `torch.multinomial` draws an exponential per vocabulary entry and is several times slower
    (docs/DECODING.md). The cumulative sum is float64 (float32 on
    MPS, which lacks it), so the intervals keep the probabilities of rare tokens."""
    flat = probs.reshape(-1, probs.shape[-1])
    dtype = torch.float32 if flat.device.type == "mps" else torch.float64
    cdf = flat.to(dtype).cumsum(-1)                                          # (rows, vocab)
    u = torch.rand(flat.shape[0], 1, dtype=dtype, device=flat.device, generator=generator)
    # u < 1 keeps u * total below the last cumulative value; the clamp only guards rounding
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=flat.shape[-1] - 1)
    return index.reshape(probs.shape[:-1])


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) per row, the distribution of the correction token after a rejection.

    Where p == q the residual has no mass; a rejection then has probability 0, but rounding can
    still produce one, so those rows fall back to p (keeps the result finite and normalised)."""
    r = (p - q).clamp_(min=0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=torch.finfo(r.dtype).tiny), p)
