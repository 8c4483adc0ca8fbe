"""What every task shares: the `Task` record, the base LightningModule, frozen models.

A task is one kind of training run (`task=prophet`, `task=draft_distill`, ...). Its file in
`train/tasks/` defines a `TASK = Task(...)`: the name users select (`conf/task/<name>.yaml`), the
typed config of its `task:` node, the DataModules it trains on, `validate(cfg) -> dict` (checks the
run's config in one-line `SpecdecError`s before anything is created, and returns the task's
keyword arguments of its LightningModule) and the LightningModule class. `train.tasks` finds the
tasks; `train.run` and `train.checkpoints` look them up by name and never special-case one.

`TaskModule` is the base LightningModule: the optimizer and its schedule over `trainable()`,
seeded generators per step, the task name in every checkpoint, `speculative_models()` for the
evaluation callback, per-epoch hooks for what a task tracks over a validation (`start_epoch`,
`end_epoch`), and the export (`write_export`: a specdec export of `export_model()` with
`export_options()`, unless a task writes another format; `check_export_dir`: may it replace what
an export directory holds). What only the prophet tasks share, their objective and simulated
acceptance, is `train.tasks.prophet_common.ProphetTaskModule`. It takes plain values only, so
`load_from_checkpoint` and `train.checkpoints` rebuild it without Hydra.

`FrozenModel` holds a model a task reads but never trains (a teacher, a frozen main model): loaded
on first use, checked against the identity recorded when the run was configured, in eval mode
with no gradient, and kept out of the module's state_dict, checkpoints, DDP and optimizer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from specdec_models import Decoder, ModelWithProphet, save_export
from specdec_models.config import from_dict
from specdec_models.decode import DraftModel, HeadDrafter
from specdec_models.errors import SpecdecError, check
from specdec_models.export import check_export_target, describe_export
from specdec_models.heads.hf_prophet import HFProphet

from ..optim import OptimConfig, configure_adam

LN2 = math.log(2.0)


def to_plain(node: Any) -> Any:
    """A Hydra node as plain Python values (resolved); plain values pass through."""
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def required(cfg: DictConfig, key: str, value: str) -> Any:
    """cfg's value at dotted `key`; a missing (`???`) or null value raises one line saying the
    task needs `key`=`value` (what to give, e.g. "DIR (an export of ...)")."""
    node, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, node) if node else cfg
    check(isinstance(parent, DictConfig) and leaf in parent and not OmegaConf.is_missing(parent, leaf)
          and parent[leaf] is not None, f"{key} is not set: task={cfg.task.name} needs {key}={value}")
    return parent[leaf]


def data_class(cfg: DictConfig) -> type:
    """The DataModule class `cfg.data._target_` names (imported, not instantiated)."""
    from hydra.utils import get_class

    target = cfg.data.get("_target_") if isinstance(cfg.get("data"), DictConfig) else None
    check(isinstance(target, str), "data is not set: choose a data config (data=enwik8, data=hf_text, ...)")
    try:
        return get_class(target)
    except Exception as error:  # noqa: BLE001  ImportError or Hydra's wrapper of it
        raise SpecdecError(f"data._target_ {target} cannot be imported: {' '.join(str(error).split())}") from None


def step_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (seed, step, micro-batch, rank)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


def warn_if_not_smaller(draft_params: int, target_params: int, draft: str = "student",
                        target: str = "teacher") -> None:
    """A draft only pays off when it is much cheaper than its target: warn when it is not smaller."""
    if draft_params >= target_params:
        warnings.warn(f"the {draft} ({draft_params:,} parameters) is not smaller than the {target} "
                      f"({target_params:,}): a draft only pays off when it is much cheaper than its target",
                      stacklevel=3)


@dataclass(frozen=True)
class SpeculativeModels:
    """What the evaluation callback decodes with: a target and exactly one drafter, a draft model
    or a prophet (see `specdec_models.decode.generate`)."""

    target: Any
    draft: Any = None
    prophet: Any = None

    def __post_init__(self) -> None:
        check((self.draft is None) != (self.prophet is None), "give exactly one of a draft and a prophet")

    def drafter(self) -> DraftModel | HeadDrafter:
        """The drafter `generate` decodes with: the draft model, or the prophet (any draft head)."""
        return DraftModel(self.draft) if self.draft is not None else HeadDrafter(self.prophet)


class FrozenModel:
    """A model the task reads but never trains (see the module docstring). `load()` returns it
    (called once, on first use); it is then frozen and moved to the module's device on access."""

    def __init__(self, load: Callable[[], nn.Module]) -> None:
        self._load = load
        self._model: nn.Module | None = None       # a plain attribute: no submodule, no state_dict entry

    def get(self, device: torch.device) -> nn.Module:
        if self._model is None:
            model = self._load()
            model.requires_grad_(False)
            self._model = model.eval()
        if next(self._model.parameters()).device != device:
            self._model.to(device)
        return self._model


