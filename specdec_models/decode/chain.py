"""The chain drafters: each proposes gamma tokens per row, drawn one after another, for the whole
batch at once (`decode.protocol`).

- `DraftModel(model)`: a smaller decoder (a specdec `Decoder`, an `hf.HFDecoder` or a Hugging Face
  causal LM) drafts with its own KV cache (Leviathan et al. 2022; Chen et al. 2023). It lags one
  token after a round that accepted everything (it never saw the last draft), so a round re-reads
  the last two tokens where any row lags, else the pending one (re-writing a cached position is
  harmless).
- `HeadDrafter(head)`: a draft head reading the target's hidden states; it is a `ProphetDrafter`
  for a `ModelWithProphet` or an `hf.HFProphet` (the prophet drafts from the target's cached
  last-layer embeddings, its own cache emptied each round since its start tokens change) and an
  `Eagle3Drafter` for an `hf.Eagle3Head` (after every target call the head's KV cache is extended
  with the target's aux-layer features of the committed positions, and it drafts feeding its own
  features back; the draft vocabulary is spread over the target's with q = 0 outside it, so the
  residual covers those tokens).

Every draft is sampled by `sample_chain`: q is exactly the distribution each token was drawn from,
and with a repetition penalty every position sees the drafts before it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..errors import check
from ..heads import DraftHead, Eagle3Head
from ..hf import HFDecoder, is_hf_model
from ..model import Decoder
from ..sampling import sample, to_probs
from .cost import DRAFT, PREFILL
from .protocol import Draft, Drafter, Verdict


def sample_chain(run: Any, logits: Tensor, gamma: int, step: Callable[[Tensor], Tensor],
                 head: Eagle3Head | None = None) -> Draft:
    """Draw gamma drafts from the first draft logits (b, vocab) on, `step(token)` giving the next
    logits; a chain `Draft` (q exactly the distribution each token was drawn from; with a
    repetition penalty the contexts (b, gamma + 1, vocab), position i seeing the drafts before it).
    `head`: the logits are an EAGLE-3 head's, over its draft vocabulary (`to_target_vocab` spreads
    them). Greedy decoding without a penalty builds no q: a draft is its model's argmax (the head's
    mapped to the target's id; its draft ids ascend, so ties resolve as over the spread logits)."""
    rows, sampling = run.rows, run.sampling
    drafts, qs = [], []
    seen, contexts = rows.seen, []                            # seen: (b, vocab + 1) or None
    argmax_only = sampling.greedy and not sampling.penalised
    for i in range(gamma):
        context = None if seen is None else seen[:, : rows.vocab]
        if argmax_only:
            tok = logits.argmax(-1)
            tok = tok if head is None else head.target_ids(tok)
        else:
            q = to_probs(logits if head is None else head.to_target_vocab(logits), sampling, context)
            tok = q.argmax(-1) if sampling.greedy else sample(q, run.generator)
            qs.append(q)
        drafts.append(tok)
        if seen is not None:
            contexts.append(context)
            seen = seen.clone().scatter_(1, tok[:, None], True)
        if i + 1 < gamma:
            logits = step(tok)
    if seen is not None:
        contexts.append(seen[:, : rows.vocab])
    return Draft(torch.stack(drafts, 1), gamma, torch.stack(qs, 1) if qs else None,
                 torch.stack(contexts, 1) if contexts else None)


class DraftModel(Drafter):
    """A draft model: a specdec `Decoder`, an `hf.HFDecoder` or a Hugging Face causal LM (wrapped
    by `generate`, whose `vocab_size` slices its logits to the target's vocabulary)."""

    method = "draft"

    def __init__(self, model: Decoder | HFDecoder | nn.Module) -> None:
        check(isinstance(model, (Decoder, HFDecoder)) or is_hf_model(model),
              f"DraftModel drafts with a specdec_models Decoder or a Hugging Face causal LM, "
              f"got {type(model).__name__}")
        self.model = model

    def start(self, run: Any) -> None:
        rows = run.rows
        self.cache = run.draft.new_cache(rows.batch, rows.capacity)
        run.logits_at(PREFILL, run.draft, rows.prompt, self.cache, rows.lens - 1)
        self.cache.rollback(torch.minimum(self.cache.lengths, rows.lens))

    def propose(self, run: Any, gamma: int) -> Draft:
        # catch up (the module docstring), also in a plain round: a draft must not fall behind
        rows, cache, model = run.rows, self.cache, run.draft
        n = 2 if bool((cache.lengths < rows.seq_len - 1).any()) else 1
        cache.rollback(rows.seq_len - n)
        logits = run.clock(DRAFT, model, rows.last(n), cache=cache).logits[:, -1]
        if gamma == 0:
            return run.empty_draft()
        return sample_chain(run, logits, gamma, lambda tok: run.clock(DRAFT, model, tok[:, None], cache=cache
                                                                       ).logits[:, -1])

    def compact(self, dst: Tensor, src: Tensor, batch: int) -> None:
        self.cache.compact_rows(dst, src, batch)


