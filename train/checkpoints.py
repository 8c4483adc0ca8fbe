"""Training checkpoints: written atomically, checked before a resume, and
turned into exports (`export_checkpoint`: the one export writer of `train` and specdec export).

A Lightning checkpoint holds the module's hyper-parameters (plain values), its state_dict and the
task's name (`TaskModule.on_save_checkpoint`); `load_module` rebuilds the module from them through
the task registry, and `export_checkpoint` writes its export with the module's `write_export`.

- `AtomicCheckpointIO` (given to every Trainer by `train.run`) writes each .ckpt under a temp name
  in its own folder, fsyncs and renames it (`specdec_models.files`): a kill mid-save leaves the
  previous checkpoint whole, and the next save removes the temp. (Lightning's own writer goes
  through the system temp folder and `shutil.move`, a plain copy across file systems.)
- `train.callbacks.PeriodicCheckpoint` (the callback, conf/callbacks/default.yaml) writes
  `last.ckpt` by time and by steps between validations.
- `export_metadata_of`: what the run's callbacks offered its export (`SpecdecCallback.
  export_metadata`, kept in each checkpoint under `EXPORT_METADATA_KEY`); `export_checkpoint`
  copies it into the export's metadata.
- `read_checkpoint` and `check_resumable`: a `ckpt_path` that is not a readable checkpoint, is of
  another task or does not fit the configured model is a one-line error before anything is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from specdec_models.errors import SpecdecError, check
from specdec_models.export import read_export_config
from specdec_models.files import check_writable_dir, one_line, os_error, remove_stale_temps, write_file

from .tasks import TaskModule, get_task

RUN_KEYS = ("optim", "seed", "metadata", "compile")    # hyper-parameters a resumed run may change


def read_checkpoint(ckpt_path: str | Path) -> dict[str, Any]:
    """The contents of a specdec training checkpoint (no pickle), or a one-line SpecdecError."""
    ckpt_path = Path(ckpt_path)
    check(ckpt_path.is_file(), f"checkpoint {ckpt_path} does not exist")
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  pickle, zip or truncation errors: report the file, not the stack
        raise SpecdecError(f"cannot read checkpoint {ckpt_path} (truncated or not a checkpoint?): "
                           f"{one_line(error)}") from None
    check(isinstance(ckpt, dict) and isinstance(ckpt.get("hyper_parameters"), dict)
          and isinstance(ckpt.get("state_dict"), dict), f"{ckpt_path} is not a specdec training checkpoint")
    return ckpt


def load_module(ckpt_path: str | Path, paths: dict[str, str] | None = None) -> tuple[TaskModule, dict[str, Any]]:
    """(the module of a training checkpoint of any task, with its weights; the raw checkpoint).
    `paths`: text settings the checkpoint recorded, replaced (`replace_paths`)."""
    ckpt = read_checkpoint(ckpt_path)
    hparams = replace_paths(ckpt["hyper_parameters"], paths or {}, ckpt_path)
    module = get_task(ckpt.get("specdec_task", "prophet")).module(**hparams)
    module.load_state_dict(ckpt["state_dict"])
    return module, ckpt


def replace_paths(hparams: dict[str, Any], paths: dict[str, str], ckpt_path: str | Path) -> dict[str, Any]:
    """`hparams` with the text settings named in `paths` replaced: a checkpoint made on another
    machine records paths of that machine (a Hugging Face task's `target_path`), which the module
    opens. Only settings the checkpoint holds as text can be replaced; what the module checks (the
    target's weights hash) it still checks, so a path to another model is refused."""
    text = sorted(k for k, v in hparams.items() if isinstance(v, str))
    for key in paths:
        check(key in hparams, f"{ckpt_path} records no setting {key!r}; its text settings: {', '.join(text) or 'none'}")
        check(isinstance(hparams[key], str), f"{key!r} of {ckpt_path} is not a text setting (a path) but "
                                             f"{type(hparams[key]).__name__}: only text settings can be replaced")
    return {**hparams, **paths}


def check_resumable(module: TaskModule, ckpt: dict[str, Any], ckpt_path: str | Path) -> None:
    """One line unless the checkpoint is of `module`'s task and its tensors fit `module` (names
    and shapes); the message names the settings that differ (model sizes, ...)."""
    task = ckpt.get("specdec_task", "prophet")
    check(task == module.task, f"ckpt_path {ckpt_path} is a checkpoint of task={task}, this run is "
                               f"task={module.task}: resume with the experiment it was trained with")
    mine = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in ckpt["state_dict"].items() if isinstance(v, torch.Tensor)}
    if mine == theirs:
        return
    saved = {k: v for k, v in ckpt["hyper_parameters"].items() if k not in RUN_KEYS}
    configured = {k: v for k, v in dict(module.hparams).items() if k not in RUN_KEYS}
    changes = [f"{key} is {a!r} there, {b!r} here" for key, a, b in _differences(saved, configured)]
    if not changes:
        names = sorted(set(mine) ^ set(theirs)) or sorted(k for k in mine if mine[k] != theirs[k])
        changes = [f"tensor {names[0]} differs"]
    more = f" (+{len(changes) - 3} more)" if len(changes) > 3 else ""
    raise SpecdecError(f"ckpt_path {ckpt_path} does not fit the configured model: {'; '.join(changes[:3])}{more}: "
                       f"resume with the settings it was trained with")


def _differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, a's value, b's value) where nested dicts a and b differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in sorted(set(a) | set(b), key=str):
            found += _differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return found
    same = list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b
    return [] if same else [(prefix[:-1], a, b)]


