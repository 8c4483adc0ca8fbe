"""task=draft_distill: a small draft `Decoder` (the student) distilled from a frozen teacher.

DistillSpec (Zhou et al. 2023) aligns a draft with its target for speculative decoding by two
choices, both configurable here (`objective`, see `DistillConfig`):
- the divergence between teacher and student next-token distributions, computed under the
  temperature / top-k / top-p the draft will decode with (`specdec_models.distill.divergence`,
  the same filtering code as `specdec_models.decode`); `ce` is the undistilled baseline;
- the data: `corpus` windows, sequences sampled from the `teacher`, or sequences sampled from
  the current `student` and scored by the teacher (on-policy, as in GKD, Agarwal et al. 2024).
  `data_fraction` of each batch's rows are generated (from a corpus prefix of `prompt_len`
  tokens, `gen_len` new tokens, batched with a KV cache); the rest are corpus windows.

The teacher is loaded from an export (`teacher.export`) in `setup()`, kept in eval mode with no
gradient, and is not a submodule: it is absent from the student's state_dict, checkpoints and
export (a resumed run reloads it and checks its hash). The evaluation callback decodes with the
teacher as target and the student as draft. The export is the student alone, a `decoder` export
for `python -m specdec_models.decode --export TEACHER --draft STUDENT --method draft`.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig
from torch import Tensor

from specdec_models import Decoder, ModelConfig, ModelWithProphet, SamplingConfig
from specdec_models.decode import generate
from specdec_models.losses import DIVERGENCES, divergence
from specdec_models.errors import check
from specdec_models.export import export_hash, load_export, read_export_config

from .module import LN2, OptimConfig, configure_adam, dataclass_from_dict, metadata_of, step_seed, to_plain

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
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"objective.{name} must be a positive integer, got {value!r}")
        check(self.sample_temperature >= 0, f"objective.sample_temperature must be >= 0, got {self.sample_temperature!r}")

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
        return dataclass_from_dict(cls, data, "objective")


def teacher_config(directory: str | Path) -> ModelConfig:
    """The teacher's decoder config from its export (the main model of a prophet export)."""
    config = read_export_config(directory)
    return ModelConfig.from_dict(config["main"])


def load_teacher(directory: str | Path, expected_hash: str | None = None) -> Decoder:
    """The teacher decoder of an export, frozen (eval mode, no gradient)."""
    if expected_hash is not None:
        found = export_hash(directory)
        check(found == expected_hash, f"teacher export {directory} has changed since this run started "
                                      f"(weights {found[:16]}, the run's teacher {expected_hash[:16]})")
    model = load_export(directory)
    teacher = model.model if isinstance(model, ModelWithProphet) else model
    teacher.requires_grad_(False)
    return teacher.eval()


def validate_task(cfg: DictConfig) -> dict[str, Any]:
    """task=draft_distill: check teacher, student, objective and data; return DistillLitModule's
    keyword arguments. Warns when the student is not smaller than the teacher."""
    check(cfg.get("teacher") is not None and cfg.teacher.get("export"),
          "task=draft_distill needs teacher.export=DIR (an export written by python -m train or scripts/export.py)")
    teacher_dir = Path(cfg.teacher.export).expanduser()
    teacher = teacher_config(teacher_dir)
    student = ModelConfig.from_dict(to_plain(cfg.student))
    objective = DistillConfig.from_dict(to_plain(cfg.objective))
    OptimConfig.from_dict(to_plain(cfg.optim))
    check(student.vocab_size == teacher.vocab_size,
          f"student vocabulary ({student.vocab_size}) differs from the teacher's ({teacher.vocab_size}) "
          f"in {teacher_dir}")
    check(teacher.vocab_size == 256, f"byte-level data needs vocab_size 256, got the teacher's {teacher.vocab_size}")
    seq_len = cfg.data.seq_len
    for name, model in (("student", student), ("teacher", teacher)):
        check(seq_len <= model.max_seq_len, f"data.seq_len ({seq_len}) exceeds the {name}'s max_seq_len "
                                            f"({model.max_seq_len})")
    if objective.data != "corpus":
        check(objective.prompt_len <= seq_len, f"objective.prompt_len ({objective.prompt_len}) exceeds data.seq_len "
                                               f"({seq_len}): prompts are prefixes of corpus windows")
        generated = objective.prompt_len + objective.gen_len
        for name, model in (("student", student), ("teacher", teacher)):
            check(generated <= model.max_seq_len,
                  f"objective.prompt_len + gen_len ({generated}) exceeds the {name}'s max_seq_len ({model.max_seq_len})")
    with torch.device("meta"):                 # parameter counts without allocating weights
        sizes = {name: sum(p.numel() for p in Decoder(c).parameters()) for name, c in
                 (("student", student), ("teacher", teacher))}
    if sizes["student"] >= sizes["teacher"]:
        message = (f"the student ({sizes['student']:,} parameters) is not smaller than the teacher "
                   f"({sizes['teacher']:,}): a draft only pays off when it is much cheaper than its target")
        warnings.warn(message, stacklevel=2)
    return dict(student=student.to_dict(), teacher_export=str(teacher_dir.resolve()),
                teacher_hash=export_hash(teacher_dir), objective=asdict(objective), optim=to_plain(cfg.optim),
                seed=cfg.seed, metadata=metadata_of(cfg), compile=cfg.compile)


