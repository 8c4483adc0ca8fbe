"""A DFlash-class draft head: a block of tokens drafted in one pass by a few bidirectional layers.

DFlash (Chen et al. 2026, arXiv 2602.06036; the layout of speculators' `DFlashDraftModel`, which
vLLM serves) conditions a small stack of decoder layers on taps of the target's layers and fills a
block of masked positions at once. With the block anchored at position a (the last committed
token, the "pending" token of `decode.speculative`):

    c_t   = hidden_norm(fc([h_a(t); h_b(t); ...]))    t < a: the context, the target's tapped layers fused
    x     = [E(x_a), E(m), ..., E(m)]                  block_size slots at positions a .. a + block_size - 1
    layer : q from input_layernorm(x); k, v from [c_0..c_{a-1}; input_layernorm(x)]
            (per-head q_norm, k_norm, then rotary), every slot seeing the whole context and every
            slot of its own block (no causal mask within the block), then SwiGLU, residuals on x
    q_i   = softmax(lm_head(norm(x_i)))                slot i = 1..block_size-1 predicts token a + i

E is the target's token embedding (frozen, shared) and m the mask token (`mask_token_id`, a target
id whose embedding marks a blank slot). The context keys and values of every layer are that
layer's projections of the same fused feature c_t (DFlash's "KV injection"), so decoding keeps
them in a KV cache that only grows: after each target call the head appends the target's taps of
the committed positions (`extend`), and a round is one pass over block_size slots
(`draft_block`). Slot 0 (the anchor) predicts nothing: a block drafts block_size - 1 tokens.

Draft vocabulary as EAGLE-3's (`heads.eagle3`: `d2t[i] = target id - i`, `t2d` marks the draft
ids); the LM head's rows start from the target's rows of those ids, the final norm from the
target's. `init_layers` of the draft layers start from the target's last layers (q_norm, k_norm
at 1: a Llama layer has none), the fc then from the identity on the highest tap and hidden_norm
from the first of those layers' input norm, so an untrained head continues the target's residual
stream rather than noise.

Training (`DFlashHead.block_loss`), the paper's recipe: random anchors among the answer tokens of
each row, every block of a row in one pass (each query block sees the row's context before its
anchor and its own block only: the mask `block_mask`, the same code decoding runs), the forward
KL from the target's distribution renormalised over the draft vocabulary (see `heads.eagle3` on
why) weighted exp(-(i - 1) / decay) at slot i (the paper's position decay), and a block never
crosses a row's end or an answer's end: a slot counts only while every label from the anchor to
it is an answer token of the row (`anchor_weights`).

Every weight the head saves is named once, in `DFLASH_WEIGHTS`, with speculators' names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import JsonConfig
from ..errors import check, check_positive_int
from ..hf.adapter import is_hf_model, logits_width, text_config
from ..kv_cache import KVCache
from ..model import RMSNorm, Rotary, rotate_half
from .base import TargetVocabHead
from .eagle3 import (
    _MLP,
    _decoder_layer,
    _final_norm_weight,
    _rope_theta,
    _submodule_weight,
    default_aux_layers,
    vocab_maps,
)
from .weights import Weight, WeightTable

# the paper's position decay per block size (its training recipe: gamma 7, 5, 4 at blocks 16, 10, 8)
PAPER_DECAY = {16: 7.0, 10: 5.0, 8: 4.0}


def paper_decay(block_size: int) -> float:
    """The loss decay of slot i, exp(-(i - 1) / decay): the paper's value for its block sizes,
    else block_size / 2 (the rule its three values follow within one)."""
    return PAPER_DECAY.get(block_size, block_size / 2)


@dataclass(frozen=True)
class DFlashConfig(JsonConfig):
    """Sizes of a DFlash head: its `num_layers` decoder layers have the target's shapes (hidden
    size, heads, key-value heads, head size, feed-forward width); `aux_layers` are the target's
    `hidden_states` indices the fc fuses (its taps), `target_layers` the target's depth L,
    `draft_vocab_size` the rows of its LM head; `block_size` slots per pass (block_size - 1
    drafts), `mask_token_id` the target id that fills the blank slots, `init_layers` how many of
    the draft layers start from the target's last layers."""

    what = "dflash head config"

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_vocab_size: int
    draft_vocab_size: int
    target_layers: int
    aux_layers: list[int] = field(default_factory=list)
    block_size: int = 8
    mask_token_id: int = 0
    num_layers: int = 1
    init_layers: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "target_vocab_size", "draft_vocab_size", "target_layers", "max_seq_len", "num_layers"):
            check_positive_int(getattr(self, name), f"dflash.{name}")
        object.__setattr__(self, "aux_layers", list(self.aux_layers))
        check(len(self.aux_layers) >= 1, "dflash.aux_layers must name at least one layer")
        for i in self.aux_layers:
            check(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= self.target_layers,
                  f"dflash.aux_layers: {i!r} is out of range: a target of {self.target_layers} layers has "
                  f"hidden_states indices 0..{self.target_layers} (index i is the input of decoder layer i)")
        check(isinstance(self.block_size, int) and not isinstance(self.block_size, bool) and self.block_size >= 2,
              f"dflash.block_size must be an integer >= 2 (the anchor and at least one drafted slot), "
              f"got {self.block_size!r}")
        check(isinstance(self.mask_token_id, int) and not isinstance(self.mask_token_id, bool)
              and 0 <= self.mask_token_id < self.target_vocab_size,
              f"dflash.mask_token_id must be a token id in [0, {self.target_vocab_size}), got {self.mask_token_id!r}")
        check(isinstance(self.init_layers, int) and not isinstance(self.init_layers, bool)
              and 0 <= self.init_layers <= min(self.num_layers, self.target_layers),
              f"dflash.init_layers must be in [0, {min(self.num_layers, self.target_layers)}] (draft layers started "
              f"from the target's), got {self.init_layers!r}")
        check(self.num_heads % self.num_kv_heads == 0,
              f"dflash.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        check(self.head_dim % 2 == 0, f"dflash.head_dim must be even for rotary embeddings, got {self.head_dim}")
        check(self.draft_vocab_size <= self.target_vocab_size,
              f"dflash.draft_vocab_size ({self.draft_vocab_size}) exceeds the target's vocabulary "
              f"({self.target_vocab_size})")
        check(self.hidden_act == "silu", f"dflash.hidden_act: only silu is supported, got {self.hidden_act!r}")

    @classmethod
    def for_target(cls, target: Any, *, block_size: int = 8, mask_token_id: int | None = None,
                   aux_layers: list[int] | None = None, draft_vocab_size: int | None = None, num_layers: int = 1,
                   init_layers: int = 0, vocab_size: int | None = None) -> DFlashConfig:
        """A head config with the decoder layer shapes of the Hugging Face causal LM `target`;
        `aux_layers` default to EAGLE-3's taps [2, L//2, L-3] (so the head trains on the same
        cache), `mask_token_id` to the last id of the vocabulary, `vocab_size` (default the rows
        of its head) is the target vocabulary the head drafts in."""
        check(is_hf_model(target), f"target must be a Hugging Face causal LM, got {type(target).__name__}")
        c = text_config(target.config)
        heads = int(c.num_attention_heads)
        layers = int(c.num_hidden_layers)
        vocab = logits_width(target) if vocab_size is None else vocab_size
        return cls(hidden_size=int(c.hidden_size), num_heads=heads,
                   num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
                   intermediate_size=int(c.intermediate_size), target_vocab_size=vocab,
                   draft_vocab_size=vocab if draft_vocab_size is None else draft_vocab_size, target_layers=layers,
                   aux_layers=default_aux_layers(layers) if aux_layers is None else list(aux_layers),
                   block_size=block_size, mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
                   num_layers=num_layers, init_layers=init_layers,
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-5)), rope_theta=_rope_theta(c),
                   max_seq_len=int(getattr(c, "max_position_embeddings", 2048)))


