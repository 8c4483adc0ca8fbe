"""Past one device: the answers and the cache written by several processes (each its share of the
batches or shards, the last to finish joining them) equal one process's, a killed process's share is
redone by the next run, and the bad inputs of a process count. Tiny random Llama targets
(test_chat_rows'), real OS processes."""

from __future__ import annotations

import os
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
    from train.data.chat_rows import build_chat_cache
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
        meta = ca.answer_conversations(CONVS, out, answerer=answerer, identity=identity, data={{"source": "test"}},
                                       temperatures=(0.0, 1.0), batch_size=2, seed=1, rank=rank, world=world)
    else:
        pairs, _ = ca.read_answers(sys.argv[6])
        meta = build_chat_cache(target, pairs[:-2], pairs[-2:], out, seq_len=SEQ, layers=[0, 1, 2],
                                describe={{"answers": sys.argv[6]}}, batch_size=1, shard_size=1, rank=rank, world=world)
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
                            temperatures=(0.0, 1.0), batch_size=2, seed=1)
    return out


def test_two_processes_answer_the_same_conversations_with_the_same_tokens_as_one(hf, one_process, tmp_path):
    out = tmp_path / "answers"
    results = launch(tmp_path, "answers", hf["stop"], out, 2)
    assert [code for code, _, _ in results] == [0, 0], results
    assert sorted(o.strip() for _, o, _ in results) == ["finalized", "not finalized"]   # the last one joins them
    assert (out / ca.ANSWERS_FILE).read_bytes() == (one_process / ca.ANSWERS_FILE).read_bytes()
    meta = ca.read_answers(out)[1]
    assert meta["ranks"] == 2 and meta["batches_done"] == 4 and not (out / "finalize.lock").exists()


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
    from train.data.chat_rows import build_chat_cache
    pairs, _ = ca.read_answers(one_process)
    single = tmp_path / "single"
    build_chat_cache(hf["stop"], pairs[:-2], pairs[-2:], single, seq_len=SEQ, layers=[0, 1, 2],
                     describe={"answers": str(one_process)}, batch_size=1, shard_size=1)
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
                                batch_size=2, rank=0, world=5)
    assert not (tmp_path / "a.partial").exists()


def test_the_recipe_refuses_more_processes_than_answer_batches_in_one_line(hf, tmp_path, capsys):
    from test_eagle3_recipe import base, main, sharegpt_file
    args = base(hf, sharegpt_file(tmp_path / "c.json"), tmp_path / "r")
    capsys.readouterr()
    assert main(*args, "--processes", "4", "--answer-batch", "8") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--processes 4 is more than the 3 batch(es)" in err[0]
    assert not (tmp_path / "r").exists()
