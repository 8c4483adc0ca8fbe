"""What the prophet tasks share (task=prophet, prophet_frozen, hf_prophet): `ProphetTaskModule`.

A prophet head drafts from windows of the sequence (`specdec_models.heads.prophet.ProphetHead`, the
prophet idea of lucidrains/speculative-decoding). Its tasks share the seeded window subsets
(`window_generator`), the objective against a frozen model (`prophet_objective`: next-token
cross-entropy over the windows, optionally mixed with a divergence toward the frozen model's
logits, DistillSpec, Zhou et al. 2023) and the simulated acceptance logged at every validation
(`track_drafted`: teacher-forced top-1 accuracy per drafted position over the epoch, and the
tokens per call it implies, beside the evaluation callback's real ones). Other heads (hf_eagle3)
track their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specdec_models.heads.prophet import ProphetHead, drafted_hits, simulated_tokens_per_call
from specdec_models.losses import divergence, next_token_loss

from .base import TaskModule


class ProphetTaskModule(TaskModule):
    """A TaskModule whose head is a prophet (see the module docstring)."""

    def __init__(self, optim: dict[str, Any] | None, seed: int, metadata: dict[str, Any] | None,
                 compile: bool) -> None:
        super().__init__(optim, seed, metadata, compile)
        self._drafted: dict[str, tuple[torch.Tensor, int]] = {}      # prefix -> (hits (gamma,), windows)

    def window_generator(self, head: ProphetHead, device: torch.device,
                         micro: int | None) -> torch.Generator | None:
        """Seeded generator of a prophet's window subset (None when it trains on every window):
        per optimizer step and micro-batch in training, the same at every validation (micro
        None), so validations compare the same windows."""
        if head.prophet_cfg.windows_per_seq is None:
            return None
        if micro is None:
            return torch.Generator(device=device).manual_seed(self.seed)
        return self.generator(micro, device)

    def prophet_objective(self, head: ProphetHead, seq: torch.Tensor, hidden: torch.Tensor,
                          micro: int | None, teacher: Callable[[torch.Tensor], torch.Tensor],
                          prefix: str | None = None, valid_len: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of a prophet trained against a frozen model (task=prophet_frozen, hf_prophet):
        next-token cross-entropy over the head's windows (`ProphetHead.anchors`, drawn by
        `window_generator(micro)`) and, when `hparams.distill` names a divergence, that divergence toward
        `teacher(anchors)` (the frozen model's logits (b W, L, vocab) at the windows' positions),
        mixed by `hparams.distill_weight`. Returns (loss, {"prophet_loss", "distill_loss"}); with
        a `prefix` ("val", "test") the windows' drafted accuracy is tracked too. `valid_len` (b,):
        each row's real tokens (regenerated rows), whose windows are drawn before the padding's."""
        generator = self.window_generator(head, seq.device, micro)
        anchors = head.anchors(seq.shape[1] - 1, seq.shape[0], generator, seq.device, valid_len)
        logits, labels = head.prophet_logits(seq, hidden, anchors)                # (b W, L, vocab)
        ce = next_token_loss(logits, labels)
        if prefix is not None:
            self.track_drafted(prefix, logits, labels)
        distill = self.hparams.distill
        if distill is None:
            return ce, {"prophet_loss": ce}
        with torch.no_grad():
            target = teacher(anchors)
        div = divergence(distill, logits, target)
        w = self.hparams.distill_weight
        return (div if w == 1 else (1 - w) * ce + w * div), {"prophet_loss": ce, "distill_loss": div}

    # -- simulated acceptance --------------------------------------------------------------------

    def track_drafted(self, prefix: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add one batch's prophet windows (logits (W, L, vocab), labels (W, L)) to the epoch's
        teacher-forced hits at drafted positions 1..gamma (the run's gamma, at most L - 1)."""
        length = logits.shape[1]
        gamma = min(int(self.run_metadata.get("gamma", length - 1)), length - 1)
        hits = drafted_hits(logits.detach(), labels, gamma)
        old, count = self._drafted.get(prefix, (torch.zeros_like(hits), 0))
        self._drafted[prefix] = (old + hits, count + labels.shape[0])

    def log_drafted(self, prefix: str) -> None:
        """Log `{prefix}/teacher_forced_accuracy/pos{i}` (a_i) and `{prefix}/simulated_tokens_per_call`
        (1 + sum_k prod_{i<=k} a_i, `specdec_models.heads.prophet`) over the epoch's windows, all ranks'."""
        if prefix not in self._drafted:
            return
        hits, count = self._drafted.pop(prefix)
        totals = torch.cat([hits.double(), hits.new_tensor([count]).double()])
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum") if self._trainer is not None else totals
        accuracy = (totals[:-1] / totals[-1].clamp(min=1)).cpu()
        for i, a in enumerate(accuracy.tolist(), start=1):
            self.log(f"{prefix}/teacher_forced_accuracy/pos{i}", a)
        self.log(f"{prefix}/simulated_tokens_per_call", simulated_tokens_per_call(accuracy))

    def start_epoch(self, prefix: str) -> None:
        self._drafted.pop(prefix, None)

    def end_epoch(self, prefix: str) -> None:
        self.log_drafted(prefix)
