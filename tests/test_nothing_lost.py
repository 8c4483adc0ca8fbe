"""Nothing lost: every writer asks `specdec_models.files.check_output` before any work, and every
bad or unusual input is one line with exit status 2 that leaves every file as it was (the listing,
sizes, modification times and bytes of the folders around it, `snapshot`).

The rule: an existing file is replaced only with --force; a non-empty folder only when specdec
marked it as the same kind of output, else with --force (overwrite=true for a run, which keeps
files it did not write); a path that is, holds or lies inside one of the command's own inputs
never, whatever the flags. Then the inputs a new user tried that crashed, or were accepted though
they should not be. Tiny random models and generated data; scripts run in-process."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from conftest import StopAt, command

from specdec_models.errors import SpecdecError
from specdec_models.files import MARKER, check_not_input, check_output, folder_kind, mark_dir, staged_dir

pytestmark = pytest.mark.usefixtures("offline", "one_thread")


def snapshot(*folders: Path) -> dict[str, tuple[int, int, bytes]]:
    """(size, mtime in ns, bytes) of every file under `folders`, and every folder's entry."""
    seen: dict[str, tuple[int, int, bytes]] = {}
    for folder in folders:
        for path in sorted([folder, *folder.rglob("*")]) if folder.exists() else []:
            stat = path.stat()
            seen[str(path)] = (stat.st_size, stat.st_mtime_ns, path.read_bytes() if path.is_file() else b"")
    return seen


def one_line(capsys, status: int, match: str) -> str:
    """The script's error: exit status 2, one line on stderr naming `match`, no traceback."""
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert match in err, err
    return err.strip()


@pytest.fixture
def user_files(tmp_path) -> Path:
    """A folder of a user's own files, one of them in a subfolder."""
    folder = tmp_path / "mine"
    (folder / "notes").mkdir(parents=True)
    (folder / "thesis.txt").write_text("three years of work\n")
    (folder / "notes" / "a.md").write_text("# a\n")
    return folder


# ---------------------------------------------------------------- the rule itself

def test_a_file_is_replaced_only_with_force(tmp_path):
    path = tmp_path / "out.jsonl"
    assert check_output(path, "--out") is False                   # absent: fine
    path.write_text("mine\n")
    with pytest.raises(SpecdecError,
                       match=r"^--out .*out.jsonl exists: choose another file, or replace it with --force"):
        check_output(path, "--out")
    assert check_output(path, "--out", force=True) is True
    with pytest.raises(SpecdecError, match="is a directory: give the file to write"):
        check_output(tmp_path, "--out", force=True)


def test_a_folder_is_replaced_only_when_specdec_marked_it_as_the_same_kind(user_files, tmp_path):
    assert check_output(tmp_path / "new", "--out", kind="compare report") is False
    (tmp_path / "empty").mkdir()
    assert check_output(tmp_path / "empty", "--out", kind="compare report") is False
    with pytest.raises(SpecdecError) as error:
        check_output(user_files, "--out", kind="compare report")
    assert str(error.value) == (f"--out {user_files} holds files specdec did not write (notes, thesis.txt): choose "
                                f"another --out, or replace it with --force")
    assert check_output(user_files, "--out", kind="compare report", force=True) is True
    with staged_dir(tmp_path / "report", kind="compare report") as tmp:
        (tmp / "table.md").write_text("| a |\n")
    assert folder_kind(tmp_path / "report") == "compare report" and (tmp_path / "report" / MARKER).is_file()
    assert check_output(tmp_path / "report", "--out", kind="compare report") is True     # its own: replaced
    with pytest.raises(SpecdecError, match=r"holds specdec's compare report \(table.md\), not a heldout report"):
        check_output(tmp_path / "report", "--out", kind="heldout report")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "steps.json").write_text("{}")           # a recipe folder from before the markers
    assert check_output(tmp_path / "old", "--out", kind="smollm2 recipe", records=["steps.json"]) is True
    mark_dir(tmp_path / "old", "smollm2 recipe")
    assert folder_kind(tmp_path / "old") == "smollm2 recipe"


