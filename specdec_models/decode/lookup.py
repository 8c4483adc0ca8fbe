"""Prompt-lookup decoding (Saxena 2023; Hugging Face's `prompt_lookup_num_tokens`): the drafter
`drafters.Lookup`, a draft tree of only its looked-up path.

Each round looks up the row's context (prompt and emitted tokens): the tokens that followed the
latest earlier occurrence of its last 3 (else 2, else 1) tokens (`tree.lookup_match`), or a
datastore's continuation where that follows a longer n-gram (`tree.looked_up_path`). They are fed
after the pending token in one causal target call: a chain is a tree of one path, so it needs no
tree mask and runs on a specdec `Decoder` as on a Hugging Face target. A round that finds nothing
feeds the pending token alone: one plain target step.

Lossless at every temperature, by the tree's own walk (`tree.walk`): a looked-up
token x is a point-mass draft (q = 1{x}), accepted with probability p(x); on rejection the token
is drawn from p without x, renormalised; greedy decoding follows the target's argmax. The path
depends only on the committed context, and an adaptive length (`lookup_max`, `TreeSpec.next_lookup`)
only on earlier rounds, so neither can bias a round's test.

Rows are decoded one after another, as the tree's are (`Plan.rows` 1). `stats.drafted` counts looked-up tokens
verified, `stats.accepted` those accepted; `stats.per_position_acceptance[k]` is the fraction of
rounds with a looked-up path of k + 1 tokens or more that accepted k + 1 or more.
"""

from __future__ import annotations

import torch

from ..errors import check
from .datastore import Datastore
from .protocol import Draft, Drafter, Plan, Verdict
from .tree import TreeSpec, _Tree, check_own_depth, looked_up_path


class Lookup(Drafter):
    """Prompt-lookup decoding (module docstring): `lookup` tokens looked up in the row's context
    per round (or in `datastore`, where it matches a longer n-gram); `lookup_max` > 0 makes the
    length adaptive, from `lookup` up to `lookup_max` (doubled after a round that accepted all of
    it, back to `lookup` after a miss), as `TreeSpec`'s fields of the same names. `tree` is the
    lookup's `TreeSpec` (its head fields unused)."""

    method = "lookup"

    def __init__(self, lookup: int, lookup_max: int = 0, datastore: Datastore | None = None) -> None:
        check(isinstance(lookup, int) and not isinstance(lookup, bool) and lookup >= 1,
              f"lookup must be an integer >= 1 (the tokens looked up per round), got {lookup!r}")
        check(isinstance(lookup_max, int) and not isinstance(lookup_max, bool)
              and (lookup_max == 0 or lookup_max >= lookup),
              f"lookup_max must be 0 (a fixed length) or an integer >= lookup ({lookup}), got {lookup_max!r}")
        check(datastore is None or isinstance(datastore, Datastore),
              f"datastore must be a decode.datastore.Datastore, got {type(datastore).__name__}")
        self.tree = TreeSpec(1, 1, 1, lookup=lookup, lookup_max=lookup_max)
        self.datastore = datastore

    def __repr__(self) -> str:
        spec = self.tree
        length = f"{spec.lookup}..{spec.lookup_max}" if spec.adaptive else f"{spec.lookup}"
        return f"Lookup({length}{', Datastore' if self.datastore is not None else ''})"

    def check(self, gamma, sampling, timing, speed_profile) -> None:
        check_own_depth("prompt lookup", gamma, sampling, timing, speed_profile)

    def plan(self, gamma: int) -> Plan:
        longest = self.tree.longest_lookup
        return Plan(self.tree.lookup, longest, longest, rows=1)

    def start(self, run) -> None:
        self.lookup = self.tree.lookup
        self.context = run.rows.seq[0, : int(run.rows.seq_len[0])].tolist()     # the prompt and the tokens emitted
        self.prompt_length = int(run.rows.lens[0])

    def propose(self, run, gamma: int) -> Draft:
        """The looked-up path as a chain (a causal verify call), walked as a tree of point masses."""
        left = run.max_new - (len(self.context) - self.prompt_length)
        path = looked_up_path(self.context, min(self.lookup, left), self.datastore)
        tree = _Tree()
        tree.add_path(path)
        self.path = path
        return Draft(torch.tensor([path], dtype=torch.long, device=run.rows.seq.device), len(path), tree=tree)

    def accept(self, run, verdict: Verdict) -> None:
        path = self.path
        self.context += verdict.tokens
        self.lookup = self.tree.next_lookup(self.lookup, len(verdict.path) == len(path) if path else None)


def parse_lookup(text: str) -> tuple[int, int]:
    """--lookup 'N' or 'N..MAX': (lookup, lookup_max), as `Lookup` takes them (lookup_max 0: fixed)."""
    parts = text.split("..")
    check(len(parts) <= 2 and all(p.strip().isdigit() for p in parts),
          f"--lookup is N or N..MAX (positive integers, e.g. 4 or 4..16), got {text!r}")
    Lookup(*(int(p) for p in parts))              # its own one-line checks (N >= 1, MAX >= N), before any loading
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 0
