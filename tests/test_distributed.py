"""Past one device: the answers and the cache written by several processes (each its share of the
batches or shards, the last to finish joining them) equal one process's, a killed process's share is
redone by the next run, and the bad inputs of a process count. Tiny random Llama targets
(test_chat_rows'), real OS processes."""

# ruff: noqa: F811 (the fixture `hf`, imported from test_chat_rows, is every test's argument)
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_chat_rows import CONVS, SEQ, hf  # noqa: F401  (the tiny stopping target, its conversations)

from specdec_models.errors import SpecdecError
from specdec_models.hf.weights import load_causal_lm
from train.data import chat_answers as ca
from train.data.embeddings_cache import cache_rows, check_cache, open_cache

pytestmark = pytest.mark.usefixtures("offline")
REPO = Path(__file__).resolve().parents[1]

DRIVER = textwrap.dedent('''
    import os, sys
    sys.path[:0] = [{tests!r}, {repo!r}]
    import torch
    torch.set_num_threads(1)
    from test_chat_rows import CONVS, SEQ
    from train.data import chat_answers as ca
    from train.data.chat_rows import ChatSource, build_chat_cache
    from train.data.embeddings_cache import BuildRun, CacheSettings
    step, target, out, rank, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    if step == "answers":
        die = os.environ.get("DIE_AFTER_ONE") == str(rank)
        real = ca.answer_batch
        calls = []
        def batch(*a, **k):
            calls.append(1)
            if die and len(calls) == 2:
                os._exit(3)                   # killed in its second batch, its first one written
            return real(*a, **k)
        ca.answer_batch = batch
        answerer, identity = ca.load_answerer(target, seq_len=SEQ, max_new_tokens=8)
        options = ca.AnswerOptions(temperatures=(0.0, 1.0), batch_size=2, seed=1, rank=rank, world=world,
                                   engine="simple")
        meta = ca.answer_conversations(CONVS, out, answerer=answerer, identity=identity, data={{"source": "test"}},
                                       options=options)
    else:
        pairs, _ = ca.read_answers(sys.argv[6])
        source = ChatSource(pairs[:-2], pairs[-2:], layers=[0, 1, 2], describe={{"answers": sys.argv[6]}})
        meta = build_chat_cache(target, source, out, CacheSettings(seq_len=SEQ, batch_size=1, shard_size=1),
                                BuildRun(rank=rank, world=world))
    print("finalized" if meta.get("finalized", True) else "not finalized")
''')


