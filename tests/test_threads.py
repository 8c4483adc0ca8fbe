"""CPU threads handed between runs side by side: the ThreadsFromFile callback (train.threads) and
the SmolLM2 recipe's side_by_side, which writes its file when a run ends."""

from __future__ import annotations

import logging
import os
import sys
import textwrap

import pytest
import torch
from conftest import load_script

from train.run import run
from train.threads import ThreadsFromFile

pytestmark = pytest.mark.usefixtures("offline", "one_thread")


class Step:
    global_step = 7


def test_the_callback_takes_the_threads_its_file_asks_for_and_keeps_them_without_a_valid_one(tmp_path, caplog):
    path = tmp_path / "threads"
    callback = ThreadsFromFile(str(path))
    def start():
        callback.on_train_batch_start(Step(), None, None, 0)

    start()                                                            # no file yet: as started
    assert torch.get_num_threads() == 1
    path.write_text("2\n")
    start()
    assert torch.get_num_threads() == 2
    with caplog.at_level(logging.WARNING, logger="train.threads"):
        for text in ("0", "two", ""):
            path.write_text(text)
            start()
            assert torch.get_num_threads() == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'0', not an integer >= 1; the threads stay 2" in warnings[0]   # said once
    path.write_text("1")
    start()
    assert torch.get_num_threads() == 1
    untouched = ThreadsFromFile(None)                                   # the default: never read
    untouched.on_train_batch_start(Step(), None, None, 0)
    assert torch.get_num_threads() == 1 and untouched.wanted() is None


def test_a_run_reads_the_threads_file_of_its_config_before_its_steps(tiny_cfg, tmp_path, caplog):
    path = tmp_path / "threads"
    path.write_text("2")
    with caplog.at_level(logging.INFO, logger="train.threads"):
        run(tiny_cfg(tmp_path / "run", "trainer.max_steps=2", "trainer.val_check_interval=2",
                     "callbacks.speculative_eval=null", f"callbacks.threads_file.path={path}"))
    assert torch.get_num_threads() == 2
    assert any(f"1 -> 2 CPU threads from {path} at step 0" in r.getMessage() for r in caplog.records)


def script(tmp_path, name: str, body: str) -> list[str]:
    file = tmp_path / f"{name}.py"
    file.write_text(textwrap.dedent(body))
    return [sys.executable, str(file)]


def test_side_by_side_hands_the_threads_of_a_run_that_ended_well_to_the_one_left(tmp_path):
    recipe = load_script("smollm2")
    share, done, seen = tmp_path / "threads", tmp_path / "first_done", tmp_path / "seen"
    share.write_text("7")                                  # an earlier run's file: removed before the runs start
    first = script(tmp_path, "first", f"""
        import os, pathlib
        assert os.environ["OMP_NUM_THREADS"] == "1"
        pathlib.Path({str(done)!r}).write_text("")
        """)
    # the second sees the file only once the first has ended: 2 runs x 1 thread, 1 left -> 2
    second = script(tmp_path, "second", f"""
        import os, pathlib, time
        assert os.environ["OMP_NUM_THREADS"] == "1"
        share = pathlib.Path({str(share)!r})
        first_done = pathlib.Path({str(done)!r})
        deadline = time.monotonic() + 300                 # a safety valve, never reached unless the file never comes
        while not first_done.exists() or not share.exists():
            assert first_done.exists() or not share.exists(), "the threads file before the first run ended"
            assert time.monotonic() < deadline, "no threads file 300 s after the first run ended"
            time.sleep(0.05)
        pathlib.Path({str(seen)!r}).write_text(share.read_text())
        """)
    assert recipe.side_by_side([first, second], dict(os.environ), 1, share) == [0, 0]
    assert seen.read_text() == "2\n"


def test_side_by_side_stops_the_others_when_one_fails_and_hands_nothing_over(tmp_path):
    # the step fails anyway and runs whole again on resume: the others' minutes would be lost
    recipe = load_script("smollm2")
    started, finished, share = tmp_path / "started", tmp_path / "finished", tmp_path / "threads"
    failing = script(tmp_path, "failing", f"""
        import pathlib, sys, time
        while not pathlib.Path({str(started)!r}).exists():
            time.sleep(0.05)
        sys.exit(3)
        """)
    # left alone it would end well after 120 s and say so; stopped, it ends by SIGTERM
    long = script(tmp_path, "long", f"""
        import pathlib, time
        pathlib.Path({str(started)!r}).write_text("")
        time.sleep(120)
        pathlib.Path({str(finished)!r}).write_text("")
        """)
    assert recipe.side_by_side([failing, long], dict(os.environ), 1, share) == [3, -15]
    assert not finished.exists() and not share.exists()