class HeadDrafter(Drafter):
    """A draft head drafting a chain from the target's hidden states: a `ModelWithProphet` or an
    `hf.HFProphet` (a `ProphetDrafter`, method "prophet"), an `hf.Eagle3Head` (an
    `Eagle3Drafter`, method "eagle3"), or a head that drafts a block in one pass (a
    `block_draft.BlockDrafter`, e.g. method "dflash")."""

    def __new__(cls, head: DraftHead, *args: Any, **kwargs: Any) -> HeadDrafter:
        if cls is HeadDrafter:
            # a drafter kind defined above this module (decode.block_draft) claims its heads by `handles`
            claimed = [kind for kind in HeadDrafter.__subclasses__() if kind.handles(head)]
            cls = claimed[0] if claimed else Eagle3Drafter if isinstance(head, Eagle3Head) else ProphetDrafter
        return super().__new__(cls)

    @staticmethod
    def handles(head: DraftHead) -> bool:
        """Whether `HeadDrafter(head)` builds this subclass (one defined in a module above this one)."""
        return False

    def __init__(self, head: DraftHead) -> None:
        check(isinstance(head, DraftHead), f"HeadDrafter drafts with a draft head (a ModelWithProphet, an HFProphet "
                                           f"or an Eagle3Head), got {type(head).__name__}")
        self.head = head

    @property
    def max_gamma(self) -> int:
        return min(8, self.head.max_gamma)


class ProphetDrafter(HeadDrafter):
    """A prophet head's chain (`HeadDrafter`): drafts from the target's last S cached embeddings."""

    method = "prophet"

    def cache_options(self) -> dict[str, Any]:
        return {"keep_embeds": True}

    def start(self, run: Any) -> None:
        prophet = self.head
        # one prophet cache for all rounds (each round empties it): S start tokens + gamma tokens
        self.cache = prophet.prophet.new_cache(run.rows.batch, prophet.num_start_tokens + run.plan.nodes)
        # the prophet needs S cached target positions per row: decode plainly until there are
        while not run.finished() and int(run.cache.lengths.min()) < prophet.num_start_tokens:
            run.verify(run.empty_draft())

    def propose(self, run: Any, gamma: int) -> Draft:
        if gamma == 0:
            return run.empty_draft()
        prophet, cache = self.head, self.cache
        start = prophet.start_tokens(run.cache.last_embeds(prophet.num_start_tokens))
        cache.rollback(torch.zeros_like(cache.lengths))
        logits = run.clock(DRAFT, prophet.prophet, run.rows.last(1), cache=cache, start=start).logits[:, -1]
        return sample_chain(run, logits, gamma, lambda tok: run.clock(DRAFT, prophet.prophet, tok[:, None],
                                                                       cache=cache).logits[:, -1])

    def compact(self, dst: Tensor, src: Tensor, batch: int) -> None:
        self.cache.compact_rows(dst, src, batch)


class Eagle3Drafter(HeadDrafter):
    """An EAGLE-3 head's chain (`HeadDrafter`). Its KV cache holds exactly the target's committed
    positions between rounds; `head_next` is its prediction for the next draft: (logits (b, draft),
    feature (b, 1, H)) of each row's last committed position."""

    method = "eagle3"

    def cache_options(self) -> dict[str, Any]:
        return {"keep_layers": self.head.aux_layers}

    def start(self, run: Any) -> None:
        self.cache = self.head.new_cache(run.rows.batch, run.rows.capacity)
        self.head_next: tuple[Tensor, Tensor] | None = None
        self.extend(run, Verdict(torch.zeros_like(run.rows.lens), torch.zeros_like(run.rows.lens)))

    def accept(self, run: Any, verdict: Verdict) -> None:
        self.extend(run, verdict)

    def extend(self, run: Any, verdict: Verdict) -> None:
        """Feed the head the target's features of the positions the last call committed (each row's
        before .. cache length - 1; a tree's kept slots only: `verdict.order[:, :span]`), with the
        token after each, and keep its prediction for the next draft (`head_next`). After a chain,
        the drafted positions of the round are dropped from the head's cache first (a tree's growth
        writes none) and the fed ones past the committed length after."""
        head, rows, cache, before = self.head, run.rows, run.cache, verdict.before
        feats = cache.layer_states                                     # (b, n, A*H) of positions before ..
        if verdict.order is not None:
            order = verdict.order[:, : verdict.span]
            feats = feats.gather(1, order[..., None].expand(-1, -1, feats.shape[-1]))
        n = feats.shape[1]
        idx = (before[:, None] + 1 + torch.arange(n, device=before.device)).clamp(max=rows.capacity - 1)
        tokens = rows.seq.gather(1, idx)                               # x_{t+1} for each position t
        drafted = verdict.order is None       # a chain drafted into the cache, and all its slots are fed
        if drafted:
            self.cache.rollback(before)
        last = (cache.lengths - before - 1).clamp(min=0)               # each row's last committed position

        def extend() -> tuple[Tensor, Tensor]:
            h = head.extend(tokens, head.fuse(feats), self.cache)
            f = h[rows.arange_b, last][:, None]
            return head.logits(f[:, 0]), f

        self.head_next = run.clock(DRAFT, extend)
        if drafted:
            self.cache.rollback(cache.lengths)

    def propose(self, run: Any, gamma: int) -> Draft:
        """d_1 from the prediction the last extension left, then each step feeds the drafted token
        and the head's own feature (see `heads.eagle3`)."""
        if gamma == 0:
            return run.empty_draft()
        head, cache = self.head, self.cache
        logits, feature = self.head_next
        state = [feature]

        def step(tok: Tensor) -> Tensor:
            def call() -> Tensor:
                state[0] = head.extend(tok[:, None], state[0], cache)
                return head.logits(state[0][:, 0])
            return run.clock(DRAFT, call)

        return sample_chain(run, logits, gamma, step, head=head)

    def compact(self, dst: Tensor, src: Tensor, batch: int) -> None:
        self.cache.compact_rows(dst, src, batch)
        self.head_next = tuple(_move_rows(t, dst, src, batch) for t in self.head_next)


def _move_rows(t: Tensor, dst: Tensor, src: Tensor, batch: int) -> Tensor:
    """Rows `src` of t copied into rows `dst`, the first `batch` rows kept (how caches drop finished rows)."""
    if dst.numel():
        t[dst] = t[src]
    return t[:batch]