@pytest.mark.parametrize("target, relation", [(".", "is"), ("..", "holds"), ("sub", "lies inside")])
def test_an_input_is_never_written_over_whatever_the_flags(tmp_path, target, relation):
    source = tmp_path / "run" / "export"
    source.mkdir(parents=True)
    out = (source / target).resolve()
    for kind in (None, "compare report"):
        with pytest.raises(SpecdecError) as error:
            check_output(out, "--out", kind=kind, force=True, inputs=[None, "", source])
        assert str(error.value) == (f"--out {out} {relation} the input {source}: write elsewhere (an input of the "
                                    f"command is never replaced, not even with --force)")
    check_not_input(tmp_path / "elsewhere", [source], "--out")     # a sibling is fine


# ---------------------------------------------------------------- scripts/compare_hf_drafts.py

def compare_hf_drafts(argv) -> int:
    return command("compare_hf_drafts").main([str(a) for a in argv])


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    return path


@pytest.mark.parametrize("command", ["compare", "acceptance", "heldout"])
def test_a_report_never_empties_a_folder_of_other_files(command, user_files, prompts, tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "cache.json").write_text("{}")
    before = snapshot(user_files, prompts.parent)
    argv = {"compare": ["--prompt-lookup", 3, "--prompts", prompts],
            "acceptance": ["--eagle3", f"h={tmp_path / 'head'}", "--prompts", prompts],
            "heldout": ["--eagle3", f"h={tmp_path / 'head'}", "--cache", cache, "--temperatures", 1]}[command]
    err = one_line(capsys, compare_hf_drafts([command, *argv, "--out", user_files]),
                   f"--out {user_files} holds files specdec did not write (notes, thesis.txt)")
    assert err.endswith("or replace it with --force")
    assert snapshot(user_files, prompts.parent) == before
    # the recipe's folder given for its report folder: the cache and heads inside stay
    recipe = tmp_path / "smollm2"
    (recipe / "cache").mkdir(parents=True)
    mark_dir(recipe, "smollm2 recipe")
    before = snapshot(recipe)
    one_line(capsys, compare_hf_drafts([command, *argv, "--out", recipe]),
             f"--out {recipe} holds specdec's smollm2 recipe (cache), not a {command} report")
    assert snapshot(recipe) == before
    # a report folder that is one of the command's inputs is refused even with --force
    source = {"compare": prompts, "acceptance": tmp_path / "head", "heldout": cache}[command]
    one_line(capsys, compare_hf_drafts([command, *argv, "--out", source, "--force"]), f"is the input {source}")


def test_student_never_replaces_model_folders_it_did_not_write(user_files, tmp_path, capsys):
    models = tmp_path / "models"
    (models / "student").mkdir(parents=True)
    (models / "student" / "my_model.safetensors").write_bytes(b"weights")
    before = snapshot(models)
    one_line(capsys, compare_hf_drafts(["student", "--out", models]),
             f"--out {models / 'student'} holds files specdec did not write (my_model.safetensors)")
    assert snapshot(models) == before
    # the target the student is cut from is an input: never replaced by the copy of it
    one_line(capsys, compare_hf_drafts(["student", "--target", models / "target", "--out", models, "--force"]),
             f"--out {models / 'target'} is the input {models / 'target'}")


@pytest.mark.parametrize("command", ["corpus", "datastore"])
def test_corpus_and_datastore_never_overwrite_an_existing_file(command, prompts, tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "cache.json").write_text("{}")
    before = snapshot(tmp_path)
    one_line(capsys, compare_hf_drafts([command, "--cache", cache, "--out", prompts]),
             f"--out {prompts} exists: choose another file, or replace it with --force")
    one_line(capsys, compare_hf_drafts([command, "--cache", cache, "--out", cache / "rows.npz", "--force"]),
             f"lies inside the input {cache}")
    assert snapshot(tmp_path) == before


