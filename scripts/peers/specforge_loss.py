"""SpecForge's EAGLE-3 loss in plain torch, to stand in for its Triton module on a CPU.

SpecForge 0.2.0 computes the draft's loss (Li et al. 2025, "EAGLE-3": the cross-entropy of the
draft against the target's distribution renormalised over the draft vocabulary, at each TTT step)
in `specforge.core.loss`, a Triton kernel pair (`LogSoftmaxLoss`) that imports `triton` at module
level, which a CPU install lacks. `run_specforge.py` (beside it) puts this module in `sys.modules`
under that name before SpecForge imports it. Same maths, read from the kernels:

    loss = (1 / (B T)) * sum_{b,t} m[b,t] * -sum_v p[b,t,v] * log_softmax(z[b,t])_v

z (B, T, V) the draft logits (computed in fp32), p (B, T, V) the target distribution, m (B, T, 1)
the position mask; a masked position contributes 0 to the loss and its gradient (the kernels skip
its row), and the mean runs over all B T positions, masked ones included. The kernels' backward is
the exact gradient of that forward, so autograd's is the same.
"""

from __future__ import annotations

import torch
from torch import Tensor


def soft_cross_entropy(logits: Tensor, target_p: Tensor, position_mask: Tensor) -> Tensor:
    """The loss above: `logits` and `target_p` (B, T, V), `position_mask` (B, T) or (B, T, 1)."""
    B, T, _ = logits.shape
    keep = position_mask.reshape(B, T).bool()
    # a skipped row is zeroed before the softmax (where, not a product), so its logits, finite or
    # not, reach neither the loss nor the gradient, as in the kernels
    z = torch.where(keep[..., None], logits.float(), 0.0)                  # (B, T, V)
    per_position = -(target_p.float() * torch.log_softmax(z, dim=-1)).sum(-1)   # (B, T)
    return torch.where(keep, per_position, 0.0).mean()


class LogSoftmaxLoss:
    """The name SpecForge calls (`LogSoftmaxLoss.apply(logits, target_p, position_mask)`)."""

    @staticmethod
    def apply(logits: Tensor, target: Tensor, position_mask: Tensor) -> Tensor:
        return soft_cross_entropy(logits, target, position_mask)


def _compute_loss(logits: Tensor, target_p: Tensor, position_mask: Tensor) -> Tensor:
    """SpecForge's reference implementation, by its name (its benchmark imports it)."""
    return soft_cross_entropy(logits, target_p, position_mask)


__all__ = ["LogSoftmaxLoss", "soft_cross_entropy"]
