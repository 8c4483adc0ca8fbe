"""Hugging Face causal LMs as targets and drafts of `generate`: a thin adapter with per-row rollback.

`HFDecoder` wraps a transformers causal LM (GPTNeoXForCausalLM, LlamaForCausalLM, ... anything
`AutoModelForCausalLM` loads that keeps its keys and values in a `DynamicCache`) and offers the
small protocol `generate` uses on a `Decoder`: `model(tokens, cache=cache).logits`,
`new_cache(batch, capacity)` with per-row `lengths` and `rollback(lengths)`, `vocab_size`,
`cfg.max_seq_len` and `device`.

Ragged rows in a Hugging Face cache. A `DynamicCache` appends the same number of slots to every
row, but speculative decoding rolls rows back by different counts. `HFKVCache` keeps the padded
cache and a boolean `valid` (batch, slots): each call appends n slots to every row and passes
- `attention_mask` = valid slots + the new tokens (2-D), so rolled-back and padding slots are
  masked out (a masked key adds exactly 0 to the softmax, where a zeroed key would add e^0);
- `position_ids` = each row's own length + 0..n-1, so positions ignore the holes.
Hugging Face's causal mask works in slot order, which is each row's logical order, so a query sees
exactly its own row's earlier tokens. A rollback marks slots invalid; slots no row uses at the end
are cut off, and once the cache holds more than `slack` slots beyond the longest row, each row's
valid slots are gathered to the front (compaction): the cache never grows without bound.
`compact_rows` drops finished rows from the batch, as `KVCache.compact_rows` does.

Hidden states for a prophet head (`prophet.HFProphet`): with `new_cache(..., keep_embeds=True)` the cache
also keeps each slot's last-layer hidden state (transformers' `hidden_states[-1]`, after the final
norm), cut and compacted with the keys and values, and `last_embeds(count)` returns each row's
last `count` logical positions, as `KVCache.last_embeds` does for a `Decoder`.

Cost. A 49k-token head costs as much per position as several transformer layers of a small
model (SmolLM2-135M: 28M of its 134M weights), so `logits_at` computes it at one position per row
only (transformers' `logits_to_keep`): the prefill needs each row's last position, a draft's
catch-up call its last one. With no hole in the cache, the 2-D mask lets transformers skip
building a 4-D mask (SDPA's own causal path), as its `generate()` does.

Vocabularies. Drafts and targets of one family often differ only by padding of the logits head
(Pythia: a 50304- or 50432-row head over a 50277-token tokenizer). `vocab_size` slices the logits
to the shared vocabulary, so p and q live on the same tokens; distributions are those of the
sliced heads (the padded rows, never trained, are left out).

transformers is imported lazily: `specdec_models` imports without it.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..errors import check


def is_hf_model(obj: Any) -> bool:
    """Whether obj is a transformers PreTrainedModel (without importing transformers: if it is
    not imported yet, nothing can be one)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(obj, tf.PreTrainedModel)


