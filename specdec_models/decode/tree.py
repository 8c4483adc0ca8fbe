"""Tree drafting for an EAGLE-3 head: several candidates per position, one target call to verify them.

A chain draft loses the whole round at its first miss. A head that is right 45-55% of the time
at its first guess is right far more often within its top 2-3, so EAGLE-2 and EAGLE-3 draft a
tree: the head expands the most probable nodes of each depth with several children each, and the
target scores every node in one call, each node attending to the committed context and its own
ancestors only (a tree attention mask; its position is the committed length + its depth). The
longest accepted path is kept, plus one target token. On a CPU where verifying 16-40 tokens costs
little more than a 1-token step (bf16), the extra nodes are nearly free.

The tree (`TreeSpec(depth, topk, width)`): the root is the pending token; its `topk` children come
from the head's prediction the last extension left; at each further depth the `width` frontier
nodes of highest cumulative draft log-probability are run through the head (one batched call over
the committed cache plus their ancestors' keys) and get `topk` children each. Nodes:
topk + (depth - 1) * width * topk at most.

Lossless at every temperature.
- T = 0: the children of a node are the head's top-k; the walk follows the child equal to the
  target's argmax, so the output is the target's greedy output, whatever the tree.
- T > 0: the children of a node are drawn from the head's q at that node *without replacement*
  (sequentially, each from q with the earlier ones removed), and the walk runs recursive rejection
  sampling (Jeon et al. 2024, "Recursive Speculative Decoding"): child i is accepted with
  probability min(1, p_i(x_i) / q_i(x_i)); after a rejection p_{i+1} = norm(max(0, p_i - q_i)) and
  q_{i+1} = q_i without x_i; after the last rejection the token is drawn from p_{k+1}. Given the
  rejections so far, x_i is distributed as q_i (whatever the earlier children were), so each test is
  the standard one and the token emitted at the node is distributed exactly as p. Which nodes get
  children, and how many, depends only on their ancestors' values, never on the children's own:
  no candidate is dropped for being unlikely after it was drawn (that would bias the test).

Prompt lookup in the tree (`TreeSpec(..., lookup=N)`): besides the head's nodes, the round's tree
holds up to N tokens that followed the latest earlier occurrence of the context's last 3 (else 2,
else 1) tokens (prompt-lookup decoding, Saxena 2023), as one more path from the root. Where a head
node at that place already holds the token, the path goes on beneath it rather than beside it. A
small model's greedy answers repeat their own words, and there the head, trained for minutes,
predicts them worse than the copy does; the copy costs no draft compute, only its nodes in the
verify call. Lossless too: a looked-up node is a deterministic candidate (q a point mass), tested
after the node's drawn children: accepted with probability p'(x) under the residual p' those left,
else the token is drawn from p' without x, renormalised; together these draw exactly from p' (for
any x not chosen from the target's own draws), so the emitted token is still distributed as p.

A tree of one child per node (`topk` 1: a chain, as long as `depth` or cut by `min_prob`) is
verified by block at T > 0 (`decode.block`, `generate(..., verify="block")`, the default) in every
round without a looked-up path: lossless for a chain whose length depends on its own drafted
prefix, and never fewer tokens than the walk below. Whether a round has a looked-up path depends
only on the committed context, never on this round's draws, so choosing the verification by it
cannot bias the output (a choice by the drawn values could). Rounds with one take the walk.

These knobs make the tree fit each round rather than the worst one:
- `min_prob` (EAGLE-2's observation: the head's draft probability tracks acceptance): a depth is
  expanded only from frontier nodes whose cumulative draft probability is at least `min_prob`, so
  `TreeSpec(6, 3, 1, min_prob=0.3)` goes 6 deep along a path the head is sure of and stops at the
  root's children where it is not. On a CPU, each head step and each verified node costs time
  whether or not it is accepted: the floor spends them where they pay. Lossless: whether a node
  gets children depends on its own value and its ancestors', never on the children's.
- `lookup_max` (adaptive lookup): the looked-up path doubles after a round that accepted all of it
  (up to `lookup_max`) and falls back to `lookup` after a miss, so a long copy is followed in a few
  rounds without paying for long paths where copying fails. The length depends only on earlier
  rounds, so it cannot bias this round's test.
- `nodes` (a budget of verified head nodes, EAGLE-2's reranking): the lookup path comes on top.
  - Greedy decoding grows the tree as above, then verifies only its `nodes` nodes of highest
    cumulative draft probability. A node's is at most its parent's (ties go to the earlier node,
    and a parent is added before its children), so the kept nodes form a tree; the walk follows
    the target's argmax, so the output is exact whatever is kept. For the same reason a frontier
    node that ranks below the budget's last node cannot have a child in it: it is not expanded,
    which saves head steps.
  - Sampling cannot drop a drawn child for its own value (above), nor by a rank that its value can
    change through the tree's growth, so there the budget caps the growth instead: each expanded
    node draws min(`topk`, the nodes left) children, and the tree stops when none are left. How
    many children a node draws then depends only on nodes drawn before them.
  It is for hardware where a verify of many nodes costs about one step (a GPU). On 2 CPU cores,
  where the recipe's floored tree verifies 6-7 nodes, a budget did not pay: the extra depth it
  affords costs head steps the extra tokens do not repay.
- `keep` (greedy decoding: a floor on the nodes verified, not only on those expanded): `min_prob`
  decides which nodes get children, but each expanded node brings all its `topk` children into the
  verify call, most of them unlikely. The head's cumulative draft probability tracks how often a
  node is accepted (on the recipe's held-out prompts a node of q in [0.1, 0.2) was accepted 18-22%
  of the time, one below 0.01 0.5-1%; `stats.nodes_by_q` counts them for any run), and each
  verified node costs the same, so the nodes worth verifying are those above a threshold: `keep`
  cuts the head's nodes below it (and expands none below it). Exact for the same reason as the
  budget; sampling ignores it (a drawn child cannot be dropped for its own value).

Rows of a batch are decoded one after another (the tree's verify already fills the target call);
`stats.per_position_acceptance[k]` is the fraction of rounds that accepted at least k + 1 tokens
of the tree; `stats.drafted` counts the draft nodes the target verified (the lookup's included) and
`stats.accepted` those it accepted, so `acceptance_rate` is the share of a tree that pays.
"""

