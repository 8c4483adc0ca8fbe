"""The drafter protocol: what `generate`'s loop asks of a drafter and what it tells it.

`generate` runs one loop for every drafter (`speculative._Decoding`): after the target's prefill it
calls `start` once, then every round

    draft = drafter.propose(run, gamma)     # a chain or a tree for every active row
    verdict = run.verify(draft)             # one target call, acceptance, emission, cache rollback
    drafter.accept(run, verdict)            # what was kept: the drafter brings its own state in step

and `compact` whenever finished rows leave the batch. The loop never asks what kind of drafter it
holds; a new kind (a head that drafts a block of k tokens in one pass, say) is one new class.

`run` (a `speculative._Decoding`) is the decoding's shared state a drafter reads: `run.target`
(a `Decoder` or `hf.HFDecoder`), `run.cache` (the target's KV cache: every row holds all its tokens
but the pending one; `cache.layer_states` (b, n, A*H) holds the aux-layer states of the last call's
n positions when `cache_options` asked for them, `cache.last_embeds(S)` the last-layer states when
it asked for `keep_embeds`), `run.rows` (`rows.seq` (b, capacity) each row's prompt and emitted
tokens, `rows.seq_len` (b,), `rows.last(n)` (b, n) the last n of each row, the pending token last,
`rows.done` (b,), `rows.prompt` (b, longest prompt) the right-padded prompts), `run.sampling`,
`run.generator`, `run.clock` (times a model call: `run.clock(DRAFT, fn, *args)`), `run.draft` (a
`DraftModel`'s model, wrapped as a decoder), `run.plan` (this drafter's `Plan`) and `run.stats`.

A round's proposal, `Draft`, for the b rows still in the batch:
- a chain: `tokens` (b, n), node i's parent is node i - 1 (node 0's the pending token), all rows
  the same n; `q` (b, n, vocab) the exact distribution each token was drawn from (None at
  temperature 0 without a repetition penalty: the tokens are argmaxes, which is all a greedy
  verify reads); `contexts` (b, n + 1, vocab) with a repetition penalty, the ids before each
  position. Verified for the whole batch at once: argmax comparison at T = 0, block or token
  verification at T > 0 (`decode.block`).
- a tree (b = 1, `Plan.rows` 1): `tree` a `decode.tree._Tree` of n nodes (parents before their
  children, siblings' tokens distinct, `tree.q[node]` the distribution its drawn children came
  from, looked-up nodes point masses), `tokens` (1, n) its nodes in order, `mask` (offsets (1 + n,),
  allowed (1 + n, 1 + n)) the verify call's tree attention (None where the tree is one path, which
  a causal call scores). Verified by the tree walk (`tree.walk`, `tree.walk_greedy`): recursive
  rejection sampling, exact argmax at T = 0. A chain is the tree of one child per node; its
  walk at T > 0 is block verification (`tree.walk_chain`) where the drafter marks it.
- `depth`: the positions the round's per-position acceptance counts (gamma for a chain, the
  tree's deepest possible path), at most `Plan.positions`; n = 0 (`run.empty_draft()`) is a plain
  target step.

What `accept` receives, `Verdict`: `before` (b,) each row's cache length before the verify call
(the pending token's position), `kept` (b,) the drafts accepted per row (the row emitted kept + 1
tokens, fewer where EOS or max_new_tokens cut it), `order` (b, span) the verify call's slots each
row kept, in order (the pending token's slot 0 first; None for a chain: slots 0..kept), `span` the
most slots any row kept (a tree's 1 + len(path)), `path` a tree's accepted node ids and `tokens`
the tokens it emitted (the path's and the one after, before any cut; host ints). After `verify` the
target's cache holds each row's committed tokens but the new pending one, and `rows` holds them all.

A block-drafting head (one pass proposes k tokens) proposes a chain of k (`q` the per-position
distributions of that pass), or, with its top-k per position, a tree of those candidates; its
`accept` extends whatever state the head keeps with the target's features of the kept slots
(`order[:, :span]` of `cache.layer_states`), as `chain.Eagle3Drafter` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class Plan:
    """How a drafter drafts in one generate call, from the gamma asked for: `gamma` what
    `DecodeStats.gamma` reports (a tree's depth, a lookup's length), `positions` the per-position
    acceptance counters (the deepest path a round can accept), `nodes` the most draft tokens one
    round feeds the verify call (room in the caches), `rows` the rows decoded at once (None: the
    whole batch; 1: one row after another, as trees are)."""

    gamma: int
    positions: int
    nodes: int
    rows: int | None = None


@dataclass
class Draft:
    """A round's proposal (module docstring)."""

    tokens: Tensor                              # (b, n)
    depth: int
    q: Tensor | None = None                     # (b, n, vocab): chains only
    contexts: Tensor | None = None              # (b, n + 1, vocab): with a repetition penalty
    tree: Any = None                            # a decode.tree._Tree (b = 1): walked on the host
    mask: tuple[Tensor, Tensor] | None = None   # tree attention of the verify call


