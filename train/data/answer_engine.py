"""An in-process answering engine: the target answers conversations turn by turn with continuous
batching and the KV cache kept from one turn to the next.

`chat_answers`' first path (`Answerer`, `answer_batch`) answers turn k of a batch of conversations
together: each turn re-prefills the whole context, the batch shrinks as answers end, then turn by
turn and length group by length group, and later turns answer few conversations at once. This
engine runs as a serving engine does (vLLM's and SGLang's continuous batching, on one machine and
without paging):

- a fixed number of `slots` rows decode together, one token per row per call; when a row's answer
  ends (its end-of-turn token, `max_new_tokens`, or the row's seq_len + 1 positions), its
  conversation's next turn, or the next conversation, takes the row before the next call, so the
  batch stays full until the conversations run out (then finished rows leave it);
- a conversation keeps its keys and values in its row from one turn to the next: turn k + 1
  prefills only what is not cached yet: the answer's last token, the template's end of turn, the
  next user message and the assistant header. The context is the one the first path feeds, token
  for token: the next turn's context is rendered and tokenized from the conversation's text
  (`chat_answers.Dialogue`), and the cache keeps only its longest common prefix with what the row
  holds (causal attention: a position's keys depend on the tokens before it only), so a template or
  a tokenizer that does not extend the earlier context as a prefix costs a fresh prefill of the
  difference, never a wrong context.

`SlotCache` holds the rows: per layer, keys and values in (slots, kv_heads, capacity, head_dim)
buffers, row b valid on its first `lengths[b]` positions; it enters the Hugging Face model as its
cache (a `DynamicCache` whose `update` writes at each row's own positions and hands back the
buffers), with a 4-D additive mask and each row's own position ids, so rows of any lengths share
one decoding call. The rows that begin a turn in the same step are prefilled together before the
next decoding call (right-padded, in calls of similar lengths and at most PREFILL_TOKENS tokens);
a row's last context token is fed with the other rows' tokens by that decoding call.

Sampling: greedy at temperature 0 (the argmax of the logits, as the first path; in fp32 the
answers are the first path's up to the rounding of a near-tie); at T > 0 each conversation draws
from its own generator, seeded by (seed, the conversation's index), one uniform per token
(`sampling.sample`), so an answer does not depend on which rows share its calls or on the order the
engine answers in. The two paths sample differently at T > 0 (the first seeds per batch and turn).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specdec_models.errors import check
from specdec_models.hf import HFDecoder
from specdec_models.hf.adapter import cache_argument
from specdec_models.sampling import sample

from .conversations import Conversation

PREFILL_TOKENS = 4096  # padded tokens per prefill call: rows that begin a turn together share calls


@functools.cache
def _slot_cache_class() -> type:
    """A DynamicCache whose `update` writes into a `SlotCache` (transformers imported lazily)."""
    from transformers import DynamicCache

    class _Slots(DynamicCache):
        def __init__(self, owner: SlotCache) -> None:
            super().__init__()
            self.owner = owner

        def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> tuple[Tensor, Tensor]:
            return self.owner.write(layer_idx, key_states, value_states)

        def get_seq_length(self, layer_idx: int | None = 0) -> int:
            return self.owner.longest

    return _Slots


class SlotCache:
    """Keys and values of `slots` rows of different lengths (module docstring). Buffers are made
    at the first write of each layer and grow by doubling up to `limit` positions per row."""

    def __init__(self, slots: int, limit: int, device: torch.device) -> None:
        self.limit, self.device = limit, device
        self.lengths = [0] * slots
        self.keys: dict[int, Tensor] = {}                # layer -> (slots, kv_heads, capacity, head_dim)
        self.values: dict[int, Tensor] = {}
        self.capacity = 0
        # (rows: a slice (one row), an index (r,) or None (every row), positions (r, n), positions returned)
        self._call: tuple[Any, Tensor, int] | None = None
        self.hf = _slot_cache_class()(self)

    @property
    def slots(self) -> int:
        return len(self.lengths)

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)

    def _reserve(self, positions: int) -> None:
        """Room for `positions` per row (grown by doubling, at most `limit`)."""
        check(positions <= self.limit, f"a row would hold {positions} positions, past the limit of {self.limit}")
        if positions <= self.capacity:
            return
        grown = min(self.limit, max(positions, 2 * self.capacity, 64))
        for store in (self.keys, self.values):
            for layer, old in store.items():
                new = old.new_zeros(*old.shape[:2], grown, old.shape[3])
                new[:, :, :self.capacity] = old
                store[layer] = new
        self.capacity = grown

    def write(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store a call's new keys and values (r, kv_heads, n, head_dim) at its rows' positions;
        return the rows' keys and values up to the call's last position, (r, kv_heads, width, head_dim)."""
        assert self._call is not None, "SlotCache.write outside a call"
        rows, positions, width = self._call
        if layer not in self.keys:
            shape = (self.slots, key.shape[1], self.capacity, key.shape[3])
            self.keys[layer] = key.new_zeros(shape)
            self.values[layer] = value.new_zeros(shape)
        keys, values = self.keys[layer], self.values[layer]
        if isinstance(rows, slice):                     # one row's prefill: views of its buffers
            keys[rows, :, positions[0, 0]:positions[0, -1] + 1] = key
            values[rows, :, positions[0, 0]:positions[0, -1] + 1] = value
            return keys[rows, :, :width], values[rows, :, :width]
        if rows is not None:                            # several rows' prefill: (r, n, kv_heads, head_dim) written
            keys[rows[:, None], :, positions] = key.transpose(1, 2)
            values[rows[:, None], :, positions] = value.transpose(1, 2)
            return keys[rows, :, :width], values[rows, :, :width]
        index = torch.arange(keys.shape[0], device=keys.device)      # every row, one new position each
        keys[index, :, positions[:, 0]] = key[:, :, 0]
        values[index, :, positions[:, 0]] = value[:, :, 0]
        return keys[:, :, :width], values[:, :, :width]

    def prefill(self, model: Any, rows: Sequence[int], tokens: Sequence[Sequence[int]]) -> int:
        """Append tokens[k] to row rows[k], all in one call, right-padded to the longest (no logits
        kept: a row's next token comes from a step). A padding token's keys land past its row's
        length (at most at the row's last position, which a context never reaches: MIN_ROOM) and
        are written over later. Returns the padding tokens fed."""
        n = max(len(t) for t in tokens)
        starts = torch.tensor([self.lengths[r] for r in rows], device=self.device)
        positions = (starts[:, None] + torch.arange(n, device=self.device)).clamp(max=self.limit - 1)   # (r, n)
        width = int(positions.max()) + 1
        self._reserve(width)
        allowed = torch.arange(width, device=self.device)[None, None] <= positions[:, :, None]      # (r, n, width)
        ids = torch.tensor([[*t, *[0] * (n - len(t))] for t in tokens], device=self.device)
        where = slice(rows[0], rows[0] + 1) if len(rows) == 1 else torch.tensor(list(rows), device=self.device)
        self._forward(model, ids, where, positions, allowed[:, None], keep=1, width=width)
        for r, t in zip(rows, tokens, strict=True):
            self.lengths[r] += len(t)
        return len(rows) * n - sum(len(t) for t in tokens)

    def step(self, model: Any, tokens: Tensor, live: Sequence[bool]) -> Tensor:
        """Feed one token per row, tokens (slots,); a row that is not `live` is fed a token that its
        length does not keep (its position is written over later). Returns logits (slots, head rows)."""
        lengths = torch.tensor(self.lengths, device=self.device)
        width = max(self.lengths[b] + 1 for b in range(self.slots))
        self._reserve(width)
        allowed = torch.arange(width, device=self.device)[None] <= lengths[:, None]       # (slots, width)
        out = self._forward(model, tokens[:, None].to(self.device), None, lengths[:, None], allowed[:, None, None],
                            keep=None, width=width)
        self.lengths = [n + 1 if alive else n for n, alive in zip(self.lengths, live, strict=True)]
        return out[:, -1]

    def _forward(self, model: Any, tokens: Tensor, rows: slice | Tensor | None, positions: Tensor, allowed: Tensor,
                 keep: int | None, width: int | None = None) -> Tensor:
        dtype = model.get_input_embeddings().weight.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)          # additive: any attention backend
        self._call = (rows, positions, int(positions.max()) + 1 if width is None else width)
        extra = {"logits_to_keep": keep} if keep is not None and _keeps_logits(type(model)) else {}
        try:
            out = model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{cache_argument(model): self.hf}, **extra)
        finally:
            self._call = None
        check(len(self.keys) > 0, f"{type(model).__name__} did not write its keys and values through the cache it "
                                  "was given: the answering engine cannot keep them; use engine='simple'")
        return out.logits

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only `rows`, in that order (rows that finished leave the batch)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        for store in (self.keys, self.values):
            for layer, t in store.items():
                store[layer] = t.index_select(0, index)
        self.lengths = [self.lengths[r] for r in rows]


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


