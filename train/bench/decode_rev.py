"""The decoding loop of this checkout against the loop of an earlier git revision, on one target
and one EAGLE-3 head, batch 1, interleaved in one process: `specdec bench decode-rev`.

A change to `specdec_models.decode` must not make decoding slower. The only fair comparison is
side by side: the same target object, the same head weights, the same prompts and the same
threads, with the two loops taking turns prompt by prompt (ABBA), so a clock or a neighbour's
load that drifts hits both alike. The earlier revision's `specdec_models` is unpacked from git
(`git archive`) under another package name (`specdec_models_<sha>`: the package imports itself
relatively, so both live in one interpreter), and each loop gets its own head, loaded by its own
package from the same export. The target's layers are prepared once, by this checkout's CPU
corner, so both loops call the very same target modules: the figure is the loop's and the head's.

At T=0 both loops must emit the same tokens (each is lossless, so each equals plain greedy
decoding); a difference is reported, since it would make the timings incomparable.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from types import ModuleType

import torch

from specdec_models.errors import SpecdecError, check

REPO = Path(__file__).resolve().parents[2]


def load_revision(rev: str, repo: Path = REPO) -> ModuleType:
    """`specdec_models` as it was at git revision `rev`, imported as `specdec_models_<sha12>` from
    a temporary folder (kept for the life of the process)."""
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                             capture_output=True, text=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        raise SpecdecError(f"--base {rev!r} is not a commit of {repo}") from None
    name = f"specdec_models_{sha[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    blob = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", sha, "specdec_models"], check=True,
                          capture_output=True).stdout
    root = Path(tempfile.mkdtemp(prefix="specdec_rev_"))
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(root, filter="data")
    (root / "specdec_models").rename(root / name)
    sys.path.insert(0, str(root))
    return importlib.import_module(name)


@dataclass
class Side:
    """One loop: its package's `generate`, its greedy sampling config (each package checks its own
    types), and the drafter it decodes with for each method."""

    name: str
    generate: Callable
    greedy: object
    drafters: dict[str, object]
    tokens: int = 0
    seconds: float = 0.0


def side(name: str, package: ModuleType, target, head_dir: str, tree: str) -> Side:
    """The drafters of `package` for the head in `head_dir` on `target`: "chain" (a gamma chain)
    and "tree" (the tree `tree` in the decoding CLI's grammar)."""
    decode = importlib.import_module(f"{package.__name__}.decode")
    export = importlib.import_module(f"{package.__name__}.export.eagle3")
    cpu = importlib.import_module(f"{package.__name__}.cpu")
    head = export.load_eagle3(head_dir, target)
    cpu.prepare_for_device(head, "cpu", dtype=None)
    return Side(name, decode.generate, decode.GREEDY, {"chain": decode.HeadDrafter(head),
                                        "tree": decode.TreeDrafter(head, decode.TreeSpec.parse(tree))})


def race(sides: Sequence[Side], target, prompts: Sequence[torch.Tensor], method: str, *, max_new_tokens: int,
         eos_id: int, gamma: int, log: Callable[[str], None]) -> dict[str, float]:
    """Each prompt decoded greedily by every side, the order reversed every prompt (ABBA); returns
    {side: tokens/s} over all prompts and counts the prompts whose tokens differ."""
    for s in sides:
        s.tokens, s.seconds = 0, 0.0
    differ = 0
    for i, ids in enumerate(prompts):
        out = {}
        for s in (sides if i % 2 == 0 else list(reversed(sides))):
            t0 = time.perf_counter()
            tokens, _ = s.generate(target, [ids], max_new_tokens, s.drafters[method], sampling=s.greedy,
                                   eos_id=eos_id, gamma=gamma)
            s.seconds += time.perf_counter() - t0
            s.tokens += len(tokens[0])
            out[s.name] = tokens[0].tolist()
        differ += len({tuple(v) for v in out.values()}) > 1
        log(f"[{method}] prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{s.name} {s.tokens / max(s.seconds, 1e-9):.1f} tok/s" for s in sides))
    result = {s.name: s.tokens / max(s.seconds, 1e-9) for s in sides}
    result["differ"] = differ
    return result


def bench(target_path: str, head_dir: str, base: str, *, prompts: int = 8, max_new_tokens: int = 128,
          tree: str = "6,3,1,0.1", gamma: int = 5, threads: int | None = None,
          log: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    """{method: {"base": tokens/s, "this": tokens/s, "ratio": this/base, "differ": prompts}} for the
    chain and the tree on the first `prompts` MT-Bench questions (one per category first), fp32."""
    from specdec_models.cpu import prepare_for_device
    from specdec_models.hf import load_model

    from .benchmarks import load_benchmark
    from .evaluate import _ids, end_of_turn_id

    check(prompts >= 1, f"--prompts must be >= 1, got {prompts}")
    if threads is not None:
        torch.set_num_threads(threads)
    old = load_revision(base)
    loaded = load_model(target_path)
    target = loaded.model.eval()
    prepare_for_device(target, "cpu", dtype="float32")
    questions = load_benchmark("mt_bench", 1 + (prompts - 1) // 8)[:prompts]
    ids = [_ids(loaded.tokenizer, [{"role": "user", "content": q.turns[0]}], None) for q in questions]
    eos_id = end_of_turn_id(loaded.tokenizer)
    sides = [side("base", old, target, head_dir, tree), side("this", importlib.import_module("specdec_models"),
                                                              target, head_dir, tree)]
    out = {}
    with torch.inference_mode():
        race(sides, target, ids[:1], "chain", max_new_tokens=16, eos_id=eos_id, gamma=gamma, log=lambda _: None)
        for method in ("chain", "tree"):
            r = race(sides, target, ids, method, max_new_tokens=max_new_tokens, eos_id=eos_id, gamma=gamma, log=log)
            r["ratio"] = r["this"] / r["base"]
            out[method] = r
    return out
