"""task=draft_distill: a small draft `Decoder` (the student) distilled from a frozen teacher.

`specdec train experiment=enwik8_draft_distill teacher.export=DIR`. The objective (divergence,
decoding settings, corpus / teacher / on-policy data) is `train.tasks.distillation`'s. The
teacher is loaded from an export (`teacher.export`: a decoder, or the main model of a
model_with_prophet export) on first use, frozen, and absent from the student's state_dict,
checkpoints and export (a resumed run reloads it and checks its weights hash). The evaluation
callback decodes with the teacher as target and the student as draft. The export is the student
alone, a `decoder` export for `specdec decode --export TEACHER --draft STUDENT`.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from specdec_models import Decoder, ModelConfig, ModelWithProphet
from specdec_models.errors import check
from specdec_models.export import export_hash, load_export, read_main_config

from ..data.enwik8 import Enwik8DataModule
from .base import FrozenModel, NoOptions, SpeculativeModels, Task, required, to_plain, warn_if_not_smaller
from .distillation import DistillConfig, DistillModule

HOW_TO_EXPORT = "DIR (an export written by specdec train or specdec export)"


def teacher_config(directory: str | Path) -> ModelConfig:
    """The teacher's decoder config from its export (the main model of a prophet export)."""
    return read_main_config(directory)[0]


def load_teacher(directory: str | Path, weights_sha256: str | None = None) -> Decoder:
    """The teacher decoder of an export, after checking its weights are the run's."""
    if weights_sha256 is not None:
        found = export_hash(directory)
        check(found == weights_sha256, f"teacher export {directory} has changed since this run started "
                                       f"(weights {found[:16]}, the run's teacher {weights_sha256[:16]})")
    model = load_export(directory)
    return model.model if isinstance(model, ModelWithProphet) else model


def parameter_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):                 # counts without allocating weights
        return sum(p.numel() for p in Decoder(cfg).parameters())


def validate(cfg: DictConfig, options: NoOptions) -> dict[str, Any]:
    """Check teacher, student, objective and data. Warns when the student is not smaller."""
    teacher_dir = Path(str(required(cfg, "teacher.export", HOW_TO_EXPORT))).expanduser()
    teacher = teacher_config(teacher_dir)
    student = ModelConfig.from_dict(to_plain(cfg.student))
    objective = DistillConfig.from_dict(to_plain(cfg.objective))
    check(student.vocab_size == teacher.vocab_size,
          f"student vocabulary ({student.vocab_size}) differs from the teacher's ({teacher.vocab_size}) "
          f"in {teacher_dir}")
    check(teacher.vocab_size == 256, f"byte-level data needs vocab_size 256, got the teacher's {teacher.vocab_size}")
    seq_len = cfg.data.seq_len
    for name, model in (("student", student), ("teacher", teacher)):
        check(seq_len <= model.max_seq_len, f"data.seq_len ({seq_len}) exceeds the {name}'s max_seq_len "
                                            f"({model.max_seq_len})")
    objective.check_fits(seq_len, {"student": student.max_seq_len, "teacher": teacher.max_seq_len})
    warn_if_not_smaller(parameter_count(student), parameter_count(teacher))
    return dict(student=student.to_dict(), teacher_export=str(teacher_dir.resolve()),
                weights_sha256=export_hash(teacher_dir), objective=asdict(objective))


class DraftDistillModule(DistillModule):
    task = "draft_distill"

    def __init__(self, student: dict[str, Any], teacher_export: str, weights_sha256: str,
                 objective: dict[str, Any] | None = None, optim: dict[str, Any] | None = None, seed: int = 0,
                 metadata: dict[str, Any] | None = None, compile: bool = False) -> None:
        """`student`: a ModelConfig dict; `teacher_export`, `weights_sha256`: the frozen teacher
        and the hash its weights must have (loaded on first use, checked against it); `objective`: a
        DistillConfig dict."""
        super().__init__(optim, seed, metadata, compile)
        self.save_hyperparameters()
        self.objective = DistillConfig.from_dict(dict(objective or {}))
        self.student = Decoder(ModelConfig.from_dict(student))
        if compile:
            self.student.compile()
        self._teacher = FrozenModel(lambda: load_teacher(teacher_export, weights_sha256))

    @property
    def teacher(self) -> Decoder:
        return self._teacher.get(self.device)

    def student_logits(self, inputs: Tensor) -> Tensor:
        return self.student(inputs).logits

    @torch.no_grad()
    def teacher_logits(self, inputs: Tensor) -> Tensor:
        return self.teacher(inputs).logits

    def drafters(self) -> SpeculativeModels:
        return SpeculativeModels(target=self.teacher, draft=self.student)

    def export_model(self) -> Decoder:
        return self.student

    def export_metadata(self) -> dict[str, Any]:
        return {"teacher_export": self.hparams.teacher_export, "teacher_weights_sha256": self.hparams.weights_sha256,
                "objective": asdict(self.objective)}


TASK = Task(name="draft_distill", config=NoOptions, module=DraftDistillModule, data=(Enwik8DataModule,),
            validate=validate)