def text_config(config: Any) -> Any:
    """The text model's config: a multimodal config's `get_text_config()`, else config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def logits_width(model: Any) -> int:
    """The number of logits a HF causal LM returns per position (its head's rows)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(text_config(model.config).vocab_size)


def cache_argument(model: Any) -> str:
    """The name a causal LM's forward takes its KV cache by: `cache` from transformers 5.24 on
    (where `past_key_values` is deprecated, to be removed in 5.40), `past_key_values` before."""
    return _cache_argument(type(model))


@functools.cache
def _cache_argument(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


@dataclass(frozen=True)
class HFSizes:
    """What `generate` reads from a model's `cfg`."""

    vocab_size: int
    max_seq_len: int


class HFOutput(NamedTuple):
    # (b, n, vocab_size), sliced to the shared vocabulary; (b, 1, vocab_size) with logits_at
    logits: Tensor
    embeds: Tensor | None = None  # (b, n, hidden * len(layers)): hidden states, when asked for


def _map_kv(kv: Any, fn) -> None:
    """Replace every cached key and value tensor t (b, heads, slots, dim) of a DynamicCache by fn(t)."""
    layers = getattr(kv, "layers", None)
    if layers is not None:                       # transformers >= 4.56: one object per layer
        for layer in layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)
    else:                                        # older: lists of tensors
        kv.key_cache = [fn(k) if k.numel() else k for k in kv.key_cache]
        kv.value_cache = [fn(v) if v.numel() else v for v in kv.value_cache]


class HFKVCache:
    """A Hugging Face DynamicCache with one logical length per row (see the module docstring).

    keep_embeds: also keep each slot's last-layer hidden state (`embeds`, (b, slots, hidden)), cut
    and compacted with the keys and values, so `last_embeds(count)` returns each row's last `count`
    logical positions: what a prophet reads (as `KVCache.embeds` does for a `Decoder`)."""

    def __init__(self, batch: int, capacity: int, device: torch.device, slack: int, keep_embeds: bool = False,
                 keep_layers: list[int] | None = None) -> None:
        from transformers import DynamicCache

        self.kv = DynamicCache()
        self.capacity = capacity
        self.slack = slack
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)    # (b, slots)
        self.keep_embeds = keep_embeds
        self.embeds: Tensor | None = None                                     # (b, slots, hidden)
        self.keep_layers = keep_layers
        self.layer_states: Tensor | None = None          # (b, n, len(keep_layers) * hidden) of the last call

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def slots(self) -> int:
        """Positions the Hugging Face cache holds per row (valid or not)."""
        return self.valid.shape[1]

    def forward(self, model: Any, tokens: Tensor, window: int | None, *, keep: Tensor | None = None,
                embeds: bool = False, tree: tuple[Tensor, Tensor] | None = None) -> Any:
        """Append tokens (b, n) to every row; return the model's output (logits (b, n, head rows),
        or at the positions `keep` (k,) of every row; hidden_states when embeds or keep_embeds).

        tree = (offsets (n,), allowed (n, n) bool): the new tokens are a draft tree (`decode.tree`):
        token i sits at position length + offsets[i] and attends to the valid slots and to the new
        tokens j with allowed[i, j] (its ancestors and itself), through a 4-D mask; `keep_new` then
        keeps the accepted path."""
        b, n = tokens.shape
        check(b == self.batch, f"cache holds {self.batch} rows, got {b}")
        check(int(self.lengths.max()) + n <= self.capacity,
              f"KV cache full: {int(self.lengths.max())} + {n} tokens exceed capacity {self.capacity}")
        if window is not None:
            check(self.slots + n <= window,
                  f"the model attends through a sliding window of {window} positions; the cache would hold "
                  f"{self.slots + n}, which this adapter does not support")
        valid = torch.cat([self.valid, torch.ones(b, n, dtype=torch.bool, device=self.valid.device)], 1)
        pos = self.lengths[:, None] + torch.arange(n, device=self.lengths.device)         # (b, n)
        mask: Tensor = valid
        if tree is not None:
            offsets, allowed = tree
            pos = self.lengths[:, None] + offsets.to(self.lengths.device)[None]
            seen = torch.cat([self.valid[:, None, :].expand(b, n, self.slots),
                              allowed.to(self.valid.device)[None].expand(b, n, n)], -1)          # (b, n, slots + n)
            dtype = model.get_input_embeddings().weight.dtype
            mask = torch.zeros(b, 1, n, self.slots + n, dtype=dtype, device=self.valid.device)
            mask.masked_fill_(~seen[:, None], torch.finfo(dtype).min)       # additive: any attention backend
        # a bool mask is what transformers converts any 2-D mask to; with no hole it builds none
        # at all (SDPA's own causal path) for one new token or an empty cache
        extra = {} if keep is None else {"logits_to_keep": keep}
        if embeds or self.keep_embeds or self.keep_layers:
            extra["output_hidden_states"] = True
        name = cache_argument(model)
        out = model(input_ids=tokens, attention_mask=mask, position_ids=pos, use_cache=True, **{name: self.kv}, **extra)
        check(getattr(out, name) is self.kv,
              f"{type(model).__name__} did not use the DynamicCache it was given: "
              "its cache cannot be rolled back per row")
        if self.keep_embeds:
            h = out.hidden_states[-1]                                                    # (b, n, hidden)
            self.embeds = h if self.embeds is None else torch.cat([self.embeds, h], 1)
        if self.keep_layers:
            self.layer_states = torch.cat([out.hidden_states[i] for i in self.keep_layers], -1)
        self.valid = valid
        self.lengths = self.lengths + n
        return out

    def keep_new(self, keep: Tensor) -> None:
        """Of the last call's n slots, keep those marked in keep (b, n) (a draft tree's accepted
        path, in order) and forget the others: the kept ones become each row's next positions."""
        n = keep.shape[1]
        self.valid[:, -n:] &= keep.to(self.valid.device)
        self.rollback(self.lengths - n + keep.sum(1).to(self.lengths.device))

    def last_embeds(self, count: int) -> Tensor:
        """The hidden states of each row's last `count` logical positions: (batch, count, hidden)."""
        check(self.keep_embeds, "this cache does not keep embeddings (new_cache(..., keep_embeds=True))")
        check(int(self.lengths.min()) >= count,
              f"every row needs at least {count} cached positions, shortest has {int(self.lengths.min())}")
        want = self.lengths[:, None] - count + torch.arange(count, device=self.lengths.device)   # (b, count)
        # logical position p of a row lives in its (p + 1)-th valid slot
        slot = torch.searchsorted(self.valid.cumsum(1), want + 1)
        assert self.embeds is not None
        return self.embeds.gather(1, slot[..., None].expand(-1, -1, self.embeds.shape[-1]))

    def rollback(self, lengths: Tensor) -> None:
        """Forget everything past `lengths` (batch,) in each row; lengths may only shrink."""
        lengths = lengths.to(self.lengths.device, torch.long)
        check(bool((lengths <= self.lengths).all()) and bool((lengths >= 0).all()),
              "rollback can only shorten rows")
        # a row's first lengths[b] valid slots stay valid
        self.valid = self.valid & (self.valid.cumsum(1) <= lengths[:, None])
        self.lengths = lengths.clone()
        slots = self.slots
        if slots == 0:
            return
        last_used = (self.valid.any(0) * torch.arange(1, slots + 1, device=self.valid.device)).max()
        longest, used = torch.stack([self.lengths.max(), last_used]).tolist()
        if slots > longest + self.slack:
            self._compact(longest)
        elif used < slots:
            _map_kv(self.kv, lambda t: t[:, :, :used])
            self.valid = self.valid[:, :used]
            if self.embeds is not None:
                self.embeds = self.embeds[:, :used]

    def compact_rows(self, dst: Tensor, src: Tensor, batch: int) -> None:
        """Copy rows `src` into rows `dst`, then keep the first `batch` rows: how decoding drops
        finished rows from a batch (the protocol of `KVCache.compact_rows`)."""
        def move(t: Tensor) -> Tensor:                                  # batch is dim 0 of every tensor here
            if dst.numel():
                t[dst.to(t.device)] = t[src.to(t.device)]
            return t[:batch]

        _map_kv(self.kv, move)
        self.valid, self.lengths = move(self.valid), move(self.lengths)
        if self.embeds is not None:
            self.embeds = move(self.embeds)

    def _compact(self, longest: int) -> None:
        """Gather each row's valid slots to the front, in order; keep `longest` slots."""
        order = (~self.valid).to(torch.uint8).argsort(dim=1, stable=True)[:, :longest]   # (b, longest)

        def gather(t: Tensor) -> Tensor:
            b, h, _, d = t.shape
            return t.gather(2, order.to(t.device)[:, None, :, None].expand(b, h, longest, d))

        _map_kv(self.kv, gather)
        if self.embeds is not None:
            self.embeds = self.embeds.gather(1, order[..., None].expand(-1, -1, self.embeds.shape[-1]))
        self.valid = torch.arange(longest, device=self.valid.device) < self.lengths[:, None]