EXPORT_METADATA_KEY = "specdec_export_metadata"


def export_metadata_of(ckpt: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint's callbacks offered its export (`train.callbacks.SpecdecCallback.
    export_metadata`: the last speculative evaluation's `speed_profiles`, ...); {} when none did."""
    return dict(ckpt.get(EXPORT_METADATA_KEY) or {})


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, metadata: dict[str, Any] | None = None, *,
                      force: bool = False, report: Callable[[str], Any] = print,
                      paths: dict[str, str] | None = None) -> Path:
    """Write the export of a training checkpoint of any task (see `TaskModule.write_export`) and
    return the directory. Refuses a folder that is not an export and an export of another model
    unless `force`; says with `report` what it replaced. `paths`: text settings of the checkpoint
    replaced before the module is built (`replace_paths`: a checkpoint made on another machine)."""
    out_dir = Path(out_dir)
    check_writable_dir(out_dir, "export directory")
    module, ckpt = load_module(ckpt_path, paths)
    replaced = module.check_export_dir(out_dir, force)
    old_weights = _weights_sha256(out_dir) if replaced else None
    meta = {**module.run_export_metadata(), "global_step": int(ckpt.get("global_step", 0)),
            "checkpoint": str(Path(ckpt_path).resolve()), **export_metadata_of(ckpt), **(metadata or {})}
    try:
        path = Path(module.write_export(out_dir, meta, force=force))
    except OSError as error:
        raise os_error(error, f"cannot write the export to {out_dir}") from None
    if replaced and old_weights is not None and old_weights == _weights_sha256(path):
        report(f"export: {path} unchanged: the export of step {meta['global_step']} has the same weights and "
               f"model config as {replaced}; caches and drafts made from it still match")
    elif replaced:
        report(f"export: replaced {replaced} in {path} with the export of step {meta['global_step']}; "
               f"caches and drafts made from the old one no longer match it")
    return path


def _weights_sha256(directory: Path) -> str | None:
    """The weights hash a specdec export's config.json records (it covers the model's config
    too, `specdec_models.export`); None for anything else (a Hugging Face export)."""
    try:
        return read_export_config(directory)["weights_sha256"]
    except SpecdecError:
        return None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, atomic in the checkpoint's own folder (module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None or "://" in str(path):      # remote storage: Lightning's own writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent, path.name)
        write_file(path, lambda f: torch.save(checkpoint, f))
