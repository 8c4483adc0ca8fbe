"""Mistakes a user makes with `python -m train` and scripts/export.py: each is one line on
stderr, exit status 2, and creates nothing (no output folder, no config.yaml, no stray
outputs/<date>/<time>).

Most go through `run(cfg)` in process; the exit status and the working directory are checked
through the CLI: `python -m train` as a subprocess for Hydra's own errors and one of ours, and its
entry point in a forked child (`conftest.forked`, no second import of lightning) for the rest.
A read-only folder is tested in a child that drops root (who may write anywhere) to `nobody`."""

from __future__ import annotations

import csv
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import NOBODY, REPO, command, forked

from specdec_models import Decoder, ModelConfig, save_export
from specdec_models.errors import SpecdecError
from train.run import run

pytestmark = pytest.mark.usefixtures("offline", "one_thread")
FAST = ["trainer.max_steps=2", "trainer.val_check_interval=2", "callbacks.speculative_eval=null"]


@pytest.fixture(scope="module")
def trained(tiny_cfg, tmp_path_factory):
    """A 2-step tiny run: a real checkpoint to resume from and export."""
    return run(tiny_cfg(tmp_path_factory.mktemp("trained") / "run", *FAST))


def one_line_error(cfg, match: str, out: Path) -> str:
    with pytest.raises(SpecdecError) as error:
        run(cfg)
    message = str(error.value)
    assert match in message and "\n" not in message, message
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))
    return message


# ---------------------------------------------------------------- resuming from a bad checkpoint

def test_junk_ckpt_path_is_one_line(tiny_cfg, tmp_path):
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(os.urandom(4096))
    one_line_error(tiny_cfg(tmp_path / "run", f"ckpt_path={junk}"), "cannot read checkpoint", tmp_path / "run")


