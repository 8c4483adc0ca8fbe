"""task=hf_prophet: a prophet head trained against a frozen Hugging Face target, and its hidden-state
cache. Tiny random Llama (hidden 32) and GPT-NeoX (hidden 64: the head projects) targets over a
word-level tokenizer, saved as model directories; end to end through run(cfg): training, the
evaluation callback, the export, decoding with the exported head; resuming; cached (bfloat16,
int8, text windows and the target's own continuations) against online hidden states; every bad
input in one line before any work."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from conftest import StopAt, hf_cache
from test_decode_cli import assert_usage_error, cli
from test_hf_cache import assert_an_interrupted_build_resumes
from test_hf_data import build_tokenizer, text_setup
from test_hf_distill import save_model

import train.run as train_run
from specdec_models import load_export
from specdec_models.cpu import describe, pieces_off
from specdec_models.decode import GREEDY, HeadDrafter, generate
from specdec_models.errors import SpecdecError
from specdec_models.export import read_export_config
from specdec_models.hf.weights import load_causal_lm, weights_sha256
from train.data.embeddings_cache import cache_rows, open_cache, read_cache_meta
from train.data.regenerate import prompts_from_text
from train.run import compose, run

pytestmark = pytest.mark.usefixtures("offline", "one_thread")

SEQ = 32


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    setup = text_setup(tmp_path_factory.mktemp("hf_prophet"), docs=300, prompt_docs=12)
    d, tok = setup["root"], setup["tok"]
    return {**setup,
            "llama": save_model(d / "llama", tok, "llama", 1),
            "neox": save_model(d / "neox", tok, "neox", 2, hidden=64),
            "other": save_model(d / "other", tok, "llama", 3),                       # same sizes, other weights
            "mismatch": save_model(d / "mismatch", build_tokenizer(d / "tok2", extra=("<sep>",)), "llama", 4)}


def cfg(hf, out, *extra, target="llama", experiment="hf_prophet", head=("head.dim_head=16",)):
    """`experiment` (a head for a Hugging Face target) at test sizes, its `head` overrides: text online
    (data=hf_text) unless `extra` picks data=hf_embeddings. test_hf_eagle3_task uses it too."""
    text = [] if "data=hf_embeddings" in extra else [f"data.files=[{hf['corpus']}]",
                                                      f"data.windows_dir={hf['root'] / 'windows'}"]
    return compose([
        f"experiment={experiment}", f"target.path={hf[target]}", *text, f"output_dir={out}", "trainer=cpu",
        f"data.seq_len={SEQ}", "data.batch_size=4", "data.val_windows=4", "data.val_batch_size=4",
        "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.num_sanity_val_steps=0",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "optim.lr=3e-3", "optim.warmup_steps=1", *head, "callbacks.progress_bar=null",
        "callbacks.speculative_eval.num_prompts=2", "callbacks.speculative_eval.prompt_len=8",
        "callbacks.speculative_eval.max_new_tokens=8", *extra])


@pytest.fixture(scope="module")
def online(hf, tmp_path_factory):
    """6 steps with hidden states online, validation (and the evaluation callback) at 3 and 6."""
    return run(cfg(hf, tmp_path_factory.mktemp("online") / "run"))


def target(hf, name="llama"):
    return load_causal_lm(hf[name]).eval()


# ---------------------------------------------------------------- end to end

def test_online_run_trains_evaluates_exports_and_the_head_decodes(online, hf, capsys):
    assert online["global_step"] == 6
    out = online["output_dir"]
    state = torch.load(online["last_ckpt"], weights_only=True)["state_dict"]
    assert state and all(k.startswith("head.") for k in state)                      # the target stays out
    assert not any("embed" in k or "lm_head" in k for k in state)
    metrics = online["metrics"]
    for key in ("train/loss", "val/prophet_loss", "val/simulated_tokens_per_call", "val/teacher_forced_accuracy/pos5",
                "val/tokens_per_call/t0", "val/tokens_per_call/t1", "val/speedup/t0"):
        assert math.isfinite(metrics[key]), key
    rows = [json.loads(line) for line in (out / "speculative_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2                                  # 2 validations x 2 prompts x 2 temperatures
    assert all(r["matches_base"] for r in rows if r["temperature"] == 0)   # greedy speculative = greedy plain
    assert all(isinstance(r["continuation"], str) for r in rows)
    # the export: the head alone, with its target's identity; it decodes exactly the target's greedy tokens
    config = read_export_config(online["export_dir"])
    model = target(hf)
    assert config["kind"] == "hf_prophet" and config["target"]["weights_sha256"] == weights_sha256(model)
    assert config["target"]["path"] == str(hf["llama"].resolve()) and config["metadata"]["global_step"] == 6
    head = load_export(online["export_dir"], target=model)
    prompts = [torch.tensor([4, 9, 12]), torch.tensor([7, 5, 20, 21, 6])]
    plain, _ = generate(model, prompts, 12, sampling=GREEDY)
    spec, stats = generate(model, prompts, 12, HeadDrafter(head), sampling=GREEDY)
    assert [t.tolist() for t in spec] == [t.tolist() for t in plain] and stats.tokens_per_call >= 1
    status, out, err = cli(capsys, "--hf-model", hf["llama"], "--prophet", online["export_dir"], "--prompt",
                           "the quick fox", "--max-new-tokens", "8", "--temperature", "0", "--gamma", "3", "--json")
    assert status == 0, err
    assert json.loads(out)["stats"]["method"] == "prophet"


def test_the_exported_head_refuses_another_target_in_one_line(online, hf, capsys):
    with pytest.raises(SpecdecError, match="trained for another target") as error:
        load_export(online["export_dir"], target=target(hf, "other"))
    assert "\n" not in str(error.value)
    assert_usage_error(capsys, "trained for another target", "--hf-model", hf["other"], "--prophet",
                       online["export_dir"], "--prompt", "the")


@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_a_resumed_run_ends_with_the_uninterrupted_runs_head(online, hf, tmp_path, monkeypatch):
    build = train_run.build_callbacks
    monkeypatch.setattr(train_run, "build_callbacks", lambda c: build(c) + [StopAt(3)])
    first = run(cfg(hf, tmp_path / "first"))
    monkeypatch.setattr(train_run, "build_callbacks", build)
    resumed = run(cfg(hf, tmp_path / "resumed", f"ckpt_path={first['last_ckpt']}"))
    assert (first["global_step"], resumed["global_step"]) == (3, 6)
    a = torch.load(resumed["last_ckpt"], weights_only=True)["state_dict"]
    b = torch.load(online["last_ckpt"], weights_only=True)["state_dict"]
    assert a.keys() == b.keys()
    for name, tensor in b.items():
        torch.testing.assert_close(a[name], tensor, msg=name)


# ---------------------------------------------------------------- the hidden-state cache

@pytest.fixture(scope="module")
def caches(hf, tmp_path_factory):
    """bfloat16 and int8 caches of the NeoX target on text windows, and one of its own continuations."""
    d = tmp_path_factory.mktemp("caches")
    common = dict(seq_len=SEQ, windows=24, shard_size="16KB", batch_size=4, seed=2)
    lines = []
    text = {dtype: hf_cache(hf["neox"], d / dtype, text=[str(hf["corpus"])], dtype=dtype, report=lines.append,
                                  **common) for dtype in ("bfloat16", "int8")}
    regenerated = hf_cache(hf["neox"], d / "regenerated", prompts=hf["prompts"], chat=True,
                                 temperatures=[0.0, 1.0], **common)
    return {"dir": d, "text": text, "regenerated": regenerated, "report": lines}


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_cached_hidden_states_are_the_online_ones_at_the_caches_precision(hf, caches, dtype):
    from train.tasks.hf_prophet import HFProphetModule, validate

    path = caches["dir"] / dtype
    meta = read_cache_meta(path)
    assert meta["model"]["weights_sha256"] == weights_sha256(target(hf, "neox")) and meta["dtype"] == dtype
    assert len(meta["files"]) > 1 and any("the cache will take about" in line for line in caches["report"])
    batch = cache_rows(open_cache(path, meta), np.arange(6), meta)
    module = HFProphetModule(**validate(cfg(hf, "/unused", "data=hf_embeddings", f"data.cache={path}", target="neox"),
                                        _options()))
    online_hidden = module.head.target_hidden(batch["tokens"][:, :-1], logits=False)[0]
    scale = online_hidden.abs().amax(-1, keepdim=True)
    error = ((batch["embeds"].float() - online_hidden).abs() / scale).max().item()
    assert error <= (2 ** -8 if dtype == "bfloat16" else 0.5 / 127) + 1e-6              # one rounding step
    with torch.no_grad():                       # the head's loss on cached and on online hidden states agree
        cached_loss, _ = module._losses(batch["tokens"], batch["embeds"], 0)
        online_loss, _ = module._losses(batch["tokens"], online_hidden, 0)
    assert cached_loss.item() == pytest.approx(online_loss.item(), rel=2e-2)


def _options(distill=None):
    from train.tasks.prophet_frozen import FrozenProphetOptions

    return FrozenProphetOptions(distill=distill)


def test_a_regenerated_cache_holds_prompts_and_the_targets_own_continuations(hf, caches):
    from train.data.hf_embeddings import HFEmbeddingsDataModule

    path = caches["dir"] / "regenerated"
    meta = read_cache_meta(path)
    assert meta["source"]["kind"] == "regenerated" and meta["source"]["temperatures"] == [0.0, 1.0]
    eos = hf["tok"].eos_token_id                                  # the chat template's end of turn too
    assert meta["source"]["eos_id"] == eos and meta["layers"] == [2] and meta["depth"] == 2
    rows = cache_rows(open_cache(path, meta), np.arange(24), meta)
    model = target(hf, "neox")
    for i in (0, 2):                                              # even rows: temperature 0, the target's greedy tokens
        n = int(rows["prompt_len"][i])
        prompt = rows["tokens"][i, :n]
        assert hf["tok"].decode(prompt.tolist()).startswith("<bos> user")              # the chat template
        expected = model.generate(prompt[None], attention_mask=torch.ones(1, n, dtype=torch.long),
                                  max_new_tokens=SEQ + 1 - n, do_sample=False, pad_token_id=eos,
                                  eos_token_id=eos)[0, : SEQ + 1].tolist()         # stops at EOS
        assert rows["tokens"][i].tolist() == expected + [eos] * (SEQ + 1 - len(expected))     # padded after it
        assert int(rows["valid_len"][i]) == len(expected)
    valid = rows["valid_len"]
    answers = [rows["tokens"][i, int(rows["prompt_len"][i]):int(valid[i])].tolist() for i in range(24)]
    assert all(a.count(eos) <= 1 and (eos not in a or a[-1] == eos) for a in answers)   # cut right after the stop
    assert all(int(v) == SEQ + 1 or a[-1] == eos for a, v in zip(answers, valid, strict=True))
    assert (valid < SEQ + 1).any()                                # some sampled rows stop (seeded)
    data = HFEmbeddingsDataModule(cache=str(path), seq_len=SEQ, batch_size=4, val_windows=4)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert set(batch) == {"tokens", "embeds", "prompt_len", "valid_len"} and batch["valid_len"].shape == (4,)
    prompts = data.prompts(2, 8)
    assert all(p.tolist() == rows["tokens"][i, : len(p)].tolist() for p, i in zip(prompts, (20, 23), strict=True))
    assert "<bos> user" in data.decode_text(prompts[0])


@pytest.mark.parametrize("distill", [None, "fkl"])
def test_a_cached_run_trains_and_decodes_with_the_evaluation_callback(hf, caches, tmp_path, distill):
    extra = [f"task.distill={distill}"] if distill else []
    result = run(cfg(hf, tmp_path / "run", "data=hf_embeddings", f"data.cache={caches['dir'] / 'regenerated'}",
                     *extra, target="neox"))
    metrics = result["metrics"]
    assert result["global_step"] == 6 and math.isfinite(metrics["val/simulated_tokens_per_call"])
    assert ("val/distill_loss" in metrics) == (distill is not None)
    rows = [json.loads(line) for line in (result["output_dir"] / "speculative_samples.jsonl").read_text().splitlines()]
    assert all(r["matches_base"] for r in rows if r["temperature"] == 0)
    assert all(r["prompt"].startswith("<bos> user") for r in rows)                   # the rows' own chat prompts
    assert read_export_config(result["export_dir"])["metadata"]["embeddings"] == "cached"


def test_prompts_from_text_are_seeded_instructions_around_snippets():
    text = " ".join(f"word{i} alpha beta gamma delta" for i in range(400))
    a, b = prompts_from_text(text, 5, seed=1), prompts_from_text(text, 5, seed=1)
    assert a == b and len(a) == 5 and a != prompts_from_text(text, 5, seed=2)
    assert all("\n\n" in p and len(p.split("\n\n", 1)[1].split()) >= 8 for p in a)


# ---------------------------------------------------------------- bad input, one line, before any work

@pytest.mark.parametrize("extra,message", [
    (["target.path=/nonexistent/model.gguf"], "GGUF file /nonexistent/model.gguf does not exist"),
    (["target.path=/nonexistent/dir"], "model directory /nonexistent/dir does not exist"),
    (["data.tokenizer=MISMATCH"], "tokenizers differ in size"),
    (["data=hf_embeddings", "data.cache=OTHER_CACHE"], "was made by another model than target.path"),
    (["data=hf_embeddings", "data.cache=/nonexistent/cache"], "does not exist"),
    (["head.prophet_train_length=5"], "must be >= gamma + 1 = 6"),
    (["data.seq_len=4"], "must hold one window"),
    (["task.distill=kl"], "task.distill must be null or one of"),
])
def test_bad_input_fails_in_one_line_before_any_work(hf, caches, tmp_path, extra, message):
    # OTHER_CACHE: the NeoX target's cache, given with the Llama target
    extra = [e.replace("MISMATCH", str(hf["mismatch"])).replace("OTHER_CACHE", str(caches["dir"] / "bfloat16"))
             for e in extra]
    out = tmp_path / "run"
    with pytest.raises(SpecdecError) as error:
        run(cfg(hf, out, *extra))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not out.exists()


def test_the_cache_builder_refuses_bad_input_in_one_line_before_any_work(hf, tmp_path, capsys):
    from conftest import command

    script = command("cache_embeddings")
    out = tmp_path / "c"
    for argv, message in [(["--gguf", "/nonexistent/m.gguf", "--prompts", str(hf["prompts"])], "does not exist"),
                          (["--hf-model", str(hf["llama"])], "give either text files or a prompts file"),
                          (["--hf-model", str(hf["llama"]), "--prompts", "/nonexistent.jsonl"], "does not exist"),
                          (["--hf-model", str(hf["llama"]), "--text", str(hf["corpus"]), "--top-k-logits", "4"],
                           "--data and --top-k-logits are for --export")]:
        assert script.main(argv + ["--out", str(out), "--seq-len", "16", "--windows", "4"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
        assert not out.exists() and not (tmp_path / "c.partial").exists()
    assert script.main(["--hf-model", str(hf["llama"]), "--text", str(hf["corpus"]), "--out", str(out), "--seq-len",
                        "16", "--windows", "4", "--dtype", "int8"]) == 0
    printed = capsys.readouterr().out
    assert printed.index("will take about") < printed.index("cache: ")                  # the size comes first


def test_an_interrupted_regenerated_cache_resumes_to_the_uninterrupted_rows(hf, caches, tmp_path):
    common = dict(seq_len=SEQ, windows=24, shard_size="16KB", batch_size=4, seed=2, prompts=hf["prompts"], chat=True,
                  temperatures=[0.0, 1.0])
    assert_an_interrupted_build_resumes(hf["neox"], tmp_path / "regenerated", caches["dir"] / "regenerated", 8 * SEQ,
                                        **common)


# ---------------------------------------------------------------- the SmolLM2 pipeline's scripts, on tiny targets

def _script(name):
    from conftest import command

    return command(name).main


def test_make_prompts_writes_chat_prompts_from_disjoint_splits(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i} alpha beta gamma delta" for i in range(3000)))
    make = _script("make_prompts")
    for split in ("train", "valid"):
        out = tmp_path / f"{split}.jsonl"
        assert make(["--text", str(text), "--split", split, "--count", "6", "--out", str(out)]) == 0
    rows = {s: [json.loads(line)["messages"][0] for line in (tmp_path / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "valid")}
    assert all(len(r) == 6 and all(m["role"] == "user" for m in r) for r in rows.values())
    numbers = {s: {w for m in r for w in m["content"].split() if re.fullmatch(r"word\d+", w)} for s, r in rows.items()}
    assert numbers["train"] and numbers["valid"] and not numbers["train"] & numbers["valid"]   # no shared snippet
    capsys.readouterr()
    assert make(["--text", str(tmp_path / "missing.txt"), "--count", "2", "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.jsonl").exists()


def test_compare_hf_drafts_prepares_a_student_and_compares_the_three_drafters(online, hf, caches, tmp_path, capsys):
    compare = _script("compare_hf_drafts")
    models = tmp_path / "models"
    assert compare(["student", "--target", str(hf["llama"]), "--depth", "1", "--out", str(models)]) == 0
    assert compare(["corpus", "--target", str(hf["llama"]), "--cache", str(caches["dir"] / "regenerated"),
                    "--val-windows", "4", "--out", str(models / "corpus.jsonl")]) == 0
    student = load_causal_lm(models / "student")
    assert student.config.num_hidden_layers == 1
    assert weights_sha256(load_causal_lm(models / "target")) == weights_sha256(target(hf))       # a plain copy
    corpus = [json.loads(line)["text"] for line in (models / "corpus.jsonl").read_text().splitlines()]
    regenerated = caches["dir"] / "regenerated"
    rows = cache_rows(open_cache(regenerated), np.arange(20), read_cache_meta(regenerated))
    assert len(corpus) == 20 and corpus[3] == hf["tok"].decode(rows["tokens"][3].tolist())     # training rows only
    capsys.readouterr()

    out = tmp_path / "report"
    argv = ["compare", "--target", str(hf["llama"]), "--prophet", str(online["export_dir"]), "--student",
            str(models / "student"), "--prompts", str(hf["prompts"]), "--chat", "--count", "4", "--batch1-count", "2",
            "--max-new-tokens", "6", "--rounds", "2", "--check-count", "2", "--random-head", "--prompt-lookup", "3",
            "--dtype", "float32", "--out", str(out)]
    assert compare(argv) == 0, capsys.readouterr().err
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[prompts] T=")]
    assert len(progress) == 4 and "prophet (trained)" in progress[0]      # a line per (T, batch) as it ends
    with pieces_off({"linear"}):                                  # a benchmark's torch-only layers
        assert compare([*argv[:-1], str(tmp_path / "b1"), "--batch1-only", "--rounds", "1", "--no-eos-stop"]) == 0
    b1 = json.loads((tmp_path / "b1" / "results.json").read_text())
    assert {r["batch"] for r in b1["rows"]} == {1} and b1["settings"]["layers"] == "torch's own linear layers"
    for r in b1["rows"]:
        assert r["new_tokens"] == r["prompts"] * 6                      # every row emits exactly 6 tokens
    assert "every row decodes max_new_tokens" in (tmp_path / "b1" / "table.md").read_text()
    assert "every row stops at the end of its answer" in (out / "table.md").read_text()
    report = json.loads((out / "results.json").read_text())
    assert report["settings"]["layers"] == describe("cpu", torch.float32)      # float32 on the CPU: prepared for it
    assert report["settings"]["layers"].startswith("few-row linear layers (")
    assert f"Target and drafters in float32, {describe('cpu', torch.float32)}" in (out / "table.md").read_text()
    assert "torch's own linear layers" in (tmp_path / "b1" / "table.md").read_text()
    assert "the median over 2 rounds in one process" in (out / "table.md").read_text()
    assert "the median over 1 round in one process" in (tmp_path / "b1" / "table.md").read_text()
    methods = ["plain", "prophet (trained)", "student (distilled)", "prompt lookup (transformers, n=3)",
               "random head (untrained)"]
    lookup = methods[3]
    assert report["greedy_equals_transformers_generate"] == {m: True for m in methods if m != lookup}
    rows = report["rows"]
    # prompt lookup decodes one row at a time: it runs at batch 1 only
    expected = [(t, b, m) for t in (0.0, 1.0) for b in (1, 8) for m in methods if b == 1 or m != lookup]
    assert [(r["temperature"], r["batch"], r["method"]) for r in rows] == expected
    for r in rows:
        assert r["prompt_set"] == "prompts" and r["speedup"] > 0
        assert r["new_tokens"] <= 2 * r["prompts"] * 6                  # up to 6 tokens a row (to <|im_end|>), 2 rounds
        if r["temperature"] == 0:                                         # greedy: every method emits plain's rows
            assert r["new_tokens"] == next(p["new_tokens"] for p in rows if p["method"] == "plain"
                                           and p["batch"] == r["batch"] and p["temperature"] == 0)
        assert r["tokens_per_call"] == pytest.approx(r["new_tokens"] / r["row_calls"])
        # a batched call serves every unfinished row: between row_calls / rows and row_calls calls
        rows_at_once = r["batch"] if r["method"] != lookup else 1
        assert r["row_calls"] / rows_at_once <= r["target_calls"] <= r["row_calls"]
        assert r["batch"] > 1 or r["target_calls"] == r["row_calls"]
        assert (r["acceptance_rate"] is None) == (r["method"] in ("plain", lookup))
        assert r["method"] != "plain" or r["tokens_per_call"] == 1
        assert r["greedy_equal_plain"] is (True if r["temperature"] == 0 else None), r["method"]
        drafted = r["drafted"]
        assert len(r["per_position_acceptance"]) == (5 if drafted else 0)
    assert (out / "table.md").read_text().count("\n| ") == len(expected) and (out / "compare.png").stat().st_size > 1000
    assert not list(tmp_path.glob(".tmp-*"))                       # written whole, no temporary left


@pytest.mark.parametrize("case,message", [
    ("missing_prophet", "does not exist"),
    ("other_target", "trained for another target"),
    ("no_drafter", "give --eagle3 NAME=DIR, --prophet, --student and/or --prompt-lookup N"),
    ("mismatch_student", "tokenizers differ"),
    ("bad_device", "is not a torch device"),
    ("absent_device", "no CUDA device is available here" if not torch.cuda.is_available() else "runs on cpu or cuda"),
])
def test_compare_hf_drafts_refuses_bad_input_in_one_line(online, hf, tmp_path, capsys, case, message):
    compare = _script("compare_hf_drafts")
    drafter = {"missing_prophet": ["--prophet", str(tmp_path / "nothing")],
               "other_target": ["--prophet", str(online["export_dir"])],
               "no_drafter": [],
               "mismatch_student": ["--student", str(hf["mismatch"])],
               "bad_device": ["--prompt-lookup", "3", "--device", "gpu0"],
               "absent_device": ["--prompt-lookup", "3",
                                 "--device", "cuda" if not torch.cuda.is_available() else "meta"]}[case]
    target_dir = hf["other"] if case == "other_target" else hf["llama"]
    status = compare(["compare", "--target", str(target_dir), *drafter, "--prompts", str(hf["prompts"]), "--chat",
                      "--count", "2", "--batch1-count", "1", "--out", str(tmp_path / "report")])
    err = capsys.readouterr().err
    if case == "other_target":             # told by the weights' hash: after the target loads (its progress bar)
        err = err.splitlines()[-1]
    assert status == 2 and err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "report").exists()
