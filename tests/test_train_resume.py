"""Runs that survive a kill -9: checkpoints by steps and by time, a resume that continues the same
CSV file (every step exactly once) and the same W&B run, the same weights as a run never killed.

The killed runs are forked children of the test process (`conftest.forked`) running
`python -m train`'s own entry point (`train.__main__.cli`) in a scratch working directory, so a
stray Hydra folder would show there. The soak test (slow) kills 20 times at random moments."""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import struct
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from conftest import forked

import train.run as train_run
from train.callbacks import PeriodicCheckpoint
from train.loggers import STATE_KEY
from train.run import run

pytestmark = pytest.mark.usefixtures("offline", "one_thread")

# 16 optimizer steps of 2 micro-batches; validation (and its checkpoint) at steps 8 and 16;
# periodic checkpoints every 3 steps counted from the last checkpoint: 3, 6, 8 (val), 11, 14, 16 (val)
RUN = ["trainer.max_steps=16", "trainer.accumulate_grad_batches=2", "trainer.val_check_interval=16",
       "callbacks.speculative_eval=null", "callbacks.periodic_checkpoint.every_steps=3",
       "callbacks.periodic_checkpoint.every_minutes=null", "logger.csv.flush_logs_every_n_steps=1"]


class KillAt(L.Callback):
    """SIGKILLs its own process at the end of the batch that completes optimizer step `step`,
    after `wait` seconds (W&B writes its run file every second: what it had a second ago stays)."""

    def __init__(self, step: int, wait: float = 1.5) -> None:
        self.step, self.wait = step, wait

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            time.sleep(self.wait)
            os.kill(os.getpid(), signal.SIGKILL)


def cli(*argv: str, kill_at: int | None = None):
    """`python -m train *argv` in this (forked) process; with `kill_at`, killed at that step."""
    def main():
        from train.__main__ import cli as train_cli

        if kill_at is not None:
            build = train_run.build_callbacks
            train_run.build_callbacks = lambda cfg: build(cfg) + [KillAt(kill_at)]
        sys.argv = ["train", *argv]
        train_cli()
    return main


def csv_rows(out: Path) -> list[dict[str, str]]:
    with open(out / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def train_steps(rows) -> list[int]:
    return [int(r["step"]) for r in rows if r.get("train/loss")]


def same_rows(a, b) -> None:
    assert [sorted(k for k, v in r.items() if v) for r in a] == [sorted(k for k, v in r.items() if v) for r in b]
    for ra, rb in zip(a, b, strict=True):
        for key, value in ra.items():
            if value and key != "epoch":
                assert float(value) == pytest.approx(float(rb[key]), rel=1e-5, abs=1e-6), (ra["step"], key)


def same_weights(a: Path, b: Path) -> None:
    wa = torch.load(a, weights_only=True)["state_dict"]
    wb = torch.load(b, weights_only=True)["state_dict"]
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=0, msg=name)