from __future__ import annotations

import argparse
import bisect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import check, check_positive_int
from ..heads import Eagle3Head
from ..sampling import SamplingConfig, residual, sample, to_probs
from .block import block_verify
from .chain import Eagle3Drafter
from .datastore import Datastore
from .protocol import Draft, Plan, Verdict
from .stats import NODE_Q_EDGES

# The tree grammar every command line takes (`TreeSpec.parse`, the one parser; `add_tree_argument`)
TREE_METAVAR = "DEPTH,TOPK,WIDTH[,LOOKUP[..MAX]][,MIN_PROB][,keep=P][,nodes=N]"
TREE_HELP = ("DEPTH head steps, TOPK children per expanded node, WIDTH nodes expanded per step (e.g. 6,3,1); LOOKUP "
             "adds that many prompt-lookup tokens as one more path (LOOKUP..MAX: doubling after each fully accepted "
             "lookup, up to MAX, e.g. 6,3,1,4..16); a last number with a point expands only nodes whose draft "
             "probability reaches it (e.g. 6,3,1,4..16,0.3); nodes=N verifies only the N most probable of the "
             "head's nodes; keep=P (greedy) only the head's nodes of draft probability >= P")


@dataclass(frozen=True)
class TreeSpec:
    """The shape of a draft tree: `depth` draft steps of the head, `topk` children per expanded
    node, `width` nodes expanded per depth after the first, and `lookup` tokens of prompt lookup
    (0: none) as one more path; `lookup_max` > 0 makes the lookup adaptive (from `lookup` up to
    `lookup_max`), `min_prob` > 0 expands only nodes whose cumulative draft probability reaches it,
    `nodes` > 0 verifies at most that many head nodes, the most probable; `keep` > 0 verifies only
    head nodes whose cumulative draft probability reaches it (greedy decoding; module docstring)."""

    # the default is the best of the shapes measured on a 2-core CPU, where a verify call's cost
    # grows with its tokens; where verifying many tokens is
    # nearly free (a GPU), larger trees (e.g. 5,3,3) pay
    depth: int = 3
    topk: int = 2
    width: int = 1
    lookup: int = 0
    lookup_max: int = 0
    min_prob: float = 0.0
    nodes: int = 0                # the head's nodes verified per round, most probable first (0: all)
    keep: float = 0.0             # greedy: verify only head nodes of cumulative draft probability >= keep

    def __post_init__(self) -> None:
        for name in ("depth", "topk", "width"):
            check_positive_int(getattr(self, name), f"tree {name}")
        for name in ("lookup", "lookup_max", "nodes"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                  f"tree {name} must be a non-negative integer, got {value!r}")
        check(self.lookup_max == 0 or self.lookup_max >= self.lookup >= 1,
              f"an adaptive lookup needs 1 <= lookup <= lookup_max, got lookup {self.lookup}, "
              f"lookup_max {self.lookup_max}")
        for name in ("min_prob", "keep"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1,
                  f"tree {name} must be in [0, 1), got {value!r}")

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """'DEPTH,TOPK,WIDTH[,LOOKUP[..LOOKUP_MAX]][,MIN_PROB][,keep=P][,nodes=N]', e.g. '5,3,3',
        '3,2,1,4', '3,2,1,4..16' (lookup adapting up to 16), '6,2,1,4..16,0.2' (depth up to 6 while
        the best path's draft probability stays >= 0.2), '6,3,2,4..16,0.3,nodes=12' (the 12 most
        probable of the head's nodes verified) or '8,4,3,4..16,0.1,keep=0.05' (greedy: only head
        nodes of draft probability >= 0.05 verified)."""
        usage = (f"a tree is {TREE_METAVAR} (positive integers, MIN_PROB and P in [0, 1); e.g. 5,3,3 or "
                 f"3,2,1,4..16 or 6,3,2,4,0.2,nodes=12 or 8,4,3,4..16,0.1,keep=0.05), got {text!r}")
        parts = [p.strip() for p in text.split(",")]
        named: dict[str, str] = {}
        while len(parts) > 3 and "=" in parts[-1]:
            name, _, value = parts.pop().partition("=")
            check(name.strip() in ("keep", "nodes") and name.strip() not in named, usage)
            named[name.strip()] = value.strip()
        check(named.get("nodes", "0").isdigit(), usage)
        nodes = int(named.get("nodes", "0"))
        try:
            keep = float(named.get("keep", "0"))
        except ValueError:
            check(False, usage)
        min_prob = 0.0
        if len(parts) > 3 and "." in parts[-1] and ".." not in parts[-1]:
            try:
                min_prob = float(parts.pop())
            except ValueError:
                check(False, usage)
        lookup = parts[3].split("..") if len(parts) == 4 else ["0"]
        check(len(parts) in (3, 4) and all(p.isdigit() for p in parts[:3] + lookup) and len(lookup) <= 2, usage)
        return cls(*(int(p) for p in parts[:3]), lookup=int(lookup[0]),
                   lookup_max=int(lookup[1]) if len(lookup) == 2 else 0, min_prob=min_prob, nodes=nodes, keep=keep)

    @property
    def label(self) -> str:
        """'3,2,1', '3,2,1 + lookup 6', '6,2,1 + lookup 4..16, q >= 0.2', '6,3,2, 12 nodes',
        '8,4,3 + lookup 4..16, q >= 0.1, nodes q >= 0.05'."""
        text = f"{self.depth},{self.topk},{self.width}"
        if self.lookup:
            text += f" + lookup {self.lookup}" + (f"..{self.lookup_max}" if self.adaptive else "")
        text += f", q >= {self.min_prob:g}" if self.min_prob else ""
        text += f", nodes q >= {self.keep:g}" if self.keep else ""
        return text + (f", {self.nodes} nodes" if self.nodes else "")

    @property
    def adaptive(self) -> bool:
        return self.lookup_max > 0

    @property
    def longest_lookup(self) -> int:
        return self.lookup_max or self.lookup

    @property
    def max_nodes(self) -> int:
        grown = self.topk + (self.depth - 1) * self.width * self.topk
        return (min(grown, self.nodes) if self.nodes else grown) + self.longest_lookup

    @property
    def max_depth(self) -> int:
        """The longest path a round can accept: the head's depth or the lookup's."""
        return max(self.depth, self.longest_lookup)

    def next_lookup(self, length: int, accepted_all: bool | None) -> int:
        """The next round's lookup length after a round with `length` whose looked-up path the
        target accepted whole (True), missed (False) or that found nothing to look up (None): an
        adaptive lookup doubles after a whole one (up to lookup_max) and falls back to `lookup`
        after a miss; a fixed one, or a round without evidence, keeps its length."""
        if not self.adaptive or accepted_all is None:
            return length
        return min(2 * length, self.lookup_max) if accepted_all else self.lookup