class TaskModule(L.LightningModule):
    """The base LightningModule of every task (see the module docstring). A subclass calls
    `super().__init__(optim, seed, metadata, compile)` and then `self.save_hyperparameters()`, builds its
    networks, and provides `trainable()`, `speculative_models()` and `export_model()` (or
    `write_export()` for another format)."""

    task: ClassVar[str]

    def __init__(self, optim: dict[str, Any] | None, seed: int, metadata: dict[str, Any] | None,
                 compile: bool) -> None:
        super().__init__()
        self.optim_cfg = OptimConfig.from_dict(dict(optim or {}))
        self.seed = seed
        self.run_metadata = dict(metadata or {})
        self.compile_requested = compile          # the subclass compiles what is worth compiling

    def save_settings(self, settings: Any, optim: dict[str, Any] | None, seed: int,
                      metadata: dict[str, Any] | None, compile: bool) -> None:
        """Record a task's settings dataclass (`train.data.settings.read_settings`: every field, the
        defaults too) and the run's keys as the module's hyper-parameters, flat, as a signature of
        plain values records them: a checkpoint rebuilds the module from them (`load_from_checkpoint`,
        `train.checkpoints.load_module`), and `--set` replaces one by its name."""
        self.save_hyperparameters({**asdict(settings), "optim": optim, "seed": seed, "metadata": metadata,
                                   "compile": compile})

    # -- what a task provides --------------------------------------------------------------------

    def trainable(self) -> nn.Module:
        """The module whose parameters the optimizer updates (those with requires_grad)."""
        raise NotImplementedError

    def evaluate(self, batch: Any, prefix: str) -> None:
        """Log the validation ("val") or test ("test") metrics of one batch."""
        raise NotImplementedError

    def speculative_models(self) -> SpeculativeModels:
        raise NotImplementedError

    def export_model(self) -> Decoder | ModelWithProphet | HFProphet:
        """The model a specdec export of this run holds."""
        raise NotImplementedError

    def export_options(self) -> dict[str, Any]:
        """`save_export`'s keyword arguments that identify what the model reads and needs: the
        bytes tokenizer for specdec's own models (a Hugging Face head: its target's path)."""
        return {"tokenizer": "bytes"}

    def export_metadata(self) -> dict[str, Any]:
        """Task-specific values the export records next to the run's metadata."""
        return {}

    def check_export_dir(self, out_dir: Path, force: bool = False) -> str | None:
        """Refuse (one-line SpecdecError) an export directory this module's export must not write
        into: a folder that is not an export, an export of another model (`force` allows both).
        Returns a line naming the export it would replace, or None."""
        old = check_export_target(out_dir, self.export_model(), force=force, **self.export_options())
        return None if old is None else describe_export(old)

    def write_export(self, out_dir: Path, metadata: dict[str, Any], force: bool = False) -> Path:
        """Write this module's export into out_dir (atomically); `metadata`: plain JSON values."""
        return Path(save_export(out_dir, self.export_model().eval(), metadata=metadata, force=force,
                                **self.export_options()))

    # -- shared steps ----------------------------------------------------------------------------

    def generator(self, micro: int, device: torch.device | None = None) -> torch.Generator:
        """A generator seeded by (seed, optimizer step, micro-batch, rank): a resumed run draws the
        same numbers as an uninterrupted one."""
        g = torch.Generator(device=device or self.device)
        return g.manual_seed(step_seed(self.seed, self.global_step, micro, self.global_rank))

    def micro_batch(self, batch_idx: int) -> int:
        return batch_idx % self.trainer.accumulate_grad_batches

    def log_train(self, loss: torch.Tensor, parts: dict[str, Any]) -> None:
        self.log("train/loss", loss, prog_bar=True)
        self.log_dict({f"train/{k}": v for k, v in parts.items()})
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(batch, "test")

    def start_epoch(self, prefix: str) -> None:
        """A validation ("val") or test ("test") epoch starts: forget what a task tracks over one."""

    def end_epoch(self, prefix: str) -> None:
        """A validation or test epoch ends: log what the task tracked over it (all ranks')."""

    def on_validation_epoch_start(self) -> None:
        self.start_epoch("val")

    def on_validation_epoch_end(self) -> None:
        self.end_epoch("val")

    def on_test_epoch_start(self) -> None:
        self.start_epoch("test")

    def on_test_epoch_end(self) -> None:
        self.end_epoch("test")

    def configure_optimizers(self):
        return configure_adam(self.trainable(), self.optim_cfg, self.trainer.max_steps, self.time_fraction)

    def time_fraction(self) -> float | None:
        """The share of `trainer.max_time` spent training so far (Lightning's Timer, which a
        resumed run restores), or None without a time budget: the schedule anneals by it too."""
        from lightning.pytorch.callbacks import Timer

        if self._trainer is None:
            return None
        timer = next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)
        duration = getattr(timer, "_duration", None)
        if not duration:
            return None
        return timer.time_elapsed("train") / duration

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["specdec_task"] = self.task          # train.checkpoints rebuilds the right module

    def run_export_metadata(self) -> dict[str, Any]:
        """The run's metadata, the optimizer settings and the task's own export metadata."""
        return {**self.run_metadata, "optim": asdict(self.optim_cfg), **self.export_metadata()}


@dataclass(frozen=True)
class Task:
    """One kind of training run (see the module docstring).

    name: what `cfg.task.name` selects; config: the dataclass of the `task:` node (its fields
    besides `name`); data: the DataModule classes whose batches the module reads; validate:
    (cfg, typed task config) -> the task's own keyword arguments of `module` (`train.run` adds
    optim, seed, metadata and compile, which every task takes; a "metadata" entry it returns is
    added to the run's metadata, kept in checkpoints and exports); can_shard_target: whether the
    task runs a frozen target that `target.shard` may split across the processes
    (`train.tasks.sharding`; any other task refuses the key)."""

    name: str
    config: type
    module: type[TaskModule]
    data: tuple[type, ...]
    validate: Callable[[DictConfig, Any], dict[str, Any]]
    can_shard_target: bool = False

    def typed_config(self, cfg: DictConfig) -> Any:
        node = {k: v for k, v in to_plain(cfg.task).items() if k != "name"}
        return from_dict(self.config, node, "task")


@dataclass(frozen=True)
class NoOptions:
    """The `task:` node of a task without options of its own."""
