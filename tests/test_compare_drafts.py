"""scripts/compare_drafts.py end to end at test sizes: every kind of candidate trains, decodes
and lands in the table, JSON and plot; scripts/acceptance.py on the same target."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import command

pytestmark = pytest.mark.usefixtures("offline")


@pytest.mark.filterwarnings("ignore:Found .* module\\(s\\) in eval mode")
def test_compare_drafts_at_test_sizes(tiny_cfg, tiny_corpus, tmp_path, capsys):
    from train.run import run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = run(tiny_cfg(tmp_path / "target", "trainer.max_steps=10", "trainer.val_check_interval=10",
                              "callbacks.speculative_eval=null"))
        script = command("compare_drafts")
        args = ["--target-export", str(target["export_dir"]), "--data", str(tiny_corpus), "--student", "tiny",
                "--steps", "2", "--seq-len", "32", "--prompt-len", "8", "--divergences", "tvd",
                "--prompts", "2", "--prompt-bytes", "8", "--max-new-tokens", "8", "--repeats", "1",
                "--out", str(tmp_path / "cmp")]
        assert script.main(args) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    names = [e["name"] for e in result["entries"]]
    assert names == ["ce", "tvd/corpus", "tvd/student", "prophet/frozen", "prophet/joint"]
    gamma, prompts, new = 5, 2, 8                      # --gamma's default, --prompts, --max-new-tokens (1 round)
    for entry in result["entries"]:
        for tag in ("t0", "t1"):
            t = entry[tag]
            # the rates are the counts': every prompt emits exactly max_new_tokens; each target call
            # emits its accepted drafts + 1 (the prefill's emits 1), the last round of a row cut by up
            # to gamma at max_new_tokens
            assert t["new_tokens"] == prompts * new
            assert t["tokens_per_call"] == t["new_tokens"] / t["row_calls"]
            assert t["row_calls"] + t["accepted"] - gamma * prompts <= t["new_tokens"] <= t["row_calls"] + t["accepted"]
            assert t["acceptance_rate"] == t["accepted"] / t["drafted"] and t["accepted"] <= t["drafted"]
            assert t["speedup"] > 0
        assert entry["t0"]["greedy_equal_plain"] is True                # speculative greedy = plain greedy
    # equal student compute; distillation pays the teacher's forward passes on top
    ce, tvd, on_policy = result["entries"][:3]
    assert ce["train_tokens"] == tvd["train_tokens"] == on_policy["train_tokens"] == 2 * 8 * 32
    assert ce["total_flops"] == ce["student_flops"] < tvd["total_flops"] < on_policy["total_flops"]
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 1000
    assert "| tvd/student |" in capsys.readouterr().out
    # a second call reuses the trained runs
    assert script.main(args) == 0
    assert "reusing" in capsys.readouterr().err

    # scripts/acceptance.py on the same target: one row per temperature, rates in [0, 1]
    acceptance = command("acceptance")
    assert acceptance.main(["--export", str(target["export_dir"]), "--data", str(tiny_corpus), "--prompts", "2",
                            "--prompt-len", "8", "--max-new-tokens", "8"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[2].strip() for r in rows] == ["0", "1"] and all(0 <= float(r[3]) <= 1 for r in rows)
    draft = tmp_path / "cmp" / "runs" / "ce" / "export"
    assert acceptance.main(["--export", str(draft), "--data", str(tiny_corpus)]) == 2
    assert "has no prophet" in capsys.readouterr().err
