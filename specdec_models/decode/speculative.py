"""Plain and speculative decoding with KV caches: batched, ragged and lossless.

`generate` runs one of three methods on a target `Decoder`:
- base: one target call per token (the baseline every speed-up is measured against);
- draft: a smaller `Decoder` proposes gamma tokens, the target verifies them in one call
  (Leviathan et al. 2022, Algorithm 1; Chen et al. 2023, Algorithm 2);
- prophet: a `ModelWithProphet` whose prophet drafts from the target's cached last-layer
  embeddings, verified the same way; for a Hugging Face target, an `hf_prophet.HFProphet` head
  drafting from the hidden states the target's cache keeps.
Target and draft may also be Hugging Face causal LMs (wrapped in `hf.HFDecoder`, with per-row
rollback of their caches; `vocab_size` slices padded heads to the shared vocabulary).

Every round keeps this invariant per row: the target's cache holds all tokens but the last one
(the "pending" token, just emitted by the target). Drafting starts from the pending token; the
verify call feeds [pending, d_1 .. d_gamma] and yields p_1 .. p_{gamma+1}. Draft token i is
accepted with probability min(1, p_i(d_i) / q_i(d_i)) using its own uniform; at the first
rejection a correction is drawn from norm(max(0, p_i - q_i)), and after gamma acceptances a bonus
from p_{gamma+1}. p and q come from the same `sampling.to_probs`, so the output is distributed
exactly as the processed target's tokens; temperature 0 compares argmaxes exactly.

Rows of a batch accept different counts: each row keeps its own cache length (rollback is a
per-row length), so no row ever attends to padding or to another row's rejected tokens. Each row
stops at its own EOS (emitted, then cut) or after exactly `max_new_tokens` tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..errors import check
from ..hf import HFDecoder, as_decoders
from ..model import Decoder
from ..prophet import ModelWithProphet, ProphetWindows
from ..sampling import SamplingConfig, residual, sample, to_probs

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class DecodeStats:
    """What one `generate` call did. See docs/DECODING.md for the metric definitions.

    target_calls counts batched target forward passes (the prefill included); tokens_per_call is
    emitted tokens / row-calls (each active row's share of those passes), so it includes the
    bonus or correction token and equals 1 for plain decoding."""

    method: str
    batch: int
    gamma: int
    new_tokens: int = 0
    target_calls: int = 0
    row_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float | None = None
    tokens_per_call: float = 0.0
    alpha: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    tokens_per_second: float = 0.0
    alpha_sum: float = 0.0
    alpha_count: int = 0
    accepted_at: Tensor | int = 0

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        for internal in ("alpha_sum", "alpha_count", "accepted_at"):
            d.pop(internal)
        return d


def _as_rows(prompt: Tensor | list[Tensor], vocab_size: int, max_seq_len: int) -> list[Tensor]:
    if isinstance(prompt, Tensor):
        check(prompt.ndim == 2, f"prompt must be a (batch, len) tensor or a list of 1-D tensors, got shape {tuple(prompt.shape)}")
        rows = list(prompt)
    else:
        check(isinstance(prompt, (list, tuple)) and len(prompt) > 0,
              "prompt must be a (batch, len) tensor or a non-empty list of 1-D tensors")
        rows = list(prompt)
    check(len(rows) > 0, "prompt has no rows")
    for i, r in enumerate(rows):
        check(isinstance(r, Tensor) and r.ndim == 1, f"prompt row {i} must be a 1-D tensor")
        check(not r.is_floating_point() and not r.is_complex(), f"prompt row {i} must hold integer token ids")
        check(r.numel() > 0, f"prompt row {i} is empty: give at least one token")
        check(r.numel() <= max_seq_len,
              f"prompt row {i} has {r.numel()} tokens, more than the model's max_seq_len {max_seq_len}")
        lo, hi = int(r.min()), int(r.max())
        check(lo >= 0 and hi < vocab_size,
              f"prompt row {i} has token ids outside the vocabulary [0, {vocab_size}): min {lo}, max {hi}")
    return rows


def _validate(target, draft, prophet, gamma, max_new_tokens, eos_id) -> str:
    check(isinstance(target, (Decoder, HFDecoder)),
          f"target must be a specdec_models Decoder or a Hugging Face causal LM, got {type(target).__name__}")
    check(draft is None or prophet is None, "give either a draft or a prophet, not both")
    check(isinstance(gamma, int) and not isinstance(gamma, bool) and gamma >= 1, f"gamma must be an integer >= 1, got {gamma!r}")
    check(isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and max_new_tokens >= 0,
          f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if eos_id is not None:
        check(isinstance(eos_id, int) and 0 <= eos_id < target.vocab_size,
              f"eos_id must be a token id in [0, {target.vocab_size}), got {eos_id!r}")
    if draft is not None:
        check(isinstance(draft, (Decoder, HFDecoder)),
              f"draft must be a specdec_models Decoder or a Hugging Face causal LM, got {type(draft).__name__}")
        check(draft.vocab_size == target.vocab_size,
              f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size})")
        return "draft"
    if prophet is not None:
        check(isinstance(prophet, ProphetWindows),
              f"prophet must be a ModelWithProphet or an HFProphet, got {type(prophet).__name__}")
        if isinstance(prophet, ModelWithProphet):
            check(isinstance(target, Decoder), "prophet decoding needs the specdec Decoder the prophet was built for, "
                  "not a Hugging Face target (a Hugging Face target drafts with an HFProphet head)")
            check(prophet.model is target, "prophet was not built for this target: pass prophet.model as the target")
        else:      # an HFProphet: drafts from the hidden states of the Hugging Face model it shares weights with
            check(isinstance(target, HFDecoder) and target.model is getattr(prophet, "target", None),
                  "this prophet head was built for another target: pass the Hugging Face model it was loaded "
                  "with (head.target) as the target")
            check(prophet.vocab_size == target.vocab_size,
                  f"the prophet head's vocabulary ({prophet.vocab_size}) differs from the target's "
                  f"({target.vocab_size}): pass vocab_size={prophet.vocab_size}")
        return "prophet"
    return "base"


class _Rows:
    """Per-row token history, emitted tokens and stop state (all left-aligned buffers)."""

    def __init__(self, rows: list[Tensor], max_new: int, gamma: int, device: torch.device) -> None:
        b = len(rows)
        self.lens = torch.tensor([r.numel() for r in rows], device=device)
        width = int(self.lens.max()) + max_new + gamma + 2
        self.seq = torch.zeros(b, width, dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            self.seq[i, : r.numel()] = r.to(device)
        self.seq_len = self.lens.clone()
        self.out = torch.zeros(b, max_new + gamma + 1, dtype=torch.long, device=device)
        self.produced = torch.zeros(b, dtype=torch.long, device=device)
        self.done = torch.zeros(b, dtype=torch.bool, device=device)
        self.max_new = max_new
        self.capacity = width
        self.arange_b = torch.arange(b, device=device)

    def last(self, count: int) -> Tensor:
        """The last `count` tokens of each row (batch, count)."""
        idx = self.seq_len[:, None] - count + torch.arange(count, device=self.seq.device)
        return self.seq.gather(1, idx)

    def emit(self, block: Tensor, valid: Tensor, eos_id: int | None) -> Tensor:
        """Append block (b, m) of which the first valid (b,) tokens are real, honouring EOS and
        max_new_tokens; return how many tokens each row emitted."""
        m = block.shape[1]
        j = torch.arange(m, device=block.device)
        n = torch.minimum(valid, self.max_new - self.produced)
        hit_eos = torch.zeros_like(self.done)
        if eos_id is not None:
            is_eos = (block == eos_id) & (j < n[:, None])
            first = torch.where(is_eos.any(1), is_eos.int().argmax(1), m)
            hit_eos = first < n
            n = torch.where(hit_eos, first + 1, n)
        n = torch.where(self.done, 0, n)
        # write all m slots; the ones past n are overwritten later or cut at the end
        self.out.scatter_(1, (self.produced[:, None] + j).clamp(max=self.out.shape[1] - 1), block)
        self.seq.scatter_(1, (self.seq_len[:, None] + j).clamp(max=self.capacity - 1), block)
        self.produced += n
        self.seq_len += n
        self.done |= hit_eos | (self.produced >= self.max_new)
        return n

    def tokens(self) -> list[Tensor]:
        return [self.out[i, : int(self.produced[i])].clone() for i in range(self.out.shape[0])]


@torch.inference_mode()
def generate(
    target: Decoder | HFDecoder | PreTrainedModel,
    prompt: Tensor | list[Tensor],
    max_new_tokens: int,
    draft: Decoder | HFDecoder | PreTrainedModel | None = None,
    prophet: ProphetWindows | None = None,
    gamma: int = 5,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    vocab_size: int | str | None = None,
) -> tuple[list[Tensor], DecodeStats]:
    """Generate up to `max_new_tokens` new tokens per prompt row; see the module docstring.

    Hugging Face causal LMs are wrapped in `HFDecoder`s; `vocab_size` (an integer, or "min" for
    the smaller head) slices their logits to the vocabulary target and draft share (see `hf.as_decoders`).
    Returns (tokens, stats): one 1-D LongTensor of new tokens per row (cut after eos_id), and a
    `DecodeStats`."""
    target, draft = as_decoders(target, draft, vocab_size)
    method = _validate(target, draft, prophet, gamma, max_new_tokens, eos_id)
    sampling = SamplingConfig(temperature, top_k, top_p)
    rows_in = _as_rows(prompt, target.vocab_size, target.cfg.max_seq_len)
    device = target.device
    stats = DecodeStats(method=method, batch=len(rows_in), gamma=gamma if method != "base" else 0)
    t0 = time.perf_counter()
    rows = _Rows(rows_in, max_new_tokens, gamma, device)
    if max_new_tokens == 0:
        return rows.tokens(), stats

    def pick(probs: Tensor) -> Tensor:
        return probs.argmax(-1) if sampling.greedy else sample(probs, generator)

    # Prefill: right-padded prompts; each row's padding lies past its own length, where no query
    # of that row looks, and the cache is rolled back to the real lengths afterwards.
    b, width = len(rows_in), int(rows.lens.max())
    padded = rows.seq[:, :width]
    cache = target.new_cache(b, rows.capacity, keep_embeds=method == "prophet")
    last = _logits_at(target, padded, cache, rows.lens - 1)
    cache.rollback(rows.lens)
    _count_call(stats, rows)
    rows.emit(pick(to_probs(last, sampling))[:, None], torch.ones_like(rows.lens), eos_id)

    draft_cache = None
    if method == "draft":
        draft_cache = draft.new_cache(b, rows.capacity)
        _logits_at(draft, padded, draft_cache, rows.lens - 1)
        draft_cache.rollback(torch.minimum(draft_cache.lengths, rows.lens))
    if method == "prophet":
        # one prophet cache for all rounds (each round empties it): S start tokens + gamma tokens
        draft_cache = prophet.prophet.new_cache(b, prophet.num_start_tokens + gamma)
        # the prophet needs S cached target positions per row: decode plainly until there are
        while not bool(rows.done.all()) and int(cache.lengths.min()) < prophet.num_start_tokens:
            _base_step(target, cache, rows, stats, pick, sampling, eos_id)

    while not bool(rows.done.all()):
        if method == "base":
            _base_step(target, cache, rows, stats, pick, sampling, eos_id)
            continue
        q = _draft_round(draft, draft_cache, prophet, cache, rows, gamma, sampling, pick)
        _verify(target, cache, rows, q, stats, sampling, pick, eos_id, generator)

    stats.wall_seconds = time.perf_counter() - t0
    _finish(stats, rows)
    return rows.tokens(), stats


def _logits_at(model, tokens: Tensor, cache, at: Tensor) -> Tensor:
    """Logits (b, vocab) of position at[i] of each row of tokens (b, n), fed to `cache`; a Hugging
    Face model computes its head at those positions only."""
    if isinstance(model, HFDecoder):
        return model(tokens, cache=cache, logits_at=at).logits[:, 0]
    return model(tokens, cache=cache).logits[torch.arange(tokens.shape[0], device=at.device), at]


def _count_call(stats: DecodeStats, rows: _Rows) -> None:
    stats.target_calls += 1
    stats.row_calls += int((~rows.done).sum())


def _base_step(target, cache, rows, stats, pick, sampling, eos_id) -> None:
    """One plain step: feed each row's pending token, sample the next one."""
    before = cache.lengths.clone()
    logits = target(rows.last(1), cache=cache).logits[:, -1]
    cache.rollback(torch.where(rows.done, before, cache.lengths))
    _count_call(stats, rows)
    rows.emit(pick(to_probs(logits, sampling))[:, None], torch.ones_like(rows.lens), eos_id)


def _draft_round(draft, draft_cache, prophet, cache, rows, gamma, sampling, pick) -> tuple[Tensor, Tensor]:
    """Propose gamma tokens per row; return (drafts (b, gamma), q (b, gamma, vocab)) where q is
    exactly the distribution each draft token was sampled from. `draft_cache` is the draft's
    cache, or the prophet's (emptied at each round: its start tokens change every round)."""
    if draft is not None:
        # Catch the draft up: it lags one token after a full acceptance (it never saw d_gamma), so
        # when a row does it re-reads the last two tokens (re-writing a cached position is harmless),
        # else the pending one only.
        n = 2 if bool((draft_cache.lengths < rows.seq_len - 1).any()) else 1
        draft_cache.rollback(rows.seq_len - n)
        logits = _logits_at(draft, rows.last(n), draft_cache, torch.full_like(rows.seq_len, n - 1))
        step = lambda tok: draft(tok, cache=draft_cache).logits[:, -1]  # noqa: E731
    else:
        start = prophet.start_tokens(cache.last_embeds(prophet.num_start_tokens))
        draft_cache.rollback(torch.zeros_like(draft_cache.lengths))
        logits = prophet.prophet(rows.last(1), start=start, cache=draft_cache).logits[:, -1]
        step = lambda tok: prophet.prophet(tok, cache=draft_cache).logits[:, -1]  # noqa: E731
    drafts, qs = [], []
    for i in range(gamma):
        q = to_probs(logits, sampling)
        tok = pick(q)
        drafts.append(tok)
        qs.append(q)
        if i + 1 < gamma:
            logits = step(tok[:, None])
    return torch.stack(drafts, 1), torch.stack(qs, 1)


def _verify(target, cache, rows, proposal, stats, sampling, pick, eos_id, generator) -> None:
    """Score [pending, drafts] in one target call, accept a prefix per row, emit the accepted
    drafts plus one correction or bonus token, and roll the cache back per row."""
    drafts, q = proposal                                        # (b, g), (b, g, vocab)
    b, g = drafts.shape
    before = cache.lengths.clone()
    active = ~rows.done
    logits = target(torch.cat([rows.last(1), drafts], 1), cache=cache).logits
    _count_call(stats, rows)
    p = to_probs(logits, sampling)                              # (b, g + 1, vocab)
    px = p[:, :g].gather(-1, drafts[..., None])[..., 0]
    qx = q.gather(-1, drafts[..., None])[..., 0]
    if sampling.greedy:
        accept = px > 0                                         # draft token == target argmax
    else:
        u = torch.rand(b, g, device=q.device, generator=generator)   # one uniform per position
        accept = u * qx < px                                    # u < p/q without dividing
    prefix = accept.int().cumprod(1)                            # (b, g): 1 while all so far accepted
    k = prefix.sum(1)                                           # accepted drafts per row
    kc = k.clamp(max=g - 1)
    fix = residual(p[rows.arange_b, kc], q[rows.arange_b, kc])
    final = torch.where((k < g)[:, None], fix, p[:, g])
    block = torch.cat([drafts, drafts[:, :1]], 1)
    block[rows.arange_b, k] = pick(final)
    # alpha: sum_x min(p, q) at each position whose acceptance test ran (up to the first rejection)
    overlap = torch.minimum(p[:, :g], q).sum(-1)                # (b, g)
    tested = (torch.arange(g, device=k.device) <= k[:, None]) & active[:, None]
    stats.alpha_sum += float((overlap * tested).sum())
    stats.alpha_count += int(tested.sum())
    stats.drafted += g * int(active.sum())
    stats.accepted += int((k * active).sum())
    stats.accepted_at += (prefix * active[:, None]).sum(0)
    rows.emit(block, k + 1, eos_id)
    # keep [pending, accepted drafts]; a row cut short by EOS or max_new_tokens keeps less
    cache.rollback(torch.where(active, torch.minimum(before + 1 + k, rows.seq_len - 1), before))


def _finish(stats: DecodeStats, rows: _Rows) -> None:
    stats.new_tokens = int(rows.produced.sum())
    stats.tokens_per_call = stats.new_tokens / max(stats.row_calls, 1)
    stats.tokens_per_second = stats.new_tokens / max(stats.wall_seconds, 1e-9)
    if stats.method != "base":
        rounds = stats.drafted // max(stats.gamma, 1)
        stats.acceptance_rate = stats.accepted / max(stats.drafted, 1)
        stats.alpha = stats.alpha_sum / max(stats.alpha_count, 1) if stats.alpha_count else None
        at = stats.accepted_at if isinstance(stats.accepted_at, Tensor) else torch.zeros(stats.gamma)
        stats.per_position_acceptance = [float(x) / max(rounds, 1) for x in at.tolist()]