@dataclass
class Verdict:
    """What a round kept (module docstring)."""

    before: Tensor                              # (b,)
    kept: Tensor                                # (b,)
    order: Tensor | None = None                 # (b, span)
    span: int | None = None
    path: list[int] | None = None
    tokens: list[int] | None = None


class Drafter:
    """The base class of the drafters: a drafter proposes chains or trees and is told what was
    accepted (module docstring). `method` names the decoding (as `DecodeStats.method` reports
    it); `model` is a draft model, `head` a draft head, `tree` and `datastore` a tree's shape and
    its looked-up path's store: a drafter sets the ones it uses. A drafter keeps the state of the
    generate call it drafts for (set by `start`), so it drafts for one call at a time."""

    method = ""
    model: Any = None
    head: Any = None
    tree: Any = None
    datastore: Any = None

    @property
    def module(self) -> Any:
        """The module that drafts (the draft model or the head): what a caller moves to a device,
        puts in eval mode or prepares for a dtype alongside the target; None for `Lookup`."""
        return self.model if self.model is not None else self.head

    def __repr__(self) -> str:
        parts = ([type(self.module).__name__] if self.module is not None else []) \
            + ([repr(self.tree)] if self.tree is not None else []) \
            + (["Datastore"] if self.datastore is not None else [])
        return f"{type(self).__name__}({', '.join(parts)})"

    # -- what generate asks, in order ---------------------------------------------------------

    def check(self, gamma: int | str, sampling: Any, timing: bool, speed_profile: Any) -> None:
        """Refuse, in one line, generate's settings this drafter cannot take (before any work)."""

    def plan(self, gamma: int) -> Plan:
        """The call's `Plan` for `gamma` (an integer; `gamma="auto"` asks for `max_gamma`)."""
        return Plan(gamma, gamma, gamma)

    @property
    def max_gamma(self) -> int:
        """The largest gamma `gamma="auto"` may choose (8, fewer for a prophet trained for fewer)."""
        return 8

    def cache_options(self) -> dict[str, Any]:
        """Keywords of the target's `new_cache`: what this drafter reads from the target's cache."""
        return {}

    def start(self, run: Any) -> None:
        """After the target's prefill (the first token emitted): build this call's state."""

    def propose(self, run: Any, gamma: int) -> Draft:
        """This round's `Draft` (gamma 0: a plain step, the drafter kept in step)."""
        return run.empty_draft()

    def accept(self, run: Any, verdict: Verdict) -> None:
        """Bring the drafter's state in step with what the round kept."""

    def compact(self, dst: Tensor, src: Tensor, batch: int) -> None:
        """Finished rows leave the batch: rows `src` move into rows `dst`, the first `batch` stay
        (`KVCache.compact_rows`); do the same to every per-row state."""


class Plain(Drafter):
    """No drafter: every round is one plain target step (generate without a drafter, or after
    `gamma="auto"` found no gamma that beats plain decoding)."""

    method = "base"

    def plan(self, gamma: int) -> Plan:
        return Plan(0, 0, 0)
