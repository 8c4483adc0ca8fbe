"""`trainer=ddp` with two CPU processes (gloo), through `python -m train` as users run it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import torch

from conftest import REPO


def test_two_cpu_processes_train_checkpoint_and_export(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "train", "experiment=tiny", "trainer=ddp", "trainer.devices=2",
               "trainer.accelerator=cpu", f"data.path={tiny_corpus}", "data.allow_short=true",
               "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.enable_progress_bar=false",
               f"output_dir={out}"]
    if importlib.util.find_spec("train.callbacks") is None:
        command.append("callbacks.speculative_eval=null")
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"output directory: {out}" in result.stdout and f"export: {out / 'export'}" in result.stdout
    assert "Starting with 2 processes" in result.stdout + result.stderr
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6
    assert (out / "export" / "config.json").is_file()
