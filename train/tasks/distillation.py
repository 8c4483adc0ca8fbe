"""What the two distillation tasks share: the objective (`conf/objective/`) and the training steps.

DistillSpec (Zhou et al. 2023) aligns a draft with its target for speculative decoding by two
choices, both configurable (`DistillConfig`, the `objective:` node):
- the divergence between teacher and student next-token distributions, computed under the
  temperature / top-k / top-p the draft will decode with (`specdec_models.losses.divergence`,
  the same filtering code as `specdec_models.decode`); `ce` is the undistilled baseline;
- the data: `corpus` windows, sequences sampled from the `teacher`, or sequences sampled from
  the current `student` and scored by the teacher (on-policy, as in GKD, Agarwal et al. 2024).
  `data_fraction` of each batch's rows are generated (from a corpus prefix of `prompt_len`
  tokens, `gen_len` new tokens, batched with a KV cache); the rest are corpus windows.

`DistillModule` runs the steps for task=draft_distill (specdec decoders) and task=hf_draft_distill
(Hugging Face models); a subclass provides the student, the frozen teacher and their logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from specdec_models import SamplingConfig
from specdec_models.config import from_dict
from specdec_models.decode import generate
from specdec_models.errors import check, check_positive_int
from specdec_models.losses import DIVERGENCES, divergence

from .base import LN2, SpeculativeModels, TaskModule

DATA_SOURCES = ("corpus", "teacher", "student")


@dataclass(frozen=True)
class DistillConfig:
    """What the student learns from (see the module docstring)."""

    divergence: str = "fkl"
    beta: float = 0.5                 # jsd only: the teacher's weight in the mixture m
    temperature: float = 1.0          # the decoding settings the draft is for (> 0)
    top_k: int | None = None
    top_p: float | None = None
    ce_weight: float = 0.0            # + ce_weight x next-token cross-entropy on the same rows
    data: str = "corpus"              # corpus | teacher | student (on-policy)
    data_fraction: float = 1.0        # share of each batch's rows generated from `data` (not corpus)
    prompt_len: int = 32              # generated rows: a corpus prefix of prompt_len tokens ...
    gen_len: int = 96                 # ... then gen_len sampled tokens
    sample_temperature: float = 1.0   # temperature the generated rows are sampled at

    def __post_init__(self) -> None:
        check(self.divergence in DIVERGENCES,
              f"objective.divergence must be one of {', '.join(DIVERGENCES)}, got {self.divergence!r}")
        check(0 < self.beta < 1, f"objective.beta must be in (0, 1), got {self.beta!r}")
        check(isinstance(self.temperature, (int, float)) and self.temperature > 0,
              f"objective.temperature must be > 0 (use 1 for a draft meant for greedy decoding), "
              f"got {self.temperature!r}")
        SamplingConfig(self.temperature, self.top_k, self.top_p)           # checks top_k and top_p
        check(isinstance(self.ce_weight, (int, float)) and self.ce_weight >= 0,
              f"objective.ce_weight must be >= 0, got {self.ce_weight!r}")
        check(self.data in DATA_SOURCES, f"objective.data must be one of {', '.join(DATA_SOURCES)}, got {self.data!r}")
        check(isinstance(self.data_fraction, (int, float)) and 0 <= self.data_fraction <= 1,
              f"objective.data_fraction must be in [0, 1], got {self.data_fraction!r}")
        for name in ("prompt_len", "gen_len"):
            check_positive_int(getattr(self, name), f"objective.{name}")
        check(self.sample_temperature >= 0,
              f"objective.sample_temperature must be >= 0, got {self.sample_temperature!r}")

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    @property
    def needs_teacher_logits(self) -> bool:
        return self.divergence != "ce"

    def generated_rows(self, batch: int) -> int:
        """How many of `batch` rows are generated (0 for corpus data)."""
        return 0 if self.data == "corpus" else round(self.data_fraction * batch)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DistillConfig":
        return from_dict(cls, data, "objective")

    def check_fits(self, seq_len: int, limits: dict[str, int | None]) -> None:
        """Generated rows fit the data and every model: `limits` maps a model's name to its
        number of positions (None: unbounded)."""
        if self.data == "corpus":
            return
        check(self.prompt_len <= seq_len, f"objective.prompt_len ({self.prompt_len}) exceeds data.seq_len "
                                          f"({seq_len}): prompts are prefixes of corpus windows")
        generated = self.prompt_len + self.gen_len
        for name, limit in limits.items():
            check(limit is None or generated <= limit,
                  f"objective.prompt_len + gen_len ({generated}) exceeds the {name}'s {limit} positions")


class DistillModule(TaskModule):
    """The training and validation steps of the distillation tasks. A subclass sets
    `self.objective` (a DistillConfig) and `self.student`, and provides the `teacher` (frozen, see
    `base.FrozenModel`), `student_logits(inputs)`, `teacher_logits(inputs)` and `drafters()`:
    teacher and student as `generate` target and draft."""

    objective: DistillConfig
    student: nn.Module

    @property
    def teacher(self) -> nn.Module:
        raise NotImplementedError

    def student_logits(self, inputs: Tensor) -> Tensor:
        raise NotImplementedError

    def teacher_logits(self, inputs: Tensor) -> Tensor:
        raise NotImplementedError

    def drafters(self) -> SpeculativeModels:
        """The teacher as target and the student as draft, as `generate` takes them."""
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        _ = self.teacher                       # load (and check) before the first step

    def trainable(self) -> nn.Module:
        return self.student

    def speculative_models(self) -> SpeculativeModels:
        return self.drafters()

    def sample_rows(self, prompts: Tensor, source: str, generator: torch.Generator) -> Tensor:
        """prompts (b, prompt_len) continued by gen_len tokens sampled from `source` (the teacher,
        or the student as it is now, in eval mode): (b, prompt_len + gen_len), batched with a KV
        cache."""
        models = self.drafters()
        model = models.target if source == "teacher" else models.draft
        training = self.student.training
        self.student.eval()
        try:
            new, _ = generate(model, prompts, self.objective.gen_len,
                              sampling=SamplingConfig(self.objective.sample_temperature), generator=generator)
        finally:
            self.student.train(training)
        return torch.cat([prompts, torch.stack(new).to(prompts.device)], 1).clone()   # not an inference tensor

    def _loss(self, seq: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """(loss, divergence, ce, student logits, teacher logits or None) of the student on
        `seq` (b, n + 1); the teacher runs only when the divergence needs it."""
        inputs, labels = seq[:, :-1], seq[:, 1:]
        logits = self.student_logits(inputs)
        obj = self.objective
        ce = divergence("ce", logits, labels=labels)
        if not obj.needs_teacher_logits:
            return ce, ce, ce, logits, None
        teacher = self.teacher_logits(inputs)
        div = divergence(obj.divergence, logits, teacher, sampling=obj.sampling, beta=obj.beta)
        return div + obj.ce_weight * ce, div, ce, logits, teacher

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        micro = self.micro_batch(batch_idx)
        obj = self.objective
        k = obj.generated_rows(batch.shape[0])
        parts = []
        if k:
            parts.append(self.sample_rows(batch[:k, :obj.prompt_len], obj.data, self.generator(micro)))
        if k < batch.shape[0]:
            parts.append(batch[k:])
        # token-weighted mean over the (differently long) generated and corpus rows
        tokens = sum(p[:, 1:].numel() for p in parts)
        loss = div = ce = 0.0
        for part in parts:
            weight = part[:, 1:].numel() / tokens
            part_loss, d, c, _, _ = self._loss(part)
            loss, div, ce = loss + weight * part_loss, div + weight * d, ce + weight * c
        self.log_train(loss, {"divergence": div, "ce": ce, "generated_rows": float(k)})
        return loss

    def evaluate(self, batch: Tensor, prefix: str) -> None:
        loss, div, ce, logits, teacher = self._loss(batch)
        if teacher is None:
            teacher = self.teacher_logits(batch[:, :-1])
        # 1 - TVD is the expected acceptance of one draft token at the objective's settings
        tvd = divergence("tvd", logits, teacher, sampling=self.objective.sampling)
        b = batch.shape[0]
        self.log_dict({f"{prefix}/loss": loss, f"{prefix}/divergence": div, f"{prefix}/ce": ce,
                       f"{prefix}/expected_acceptance": 1 - tvd}, sync_dist=True, batch_size=b)
        # the student's bits per token (per byte on byte-level data; the checkpoint callback monitors it)
        self.log(f"{prefix}/bpc", ce / LN2, prog_bar=True, sync_dist=True, batch_size=b)
