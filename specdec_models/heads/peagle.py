"""A P-EAGLE-class draft head: EAGLE-3 drafting K depths in one pass from mask positions.

P-EAGLE ("parallel EAGLE"; the layout of speculators' `peagle` model, its PR #480) keeps the EAGLE-3
head of `heads.eagle3` (an fc over the target's aux layers, one decoder layer reading
[embedding; feature], an LM head over a draft vocabulary) and changes how it drafts. The head's
cache holds the context: head position t reads x_{t+1} and the target's fused feature of t, and its
output predicts x_{t+2} (depth 0, as EAGLE-3's first draft). In the same pass, K - 1 mask positions
t+1..t+K-1 follow, each reading [E(m); fc(mask_hidden)]: the embedding of the mask token m and a
learned vector in the aux layers' space in place of a target feature. The output at t + d (depth d)
predicts x_{t+2+d}. Attention stays causal: a mask position sees the context and the mask
positions before it, and no draft, so the K drafts come from one pass where EAGLE-3 makes K.

The mask token's embedding is a learned row (`mask_embed`, started from the target's row of
`mask_token_id`); every other token reads the target's frozen embedding, as in `Eagle3Head`.
speculators trains the whole embedding table (its `embed_requires_grad`); here only the mask row
learns, which is the only row a mask position reads, and an export writes the target's table with
that row replaced. So the mask token should be one that never occurs in the text (a reserved or
special token): a real occurrence reads the learned row in both layouts.

Training (`PEagleHead.parallel_loss`) follows speculators' COD sampling ("conditional drop"):
depth 0 runs teacher-forced at every position (as EAGLE-3's step 0); depth d runs at anchors drawn
from those of depth d - 1 whose label at depth d counts, keeping max(ratio^d, ratio_min) of the
row's counted labels (less d), so depth d trains on a shrinking share of positions and a row
costs about 1 / (1 - ratio) passes rather than K. A chain (anchor t, depths 1..d) exists only if
every label on it, those of positions t + 2 .. t + 1 + d, counts: it never runs past the row's
end, past the end of the conversation (the padding after it), or across a prompt or a user turn
between two answers (`depth_chains`, the one place that decides it). speculators' sampler wraps
around the row (`% seq_length`) and can anchor at -1; this one does neither. A mask position's
queries, keys and values are the same vector at every anchor but for their rotary position, so
depth d costs its attention and one feed-forward per sampled anchor. The loss is the forward KL
from the target's distribution renormalised over the draft vocabulary (`Eagle3Head.label_targets`)
to the head's, averaged over every sampled (anchor, depth) pair whose label counts, as
speculators pools them.

Decoding follows the block-head protocol of `decode.block_draft` (`HeadDrafter(head)` is a
`BlockDrafter`: a chain of up to K drafts, or a tree of the top candidates of each depth):
`extend(tokens, aux, cache)` appends committed positions from the target's raw taps (b, n, A*H),
keeping each position's fused feature in the cache (`KVCache.embeds`), and `draft_block(anchor,
cache)` is the round's one pass: it re-reads the last committed position L - 1 (the pending token
`anchor` and its kept feature) and the K - 1 mask positions after it, giving the K depths' logits
(b, K, draft), then rolls the cache back to L. Re-reading position L - 1 costs one position and
lets every row of a batch draft in the same call whatever it committed. Note that `extend` takes
raw taps here where `Eagle3Head.extend` takes fused features (`extend_features`): EAGLE-3's own
drafters (`chain.Eagle3Drafter`, `tree.TreeDrafter`) do not take a P-EAGLE head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..errors import check
from ..kv_cache import KVCache
from .eagle3 import (
    EAGLE3_WEIGHTS,
    Eagle3Config,
    Eagle3Head,
    _pack,
    _unpack,
    eagle3_sizes,
    ttt_attention,
)
from .weights import Weight, WeightTable


@dataclass(frozen=True)
class PEagleConfig(Eagle3Config):
    """An `Eagle3Config` and P-EAGLE's own sizes: `parallel_depths` K (the drafts of one pass, K >= 2),
    `mask_token_id` (the token the mask positions read, in the target's vocabulary),
    `layers_from_target` (how many of the head's decoder layers start as the target's: 0 or 1, the
    head has one layer; 1 starts it as `Eagle3Head.init_layer_from` does)."""

    what = "peagle head config"

    parallel_depths: int = 4
    mask_token_id: int | None = None
    layers_from_target: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.parallel_depths
        check(isinstance(k, int) and not isinstance(k, bool) and k >= 2,
              f"peagle.parallel_depths must be an integer >= 2 (depth 0 and at least one mask position), got {k!r}")
        m = self.mask_token_id
        check(isinstance(m, int) and not isinstance(m, bool) and 0 <= m < self.target_vocab_size,
              f"peagle.mask_token_id must be a token id in the target's vocabulary 0..{self.target_vocab_size - 1}, "
              f"got {m!r}")
        check(self.layers_from_target in (0, 1) and not isinstance(self.layers_from_target, bool),
              f"peagle.layers_from_target must be 0 or 1 (the head has one decoder layer), "
              f"got {self.layers_from_target!r}")
        check(self.max_seq_len > self.parallel_depths,
              f"peagle.parallel_depths ({k}) must be below the head's {self.max_seq_len} positions")

    @classmethod
    def for_target(cls, target: Any, *, parallel_depths: int = 4, mask_token_id: int | None = None,
                   layers_from_target: int = 0, **kw: Any) -> PEagleConfig:
        """`Eagle3Config.for_target`'s head with P-EAGLE's sizes; `mask_token_id` None: the last id
        of the vocabulary the head drafts in (set a reserved token of the target's tokenizer)."""
        base = Eagle3Config.for_target(target, **kw).to_dict()
        mask = base["target_vocab_size"] - 1 if mask_token_id is None else mask_token_id
        return cls(**base, parallel_depths=parallel_depths, mask_token_id=mask, layers_from_target=layers_from_target)


def peagle_sizes(c: PEagleConfig) -> dict[str, int]:
    """`eagle3_sizes`: the same named sizes (AH the aux layers concatenated, H hidden)."""
    return eagle3_sizes(c)


# Every tensor a PEagleHead saves: EAGLE-3's and the two mask inputs.
PEAGLE_WEIGHTS = WeightTable("peagle", (
    *EAGLE3_WEIGHTS.weights,
    Weight("mask_hidden", ("AH",), "what a mask position reads in place of the target's aux hidden states"),
    Weight("mask_embed", ("H",), "the embedding of the mask token (starts as the target's row of mask_token_id)"),
), peagle_sizes)


class DepthLoss(NamedTuple):
    loss: Tensor          # mean KL over every sampled (anchor, depth) pair whose label counts
    depth_kl: Tensor      # (K,) mean KL per depth (no gradient)
    depth_hits: Tensor    # (K,) sampled anchors whose argmax is right at this depth and at every depth before
    depth_correct: Tensor  # (K,) sampled anchors whose argmax is right at this depth
    depth_count: Tensor   # (K,) sampled anchors per depth


def depth_chains(mask: Tensor, depths: int, ratio: float = 0.7, ratio_min: float = 0.2,
                 generator: torch.Generator | None = None) -> list[Tensor]:
    """COD sampling (module docstring): the anchors of depths 1..depths-1, each (b, T) bool, from
    the label mask (b, T) (mask[b, t]: the label of head position t, at position t + 1, counts).
    Depth d keeps, of the anchors of depth d - 1 whose label at t + d counts, floor((count - d) *
    max(ratio^d, ratio_min)) per row (count: the row's counted labels), at random (all when fewer
    are left; speculators' rule). A share of 1 keeps every chain (validation: ratio = ratio_min = 1).
    This is the one place that decides which chains exist: a chain never runs past the row or a
    label that does not count."""
    b, T = mask.shape
    count = mask.sum(1)                                                        # (b,)
    alive = torch.ones_like(mask)
    out = []
    for d in range(1, depths):
        counted = torch.zeros_like(mask)
        counted[:, :max(T - d, 0)] = mask[:, d:]                               # label of depth d at anchor t
        candidate = alive & counted
        share = max(ratio ** d, ratio_min)
        if share >= 1:
            alive = candidate
            out.append(alive)
            continue
        keep = torch.floor((count - d).clamp(min=0).double() * share).long()
        score = torch.rand(b, T, generator=generator, device=mask.device if generator is None else generator.device)
        score = score.to(mask.device).masked_fill(~candidate, 2.0)
        rank = score.argsort(1).argsort(1)
        alive = candidate & (rank < keep[:, None])
        out.append(alive)
    return out


def _packed(anchors: Tensor) -> tuple[Tensor, Tensor]:
    """(positions (b, M), real (b, M)): each row's True entries of anchors (b, T) in order, padded."""
    counts = anchors.sum(1)
    width = max(int(counts.max()), 1) if anchors.shape[0] else 1
    order = (~anchors).to(torch.uint8).argsort(dim=1, stable=True)[:, :width]
    return order, torch.arange(width, device=anchors.device) < counts[:, None]


class PEagleHead(Eagle3Head):
    """A P-EAGLE head for the Hugging Face causal LM `target` (module docstring): an `Eagle3Head`
    with a learned mask embedding and mask feature, drafting `parallel_depths` tokens per pass.

    head = PEagleHead(PEagleConfig.for_target(model, draft_vocab_size=8192, parallel_depths=4), model, ids)
    out = head.parallel_loss(tokens, aux, last, label_mask)        # training
    """

    def __init__(self, config: PEagleConfig, target: Any, draft_ids: Tensor | None = None, *,
                 init_from_target: bool = True) -> None:
        check(isinstance(config, PEagleConfig), f"config must be a PEagleConfig, got {type(config).__name__}")
        rows = target.get_input_embeddings().weight.shape[0] if hasattr(target, "get_input_embeddings") else None
        check(rows is None or config.mask_token_id < rows,
              f"peagle.mask_token_id {config.mask_token_id} is outside the target's embedding of {rows} rows")
        super().__init__(config, target, draft_ids, init_from_target=init_from_target,
                         init_layer_from_target=init_from_target and config.layers_from_target > 0)
        weight = target.get_input_embeddings().weight
        H = config.hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(len(config.aux_layers) * H))   # as speculators starts it
        self.mask_embed = nn.Parameter(weight[config.mask_token_id].detach().float().clone())
        self.to(device=weight.device, dtype=weight.dtype)

    kind = "peagle"                   # what decoding calls it (`DecodeStats.method`, messages)

    @property
    def max_gamma(self) -> int:
        """One pass drafts `parallel_depths` tokens."""
        return self.config.parallel_depths

    def embed(self, tokens: Tensor) -> Tensor:
        """The target's frozen embeddings of tokens (..., n), the mask token's row the learned `mask_embed`."""
        x = super().embed(tokens)
        is_mask = (tokens.to(self.device) == self.config.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embed.to(x.dtype), x)

    def mask_inputs(self, b: int, n: int) -> tuple[Tensor, Tensor]:
        """What n mask positions of b rows read: (tokens (b, n), all the mask token; features (b, n, H),
        the fused `mask_hidden`)."""
        tokens = torch.full((b, n), self.config.mask_token_id, dtype=torch.long, device=self.device)
        return tokens, self.fuse(self.mask_hidden).expand(b, n, -1)

    # -- decoding --------------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """The head's KV cache, which also keeps each position's fused feature (`draft_block` re-reads
        the last committed one); room for K - 1 mask positions past `capacity`."""
        w = self.fc.weight
        return KVCache(depth=1, batch=batch, heads=self.config.num_kv_heads, dim_head=self.config.head_dim,
                       capacity=capacity + self.config.parallel_depths, embed_dim=self.config.hidden_size,
                       dtype=w.dtype, device=w.device)

    def extend(self, tokens: Tensor, aux: Tensor, cache: KVCache) -> Tensor:
        """The block-head protocol's extension (module docstring): append positions t with the
        target's taps aux (b, n, A*H) and the token after each, tokens (b, n); their fused features
        are kept in the cache. Returns the layer's outputs (b, n, H)."""
        feature = self.fuse(aux)
        cache.update_embeds(cache.positions(tokens.shape[1]), feature)
        return self.extend_features(tokens, feature, cache)

    def extend_features(self, tokens: Tensor, feature: Tensor, cache: KVCache) -> Tensor:
        """`Eagle3Head.extend`: append positions with fused features feature (b, n, H)."""
        return Eagle3Head.extend(self, tokens, feature, cache)

    def extend_and_draft(self, tokens: Tensor, feature: Tensor, cache: KVCache) -> Tensor:
        """One pass: append positions tokens (b, n) with fused features feature (b, n, H) to `cache`,
        then K - 1 mask positions. Returns the layer's outputs (b, n + K - 1, H): those of the n
        positions, then depths 1..K-1. The cache advances by n + K - 1; roll the mask positions
        back before the next extension. Every row's context must end at its n-th position."""
        b = tokens.shape[0]
        masks, masked = self.mask_inputs(b, self.config.parallel_depths - 1)
        return self.extend_features(torch.cat([tokens.to(self.device), masks], 1),
                                    torch.cat([feature.to(masked), masked], 1), cache)

    def draft_block(self, anchor: Tensor, cache: KVCache) -> Tensor:
        """The round's one pass (module docstring): logits (b, K, draft) of the tokens after the
        pending token `anchor` (b,), at position L = cache.lengths; the cache ends at L again."""
        lengths = cache.lengths.clone()
        check(bool((lengths >= 1).all()), "a P-EAGLE head drafts after at least one committed position")
        rows = torch.arange(lengths.numel(), device=lengths.device)
        feature = cache.embeds[rows, lengths - 1][:, None]                               # (b, 1, H)
        cache.rollback(lengths - 1)
        out = self.extend_and_draft(anchor[:, None], feature, cache)                     # (b, K, H)
        cache.rollback(lengths)
        return self.logits(out)

    # -- training --------------------------------------------------------------------------------

    def depth_features(self, k0: Tensor, v0: Tensor, anchors: Tensor, real: Tensor, d: int) -> Tensor:
        """The layer's outputs (1, N, H) of depth d at the anchors (b, M) (`real` (b, M): not padding;
        N of them): queries at position t + d see the step-0 keys k0, values v0 (b, kv_heads, T, dh)
        at positions <= t and the chain's mask positions t + 1 .. t + d."""
        layer = self.layers[0]
        attention = layer.self_attn
        at = anchors[real]                                                                # (N,)
        tokens, feature = self.mask_inputs(1, 1)
        x = layer.attention_input(self.embed(tokens), feature).expand(1, at.numel(), -1)  # (1, N, 2H)
        cos, sin = self.rotary(k0.shape[2] + d, self.fc.weight.dtype)
        q = attention.queries(x, cos[at + d], sin[at + d])                               # (1, heads, N, dh)
        ks, vs = [], []
        for j in range(1, d + 1):
            k, v = attention.keys_values(x, cos[at + j], sin[at + j])
            ks.append(_unpack(k, real))
            vs.append(_unpack(v, real))
        attended = ttt_attention(_unpack(q, real), k0, v0, ks, vs, query_pos=anchors)
        return layer.finish(feature.expand(1, at.numel(), -1), _pack(attended, real))

    def parallel_loss(self, tokens: Tensor, aux: Tensor, last: Tensor, label_mask: Tensor | None = None, *,
                      ratio: float = 0.7, ratio_min: float = 0.2, generator: torch.Generator | None = None,
                      greedy_in_vocab: Tensor | None = None) -> DepthLoss:
        """P-EAGLE's loss (module docstring) on rows tokens (b, n + 1) with the target's aux hidden
        states aux (b, n, A*H) and normed last layer last (b, n, H) of tokens[:, :n]; label_mask
        (b, n): whether the target's prediction at position j (of token j + 1) counts (None: all).
        `ratio`, `ratio_min`, `generator`: the depth sampling (`depth_chains`). `greedy_in_vocab`
        (b, n - 1): as for `Eagle3Head.ttt_loss` (hit counts only)."""
        b, n = aux.shape[:2]
        T = n - 1
        K = self.config.parallel_depths
        check(T >= 1, f"rows of {n} positions are too short for a P-EAGLE loss")
        if label_mask is None:
            label_mask = torch.ones(b, n, dtype=torch.bool, device=aux.device)
        mask = label_mask[:, 1:].to(aux.device)                                   # (b, T) label at t + 1
        chains = depth_chains(mask, K, ratio, ratio_min, generator)
        needed = mask.clone()                            # every label a sampled pair reads (the sampler decides)
        for d, picked in enumerate(chains, 1):
            needed[:, d:] |= picked[:, :T - d]
        p, p_logp, label, row = self.label_targets(last, needed, None, greedy_in_vocab)
        f0, k0, v0 = self.teacher_forced(tokens, aux, mask)
        kls, correct, counts, hits = [], [], [], []
        total = aux.new_zeros((), dtype=torch.float32)
        alive = mask
        for d in range(K):
            if d == 0:
                anchors, real = _packed(mask)
                feature = f0[mask]                                                    # (N, H)
            else:
                anchors, real = _packed(chains[d - 1])
                feature = self.depth_features(k0, v0, anchors, real, d)[0]
            rows = row.gather(1, (anchors + d).clamp(max=T - 1))[real]                # (N,) rows of p
            logq = torch.log_softmax(self.logits(feature).float(), -1)
            kl = p_logp[rows] - (p[rows] * logq).sum(-1)                              # (N,) KL(p || q)
            total = total + kl.sum()
            with torch.no_grad():
                right = torch.zeros_like(mask)
                right[real.nonzero()[:, 0], anchors[real]] = logq.argmax(-1) == label[rows]
                alive = alive & right if d else right
                picked = mask if d == 0 else chains[d - 1]
                hits.append((alive & picked).sum())
                correct.append(right.sum())
                counts.append(real.sum())
                kls.append(kl.detach().sum() / real.sum().clamp(min=1))
        count = torch.stack(counts)
        return DepthLoss(total / count.sum().clamp(min=1), torch.stack(kls), torch.stack(hits), torch.stack(correct),
                         count)


__all__ = ["PEAGLE_WEIGHTS", "DepthLoss", "PEagleConfig", "PEagleHead", "depth_chains", "peagle_sizes"]