def check_dflash_target(config: DFlashConfig, target: Any) -> None:
    """Refuse, in one line, a target whose shapes are not those the head was made for."""
    c = text_config(target.config)
    name = type(target).__name__
    check(int(c.hidden_size) == config.hidden_size,
          f"the dflash head was made for a target of hidden size {config.hidden_size}, {name} has {c.hidden_size}")
    check(int(c.num_hidden_layers) == config.target_layers,
          f"the dflash head was made for a target of {config.target_layers} layers, {name} has "
          f"{c.num_hidden_layers}: its taps {config.aux_layers} would read other depths")
    check(logits_width(target) >= config.target_vocab_size,
          f"the dflash head drafts in a vocabulary of {config.target_vocab_size} tokens, {name}'s head has "
          f"{logits_width(target)} rows")


# ------------------------------------------------------------------------------ the weights

def dflash_sizes(c: DFlashConfig) -> dict[str, int]:
    """The named sizes of `dflash_weights`' shapes: H hidden, AH the taps concatenated, Q and KV
    the query and key-value widths, d the head size, I the feed-forward width, D and V the draft
    and target vocabularies."""
    return {"H": c.hidden_size, "AH": len(c.aux_layers) * c.hidden_size, "Q": c.num_heads * c.head_dim,
            "KV": c.num_kv_heads * c.head_dim, "d": c.head_dim, "I": c.intermediate_size, "D": c.draft_vocab_size,
            "V": c.target_vocab_size}


