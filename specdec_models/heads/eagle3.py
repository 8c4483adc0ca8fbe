"""An EAGLE-3-class draft head for a frozen Hugging Face target.

The head (Li et al. 2025, "EAGLE-3"; the layout vLLM's `speculators` and SGLang serve) drafts from
the target's hidden states of three layers ("aux" layers, Hugging Face `hidden_states` indices:
the input of decoder layer i, `hidden_states[0]` being the embeddings; default [2, L//2, L-3]):

    g_t   = fc([h_a(t); h_b(t); h_c(t)])                         fused target feature of position t
    f_t   = layer([norm_e(E(x_{t+1})); norm_h(g_t)], residual g_t)   one decoder layer, q/k/v read 2H
    q_t   = softmax(lm_head(norm(f_t)))                           over the draft vocabulary, predicts x_{t+2}

E is the target's token embedding (frozen, shared). The layer attends causally over every earlier
position of the head's own KV cache. From draft step 2 on, the feature is the head's own previous
output: draft step j (j >= 2) at position t + j - 1 reads [E(d_{j-1}); f] where f is the layer's
output at the step before, and attends to the target-feature positions 0..t plus its own earlier
draft positions. After each target call the cache is extended with the target's features of the
tokens it accepted (and the drafted positions are dropped), so the head always conditions on the
whole context.

Draft vocabulary. The head's LM head covers `draft_vocab_size` target tokens: `d2t[i]` holds
`target_id - i` for draft id i (the convention of EAGLE-3's and speculators' exports), `t2d` marks
the target ids in the draft vocabulary. Its rows start from the target's LM-head rows of those
tokens and its final norm from the target's final norm, so an untrained head already maps a
feature like the target's last layer to sensible logits. Decoding stays lossless: the draft
distribution q is zero outside the draft vocabulary and the residual max(0, p - q) covers it.

Training as decoding runs it (`Eagle3Head.ttt_loss`): step 0 is teacher-forced over every position
of a row (target features in); steps 1..K-1 feed the head's own features of the step before, each
position's query attending to the target-feature keys up to it (causal) and to its own chain's
keys of the earlier steps (the "diagonal" of EAGLE-3's training-time test), at rotary positions
shifted by the step. The tokens fed are the row's (teacher forcing: a draft step runs only after
the drafts before it were accepted, and then they equal the target's tokens). The loss of step k
is the forward KL from the target's next-token distribution, renormalised over the draft
vocabulary, to the head's, weighted by `ttt_decay`^k, over the positions whose label is an answer
token (`label_mask`). Steps 1..K-1 run only the chains with such a label ahead (`needed_chains`),
and step 0 runs its queries, attention output and feed-forward only where its output is read: a
prompt position gives step 0 its keys and values and nothing more. Those positions are packed into
one row for the layer's products, so padding to the longest row costs nothing. Renormalising is
the right handling of the mass outside the draft vocabulary: among distributions q supported on the
draft vocabulary V, the expected acceptance sum_x min(p(x), q(x)) is at most p(V), and q = p / p(V)
attains it; the KL toward p / p(V) has exactly that q as its minimum. An optional term
(`feature_weight`) also pulls the head's normed output toward the target's normed last layer at
the label's position: with the LM head's rows the target's, that vector is what gives p.

Every weight the head saves is named once, in `EAGLE3_WEIGHTS` (canonical name, shape, meaning).
The names are those of the speculators layout (`fc`, `layers.0.{input_layernorm, hidden_norm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`, `lm_head`,
`d2t`, `t2d`); each serving layout renames them by a name map (`specdec_models.export.eagle3`).
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
from .weights import Weight, WeightTable


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default aux layers for an L-layer target: `hidden_states` indices [2, L//2, L-3]."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


def init_layer_index(config: "Eagle3Config") -> int:
    """The target layer `Eagle3Head.init_layer_from` starts the head's layer from: the one that reads
    the highest aux layer, `hidden_states[aux_layers[-1]]`."""
    return min(config.aux_layers[-1], config.target_layers - 1)


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", None) or 10000.0)


@dataclass(frozen=True)
class Eagle3Config(JsonConfig):
    """Sizes of an EAGLE-3 head: its decoder layer has the target's shapes (hidden size, heads,
    key-value heads, head size, feed-forward width), `aux_layers` are the target's `hidden_states`
    indices the `fc` fuses, `target_layers` the target's depth L, `draft_vocab_size` the rows of
    its LM head (<= target_vocab_size)."""

    what = "eagle3 head config"

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_vocab_size: int
    draft_vocab_size: int
    target_layers: int
    aux_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "target_vocab_size", "draft_vocab_size", "target_layers", "max_seq_len"):
            check_positive_int(getattr(self, name), f"eagle3.{name}")
        object.__setattr__(self, "aux_layers", list(self.aux_layers))
        check(len(self.aux_layers) >= 1, "eagle3.aux_layers must name at least one layer")
        for i in self.aux_layers:
            check(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= self.target_layers,
                  f"eagle3.aux_layers: {i!r} is out of range: a target of {self.target_layers} layers has "
                  f"hidden_states indices 0..{self.target_layers} (index i is the input of decoder layer i)")
        check(self.num_heads % self.num_kv_heads == 0,
              f"eagle3.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        check(self.head_dim % 2 == 0, f"eagle3.head_dim must be even for rotary embeddings, got {self.head_dim}")
        check(self.draft_vocab_size <= self.target_vocab_size,
              f"eagle3.draft_vocab_size ({self.draft_vocab_size}) exceeds the target's vocabulary "
              f"({self.target_vocab_size})")
        check(self.hidden_act == "silu", f"eagle3.hidden_act: only silu is supported, got {self.hidden_act!r}")

    @classmethod
    def for_target(cls, target: Any, *, draft_vocab_size: int | None = None, aux_layers: list[int] | None = None,
                   vocab_size: int | None = None) -> Eagle3Config:
        """A head config with the decoder layer shapes of the Hugging Face causal LM `target` (the
        layer is a Llama one, SwiGLU, whatever the target's own architecture);
        `vocab_size` (default the rows of its head) is the target vocabulary the head drafts in."""
        check(is_hf_model(target), f"target must be a Hugging Face causal LM, got {type(target).__name__}")
        c = text_config(target.config)
        heads = int(c.num_attention_heads)
        layers = int(c.num_hidden_layers)
        vocab = logits_width(target) if vocab_size is None else vocab_size
        return cls(hidden_size=int(c.hidden_size), num_heads=heads,
                   num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
                   intermediate_size=int(c.intermediate_size), target_vocab_size=vocab,
                   draft_vocab_size=vocab if draft_vocab_size is None else draft_vocab_size,
                   target_layers=layers,
                   aux_layers=default_aux_layers(layers) if aux_layers is None else list(aux_layers),
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-5)), rope_theta=_rope_theta(c),
                   max_seq_len=int(getattr(c, "max_position_embeddings", 2048)))


def check_head_target(config: Eagle3Config, target: Any) -> None:
    """Refuse, in one line, a target whose shapes are not those the head was made for."""
    c = text_config(target.config)
    check(int(c.hidden_size) == config.hidden_size,
          f"the eagle3 head was made for a target of hidden size {config.hidden_size}, "
          f"{type(target).__name__} has {c.hidden_size}")
    check(int(c.num_hidden_layers) == config.target_layers,
          f"the eagle3 head was made for a target of {config.target_layers} layers, {type(target).__name__} has "
          f"{c.num_hidden_layers}: its aux layers {config.aux_layers} would read other depths")
    check(logits_width(target) >= config.target_vocab_size,
          f"the eagle3 head drafts in a vocabulary of {config.target_vocab_size} tokens, {type(target).__name__}'s "
          f"head has {logits_width(target)} rows")


# ------------------------------------------------------------------------------ the weights

def eagle3_sizes(c: Eagle3Config) -> dict[str, int]:
    """The named sizes of `EAGLE3_WEIGHTS`' shapes: H hidden, AH the aux layers concatenated, 2H
    what q/k/v read ([embedding; feature]), Q and KV the query and key-value widths, I the
    feed-forward width, D and V the draft and target vocabularies."""
    H = c.hidden_size
    return {"H": H, "AH": len(c.aux_layers) * H, "2H": 2 * H, "Q": c.num_heads * c.head_dim,
            "KV": c.num_kv_heads * c.head_dim, "I": c.intermediate_size, "D": c.draft_vocab_size,
            "V": c.target_vocab_size}


# Every tensor an Eagle3Head saves, in state_dict order: the one place its weights are named (module
# docstring). The target's embedding is read, never saved.
EAGLE3_WEIGHTS = WeightTable("eagle3", (
    Weight("d2t", ("D",), "target id - draft id of each draft id (int64)", vocab_map=True),
    Weight("t2d", ("V",), "whether each target id is in the draft vocabulary (bool)", vocab_map=True),
    Weight("fc.weight", ("H", "AH"), "fuses the aux layers' hidden states, concatenated, into one feature"),
    Weight("layers.0.input_layernorm.weight", ("H",), "RMSNorm of the token embedding (first half of q/k/v's input)"),
    Weight("layers.0.hidden_norm.weight", ("H",), "RMSNorm of the feature (second half of q/k/v's input)"),
    Weight("layers.0.self_attn.q_proj.weight", ("Q", "2H"), "queries of [embedding; feature]"),
    Weight("layers.0.self_attn.k_proj.weight", ("KV", "2H"), "keys of [embedding; feature]"),
    Weight("layers.0.self_attn.v_proj.weight", ("KV", "2H"), "values of [embedding; feature]"),
    Weight("layers.0.self_attn.o_proj.weight", ("H", "Q"), "attention output, added to the feature"),
    Weight("layers.0.post_attention_layernorm.weight", ("H",), "RMSNorm before the feed-forward"),
    Weight("layers.0.mlp.gate_proj.weight", ("I", "H"), "SwiGLU gate"),
    Weight("layers.0.mlp.up_proj.weight", ("I", "H"), "SwiGLU up projection"),
    Weight("layers.0.mlp.down_proj.weight", ("H", "I"), "SwiGLU down projection"),
    Weight("norm.weight", ("H",), "final RMSNorm (starts as the target's)"),
    Weight("lm_head.weight", ("D", "H"), "LM head over the draft vocabulary (starts as the target's rows)"),
), eagle3_sizes)


# ------------------------------------------------------------------------------ draft vocabulary

def choose_draft_vocab(counts: Tensor, size: int) -> Tensor:
    """The `size` token ids with the largest counts (ties by smaller id), in ascending id order.
    `counts` (vocab,): how often the target emitted each token as its greedy choice on training
    data (`target_token_counts`); the draft only has to match the target."""
    check_positive_int(size, "draft vocabulary size")
    check(size <= counts.numel(), f"draft vocabulary size {size} exceeds the target's {counts.numel()} tokens")
    order = torch.argsort(-counts.double() + torch.arange(counts.numel(), dtype=torch.float64) * 1e-12, stable=True)
    return order[:size].sort().values


def coverage(counts: Tensor, ids: Tensor) -> float:
    """The share of the counted tokens that lie in the draft vocabulary `ids`."""
    total = float(counts.sum())
    return float(counts[ids].sum()) / total if total > 0 else 0.0


def vocab_maps(ids: Tensor, target_vocab_size: int) -> tuple[Tensor, Tensor]:
    """(d2t (draft,) long with d2t[i] = ids[i] - i, t2d (target_vocab,) bool) for sorted draft ids."""
    ids = ids.long()
    check(ids.ndim == 1 and ids.numel() >= 1, "draft vocabulary ids must be a non-empty 1-D tensor")
    check(bool((ids[1:] > ids[:-1]).all()), "draft vocabulary ids must be strictly increasing")
    check(int(ids[0]) >= 0 and int(ids[-1]) < target_vocab_size,
          f"draft vocabulary ids must lie in [0, {target_vocab_size})")
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


# ------------------------------------------------------------------------------ the layer

class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (b, heads, n, d), keys and values (b, kv_heads, n, d), rotary applied."""
        return (self.queries(x, cos, sin), *self.keys_values(x, cos, sin))

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Queries (b, heads, n, d) of x (b, n, 2H), rotary applied."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (b, kv_heads, n, d) of x (b, n, 2H), rotary applied to the keys."""
        b, n, _ = x.shape
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return k * cos + rotate_half(k) * sin, v


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [input_layernorm(embedding); hidden_norm(feature)]
    (2 x hidden in), the un-normalised feature as the residual, then a SwiGLU feed-forward."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def qkv(self, emb: Tensor, feature: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.self_attn.qkv(self.attention_input(emb, feature), cos, sin)

    def attention_input(self, emb: Tensor, feature: Tensor) -> Tensor:
        """What q/k/v read: [input_layernorm(emb); hidden_norm(feature)] (..., 2H)."""
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(feature)], -1)

    def finish(self, feature: Tensor, attended: Tensor) -> Tensor:
        """The layer's output from its residual `feature` (b, n, H) and the attention's output (b, heads, n, d)."""
        b, _, n, _ = attended.shape
        h = feature + self.self_attn.o_proj(attended.transpose(1, 2).reshape(b, n, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


def ttt_attention(q: Tensor, k0: Tensor, v0: Tensor, ks: list[Tensor], vs: list[Tensor],
                  query_pos: Tensor | None = None) -> Tensor:
    """Attention of training-time-test step len(ks): queries q (b, h, M, d) see the step-0 keys
    k0 (b, kv, T, d) at positions <= their own (causal) and, at their own position only, the keys of
    the steps 1..len(ks) (`ks`, each (b, kv, M, d)): what draft step len(ks) + 1 sees in decoding.
    The queries are those of positions 0..T-1 (M = T), or of the positions `query_pos` (b, M) when
    only some chains are computed (`Eagle3Head.ttt_features`). Returns (b, h, M, d)."""
    groups = q.shape[1] // k0.shape[1]
    expand = (lambda t: t.repeat_interleave(groups, dim=1)) if groups > 1 else (lambda t: t)  # noqa: E731
    scale = q.shape[-1] ** -0.5
    T = k0.shape[2]
    scores = torch.matmul(q, expand(k0).transpose(-1, -2)) * scale                     # (b, h, M, T)
    keys = torch.arange(T, device=q.device)
    if query_pos is None:
        causal = keys[None, :] <= keys[:, None]                                           # (T, T)
    else:
        causal = (keys[None, None, :] <= query_pos[:, :, None])[:, None]                  # (b, 1, M, T)
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(q * expand(k)).sum(-1, keepdim=True) * scale for k in ks]                 # each (b, h, M, 1)
    weights = torch.softmax(torch.cat([scores, *diag], -1).float(), -1).to(q.dtype)
    out = torch.matmul(weights[..., :T], expand(v0))
    for j, v in enumerate(vs):
        out = out + weights[..., T + j:T + j + 1] * expand(v)
    return out


def _pack(x: Tensor, mask: Tensor) -> Tensor:
    """The entries mask (b, n) of x (b, heads, n, d), packed into one row (1, heads, N, d)."""
    return x.transpose(1, 2)[mask].transpose(0, 1)[None]


def _unpack(x: Tensor, mask: Tensor) -> Tensor:
    """x (1, heads, N, d) back at the entries mask (b, n) of a (b, heads, n, d) tensor, zeros elsewhere."""
    out = x.new_zeros(*mask.shape, x.shape[1], x.shape[3])
    out[mask] = x[0].transpose(0, 1)
    return out.transpose(1, 2)


def _unpack_rows(x: Tensor, mask: Tensor) -> Tensor:
    """x (1, N, H) back at the entries mask (b, n) of a (b, n, H) tensor, zeros elsewhere."""
    out = x.new_zeros(*mask.shape, x.shape[-1])
    out[mask] = x[0]
    return out


def needed_chains(mask: Tensor, steps: int) -> tuple[Tensor, Tensor]:
    """The chains (head positions t) that unrolled steps 1..steps-1 must compute, given the label
    mask (b, T) (mask[b, t]: the label at position t + 1 counts): those whose label of some step
    k >= 1, at position t + 1 + k, counts. Returns (positions (b, M), real (b, M)): each row's
    chains in order, padded to the longest row's count with other positions (real False). A chain
    reads only its own earlier steps and the step-0 keys, so leaving the others out changes nothing."""
    b, T = mask.shape
    need = torch.zeros_like(mask)
    for k in range(1, steps):
        need[:, : T - k] |= mask[:, k:]
    counts = need.sum(1)
    width = max(int(counts.max()), 1) if b else 1
    order = (~need).to(torch.uint8).argsort(dim=1, stable=True)[:, :width]
    return order, torch.arange(width, device=mask.device) < counts[:, None]


class TTTLoss(NamedTuple):
    loss: Tensor                  # weighted sum over steps of the per-step mean KL
    step_kl: Tensor               # (K,) mean KL per step (no gradient)
    step_hits: Tensor             # (K,) positions whose draft argmax equals the label's argmax, all steps so far too
    step_correct: Tensor          # (K,) positions whose draft argmax equals the label's (this step alone)
    step_count: Tensor            # (K,) positions counted per step
    vocab_mass: Tensor | None     # mean target probability inside the draft vocabulary (with greedy_in_vocab only)


# ------------------------------------------------------------------------------ the head

class Eagle3Head(TargetVocabHead):
    """An EAGLE-3 head for the Hugging Face causal LM `target` (frozen, shared: its token embedding
    is read, never trained or saved; see the module docstring).

    head = Eagle3Head(Eagle3Config.for_target(model, draft_vocab_size=8192), model, draft_ids)
    out = head.ttt_loss(tokens, aux, last, label_mask, steps=4)    # training
    tokens, stats = generate(model, prompt, 64, HeadDrafter(head))  # decoding

    `draft_ids` (draft_vocab_size,) sorted target ids of the draft vocabulary (None: the first
    draft_vocab_size ids, the whole vocabulary when the sizes agree); `init_from_target` copies
    the target's LM-head rows of those ids and its final norm into the head. Moving the head
    leaves the target where it is; `head.float()` trains fp32 weights next to a bf16 target.
    """

    def __init__(self, config: Eagle3Config, target: Any, draft_ids: Tensor | None = None, *,
                 init_from_target: bool = True, init_layer_from_target: bool = False) -> None:
        super().__init__()
        check(isinstance(config, Eagle3Config), f"config must be an Eagle3Config, got {type(config).__name__}")
        check(is_hf_model(target), f"target must be a Hugging Face causal LM, got {type(target).__name__}")
        check_head_target(config, target)
        self.config = config
        self._target = (target,)
        H = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layers) * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
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
        self.reset_parameters(init_from_target, init_layer_from_target)
        weight = target.get_input_embeddings().weight
        self.to(device=weight.device, dtype=weight.dtype)

    # -- construction ----------------------------------------------------------------------------

    def reset_parameters(self, init_from_target: bool = True, init_layer_from_target: bool = False) -> None:
        """Small normal weights (the fc too, as EAGLE-3's and speculators' heads start), norms at 1;
        then (init_from_target) the LM head's rows and the final norm from the target's, and
        (init_layer_from_target) the decoder layer from the target's (`init_layer_from`)."""
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
        if init_layer_from_target:
            self.init_layer_from()

    @torch.no_grad()
    def init_layer_from(self, index: int | None = None) -> None:
        """Start the decoder layer as the target's layer `index` (default: the layer that reads the
        highest aux layer, `hidden_states[aux_layers[-1]]`) and the fc as the identity on that aux
        layer: the untrained head then computes that target layer's output from the target's
        features, a point inside the target's residual stream rather than noise. The embedding's
        half of q/k/v keeps its small random start (the target's layer has no such input). A
        target whose layer does not have the head's (Llama) shapes is refused in one line."""
        H = self.config.hidden_size
        index = init_layer_index(self.config) if index is None else index
        source = _decoder_layer(self.target, index)
        ours = self.layers[0]
        pairs = [(ours.self_attn.o_proj, "self_attn.o_proj"), (ours.mlp.gate_proj, "mlp.gate_proj"),
                 (ours.mlp.up_proj, "mlp.up_proj"), (ours.mlp.down_proj, "mlp.down_proj"),
                 (ours.post_attention_layernorm, "post_attention_layernorm"), (ours.hidden_norm, "input_layernorm")]
        halves = [(ours.self_attn.q_proj, "self_attn.q_proj"), (ours.self_attn.k_proj, "self_attn.k_proj"),
                  (ours.self_attn.v_proj, "self_attn.v_proj")]
        weights = {name: _submodule_weight(source, name) for _, name in pairs + halves}
        bad = [name for name, w in weights.items() if w is None]
        check(not bad, f"the target's decoder layer {index} lacks {', '.join(bad)}: it is not a Llama-shaped layer "
                       f"to start the head's layer from")
        for module, name in pairs:
            check(module.weight.shape == weights[name].shape,
                  f"the target's layer {index} {name} is {tuple(weights[name].shape)}, the head's "
                  f"{tuple(module.weight.shape)}")
            module.weight.copy_(weights[name].to(module.weight))
        for module, name in halves:
            check(module.weight[:, H:].shape == weights[name].shape,
                  f"the target's layer {index} {name} is {tuple(weights[name].shape)}, the head's feature half "
                  f"{tuple(module.weight[:, H:].shape)}")
            module.weight[:, H:].copy_(weights[name].to(module.weight))
        self.fc.weight.zero_()
        slot = len(self.config.aux_layers) - 1
        self.fc.weight[:, slot * H:(slot + 1) * H].copy_(torch.eye(H))

    @property
    def max_gamma(self) -> int:
        """The head drafts as far as asked; the speed model's `gamma=auto` stops at 8."""
        return 8

    def fuse(self, aux: Tensor) -> Tensor:
        """The fused target feature (..., H) from its aux layers' hidden states concatenated (..., A*H)."""
        return self.fc(aux.to(self.fc.weight))

    # -- decoding --------------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        w = self.fc.weight
        return KVCache(depth=1, batch=batch, heads=self.config.num_kv_heads, dim_head=self.config.head_dim,
                       capacity=capacity, dtype=w.dtype, device=w.device)

    def extend(self, tokens: Tensor, feature: Tensor, cache: KVCache) -> Tensor:
        """Append positions to each row of `cache`: tokens (b, n) are the tokens x_{t+1} and
        feature (b, n, H) the features of positions t (fused target features, or the head's own
        output for a draft step). Returns the layer's outputs (b, n, H); the cache advances by n."""
        n = tokens.shape[1]
        cache.check_room(n)
        pos = cache.positions(n)
        mask = cache.attention_mask(pos)
        feature = feature.to(self.fc.weight)
        cos, sin = self.rotary(pos, feature.dtype)
        layer = self.layers[0]
        q, k, v = layer.qkv(self.embed(tokens), feature, cos, sin)
        k, v = cache.update(0, pos, k, v, mask.shape[-1])
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        cache.advance(n)
        return layer.finish(feature, attended)

    # -- training --------------------------------------------------------------------------------

    def ttt_features(self, tokens: Tensor, aux: Tensor, steps: int, chains: Tensor | None = None,
                     real: Tensor | None = None, queries: Tensor | None = None) -> list[Tensor]:
        """The layer's outputs (b, n - 1, H) of each training-time-test step on rows tokens (b, n + 1)
        with the target's aux hidden states aux (b, n, A*H) of tokens[:, :n] (see `ttt_logits`).

        chains (b, M): compute steps 1.. for these head positions only (`needed_chains`), `real`
        (b, M) marking those that are not padding (None: all); those steps' outputs are then
        (b, M, H), row m being chain chains[:, m], zeros at padding. queries (b, n - 1): the head
        positions whose step-0 output is needed (None: all; it must hold the real chains); every
        position's keys and values are computed, since later positions attend to them, and the
        other positions' step-0 output is zeros. The layer's products run on the positions computed
        only, packed into one row, so a step's arithmetic follows the answer tokens a batch holds,
        not its prompts or the longest row's."""
        check_positive_int(steps, "ttt steps")
        b, n = aux.shape[:2]
        T = n - 1                                    # head positions 0..T-1 (x_{t+1} and a label at t+1)
        check(T >= steps, f"rows of {n} positions are too short for {steps} training-time-test steps")
        feature, k0, v0 = self.teacher_forced(tokens, aux, queries)
        out = [feature]
        if steps == 1:
            return out
        padded = torch.cat([tokens, tokens.new_zeros(b, steps)], 1)
        layer = self.layers[0]
        cos, sin = self.rotary(T + steps, self.fc.weight.dtype)
        if chains is None:
            chains = torch.arange(T, device=feature.device).expand(b, T)
        if real is None:
            real = torch.ones_like(chains, dtype=torch.bool)
        at = chains[real]                                                                         # (N,)
        feature = feature.gather(1, chains[..., None].expand(-1, -1, feature.shape[-1]))[real][None]  # (1, N, H)
        ks: list[Tensor] = []
        vs: list[Tensor] = []
        for k in range(1, steps):
            fed = padded.gather(1, chains + 1 + k)[real][None]                                   # (1, N)
            q, kk, vv = layer.qkv(self.embed(fed), feature, cos[at + k], sin[at + k])
            ks.append(_unpack(kk, real))
            vs.append(_unpack(vv, real))
            attended = ttt_attention(_unpack(q, real), k0, v0, ks, vs, query_pos=chains)
            feature = layer.finish(feature, _pack(attended, real))
            out.append(_unpack_rows(feature, real))
        return out

    def teacher_forced(self, tokens: Tensor, aux: Tensor, queries: Tensor | None = None
                       ) -> tuple[Tensor, Tensor, Tensor]:
        """Step 0 of `ttt_features` (every head position t = 0..T-1, T = n - 1, reading x_{t+1} and
        the target's feature of t): (the layer's outputs (b, T, H), zeros where `queries` (b, T)
        is False; its keys and values (b, kv_heads, T, d), which every later query attends to)."""
        b, n = aux.shape[:2]
        T = n - 1
        feature = self.fuse(aux[:, :T])                                              # (b, T, H)
        layer = self.layers[0]
        attention = layer.self_attn
        cos, sin = self.rotary(T, self.fc.weight.dtype)
        x = layer.attention_input(self.embed(tokens[:, 1:1 + T]), feature)          # (b, T, 2H)
        k0, v0 = attention.keys_values(x, cos, sin)
        if queries is None:
            return layer.finish(feature, ttt_attention(attention.queries(x, cos, sin), k0, v0, [], [])), k0, v0
        at = torch.arange(T, device=x.device).expand(b, T)[queries]                              # (N,)
        q = attention.queries(x[queries][None], cos[at], sin[at])                                 # (1, heads, N, d)
        attended = _pack(ttt_attention(_unpack(q, queries), k0, v0, [], []), queries)
        return _unpack_rows(layer.finish(feature[queries][None], attended), queries), k0, v0

    def ttt_logits(self, tokens: Tensor, aux: Tensor, steps: int) -> list[Tensor]:
        """The draft logits of each training-time-test step on rows tokens (b, n + 1) with the
        target's aux hidden states aux (b, n, A*H) of tokens[:, :n]: step k's (b, n - 1 - k, draft)
        at head positions t = 0..n-2-k predict the target's distribution at position t + 1 + k,
        exactly what draft step k + 1 of a decoding round anchored at t computes."""
        T = aux.shape[1] - 1
        return [self.logits(f[:, :T - k]) for k, f in enumerate(self.ttt_features(tokens, aux, steps))]

    def ttt_loss(self, tokens: Tensor, aux: Tensor, last: Tensor, label_mask: Tensor | None = None, *,
                 steps: int = 4, decay: float = 0.8, tv_weight: float = 0.0, feature_weight: float = 0.0,
                 target_logits: Tensor | None = None, greedy_in_vocab: Tensor | None = None) -> TTTLoss:
        """The training-time-test loss (module docstring) on rows tokens (b, n + 1), with the
        target's aux hidden states aux (b, n, A*H) and its last-layer hidden states after the final
        norm last (b, n, H), both of tokens[:, :n]. label_mask (b, n): whether the target's
        prediction at position j (of token j + 1) counts. `target_logits` (b, n - 1, draft) may
        replace the head's own computation of the target's logits at positions 1..n-1.
        `greedy_in_vocab` (b, n - 1): whether the target's greedy token at positions 1..n-1 lies
        in the draft vocabulary (`greedy_in_vocab`); without it the hit counts compare argmaxes
        over the draft vocabulary only, which overstates them by the greedy tokens outside it.
        `tv_weight`: add that multiple of the total-variation distance TV(p, q) = 1 - sum_x min(p(x),
        q(x)) to each step's KL (p renormalised over the draft vocabulary, as for the KL): the
        probability that a T = 1 draft from q is rejected (module docstring).
        `feature_weight`: add that multiple of the smooth-L1 distance, averaged over the H
        channels, between the head's normed output norm(f) and the target's `last` at the label's
        position (module docstring: what the LM head reads there).

        Both LM heads (the head's and the target's rows) run at the counted positions only: in a
        regenerated row the prompt and the padding after EOS cost no logits (about half a row)."""
        b, n = aux.shape[:2]
        T = n - 1
        with torch.no_grad():
            if label_mask is None:
                label_mask = torch.ones(b, n, dtype=torch.bool, device=aux.device)
            mask = label_mask[:, 1:].to(aux.device)                                  # label position t + 1
            p, p_logp, label, row = self.label_targets(last, mask, target_logits, greedy_in_vocab)
            aim = last[:, 1:][mask.to(last.device)].to(aux.device).float() if feature_weight else None  # (M, H)
        losses, kls, hits, correct, counts = [], [], [], [], []
        # steps 1.. run only the chains with a counted label ahead (not the prompt's, not past EOS)
        chains, real = needed_chains(mask, steps)
        queries = mask | torch.zeros_like(mask).scatter_(1, chains, real)      # step 0's outputs that are read
        every = torch.arange(T, device=aux.device).expand(b, T)
        alive = mask
        for k, feature in enumerate(self.ttt_features(tokens, aux, steps, chains, real, queries)):
            at, ok = (every, torch.ones_like(mask)) if k == 0 else (chains, real)   # chain positions t
            label_at = (at + k).clamp(max=T - 1)                                      # label t + 1 + k
            sel = ok & (at + k < T) & mask.gather(1, label_at)
            rows = row.gather(1, label_at)[sel]
            normed = self.norm(feature[sel])                                          # (Mk, H)
            logq = torch.log_softmax(self.lm_head(normed).float(), -1)                # (Mk, draft)
            kl = p_logp[rows] - (p[rows] * logq).sum(-1)                             # (Mk,) KL(p || q)
            count = sel.sum().clamp_min(1)
            loss = kl
            if tv_weight:                                   # rejection probability of a T = 1 draft
                loss = loss + tv_weight * (1 - torch.minimum(p[rows], logq.exp()).sum(-1))
            if feature_weight:                              # the target's normed last layer at the label
                loss = loss + feature_weight * F.smooth_l1_loss(normed.float(), aim[rows], reduction="none").mean(-1)
            losses.append(loss.sum() / count * decay ** k)
            with torch.no_grad():
                right = torch.zeros_like(sel)
                right[sel] = logq.argmax(-1) == label[rows]
                alive = right if k == 0 else alive & right                            # every step so far right
                hits.append(alive.sum())
                if k == 0:                                                            # followed along the chains
                    alive = alive.gather(1, chains) & real
                kls.append(kl.sum() / count)
                correct.append(right.sum())
                counts.append(sel.sum())
        with torch.no_grad():        # the full head at up to 256 positions: validation only, not every step
            mass = self._draft_mass(last[:, 1:], mask) if greedy_in_vocab is not None else None
        return TTTLoss(torch.stack(losses).sum(), torch.stack(kls), torch.stack(hits), torch.stack(correct),
                       torch.stack(counts), mass)

    @torch.no_grad()
    def label_targets(self, last: Tensor, mask: Tensor, target_logits: Tensor | None = None,
                      greedy_in_vocab: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The target's side of the loss at the labels mask (b, T) marks (mask[b, t]: the target's
        distribution at position t + 1, from last (b, T + 1, H), the normed last layer; or from
        `target_logits` (b, T, draft) where given): (p (M, draft), the target's distribution
        renormalised over the draft vocabulary (module docstring); sum p log p (M,); the greedy
        label (M,) in draft ids, -1 where `greedy_in_vocab` (b, T) says the target's greedy token
        lies outside the draft vocabulary; row (b, T): each marked label's row of p, -1 elsewhere)."""
        b, T = mask.shape
        picked = (target_logits[mask.to(target_logits.device)] if target_logits is not None
                  else self.target_draft_logits(last[:, 1:][mask.to(last.device)]))          # (M, draft)
        p = torch.softmax(picked.float().to(mask.device), -1)
        p_logp = (p * torch.log(p.clamp_min(1e-30))).sum(-1)                         # (M,) -entropy, once
        label = picked.argmax(-1).to(mask.device)                                     # (M,) draft ids
        if greedy_in_vocab is not None:                    # a greedy token outside the vocabulary: no hit
            label = label.masked_fill(~greedy_in_vocab.to(mask.device)[mask], -1)
        row = torch.full((b, T), -1, dtype=torch.long, device=mask.device)          # (b, t) -> row of p
        row[mask] = torch.arange(int(mask.sum()), device=mask.device)
        return p, p_logp, label, row

    @torch.no_grad()
    def _draft_mass(self, last: Tensor, mask: Tensor) -> Tensor:
        """Mean probability the target puts inside the draft vocabulary at the masked positions
        (1 for a full vocabulary; else the full head is computed at up to 256 positions)."""
        if self.config.draft_vocab_size == self.config.target_vocab_size:
            return torch.ones((), device=last.device)
        picked = last[mask.to(last.device)][:256]
        if picked.numel() == 0:
            return torch.ones((), device=last.device)
        head = self.target.get_output_embeddings()
        full = F.linear(picked.to(head.weight), head.weight[: self.config.target_vocab_size]).float()
        probs = torch.softmax(full, -1)
        return probs[:, self.draft_ids.to(probs.device)].sum(-1).mean().to(self.device)

    def forward(self, tokens: Tensor, aux: Tensor, last: Tensor, label_mask: Tensor | None = None, **kw) -> TTTLoss:
        return self.ttt_loss(tokens, aux, last, label_mask, **kw)


def _final_norm_weight(target: Any) -> Tensor | None:
    """The weight of the target's final norm (the module applied before its LM head), if found."""
    base = getattr(target, "base_model", target)
    norm = next((getattr(base, name) for name in ("norm", "final_layernorm", "final_layer_norm", "ln_f")
                 if getattr(base, name, None) is not None), None)
    weight = getattr(norm, "weight", None)
    return weight if isinstance(weight, Tensor) else None


def _decoder_layer(target: Any, index: int) -> nn.Module:
    """The target's decoder layer `index` (`model.layers[index]` of a Hugging Face causal LM)."""
    base = getattr(target, "base_model", target)
    layers = getattr(base, "layers", None)
    check(isinstance(layers, nn.ModuleList) and 0 <= index < len(layers),
          f"the target has no decoder layer {index} to start the head's layer from")
    return layers[index]


def _submodule_weight(module: nn.Module, name: str) -> Tensor | None:
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, Tensor) else None


def target_hidden_states(target: Any, tokens: Tensor, layers: list[int], *, cache=None) -> Tensor:
    """The target's hidden states at `hidden_states` indices `layers`, concatenated (b, n, len(layers) * H),
    from one forward pass over tokens (b, n) without gradient."""
    with torch.no_grad():
        out = target(input_ids=tokens, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return torch.cat([out.hidden_states[i] for i in layers], -1)


__all__ = ["EAGLE3_WEIGHTS", "Eagle3Config", "Eagle3Head", "TTTLoss", "choose_draft_vocab", "coverage",
           "default_aux_layers", "eagle3_sizes", "needed_chains", "target_hidden_states", "ttt_attention", "vocab_maps"]
