"""The decoding benchmark harness (`train.bench.decode`, `scripts/bench_decode.py`) and
the adapter of lucidrains' package (`train.bench.lucidrains`) on tiny exports."""

import importlib.util
import json
import math
import sys

import pytest
import torch

from conftest import command

from specdec_models import Decoder, ModelConfig, ModelWithProphet, ProphetConfig, SpecdecError, save_export
from train.bench.decode import DecodeBench, markdown, run, write_report

lucidrains_installed = importlib.util.find_spec("speculative_decoding") is not None
MAIN = ModelConfig(vocab_size=256, dim=32, depth=2, heads=2, dim_head=16, max_seq_len=256)
PROPHET = ProphetConfig(model=ModelConfig(vocab_size=256, dim=32, depth=1, heads=2, dim_head=16, max_seq_len=16),
                        prophet_train_length=7)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_exports")
    torch.manual_seed(0)
    save_export(root / "pair", ModelWithProphet(MAIN, PROPHET))
    save_export(root / "draft", Decoder(ModelConfig(vocab_size=256, dim=16, depth=1, heads=1, dim_head=16)))
    return root


def test_bench_runs_every_setting_interleaved_and_predicts_from_its_own_timings(exports, tmp_path):
    methods = ["base", "draft", "prophet"] + (["lucidrains"] if lucidrains_installed else [])
    bench = DecodeBench(batches=[1, 2], methods=methods, gammas=[2, "auto"], max_new_tokens=24, repeats=2,
                        target_export=str(exports / "pair"), draft_export=str(exports / "draft"))
    lines = []
    report = run(bench, log=lines.append)
    rows = report["results"]
    # base, draft x 2 gammas, prophet x 2, lucidrains' at 2
    per_batch = 1 + 2 + 2 + (2 if lucidrains_installed else 0)
    assert len(rows) == 2 * per_batch and len(lines) == 2 * 2 * per_batch
    # round-robin: the first repeat of every setting comes before the second of any
    first = [line for line in lines if "batch 1 repeat 1/2" in line]
    assert lines[:per_batch] == first
    for r in rows:
        assert r["tokens_per_second"] > 0 and r["speedup"] > 0
        if r["method"] in ("draft", "prophet"):
            assert r["c"] > 0 and r["predicted_speedup"] > 0
            if r["gamma"] == "auto":      # calibrated at 8, 1, 4, 2 (6, 1, 3, 2 for this prophet), then its choice
                top = 8 if r["method"] == "draft" else 6
                assert all(1 <= g <= top for g in r["gammas_used"])
                assert r["v_by_gamma"] and set(r["v_by_gamma"]) <= {top, 1, top // 2, 2, *r["gammas_used"]}
            else:
                assert set(r["v_by_gamma"]) == {r["gamma"]}
                expected = 1 + sum(r["per_position_acceptance"][: r["gamma"]])
                assert r["expected_tokens_per_call"] == pytest.approx(expected)
            assert r["measured_over_predicted"] == pytest.approx(r["speedup"] / r["predicted_speedup"])
            assert 0 <= r["non_model_share"] < 1
        if r["method"].startswith("lucidrains"):
            assert r["ours_over_lucidrains"] == pytest.approx(r["ours_tokens_per_second"] / r["tokens_per_second"])
    paths = write_report(report, tmp_path / "out" / "decode.json")
    assert [p.name for p in paths] == ["decode.json", "decode.md", "decode.png"]
    assert json.loads(paths[0].read_text())["settings"]["gammas"] == [2, "auto"]
    assert paths[1].read_text().strip() == markdown(report)
    assert paths[2].stat().st_size > 1000


def test_gamma_stored_decodes_at_the_best_gamma_of_the_exports_profile(exports, tmp_path):
    from specdec_models import load_export
    from specdec_models.decode import SpeedProfile

    # training's evaluation stores one profile per temperature and batch size; this one favours gamma 3 at batch 1
    profiles = [{"temperature": 1.0,
                 **SpeedProfile(0.1, {1: 1.1, 3: 1.2, 5: 3.0}, [0.9, 0.9, 0.9, 0.1, 0.1], b).to_dict()}
                for b in (1, 2)]
    save_export(tmp_path / "stored", load_export(exports / "pair"), metadata={"speed_profiles": profiles})
    bench = DecodeBench(batches=[1], methods=["base", "prophet"], gammas=["stored"], max_new_tokens=12, repeats=1,
                        target_export=str(tmp_path / "stored"))
    (row,) = [r for r in run(bench, log=lambda _: None)["results"] if r["method"] == "prophet"]
    assert row["gamma"] == "stored" and row["gammas_used"] == [SpeedProfile.from_dict(profiles[0]).best_gamma()] == [3]
    assert set(row["v_by_gamma"]) == {3}                         # nothing calibrated: every round at gamma 3
    with pytest.raises(SpecdecError, match="holds no speed profile"):
        run(DecodeBench(methods=["base", "prophet"], gammas=["stored"], target_export=str(exports / "pair")))


@pytest.mark.parametrize("kwargs, match", [
    (dict(gammas=["stored"]), "give target_export"),
    (dict(methods=["medusa"]), "unknown method"),
    (dict(gammas=[0]), "gammas"),
    (dict(batches=[0]), "batch sizes"),
    (dict(repeats=0), "repeats"),
    (dict(draft_export="x"), "needs a target export"),
])
def test_bad_bench_settings_are_refused(kwargs, match):
    with pytest.raises(SpecdecError, match=match):
        DecodeBench(**kwargs)


def test_bench_script_reports_and_refuses_bad_input(exports, tmp_path, capsys):
    bench_decode = command("bench_decode")
    out = tmp_path / "b" / "decode.json"
    status = bench_decode.main(["--target-export", str(exports / "pair"), "--batch", "1", "--max-new-tokens", "6",
                                "--repeats", "1", "--methods", "base,prophet", "--gamma", "2", "--out", str(out)])
    assert status == 0
    assert "| 1 | prophet | 2 |" in capsys.readouterr().out and out.exists()
    status = bench_decode.main(["--draft-export", str(exports / "draft"), "--out", str(out)])
    assert status == 2 and capsys.readouterr().err.startswith("error: a draft export needs a target export")


# ---------------------------------------------------------------- lucidrains' package

needs_lucidrains = pytest.mark.skipif(not lucidrains_installed,
                                      reason="lucidrains' speculative-decoding is not installed")


@needs_lucidrains
def test_patched_lucidrains_computes_our_function_and_the_published_one_lacks_the_feed_forward():
    from train.bench.lucidrains import build_lucidrains, copy_weights

    torch.manual_seed(0)
    ours = ModelWithProphet(MAIN, PROPHET).eval()
    x = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        mine = ours.model(x).logits
        patched = copy_weights(build_lucidrains(MAIN, PROPHET, patched_ff=True), ours).eval()
        published = copy_weights(build_lucidrains(MAIN, PROPHET, patched_ff=False), ours).eval()
        # equal up to the RMSNorm epsilon (ours 1e-6, lucidrains' float32 eps)
        torch.testing.assert_close(patched.model(x), mine, rtol=1e-3, atol=1e-3)
        assert (published.model(x) - mine).abs().max() > 0.05
        # same sizes: every weight of ours has its place in lucidrains'
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in patched.parameters())