def test_make_prompts_and_draft_vocab_never_write_over_their_inputs(prompts, tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text("{}")
    before = snapshot(tmp_path)
    one_line(capsys, command("make_prompts").main(["--text", str(prompts), "--count", "2", "--out", str(prompts),
                                                       "--force"]), f"--out {prompts} is the input {prompts}")
    one_line(capsys, command("draft_vocab").main(["--cache", str(tmp_path / "cache"), "--out",
                                                      str(tmp_path / "counts.json"), "--report", str(report)]),
             f"--report {report} exists")
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- python -m train: run(cfg)

FAST = ["trainer.max_steps=4", "trainer.val_check_interval=2", "callbacks.speculative_eval.num_prompts=1",
        "callbacks.speculative_eval.prompt_len=8", "callbacks.speculative_eval.max_new_tokens=4"]


@pytest.fixture(scope="module")
def trained(tiny_cfg, tmp_path_factory) -> dict:
    """A 4-step tiny run, evaluated (and its samples written) at steps 2 and 4."""
    from train.run import run

    return run(tiny_cfg(tmp_path_factory.mktemp("trained") / "run", *FAST))


def samples(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "speculative_samples.jsonl").read_text().splitlines()]


def test_overwrite_never_deletes_the_export_the_run_reads(trained, tiny_corpus, compose, tmp_path):
    import shutil

    from train.run import run

    folder = tmp_path / "run"
    shutil.copytree(trained["output_dir"], folder)
    before = snapshot(folder)
    cfg = compose(["experiment=tiny_draft_distill", f"teacher.export={folder / 'export'}", f"data.path={tiny_corpus}",
                   "data.allow_short=true", f"output_dir={folder}", "overwrite=true"])
    with pytest.raises(SpecdecError) as error:
        run(cfg)
    assert str(error.value) == (f"output directory {folder} holds the input {folder / 'export'}: write elsewhere (an "
                                f"input of the command is never replaced, not even with overwrite=true)")
    assert snapshot(folder) == before


def test_overwrite_replaces_the_earlier_runs_samples(trained, tiny_cfg, tmp_path):
    import shutil

    from train.run import run

    folder = tmp_path / "run"
    shutil.copytree(trained["output_dir"], folder)
    assert [r["step"] for r in samples(folder)] == [2, 2, 4, 4]          # 1 prompt x 2 temperatures, 2 evaluations
    with open(folder / "speculative_samples.jsonl", "a") as f:
        f.write(json.dumps({"step": 0, "earlier": True}) + "\n")
    run(tiny_cfg(folder, *FAST, "overwrite=true"))
    rows = samples(folder)
    assert [r["step"] for r in rows] == [2, 2, 4, 4] and not any("earlier" in r for r in rows)


class KilledAfterEvaluating(StopAt):
    """Raises after the evaluation of step `step` wrote its samples, before its checkpoint (Lightning
    calls the checkpoint callbacks' on_validation_end last): a kill between the two."""

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.global_step >= self.step:
            raise RuntimeError("killed")


def test_a_run_killed_between_an_evaluation_and_its_checkpoint_lists_that_steps_samples_once(tiny_cfg, tmp_path):
    from train.run import run

    folder = tmp_path / "run"
    with pytest.raises(RuntimeError, match="killed"):
        run(tiny_cfg(folder, *FAST), callbacks=[KilledAfterEvaluating(4)])
    assert [r["step"] for r in samples(folder)] == [2, 2, 4, 4]
    assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    result = run(tiny_cfg(folder, *FAST, f"ckpt_path={folder / 'checkpoints' / 'last.ckpt'}"))
    assert result["global_step"] == 4
    assert [r["step"] for r in samples(folder)] == [2, 2, 4, 4]            # step 4's samples once


def test_output_dir_holding_other_files_is_refused_and_overwrite_keeps_them(tiny_cfg, user_files):
    from train.run import run

    before = snapshot(user_files)
    with pytest.raises(SpecdecError) as error:
        run(tiny_cfg(user_files, *FAST))
    assert str(error.value) == (f"output directory {user_files} holds files specdec did not write (notes, thesis.txt): "
                                f"choose another output directory, or write beside them with overwrite=true")
    assert snapshot(user_files) == before
    run(tiny_cfg(user_files, *FAST, "trainer.max_steps=2", "overwrite=true"))
    assert {k: v for k, v in snapshot(user_files).items() if k in before and Path(k).is_file()} == {
        k: v for k, v in before.items() if Path(k).is_file()}                # the user's files, untouched
    assert folder_kind(user_files) == "training run" and (user_files / "export" / "config.json").is_file()


