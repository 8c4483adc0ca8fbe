"""The device a command runs on, `--device auto` included: one rule for every command line.

`auto_device("auto")` is "cuda" when torch sees a CUDA device and "cpu" otherwise; any other name
comes back as it was given, for the command's own checks (`specdec_models.cpu.resolve_device`, the
recipe's `check_inputs`). `pick_device` also says so on a line of its own (`device: cuda (auto)`),
so a run's log shows where it ran; a command that checks its inputs first resolves quietly with
`auto_device` and prints `auto_line` once they pass. Commands whose default is `auto` behave on a
machine without CUDA exactly as with `--device cpu`.
"""

from __future__ import annotations

import sys
from typing import TextIO

AUTO = "auto"
HELP = "auto: cuda when a CUDA device is here, else cpu (printed at the start)"


def auto_device(name: str) -> str:
    """`name`, or for "auto" "cuda" when `torch.cuda.is_available()` else "cpu"."""
    if str(name) != AUTO:
        return str(name)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def auto_line(device: object) -> str:
    """The line a command prints when --device auto chose `device`."""
    return f"device: {device} (auto)"


def pick_device(name: str, stream: TextIO | None = None) -> str:
    """`auto_device(name)`, and for "auto" the line `device: NAME (auto)` printed to `stream`
    (default: standard output)."""
    device = auto_device(name)
    if str(name) == AUTO:
        print(auto_line(device), file=stream or sys.stdout, flush=True)
    return device