@needs_lucidrains
def test_lucidrains_prophet_decoding_emits_the_requested_tokens():
    from train.bench.lucidrains import build_lucidrains, lucidrains_prophet_decode

    torch.manual_seed(0)
    net = build_lucidrains(MAIN, PROPHET, patched_ff=True).eval()
    out, seconds, accepted = lucidrains_prophet_decode(net, torch.randint(0, 256, (3, 5)), 17, gamma=3, top_k=20)
    assert out.shape == (3, 17) and seconds > 0
    # a prophet that drafts exactly the main model's token: zero output weights give both the same
    # (all-equal) logits, top_k=1 keeps the same single token, p/q = 1, so every draft of every
    # round is accepted: 3 per round, and every new token is that token
    with torch.no_grad():
        net.model.to_logits[-1].weight.zero_()
        net.prophet.to_logits[-1].weight.zero_()
    out, _, accepted = lucidrains_prophet_decode(net, torch.randint(0, 256, (3, 5)), 17, gamma=3, top_k=1)
    assert accepted == 3.0
    assert out.shape == (3, 17) and (out == out[0, 0]).all()


def test_lucidrains_filter_threshold_keeps_exactly_top_k():
    from train.bench.lucidrains import filter_thres

    for vocab in (6, 256, 50257):
        for k in (1, 2, vocab // 3, vocab - 1):
            assert math.ceil((1 - filter_thres(k, vocab)) * vocab) == k
        assert math.ceil((1 - filter_thres(None, vocab)) * vocab) == vocab


def test_a_missing_lucidrains_package_is_one_clear_line(monkeypatch):
    from train.bench import lucidrains

    monkeypatch.setitem(sys.modules, "speculative_decoding", None)       # import fails
    with pytest.raises(SpecdecError, match=r"^lucidrains' speculative-decoding is not installed: "
                                           r"pip install speculative-decoding==0.2.0"):
        lucidrains.build_lucidrains(MAIN, PROPHET, patched_ff=False)
