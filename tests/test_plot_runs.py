"""scripts/plot_runs.py: runs' validation figures against their minutes of training."""

from __future__ import annotations

import pytest

from conftest import command

pytest.importorskip("matplotlib")


def fake_run(folder, minutes_per_100_steps: float) -> None:
    """A run folder as `python -m train ... logger=csv` leaves it: csv/metrics.csv and train.log."""
    (folder / "csv").mkdir(parents=True)
    lines = ["epoch,step,train/kl/step0,val/ttt_kl/step0,val/simulated_tokens_per_call"]
    log = ["[2026-11-29 11:00:00,000][train.progress][INFO] - step 0/1000 (0%) | training starts"]
    for step in range(100, 501, 100):
        lines.append(f"0,{step},{3 - step / 500},,")
        lines.append(f"0,{step},,{2.5 - step / 1000},{1 + step / 1000}")
        seconds = round(60 * minutes_per_100_steps * step / 100)
        log.append(f"[2026-11-29 11:{seconds // 60:02d}:{seconds % 60:02d},500][train.progress][INFO] - "
                   f"step {step}/1000 (0%) | 0.7 s/step | validated")
    (folder / "csv" / "metrics.csv").write_text("\n".join(lines) + "\n")
    (folder / "train.log").write_text("\n".join(log) + "\n")


def test_minutes_come_from_the_progress_lines_and_are_interpolated_between_them(tmp_path):
    script = command("plot_runs")
    fake_run(tmp_path / "a", minutes_per_100_steps=2)
    known = script.step_minutes(tmp_path / "a" / "train.log")
    assert known[0] == 0 and known[500] == pytest.approx(10 + 0.5 / 60)
    assert script.minutes_at([250], {200: 4.0, 300: 6.0}) == [5.0]
    series, _ = script.read_run(tmp_path / "a")
    assert series["val/ttt_kl/step0"][0] == (100, pytest.approx(2.4)) and len(series["train/kl/step0"]) == 5


def test_it_writes_the_png_and_refuses_a_metric_no_run_logged(tmp_path, capsys):
    script = command("plot_runs")
    fake_run(tmp_path / "a", 2)
    fake_run(tmp_path / "b", 3)
    out = tmp_path / "fig" / "runs.png"
    runs = ["--run", f"fast={tmp_path / 'a'}", "--run", f"slow={tmp_path / 'b'}"]
    assert script.main([*runs, "--out", str(out), "--train-metric", "train/kl/step0"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert script.main([*runs, "--out", str(tmp_path / "x.png"), "--metric", "val/nothing"]) == 2
    assert "no run logged 'val/nothing'" in capsys.readouterr().err and not (tmp_path / "x.png").exists()
    assert script.main(["--run", str(tmp_path / "a"), "--out", str(tmp_path / "y.png")]) == 2
    assert "LABEL=DIR" in capsys.readouterr().err