def test_an_empty_output_dir_is_refused_not_taken_as_a_new_dated_folder(tiny_cfg, tmp_path, monkeypatch):
    from train.run import run

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecdecError, match=r"^output_dir must be a folder or null .*got ''$"):
        run(tiny_cfg("''"))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- crashes that are one line now

@pytest.fixture(scope="module")
def eagle3_heads(tmp_path_factory) -> dict:
    """A tiny Llama target and an eagle3 head for it in the speculators layout: one naming a hub
    verifier (no local target), one naming the target's folder."""
    pytest.importorskip("transformers")
    from test_eagle3_export import deep_llama, perturbed_head

    from specdec_models.export.eagle3 import save_eagle3

    root = tmp_path_factory.mktemp("eagle3_heads")
    target = deep_llama(root / "target")
    head = perturbed_head(target, draft=40, aux=[2, 3, 5])
    return {"root": root, "target": root / "target",
            "hub": save_eagle3(root / "hub", head, "speculators", verifier="org/target-model"),
            "local": save_eagle3(root / "local", head, "speculators", verifier=str(root / "target"))}


def decode(capsys, *argv) -> tuple[int, str, str]:
    from specdec_models.decode.__main__ import main

    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_a_speculators_head_without_a_target_is_one_line_or_uses_its_local_verifier(eagle3_heads, capsys):
    before = snapshot(eagle3_heads["root"])
    status, _, err = decode(capsys, "--eagle3", eagle3_heads["hub"], "--prompt", "hi")
    assert status == 2 and err.count("\n") == 1, err
    assert err.strip() == (f"error: the head in {eagle3_heads['hub']} names its verifier 'org/target-model', not a "
                           f"local path: give the target: --hf-model DIR or --gguf FILE")
    status, out, err = decode(capsys, "--eagle3", eagle3_heads["local"], "--prompt", "a", "--max-new-tokens", 3,
                              "--temperature", 0, "--dtype", "float32", "--json")
    assert status == 0 and json.loads(out)["method"] == "eagle3", err
    export = command("export_head").main
    out = eagle3_heads["root"] / "sglang"
    one_line(capsys, export([str(eagle3_heads["hub"]), str(out), "--layout", "sglang"]), "names its verifier")
    assert not out.exists()
    assert snapshot(eagle3_heads["root"]) == before
    assert export([str(eagle3_heads["local"]), str(out), "--layout", "sglang"]) == 0
    one_line(capsys, export([str(eagle3_heads["local"]), str(eagle3_heads["local"]), "--layout", "sglang", "--force"]),
             "is the input")
    assert (eagle3_heads["local"] / "config.json").is_file()


def test_a_pickled_model_that_would_run_code_is_one_line(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from test_hf_data import build_tokenizer

    folder = tmp_path / "evil"
    tok = build_tokenizer(folder)
    transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=32).save_pretrained(folder)
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    torch.save({"model.embed_tokens.weight": Payload()}, folder / "pytorch_model.bin")
    before = snapshot(tmp_path)
    status, _, err = decode(capsys, "--hf-model", folder, "--prompt", "hi")
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.strip() == (f"error: target: {folder} holds pickled weights that are not plain tensors (they call "
                           f"posix.system): refused, as loading them could run code; use a copy of the model saved "
                           f"as safetensors")
    assert not ran.exists() and snapshot(tmp_path) == before


def test_a_batch_past_the_memory_free_is_refused_before_any_work(tiny_decoder_export, capsys):
    started = time.perf_counter()
    status, _, err = decode(capsys, "--export", tiny_decoder_export, "--prompt", "hi", "--batch", 100_000_000)
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith("error: a batch of 100,000,000 rows of up to 202 positions needs at least ")
    assert "GiB for its KV caches and logits, more than the" in err
    assert err.strip().endswith("decode fewer rows at once")
    assert time.perf_counter() - started < 30                       # not split into rows first
    from specdec_models import load_export
    from specdec_models.decode import generate

    with pytest.raises(SpecdecError, match="a batch of 100,000,000 rows"):
        generate(load_export(tiny_decoder_export), torch.zeros(1, 4, dtype=torch.long).expand(100_000_000, 4), 8)


# ---------------------------------------------------------------- accepted, but should not be