def tree_argument(text: str) -> str:
    """An argparse type: `text` if it is a tree (`TreeSpec.parse`) or '' (none), so a bad tree is
    the parser's one-line error, before any work; the text is kept, as configs and reports hold it."""
    if text.strip():
        try:
            TreeSpec.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip()


def add_tree_argument(parser, what: str, *, flag: str = "--tree", **kwargs):
    """Add `flag` to `parser`: a draft tree in the one grammar (`TREE_METAVAR`, `TREE_HELP`), its
    value the tree's text ('' for none); `what` says what the tree does in this command."""
    return parser.add_argument(flag, type=tree_argument, metavar=TREE_METAVAR, help=f"{what}. {TREE_HELP}",
                               **kwargs)


def lookup_continuation(context: list[int], length: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup: `length` tokens that followed the latest earlier occurrence of the last n
    tokens of `context`, for the largest n <= max_ngram that occurs earlier ([] if none does).
    Where what followed runs into the end of the context, the context is read as a loop: the
    d tokens between the occurrence and the end repeat (a small model's greedy loops)."""
    return lookup_match(context, length, max_ngram)[1]


def lookup_match(context: list[int], length: int, max_ngram: int = 3) -> tuple[int, list[int]]:
    """(n, `lookup_continuation`): the n of the n-gram the continuation follows (0 and [] if none)."""
    end = len(context)
    if length <= 0:
        return 0, []
    for n in range(min(max_ngram, end - 1), 0, -1):
        tail = context[end - n:]
        for start in range(end - n - 1, -1, -1):         # latest first: in a loop, its last turn
            if context[start:start + n] == tail:
                period = end - (start + n)
                return n, [context[start + n + i % period] for i in range(length)]
    return 0, []


def looked_up_path(context: list[int], length: int, datastore: Datastore | None = None) -> list[int]:
    """A round's looked-up path: prompt lookup's continuation of `context`, or the datastore's
    where that follows a longer n-gram (a tie goes to the context's own match)."""
    n, path = lookup_match(context, length)
    if datastore is not None:
        m, stored = datastore.match(context, length)
        if m > n:
            path = stored
    return path


def _without(q: Tensor, x: int) -> Tensor | None:
    """q with token x removed, renormalised (None when nothing is left): the next child's q."""
    rest = q.clone()
    rest[x] = 0
    mass = rest.sum()
    return None if float(mass) <= 0 else rest / mass


def _rejected(p: Tensor, x: int) -> Tensor | None:
    """The target's distribution after its test of a looked-up token x failed: p without x,
    renormalised (the test accepts with probability p(x) < 1 here, so some mass is left)."""
    return _without(p, x)


class _Tree:
    """The nodes of one round: token, parent (-1: the root), depth, cumulative draft log-prob;
    `looked_up` holds the nodes prompt lookup added (deterministic candidates)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.score: list[float] = []
        self.children: dict[int, list[int]] = {}
        self.q: dict[int, Tensor] = {}           # node -> the distribution its children were drawn from
        self.looked_up: set[int] = set()
        self.lookup_path: list[int] = []        # the looked-up tokens' nodes, root first (shared ones too)
        self.block = False                      # a drawn chain, verified by block (`walk_chain`)

    def add(self, parent: int, tokens: list[int], scores: list[float], q: Tensor | None) -> list[int]:
        start = len(self.tokens)
        depth = 1 if parent < 0 else self.depth[parent] + 1
        self.tokens += tokens
        self.parent += [parent] * len(tokens)
        self.depth += [depth] * len(tokens)
        self.score += scores
        ids = list(range(start, len(self.tokens)))
        self.children[parent] = self.children.get(parent, []) + ids
        if q is not None:
            self.q[parent] = q
        return ids

    def add_path(self, tokens: list[int]) -> None:
        """A looked-up path from the root: each token goes beneath the node holding the one before
        (an existing child with the same token is followed, not duplicated)."""
        node = -1
        for token in tokens:
            same = [c for c in self.children.get(node, []) if self.tokens[c] == token]
            if same:
                node = same[0]
            else:
                node = self.add(node, [token], [0.0], None)[0]
                self.looked_up.add(node)
            self.lookup_path.append(node)

    def pruned(self, budget: int, floor: float = -math.inf) -> _Tree:
        """The nodes of cumulative draft log-probability >= `floor`, at most the `budget` (0: no
        limit) highest, as a tree of their own (ids renumbered in order; itself when nothing is
        cut); ties go to the earlier node, so every kept node's parent is kept (a child's score is
        at most its parent's). Greedy decoding only (module docstring), before any lookup path."""
        n = len(self.tokens)
        ranked = [i for i in sorted(range(n), key=lambda i: (-self.score[i], i)) if self.score[i] >= floor]
        ranked = ranked[:budget] if budget > 0 else ranked
        if len(ranked) == n:
            return self
        keep = sorted(ranked)
        tree, new = _Tree(), {-1: -1}
        for i in keep:                          # a parent ranks before its children, so it is in `new`
            new[i] = tree.add(new[self.parent[i]], [self.tokens[i]], [self.score[i]], None)[0]
        tree.q = {new[i]: q for i, q in self.q.items() if i in new}
        return tree

    def ancestry(self) -> Tensor:
        """(n, n) bool: node j is node i or one of its ancestors."""
        n = len(self.tokens)
        allowed = torch.eye(n, dtype=torch.bool)
        for i in range(n):
            if self.parent[i] >= 0:
                allowed[i] |= allowed[self.parent[i]]
        return allowed


class _TreeDecoding:
    """Grows a round's tree from an EAGLE-3 head (module docstring): the head's children of each
    expanded node, then the looked-up path."""

    def __init__(self, head, spec: TreeSpec, sampling: SamplingConfig, generator: torch.Generator | None,
                 vocab: int, datastore: Datastore | None = None) -> None:
        self.head, self.spec, self.datastore = head, spec, datastore
        self.sampling, self.generator, self.vocab = sampling, generator, vocab

    def draft_probs(self, logits: Tensor) -> Tensor:
        """The head's distribution q over the target vocabulary (zero outside the draft vocabulary)."""
        return to_probs(self.head.to_target_vocab(logits)[..., : self.vocab], self.sampling)

    def children(self, logits: Tensor, k: int) -> tuple[list[int], list[float], Tensor | None]:
        """k children of a node whose head logits are `logits` (draft,): (tokens, log q, q drawn from)."""
        if self.sampling.greedy:                 # the head's top-k, over its own vocabulary
            top = torch.log_softmax(logits.float(), -1).topk(min(k, logits.shape[-1]))
            return self.head.draft_ids[top.indices].tolist(), top.values.tolist(), None
        q = self.draft_probs(logits.float())
        rest, tokens, scores = q.clone(), [], []
        for _ in range(k):                       # without replacement: each from q without the earlier ones
            mass = float(rest.sum())
            if mass <= 0:
                break
            x = int(sample(rest / mass, self.generator))
            tokens.append(x)
            scores.append(float(torch.log(q[x])))
            rest[x] = 0
        return tokens, scores, q

    def draft(self, hcache, root_logits: Tensor, root_feature: Tensor, context: list[int], lookup: int) -> _Tree:
        """Grow the round's tree from the head's prediction at the root (`root_logits` (draft,),
        `root_feature` (H,)), then add the lookup path found in `context` (the prompt and the
        tokens emitted so far, the root last); see the module docstring."""
        head, spec, tree = self.head, self.spec, _Tree()
        layer = head.layers[0]
        L = int(hcache.lengths[0])
        ck, cv = hcache.k[0, :, :, :L], hcache.v[0, :, :, :L]           # (1, kv, L, d) committed positions
        # sampling spends a node budget as the tree grows; greedy decoding prunes the grown tree
        left = spec.nodes if spec.nodes and not self.sampling.greedy else math.inf
        tokens, scores, q = self.children(root_logits, min(spec.topk, left))
        left -= len(tokens)
        frontier = tree.add(-1, tokens, scores, q)
        feature = {-1: root_feature}
        done_k: list[Tensor] = []
        done_v: list[Tensor] = []
        processed: list[int] = []
        floor = math.log(spec.min_prob) if spec.min_prob > 0 else -math.inf
        kept = math.log(spec.keep) if spec.keep > 0 and self.sampling.greedy else -math.inf
        floor = max(floor, kept)          # greedy: a node below `keep` is cut, and so are its children
        for _ in range(spec.depth - 1):
            chosen = [i for i in sorted(frontier, key=lambda i: -tree.score[i])[: spec.width] if tree.score[i] >= floor]
            chosen = chosen[: math.ceil(left / spec.topk)] if left < math.inf else chosen     # ones the budget reaches
            if spec.nodes and self.sampling.greedy and len(tree.tokens) >= spec.nodes:
                # a child ranks below its parent, so it enters the budget only under a parent
                # that ranks above the budget's last node: the others' children are not computed
                last = sorted(tree.score, reverse=True)[spec.nodes - 1]
                chosen = [i for i in chosen if tree.score[i] > last]
            if not chosen:
                break
            m = len(chosen)
            toks = torch.tensor([tree.tokens[i] for i in chosen], device=head.device)
            feats = torch.stack([feature[tree.parent[i]] for i in chosen])[None]          # (1, m, H)
            pos = torch.tensor([[L + tree.depth[i] - 1 for i in chosen]], device=head.device)
            cos, sin = head.rotary(pos, feats.dtype)
            qq, kk, vv = layer.qkv(head.embed(toks[None]), feats, cos, sin)
            keys = torch.cat([ck, *done_k, kk], 2)
            values = torch.cat([cv, *done_v, vv], 2)
            allowed = tree.ancestry()
            mask = torch.cat([torch.ones(m, L, dtype=torch.bool),
                              allowed[chosen][:, processed + chosen]], 1).to(head.device)
            attended = F.scaled_dot_product_attention(qq, keys, values, attn_mask=mask[None, None],
                                                      enable_gqa=qq.shape[1] != kk.shape[1])
            out = layer.finish(feats, attended)[0]                                        # (m, H)
            logits = head.logits(out)                                                     # (m, draft)
            done_k.append(kk)
            done_v.append(vv)
            processed += chosen
            frontier = []
            for j, i in enumerate(chosen):
                feature[i] = out[j]
                tokens, scores, q = self.children(logits[j], min(spec.topk, left))
                left -= len(tokens)
                frontier += tree.add(i, tokens, [tree.score[i] + s for s in scores], q)
        if self.sampling.greedy:
            tree = tree.pruned(spec.nodes, kept)
        tree.add_path(looked_up_path(context, lookup, self.datastore))
        return tree


class Draws:
    """The host-side draws of a tree walk, from the decoding's generator: a token from a
    distribution (vocab,) and a uniform in [0, 1) (on the generator's device: a CUDA generator
    draws CUDA tensors)."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator
        self.device = generator.device if generator is not None else None

    def token(self, probs: Tensor) -> int:
        return int(sample(probs, self.generator))

    def uniform(self) -> float:
        return float(torch.rand((), dtype=torch.float64, device=self.device, generator=self.generator))


def walk(tree: _Tree, p: Tensor, draws: Draws) -> tuple[list[int], int]:
    """The accepted path (node ids) and the token after it, from the target's distributions p
    (1 + nodes, vocab): row 0 at the root (the pending token), row i + 1 at node i. Sampling
    only: greedy decoding takes `walk_greedy`; a drawn chain marked `tree.block` takes `walk_chain`."""
    if tree.block and not tree.lookup_path:
        return walk_chain(tree, p, draws)
    path: list[int] = []
    node = -1
    while True:
        probs = p[node + 1]
        kids = tree.children.get(node, [])
        if not kids:
            return path, draws.token(probs)                                    # a leaf: the bonus token
        q = tree.q.get(node)
        accepted = None
        for c in (c for c in kids if c not in tree.looked_up):                # recursive rejection sampling
            x = tree.tokens[c]
            u = draws.uniform()
            if u * float(q[x]) < float(probs[x]):
                accepted = c
                break
            probs = residual(probs, q)
            q = _without(q, x)
            if q is None:
                break
        looked = [c for c in kids if c in tree.looked_up]                      # at most one per node
        if accepted is None and looked:          # a point-mass candidate, last: accepted with p'(x)
            x = tree.tokens[looked[0]]
            u = draws.uniform()
            if u < float(probs[x]):
                accepted = looked[0]
            else:
                probs = _rejected(probs, x)
        if accepted is None:
            return path, draws.token(probs)
        node = accepted
        path.append(node)


def walk_greedy(tree: _Tree, best: list[int]) -> tuple[list[int], int]:
    """`walk` at temperature 0, from the target's argmax at the root and at each node (best[0],
    best[i + 1]; no (1 + nodes, vocab) one-hot built): follow the child that holds the argmax
    while there is one; the argmax where none does is the token after the path."""
    path: list[int] = []
    node = -1
    while True:
        token = best[node + 1]
        match = [c for c in tree.children.get(node, []) if tree.tokens[c] == token]
        if not match:
            return path, token
        node = match[0]
        path.append(node)


def walk_chain(tree: _Tree, p: Tensor, draws: Draws) -> tuple[list[int], int]:
    """`walk` for a tree that is one chain of drawn nodes, by block verification (`decode.block`)."""
    chain: list[int] = []
    node = -1
    while tree.children.get(node):
        node = tree.children[node][0]
        chain.append(node)
    if not chain:
        return [], draws.token(p[0])
    q = torch.stack([tree.q[tree.parent[c]] for c in chain])[None]                   # (1, g, vocab)
    u = torch.tensor([[draws.uniform() for _ in chain]], dtype=torch.float64)
    drafts = torch.tensor([[tree.tokens[c] for c in chain]], device=q.device)
    kept, final = block_verify(p[[0] + [c + 1 for c in chain]][None], q, drafts, u.to(q.device))
    return chain[: int(kept)], draws.token(final[0])


class TreeDrafter(Eagle3Drafter):
    """An EAGLE-3 head drafting a tree shaped by `tree` (a `TreeSpec`), verified in one call per
    row (method "eagle3_tree"); `datastore` (with a tree whose lookup is on) proposes the looked-up
    path where it matches a longer n-gram than the context does (`decode.datastore`). Its head's
    state between rounds is the chain's (`chain.Eagle3Drafter`), extended with the kept path only."""

    method = "eagle3_tree"

    def __init__(self, head, tree: TreeSpec, datastore: Datastore | None = None) -> None:
        check(datastore is None or (isinstance(tree, TreeSpec) and tree.lookup > 0),
              "a datastore proposes a tree's looked-up path: pass it with a tree whose lookup is on (e.g. 8,4,3,4..16)")
        check(datastore is None or isinstance(datastore, Datastore),
              f"datastore must be a decode.datastore.Datastore, got {type(datastore).__name__}")
        check(isinstance(tree, TreeSpec), f"tree must be a decode.tree.TreeSpec, got {type(tree).__name__}")
        check(isinstance(head, Eagle3Head), f"tree drafting needs an EAGLE-3 head (an hf.Eagle3Head), "
                                            f"got {type(head).__name__}")
        # a head that drafts a block in one pass (a P-EAGLE head is an Eagle3Head too) drafts its own tree
        check(not callable(getattr(head, "draft_block", None)),
              f"a {getattr(head, 'kind', 'block')} head drafts its tree in one pass: use "
              f"decode.BlockDrafter(head, tree), not TreeDrafter")
        self.head, self.tree, self.datastore = head, tree, datastore

    def check(self, gamma, sampling, timing, speed_profile) -> None:
        check_own_depth("tree drafting", gamma, sampling, timing, speed_profile)

    def plan(self, gamma: int) -> Plan:
        return Plan(self.tree.depth, self.tree.max_depth, self.tree.max_nodes, rows=1)

    def start(self, run) -> None:
        super().start(run)
        spec, sampling = self.tree, run.sampling
        self.grower = _TreeDecoding(self.head, spec, sampling, run.generator, run.target.vocab_size, self.datastore)
        # sampled chains (topk 1) in rounds without a looked-up path are verified by block
        self.block = run.block and spec.topk == 1 and not sampling.greedy
        self.lookup = spec.lookup
        self.context = run.rows.seq[0, : int(run.rows.seq_len[0])].tolist()     # the prompt and the tokens emitted
        if not run.stats.nodes_by_q:
            run.stats.nodes_by_q = [0] * (len(NODE_Q_EDGES) + 1)
            run.stats.accepted_by_q = [0] * (len(NODE_Q_EDGES) + 1)

    def propose(self, run, gamma: int) -> Draft:
        device = run.target.device
        logits, feature = self.head_next                      # (1, draft), (1, 1, H)
        tree = self.grower.draft(self.cache, logits[0], feature[0, 0], self.context, self.lookup)
        tree.block = self.block
        self.last_tree = tree
        n = len(tree.tokens)
        allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        allowed[:, 0] = True
        allowed[1:, 1:] = tree.ancestry()
        offsets = torch.tensor([0] + tree.depth, device=device)
        return Draft(torch.tensor([tree.tokens], dtype=torch.long, device=device), self.tree.max_depth, tree=tree,
                     mask=(offsets, allowed.to(device)))

    def accept(self, run, verdict: Verdict) -> None:
        super().accept(run, verdict)
        self.context += verdict.tokens
        tree, path, stats = self.last_tree, verdict.path, run.stats
        looked = tree.lookup_path
        self.lookup = self.tree.next_lookup(self.lookup, path[: len(looked)] == looked if looked else None)
        on_path = set(path)
        for i, score in enumerate(tree.score):           # the head's nodes by their cumulative q
            if i not in tree.looked_up:
                b = bisect.bisect_right(NODE_Q_EDGES, math.exp(score))
                stats.nodes_by_q[b] += 1
                stats.accepted_by_q[b] += i in on_path


def check_own_depth(kind: str, gamma, sampling: SamplingConfig, timing: bool, speed_profile) -> None:
    """A drafter with its own depth (a tree's, a lookup's) takes no gamma="auto", speed profile,
    repetition penalty or timing."""
    check(gamma != "auto" and speed_profile is None, f"{kind} has its own depth (the tree's or the lookup's): "
                                                     f"gamma='auto' and a speed_profile do not apply")
    check(not sampling.penalised and not timing, f"{kind} does not take a repetition penalty or timing=True")
