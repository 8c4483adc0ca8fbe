"""A preallocated key/value cache with one length per row.

Speculative decoding appends several tokens at once (the verify step) and then throws away the
rejected ones, and in a batch every row keeps a different number. So the cache stores each row
left-aligned in a fixed buffer (no concatenation per step) and keeps `lengths`, one per row:
appending writes row b at positions lengths[b], lengths[b] + 1, ...; rolling back just lowers
lengths[b]. Entries past a row's length are stale and never attended to: the attention mask
lets a query at position i see only keys at positions <= i of its own row.

Optionally the cache also keeps the last-layer embeddings of every cached position (what a
prophet reads as its start tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import check


class KVCache:
    """Keys and values of shape (depth, batch, heads, capacity, dim_head), plus per-row lengths."""

    def __init__(self, *, depth: int, batch: int, heads: int, dim_head: int, capacity: int,
                 embed_dim: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.capacity = capacity
        self.k = torch.zeros(depth, batch, heads, capacity, dim_head, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.embeds = (torch.zeros(batch, capacity, embed_dim, dtype=dtype, device=device)
                       if embed_dim is not None else None)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def positions(self, n: int) -> Tensor:
        """Positions (batch, n) that the next n appended tokens of each row will take."""
        pos = self.lengths[:, None] + torch.arange(n, device=self.lengths.device)
        return pos

    def check_room(self, n: int) -> None:
        check(int(self.lengths.max()) + n <= self.capacity,
              f"KV cache full: {int(self.lengths.max())} + {n} tokens exceed capacity {self.capacity}")

    def attention_mask(self, pos: Tensor) -> Tensor:
        """Boolean mask (batch, 1, n, kv_len) for queries at `pos` (batch, n): a query sees the keys
        of its own row at positions <= its own, so stale entries and other rows' padding never
        enter the softmax. kv_len = max(pos) + 1: the keys past it are never needed."""
        kv_len = int(pos[:, -1].max()) + 1
        key_pos = torch.arange(kv_len, device=pos.device)
        return (key_pos[None, None, :] <= pos[:, :, None])[:, None]

    def update(self, layer: int, pos: Tensor, k: Tensor, v: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Store k, v (batch, heads, n, dim_head) at `pos` (batch, n) and return this layer's keys
        and values (batch, heads, kv_len, dim_head) for attention."""
        b, h, n, d = k.shape
        index = pos[:, None, :, None].expand(b, h, n, d)
        self.k[layer].scatter_(2, index, k.to(self.k.dtype))
        self.v[layer].scatter_(2, index, v.to(self.v.dtype))
        return self.k[layer, :, :, :kv_len], self.v[layer, :, :, :kv_len]

    def update_embeds(self, pos: Tensor, embeds: Tensor) -> None:
        """Store last-layer embeddings (batch, n, dim) at `pos` when this cache keeps them."""
        if self.embeds is not None:
            b, n, d = embeds.shape
            self.embeds.scatter_(1, pos[:, :, None].expand(b, n, d), embeds.to(self.embeds.dtype))

    def advance(self, n: int) -> None:
        self.lengths += n

    def last_embeds(self, count: int) -> Tensor:
        """The cached embeddings of each row's last `count` positions: (batch, count, embed_dim)."""
        check(self.embeds is not None, "this cache does not keep embeddings")
        check(int(self.lengths.min()) >= count,
              f"every row needs at least {count} cached positions, shortest has {int(self.lengths.min())}")
        pos = self.lengths[:, None] - count + torch.arange(count, device=self.lengths.device)
        b, _, d = self.embeds.shape
        return self.embeds.gather(1, pos[:, :, None].expand(b, count, d))

    def compact_rows(self, dst: Tensor, src: Tensor, batch: int) -> None:
        """Copy rows `src` into rows `dst`, then keep the first `batch` rows (views, no copy): how
        decoding drops finished rows from a batch while copying only the rows that move."""
        if dst.numel():
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]
            self.lengths[dst] = self.lengths[src]
            if self.embeds is not None:
                self.embeds[dst] = self.embeds[src]
        self.k, self.v, self.lengths = self.k[:, :batch], self.v[:, :batch], self.lengths[:batch]
        if self.embeds is not None:
            self.embeds = self.embeds[:batch]

    def rollback(self, lengths: Tensor) -> None:
        """Forget everything past `lengths` (batch,) in each row; lengths may only shrink."""
        check(bool((lengths <= self.lengths).all()) and bool((lengths >= 0).all()),
              "rollback can only shorten rows")
        self.lengths = lengths.to(self.lengths.device, torch.long).clone()