class HFDecoder:
    """A Hugging Face causal LM seen through the protocol `generate` uses on a `Decoder`.

    vocab_size: keep the first vocab_size logits (the vocabulary shared with the other model);
    None keeps all the head's rows. slack: slots a cache may hold beyond its longest row before it
    is compacted (a trade between copying the cache and attending over holes)."""

    def __init__(self, model: Any, vocab_size: int | None = None, slack: int = 64) -> None:
        check(is_hf_model(model), f"HFDecoder wraps a transformers PreTrainedModel, got {type(model).__name__}")
        config = text_config(model.config)
        check(not getattr(model.config, "is_encoder_decoder", False),
              f"{type(model).__name__} is an encoder-decoder model; give a causal LM (AutoModelForCausalLM)")
        check(model.get_output_embeddings() is not None,
              f"{type(model).__name__} has no language-model head; load it with AutoModelForCausalLM")
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        check(layer_types <= {"full_attention", "sliding_attention"},
              f"{type(model).__name__} has layers of type {sorted(layer_types)}: only attention layers with a "
              "DynamicCache can be rolled back per row")
        width = logits_width(model)
        vocab_size = width if vocab_size is None else vocab_size
        check(isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and 1 <= vocab_size <= width,
              f"vocab_size must be an integer in [1, {width}] (the rows of {type(model).__name__}'s head), "
              f"got {vocab_size!r}")
        check(isinstance(slack, int) and slack >= 0, f"slack must be an integer >= 0, got {slack!r}")
        window = getattr(config, "sliding_window", None)
        uses_window = getattr(config, "use_sliding_window", True) is not False
        self.window = window if isinstance(window, int) and uses_window else None
        max_len = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions", "max_seq_len")
                        if isinstance(getattr(config, k, None), int)), 1 << 30)
        self.model = model
        self.slack = slack
        # transformers' `logits_to_keep` (most causal LMs since 4.45): compute the head where needed only
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.cfg = HFSizes(vocab_size=vocab_size, max_seq_len=max_len)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def new_cache(self, batch: int, capacity: int, *, keep_embeds: bool = False,
                  keep_layers: list[int] | None = None) -> HFKVCache:
        """A per-row cache; keep_embeds also keeps the last-layer hidden states (for a prophet),
        keep_layers the hidden states at those `hidden_states` indices of each call's new
        positions, concatenated, as `layer_states` (for an EAGLE-3 head)."""
        return HFKVCache(batch, capacity, self.device, self.slack, keep_embeds=keep_embeds, keep_layers=keep_layers)

    @torch.no_grad()
    def __call__(self, tokens: Tensor, *, cache: HFKVCache | None = None, logits_at: Tensor | None = None,
                 embeds: bool = False, layers: Sequence[int] = (-1,),
                 tree: tuple[Tensor, Tensor] | None = None) -> HFOutput:
        """Logits (b, n, vocab_size) of tokens (b, n): appended to each row of `cache`, or a fresh
        causal sequence from position 0 without one.

        logits_at (b,): compute the logits of one position per row only, (b, 1, vocab_size): the
        head of a 49k-token vocabulary costs as much as several layers per position. tree: the new
        tokens are a draft tree (`HFKVCache.forward`; with a cache only). embeds: also
        return the hidden states of `layers` (transformers' `hidden_states` indices: i is the input
        of decoder layer i, 0 the embedding output, -1 the last layer after the final norm, the
        head's input), concatenated in that order: (b, n, hidden * len(layers)), one forward pass."""
        tokens = tokens.to(self.device)
        keep = inverse = None
        if logits_at is not None and self._keeps_logits:
            # transformers keeps the same positions in every row: the distinct ones, then pick per row
            keep, inverse = torch.unique(logits_at.to(self.device), return_inverse=True)
        check(tree is None or cache is not None, "a draft tree is verified against a cache: pass cache=")
        if cache is None:
            extra = {} if keep is None else {"logits_to_keep": keep}
            out = self.model(input_ids=tokens, use_cache=False, output_hidden_states=embeds, **extra)
        else:
            out = cache.forward(self.model, tokens, self.window, keep=keep, embeds=embeds, tree=tree)
        logits = out.logits
        if logits_at is not None:
            rows = torch.arange(tokens.shape[0], device=logits.device)
            at = inverse if keep is not None else logits_at
            logits = logits[rows, at.to(logits.device)][:, None]
        hidden = torch.cat([out.hidden_states[i] for i in layers], -1).to(tokens.device) if embeds else None
        return HFOutput(logits[..., : self.vocab_size].to(tokens.device), hidden)