def wandb_history(run_dir: Path) -> tuple[str, list[dict]]:
    """(run id, history rows) of an offline W&B run folder, read from its .wandb file: a LevelDB
    style log of protobuf `Record`s in 32 KiB blocks (7-byte file header, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data, pos, pending, rows, run_id = path.read_bytes(), 7, b"", [], None
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        space = 32768 - pos % 32768
        if space < 7:                                   # the block's tail is padding
            pos += space
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (2, 3):                              # first / middle part of a long record
            pending = (b"" if kind == 2 else pending) + chunk
            continue
        if kind not in (1, 4):
            break
        record = pb.Record()
        record.ParseFromString(pending + chunk if kind == 4 else chunk)
        if record.WhichOneof("record_type") == "run":
            run_id = record.run.run_id
        elif record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return run_id, rows


@pytest.fixture(scope="module")
def reference(tiny_cfg, tmp_path_factory):
    """The run of RUN never killed (CSV logger)."""
    torch.set_num_threads(1)
    return run(tiny_cfg(tmp_path_factory.mktemp("reference") / "run", *RUN))


@pytest.mark.parametrize("kill_at,saved_at", [(13, 11), (10, 8)], ids=["periodic-checkpoint", "validation-checkpoint"])
def test_killed_run_resumes_the_same_csv_and_wandb_run_with_every_step_once(reference, tiny_corpus, tmp_path,
                                                                             monkeypatch, kill_at, saved_at):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cwd, out = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    args = ["experiment=tiny", f"data.path={tiny_corpus}", "data.allow_short=true", f"output_dir={out}",
            "logger=[csv,wandb]", *RUN]
    killed = forked(cli(*args, kill_at=kill_at), cwd=cwd)
    assert killed.status == -signal.SIGKILL, killed.output[-3000:]
    last = out / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == saved_at
    assert len(csv_rows(out)) > ckpt[STATE_KEY]["csv_rows"]           # the killed run logged past its checkpoint

    resumed = forked(cli(*args, f"ckpt_path={last}"), cwd=cwd)
    assert resumed.status == 0, resumed.output[-3000:]
    assert list(cwd.iterdir()) == []                                   # no stray outputs/<date>/<time>
    # the CSV: the rows the killed run wrote after its checkpoint are gone, the resumed run's follow
    rows = csv_rows(out)
    assert train_steps(rows) == sorted(set(train_steps(rows))) == train_steps(csv_rows(reference["output_dir"]))
    same_rows(rows, csv_rows(reference["output_dir"]))
    same_weights(out / "checkpoints" / "last.ckpt", reference["last_ckpt"])
    # W&B: one run id in both offline folders, the one the checkpoint recorded; the resumed part
    # starts at the checkpoint's step
    first, second = sorted((out / "wandb").glob("offline-run-*"))
    (id_a, history_a), (id_b, history_b) = wandb_history(first), wandb_history(second)
    assert id_a == id_b == ckpt[STATE_KEY]["wandb_id"]
    steps_a = [r["trainer/global_step"] for r in history_a if "train/loss" in r]
    steps_b = [r["trainer/global_step"] for r in history_b if "train/loss" in r]
    assert steps_a[:saved_at] == list(range(saved_at)) and steps_b == list(range(saved_at, 16)), (steps_a, steps_b)
    # one train.log in the run's folder, both runs in it; no litlogger tip, no wandb warning
    log = (out / "train.log").read_text()
    assert log.count("training starts") == 2 and "step 16/16 (100%)" in log
    for output in (killed.output, resumed.output):
        assert "Tip:" not in output and "anonymous" not in output


class FakeClock(L.Callback):
    """A clock for PeriodicCheckpoint that advances `per_batch` seconds at the end of every training
    batch, whatever the machine's speed: checkpoints by time land on known steps."""

    def __init__(self, per_batch: float) -> None:
        self.per_batch, self.now = per_batch, 0.0

    def __call__(self) -> float:
        return self.now

    def on_train_batch_end(self, *args) -> None:
        self.now += self.per_batch


class Spy(L.Callback):
    """Records (step, who) for every checkpoint saved: "periodic" for PeriodicCheckpoint's, and
    the periodic checkpoint's clock then."""

    def __init__(self, periodic: PeriodicCheckpoint, saved: list) -> None:
        self.periodic, self.saved, self.times = periodic, saved, []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saved.append((trainer.global_step, "periodic" if self.periodic._saving else "other"))
        self.times.append(self.periodic.clock())


BUILD_CALLBACKS = train_run.build_callbacks


def spied(spies: list, clock: FakeClock):
    """build_callbacks that gives PeriodicCheckpoint the fake `clock` and adds a Spy (appended to `spies`)."""
    def callbacks(cfg):
        found = BUILD_CALLBACKS(cfg)
        periodic = next(c for c in found if isinstance(c, PeriodicCheckpoint))
        periodic.clock = clock
        spies.append(Spy(periodic, []))
        return [*found, clock, spies[-1]]
    return callbacks


