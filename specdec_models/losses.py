"""The training losses: next-token cross-entropy, and the divergences between a teacher's and a
student's next-token distributions (DistillSpec).

Zhou et al. 2023, "DistillSpec: Improving Speculative Decoding via Knowledge Distillation",
train the draft (student) to match the target (teacher) under the distribution decoding will
actually sample from, and pick the divergence for the decoding setting. Both sides go through
`sampling.process_logits` with the same `SamplingConfig` that decoding uses (temperature, then
top-k, then top-p), so the student learns the distribution speculative decoding compares it
with. With p the teacher's and q the student's processed distribution over the vocabulary:

    fkl   KL(p || q) = sum_x p log(p / q)                      (mode covering)
    rkl   KL(q || p) = sum_x q log(q / p)                      (mode seeking)
    jsd   beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q
          (the generalised JSD of Agarwal et al. 2024, GKD; beta = 0.5 is the usual JSD)
    tvd   1/2 sum_x |p - q|; 1 - tvd is the expected acceptance of one draft token
          (Leviathan et al. 2022), so tvd is the loss that targets acceptance directly
    ce    cross-entropy against the data's next tokens: the undistilled baseline

Each is a per-position value (nats, except tvd) averaged over positions. 0 log 0 = 0; where
top-k/top-p leaves the student no mass on a token the teacher keeps, log q is clamped to
`LOG_FLOOR` so the loss stays finite (and the gradient flows through the kept tokens).
Temperature 0 (greedy) has one-hot distributions with no gradient: use the divergence at
temperature 1 for a draft meant for greedy decoding (DistillSpec does the same).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import check
from .sampling import SamplingConfig, process_logits

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd", "ce")
LOG_FLOOR = -1e4          # log-probability given to tokens a filter removed (exp underflows to 0)


def next_token_loss(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy (nats) of logits (..., vocab) against labels (...), in fp32: the mean, or
    per position (shape of labels) with reduction="none"."""
    per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction=reduction)
    return per if reduction == "mean" else per.view(labels.shape)


def log_probs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """Log of the processed distribution (fp32); filtered tokens get LOG_FLOOR instead of -inf."""
    check(not sampling.greedy, "distillation needs a temperature > 0 (use 1 for drafts meant for greedy decoding)")
    return process_logits(logits, sampling).log_softmax(dim=-1).clamp(min=LOG_FLOOR)


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """KL(a || b) per position from log-probabilities (..., vocab) -> (...)."""
    a = log_a.exp()
    return (a * (log_a - log_b)).sum(dim=-1)


# the default sampling of `divergence`: plain softmax at temperature 1 (a frozen dataclass, so one
# shared instance is safe as a default)
DEFAULT_SAMPLING = SamplingConfig()


def divergence(name: str, student_logits: Tensor, teacher_logits: Tensor | None = None,
               labels: Tensor | None = None, sampling: SamplingConfig = DEFAULT_SAMPLING,
               beta: float = 0.5, mask: Tensor | None = None) -> Tensor:
    """Mean divergence `name` over positions. student_logits, teacher_logits: (..., vocab);
    labels (...) for `ce`; mask (...) bool: positions to average over (None: all)."""
    check(name in DIVERGENCES, f"unknown divergence {name!r}; choose one of {', '.join(DIVERGENCES)}")
    if name == "ce":
        check(labels is not None, "divergence 'ce' needs labels")
        per = next_token_loss(student_logits, labels, reduction="none")
    else:
        check(teacher_logits is not None, f"divergence {name!r} needs teacher logits")
        check(teacher_logits.shape == student_logits.shape,
              f"teacher logits {tuple(teacher_logits.shape)} and student logits "
              f"{tuple(student_logits.shape)} differ in shape")
        log_q = log_probs(student_logits, sampling)
        log_p = log_probs(teacher_logits.detach(), sampling)
        if name == "fkl":
            per = _kl(log_p, log_q)
        elif name == "rkl":
            per = _kl(log_q, log_p)
        elif name == "tvd":
            per = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(dim=-1)
        else:
            check(0 < beta < 1, f"jsd beta must be in (0, 1), got {beta!r}")
            log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
            per = beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
    if mask is None:
        return per.mean()
    mask = mask.to(per.dtype)
    return (per * mask).sum() / mask.sum().clamp(min=1)
