"""task=hf_draft_distill: a Hugging Face causal LM (the student, the draft) distilled from another
(the teacher, the target), e.g. Pythia 160M from Pythia 1.4B, Llama 3.2 1B from Llama 3.1 8B,
SmolLM2 135M from SmolLM2 1.7B.

The objective is `train.distill`'s (DistillSpec, Zhou et al. 2023; on-policy data as in GKD,
Agarwal et al. 2024): the same `DistillConfig`, the same divergences from
`specdec_models.distill`, the same corpus / teacher / student data, here over token windows of
`train.hf_data.HFTextDataModule`. Generated rows are sampled with `specdec_models.decode.generate`
through `specdec_models.hf.HFDecoder` (KV-cached, batched).

Both models come from local directories (`AutoModelForCausalLM.from_pretrained(path,
local_files_only=True)`), and must share one tokenizer: a different vocabulary or different
special tokens stop the run before training with a one-line error. Heads padded beyond the
tokenizer (Pythia: 50304 rows for 50277 tokens) are sliced to the tokenizer's size everywhere:
in the divergences (the padded rows get no gradient), in sampling and in the evaluation callback.

The teacher is loaded in `setup()`, frozen (eval mode, no gradient) and held outside the module's
submodules: absent from the state_dict, checkpoints and export. Its identity (config.json and the
names and sizes of its weight files; the weights are too large to hash on every start) is checked
when a run resumes. The export is the student alone, written with `save_pretrained` (+ the
tokenizer) into a temporary directory that is then renamed into place, loadable by
`AutoModelForCausalLM`, by transformers' assisted generation (`target.generate(...,
assistant_model=student)`) and by vLLM.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from specdec_models.decode import generate
from specdec_models.errors import SpecdecError, check
from specdec_models.hf import HFDecoder

from .distill import DistillConfig, DistillSteps
from .hf_data import load_tokenizer, special_tokens
from .module import OptimConfig, metadata_of, to_plain

TASK = "hf_draft_distill"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPORT_METADATA = "specdec_distill.json"         # next to the student's files in the export


# -- models and tokenizers ---------------------------------------------------------------------

def model_dir(path: Any, role: str) -> Path:
    check(path, f"task={TASK} needs {role}.path=DIR (a local Hugging Face causal LM: save_pretrained or a "
                f"hub snapshot on disk)")
    directory = Path(str(path)).expanduser()
    check((directory / "config.json").is_file(), f"{role}.path {directory} is not a model directory (no config.json)")
    return directory


def dtype_of(name: Any, role: str) -> torch.dtype:
    check(name in DTYPES, f"{role}.dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_config(directory: Path, role: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:
        raise SpecdecError(f"cannot read the {role}'s config in {directory}: {str(error).splitlines()[0]}") from None


def load_causal_lm(directory: str | Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as error:
        raise SpecdecError(f"cannot load a causal LM from {directory}: {str(error).splitlines()[0]}") from None


def head_rows(config: Any) -> int:
    get = getattr(config, "get_text_config", None)
    return int((get() if callable(get) else config).vocab_size)


def max_positions(config: Any) -> int | None:
    get = getattr(config, "get_text_config", None)
    text = get() if callable(get) else config
    return next((getattr(text, k) for k in ("max_position_embeddings", "n_positions")
                 if isinstance(getattr(text, k, None), int)), None)


def check_same_tokenizer(teacher: Any, student: Any, teacher_dir: Path, student_dir: Path) -> int:
    """Raise a one-line SpecdecError unless the two tokenizers are the same; return their size."""
    where = f"(teacher {teacher_dir}, student {student_dir}): teacher and student must share one tokenizer"
    check(len(teacher) == len(student),
          f"the student's tokenizer has {len(student)} tokens, the teacher's {len(teacher)} {where}")
    tv, sv = teacher.get_vocab(), student.get_vocab()
    if tv != sv:
        differ = sorted(t for t in set(tv) | set(sv) if tv.get(t) != sv.get(t))
        raise SpecdecError(f"the tokenizers' vocabularies differ ({len(differ)} tokens, e.g. {differ[0]!r}: teacher id "
                           f"{tv.get(differ[0])}, student id {sv.get(differ[0])}) {where}")
    ts, ss = special_tokens(teacher), special_tokens(student)
    if ts != ss:
        name = next(k for k in [*ts, *ss] if ts.get(k) != ss.get(k))      # named tokens before the full list
        raise SpecdecError(f"the tokenizers' special tokens differ ({name}: teacher {ts.get(name)}, student "
                           f"{ss.get(name)}) {where}")
    return len(teacher)


def fingerprint(directory: str | Path) -> str:
    """A cheap identity of a model directory: config.json and the names and sizes of its weights."""
    directory = Path(directory)
    h = hashlib.sha256((directory / "config.json").read_bytes())
    for path in sorted(directory.iterdir()):
        if path.suffix in (".safetensors", ".bin", ".pt") or path.name.endswith(".index.json"):
            h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()


def parameter_count(config: Any) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):               # no weights are allocated
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


# -- the task ----------------------------------------------------------------------------------

def validate_task(cfg: DictConfig) -> dict[str, Any]:
    """task=hf_draft_distill: check both models, their tokenizers, the objective and the data
    settings (configs and tokenizers only: no weights are loaded); return HFDistillLitModule's
    keyword arguments. Warns when the student is not smaller than the teacher."""
    check(cfg.get("teacher") is not None and cfg.get("student") is not None,
          f"task={TASK} needs teacher and student nodes (experiment=hf_draft_distill)")
    teacher_dir, student_dir = model_dir(cfg.teacher.get("path"), "teacher"), model_dir(cfg.student.get("path"), "student")
    teacher_dtype, student_dtype = cfg.teacher.get("dtype", "bfloat16"), cfg.student.get("dtype", "float32")
    dtype_of(teacher_dtype, "teacher"), dtype_of(student_dtype, "student")
    export_dtype = cfg.student.get("export_dtype")
    check(export_dtype is None or export_dtype in DTYPES,
          f"student.export_dtype must be null (the student's own) or one of {', '.join(DTYPES)}, got {export_dtype!r}")
    checkpointing = cfg.student.get("gradient_checkpointing", False)
    check(isinstance(checkpointing, bool), f"student.gradient_checkpointing must be true or false, got {checkpointing!r}")
    objective = DistillConfig.from_dict(to_plain(cfg.objective))
    OptimConfig.from_dict(to_plain(cfg.optim))

    vocab = check_same_tokenizer(load_tokenizer(teacher_dir), load_tokenizer(student_dir), teacher_dir, student_dir)
    data_tokenizer = cfg.data.get("tokenizer")
    if data_tokenizer and Path(data_tokenizer).expanduser().resolve() != teacher_dir.resolve():
        check_same_tokenizer(load_tokenizer(teacher_dir), load_tokenizer(data_tokenizer), teacher_dir,
                             Path(data_tokenizer))
    configs = {"teacher": load_config(teacher_dir, "teacher"), "student": load_config(student_dir, "student")}
    seq_len = cfg.data.seq_len
    generated = objective.prompt_len + objective.gen_len if objective.data != "corpus" else 0
    if generated:
        check(objective.prompt_len <= seq_len, f"objective.prompt_len ({objective.prompt_len}) exceeds data.seq_len "
                                               f"({seq_len}): prompts are prefixes of corpus windows")
    for role, config in configs.items():
        check(not getattr(config, "is_encoder_decoder", False), f"the {role} is an encoder-decoder model; give a causal LM")
        rows = head_rows(config)
        check(rows >= vocab, f"the {role}'s head has {rows} rows, fewer than its tokenizer's {vocab} tokens")
        limit = max_positions(config)
        if limit is not None:
            check(seq_len <= limit, f"data.seq_len ({seq_len}) exceeds the {role}'s {limit} positions")
            check(generated <= limit, f"objective.prompt_len + gen_len ({generated}) exceeds the {role}'s {limit} positions")
    sizes = {role: parameter_count(config) for role, config in configs.items()}
    if sizes["student"] >= sizes["teacher"]:
        warnings.warn(f"the student ({sizes['student']:,} parameters) is not smaller than the teacher "
                      f"({sizes['teacher']:,}): a draft only pays off when it is much cheaper than its target",
                      stacklevel=2)
    return dict(teacher_path=str(teacher_dir.resolve()), teacher_hash=fingerprint(teacher_dir),
                student_path=str(student_dir.resolve()), vocab_size=vocab, teacher_dtype=teacher_dtype,
                student_dtype=student_dtype, export_dtype=export_dtype, gradient_checkpointing=checkpointing,
                objective=asdict(objective), optim=to_plain(cfg.optim), seed=cfg.seed, metadata=metadata_of(cfg),
                compile=cfg.compile)


class HFDistillLitModule(DistillSteps):
    task = TASK

    def __init__(self, teacher_path: str, teacher_hash: str, student_path: str, vocab_size: int,
                 teacher_dtype: str = "bfloat16", student_dtype: str = "float32", export_dtype: str | None = None,
                 gradient_checkpointing: bool = False, objective: dict[str, Any] | None = None,
                 optim: dict[str, Any] | None = None, seed: int = 0, metadata: dict[str, Any] | None = None,
                 compile: bool = False) -> None:
        """Model directories and plain values only (load_from_checkpoint needs no Hydra). The
        student starts from `student_path`'s weights; `vocab_size`: the shared tokenizer's size,
        the logits every head is sliced to."""
        super().__init__()
        self.save_hyperparameters()
        self.objective = DistillConfig.from_dict(dict(objective or {}))
        self.optim_cfg = OptimConfig.from_dict(dict(optim or {}))
        self.vocab_size = vocab_size
        self.student = load_causal_lm(student_path, DTYPES[student_dtype]).train()   # from_pretrained gives eval mode
        if gradient_checkpointing:
            self.student.gradient_checkpointing_enable()
        self.student.config.use_cache = False            # training forwards keep no KV cache
        if compile:
            self.student.compile()
        self._teacher: list[Any] = []                    # a list hides it from state_dict, DDP and the optimizer

    # -- the models ------------------------------------------------------------------------------

    @property
    def teacher(self):
        if not self._teacher:
            path, expected = self.hparams.teacher_path, self.hparams.teacher_hash
            check(Path(path).is_dir(), f"the teacher {path} is gone")
            found = fingerprint(path)
            check(found == expected, f"the teacher {path} has changed since this run started (fingerprint "
                                     f"{found[:16]}, the run's teacher {expected[:16]})")
            teacher = load_causal_lm(path, DTYPES[self.hparams.teacher_dtype])
            teacher.requires_grad_(False)
            self._teacher.append(teacher.eval())
        teacher = self._teacher[0]
        if teacher.get_input_embeddings().weight.device != self.device:
            teacher.to(self.device)
        return teacher

    def student_logits(self, inputs: Tensor) -> Tensor:
        return self.student(input_ids=inputs, use_cache=False).logits[..., : self.vocab_size]

    @torch.no_grad()
    def teacher_logits(self, inputs: Tensor) -> Tensor:
        return self.teacher(input_ids=inputs, use_cache=False).logits[..., : self.vocab_size]

    def decoders(self) -> dict[str, HFDecoder]:
        """Teacher and student as `generate` targets/drafts on the shared vocabulary."""
        return {"target": HFDecoder(self.teacher, self.vocab_size), "draft": HFDecoder(self.student, self.vocab_size)}

    # -- data ------------------------------------------------------------------------------------

    def sample_rows(self, prompts: Tensor, source: str, generator: torch.Generator) -> Tensor:
        """prompts (b, prompt_len) continued by gen_len tokens sampled from `source` (teacher or
        the student as it is now, in eval mode): (b, prompt_len + gen_len)."""
        decoders = self.decoders()
        model = decoders["target" if source == "teacher" else "draft"]
        training = self.student.training
        self.student.eval()
        try:
            new, _ = generate(model, prompts, self.objective.gen_len, temperature=self.objective.sample_temperature,
                              generator=generator)
        finally:
            self.student.train(training)
        return torch.cat([prompts, torch.stack(new).to(prompts.device)], 1).clone()   # not an inference tensor

    # -- evaluation, checkpoints and export ------------------------------------------------------

    def speculative_models(self) -> dict[str, HFDecoder]:
        return self.decoders()

    def export_metadata(self) -> dict[str, Any]:
        return {"teacher_path": self.hparams.teacher_path, "teacher_hash": self.hparams.teacher_hash,
                "student_init": self.hparams.student_path, "vocab_size": self.vocab_size,
                "objective": asdict(self.objective)}

    def write_export(self, out_dir: str | Path, metadata: dict[str, Any] | None = None) -> Path:
        """The student as a Hugging Face model directory (save_pretrained + the tokenizer +
        `specdec_distill.json`), written next to `out_dir` and renamed into place."""
        out_dir = Path(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_dir.with_name(f".tmp-{out_dir.name}-{uuid.uuid4().hex}")
        old = out_dir.with_name(f".old-{out_dir.name}-{uuid.uuid4().hex}")
        name = self.hparams.export_dtype
        dtype = DTYPES[name] if name else getattr(load_config(Path(self.hparams.student_path), "student"), "dtype", None)
        dtype = dtype if isinstance(dtype, torch.dtype) else DTYPES.get(str(dtype), torch.float32)
        try:
            state, cast = {}, {}
            for key, value in self.student.state_dict().items():
                ident = (value.data_ptr(), value.shape, value.dtype)          # tied weights stay one tensor
                if ident not in cast:
                    value = value.detach()
                    cast[ident] = value.to("cpu", dtype) if value.is_floating_point() else value.cpu()
                state[key] = cast[ident]
            config_dtype, use_cache = self.student.config.dtype, self.student.config.use_cache
            self.student.config.dtype, self.student.config.use_cache = dtype, True
            try:
                self.student.save_pretrained(tmp, state_dict=state)
            finally:
                self.student.config.dtype, self.student.config.use_cache = config_dtype, use_cache
            config = json.loads((tmp / "config.json").read_text())     # save_pretrained writes the module's dtype
            config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")   # torch_dtype: transformers 4
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            load_tokenizer(self.hparams.student_path).save_pretrained(tmp)
            meta = {**(self.hparams.metadata or {}), **self.export_metadata(), **(metadata or {})}
            (tmp / EXPORT_METADATA).write_text(json.dumps(meta, indent=1, default=str))
            if out_dir.exists():
                out_dir.rename(old)
            tmp.rename(out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
        return out_dir


LitModule = HFDistillLitModule