def test_periodic_checkpoints_by_steps_and_by_time(tiny_cfg, tmp_path, monkeypatch):
    spies: list[Spy] = []
    monkeypatch.setattr(train_run, "build_callbacks", spied(spies, FakeClock(0.0)))
    run(tiny_cfg(tmp_path / "steps", *RUN))
    # every 3 steps from the last checkpoint; a validation writes two (best and last.ckpt); then the final one
    assert spies[0].saved == [(3, "periodic"), (6, "periodic"), (8, "other"), (8, "other"), (11, "periodic"),
                              (14, "periodic"), (16, "other"), (16, "other"), (16, "other")]
    # by time: every_minutes=0.01 (0.6 s) on a fake clock at 0.125 s a step (2 micro-batches x 0.0625 s,
    # exact in binary): a checkpoint at the first step boundary 0.6 s after the last checkpoint of
    # either kind, i.e. 5 steps after it: 5, then the validation's at 8, then 13
    monkeypatch.setattr(train_run, "build_callbacks", spied(spies, FakeClock(0.0625)))
    run(tiny_cfg(tmp_path / "time", *RUN, "callbacks.periodic_checkpoint.every_steps=null",
                 "callbacks.periodic_checkpoint.every_minutes=0.01"))
    spy = spies[1]
    assert spy.saved == [(5, "periodic"), (8, "other"), (8, "other"), (13, "periodic"), (16, "other"),
                         (16, "other"), (16, "other")]
    assert spy.times == [0.625, 1.0, 1.0, 1.625, 2.0, 2.0, 2.0]


@pytest.mark.slow
def test_soak_twenty_kills_at_random_moments_end_like_an_uninterrupted_run(tiny_cfg, tmp_path):
    """20 kill -9 at random moments (seeded delays) of a 400-step run that validates every 25
    steps and checkpoints then and every 7 steps or 0.6 s, each followed by a resume (from a
    periodic or a validation checkpoint); then the run finishes. Its weights equal the
    uninterrupted run's bit for bit, and its metrics file holds every step exactly once."""
    steps = ["trainer.max_steps=400", "trainer.val_check_interval=25", "callbacks.speculative_eval=null",
             "callbacks.periodic_checkpoint.every_steps=7", "callbacks.periodic_checkpoint.every_minutes=0.01",
             "logger.csv.flush_logs_every_n_steps=1", "trainer.enable_progress_bar=false"]
    start = time.monotonic()
    reference = run(tiny_cfg(tmp_path / "reference", *steps))
    pace = (time.monotonic() - start) / 400            # seconds per step here, validation included
    out = tmp_path / "killed"
    last = out / "checkpoints" / "last.ckpt"
    rng, resumed_from = random.Random(0), []
    for kill in range(20):
        step = torch.load(last, weights_only=True)["global_step"] if last.exists() else 0
        resume = [f"ckpt_path={last}"] if last.exists() else ["overwrite=true"]   # killed before any checkpoint
        if last.exists():
            resumed_from.append(step)
        # a random moment within about twice this restart's share of the steps left (each
        # restart also spends ~1 s starting up), so kills spread along the run and it never
        # ends before the 20th, on a slow machine or a fast one
        longest = 0.3 + 1.5 * pace * (400 - step) / (20 - kill + 1)
        child = forked(lambda resume=resume: run(tiny_cfg(out, *steps, *resume)), kill_after=rng.uniform(0.3, longest))
        assert child.status == -signal.SIGKILL, f"run ended before kill {kill + 1}: {child.output[-2000:]}"
    child = forked(lambda: run(tiny_cfg(out, *steps, f"ckpt_path={last}")))
    assert child.status == 0, child.output[-3000:]
    print(f"resumed from steps {resumed_from}")
    assert len(set(resumed_from)) >= 5, resumed_from             # the kills landed along the run
    same_weights(last, reference["last_ckpt"])
    rows, expected = csv_rows(out), csv_rows(reference["output_dir"])
    assert train_steps(rows) == list(range(400)) == train_steps(expected)
    same_rows(rows, expected)
    assert not [p for p in out.rglob(".tmp*")]