def _layer_weights(i: int) -> tuple[Weight, ...]:
    p = f"layers.{i}."
    return (
        Weight(p + "input_layernorm.weight", ("H",), "RMSNorm of the block's slots (what q/k/v of the block read)"),
        Weight(p + "self_attn.q_proj.weight", ("Q", "H"), "queries of the block's slots"),
        Weight(p + "self_attn.k_proj.weight", ("KV", "H"), "keys of the context features and of the block's slots"),
        Weight(p + "self_attn.v_proj.weight", ("KV", "H"), "values of the context features and of the block's slots"),
        Weight(p + "self_attn.o_proj.weight", ("H", "Q"), "attention output, added to the slots"),
        Weight(p + "self_attn.q_norm.weight", ("d",), "per-head RMSNorm of the queries"),
        Weight(p + "self_attn.k_norm.weight", ("d",), "per-head RMSNorm of the keys"),
        Weight(p + "post_attention_layernorm.weight", ("H",), "RMSNorm before the feed-forward"),
        Weight(p + "mlp.gate_proj.weight", ("I", "H"), "SwiGLU gate"),
        Weight(p + "mlp.up_proj.weight", ("I", "H"), "SwiGLU up projection"),
        Weight(p + "mlp.down_proj.weight", ("H", "I"), "SwiGLU down projection"),
    )


def dflash_weights(num_layers: int) -> WeightTable:
    """Every tensor a DFlashHead of `num_layers` layers saves, in state_dict order, with
    speculators' names (module docstring). The target's embedding is read, never saved."""
    return WeightTable("dflash", (
        Weight("d2t", ("D",), "target id - draft id of each draft id (int64)", vocab_map=True),
        Weight("t2d", ("V",), "whether each target id is in the draft vocabulary (bool)", vocab_map=True),
        Weight("fc.weight", ("H", "AH"), "fuses the tapped hidden states, concatenated, into one context feature"),
        Weight("hidden_norm.weight", ("H",), "RMSNorm of the fused context feature (what every layer's k/v read)"),
        *(w for i in range(num_layers) for w in _layer_weights(i)),
        Weight("norm.weight", ("H",), "final RMSNorm (starts as the target's)"),
        Weight("lm_head.weight", ("D", "H"), "LM head over the draft vocabulary (starts as the target's rows)"),
    ), dflash_sizes)


# ------------------------------------------------------------------------------ the layer

