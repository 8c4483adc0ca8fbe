"""What the runners of the peer trainers share: the peer trainers are the EAGLE-3 trainers of vLLM's
`speculators` and of SpecForge, run live on this CPU.

Each runner (scripts/peers/run_speculators.py, scripts/peers/run_specforge.py) runs in the
environment where its package is installed (`make setup-interop`: .venv-interop), one process per
peer trainer, started by `specdec peers` as `python scripts/peers/run_<trainer>.py`; it
imports this module by its file name (its folder is first on sys.path). They live outside the
installed `train` package: their packages pin other versions than specdec's environment. Each
applies its peer's runtime patches (no file of the package is edited), trains from the data
`train.data.peer_formats` wrote, stops cleanly at a wall-time budget or a step limit (`Budget`),
keeps the saved head where specdec loads it (`specdec_models.export.eagle3.load_eagle3`) and
writes a JSON report with the trainer's training throughput.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


class Budget:
    """When a peer's training stops: `minutes` of training wall time (from its first batch) or
    `max_steps` optimizer steps, whichever comes first; None leaves either out. Counts the steps,
    the tokens and the answer tokens trained on, and the seconds spent training."""

    def __init__(self, minutes: float | None, max_steps: int | None) -> None:
        self.limit = None if minutes is None else 60.0 * minutes
        self.max_steps = max_steps
        self.steps = self.tokens = self.answer_tokens = 0
        self.seconds = 0.0
        self.started: float | None = None
        self.reason = "finished"

    def start(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def spent(self) -> bool:
        """After a step: is the budget spent? (records why)"""
        if self.max_steps is not None and self.steps >= self.max_steps:
            self.reason = "max_steps"
            return True
        if self.limit is not None and self.started is not None and time.perf_counter() - self.started >= self.limit:
            self.reason = "minutes"
            return True
        return False

    def report(self, peer: str, threads: int, **extra: Any) -> dict[str, Any]:
        def per_s(n: int) -> float | None:
            return round(n / self.seconds, 2) if self.seconds > 0 else None

        return {"peer": peer, "threads": threads, "stopped_by": self.reason, "steps": self.steps,
                "tokens": self.tokens, "answer_tokens": self.answer_tokens, "train_seconds": round(self.seconds, 2),
                "tokens_per_s": per_s(self.tokens), "answer_tokens_per_s": per_s(self.answer_tokens), **extra}


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


def add_budget_args(p: argparse.ArgumentParser, seed: int) -> None:
    """The arguments every peer runner takes: its budget (minutes or steps), threads, TTT steps,
    an epoch bound, the seed, and the trainer's own flags after `--`."""
    p.add_argument("--minutes", type=float)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=1000, help="an upper bound: the budget stops the run")
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more of the trainer's own settings")


def parse_budget_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse; the `--` before the trainer's own settings goes; a budget is required."""
    a = p.parse_args(argv)
    a.extra = a.extra[1:] if a.extra[:1] == ["--"] else a.extra
    if a.minutes is None and a.max_steps is None:
        p.error("give --minutes or --max-steps")
    return a
