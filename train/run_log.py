"""The logging of one run: `train.log`, and less noise.

`run_log(out)`: while the run's block runs, the `train.*` loggers print to stdout, and everything
logged at INFO (Lightning's messages, the progress lines of `train.callbacks.StepProgressBar`)
also goes to `<out>/train.log`, appended to by a resumed run. `quiet_tips()` drops Lightning's
advertising tips (litlogger, litmodels) from every run's output.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)


_TIPS = _DropTips()


def quiet_tips() -> None:
    """Drop Lightning's advertising tips ("Tip: ... try installing litlogger / litmodels")."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _TIPS not in logger.filters:
            logger.addFilter(_TIPS)


@contextmanager
def run_log(out: Path) -> Iterator[None]:
    """While the block runs: `train.*` INFO lines on stdout, and every INFO line in out/train.log."""
    file = logging.FileHandler(out / "train.log", encoding="utf-8")
    file.setFormatter(logging.Formatter(LOG_FORMAT))
    file.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter("%(message)s"))
    root, ours = logging.getLogger(), logging.getLogger("train")
    # Lightning keeps its messages to itself when the root logger had no handler at its import
    targets = [root] + [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")
                        if not logging.getLogger(n).propagate]
    levels = root.level, ours.level
    for target in targets:
        target.addHandler(file)
    ours.addHandler(console)
    if root.level > logging.INFO:
        root.setLevel(logging.INFO)
    ours.setLevel(logging.INFO)
    try:
        yield
    finally:
        for target in targets:
            target.removeHandler(file)
        ours.removeHandler(console)
        root.setLevel(levels[0])
        ours.setLevel(levels[1])
        file.close()