def test_truncated_ckpt_path_is_one_line(trained, tiny_cfg, tmp_path):
    half = tmp_path / "half.ckpt"
    data = trained["last_ckpt"].read_bytes()
    half.write_bytes(data[: len(data) // 2])
    one_line_error(tiny_cfg(tmp_path / "run", f"ckpt_path={half}"), "truncated or not a checkpoint", tmp_path / "run")


def test_checkpoint_of_another_model_size_is_one_line(trained, tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", f"ckpt_path={trained['last_ckpt']}", "model.main.dim=48",
                   "model.prophet.model.dim=48")
    message = one_line_error(cfg, "does not fit the configured model", tmp_path / "run")
    assert "main.dim is 32 there, 48 here" in message and "resume with the settings it was trained with" in message


def test_checkpoint_of_another_task_is_one_line(trained):
    from train.checkpoints import check_resumable, load_module

    module, ckpt = load_module(trained["last_ckpt"])
    with pytest.raises(SpecdecError, match="is a checkpoint of task=draft_distill, this run is task=prophet"):
        check_resumable(module, {**ckpt, "specdec_task": "draft_distill"}, "x.ckpt")


# ---------------------------------------------------------------- the output folder

def test_output_dir_that_is_a_file_is_one_line(tiny_cfg, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpecdecError, match="output directory .*file exists and is not a directory"):
        run(tiny_cfg(tmp_path / "file"))
    with pytest.raises(SpecdecError, match="file is a file, not a directory"):
        run(tiny_cfg(tmp_path / "file" / "run"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_read_only_output_folder_is_one_line(tiny_cfg, tiny_corpus, shared_dir):
    corpus = shared_dir / "corpus.gz"                 # readable by the child's user
    shutil.copy(tiny_corpus, corpus)
    os.chmod(corpus, 0o644)
    out = shared_dir / "readonly" / "run"
    cfg = tiny_cfg(out, f"data.path={corpus}", *FAST)
    child = forked(lambda: run(cfg), user=NOBODY)
    assert child.status == 71, child.output
    assert "SpecdecError: output directory" in child.output and "is not writable" in child.output
    assert not out.exists()


def test_an_output_folder_whose_export_is_another_model_is_refused_before_training(tiny_cfg, tmp_path):
    out = tmp_path / "run"
    save_export(out / "export", Decoder(ModelConfig(vocab_size=256, dim=32, depth=2, heads=2, dim_head=16)))
    with pytest.raises(SpecdecError, match="holds an earlier run .export.: resume it with ckpt_path=.*overwrite=true"):
        run(tiny_cfg(out))
    assert sorted(p.name for p in out.iterdir()) == ["export"]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def earlier_run(trained, tmp_path) -> Path:
    """A copy of a finished run's folder (checkpoints, csv/metrics.csv, config.yaml, train.log, export)."""
    folder = tmp_path / "earlier"
    shutil.copytree(trained["output_dir"], folder)
    return folder


def test_a_finished_runs_folder_is_refused_without_ckpt_path_or_overwrite(earlier_run, tiny_cfg):
    before = snapshot(earlier_run)
    with pytest.raises(SpecdecError) as error:
        run(tiny_cfg(earlier_run, *FAST))
    message = str(error.value)
    assert message == (f"output directory {earlier_run} holds an earlier run (config.yaml, train.log, checkpoints, "
                       f"csv, export): resume it with ckpt_path={earlier_run / 'checkpoints' / 'last.ckpt'}, choose a "
                       f"new output_dir, or replace it with overwrite=true")
    assert snapshot(earlier_run) == before


def test_overwrite_true_replaces_the_earlier_run_whole(earlier_run, tiny_cfg):
    result = run(tiny_cfg(earlier_run, *FAST, "trainer.max_steps=4", "trainer.val_check_interval=4", "overwrite=true"))
    assert result["global_step"] == 4
    assert [p.name for p in (earlier_run / "checkpoints").iterdir() if p.name.startswith("step")] == [
        result["best_ckpt"].name]                                         # the earlier run's best is gone
    with open(earlier_run / "csv" / "metrics.csv", newline="") as f:
        train_steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert train_steps == [0, 1, 2, 3]                                    # this run's rows only, once each
    assert "max_steps: 4" in (earlier_run / "config.yaml").read_text()
    assert (earlier_run / "train.log").read_text().count("training starts") == 1


def test_resuming_into_another_runs_folder_is_refused(trained, earlier_run, tiny_cfg):
    before = snapshot(earlier_run)
    for extra in ([], ["overwrite=true"]):
        with pytest.raises(SpecdecError) as error:
            run(tiny_cfg(earlier_run, f"ckpt_path={trained['last_ckpt']}", *extra))
        assert str(error.value).startswith(f"ckpt_path {trained['last_ckpt']} belongs to the run in "
                                           f"{trained['output_dir']}, and output directory {earlier_run} holds "
                                           f"another run")
        assert "a resumed run writes into its checkpoint's own folder" in str(error.value)
    assert snapshot(earlier_run) == before


# ---------------------------------------------------------------- callbacks, trainer, data

@pytest.mark.parametrize("override,match", [
    ("callbacks.speculative_eval.num_prompts=0", "speculative_eval.num_prompts must be a positive integer, got 0"),
    ("+callbacks.speculative_eval.bogus=1",
     "callbacks.speculative_eval is not valid: SpeculativeEval.__init__() got an unexpected keyword argument 'bogus'"),
    # what the evaluation decodes must fit the models: caught before the first step, not at the first validation
    ("callbacks.speculative_eval.gamma=7",
     "speculative_eval.gamma (7) needs a head that drafts gamma tokens per round: it drafts 6"),
    ("callbacks.speculative_eval.max_new_tokens=250",
     "speculative_eval.prompt_len + max_new_tokens = 266 exceeds the target's max_seq_len 256"),
    ("callbacks.periodic_checkpoint.every_minutes=0", "periodic_checkpoint.every_minutes must be > 0 or null"),
    ("callbacks.progress_bar.refresh_rate=0", "progress_bar.refresh_rate must be a positive integer"),
    ("trainer.precision=bogus", "trainer is not valid: Precision 'bogus' is invalid"),
    ("+trainer.bogus=1", "trainer is not valid: Trainer.__init__() got an unexpected keyword argument 'bogus'"),
])
def test_bad_callback_and_trainer_settings_are_one_line(tiny_cfg, tmp_path, override, match):
    if "speculative_eval" in override and importlib.util.find_spec("train.callbacks") is None:
        pytest.skip("no evaluation callback")
    one_line_error(tiny_cfg(tmp_path / "run", override), match, tmp_path / "run")


def test_unreadable_data_is_one_line_and_creates_nothing(tiny_cfg, tmp_path):
    bad = tmp_path / "corrupt.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00 not really gzip" * 100)
    one_line_error(tiny_cfg(tmp_path / "run", f"data.path={bad}"), str(bad), tmp_path / "run")


# ---------------------------------------------------------------- through the command line

def python_m_train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("args,match", [
    (["experiment=tiny", "data.seqlen=64"], "error: Could not override 'data.seqlen'. To append to your config "
                                            "use +data.seqlen=64: Key 'seqlen' is not in struct"),
    (["experiment=tiny", "data.seq_len=[1"], "error: no viable alternative at input '[1'"),
    (["experiment=tiny", "model=huge"], "error: In 'train': Could not find 'model/huge' Available options in "
                                        "'model': base mid small tiny"),
])
def test_hydra_mistakes_exit_2_in_one_line(tmp_path, args, match):
    result = python_m_train(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(match) and result.stderr.count("\n") == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_project_error_exits_2_in_one_line_and_creates_nothing(tmp_path):
    result = python_m_train("experiment=tiny", "data.path=/nonexistent/enwik8", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "error: data.path /nonexistent/enwik8 does not exist or is not a file\n"
    assert list(tmp_path.iterdir()) == []


def cli(*argv: str):
    def main():
        from train.__main__ import cli as train_cli

        sys.argv = ["train", *argv]
        train_cli()
    return main


def test_a_junk_checkpoint_through_the_cli_exits_2_and_creates_nothing(tiny_corpus, tmp_path):
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"PK\x03\x04" + os.urandom(100))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    child = forked(cli("experiment=tiny", f"data.path={tiny_corpus}", "data.allow_short=true",
                       f"ckpt_path={junk}"), cwd=cwd)
    assert child.status == 2
    (line,) = child.output.strip().splitlines()
    assert line.startswith(f"error: cannot read checkpoint {junk}")
    assert list(cwd.iterdir()) == []


def test_an_error_found_after_seeding_is_one_line_without_the_seed_message(tmp_path):
    bad = tmp_path / "corrupt.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00 not really gzip" * 100)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    child = forked(cli("experiment=tiny", f"data.path={bad}", "data.allow_short=true"), cwd=cwd)
    assert child.status == 2
    (line,) = child.output.strip().splitlines()                       # no "Seed set to 0" before it
    assert line.startswith("error: ") and str(bad) in line
    assert list(cwd.iterdir()) == []


def test_hydra_run_dir_is_the_output_dir(tiny_corpus, tmp_path):
    cwd, chosen = tmp_path / "cwd", tmp_path / "chosen" / "run"
    cwd.mkdir()
    child = forked(cli("experiment=tiny", f"data.path={tiny_corpus}", "data.allow_short=true", *FAST,
                       f"hydra.run.dir={chosen}"), cwd=cwd)
    assert child.status == 0, child.output[-3000:]
    assert {"config.yaml", "train.log", "checkpoints", "csv", "export"} <= {p.name for p in chosen.iterdir()}
    assert list(cwd.iterdir()) == []                                   # no outputs/<date>/<time>


def test_hydra_run_dir_and_another_output_dir_is_one_line_and_leaves_nothing(tiny_corpus, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    child = forked(cli("experiment=tiny", f"data.path={tiny_corpus}", "data.allow_short=true",
                       f"hydra.run.dir={tmp_path / 'made' / 'by_hydra'}", f"output_dir={tmp_path / 'other'}"), cwd=cwd)
    assert child.status == 2
    (line,) = child.output.strip().splitlines()
    assert line == (f"error: output_dir={tmp_path / 'other'} and hydra.run.dir={tmp_path / 'made' / 'by_hydra'} "
                    f"differ: give the run's folder once, as output_dir=DIR")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd"] and list(cwd.iterdir()) == []


# ---------------------------------------------------------------- scripts/export.py

def export_script():
    return command("export")


def test_export_script_refuses_other_folders_without_force_and_says_what_it_replaces(trained, tmp_path, capsys):
    script, ckpt = export_script(), str(trained["last_ckpt"])
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "cache.json").write_text("{}")
    assert script.main([ckpt, str(cache)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {cache} is not a specdec export") and "--force" in err and err.count("\n") == 1
    assert sorted(p.name for p in cache.iterdir()) == ["cache.json"]
    assert script.main([ckpt, str(cache), "--force"]) == 0
    capsys.readouterr()

    other = tmp_path / "other"
    save_export(other, Decoder(ModelConfig(vocab_size=256, dim=32, depth=2, heads=2, dim_head=16)))
    assert script.main([ckpt, str(other)]) == 2
    assert "another model" in capsys.readouterr().err
    same = tmp_path / "same"
    shutil.copytree(trained["export_dir"], same)
    assert script.main([ckpt, str(same)]) == 0                          # the same weights: unchanged, and said
    out = capsys.readouterr().out
    assert f"export: {same} unchanged: the export of step 2 has the same weights and model config as a " \
           f"model_with_prophet export of step 2" in out and "still match" in out and "replaced" not in out
    assert sorted(p.name for p in same.iterdir()) == sorted(p.name for p in trained["export_dir"].iterdir())

    from specdec_models import load_export

    older = load_export(trained["export_dir"])                          # the same model, other weights
    with torch.no_grad():
        next(older.parameters()).add_(1.0)
    save_export(tmp_path / "older", older, metadata={"global_step": 1})
    assert script.main([ckpt, str(tmp_path / "older")]) == 0
    out = capsys.readouterr().out
    assert "export: replaced a model_with_prophet export of step 1" in out and "no longer match" in out


def test_export_script_into_a_read_only_folder_exits_2(trained, shared_dir):
    ckpt = shared_dir / "last.ckpt"
    shutil.copy(trained["last_ckpt"], ckpt)
    os.chmod(ckpt, 0o644)
    script = export_script()
    child = forked(lambda: script.main([str(ckpt), str(shared_dir / "readonly" / "export")]), user=NOBODY)
    assert child.status == 2, child.output
    assert child.output.strip() == (f"error: export directory {shared_dir / 'readonly' / 'export'}: "
                                    f"{shared_dir / 'readonly'} is not writable (read-only folder or file system)")
    assert list((shared_dir / "readonly").iterdir()) == []
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2
