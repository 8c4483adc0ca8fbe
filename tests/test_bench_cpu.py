"""scripts/bench_cpu.py: one-line errors for bad arguments before any model loads, and a tiny run
end to end (a random tiny Llama with a character tokenizer standing in for SmolLM2): every piece
this host uses timed on and off for plain and eagle3 decoding, the table printed and the JSON
written; and the kernel timings of --matmul-rows."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from conftest import command
from test_hf_decode import build
from test_hf_decode_cli import VOCAB, char_tokenizer


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_cpu") / "target"
    build(path, "llama", 1, 30.0, vocab=VOCAB)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("argv, match", [
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--gamma", "0"], "--gamma must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--matmul-rows", "0"], "--matmul-rows must be >= 1"),
    (["--tree", "2,x"], "tree"),
    (["--eagle3", "MISSING"], "MISSING"),
    (["--target", "MISSING.gguf"], "GGUF file"),
])
def test_bad_arguments_exit_2_with_one_line_before_a_model_loads(tiny, tmp_path, capsys, monkeypatch, argv, match):
    from specdec_models.hf import weights

    monkeypatch.setattr(weights, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    bench = command("bench_cpu")
    target = [] if "--target" in argv else ["--target", str(tiny)]
    assert bench.main([*target, *argv, "--out", str(tmp_path / "cpu.json")]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err
    assert not (tmp_path / "cpu.json").exists()


def test_a_tiny_run_times_every_piece_on_and_off_for_both_methods(tiny, tmp_path, capsys):
    from specdec_models import cpu

    bench = command("bench_cpu")
    out = tmp_path / "cpu.json"
    assert bench.main(["--target", str(tiny), "--prompts", "2", "--max-new-tokens", "3", "--gamma", "2",
                       "--out", str(out)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    comparisons = cpu.comparisons()
    assert [(r["piece"], r["method"]) for r in report["rows"]] == [(name, m) for name, _, _ in comparisons
                                                                   for m in ("plain", "eagle3")]
    assert all(r["ratio"] > 0 and r["on_tokens_per_second"] > 0 and r["off_tokens_per_second"] > 0
               for r in report["rows"])
    assert all(len(rates) == 2 for rates in report["tokens_per_second"].values())      # one per prompt
    assert report["host"]["flags"] == cpu.host_report()["flags"] and report["head"] == "random"
    assert "flags the rules read:" in printed and "| piece | used here |" in printed
    assert all(f"| {r['piece']} |" in printed for r in report["rows"])
    assert cpu.host_report()["pieces_off"] == []                 # every piece is on again afterwards


def test_matmul_rows_times_each_few_row_path(tiny, tmp_path, capsys):
    bench = command("bench_cpu")
    out = tmp_path / "matmul.json"
    assert bench.main(["--target", str(tiny), "--matmul-rows", "1,3", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "F.linear" in report["ms"] and all(set(v) == {"1", "3"} for v in report["ms"].values())
    assert "| F.linear |" in capsys.readouterr().out