class DistillSteps(L.LightningModule):
    """The training, validation and optimizer steps shared by the distillation tasks (native
    decoders here, Hugging Face models in train.hf_distill). A subclass provides `student`,
    `objective`, `optim_cfg`, `task`, a `teacher` property, `student_logits(inputs)`,
    `teacher_logits(inputs)` and `sample_rows(prompts, source, generator)`."""

    def setup(self, stage: str) -> None:
        self.teacher                           # load (and check) before the first step

    def generator(self, micro: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        return g.manual_seed(step_seed(self.hparams.seed, self.global_step, micro, self.global_rank))

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
        micro = batch_idx % self.trainer.accumulate_grad_batches
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
            l, d, c, _, _ = self._loss(part)
            loss, div, ce = loss + weight * l, div + weight * d, ce + weight * c
        self.log("train/loss", loss, prog_bar=True)
        self.log_dict({"train/divergence": div, "train/ce": ce, "train/generated_rows": float(k)})
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def _evaluate(self, batch: Tensor, prefix: str) -> None:
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

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        return configure_adam(self.student, self.optim_cfg, self.trainer.max_steps)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["specdec_task"] = self.task


class DistillLitModule(DistillSteps):
    task = "draft_distill"

    def __init__(self, student: dict[str, Any], teacher_export: str, teacher_hash: str,
                 objective: dict[str, Any] | None = None, optim: dict[str, Any] | None = None, seed: int = 0,
                 metadata: dict[str, Any] | None = None, compile: bool = False) -> None:
        """`student`: a ModelConfig dict; `teacher_export`, `teacher_hash`: the frozen teacher
        (loaded in `setup`, checked against the hash); `objective`: a DistillConfig dict."""
        super().__init__()
        self.save_hyperparameters()
        self.objective = DistillConfig.from_dict(dict(objective or {}))
        self.optim_cfg = OptimConfig.from_dict(dict(optim or {}))
        self.student = Decoder(ModelConfig.from_dict(dict(student)))
        if compile:
            self.student.compile()
        self._teacher: list[Decoder] = []       # a list hides it from state_dict, DDP and the optimizer

    # -- the teacher -----------------------------------------------------------------------------

    @property
    def teacher(self) -> Decoder:
        if not self._teacher:
            self._teacher.append(load_teacher(self.hparams.teacher_export, self.hparams.teacher_hash))
        teacher = self._teacher[0]
        if teacher.to_logits.weight.device != self.device:
            teacher.to(self.device)
        return teacher

    def student_logits(self, inputs: Tensor) -> Tensor:
        return self.student(inputs).logits

    @torch.no_grad()
    def teacher_logits(self, inputs: Tensor) -> Tensor:
        return self.teacher(inputs).logits

    # -- data ------------------------------------------------------------------------------------

    def sample_rows(self, prompts: Tensor, source: str, generator: torch.Generator) -> Tensor:
        """prompts (b, prompt_len) continued by gen_len tokens sampled from `source` (teacher or
        student, as it is now): (b, prompt_len + gen_len), batched with a KV cache."""
        model = self.teacher if source == "teacher" else self.student
        obj = self.objective
        new, _ = generate(model, prompts, obj.gen_len, temperature=obj.sample_temperature, generator=generator)
        return torch.cat([prompts, torch.stack(new)], 1).clone()        # a normal tensor, not an inference one

    # -- evaluation, checkpoints and export ------------------------------------------------------

    def speculative_models(self) -> dict[str, torch.nn.Module]:
        return {"target": self.teacher, "draft": self.student}

    def export_model(self) -> torch.nn.Module:
        return self.student

    def export_metadata(self) -> dict[str, Any]:
        return {"teacher_export": self.hparams.teacher_export, "teacher_hash": self.hparams.teacher_hash,
                "objective": asdict(self.objective)}


LitModule = DistillLitModule