class _Attention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def _split(self, x: Tensor, heads: int) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, heads, self.head_dim).transpose(1, 2)          # (b, heads, n, d)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (k_norm, rotary) and values (b, kv_heads, n, d) of x (b, n, H)."""
        k = self.k_norm(self._split(self.k_proj(x), self.kv_heads))
        return k * cos + rotate_half(k) * sin, self._split(self.v_proj(x), self.kv_heads)

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Queries (q_norm, rotary) (b, heads, n, d) of x (b, n, H)."""
        q = self.q_norm(self._split(self.q_proj(x), self.heads))
        return q * cos + rotate_half(q) * sin


class DFlashLayer(nn.Module):
    """One draft layer: attention of the block's slots over the context's keys and values and
    their own block's, then a SwiGLU feed-forward, both residual on the slots."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """The slots x (b, Q, H) at rotary cos, sin (b, 1, Q, d), seeing the context keys and
        values (each (b, kv, C, d)) and the slots' own keys as mask (b, 1, Q, C + Q) allows."""
        attn = self.self_attn
        normed = self.input_layernorm(x)
        k, v = attn.keys_values(normed, cos, sin)
        q = attn.queries(normed, cos, sin)
        keys, values = torch.cat([context[0].to(k), k], 2), torch.cat([context[1].to(v), v], 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        b, _, n, _ = out.shape
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


def block_mask(context_visible: Tensor, block_size: int) -> Tensor:
    """The attention mask (b, 1, Q, C + Q) of Q = m * block_size slots (m blocks side by side):
    context_visible (b, Q, C) says which context keys each slot sees, and each slot sees every slot
    of its own block and none of another's (bidirectional within a block)."""
    b, Q, _ = context_visible.shape
    block = torch.arange(Q, device=context_visible.device) // block_size
    own = (block[:, None] == block[None, :]).expand(b, Q, Q)
    return torch.cat([context_visible, own], -1)[:, None]


def anchor_weights(label_mask: Tensor, block_size: int, decay: float) -> tuple[Tensor, Tensor]:
    """(valid anchors (b, n), slot weights (b, n, block_size - 1)) from label_mask (b, n)
    (label_mask[j]: the target's prediction at position j, of token j + 1, counts). A block
    anchored at a drafts tokens a + 1 .. a + block_size - 1, slot i's label being the prediction at
    a + i - 1. Slot i counts only while labels a .. a + i - 1 all count (an answer's end, a turn's
    end or the row's end stops the block: nothing past it is trained on), and weighs
    exp(-(i - 1) / decay). An anchor is valid where a >= 1 (a context to read), token a is itself
    an answer token (label a - 1 counts: in decoding the anchor is always an emitted token) and
    slot 1 counts."""
    b, n = label_mask.shape
    g = block_size - 1
    padded = torch.cat([label_mask.bool(), label_mask.new_zeros(b, g, dtype=torch.bool)], 1)
    labels = padded.unfold(1, g, 1)[:, :n]                                         # (b, n, g): labels a .. a+g-1
    alive = labels.int().cumprod(-1).bool()
    decay_w = torch.exp(-torch.arange(g, device=label_mask.device, dtype=torch.float32) / decay)
    prev = torch.cat([label_mask.new_zeros(b, 1, dtype=torch.bool), label_mask[:, :-1].bool()], 1)
    valid = alive[..., 0] & prev
    return valid, alive.float() * decay_w * valid[..., None]


def sample_anchors(valid: Tensor, count: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """(anchors (b, m), real (b, m)): up to `count` distinct valid positions per row, uniformly at
    random, ascending (m = min(count, the most any row has)); padding anchors are 0, real False."""
    b, n = valid.shape
    m = max(1, min(count, int(valid.sum(1).max()) if b else 1))
    scores = torch.rand(b, n, generator=generator, device=valid.device if generator is None else generator.device)
    scores = scores.to(valid.device).masked_fill(~valid, -1.0)
    top = scores.topk(m, dim=1)
    anchors = torch.where(top.values >= 0, top.indices, 0)
    order = anchors.argsort(1)
    return anchors.gather(1, order), (top.values >= 0).gather(1, order)


class BlockLoss(NamedTuple):
    loss: Tensor               # weighted mean KL over the counted slots
    slot_kl: Tensor            # (g,) mean KL per slot (no gradient)
    slot_correct: Tensor       # (g,) counted slots whose draft argmax equals the target's
    slot_count: Tensor         # (g,) counted slots
    accepted: Tensor           # () sum over blocks of the greedy accepted run (consecutive right slots)
    blocks: Tensor             # () blocks counted


@torch.no_grad()
def _block_stats(loss: Tensor, kl: Tensor, right: Tensor, counted: Tensor) -> BlockLoss:
    """A `BlockLoss` from the counted slots' KL and hits (M,), counted (b, m, g) marking them."""
    g = counted.shape[-1]
    slot = torch.arange(g, device=counted.device).expand_as(counted)[counted]
    hits = torch.zeros_like(counted)
    hits[counted] = right
    run = (hits | ~counted).int().cumprod(-1) * counted                        # right so far, counted
    count = torch.zeros(g, device=kl.device).index_add_(0, slot, torch.ones_like(kl))
    slot_kl = torch.zeros(g, device=kl.device).index_add_(0, slot, kl) / count.clamp_min(1)
    correct = torch.zeros(g, device=kl.device).index_add_(0, slot, right.float())
    return BlockLoss(loss, slot_kl, correct, count, run.sum().float(), counted[..., 0].sum().float())


# ------------------------------------------------------------------------------ the head

class DFlashHead(TargetVocabHead):
    """A DFlash head for the Hugging Face causal LM `target` (frozen, shared: its token embedding
    is read, never trained or saved; see the module docstring).

    head = DFlashHead(DFlashConfig.for_target(model, block_size=8), model, draft_ids)
    out = head.block_loss(tokens, aux, last, label_mask, anchors=16)        # training
    tokens, stats = generate(model, prompt, 64, BlockDrafter(head))        # decoding

    `draft_ids` (draft_vocab_size,) sorted target ids of the draft vocabulary (None: the first
    draft_vocab_size ids); `init_from_target` copies the target's LM-head rows of those ids, its
    final norm, and its last `init_layers` layers into the head."""

    kind = "dflash"

    def __init__(self, config: DFlashConfig, target: Any, draft_ids: Tensor | None = None, *,
                 init_from_target: bool = True) -> None:
        super().__init__()
        check(isinstance(config, DFlashConfig), f"config must be a DFlashConfig, got {type(config).__name__}")
        check(is_hf_model(target), f"target must be a Hugging Face causal LM, got {type(target).__name__}")
        check_dflash_target(config, target)
        self.config = config
        self._target = (target,)
        H = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layers) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.rotary = Rotary(config.head_dim, min(config.max_seq_len, 4096), base=config.rope_theta)
        if draft_ids is None:
            draft_ids = torch.arange(config.draft_vocab_size)
        check(draft_ids.numel() == config.draft_vocab_size,
              f"draft vocabulary map holds {draft_ids.numel()} ids, the head's config {config.draft_vocab_size}")
        d2t, t2d = vocab_maps(draft_ids, config.target_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.reset_parameters(init_from_target)
        weight = target.get_input_embeddings().weight
        self.to(device=weight.device, dtype=weight.dtype)

    # -- construction ----------------------------------------------------------------------------

    def reset_parameters(self, init_from_target: bool = True) -> None:
        """Small normal weights, norms at 1; then (init_from_target) the LM head's rows, the final
        norm and the first `init_layers` layers from the target's (module docstring)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        if not init_from_target:
            return
        with torch.no_grad():
            head = self.target.get_output_embeddings().weight
            self.lm_head.weight.copy_(head[self.draft_ids.to(head.device)].to(self.lm_head.weight))
            final_norm = _final_norm_weight(self.target)
            if final_norm is not None:
                self.norm.weight.copy_(final_norm.to(self.norm.weight))
        if self.config.init_layers:
            self.init_layers_from()

    @torch.no_grad()
    def init_layers_from(self) -> None:
        """Start draft layer j < init_layers as the target's layer L - init_layers + j, the fc as
        the identity on the highest tap and hidden_norm as that first layer's input norm. A
        target whose layers do not have the head's (Llama) shapes is refused in one line."""
        c = self.config
        first = c.target_layers - c.init_layers
        names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
        for j in range(c.init_layers):
            source, ours = _decoder_layer(self.target, first + j), self.layers[j]
            for name in names:
                theirs, mine = _submodule_weight(source, name), _submodule_weight(ours, name)
                check(theirs is not None and theirs.shape == mine.shape,
                      f"the target's layer {first + j} {name} is "
                      f"{'missing' if theirs is None else tuple(theirs.shape)}, the head's {tuple(mine.shape)}: it is "
                      f"not a Llama-shaped layer to start a draft layer from")
                mine.copy_(theirs.to(mine))
        self.hidden_norm.weight.copy_(_submodule_weight(_decoder_layer(self.target, first), "input_layernorm")
                                      .to(self.hidden_norm.weight))
        H = c.hidden_size
        slot = len(c.aux_layers) - 1
        self.fc.weight.zero_()
        self.fc.weight[:, slot * H:(slot + 1) * H].copy_(torch.eye(H))

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_gamma(self) -> int:
        """A pass drafts block_size - 1 tokens."""
        return self.config.block_size - 1

    def context(self, aux: Tensor) -> Tensor:
        """The fused context feature hidden_norm(fc(taps)) (..., H) of the taps concatenated (..., A*H)."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight)))

    def run_blocks(self, anchor_tokens: Tensor, anchor_pos: Tensor, contexts: list[tuple[Tensor, Tensor]],
                   context_visible: Tensor) -> Tensor:
        """The last layer's slots (b, m * block_size, H) of m blocks per row side by side: anchor
        tokens and positions (b, m), each layer's context keys and values `contexts`, and which
        context keys each block sees, context_visible (b, m, C). One pass; decoding and training
        both run it."""
        bs = self.config.block_size
        b, m = anchor_tokens.shape
        slots = torch.full((b, m, bs), self.config.mask_token_id, dtype=torch.long, device=anchor_tokens.device)
        slots[..., 0] = anchor_tokens
        x = self.embed(slots.flatten(1))                                          # (b, m * bs, H)
        pos = (anchor_pos[..., None] + torch.arange(bs, device=anchor_pos.device)).flatten(1)
        cos, sin = self.rotary(pos.to(self.device), x.dtype)
        mask = block_mask(context_visible.repeat_interleave(bs, 1).to(self.device), bs)
        for layer, context in zip(self.layers, contexts, strict=True):
            x = layer(x, cos, sin, context, mask)
        return x

    # -- decoding --------------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """The context's keys and values of every layer (capacity positions per row)."""
        w = self.fc.weight
        return KVCache(depth=self.config.num_layers, batch=batch, heads=self.config.num_kv_heads,
                       dim_head=self.config.head_dim, capacity=capacity, dtype=w.dtype, device=w.device)

    def extend(self, tokens: Tensor | None, aux: Tensor, cache: KVCache) -> None:
        """Append the context positions whose taps are aux (b, n, A*H) to each row of `cache`, at
        its rows' lengths (every row advances by n; roll back rows that committed fewer). `tokens`,
        the token after each position in the block drafter's protocol (`decode.block_draft`), is
        not read: the context is the target's taps alone."""
        n = aux.shape[1]
        cache.check_room(n)
        pos = cache.positions(n)
        feature = self.context(aux)
        cos, sin = self.rotary(pos, feature.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(feature, cos, sin)
            cache.update(i, pos, k, v, 0)
        cache.advance(n)

    def draft_block(self, anchor: Tensor, cache: KVCache) -> Tensor:
        """One pass: the draft logits (b, block_size - 1, draft) of the slots after each row's
        anchor token anchor (b,), at position cache.lengths (the block sees the whole cached context)."""
        L = int(cache.lengths.max())
        contexts = [(cache.k[i, :, :, :L], cache.v[i, :, :, :L]) for i in range(self.config.num_layers)]
        visible = (torch.arange(L, device=cache.lengths.device) < cache.lengths[:, None])[:, None]   # (b, 1, L)
        x = self.run_blocks(anchor[:, None], cache.lengths[:, None], contexts, visible)
        return self.logits(x[:, 1:])

    # -- training --------------------------------------------------------------------------------

    def block_logits(self, tokens: Tensor, aux: Tensor, anchors: Tensor) -> Tensor:
        """Draft logits (b, m, block_size - 1, draft) of blocks anchored at anchors (b, m) of rows
        tokens (b, >= n) whose taps are aux (b, n, A*H): each block sees the row's context before
        its anchor, as `draft_block` does after decoding that context."""
        b, n = aux.shape[:2]
        m, bs = anchors.shape[1], self.config.block_size
        feature = self.context(aux)
        pos = torch.arange(n, device=self.device).expand(b, n)
        cos, sin = self.rotary(pos, feature.dtype)
        contexts = [layer.self_attn.keys_values(feature, cos, sin) for layer in self.layers]
        anchors = anchors.to(self.device)
        visible = torch.arange(n, device=self.device)[None, None, :] < anchors[..., None]      # (b, m, n)
        x = self.run_blocks(tokens.to(self.device).gather(1, anchors), anchors, contexts, visible)
        return self.logits(x.unflatten(1, (m, bs))[:, :, 1:])

    def block_loss(self, tokens: Tensor, aux: Tensor, last: Tensor, label_mask: Tensor | None = None, *,
                   anchors: int = 16, decay: float | None = None, generator: torch.Generator | None = None,
                   greedy_in_vocab: Tensor | None = None) -> BlockLoss:
        """The training loss (module docstring) on rows tokens (b, n + 1) with the target's taps
        aux (b, n, A*H) and last-layer hidden states after the final norm last (b, n, H), both of
        tokens[:, :n]; label_mask (b, n) (None: all). Up to `anchors` blocks per row, drawn with
        `generator`; slot i weighs exp(-(i - 1) / decay) (None: `paper_decay`). greedy_in_vocab
        (b, n): whether the target's greedy token at each position lies in the draft vocabulary
        (a miss where not; None: argmaxes over the draft vocabulary compared)."""
        b, n = aux.shape[:2]
        bs, g = self.config.block_size, self.config.block_size - 1
        mask = torch.ones(b, n, dtype=torch.bool) if label_mask is None else label_mask.bool()
        valid, weights = anchor_weights(mask.to(self.device), bs, paper_decay(bs) if decay is None else decay)
        at, real = sample_anchors(valid, anchors, generator)
        w = weights.gather(1, at[..., None].expand(-1, -1, g)) * real[..., None]          # (b, m, g)
        label_pos = (at[..., None] + torch.arange(g, device=at.device)).clamp(max=n - 1)  # (b, m, g)
        counted = w > 0
        logq = torch.log_softmax(self.block_logits(tokens, aux, at)[counted].float(), -1)          # (M, draft)
        with torch.no_grad():
            rows = torch.arange(b, device=at.device)[:, None, None].expand_as(label_pos)[counted]
            at_label = label_pos[counted]
            p = torch.softmax(self.target_draft_logits(last.to(self.device)[rows, at_label]).float(), -1)
            label = p.argmax(-1)
            if greedy_in_vocab is not None:
                label = label.masked_fill(~greedy_in_vocab.to(self.device)[rows, at_label], -1)
        kl = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)                         # (M,) KL(p || q)
        wc = w[counted]
        loss = (wc * kl).sum() / wc.sum().clamp_min(1e-12)
        return _block_stats(loss, kl.detach(), logq.argmax(-1) == label, counted)

    def forward(self, tokens: Tensor, aux: Tensor, last: Tensor, label_mask: Tensor | None = None,
                **kw: Any) -> BlockLoss:
        return self.block_loss(tokens, aux, last, label_mask, **kw)


__all__ = ["BlockLoss", "DFlashConfig", "DFlashHead", "DFlashLayer", "anchor_weights", "block_mask",
           "check_dflash_target", "dflash_sizes", "dflash_weights", "paper_decay", "sample_anchors"]
