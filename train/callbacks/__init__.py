"""Every callback of a run, in one package, one module per family (conf/callbacks/default.yaml
names them by the re-exports here):

- `base`: `SpecdecCallback`, the base of callbacks that check the module before any work and add
  to the export (`check_module`, `export_metadata`);
- `evaluation`: `SpeculativeEval`, the speculative-decoding evaluation (what a draft buys,
  measured while it trains);
- `checkpoint`: `PeriodicCheckpoint`, `last.ckpt` by time and by steps between validations;
- `logger_state`: `LoggerState`, where the loggers stood, kept in every checkpoint so a resumed
  run continues them (attached to every run by `train.run`);
- `progress`: `StepProgressBar`, progress in optimizer steps with an ETA.

What these build on stays beside `train.run`: checkpoints read, written and exported in
`train.checkpoints`, the loggers in `train.loggers`, the run's log file in `train.run_log`.
"""

from .base import SpecdecCallback
from .checkpoint import PeriodicCheckpoint
from .evaluation import SAMPLES_FILE, SpeculativeEval, temperature_tag
from .logger_state import LoggerState
from .progress import StepProgressBar

__all__ = ["SAMPLES_FILE", "LoggerState", "PeriodicCheckpoint", "SpecdecCallback", "SpeculativeEval",
           "StepProgressBar", "temperature_tag"]
