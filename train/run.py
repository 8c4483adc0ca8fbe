"""run(cfg): the training job, wired explicitly so tests call the same function users do.

Order: check the whole config (one-line `SpecdecError`s: unknown top-level keys, the run-level
keys here, the task's own through its `Task.validate`), pick the output directory (checked
writable, not yet created, holding no earlier run and no other files unless this resumes it or
overwrite=true, and never holding or lying inside a path the run reads: `files.check_output`),
read the checkpoint to resume from, seed, load the data (a missing or bad file stops here), build
the task's module (checked against that checkpoint and against what `<output>/export` holds),
the callbacks (each `SpecdecCallback` checks the module, `train.callbacks`), the loggers
(continuing the checkpoint's CSV file and W&B run, `train.loggers`) and the trainer (atomic
checkpoint writes, `train.checkpoints`). Only then is the output directory created, with
config.yaml and train.log, so a run that fails any check leaves nothing
behind. Then fit, save `checkpoints/last.ckpt`, and export it with
`train.checkpoints.export_checkpoint`. Nothing here knows one task, or one callback, from another.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import get_class, instantiate
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from specdec_models.errors import SpecdecError, check, check_positive_int
from specdec_models.files import check_output, mark_dir, one_line, os_error, write_file

from .callbacks import LoggerState, SpecdecCallback
from .checkpoints import AtomicCheckpointIO, check_resumable, export_checkpoint, read_checkpoint
from .loggers import STATE_KEY, resume_kwargs
from .optim import OptimConfig
from .run_log import quiet_tips, run_log
from .tasks import Task, get_task
from .tasks.base import data_class, to_plain
from .tasks.sharding import check_task_can_shard

log = logging.getLogger("train.run")

# Lightning 2.6 with torch 2.13 warns about torch's pytree LeafSpec on every fit: harmless noise.
warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
# ... and about modules in eval mode at the start of a fit: the frozen models some tasks hold, on purpose.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")


def metadata_of(cfg: DictConfig) -> dict[str, Any]:
    """What a run keeps in its checkpoint and export: run name, task, gamma, seq_len, tags."""
    return {"name": cfg.name, "task": cfg.task.name, "gamma": cfg.gamma, "seq_len": cfg.data.seq_len,
            "tags": list(cfg.tags)}


CONF = Path(__file__).resolve().parent.parent / "conf"
GLOBAL_PACKAGE = "# @package _global_"


def compose(overrides: list[str]) -> DictConfig:
    """conf/train.yaml with `overrides` (Hydra's override syntax), composed as `python -m train`
    composes it (struct mode: an unknown key is an error): the config `run` takes, for tests,
    benchmarks (`train.bench`) and anything else that starts runs in-process. The one place
    that composes conf/ outside the `@hydra.main` shell."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides))


@functools.cache
def known_top_level_keys() -> frozenset[str]:
    """Every top-level key some part of conf/ defines: conf/train.yaml's own, each group's name
    (task, model, teacher, student, ...) and the top-level keys of the `# @package _global_`
    files (tasks, experiments). A `+key=...` outside these is read by nothing."""
    import yaml

    keys = {"hydra"}
    for path in CONF.rglob("*.yaml"):
        text = path.read_text(encoding="utf-8")
        if path.parent == CONF or GLOBAL_PACKAGE in text.split("\n", 3)[:3]:
            keys |= set(yaml.safe_load(text) or {}) - {"defaults"}
        else:
            keys.add(path.relative_to(CONF).parts[0])
    return frozenset(keys)


def validate_run(cfg: DictConfig) -> Task:
    """Check the run-level keys every task shares; return the run's task."""
    for key in sorted(set(cfg) - known_top_level_keys()):
        raise SpecdecError(f"unknown config key {key}: nothing reads it (no file in conf/ defines it); "
                           f"check its spelling or drop +{key}=...")
    check(isinstance(cfg.get("task"), DictConfig), "task must be a config node: choose one with task=NAME")
    task = get_task(cfg.task.get("name"))
    check_task_can_shard(cfg, task)
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
    check(isinstance(cfg.overwrite, bool), f"overwrite must be true or false, got {cfg.overwrite!r}")
    check(cfg.output_dir is None or (isinstance(cfg.output_dir, str) and cfg.output_dir.strip()),
          f"output_dir must be a folder or null (null: a new outputs/<date>/<time>), got {cfg.output_dir!r}")
    OptimConfig.from_dict(to_plain(cfg.optim))
    return task


def validate(cfg: DictConfig) -> dict[str, Any]:
    """Check the values a run depends on; raise SpecdecError with a one-line message. Returns
    the keyword arguments of the task's LightningModule."""
    task = validate_run(cfg)
    kwargs = task.validate(cfg, task.typed_config(cfg))
    metadata = {**metadata_of(cfg), **kwargs.pop("metadata", {})}
    return {**kwargs, "optim": to_plain(cfg.optim), "seed": cfg.seed, "metadata": metadata, "compile": cfg.compile}


def hydra_run_dir() -> Path | None:
    """`hydra.run.dir=X` on the command line (not conf/train.yaml's "."), in a single run; else None."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.RUN:
        return None
    run_dir = HydraConfig.get().run.dir
    return None if not run_dir or Path(run_dir) == Path(".") else Path(run_dir)


def checkpoint_run_dir(ckpt_path: str | os.PathLike) -> Path | None:
    """The run directory a checkpoint of <run>/checkpoints/ belongs to, else None."""
    path = Path(ckpt_path).resolve()
    return path.parent.parent if path.parent.name == "checkpoints" else None


def output_dir(cfg: DictConfig) -> Path:
    """cfg.output_dir (or `hydra.run.dir=X`, the same thing: giving both, different, is an
    error); else, when resuming from <run>/checkpoints/*.ckpt, that run's directory (a resumed
    run continues the same run); else, in a Hydra multirun, the job's directory; else a new
    outputs/<date>/<time>. Creates nothing."""
    run_dir = hydra_run_dir()
    if cfg.output_dir and run_dir is not None:
        check(Path(cfg.output_dir).resolve() == run_dir.resolve(),
              f"output_dir={cfg.output_dir} and hydra.run.dir={run_dir} differ: give the run's folder once, "
              f"as output_dir=DIR")
    if cfg.output_dir or run_dir is not None:
        return Path(cfg.output_dir or run_dir)
    if cfg.ckpt_path and checkpoint_run_dir(cfg.ckpt_path) is not None:
        return checkpoint_run_dir(cfg.ckpt_path)
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Path(HydraConfig.get().runtime.output_dir)
    base = Path("outputs") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    out, n = base, 0
    while out.exists():                  # two runs started in the same second get two directories
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


# what a run writes (speculative_samples.jsonl: train.callbacks.SAMPLES_FILE)
RUN_OUTPUTS = ("config.yaml", "train.log", "checkpoints", "csv", "export", "wandb", "speculative_samples.jsonl")
RUN_KIND = "training run"          # the folder kind run() marks its output directory with (`files.mark_dir`)
INPUT_KEYS = frozenset({"path", "export", "cache", "extra_caches", "files", "init_from", "draft_vocab", "tokenizer",
                        "ckpt_path"})  # config keys (at any depth) that name files a run reads


def run_inputs(resolved: dict[str, Any], resumed: bool) -> list[str]:
    """The existing paths a run reads, from its resolved config: every INPUT_KEYS value (a
    resumed run's own checkpoint aside: it lies in the folder the run continues)."""
    found: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value)
            elif key in INPUT_KEYS and not (key == "ckpt_path" and resumed):
                found.extend(v for v in (value if isinstance(value, list) else [value])
                             if isinstance(v, str) and v and Path(v).expanduser().exists())

    walk({k: v for k, v in resolved.items() if k != "hydra"})
    return found


def check_output_dir(cfg: DictConfig, out: Path, inputs: Sequence[str] = ()) -> list[Path]:
    """One line unless `out` may take this run's files (`files.check_output`, flag overwrite=true):
    never a folder that is, holds or lies inside one of the run's `inputs`; a resumed run writes
    into its checkpoint's own run folder only; any other run into a folder that is absent or
    empty, or holds no earlier run's files (RUN_OUTPUTS) and nothing else, unless overwrite=true
    (which removes the earlier run's files and keeps the others). Returns what overwrite=true
    replaces (removed once every check has passed), else []. Other ranks of a multi-process run
    skip this: rank 0 checked it and has written config.yaml by the time they start."""
    if rank_zero_only.rank != 0:
        return []
    earlier = [name for name in RUN_OUTPUTS if (out / name).exists()]
    own = checkpoint_run_dir(cfg.ckpt_path) if cfg.ckpt_path else None
    resumed = own is not None and own == out.resolve()
    check_output(out, "output directory", kind=RUN_KIND, force=True, inputs=inputs, flag="overwrite=true")
    if resumed:
        return []
    check(own is None or not earlier,
          f"ckpt_path {cfg.ckpt_path} belongs to the run in {own}, and output directory {out} holds another run "
          f"({', '.join(earlier)}): a resumed run writes into its checkpoint's own folder (leave output_dir out, "
          f"or give output_dir={own})")
    check(not earlier or cfg.overwrite,
          f"output directory {out} holds an earlier run ({', '.join(earlier)}): resume it with "
          f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}, choose a new output_dir, or replace it with overwrite=true")
    check_output(out, "output directory", kind=RUN_KIND, force=cfg.overwrite, flag="overwrite=true",
                 force_does="write beside them")
    return [out / name for name in earlier]


def remove_earlier_run(paths: list[Path]) -> None:
    """overwrite=true: remove the earlier run's files, so none of them mixes with this run's."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def build(node: DictConfig, key: str, **kwargs: Any) -> Any:
    """instantiate(node), with a config mistake (bad arguments or values, an unknown _target_) as a
    one-line SpecdecError naming `key` instead of Hydra's wrapped traceback."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__ or error
        while not isinstance(cause, SpecdecError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, SpecdecError):
            raise SpecdecError(str(cause)) from None
        if not isinstance(cause, (TypeError, ValueError, ImportError, AttributeError, InstantiationException,
                                  MisconfigurationException)):
            raise                        # not a config mistake: keep the traceback
        raise SpecdecError(f"{key} is not valid: {one_line(cause)}") from None


def _wandb_logged_in() -> bool:
    try:
        import wandb
        return bool(wandb.login(prompt=False, verify=False))
    except Exception:  # noqa: BLE001  no key, unreadable settings: treat as logged out
        return False


def build_loggers(cfg: DictConfig, out: Path, resume: dict[str, Any] | None = None) -> list:
    """The loggers of cfg.logger; `resume`: what the checkpoint of a resumed run recorded about
    them (`train.loggers`): they continue the same CSV file and W&B run."""
    loggers = []
    for key, node in (cfg.get("logger") or {}).items():
        if node is None:
            continue
        cls = get_class(node._target_)
        kwargs: dict[str, Any] = resume_kwargs(cls, resume)
        if issubclass(cls, WandbLogger):
            kwargs["name"] = kwargs.get("name") or node.get("name") or f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
            # WANDB_MODE (online / offline / disabled) wins; else online only with credentials
            if "WANDB_MODE" not in os.environ and not _wandb_logged_in():
                kwargs["mode"] = "offline"
                print(f"W&B: not logged in, logging offline; upload later with `wandb sync {out}/wandb/offline-run-*`")
        loggers.append(build(node, f"logger.{key}", **kwargs))
    return loggers


def build_callbacks(cfg: DictConfig) -> list:
    """The callbacks of cfg.callbacks, and `LoggerState` (resumable logs) on every run."""
    callbacks = [build(node, f"callbacks.{key}") for key, node in (cfg.get("callbacks") or {}).items()
                 if node is not None]
    if not cfg.trainer.get("enable_progress_bar", True):   # the Trainer refuses a bar it was told not to show
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    return callbacks + [LoggerState()]


def write_run_dir(out: Path, replaced: list[Path], config_text: str) -> None:
    """Make the run's folder `out`: remove what overwrite=true replaces of an earlier run
    (`replaced`, from `check_output_dir`), mark the folder as a run's and write its config.yaml."""
    try:
        if replaced:
            print(f"overwrite=true: removing the earlier run's {', '.join(p.name for p in replaced)} in {out}")
            remove_earlier_run(replaced)
        out.mkdir(parents=True, exist_ok=True)
        mark_dir(out, RUN_KIND)
        write_file(out / "config.yaml", lambda f: f.write(config_text.encode("utf-8")))
    except OSError as error:
        raise os_error(error, f"cannot write the output directory {out}") from None


def fit_and_export(cfg: DictConfig, trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule,
                   resolved: Any, out: Path) -> tuple[Path, Path | None]:
    """Fit (resuming from cfg.ckpt_path), save the final step's checkpoint and, on rank 0, write the
    export from it; all inside the run's log (`run_log`). Returns (last.ckpt, the export or None on
    other ranks). `resolved`: the config the loggers record."""
    with run_log(out):
        for logger in trainer.loggers:
            logger.log_hyperparams(resolved)
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)

        # ModelCheckpoint writes last.ckpt after each validation; this one holds the final step.
        last = out / "checkpoints" / "last.ckpt"
        trainer.save_checkpoint(last, weights_only=False)
        export_dir = None
        if trainer.is_global_zero:
            export_dir = export_checkpoint(last, out / "export", force=cfg.overwrite, report=log.info)
            log.info(f"export: {export_dir}")
            if any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
                import wandb
                wandb.finish()
    return last, export_dir


def run(cfg: DictConfig, callbacks: Sequence[L.Callback] = ()) -> dict[str, Any]:
    """Train, checkpoint and export. Returns output_dir, export_dir, last_ckpt, best_ckpt,
    global_step and metrics (the final logged values). `callbacks`: more callbacks, after the
    config's (a benchmark's probe into the fit, `train.bench.pipeline`).

    Everything that can be checked is checked before anything is created (one-line
    `SpecdecError`s): the config, the output folder, the checkpoint to resume from (readable, of
    this task, fitting the configured model), the data, the callbacks, loggers and trainer."""
    quiet_tips()
    kwargs = validate(cfg)
    task = get_task(cfg.task.name)
    chosen = not cfg.output_dir
    out = output_dir(cfg).resolve()
    cfg.output_dir = str(out)                       # resolves ${output_dir} in trainer, loggers, callbacks
    try:
        config_text = OmegaConf.to_yaml(cfg, resolve=True)
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as error:
        raise SpecdecError(f"the config does not resolve: {one_line(error)}") from None
    resumed = bool(cfg.ckpt_path) and checkpoint_run_dir(cfg.ckpt_path) == out
    replaced = check_output_dir(cfg, out, run_inputs(resolved, resumed))
    ckpt = read_checkpoint(cfg.ckpt_path) if cfg.ckpt_path else None
    L.seed_everything(cfg.seed, workers=True, verbose=False)   # said below, once every check has passed

    datamodule = build(cfg.data, "data")
    datamodule.prepare_data()                       # a missing or bad file stops here
    datamodule.setup("fit")

    module = task.module(**kwargs)
    resume = None
    if ckpt is not None:
        check_resumable(module, ckpt, cfg.ckpt_path)
        resume = ckpt.get(STATE_KEY, {})
        del ckpt                                    # Lightning reads it again in fit
    module.check_export_dir(out / "export", force=cfg.overwrite)
    callbacks = build_callbacks(cfg) + list(callbacks)
    for callback in callbacks:
        if isinstance(callback, SpecdecCallback):   # each checks the module now, before anything is created
            callback.check_module(module)
    loggers = build_loggers(cfg, out, resume)
    trainer: L.Trainer = build(cfg.trainer, "trainer", logger=loggers or False, callbacks=callbacks,
                               plugins=[AtomicCheckpointIO()])
    print(f"output directory: {out}")
    write_run_dir(out, replaced, config_text)
    if chosen and HydraConfig.initialized():
        # Lightning's DDP launcher starts the other ranks with this command line: same directory
        sys.argv.append(f'output_dir="{out}"')

    last, export_dir = fit_and_export(cfg, trainer, module, datamodule, resolved, out)
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    return {
        "output_dir": out,
        "export_dir": export_dir,
        "last_ckpt": last,
        "best_ckpt": Path(best) if best else None,
        "global_step": trainer.global_step,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