def launch(tmp_path, step, target, out, world, *extra, env=None, ranks=None):
    """`world` processes of the driver at once; their (exit code, stdout) by rank."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(tests=str(REPO / "tests"), repo=str(REPO)))
    procs = [subprocess.Popen([sys.executable, str(driver), step, str(target), str(out), str(rank), str(world),
                               *map(str, extra)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"})
             for rank in (range(world) if ranks is None else ranks)]
    return [(p.wait(), p.stdout.read(), p.stderr.read()) for p in procs]


@pytest.fixture(scope="module")
def one_process(hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "answers"
    answerer, identity = ca.load_answerer(hf["stop"], seq_len=SEQ, max_new_tokens=8)
    ca.answer_conversations(CONVS, out, answerer=answerer, identity=identity, data={"source": "test"},
                            options=ca.AnswerOptions(temperatures=(0.0, 1.0), batch_size=2, seed=1, engine="simple"))
    return out


@pytest.mark.slow     # about 12 s: two processes
def test_two_processes_answer_the_same_conversations_with_the_same_tokens_as_one(hf, one_process, tmp_path):
    out = tmp_path / "answers"
    results = launch(tmp_path, "answers", hf["stop"], out, 2)
    assert [code for code, _, _ in results] == [0, 0], results
    assert sorted(o.strip() for _, o, _ in results) == ["finalized", "not finalized"]   # the last one joins them
    assert (out / ca.ANSWERS_FILE).read_bytes() == (one_process / ca.ANSWERS_FILE).read_bytes()
    meta = ca.read_answers(out)[1]
    assert meta["ranks"] == 2 and meta["batches_done"] == 4 and not (out / "finalize.lock").exists()


@pytest.mark.slow     # about 20 s: two processes and a kill; test_train_ddp.py keeps two processes by default
def test_a_killed_process_leaves_its_written_batches_and_the_next_run_answers_the_rest(hf, one_process, tmp_path):
    out = tmp_path / "answers"
    first = launch(tmp_path, "answers", hf["stop"], out, 2, env={"DIE_AFTER_ONE": "1"})
    assert [code for code, _, _ in first] == [0, 3]
    assert first[0][1].strip() == "not finalized" and not out.exists()
    partial = out.with_name("answers.partial")
    assert sorted(p.name for p in partial.glob("part-*.jsonl")) == ["part-00000.jsonl", "part-00001.jsonl",
                                                                      "part-00002.jsonl"]   # rank 1 lost batch 3
    again = launch(tmp_path, "answers", hf["stop"], out, 2)
    assert [code for code, _, _ in again] == [0, 0]
    assert (out / ca.ANSWERS_FILE).read_bytes() == (one_process / ca.ANSWERS_FILE).read_bytes()


def test_two_processes_write_the_cache_one_process_writes(hf, one_process, tmp_path):
    from train.data.chat_rows import ChatSource, build_chat_cache
    from train.data.embeddings_cache import CacheSettings
    pairs, _ = ca.read_answers(one_process)
    single = tmp_path / "single"
    build_chat_cache(hf["stop"], ChatSource(pairs[:-2], pairs[-2:], layers=[0, 1, 2],
                                            describe={"answers": str(one_process)}),
                     single, CacheSettings(seq_len=SEQ, batch_size=1, shard_size=1))
    out = tmp_path / "cache"
    results = launch(tmp_path, "cache", hf["stop"], out, 2, one_process)
    assert [code for code, _, _ in results] == [0, 0], results
    a, b = check_cache(single), check_cache(out)
    assert a["files"].keys() == b["files"].keys() and len(a["files"]) == len(CONVS)        # one shard per row here
    rows = np.arange(a["windows"])
    x, y = cache_rows(open_cache(single, a), rows, a), cache_rows(open_cache(out, b), rows, b)
    for name in ("tokens", "loss_mask", "valid_len", "prompt_len"):
        assert torch.equal(x[name], y[name]), name
    torch.testing.assert_close(x["embeds"], y["embeds"], rtol=0, atol=0)


def test_more_processes_than_batches_is_refused_before_any_work(hf, tmp_path):
    answerer, identity = ca.load_answerer(hf["stop"], seq_len=SEQ, max_new_tokens=8)
    with pytest.raises(SpecdecError, match="5 processes for 7 conversations in 4 batch"):
        ca.answer_conversations(CONVS, tmp_path / "a", answerer=answerer, identity=identity, data={},
                                options=ca.AnswerOptions(batch_size=2, rank=0, world=5))
    assert not (tmp_path / "a.partial").exists()


def test_the_recipe_refuses_more_processes_than_answer_batches_in_one_line(hf, tmp_path, capsys):
    from test_eagle3_recipe import base, main, sharegpt_file
    args = base(hf, sharegpt_file(tmp_path / "c.json"), tmp_path / "r")
    capsys.readouterr()
    assert main(*args, "--processes", "4", "--answer-batch", "8") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--processes 4 is more than the 3 batch(es)" in err[0]
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- a target split across the processes (target.shard)
# Online task=hf_eagle3 on a tiny random Llama of 4 layers: `target.shard=true` under trainer=ddp with two CPU
# processes (gloo, FSDP2) trains as the unsplit 2-process run does, and each process holds half of every decoder layer.

SHARD_SEQ = 16
SHARD_LINE = re.compile(r"target\.shard: rank (\d) of 2 holds ([\d,]+) of the target's ([\d,]+) parameter elements; "
                        r"of its decoder layers ([\d,]+) of ([\d,]+)")


@pytest.fixture(scope="module")
def shard_setup(tmp_path_factory):
    from test_hf_data import text_setup
    from test_hf_distill import save_model

    d = tmp_path_factory.mktemp("shard")
    setup = text_setup(d, docs=200, prompt_docs=2)
    return {**setup, "target": save_model(d / "target", setup["tok"], "llama", 7, depth=4)}


def shard_args(setup, out, *extra):
    """experiment=hf_eagle3 online (data=hf_text, unless `extra` picks data=hf_embeddings) at test sizes: 2
    steps, validation of 3 rows at step 2."""
    text = [] if "data=hf_embeddings" in extra else [f"data.files=[{setup['corpus']}]",
                                                      f"data.windows_dir={setup['root'] / 'windows'}"]
    return ["experiment=hf_eagle3", f"target.path={setup['target']}", *text, f"data.seq_len={SHARD_SEQ}",
            "data.batch_size=2", "data.val_windows=3", "data.val_batch_size=1", "head.draft_vocab_size=null",
            "head.aux_layers=[1,2,3]", "task.ttt_steps=2", "trainer.max_steps=2", "trainer.val_check_interval=2",
            "trainer.num_sanity_val_steps=1", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", "callbacks.progress_bar=null", "callbacks.speculative_eval=null",
            f"output_dir={out}", *extra]


def logged_losses(out):
    """{(step, name): value} of train/loss and val/loss in a run's metrics.csv (rank 0's)."""
    import csv
    rows = list(csv.DictReader((out / "csv" / "metrics.csv").open()))
    return {(int(r["step"]), k): float(r[k]) for r in rows for k in ("train/loss", "val/loss") if r.get(k)}


def train_two(setup, out, *extra):
    """`python -m train` in two CPU processes (trainer=ddp, gloo): its stdout, checked to finish."""
    command = [sys.executable, "-m", "train", *shard_args(setup, out, "trainer=ddp", "trainer.devices=2",
                                                          "trainer.accelerator=cpu", *extra)]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Starting with 2 processes" in result.stdout + result.stderr
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert (out / "export" / "config.json").is_file()
    return result.stdout


@pytest.mark.slow     # about 30 s: two processes of Lightning and gloo
def test_a_target_split_across_two_processes_trains_as_the_whole_one_does_and_each_holds_half_its_layers(
        shard_setup, tmp_path):
    whole = tmp_path / "whole"
    assert not SHARD_LINE.search(train_two(shard_setup, whole))
    sharded = tmp_path / "sharded"
    stdout = train_two(shard_setup, sharded, "target.shard=true")
    # the same losses at steps 0 and 1 and in the validation (3 rows over 2 processes: one repeated)
    expected = logged_losses(whole)
    assert {(0, "train/loss"), (1, "train/loss"), (1, "val/loss")} <= set(expected)
    assert logged_losses(sharded) == pytest.approx(expected, abs=1e-5)
    held = {int(m[1]): [int(x.replace(",", "")) for x in m.groups()[1:]] for m in SHARD_LINE.finditer(stdout)}
    assert sorted(held) == [0, 1], stdout[-3000:]
    for mine, total, layers_mine, layers_total in held.values():
        assert layers_mine * 2 == layers_total                     # half of every decoder layer
        assert mine == total - layers_total // 2                   # the embedding, final norm and LM head whole
        assert total == sum(p.numel() for p in load_causal_lm(shard_setup["target"]).parameters())


def test_a_split_target_in_a_process_alone_stays_whole_with_a_warning(shard_setup):
    from train.tasks.sharding import ShardedFrozenModel, held_elements

    holder = ShardedFrozenModel(lambda: load_causal_lm(shard_setup["target"]))
    with pytest.warns(UserWarning, match="target.shard: this run has one process: the target stays whole"):
        holder.shard(torch.device("cpu"))
    model = holder.get(torch.device("cpu"))
    assert not holder.sharded and held_elements(model)[0] == held_elements(model)[1]


EVALUATION_ON = "callbacks.speculative_eval.num_prompts=2"      # this case keeps the evaluation callback


@pytest.mark.parametrize("extra, message", [
    (["data=hf_embeddings", "trainer=ddp"], ("target.shard: data=hf_embeddings reads the target's hidden states from "
                                             "a cache and never runs the target")),
    (["trainer=cpu"], r"this run has one \(trainer.devices \* trainer.num_nodes = 1\)"),
    (["trainer=ddp", "trainer.devices=1"], r"this run has one \(trainer.devices"),
    (["trainer=ddp", "trainer.strategy=fsdp"], "trainer.strategy must be ddp"),
    (["trainer=ddp", EVALUATION_ON], "callbacks.speculative_eval decodes on rank 0 alone"),
    (["trainer=ddp", "target.shard=yes"], "target.shard must be true or false, got 'yes'"),
])
def test_a_split_target_that_cannot_run_is_refused_in_one_line_before_any_work(shard_setup, tmp_path, extra,
                                                                                message):
    import train.run as train_run

    out = tmp_path / "run"
    args = shard_args(shard_setup, out, "target.shard=true", *extra)
    if EVALUATION_ON in extra:
        args.remove("callbacks.speculative_eval=null")
    with pytest.raises(SpecdecError, match=message) as err:
        train_run.validate(train_run.compose(args))
    assert "\n" not in str(err.value) and not out.exists()


@pytest.mark.parametrize("experiment", ["tiny", "hf_draft_distill"])
def test_target_shard_on_a_task_without_a_target_to_shard_is_refused_in_one_line(experiment):
    import train.run as train_run

    with pytest.raises(SpecdecError, match=r"target.shard: task=\w+ runs no frozen target to shard \(only "
                                           r"task=hf_dflash or task=hf_eagle3 or task=hf_peagle or task=hf_prophet "
                                           r"with data=hf_text or data=hf_chat"):
        train_run.validate_run(train_run.compose([f"experiment={experiment}", "+target.shard=true"]))
