"""Writing a benchmark report: OUT.json, OUT.md and (optionally) OUT.png side by side, each
written atomically (`files.write_file`), and the machine's description every report carries."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specdec_models.files import check_output, write_file


def machine(load_before: float | None = None) -> dict[str, Any]:
    """What the figures ran on; the load average says whether other jobs shared the CPUs."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_average_1m_before": load_before,
            "load_average_1m_after": os.getloadavg()[0],
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def load_note(report: dict[str, Any]) -> str:
    m = report.get("machine")
    if not m:
        return ""
    before = "" if m.get("load_average_1m_before") is None else f"{m['load_average_1m_before']:.2f} before, "
    return (f"\n\n{m['cpus']} CPUs, torch threads: {m['threads']}, {m['gpu'] or 'no GPU'}; "
            f"load average (1 min) {before}"
            f"{m['load_average_1m_after']:.2f} after (above 0 means other jobs shared the CPUs).")


def check_report(out: Path, *, force: bool, inputs: Sequence[str | Path | None] = ()) -> None:
    """Before a benchmark runs: may its report go to out.json, out.md and out.png? Existing files
    only with `force` (a script passes it for its own default place, bench/), never over an input
    (`files.check_output`)."""
    for suffix in (".json", ".md", ".png"):
        check_output(out.with_suffix(suffix), "--out", force=force, inputs=inputs)


def write_report(report: dict[str, Any], out: Path, markdown: str,
                 plot: Callable[[dict[str, Any], Path], None] | None = None) -> list[Path]:
    """Write out.json (the report), out.md (`markdown`) and, with `plot`, out.png; return the paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [write_file(out.with_suffix(".json"), lambda f: f.write((json.dumps(report, indent=2, default=str)
                                                                     + "\n").encode())),
             write_file(out.with_suffix(".md"), lambda f: f.write((markdown + "\n").encode()))]
    if plot is not None:
        png = out.with_suffix(".png")
        paths.append(write_file(png, lambda f: plot(report, f)))
    return paths


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