def as_decoders(target: Any, draft: Any, vocab_size: int | str | None) -> tuple[Any, Any]:
    """Wrap the Hugging Face causal LMs among target and draft in `HFDecoder`s on one vocabulary.

    vocab_size: None keeps every head whole (the vocabularies must then be equal); an integer
    slices every Hugging Face head to it; "min" slices to the smaller of the two. Models that are
    not Hugging Face ones pass through unchanged (generate validates them), and must already have
    exactly the shared vocabulary."""
    hf = [m for m in (target, draft) if is_hf_model(m)]
    if vocab_size is None and not hf:
        return target, draft
    if vocab_size is not None:
        is_count = isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and vocab_size >= 1
        check(vocab_size == "min" or is_count,
              f"vocab_size must be an integer >= 1 or 'min', got {vocab_size!r}")
    sizes = [logits_width(m) if is_hf_model(m) else getattr(m, "vocab_size", None) for m in (target, draft)]
    if vocab_size is None:
        if draft is not None and hf and None not in sizes:
            check(sizes[0] == sizes[1],
                  f"draft vocabulary ({sizes[1]}) differs from the target's ({sizes[0]}); if both use one tokenizer "
                  "and a head is padded, pass vocab_size=<the tokenizer's size> or vocab_size='min'")
        shared = None
    else:
        known = [s for s in sizes if isinstance(s, int)]
        shared = min(known) if vocab_size == "min" and known else vocab_size
        for role, m, size in (("target", target, sizes[0]), ("draft", draft, sizes[1])):
            if m is None or not isinstance(size, int):
                continue
            if is_hf_model(m):
                check(shared <= size, f"vocab_size {shared} exceeds the {role}'s {size} logits")
            else:
                check(size == shared,
                      f"the {role} ({type(m).__name__}) has vocabulary {size}, not vocab_size {shared}: "
                      "only Hugging Face heads are sliced")
    target, draft = (HFDecoder(m, shared) if is_hf_model(m) else m for m in (target, draft))
    return target, draft
