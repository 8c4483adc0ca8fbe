"""An EAGLE-3 head written in another layout: specdec export-eagle3 and the recipe's export step.

`ExportJob` holds what the command line gives (the head in any layout, the output folder, the
layout, the target, the drafting to serve); `check` refuses bad input in one line before anything
loads, and `export_head` loads the head for its target (`specdec_models.export.load_hf_run`) and
writes it (`specdec_models.export.eagle3.save_eagle3`).

`Drafting` is how many tokens a server drafts per step with the head, and where that number comes
from: written into the speculators layout as `speculative_tokens`, printed with vLLM's
`num_speculative_tokens` and SGLang's `--speculative-num-steps` (docs/serving.md). It is the
drafting that was evaluated: a chain of gamma G drafts G tokens, a tree of depth D drafts paths D
tokens deep; or the number given (`--speculative-tokens N`); without either, the chain
specdec evaluate evaluates by default (gamma 5, `specdec_models.export.eagle3.SPECULATIVE_TOKENS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec_models.errors import check, check_positive_int

LAYOUTS = ("specdec", "speculators", "sglang")


@dataclass(frozen=True)
class Drafting:
    """tokens: the tokens a server drafts per step (speculators' `speculative_tokens`); source: why
    that many, in words ("--speculative-tokens", "the evaluated chain, gamma 5", ...)."""

    tokens: int
    source: str

    @classmethod
    def of(cls, tokens: int | None = None, *, gamma: int | None = None, tree: str | None = None) -> Drafting:
        """The given number (`tokens`), else the evaluated chain's `gamma`, else the evaluated tree's
        depth (`tree`, a tree SPEC as specdec evaluate's --tree), else specdec evaluate's default
        chain; one line for a number that is not a positive integer or a tree that does not parse."""
        if tokens is not None:
            check_positive_int(tokens, "--speculative-tokens")
            return cls(tokens, "--speculative-tokens")
        if gamma is not None:
            check_positive_int(gamma, "the evaluated chain's gamma")
            return cls(gamma, f"the evaluated chain, gamma {gamma}")
        if tree is not None:
            from specdec_models.decode.tree import TreeSpec

            depth = TreeSpec.parse(tree).depth
            return cls(depth, f"the evaluated tree {tree}, depth {depth}")
        from specdec_models.export.eagle3 import SPECULATIVE_TOKENS

        return cls(SPECULATIVE_TOKENS, f"not given: specdec evaluate's default chain, gamma {SPECULATIVE_TOKENS}")

    def describe(self, layout: str) -> str:
        """One line for the export's output: the number, its source and how a server is told it."""
        serve = {"speculators": f"vLLM: \"num_speculative_tokens\": {self.tokens} in --speculative-config",
                 "sglang": f"SGLang: --speculative-num-steps {self.tokens}"}.get(layout)
        line = f"speculative tokens {self.tokens} ({self.source})"
        return f"{line}; {serve}" if serve else line


@dataclass(frozen=True)
class ExportJob:
    """head: the eagle3 head to read (specdec's hf_eagle3 export, speculators' or SGLang's layout);
    out_dir: the folder to write in `layout`; target: the model directory or GGUF file (None: the
    one a specdec export records); verifier: the speculators layout's verifier name or path (None:
    the target); force: replace out_dir whatever it holds (never an input); drafting: the tokens
    a server drafts per step, written into the speculators layout (None: `Drafting.of()`)."""

    head: str
    out_dir: str
    layout: str
    target: str | None = None
    verifier: str | None = None
    force: bool = False
    drafting: Drafting | None = None

    def check(self) -> None:
        """The layout, the verifier's use and the output folder, before anything loads."""
        from specdec_models.files import check_not_input

        check(self.layout in LAYOUTS, f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        check(self.verifier is None or self.layout == "speculators", "--verifier is for --layout speculators")
        if self.drafting is not None:
            check_positive_int(self.drafting.tokens, "--speculative-tokens")
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
        drafting = job.drafting or Drafting.of()
        return save_eagle3(job.out_dir, run.prophet, "speculators", verifier=job.verifier or job.target,
                           speculative_tokens=drafting.tokens, force=job.force)
    return save_eagle3(job.out_dir, run.prophet, "sglang", force=job.force)
