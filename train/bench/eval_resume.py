"""An evaluation that loses nothing when it dies: each benchmark's figures are kept as soon as
that benchmark is scored, and a rerun of the same command takes them up again.

A whole-set evaluation runs for an hour or more on a CPU; the report (`eval_report.write`) is
written as one folder at the end. So after each benchmark `save` writes its results into
`OUT.partial/` (beside `--out`, marked as specdec's), with the settings that decide the figures
(`settings`). A rerun with the same settings reads the finished benchmarks back (`resume`) and
scores only the rest; the report says which benchmarks were resumed. Settings that differ are
refused in one line before any model loads (the figures would mix two evaluations), unless
`--force`, which starts over. Once the report is written the partial folder goes (`finish`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from specdec_models.errors import SpecdecError
from specdec_models.files import check_output, folder_kind, mark_dir, write_file

KIND = "evaluation-partial"
SETTINGS = "settings.json"


def partial_dir(out: Path) -> Path:
    """Where the finished benchmarks of an evaluation into `out` wait for its report."""
    return out.with_name(out.name + ".partial")


def _fingerprint(path: str) -> dict[str, Any]:
    """What identifies a head or target on disk without reading its weights: each file's name,
    size and modification time (a retrained head in the same folder differs)."""
    root = Path(path).expanduser()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root) if p != root else p.name): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in files}


def settings(job: Any, checked: Any) -> dict[str, Any]:
    """The settings that decide an evaluation's figures: every option but --out, --force,
    --threads and the benchmarks list (a rerun may add or drop benchmarks), with the target's and
    heads' files fingerprinted."""
    files = {"target": _fingerprint(job.target), **{name: _fingerprint(p) for name, p in checked.heads.items()}}
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    return {"target": job.target, "heads": checked.heads, "tree": job.tree, "gamma": job.gamma, "lookup": job.lookup,
            "subset": job.subset, "speed_subset": checked.speed, "tau_batch": job.tau_batch,
            "temperatures": list(checked.temperatures), "max_new_tokens": job.max_new_tokens,
            "dtype": str(checked.dtype), "device": str(checked.device), "seed": job.seed,
            "chat_template_kwargs": checked.kwargs, "files": digest}


def resume(out: Path, wanted: dict[str, Any], force: bool) -> dict[str, dict]:
    """{benchmark: {"results", "parts"}} already scored into `partial_dir(out)` with the `wanted`
    settings; {} when there is none (or `force`, which discards it). A folder of other settings, or
    one specdec did not mark, is a one-line SpecdecError."""
    partial = partial_dir(out)
    if not partial.exists():
        return {}
    check_output(partial, "the partial evaluation", kind=KIND, force=False)
    if folder_kind(partial) != KIND:
        return {}                                    # an empty folder: nothing finished in it
    if force or not (partial / SETTINGS).exists():
        shutil.rmtree(partial)                       # --force, or killed before its first benchmark was kept
        return {}
    found = json.loads((partial / SETTINGS).read_text())
    differ = sorted(key for key in set(found) | set(wanted) if found.get(key) != wanted.get(key))
    if differ:
        raise SpecdecError(f"{partial} holds benchmarks scored with other settings ({', '.join(differ)} differ): "
                           f"rerun with the same settings to finish that evaluation, or start over with --force")
    return {p.stem: json.loads(p.read_text()) for p in sorted(partial.glob("*.json")) if p.name != SETTINGS}


def save(out: Path, wanted: dict[str, Any], benchmark: str, results: dict, parts: dict) -> Path:
    """Keep one scored benchmark in `partial_dir(out)` (atomic writes; the folder marked as
    specdec's and its settings written with its first benchmark)."""
    partial = partial_dir(out)
    if folder_kind(partial) != KIND:
        partial.mkdir(parents=True, exist_ok=True)
        mark_dir(partial, KIND)
    if not (partial / SETTINGS).exists():
        write_file(partial / SETTINGS, lambda f: f.write(json.dumps(wanted, indent=1).encode()))
    body = json.dumps({"results": results, "parts": parts}).encode()
    return write_file(partial / f"{benchmark}.json", lambda f: f.write(body))


def finish(out: Path) -> None:
    """The report is written: the partial folder (specdec's own) goes."""
    partial = partial_dir(out)
    if partial.exists() and folder_kind(partial) == KIND:
        shutil.rmtree(partial)
