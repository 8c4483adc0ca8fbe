"""experiment=tiny end to end through run(cfg), the function `python -m train` calls: training,
checkpoints, the export, resuming, and learning on a tiny repetitive corpus."""

from __future__ import annotations

import csv
import importlib.util
import json
import math

import pytest
import torch

from conftest import TEXTMIX, StopAt, command

import train.run as train_run
from train.run import run
from train.tasks.prophet import ProphetModule

pytestmark = pytest.mark.usefixtures("offline", "one_thread")



@pytest.fixture(scope="module")
def trained(tiny_cfg, tmp_path_factory):
    """experiment=tiny (CSV logger): 40 steps, validation at steps 20 and 40."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    return run(tiny_cfg(out))


def csv_rows(output_dir):
    with open(output_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_tiny_run_writes_checkpoints_config_metrics_and_export(trained):
    out = trained["output_dir"]
    assert trained["global_step"] == 40
    assert trained["last_ckpt"] == out / "checkpoints" / "last.ckpt" and trained["last_ckpt"].is_file()
    assert trained["best_ckpt"] is not None and trained["best_ckpt"].is_file()
    assert trained["export_dir"] == out / "export"
    assert (out / "config.yaml").is_file()
    for key in ("train/loss", "train/main_loss", "train/prophet_loss", "val/main_loss", "val/prophet_loss", "val/bpc"):
        assert math.isfinite(trained["metrics"][key]), key
    assert trained["metrics"]["val/bpc"] == pytest.approx(trained["metrics"]["val/main_loss"] / math.log(2))
    assert torch.load(trained["last_ckpt"], weights_only=True)["global_step"] == 40
    if importlib.util.find_spec("train.callbacks") is not None:   # the evaluation callback ran
        assert any(key.startswith("val/acceptance_rate/") for key in trained["metrics"])


def test_every_validation_logs_the_simulated_acceptance_beside_the_real_one(trained):
    rows = [r for r in csv_rows(trained["output_dir"]) if r.get("val/simulated_tokens_per_call")]
    assert [int(r["step"]) for r in rows] == [19, 39]           # both validations (CSV steps count from 0)
    gamma = 5
    for row in rows:
        accuracy = [float(row[f"val/teacher_forced_accuracy/pos{i}"]) for i in range(1, gamma + 1)]
        assert all(0 <= a <= 1 for a in accuracy)
        expected = 1 + sum(math.prod(accuracy[:k]) for k in range(1, gamma + 1))
        assert float(row["val/simulated_tokens_per_call"]) == pytest.approx(expected, rel=1e-6)
        assert row["val/tokens_per_call/t0"]                          # the real one, same validation


def test_the_export_keeps_the_last_evaluations_speed_profiles_for_gamma_auto(trained, capsys):
    from specdec_models.decode import SpeedProfile
    from specdec_models.decode.__main__ import main as decode_main
    from specdec_models.export import read_export_config

    metadata = read_export_config(trained["export_dir"])["metadata"]
    profiles = metadata["speed_profiles"]
    assert {(p["temperature"], p["batch"]) for p in profiles} == {(0.0, 1), (0.0, 2), (1.0, 1), (1.0, 2)}
    t0 = SpeedProfile.from_dict(next(p for p in profiles if p["temperature"] == 0.0 and p["batch"] == 1))
    # the acceptance is the last (step 40) evaluation's
    last = [r for r in csv_rows(trained["output_dir"]) if r.get("val/per_position_acceptance/pos1/t0")][-1]
    assert list(t0.per_position_acceptance) == pytest.approx(
        [float(last[f"val/per_position_acceptance/pos{i}/t0"]) for i in range(1, 6)])
    assert decode_main(["--export", str(trained["export_dir"]), "--prompt", "abc", "--max-new-tokens", "12",
                        "--temperature", "0", "--gamma", "auto", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    # the stored profile's choice, which may be 0 (plain decoding) where its timings predict no
    # gamma pays: the profile's c and v were timed during training, so either can happen
    assert stats["gamma"] == t0.best_gamma(plain=True) and stats["speed_profile"] == t0.to_dict()


def test_export_loads_and_matches_the_trained_module(trained):
    from specdec_models.export import load_export

    exported = load_export(trained["export_dir"])
    module = ProphetModule.load_from_checkpoint(trained["last_ckpt"], map_location="cpu").eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = module.net.model(tokens)
        got = exported.model(tokens)
        torch.testing.assert_close(got.logits, ref.logits)
        start = module.net.start_tokens(ref.embeds[:, -2:])
        torch.testing.assert_close(exported.prophet(tokens[:, :5], start=start).logits,
                                   module.net.prophet(tokens[:, :5], start=start).logits)


def test_loss_falls_on_a_tiny_repetitive_corpus(trained):
    rows = csv_rows(trained["output_dir"])
    main = [float(r["train/main_loss"]) for r in rows if r.get("train/main_loss")]
    prophet = [float(r["train/prophet_loss"]) for r in rows if r.get("train/prophet_loss")]
    # untrained: about ln 256 = 5.5 nats per byte; four repeated sentences are learnt fast
    assert main[0] > 5.0 and main[-1] < 0.5 * main[0]
    assert prophet[0] > 5.0 and prophet[-1] < 0.5 * prophet[0]
    assert trained["metrics"]["val/bpc"] < 0.6 * 8



@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_resume_from_last_ckpt_continues_the_same_run(trained, tiny_cfg, tmp_path, monkeypatch):
    build = train_run.build_callbacks
    monkeypatch.setattr(train_run, "build_callbacks", lambda cfg: build(cfg) + [StopAt(20)])
    first = run(tiny_cfg(tmp_path / "first"))
    assert first["global_step"] == 20
    monkeypatch.setattr(train_run, "build_callbacks", build)
    resumed = run(tiny_cfg(tmp_path / "resumed", f"ckpt_path={first['last_ckpt']}"))
    assert resumed["global_step"] == 40
    # step count, optimizer, schedule and data stream all resume: the weights equal the
    # uninterrupted run's
    a = torch.load(resumed["last_ckpt"], weights_only=True)
    b = torch.load(trained["last_ckpt"], weights_only=True)
    for name, tensor in b["state_dict"].items():
        torch.testing.assert_close(a["state_dict"][name], tensor, msg=name)
    assert a["lr_schedulers"][0]["last_epoch"] == b["lr_schedulers"][0]["last_epoch"] == 40


def test_export_script_writes_a_loadable_export(trained, tmp_path, capsys):
    from specdec_models.export import load_export

    script = command("export")
    assert script.main([str(trained["last_ckpt"]), str(tmp_path / "exp")]) == 0
    assert str(tmp_path / "exp") in capsys.readouterr().out
    load_export(tmp_path / "exp")
    assert script.main([str(tmp_path / "missing.ckpt"), str(tmp_path / "exp2")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.skipif(not TEXTMIX.is_file(), reason="../shared/data/textmix100m.gz is absent")
def test_tiny_runs_on_the_full_size_stand_in(tiny_cfg, tmp_path):
    result = run(tiny_cfg(tmp_path / "run", f"data.path={TEXTMIX}", "data.allow_short=false",
                          "trainer.max_steps=4", "trainer.val_check_interval=2"))
    assert result["global_step"] == 4 and (result["export_dir"] / "config.json").exists()


def test_bf16_mixed_and_a_window_subset_train(tiny_cfg, tmp_path):
    result = run(tiny_cfg(tmp_path / "run", "trainer.precision=bf16-mixed", "model.prophet.windows_per_seq=8",
                          "trainer.max_steps=4", "trainer.val_check_interval=2"))
    assert result["global_step"] == 4 and math.isfinite(result["metrics"]["val/bpc"])


def test_training_raises_the_prophets_acceptance(trained, tiny_corpus):
    # Same trained main model as target; its trained prophet against a freshly initialised one,
    # greedy, on windows of the corpus: training must raise acceptance well above the fresh
    # prophet's (measured after the 40 tiny steps: 0.38 against 0.0; deterministic: greedy, fixed seeds).
    import copy
    import gzip

    from specdec_models.decode import GREEDY, HeadDrafter, generate
    from specdec_models.export import load_export

    trained_pair = load_export(trained["export_dir"])
    fresh = copy.deepcopy(trained_pair)
    fresh.prophet.reset_parameters()
    text = gzip.decompress(tiny_corpus.read_bytes())
    prompts = torch.tensor([list(text[i:i + 24]) for i in range(1000, 9000, 1000)])
    rates = {}
    for name, pair in (("trained", trained_pair), ("fresh", fresh)):
        _, stats = generate(pair.model, prompts, 32, HeadDrafter(pair), gamma=4, sampling=GREEDY)
        rates[name] = stats.acceptance_rate
    assert rates["trained"] > 0.25 and rates["trained"] > rates["fresh"] + 0.25, rates
