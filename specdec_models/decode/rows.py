"""`Rows`: the token state of a batch being decoded (`decode.speculative`): each row's prompt and
emitted tokens, its stop state, and the ids in its context for a repetition penalty."""

from __future__ import annotations

import torch
from torch import Tensor


class Rows:
    """Per-row token history, emitted tokens and stop state (all left-aligned buffers), for the
    rows still decoding: `compact` drops finished rows, `orig` maps each row to its prompt.
    With `vocab` (a repetition penalty), `seen` (b, vocab + 1) marks the ids in each row's context
    (prompt and emitted tokens), updated as tokens are emitted; column `vocab` takes the writes
    of padding and of slots past a row's emitted tokens."""

    def __init__(self, rows: list[Tensor], max_new: int, gamma: int, device: torch.device,
                 vocab: int | None = None) -> None:
        b = len(rows)
        self.lens = torch.tensor([r.numel() for r in rows], device=device)
        self.width = max(r.numel() for r in rows)              # the longest prompt
        width = self.width + max_new + gamma + 2
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
        self.orig = torch.arange(b, device=device)
        self.result: list[Tensor | None] = [None] * b
        self.vocab = vocab
        self.seen = None
        if vocab is not None:
            prompt = self.seq[:, : int(self.lens.max())]
            in_prompt = torch.arange(prompt.shape[1], device=device) < self.lens[:, None]
            self.seen = torch.zeros(b, vocab + 1, dtype=torch.bool, device=device)
            self.seen.scatter_(1, torch.where(in_prompt, prompt, vocab), True)

    @property
    def prompt(self) -> Tensor:
        """The right-padded prompts (b, longest prompt): a view of `seq` (each row's padding lies
        past its own length, where no query of that row looks)."""
        return self.seq[:, : self.width]

    def context(self) -> Tensor | None:
        """The ids in each row's context so far (b, vocab), for the repetition penalty."""
        return None if self.seen is None else self.seen[:, : self.vocab]

    @property
    def batch(self) -> int:
        return self.seq.shape[0]

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
        if self.seen is not None:
            self.seen.scatter_(1, torch.where(j < n[:, None], block, self.vocab), True)
        self.produced += n
        self.seq_len += n
        self.done |= hit_eos | (self.produced >= self.max_new)
        return n

    def _save(self, rows: list[int]) -> None:
        for i, orig, produced in zip(rows, self.orig[rows].tolist(), self.produced[rows].tolist(), strict=True):
            self.result[orig] = self.out[i, :produced].clone()

    def compact(self) -> tuple[Tensor, Tensor, int]:
        """Drop the finished rows: keep their tokens aside and move the unfinished rows from the
        end into their slots (only those rows are copied); return (dst, src, batch) so that the
        caches do the same."""
        done = self.done
        batch = int((~done).sum())
        self._save(done.nonzero()[:, 0].tolist())
        dst = done[:batch].nonzero()[:, 0]
        src = (~done[batch:]).nonzero()[:, 0] + batch
        for name in ("lens", "seq", "seq_len", "out", "produced", "done", "orig") + (("seen",) if self.vocab else ()):
            t = getattr(self, name)
            t[dst] = t[src]
            setattr(self, name, t[:batch])
        self.arange_b = self.arange_b[:batch]
        return dst, src, batch

    def tokens(self) -> list[Tensor]:
        """The new tokens of every prompt row, in the prompts' order."""
        self._save(list(range(self.batch)))
        return list(self.result)
