"""task=hf_draft_distill: a Hugging Face causal LM (the student, the draft) distilled from another
(the teacher, the target), e.g. Pythia 160M from Pythia 1.4B, Llama 3.2 1B from Llama 3.1 8B,
SmolLM2 135M from SmolLM2 1.7B.

The objective is `train.tasks.distillation`'s (DistillSpec, Zhou et al. 2023; on-policy data as in GKD,
Agarwal et al. 2024): the same `DistillConfig`, the same divergences from
`specdec_models.losses`, the same corpus / teacher / student data, here over token windows of
`train.data.hf_text.HFTextDataModule` (`data=hf_text`). Generated rows are sampled with `specdec_models.decode.generate`
through `specdec_models.hf.HFDecoder` (KV-cached, batched).

Both models come from local directories (`AutoModelForCausalLM.from_pretrained(path,
local_files_only=True)`), and must share one tokenizer: a different vocabulary or different
special tokens stop the run before training with a one-line error. Heads padded beyond the
tokenizer (Pythia: 50304 rows for 50277 tokens) are sliced to the tokenizer's size everywhere:
in the divergences (the padded rows get no gradient), in sampling and in the evaluation callback.

The teacher is loaded on first use, frozen (eval mode, no gradient) and held outside the module's
submodules (`base.FrozenModel`): absent from the state_dict, checkpoints and export. Its identity (config.json and the
names and sizes of its weight files; the weights are too large to hash on every start) is checked
when a run resumes. The export is the student alone, a Hugging Face model directory
(`specdec_models.export.hf_draft`: `save_pretrained` + the tokenizer, built in a temporary
directory that is then renamed into place), loadable by `AutoModelForCausalLM`, by transformers'
assisted generation (`target.generate(..., assistant_model=student)`) and by vLLM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from specdec_models.config import DTYPES, from_dict, torch_dtype
from specdec_models.decode.cost import stored_profile
from specdec_models.errors import check
from specdec_models.export import check_hf_draft_dir, sampling_temperature, save_hf_draft
from specdec_models.hf import (
    HFDecoder,
    check_same_tokenizer,
    head_rows,
    load_causal_lm,
    load_config,
    load_tokenizer,
    max_positions,
    model_dir,
    model_dir_fingerprint,
    parameter_count,
)

from ..data.hf_text import HFTextDataModule
from ..data.settings import read_settings
from .base import FrozenModel, NoOptions, SpeculativeModels, Task, to_plain, warn_if_not_smaller
from .distillation import DistillConfig, DistillModule


@dataclass(frozen=True)
class HFTeacher:
    """The `teacher:` node (conf/teacher/hf_model.yaml): a local model directory, frozen."""

    path: str | None = None
    dtype: str = "bfloat16"           # the teacher only runs forward passes

    def __post_init__(self) -> None:
        torch_dtype(self.dtype, "teacher.dtype")


@dataclass(frozen=True)
class HFStudent:
    """The `student:` node (conf/student/hf_model.yaml): the draft's starting weights."""

    path: str | None = None
    dtype: str = "float32"                     # the trained weights' dtype
    export_dtype: str | None = None            # None: the dtype in the student's config.json
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        torch_dtype(self.dtype, "student.dtype")
        check(self.export_dtype is None or self.export_dtype in DTYPES,
              f"student.export_dtype must be null (the student's own) or one of {', '.join(DTYPES)}, "
              f"got {self.export_dtype!r}")
        check(isinstance(self.gradient_checkpointing, bool),
              f"student.gradient_checkpointing must be true or false, got {self.gradient_checkpointing!r}")


def validate(cfg: DictConfig, options: NoOptions) -> dict[str, Any]:
    """Check both models, their tokenizers, the objective and the data settings (configs and
    tokenizers only: no weights are loaded). Warns when the student is not smaller."""
    teacher = from_dict(HFTeacher, to_plain(cfg.get("teacher")), "teacher")
    student = from_dict(HFStudent, to_plain(cfg.get("student")), "student")
    teacher_dir, student_dir = model_dir(teacher.path, "teacher"), model_dir(student.path, "student")
    objective = DistillConfig.from_dict(to_plain(cfg.objective))

    vocab = check_same_tokenizer(load_tokenizer(teacher_dir, "tokenizer"), load_tokenizer(student_dir, "tokenizer"),
                                 f"teacher {teacher_dir}", f"student {student_dir}")
    data_tokenizer = cfg.data.get("tokenizer")
    if data_tokenizer and Path(data_tokenizer).expanduser().resolve() != teacher_dir.resolve():
        check_same_tokenizer(load_tokenizer(teacher_dir, "tokenizer"), load_tokenizer(data_tokenizer, "tokenizer"),
                             f"teacher {teacher_dir}", f"data.tokenizer {data_tokenizer}")
    configs = {"teacher": load_config(teacher_dir, "teacher"), "student": load_config(student_dir, "student")}
    seq_len = cfg.data.seq_len
    for role, config in configs.items():
        check(not getattr(config, "is_encoder_decoder", False),
              f"the {role} is an encoder-decoder model; give a causal LM")
        rows = head_rows(config)
        check(rows >= vocab, f"the {role}'s head has {rows} rows, fewer than its tokenizer's {vocab} tokens")
        limit = max_positions(config)
        check(limit is None or seq_len <= limit, f"data.seq_len ({seq_len}) exceeds the {role}'s {limit} positions")
    objective.check_fits(seq_len, {role: max_positions(config) for role, config in configs.items()})
    warn_if_not_smaller(parameter_count(configs["student"]), parameter_count(configs["teacher"]))
    return dict(teacher_path=str(teacher_dir.resolve()), teacher_fingerprint=model_dir_fingerprint(teacher_dir),
                student_path=str(student_dir.resolve()), vocab_size=vocab, teacher_dtype=teacher.dtype,
                student_dtype=student.dtype, export_dtype=student.export_dtype,
                gradient_checkpointing=student.gradient_checkpointing, objective=asdict(objective))


