"""An EAGLE-3 head written in another layout: scripts/export_eagle3.py and the recipe's export step.

`ExportJob` holds what the command line gives (the head in any layout, the output folder, the
layout, the target); `check` refuses bad input in one line before anything loads, and
`export_head` loads the head for its target (`specdec_models.export.load_hf_run`) and writes it
(`specdec_models.export.eagle3.save_eagle3`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec_models.errors import check

LAYOUTS = ("specdec", "speculators", "sglang")


@dataclass(frozen=True)
class ExportJob:
    """head: the eagle3 head to read (specdec's hf_eagle3 export, speculators' or SGLang's layout);
    out_dir: the folder to write in `layout`; target: the model directory or GGUF file (None: the
    one a specdec export records); verifier: the speculators layout's verifier name or path (None:
    the target); force: replace out_dir whatever it holds (never an input)."""

    head: str
    out_dir: str
    layout: str
    target: str | None = None
    verifier: str | None = None
    force: bool = False

    def check(self) -> None:
        """The layout, the verifier's use and the output folder, before anything loads."""
        from specdec_models.files import check_not_input

        check(self.layout in LAYOUTS, f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        check(self.verifier is None or self.layout == "speculators", "--verifier is for --layout speculators")
        check_not_input(self.out_dir, [self.head, self.target], "OUT_DIR")


def export_head(job: ExportJob) -> Path:
    """Load job.head for its target and write it to job.out_dir in job.layout; returns the folder."""
    from specdec_models.export import load_hf_run
    from specdec_models.export.eagle3 import save_eagle3

    job.check()
    run = load_hf_run(job.target, eagle3=job.head)
    if job.layout == "specdec":
        return save_eagle3(job.out_dir, run.prophet, "specdec", target_path=job.target, force=job.force)
    if job.layout == "speculators":
        return save_eagle3(job.out_dir, run.prophet, "speculators", verifier=job.verifier or job.target,
                           force=job.force)
    return save_eagle3(job.out_dir, run.prophet, "sglang", force=job.force)