@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_a_temperature_that_is_no_finite_number_is_refused(tiny_decoder_export, capsys, value):
    status, _, err = decode(capsys, "--export", tiny_decoder_export, "--prompt", "hi", "--temperature", value)
    assert status == 2 and err.startswith("error: temperature must be >= 0 and finite, got") and err.count("\n") == 1


def test_cache_embeddings_threads_0_is_refused(tmp_path, capsys):
    status = command("cache_embeddings").main(["--hf-model", str(tmp_path / "m"), "--text", "a.txt", "--out",
                                                   str(tmp_path / "cache"), "--threads", "0"])
    one_line(capsys, status, "--threads must be >= 1, got 0")
    status = command("cache_embeddings").main(["--hf-model", str(tmp_path), "--text", "a.txt", "--out",
                                                   str(tmp_path / "cache"), "--overwrite"])
    one_line(capsys, status, f"--out {tmp_path / 'cache'} lies inside the input {tmp_path}")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def text_cache(tmp_path_factory) -> Path:
    """A 12-row text-window cache of a tiny Llama target (test_hf_distill.save_model) over a
    word-level tokenizer."""
    pytest.importorskip("transformers")
    from conftest import hf_cache
    from test_hf_data import text_setup
    from test_hf_distill import save_model

    setup = text_setup(tmp_path_factory.mktemp("text_cache"), docs=80, prompt_docs=4)
    target = save_model(setup["root"] / "target", setup["tok"], "llama", 1)
    hf_cache(target, setup["root"] / "cache", text=[str(setup["corpus"])], seq_len=16, windows=12, batch_size=4)
    return setup["root"] / "cache"


def test_draft_vocab_refuses_a_size_it_would_ignore(text_cache, tmp_path, capsys):
    from train.data.embeddings_cache import read_cache_meta

    vocab = read_cache_meta(text_cache)["vocab_size"]
    status = command("draft_vocab").main(["--cache", str(text_cache), "--out", str(tmp_path / "counts.json"),
                                              "--sizes", "8,100000", "--val-windows", "4"])
    one_line(capsys, status, f"--sizes 100000: a draft vocabulary is smaller than the target's {vocab} tokens")
    assert list(tmp_path.iterdir()) == []


def test_make_prompts_count_is_bounded(tmp_path, capsys):
    started = time.perf_counter()
    status = command("make_prompts").main(["--kind", "open", "--count", "100000000", "--out",
                                               str(tmp_path / "p.jsonl")])
    one_line(capsys, status, "--count 100000000 is more than the 1,000,000 prompts this script makes")
    assert time.perf_counter() - started < 5 and list(tmp_path.iterdir()) == []


def test_a_cut_gguf_file_is_said_to_be_damaged_not_its_tokenizer(tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((64, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(path.read_bytes()[:-1000])                 # a download cut short
    status, _, err = decode(capsys, "--gguf", path, "--prompt", "hi")
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: target: GGUF file {path} is cut short or damaged (it does not parse: ")
    assert "tokenizer" not in err and err.strip().endswith("copy or download it again")


def test_a_specdec_export_or_a_draft_head_given_as_a_model_says_what_it_is(tiny_decoder_export, eagle3_heads, capsys):
    status, _, err = decode(capsys, "--hf-model", tiny_decoder_export, "--prompt", "hi")
    assert status == 2 and "tokenizer" not in err
    assert err.strip() == (f"error: target: {tiny_decoder_export} is a specdec decoder export, not a Hugging Face "
                           f"model directory: pass it where an export is read (--export DIR; a head's: --prophet DIR "
                           f"or --eagle3 DIR)")
    status, _, err = decode(capsys, "--hf-model", eagle3_heads["hub"], "--prompt", "hi")
    assert status == 2 and err.strip() == (f"error: target: {eagle3_heads['hub']} is a speculators draft head, not a "
                                           f"Hugging Face model directory: pass it as --eagle3 DIR")


def test_acceptance_with_no_prompts_says_so(trained, tiny_corpus, capsys):
    status = command("acceptance").main(["--export", str(trained["export_dir"]), "--data", str(tiny_corpus),
                                             "--prompts", "0"])
    one_line(capsys, status, "--prompts must be a positive integer, got 0")