@dataclass(frozen=True)
class HFDraftDistillSettings:
    """What `validate` gives HFDraftDistillModule, the hyper-parameters its checkpoints record:
    model directories and plain values (a checkpoint rebuilds the module without Hydra). The
    student starts from `student_path`'s weights; `teacher_fingerprint`: the identity the teacher
    directory must keep; `vocab_size`: the shared tokenizer's size, the logits every head is
    sliced to; `objective`: a DistillConfig dict."""

    teacher_path: str
    teacher_fingerprint: str
    student_path: str
    vocab_size: int
    teacher_dtype: str = "bfloat16"
    student_dtype: str = "float32"
    export_dtype: str | None = None
    gradient_checkpointing: bool = False
    objective: dict[str, Any] | None = None


class HFDraftDistillModule(DistillModule):
    task = "hf_draft_distill"

    def __init__(self, optim: dict[str, Any] | None = None, seed: int = 0, metadata: dict[str, Any] | None = None,
                 compile: bool = False, **settings: Any) -> None:
        """`settings`: the fields of `HFDraftDistillSettings`."""
        super().__init__(optim, seed, metadata, compile)
        s = read_settings(HFDraftDistillSettings, type(self), settings)
        self.save_settings(s, optim, seed, metadata, compile)
        objective, vocab_size, student_path, student_dtype = s.objective, s.vocab_size, s.student_path, s.student_dtype
        gradient_checkpointing = s.gradient_checkpointing
        self.objective = DistillConfig.from_dict(dict(objective or {}))
        self.vocab_size = vocab_size
        self.student = load_causal_lm(student_path, dtype=DTYPES[student_dtype]).train()   # from_pretrained gives eval
        if gradient_checkpointing:
            self.student.gradient_checkpointing_enable()
        self.student.config.use_cache = False            # training forwards keep no KV cache
        if compile:
            self.student.compile()
        self._teacher = FrozenModel(self._load_teacher)

    # -- the models ------------------------------------------------------------------------------

    def _load_teacher(self):
        path, expected = self.hparams.teacher_path, self.hparams.teacher_fingerprint
        check(Path(path).is_dir(), f"the teacher {path} is gone")
        found = model_dir_fingerprint(path)
        check(found == expected, f"the teacher {path} has changed since this run started (fingerprint "
                                 f"{found[:16]}, the run's teacher {expected[:16]})")
        return load_causal_lm(path, dtype=DTYPES[self.hparams.teacher_dtype])     # FrozenModel keeps it in eval mode

    @property
    def teacher(self):
        return self._teacher.get(self.device)

    def student_logits(self, inputs: Tensor) -> Tensor:
        return self.student(input_ids=inputs, use_cache=False).logits[..., : self.vocab_size]

    @torch.no_grad()
    def teacher_logits(self, inputs: Tensor) -> Tensor:
        return self.teacher(input_ids=inputs, use_cache=False).logits[..., : self.vocab_size]

    def drafters(self) -> SpeculativeModels:
        """Teacher and student as `generate` target and draft on the shared vocabulary."""
        return SpeculativeModels(target=HFDecoder(self.teacher, self.vocab_size),
                                 draft=HFDecoder(self.student, self.vocab_size))

    # -- evaluation, checkpoints and export ------------------------------------------------------

    def export_metadata(self) -> dict[str, Any]:
        return {"teacher_path": self.hparams.teacher_path, "teacher_fingerprint": self.hparams.teacher_fingerprint,
                "student_init": self.hparams.student_path, "vocab_size": self.vocab_size,
                "objective": asdict(self.objective)}

    def check_export_dir(self, out_dir: Path, force: bool = False) -> str | None:
        """An export directory must be new, empty, or hold a Hugging Face draft export
        (`specdec_models.export.check_hf_draft_dir`); `force` allows any folder."""
        return check_hf_draft_dir(out_dir, force)

    def write_export(self, out_dir: Path, metadata: dict[str, Any], force: bool = False) -> Path:
        """The student as a Hugging Face model directory with the tokenizer
        (`specdec_models.export.save_hf_draft`), in `export_dtype` or the student's own dtype; its
        `num_assistant_tokens` is the best gamma the last evaluation measured (`speed_profiles` of
        `metadata`) at batch 1 and the student's own generation temperature."""
        name = self.hparams.export_dtype
        dtype = (DTYPES[name] if name
                 else getattr(load_config(Path(self.hparams.student_path), "student"), "dtype", None))
        dtype = dtype if isinstance(dtype, torch.dtype) else DTYPES.get(str(dtype), torch.float32)
        profile = stored_profile(metadata, sampling_temperature(self.student.generation_config), 1)
        return save_hf_draft(out_dir, self.student, load_tokenizer(self.hparams.student_path, "tokenizer"), metadata,
                             dtype=dtype, num_assistant_tokens=None if profile is None else profile.best_gamma(),
                             force=force)


TASK = Task(name="hf_draft_distill", config=NoOptions, module=HFDraftDistillModule, data=(HFTextDataModule,),
            validate=validate)
