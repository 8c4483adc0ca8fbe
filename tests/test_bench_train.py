"""The training benchmarks' library (`train.bench.train_step`, `.train_quality`,
`.report`) and `scripts/bench_train.py`'s argument errors, at tiny sizes."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from conftest import command

from specdec_models import ModelWithProphet
from specdec_models.errors import SpecdecError
from train.bench import train_quality, train_step
from train.bench.report import write_report

TINY = "32x2+32x1"          # main 32 x 2 + prophet 32 x 1, one head of 32
SEQ = 24
pytestmark = pytest.mark.usefixtures("one_thread")
needs_lucidrains = pytest.mark.skipif(importlib.util.find_spec("speculative_decoding") is None,
                                      reason="lucidrains' speculative-decoding is not installed")


def batch_of(k: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(k))


class Fake(train_step.TrainStep):
    """A contender whose steps log their name (the order) and take no measurable time."""

    def __init__(self, name: str, log: list[str]) -> None:
        net = torch.nn.Linear(1, 1)
        super().__init__(name, net, lambda b: net.weight.sum(), torch.optim.SGD(net.parameters(), lr=0.0), 1)
        self.log = log

    def step(self, batch: torch.Tensor) -> float:
        self.log.append(self.name)
        self.seconds.append(0.5)
        return 0.0


def test_size_names_build_the_configs_and_bad_ones_are_refused():
    main, prophet = train_step.size_configs("512x10+512x2", windows_per_seq=64)
    assert (main.dim, main.depth, main.heads, main.dim_head) == (512, 10, 8, 64)
    assert (prophet.model.depth, prophet.prophet_train_length, prophet.windows_per_seq) == (2, 7, 64)
    for bad in ("512x10", "512x10+100x2", "0x1+32x1"):
        with pytest.raises(SpecdecError, match="size"):
            train_step.size_configs(bad)


def test_rounds_rotate_who_steps_first():
    assert [train_step.round_order(3, r) for r in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    log: list[str] = []
    rounds = train_step.interleave([Fake("a", log), Fake("b", log)], (batch_of(k) for k in range(4)), warmup=1)
    assert log == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert rounds == [[0.5, 0.5]] * 3            # the warm-up round is not kept
    with pytest.raises(SpecdecError, match="no timed rounds"):
        train_step.interleave([Fake("a", [])], [batch_of(0)], warmup=1)


@needs_lucidrains
def test_step_timers_give_positive_rates_for_ours_and_both_lucidrains_variants():
    report = train_step.bench_steps(TINY, batch_of, seq_len=SEQ, batch_size=2, windows_per_seq=[3], steps=2, warmup=1)
    rows = {r["contender"]: r for r in report["contenders"]}
    assert list(rows) == ["ours", "ours wps=3", "lucidrains", "lucidrains+ff"]
    all_windows = train_step.size_configs(TINY)[1].anchor_count(SEQ)
    assert [r["prophet_windows_per_seq"] for r in rows.values()] == [all_windows, 3, all_windows, all_windows]
    for name, r in rows.items():
        assert r["tokens_per_second"] > 0 and len(r["step_seconds"]) == 2
        assert set(r["speedup_over"]) == set(rows) - {name} and all(v > 0 for v in r["speedup_over"].values())
    md = train_step.markdown({"sizes": [report]})
    with pytest.raises(SpecdecError, match="expected"):
        train_step.bench_steps(TINY, batch_of, seq_len=SEQ + 1, batch_size=2)
    assert "| ours / lucidrains | ours / lucidrains+ff |" in md and "| ours wps=3 | 3 |" in md


@needs_lucidrains
def test_lucidrains_weights_mapped_into_ours_compute_its_function():
    from train.bench.lucidrains import build_lucidrains, copy_weights_to_ours

    main, prophet = train_step.size_configs(TINY)
    torch.manual_seed(1)
    x = torch.randint(0, 256, (2, 12))
    for patched in (True, False):
        net = build_lucidrains(main, prophet, patched_ff=patched).eval()
        ours = copy_weights_to_ours(ModelWithProphet(main, prophet), net).eval()
        with torch.no_grad():
            # equal up to the RMSNorm epsilon (ours 1e-6, lucidrains' float32 eps)
            torch.testing.assert_close(ours.model(x).logits, net.model(x), rtol=1e-3, atol=1e-3)
            start = torch.randn(2, 2, 32)
            torch.testing.assert_close(ours.prophet(x[:, :4], start=start).logits,
                                       net.prophet(x[:, :4], start_tokens=start), rtol=1e-3, atol=1e-3)


def test_time_to_quality_stops_each_contender_at_the_threshold():
    log: list[str] = []
    steps = [Fake("fast", log), Fake("slow", log), Fake("never", log)]
    rate = {"fast": 0.1, "slow": 0.05, "never": 0.0}       # acceptance gained per step

    def score(step):
        return {"acceptance_rate": rate[step.name] * len(step.seconds), "tokens_per_call": 1.0}

    rows = train_quality.time_to_quality(steps, batch_of, score, threshold=0.4, eval_every=2, max_steps=10,
                                         metric="acceptance_rate")
    fast, slow, never = rows
    assert fast["reached"] == {"step": 4, "train_seconds": 2.0} and fast["steps"] == 4
    assert slow["reached"] == {"step": 8, "train_seconds": 4.0} and slow["steps"] == 8
    assert never["reached"] is None and never["steps"] == 10 and len(never["curve"]) == 5
    assert [p["step"] for p in fast["curve"]] == [2, 4]
    # all three step on each batch until the fast one stops
    assert log[:6] == ["fast", "slow", "never", "slow", "never", "fast"]


def test_time_to_quality_stops_when_all_reached():
    steps = [Fake("a", []), Fake("b", [])]
    rows = train_quality.time_to_quality(steps, batch_of, lambda s: {"tokens_per_call": 2.0}, threshold=1.5,
                                         eval_every=3, max_steps=100)
    assert [r["steps"] for r in rows] == [3, 3]


@needs_lucidrains
def test_quality_bench_runs_every_contender_and_writes_its_report(tmp_path):
    bench = train_quality.QualityBench(size=TINY, seq_len=SEQ, batch_size=2, threshold=6.0, also_report=[1.01],
                                       eval_every=1, max_steps=2, new_tokens=4, windows_per_seq=[3])
    report = train_quality.bench_quality(bench, batch_of, batch_of(99), torch.randint(0, 256, (2, 8)))
    assert [r["contender"] for r in report["contenders"]] == ["ours", "ours wps=3", "lucidrains", "lucidrains+ff"]
    for r in report["contenders"]:
        assert [p["step"] for p in r["curve"]] == [1, 2] and r["train_seconds"] > 0
        assert all(1 <= p["tokens_per_call"] <= 6 and 0 <= p["decode_acceptance_rate"] <= 1
                   and len(p["per_position_accuracy"]) == 5 for p in r["curve"])
    paths = write_report(report, tmp_path / "q" / "quality", train_quality.markdown(report), train_quality.plot)
    assert [p.name for p in paths] == ["quality.json", "quality.md", "quality.png"]
    assert json.loads(paths[0].read_text())["mode"] == "quality"
    assert "not reached" in paths[1].read_text() and paths[2].read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in paths[0].parent.iterdir()) == ["quality.json", "quality.md", "quality.png"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(threshold=1.0), "threshold"), (dict(threshold=6.5), "threshold"), (dict(also_report=[0.5]), "threshold"),
    (dict(eval_every=0), "eval_every"),
    (dict(size="big"), "size"), (dict(gamma=7), "gamma"), (dict(lr=0), "lr"),
])
def test_bad_quality_settings_are_refused(kwargs, match):
    with pytest.raises(SpecdecError, match=match):
        train_quality.QualityBench(**kwargs)


@pytest.mark.parametrize("argv, match", [
    (["--lucidrains", "--sizes", "huge"], "is not of the form"),
    (["--quality", "--threshold", "0.5"], "threshold must be"),
    (["--lucidrains", "--data", "/nonexistent/file"], "is not a file"),
    (["--lucidrains", "--steps", "0"], "must be >= 1"),
    (["--precisions", "fp8"], "precision must be one of"),
])
def test_bench_script_refuses_bad_arguments_in_one_line(argv, match, capsys, tmp_path):
    bench_train = command("bench_train")
    assert bench_train.main([*argv, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


@pytest.mark.usefixtures("offline", "one_thread")
def test_pipeline_bench_trains_through_run_and_the_plain_loop_ends_at_the_same_weights(tiny_corpus, tmp_path):
    from train.bench import pipeline

    bench = pipeline.PipelineBench(model="tiny", precisions=["32-true"], warmup=1, steps=2, rounds=2,
                                   overrides=["data.seq_len=32", "data.batch_size=2", "data.val_windows=4",
                                              "callbacks.speculative_eval.num_prompts=1",
                                              "callbacks.speculative_eval.max_new_tokens=8",
                                              "callbacks.speculative_eval.prompt_len=8"])
    report = pipeline.bench_pipeline(bench, tiny_corpus, "tiny corpus", tmp_path)
    (row,) = report["results"]
    # run() itself trained (its folder and export), timed step by step after the warm-up
    assert (tmp_path / "32-true" / "config.yaml").is_file() and (tmp_path / "32-true" / "export").is_dir()
    assert len(row["pipeline_step_seconds"]) == len(row["plain_step_seconds"]) == bench.rounds * bench.steps
    assert len(row["ratio_per_round"]) == bench.rounds
    # the plain loop is the same training: same initial weights, batches, optimizer and schedule
    assert row["weights_max_abs_diff"] < 1e-5
    assert report["speculative_eval"]["settings"]["num_prompts"] == 1
    assert "| 32-true |" in pipeline.markdown(report)
