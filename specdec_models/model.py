"""The decoder: a pre-norm transformer language model with rotary embeddings and a KV cache.

Architecture of the reference prophet implementation (RMSNorm before attention and feed-forward,
rotary position embeddings, causal self-attention, GELU feed-forward, final norm, bias-free
logits head), with the feed-forward block applied in every layer and attention computed by
`F.scaled_dot_product_attention` (causal flag when training, an explicit per-row mask with a
cache). `start` embeddings can lead the token embeddings: that is how a prophet reads the main
model's last-layer embeddings.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .config import ModelConfig
from .errors import check
from .kv_cache import KVCache


class DecoderOutput(NamedTuple):
    logits: Tensor        # (b, n, vocab)
    embeds: Tensor        # (b, n, dim): last-layer embeddings, before the final norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """cos/sin tables computed once up to max_seq_len (regrown only if decoding goes past it)."""

    def __init__(self, dim_head: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim_head, 2, dtype=torch.float32) / dim_head))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._build(max_seq_len)

    def _build(self, length: int) -> None:
        t = torch.arange(length, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)                      # (n, dim_head)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, pos: Tensor | int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin for positions `pos`: an int n (positions 0..n-1, shape (n, d)) or (b, n) -> (b, 1, n, d)."""
        needed = pos if isinstance(pos, int) else int(pos.max()) + 1
        if needed > self.cos.shape[0]:
            self._build(max(needed, 2 * self.cos.shape[0]))
        if isinstance(pos, int):
            return self.cos[:pos].to(dtype), self.sin[:pos].to(dtype)
        return self.cos[pos][:, None].to(dtype), self.sin[pos][:, None].to(dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm = RMSNorm(cfg.dim)
        self.to_qkv = nn.Linear(cfg.dim, 3 * cfg.inner_dim, bias=False)
        self.to_out = nn.Linear(cfg.inner_dim, cfg.dim, bias=False)
        self.ff_norm = RMSNorm(cfg.dim)
        self.ff = nn.Sequential(nn.Linear(cfg.dim, cfg.dim * cfg.ff_mult), nn.GELU(),
                                nn.Linear(cfg.dim * cfg.ff_mult, cfg.dim))

    def qkv(self, x: Tensor) -> Tensor:
        """Queries, keys and values (b, n, 3 * heads * dim_head) before rotary embedding. Depends
        on each position alone, so the prophet's training computes it once per position."""
        return self.to_qkv(self.attn_norm(x))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, *, qkv: Tensor | None = None,
                cache: KVCache | None = None, layer: int = 0, pos: Tensor | None = None,
                mask: Tensor | None = None, queries_from: int = 0) -> Tensor:
        """x (b, n, dim) -> (b, n - queries_from, dim). `queries_from` > 0 computes the outputs of
        the last positions only (their keys and values still come from all n positions)."""
        # b: batch, n: new positions, h: heads, d: dim_head
        qkv = self.qkv(x) if qkv is None else qkv
        q, k, v = rearrange(qkv, "b n (qkv h d) -> qkv b h n d", qkv=3, h=self.heads)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(layer, pos, k, v, mask.shape[-1])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif queries_from:
            n = x.shape[1]
            x, q = x[:, queries_from:], q[:, :, queries_from:]
            causal = torch.ones(n - queries_from, n, dtype=torch.bool, device=x.device).tril(queries_from)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.to_out(rearrange(out, "b h n d -> b n (h d)"))
        return x + self.ff(self.ff_norm(x))


def _column_major_where_faster(module: nn.Module) -> None:
    """Store the weights of widening projections (in <= out) column-major.

    Batch-1 decoding is memory-bound matrix-vector work. On CPU, `F.linear` streams a (out, in)
    weight about twice as fast when it is laid out column-major if in <= out, and row-major when
    in > out (docs/cpu.md). Shapes, state dicts and exports are unchanged: only the strides differ,
    and `load_state_dict` copies into them."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.in_features <= m.out_features and m.weight.is_contiguous():
            m.weight = nn.Parameter(m.weight.detach().t().contiguous().t(), requires_grad=m.weight.requires_grad)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rotary = Rotary(cfg.dim_head, cfg.max_seq_len)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = RMSNorm(cfg.dim)
        self.to_logits = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @property
    def dim(self) -> int:
        return self.cfg.dim

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def device(self) -> torch.device:
        return self.to_logits.weight.device

    def reset_parameters(self) -> None:
        # GPT-2 style: N(0, 0.02), residual projections scaled down by depth.
        for name, p in self.named_parameters():
            if p.ndim < 2:
                continue
            std = 0.02 / math.sqrt(2 * self.cfg.depth) if name.endswith(("to_out.weight", "ff.2.weight")) else 0.02
            nn.init.normal_(p, std=std)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        _column_major_where_faster(self)

    def new_cache(self, batch: int, capacity: int, *, keep_embeds: bool = False) -> KVCache:
        p = self.to_logits.weight
        return KVCache(depth=self.cfg.depth, batch=batch, heads=self.cfg.heads, dim_head=self.cfg.dim_head,
                       capacity=capacity, embed_dim=self.cfg.dim if keep_embeds else None,
                       dtype=p.dtype, device=p.device)

    def hidden(self, tokens: Tensor | None, *, start: Tensor | None = None,
               cache: KVCache | None = None) -> Tensor:
        """Last-layer embeddings (b, n, dim) of `start` (b, s, dim) followed by `tokens` (b, t).

        Without a cache the sequence is causal from position 0. With a cache the new positions are
        appended after each row's cached ones (and the cache advances by n)."""
        parts = []
        if start is not None:
            parts.append(start.to(self.token_emb.weight.dtype))
        if tokens is not None:
            parts.append(self.token_emb(tokens))
        check(bool(parts), "Decoder.hidden needs tokens or start embeddings")
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)      # (b, n, dim)
        n = x.shape[1]
        if cache is None:
            cos, sin = self.rotary(n, x.dtype)
            for block in self.layers:
                x = block(x, cos, sin)
            return x
        cache.check_room(n)
        pos = cache.positions(n)                                            # (b, n)
        mask = cache.attention_mask(pos)                                    # (b, 1, n, kv_len)
        cos, sin = self.rotary(pos, x.dtype)
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, cache=cache, layer=i, pos=pos, mask=mask)
        cache.update_embeds(pos, x)
        cache.advance(n)
        return x

    def logits(self, embeds: Tensor) -> Tensor:
        return self.to_logits(self.norm(embeds))

    def forward(self, tokens: Tensor | None, *, start: Tensor | None = None,
                cache: KVCache | None = None) -> DecoderOutput:
        embeds = self.hidden(tokens, start=start, cache=cache)
        return DecoderOutput(self.logits(embeds), embeds)
