"""Block drafting: a head that drafts a block of k tokens in one pass (DFlash; P-EAGLE), proposed
as a chain or as a tree of its top candidates per position (`decode.protocol`).

A block head keeps its own state of the committed context (a KV cache of the target's tapped
features) and answers one call per round with the logits of k positions at once:

    head.aux_layers                          the target's `hidden_states` indices it reads
    head.max_gamma                           k, the drafts of one pass
    head.new_cache(batch, capacity)          its state, a `KVCache` with one length per row
    head.extend(tokens, aux, cache)          append positions t: taps aux (b, n, A*H) and the token
                                             after each, tokens (b, n); every row advances by n
    head.draft_block(anchor, cache)          logits (b, k, draft) of positions L + 1 .. L + k, one
                                             pass, anchor (b,) the pending token at L = cache.lengths
    head.to_target_vocab(logits), head.target_ids(draft ids), head.draft_ids, head.target, head.vocab_size

(a `heads.dflash.DFlashHead` is one). `HeadDrafter(head)` of such a head is a `BlockDrafter`.

- A chain (`BlockDrafter(head)`): the first gamma <= k positions, token i drawn from q_i, the
  softmax of position i's logits (processed as the target's: `sampling.to_probs`, with a
  repetition penalty seeing the drafts before it, by `chain.sample_chain`). q_i does not depend
  on the drafts before position i, which verification allows: it needs each draft drawn from the
  q it reports, whatever that q was computed from. Verified as any chain, for the whole batch
  (argmax at T = 0, block or token verification at T > 0).
- A tree (`BlockDrafter(head, TreeSpec(depth, topk, width))`, one row at a time): the root's
  `topk` children come from q_1, and at each depth d >= 2 the `width` frontier nodes of highest
  cumulative draft log-probability (at least `min_prob`'s log where set) each get `topk` children
  from q_d: at T = 0 its top-k, at T > 0 drawn without replacement (each node draws its own), as
  the tree walk's recursive rejection sampling needs (`decode.tree`: lossless at every
  temperature). Siblings are distinct; a node's children depend on its depth and never on the
  other nodes' draws, and whether it is expanded on its own value and its ancestors' only. All
  depths come from the same one pass: the tree costs one head call, whatever its size.

After each verify call, `accept` extends the head's state with the target's taps of the slots
the round kept (`verdict.order[:, :span]` of a tree, every slot of a chain) and rolls each row
back to the target's committed length; the block itself is never written to the head's cache.
The cost model (`cost.SpeedProfile(one_pass=True)`) charges a round one draft pass, not gamma.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..errors import check, check_positive_int
from .chain import HeadDrafter, sample_chain
from .cost import DRAFT
from .protocol import Draft, Plan, Verdict
from .tree import TreeSpec, _Tree, _TreeDecoding, check_own_depth


def is_block_head(head: Any) -> bool:
    """Whether `head` drafts a block in one pass (the protocol of the module docstring)."""
    return callable(getattr(head, "draft_block", None)) and callable(getattr(head, "extend", None))


class BlockDrafter(HeadDrafter):
    """A block head's drafter (module docstring): a chain of up to head.max_gamma drafts per row,
    or with `tree` (a `decode.tree.TreeSpec` of depth <= head.max_gamma, no lookup, node budget or
    keep) a tree of its top candidates per position, one row at a time. Method: the head's `kind`
    ("dflash"), "_tree" added for a tree."""

    one_pass = True                     # a round's drafts cost one head call (cost.SpeedProfile)

    @staticmethod
    def handles(head: Any) -> bool:
        return is_block_head(head)

    def __init__(self, head: Any, tree: TreeSpec | None = None) -> None:
        check(is_block_head(head), f"BlockDrafter drafts with a head that drafts a block in one pass (a "
                                   f"DFlashHead), got {type(head).__name__}")
        check(tree is None or isinstance(tree, TreeSpec), f"tree must be a decode.tree.TreeSpec, got "
                                                          f"{type(tree).__name__}")
        if tree is not None:
            check(tree.depth <= head.max_gamma, f"the tree's depth {tree.depth} exceeds the {head.max_gamma} "
                                                f"positions one pass of the block head drafts")
            check(not tree.lookup and not tree.nodes and not tree.keep,
                  "a block head's tree takes no lookup path, node budget or keep (DEPTH,TOPK,WIDTH[,MIN_PROB])")
        self.head, self.tree = head, tree
        kind = getattr(head, "kind", "block")
        self.method = kind if tree is None else f"{kind}_tree"

    @property
    def max_gamma(self) -> int:
        return self.head.max_gamma

    def check(self, gamma: int | str, sampling: Any, timing: bool, speed_profile: Any) -> None:
        if self.tree is not None:
            check_own_depth("a block head's tree", gamma, sampling, timing, speed_profile)
        elif gamma != "auto":
            check_positive_int(gamma, "gamma")
            check(gamma <= self.head.max_gamma, f"gamma {gamma} exceeds the {self.head.max_gamma} drafts one pass of "
                                                f"the block head gives (its block size - 1)")

    def plan(self, gamma: int) -> Plan:
        if self.tree is None:
            return Plan(gamma, gamma, gamma)
        spec = self.tree
        return Plan(spec.depth, spec.depth, spec.topk + (spec.depth - 1) * spec.width * spec.topk, rows=1)

    def cache_options(self) -> dict[str, Any]:
        return {"keep_layers": self.head.aux_layers}

    def start(self, run: Any) -> None:
        self.cache = self.head.new_cache(run.rows.batch, run.rows.capacity)
        zeros = torch.zeros_like(run.rows.lens)
        self.accept(run, Verdict(zeros, zeros))              # the prompt's positions, from the prefill

    def accept(self, run: Any, verdict: Verdict) -> None:
        """Feed the head the target's taps of the positions the last call committed (a tree's kept
        slots only), with the token after each, then roll each row back to the committed length."""
        rows, before = run.rows, verdict.before
        feats = run.cache.layer_states                                  # (b, n, A*H) of positions before ..
        if verdict.order is not None:
            order = verdict.order[:, : verdict.span]
            feats = feats.gather(1, order[..., None].expand(-1, -1, feats.shape[-1]))
        n = feats.shape[1]
        idx = (before[:, None] + 1 + torch.arange(n, device=before.device)).clamp(max=rows.capacity - 1)
        tokens = rows.seq.gather(1, idx)                                # x_{t+1} for each position t
        run.clock(DRAFT, self.head.extend, tokens, feats, self.cache)
        self.cache.rollback(run.cache.lengths)

    def propose(self, run: Any, gamma: int) -> Draft:
        if gamma == 0:
            return run.empty_draft()
        head = self.head
        logits = run.clock(DRAFT, head.draft_block, run.rows.last(1)[:, 0], self.cache)      # (b, k, draft)
        if self.tree is not None:
            return self._tree_draft(run, logits[0])
        return sample_chain(run, logits[:, 0], gamma, _Positions(logits), head=head)

    def _tree_draft(self, run: Any, logits: Tensor) -> Draft:
        """The round's tree from one pass's logits (k, draft) of one row (module docstring)."""
        spec, sampling = self.tree, run.sampling
        grower = _TreeDecoding(self.head, spec, sampling, run.generator, run.target.vocab_size)
        tree = _Tree()
        frontier = tree.add(-1, *grower.children(logits[0], spec.topk))
        floor = math.log(spec.min_prob) if spec.min_prob > 0 else -math.inf
        for d in range(1, spec.depth):
            chosen = [i for i in sorted(frontier, key=lambda i: -tree.score[i])[: spec.width] if tree.score[i] >= floor]
            frontier = []
            for i in chosen:
                tokens, scores, q = grower.children(logits[d], spec.topk)
                frontier += tree.add(i, tokens, [tree.score[i] + s for s in scores], q)
        tree.block = run.block and spec.topk == 1 and not sampling.greedy
        n, device = len(tree.tokens), run.target.device
        allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        allowed[:, 0] = True
        allowed[1:, 1:] = tree.ancestry()
        offsets = torch.tensor([0] + tree.depth, device=device)
        return Draft(torch.tensor([tree.tokens], dtype=torch.long, device=device), spec.depth, tree=tree,
                     mask=(offsets, allowed.to(device)))

    def compact(self, dst: Tensor, src: Tensor, batch: int) -> None:
        self.cache.compact_rows(dst, src, batch)


class _Positions:
    """`sample_chain`'s step over a pass's logits (b, k, draft): the next position's logits,
    whatever token was drawn (a block's positions do not read each other's drafts)."""

    def __init__(self, logits: Tensor) -> None:
        self.logits, self.at = logits, 0

    def __call__(self, token: Tensor) -> Tensor:
        self.at += 1
        return self.logits[:, self.at]


__all__ = ["BlockDrafter", "is_block_head"]