@functools.cache
def _keeps_logits(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


@dataclass
class EngineCounts:
    """What the engine fed the model: `prefilled` context tokens (prefill calls), `stepped` rows
    fed by decoding calls (each a real token), `steps` decoding calls, `idle` rows fed only to keep
    the batch's shape, `fresh` turns whose context did not extend the cached one (the cache kept
    the longest common prefix), `generated` answer tokens (stop tokens included), `padding` fed to
    right-pad prefills of several rows."""
    prefilled: int = 0
    stepped: int = 0
    steps: int = 0
    idle: int = 0
    fresh: int = 0
    generated: int = 0
    padding: int = 0


@dataclass
class _Row:
    """A conversation in a slot: its `dialogue` (`chat_answers.Dialogue`), the tokens its row
    caches, the token the next step feeds, where the answer starts and its tokens so far."""
    index: int
    dialogue: Any
    temperature: float
    generator: torch.Generator | None
    cached: list[int] = field(default_factory=list)
    feed: int = 0
    start: int = 0
    answer: list[int] = field(default_factory=list)


class AnswerEngine:
    """Answers conversations with a Hugging Face target (module docstring). `decoder`: the target
    (`HFDecoder`, its vocabulary slice); `eos_id`: the end-of-turn token; a row holds at most
    seq_len + 1 positions; `slots`: rows decoded together."""

    def __init__(self, decoder: HFDecoder, tokenizer: Any, eos_id: int, seq_len: int, max_new_tokens: int,
                 slots: int = 64) -> None:
        check(isinstance(slots, int) and slots >= 1, f"the engine's slots must be a positive integer, got {slots!r}")
        check(decoder.window is None or seq_len + 1 <= decoder.window,
              f"the target attends through a sliding window of {decoder.window} positions, shorter than a row of "
              f"{seq_len + 1}: the answering engine does not slide; use engine='simple' or a shorter seq_len")
        self.decoder, self.tokenizer, self.eos_id = decoder, tokenizer, eos_id
        self.seq_len, self.max_new_tokens, self.slots = seq_len, max_new_tokens, slots
        self.counts = EngineCounts()
        self.stopped = 0          # conversations in work when a deadline stopped the last run
        self._pending: list[tuple[int, list[int]]] = []      # (slot, tokens) to prefill before the next step

    def run(self, conversations: Sequence[tuple[int, Conversation]], make_dialogue: Any,
            temperatures: Sequence[float], seed: int, deadline: float | None = None) -> Iterator[tuple[int, Any]]:
        """Answer `conversations` ((global index, conversation) pairs, taken in order), yielding
        (index, dialogue) as each conversation is over (`dialogue.record` set, or `too_long`).
        `make_dialogue(conversation)` starts one. Stops when time.perf_counter() passes `deadline`
        (checked before every call): the conversations in work (`stopped` of them) are closed at
        their last finished answer (`dialogue.close()`) and yielded; those not begun are not."""
        model, device = self.decoder.model, self.decoder.device
        queue = deque(conversations)
        rows: list[_Row | None] = [None] * min(self.slots, len(conversations))
        cache = SlotCache(len(rows), self.seq_len + 1, device)
        self.stopped, self._pending = 0, []
        while True:
            for b in range(len(rows)):                     # fill every free row from the queue
                while rows[b] is None and queue and not _past(deadline):
                    index, conversation = queue.popleft()
                    t = float(temperatures[index % len(temperatures)])
                    g = None if t == 0 else torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
                    row = _Row(index, make_dialogue(conversation), t, g)
                    if row.dialogue.ids is None:
                        yield index, row.dialogue
                        continue
                    self._begin_turn(cache, b, row)
                    rows[b] = row
            live = [r is not None for r in rows]
            if _past(deadline):                           # the turns in work are dropped
                self.stopped = sum(live)
                for row in rows:
                    if row is not None:
                        row.dialogue.close()
                        yield row.index, row.dialogue
                return
            self._prefill(cache, model)
            if not any(live):
                return
            idle = len(live) - sum(live)
            if not queue and 4 * idle >= len(live):        # the tail: finished rows leave the batch
                keep = [b for b, alive in enumerate(live) if alive]
                cache.keep_rows(keep)
                rows, live = [rows[b] for b in keep], [True] * len(keep)
            yield from self._step(cache, model, rows, live)

    def _step(self, cache: SlotCache, model: Any, rows: list[_Row | None], live: list[bool]
              ) -> Iterator[tuple[int, Any]]:
        """One decoding call over every row; rows whose answer ends start their next turn or free
        their slot (yielding the conversation)."""
        feed = torch.tensor([r.feed if r is not None else 0 for r in rows], dtype=torch.long)
        logits = cache.step(model, feed, live)[:, : self.decoder.vocab_size]     # (slots, vocab)
        self.counts.steps += 1
        self.counts.stepped += sum(live)
        self.counts.idle += len(live) - sum(live)
        greedy = logits.argmax(-1).tolist()
        for b, row in enumerate(rows):
            if row is None:
                continue
            token = greedy[b] if row.temperature == 0 else int(sample(
                (logits[b:b + 1].float() / row.temperature).softmax(-1), row.generator)[0])
            row.cached.append(row.feed)
            at = row.start + len(row.answer)              # the position the new token takes
            row.answer.append(token)
            self.counts.generated += 1
            ended = token == self.eos_id
            if not (ended or at + 1 >= self.seq_len + 1 or len(row.answer) >= self.max_new_tokens):
                row.feed = token
                continue
            if row.dialogue.answered(row.answer[:-1] if ended else row.answer, ended) is None:
                rows[b], cache.lengths[b] = None, 0
                yield row.index, row.dialogue
            else:
                self._begin_turn(cache, b, row)

    def _begin_turn(self, cache: SlotCache, b: int, row: _Row) -> None:
        """Put the row's next context in slot b: keep the longest cached prefix it shares; the rest
        but its last token waits for the next prefill call (the next step feeds the last one)."""
        ids = row.dialogue.ids
        common = 0
        limit = min(len(row.cached), len(ids) - 1)
        while common < limit and row.cached[common] == ids[common]:
            common += 1
        self.counts.fresh += common < len(row.cached)
        cache.lengths[b] = common
        if len(ids) - 1 > common:
            self._pending.append((b, ids[common:-1]))
            self.counts.prefilled += len(ids) - 1 - common
        row.cached, row.feed, row.start, row.answer = list(ids[:-1]), ids[-1], len(ids), []

    def _prefill(self, cache: SlotCache, model: Any) -> None:
        """The pending prefills, shortest first, in calls of at most PREFILL_TOKENS padded tokens, a
        new call where a length passes 1.25 times its call's shortest plus 8 (`chat_answers.
        length_groups`' rule: right-padding spends at most about a quarter of a call)."""
        pending, self._pending = sorted(self._pending, key=lambda p: len(p[1])), []
        group: list[tuple[int, list[int]]] = []
        for item in [*pending, None]:
            if group and (item is None or (len(group) + 1) * len(item[1]) > PREFILL_TOKENS
                          or len(item[1]) > 1.25 * len(group[0][1]) + 8):
                self.counts.padding += cache.prefill(model, [b for b, _ in group], [t for _, t in group])
                group = []
            if item is not None:
                group.append(item)
