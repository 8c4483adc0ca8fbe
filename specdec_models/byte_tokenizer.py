"""The "bytes" tokenizer of specdec's own models: token id = byte value of the UTF-8 text.

The one place text becomes byte tokens and back: the decoding CLI, the evaluation callback's
samples and the scripts all go through `encode` and `decode`. Exports record it as
`{"kind": "bytes"}`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import check

KIND = "bytes"
VOCAB_SIZE = 256


def encode(text: str | bytes, vocab_size: int = VOCAB_SIZE, max_len: int | None = None) -> Tensor:
    """Text (UTF-8; lone surrogates from the command line pass through) or raw bytes -> token ids
    (n,), checked against a model's vocabulary and context length."""
    data = text if isinstance(text, bytes) else text.encode("utf-8", errors="surrogateescape")
    outside = sorted({b for b in data if b >= vocab_size})
    check(not outside, f"the prompt holds byte(s) {', '.join(f'0x{b:02x}' for b in outside[:5])} outside the "
                       f"model's vocabulary of {vocab_size} tokens (token id = UTF-8 byte value): use ASCII "
                       f"below {vocab_size}")
    check(max_len is None or len(data) <= max_len,
          f"the prompt is {len(data)} bytes, more than the model's max_seq_len {max_len}: shorten it")
    return torch.tensor(list(data), dtype=torch.long)


def decode(tokens: Tensor) -> str:
    """Byte token ids (n,) -> text: UTF-8, undecodable bytes replaced."""
    return bytes(int(t) for t in tokens.tolist()).decode("utf-8", errors="replace")
