"""What a run prints and where it writes it: progress in optimizer steps (with a total and an
ETA) as plain lines when stdout is not a terminal, one tqdm bar when it is; train.log in the
run's own folder and no stray Hydra folder; no Lightning tips."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import forked

from train.run import run

pytestmark = pytest.mark.usefixtures("offline", "one_thread")
# 6 optimizer steps of 2 micro-batches: Lightning's own bar counted 12 batches here ("3/3" then "12/?")
STEPS = ["trainer.max_steps=6", "trainer.accumulate_grad_batches=2", "trainer.val_check_interval=6",
         "callbacks.speculative_eval=null", "callbacks.progress_bar.log_every_seconds=0"]


def test_progress_is_plain_lines_of_optimizer_steps_when_stdout_is_not_a_terminal(tiny_cfg, tmp_path, capsys):
    result = run(tiny_cfg(tmp_path / "run", *STEPS))
    out = capsys.readouterr().out
    assert "\r" not in out
    steps = [(int(a), int(b)) for a, b in re.findall(r"^step (\d+)/(\d+) ", out, flags=re.M)]
    assert steps[0] == (0, 6) and steps[-1] == (6, 6)
    assert [a for a, _ in steps if a] == sorted(a for a, _ in steps if a) and {b for _, b in steps} == {6}
    assert [a for a, _ in steps].count(3) == 2                      # after step 3, and after its validation
    assert re.search(r"^step 6/6 \(100%\) \| [\d.]+ s/step \| ETA 0:00:00 \| .*train/loss=", out, flags=re.M)
    assert "Tip:" not in out
    log = (result["output_dir"] / "train.log").read_text()
    assert "step 6/6 (100%)" in log and "export:" in log


def test_progress_is_one_bar_of_optimizer_steps_on_a_terminal(tiny_cfg, tmp_path, capsys):
    run(tiny_cfg(tmp_path / "run", *STEPS, "+callbacks.progress_bar.terminal=true"))
    out = capsys.readouterr().out
    counts = [(int(a), int(b)) for a, b in re.findall(r"\| (\d+)/(\d+) \[", out)]
    assert counts[0] == (0, 6) and counts[-1] == (6, 6) and {b for _, b in counts} == {6}, counts
    assert re.search(r"train: 100%\|.*\| 6/6 \[", out)


def test_a_run_makes_only_its_own_folder_with_train_log_in_it(tiny_corpus, tmp_path):
    def cli():
        from train.__main__ import cli as train_cli

        sys.argv = ["train", "experiment=tiny", f"data.path={tiny_corpus}", "data.allow_short=true", *STEPS]
        train_cli()

    child = forked(cli, cwd=tmp_path)
    assert child.status == 0, child.output[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")                  # outputs/<date>/<time>, nothing else
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"] and not (run_dir / ".hydra").exists()
    assert {"config.yaml", "train.log", "checkpoints", "export", "csv"} <= {p.name for p in run_dir.iterdir()}
    assert f"output directory: {run_dir}" in child.output
    assert "`Trainer.fit` stopped" in (run_dir / "train.log").read_text()
