"""A trained head written in another layout: specdec export-head and the recipe's export step.

`ExportJob` holds what the command line gives (the head of any kind in any layout, the output
folder, the layout, the target, the drafting to serve); `check` refuses bad input in one line before
anything loads, a layout the head's kind has none of included (SGLang's DFlash reads z-lab's own
checkpoint layout, which specdec does not write; SGLang has no P-EAGLE), and `export_head` loads the
head for its target and writes it with its kind's writer (`writers`: `save_eagle3`, `save_dflash`,
`save_peagle`).

`Drafting` is how many tokens a server drafts per step with the head, and where that number comes
from: written into the speculators layout as `speculative_tokens`, printed with vLLM's
`num_speculative_tokens` and SGLang's `--speculative-num-steps` (docs/serving.md). It is the
drafting that was evaluated: a chain of gamma G drafts G tokens, a tree of depth D drafts paths D
tokens deep; or the number given (`--speculative-tokens N`); without either, the chain specdec
evaluate drafts by default: 5 for an EAGLE-3 head (`specdec_models.export.eagle3.SPECULATIVE_TOKENS`),
the whole block for a block head (one pass drafts it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from specdec_models.errors import check, check_positive_int

LAYOUTS = ("specdec", "speculators", "sglang")
# why a head kind has no layout of that name (`specdec_models.export.heads.HEADS` says which it has)
NO_LAYOUT = {("dflash", "sglang"): "SGLang's DFlash reads z-lab's own checkpoint layout, which specdec does not write",
             ("peagle", "sglang"): "SGLang has no P-EAGLE layout, and an EAGLE-3 one cannot hold its mask inputs"}


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
    """head: the head to read, of any kind and layout `specdec_models.export.heads.detect_head` knows;
    out_dir: the folder to write in `layout`; target: the model directory or GGUF file (None: the
    one a specdec export records); verifier: the speculators layout's verifier name or path (None:
    the target); force: replace out_dir whatever it holds (never an input); drafting: the tokens
    a server drafts per step, written into the speculators layout (None: an EAGLE-3 head's
    `Drafting.of()`, a block head's whole block)."""

    head: str
    out_dir: str
    layout: str
    target: str | None = None
    verifier: str | None = None
    force: bool = False
    drafting: Drafting | None = None

    def check(self) -> None:
        """The layout, the verifier's use and the output folder, before anything loads (the head
        need not exist yet: the recipe checks its jobs before it trains)."""
        from specdec_models.files import check_not_input

        check(self.layout in LAYOUTS, f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        check(self.verifier is None or self.layout == "speculators", "--verifier is for --layout speculators")
        if self.drafting is not None:
            check_positive_int(self.drafting.tokens, "--speculative-tokens")
        check_not_input(self.out_dir, [self.head, self.target], "OUT_DIR")

    def head_kind(self):
        """The head's `FoundHead` (kind and layout, from its config alone), one line when its kind has
        no `layout` (`NO_LAYOUT` says why)."""
        from specdec_models.export.heads import detect_head

        found = detect_head(self.head)
        names = found.kind.layout_names
        check(self.layout in names, f"a {found.kind.name} head has no {self.layout} layout "
                                    f"({NO_LAYOUT.get((found.kind.name, self.layout), 'none exists')}): "
                                    f"--layout {' or '.join(names)}")
        return found


def writers() -> dict:
    """{head kind: its writer}: each `save_KIND(directory, head, layout, *, target_path, verifier,
    speculative_tokens, force)`."""
    from specdec_models.export.dflash import save_dflash
    from specdec_models.export.eagle3 import save_eagle3
    from specdec_models.export.peagle import save_peagle

    return {"eagle3": save_eagle3, "dflash": save_dflash, "peagle": save_peagle}


class Exported(NamedTuple):
    """What `export_head` wrote: the folder, and the drafting written (or, for a layout without a
    place for it, the one a server should be given)."""

    path: Path
    drafting: Drafting


def export_head(job: ExportJob) -> Exported:
    """Load job.head for its target and write it to job.out_dir in job.layout."""
    from specdec_models.decode.block_draft import is_block_head
    from specdec_models.export.heads import load_any_head
    from specdec_models.export.load import recorded_target
    from specdec_models.hf import load_causal_lm
    from train.bench.eval_job import own_gamma

    job.check()
    found = job.head_kind()
    target = load_causal_lm(job.target or recorded_target(job.head, found.layout), what="target")   # fp32
    head = load_any_head(job.head, target)
    save = writers()[found.kind.name]
    # without a drafting given, the chain specdec evaluate drafts by default (`own_gamma`)
    drafting = job.drafting or (Drafting(own_gamma(head, None), "not given: the whole block, drafted in one pass")
                                if is_block_head(head) else Drafting.of())
    if job.layout == "specdec":
        path = save(job.out_dir, head, "specdec", target_path=job.target, force=job.force)
    elif job.layout == "speculators":
        path = save(job.out_dir, head, "speculators", verifier=job.verifier or job.target,
                    speculative_tokens=drafting.tokens, force=job.force)
    else:
        path = save(job.out_dir, head, "sglang", force=job.force)
    return Exported(Path(path), drafting)
