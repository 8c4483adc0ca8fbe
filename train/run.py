"""run(cfg): the training job, wired explicitly so tests call the same function users do.

Order: check the whole config (one-line `SpecdecError`s, before anything is created: the
run-level keys here, the task's own through its `Task.validate`), pick the output directory,
seed, load the data (so a missing or bad file stops the run before a model is built), build the
task's module, loggers, callbacks and trainer, fit, save `checkpoints/last.ckpt`, and export it
with `train.checkpoints.export_checkpoint`. Nothing here knows one task from another.
"""

from __future__ import annotations

import os
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from specdec_models.errors import check, check_positive_int

from .checkpoints import export_checkpoint
from .optim import OptimConfig
from .tasks import Task, get_task
from .tasks.base import data_class, to_plain

# Lightning 2.6 with torch 2.13 warns about torch's pytree LeafSpec on every fit: harmless noise.
warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
# ... and about modules in eval mode at the start of a fit: the frozen models some tasks hold, on purpose.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")


def metadata_of(cfg: DictConfig) -> dict[str, Any]:
    """What a run keeps in its checkpoint and export: run name, task, gamma, seq_len, tags."""
    return {"name": cfg.name, "task": cfg.task.name, "gamma": cfg.gamma, "seq_len": cfg.data.seq_len,
            "tags": list(cfg.tags)}


def validate_run(cfg: DictConfig) -> Task:
    """Check the run-level keys every task shares; return the run's task."""
    check(isinstance(cfg.get("task"), DictConfig), "task must be a config node: choose one with task=NAME")
    task = get_task(cfg.task.get("name"))
    check_positive_int(cfg.gamma, "gamma")
    check(isinstance(cfg.seed, int), f"seed must be an integer, got {cfg.seed!r}")
    check(isinstance(cfg.compile, bool), f"compile must be true or false, got {cfg.compile!r}")
    data = cfg.data
    cls = data_class(cfg)
    check(issubclass(cls, task.data), f"task={task.name} trains on {' or '.join(c.__name__ for c in task.data)} "
                                      f"batches, data._target_ is {cls.__name__}: choose a data config for this task")
    check_positive_int(data.seq_len, "data.seq_len")
    if data.get("path"):
        check(Path(data.path).expanduser().is_file(), f"data.path {data.path} does not exist or is not a file")
    trainer = cfg.trainer
    check_positive_int(trainer.max_steps, "trainer.max_steps")
    check_positive_int(trainer.accumulate_grad_batches, "trainer.accumulate_grad_batches")
    interval = trainer.val_check_interval
    check(isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1,
          f"trainer.val_check_interval must be a whole number of batches (training never ends an epoch), "
          f"got {interval!r}")
    check(interval % trainer.accumulate_grad_batches == 0,
          f"trainer.val_check_interval ({interval}) must be a multiple of trainer.accumulate_grad_batches "
          f"({trainer.accumulate_grad_batches}) so checkpoints fall on optimizer steps")
    check(trainer.get("gradient_clip_val") is None or trainer.gradient_clip_val > 0,
          f"trainer.gradient_clip_val must be > 0 or null, got {trainer.get('gradient_clip_val')!r}")
    if cfg.ckpt_path is not None:
        check(Path(cfg.ckpt_path).is_file(), f"ckpt_path {cfg.ckpt_path} does not exist")
    OptimConfig.from_dict(to_plain(cfg.optim))
    return task


def validate(cfg: DictConfig) -> dict[str, Any]:
    """Check the values a run depends on; raise SpecdecError with a one-line message. Returns
    the keyword arguments of the task's LightningModule."""
    task = validate_run(cfg)
    kwargs = task.validate(cfg, task.typed_config(cfg))
    metadata = {**metadata_of(cfg), **kwargs.pop("metadata", {})}
    return {**kwargs, "optim": to_plain(cfg.optim), "seed": cfg.seed, "metadata": metadata, "compile": cfg.compile}


def output_dir(cfg: DictConfig) -> Path:
    """cfg.output_dir; else, when resuming from <run>/checkpoints/*.ckpt, that run's directory (a
    resumed run continues the same run); else Hydra's run directory; else outputs/<date>/<time>."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    if cfg.ckpt_path and Path(cfg.ckpt_path).parent.name == "checkpoints":
        return Path(cfg.ckpt_path).parent.parent
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path("outputs") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


def _wandb_logged_in() -> bool:
    try:
        import wandb
        return bool(wandb.login(prompt=False, verify=False))
    except Exception:  # no key, unreadable settings: treat as logged out
        return False


def build_loggers(cfg: DictConfig, out: Path) -> list:
    loggers = []
    for key, node in (cfg.get("logger") or {}).items():
        if node is None:
            continue
        kwargs: dict[str, Any] = {}
        if node._target_.endswith("WandbLogger"):
            kwargs["name"] = node.get("name") or f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
            # WANDB_MODE (online / offline / disabled) wins; else online only with credentials
            if "WANDB_MODE" not in os.environ and not _wandb_logged_in():
                kwargs["mode"] = "offline"
                print(f"W&B: not logged in, logging offline; upload later with `wandb sync {out}/wandb/offline-run-*`")
        loggers.append(instantiate(node, **kwargs))
    return loggers


def build_callbacks(cfg: DictConfig) -> list:
    from lightning.pytorch.callbacks import ProgressBar

    callbacks = [instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node is not None]
    if not cfg.trainer.get("enable_progress_bar", True):   # the Trainer refuses a bar it was told not to show
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    return callbacks


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train, checkpoint and export. Returns output_dir, export_dir, last_ckpt, best_ckpt,
    global_step and metrics (the final logged values)."""
    kwargs = validate(cfg)
    task = get_task(cfg.task.name)
    out = output_dir(cfg).resolve()
    cfg.output_dir = str(out)                       # resolves ${output_dir} in trainer, loggers, callbacks
    print(f"output directory: {out}")
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml", resolve=True)
    L.seed_everything(cfg.seed, workers=True)

    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()                       # a missing or bad file stops here
    datamodule.setup("fit")

    module = task.module(**kwargs)
    loggers = build_loggers(cfg, out)
    callbacks = build_callbacks(cfg)
    trainer: L.Trainer = instantiate(cfg.trainer, logger=loggers or False, callbacks=callbacks)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    for logger in loggers:
        logger.log_hyperparams(resolved)

    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)

    # ModelCheckpoint writes last.ckpt after each validation; this one holds the final step.
    last = out / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(last, weights_only=False)
    export_dir = None
    if trainer.is_global_zero:
        export_dir = export_checkpoint(last, out / "export")
        print(f"export: {export_dir}")
        if any(type(logger).__name__ == "WandbLogger" for logger in loggers):
            import wandb
            wandb.finish()
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    return {
        "output_dir": out,
        "export_dir": export_dir,
        "last_ckpt": last,
        "best_ckpt": Path(best) if best else None,
        "global_step": trainer.global_step,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }

