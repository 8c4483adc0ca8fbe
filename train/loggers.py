"""The run's loggers, and what a resumed run needs to continue them (so a resumed run keeps its history).

`train.callbacks.LoggerState` (attached to every run by `train.run`) flushes the loggers at every
checkpoint save, before the file is written, and records in the checkpoint where they stood
(`STATE_KEY`): the number of rows in the CSV file and the W&B run id. A run resumed from that
checkpoint then continues them (`resume_kwargs`):

- `CSVLogger` (Lightning's, continued): keeps the first rows the checkpoint counted, drops those a
  crashed run wrote after it (the resumed run logs those steps again) and appends to the same
  `metrics.csv`. Header rewrites and the resume's cut go through a temp file and a rename, so a
  crash never leaves half a file; a line cut short by a kill is dropped.
- `WandbLogger` (Lightning's): the same run id with `resume="allow"`, online or offline (offline
  runs land in several `offline-run-*` folders of one id). W&B keeps what it was sent: the steps
  between the checkpoint and a crash appear twice in its history (plotted against
  `trainer/global_step`). Its local run file is written every second (wandb's default of 15 s
  is history a kill loses), and it is built without the `anonymous` setting wandb warns about.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import csv_logs
from lightning.pytorch.loggers import wandb as wandb_logs
from lightning.pytorch.loggers.logger import rank_zero_experiment

from specdec_models.files import remove_stale_temps, write_file

STATE_KEY = "specdec_loggers"      # in every checkpoint: {"csv_rows": int, "wandb_id": str, "wandb_name": str}


class _ContinuedWriter(csv_logs.ExperimentWriter):
    """Lightning's CSV writer that counts the rows on disk and, when continuing, keeps the first
    `keep_rows` of an existing metrics.csv instead of deleting it."""

    def __init__(self, log_dir: str, continue_from: int | None) -> None:
        self.continue_from = continue_from
        self.rows = 0
        super().__init__(log_dir=log_dir)          # calls _check_log_dir_exists

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        remove_stale_temps(path.parent, path.name)
        if self.continue_from is None or not path.is_file():
            super()._check_log_dir_exists()      # a new run replaces an old file (Lightning warns)
            return
        text = path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):      # a line cut short by a kill
            text = text[: text.rfind("\n") + 1]
        reader = csv.DictReader(io.StringIO(text, newline=""))
        rows = list(reader)[: self.continue_from] if self.continue_from >= 0 else list(reader)
        self.metrics_keys = list(reader.fieldnames or [])
        self._write_all(self.metrics_keys, rows)
        self.rows = len(rows)

    def _write_all(self, fieldnames: list[str], rows: list[dict[str, Any]]) -> None:
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)
        write_file(Path(self.metrics_file_path), lambda f: f.write(text.getvalue().encode("utf-8")))

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        with open(self.metrics_file_path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        self._write_all(fieldnames, rows)

    def save(self) -> None:
        pending = len(self.metrics)
        super().save()
        self.rows += pending


class CSVLogger(csv_logs.CSVLogger):
    """Lightning's CSVLogger, continued by a resumed run: `continue_from=N` keeps the first N rows
    of the existing metrics.csv (-1: all of them) and appends after them; None starts a new file."""

    def __init__(self, *args: Any, continue_from: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.continue_from = continue_from

    @property
    @rank_zero_experiment
    def experiment(self) -> _ContinuedWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedWriter(self.log_dir, self.continue_from)
        return self._experiment


class WandbLogger(wandb_logs.WandbLogger):
    """Lightning's WandbLogger without the `anonymous` setting (wandb >= 0.19 warns that it has
    no effect, on every run), writing its local run file every `flush_seconds` (wandb's default,
    15 s, is what a kill loses)."""

    def __init__(self, *args: Any, flush_seconds: float = 1.0, **kwargs: Any) -> None:
        import wandb

        fields = getattr(wandb.Settings, "model_fields", {})
        if "settings" not in kwargs and "x_transaction_log_flush_interval" in fields:
            kwargs["settings"] = wandb.Settings(x_transaction_log_flush_interval=flush_seconds)
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)


def resume_kwargs(logger_class: type, state: dict[str, Any] | None) -> dict[str, Any]:
    """Keyword arguments that make a logger of `logger_class` continue the run a checkpoint
    recorded (`state`: the checkpoint's STATE_KEY entry; {} for a checkpoint that recorded none,
    None for a new run)."""
    if state is None:
        return {}
    if issubclass(logger_class, CSVLogger):
        return {"continue_from": state.get("csv_rows", -1)}
    if issubclass(logger_class, wandb_logs.WandbLogger) and state.get("wandb_id"):
        return {"id": state["wandb_id"], "resume": "allow", "name": state.get("wandb_name")}
    return {}
