"""`DraftHead`: the base class of every head that drafts from a target's hidden states.

Two families share it: the prophet's (`prophet.ProphetHead`: `ModelWithProphet` for specdec's
own decoders, `hf_prophet.HFProphet` for Hugging Face targets) and EAGLE-3's (`eagle3.Eagle3Head`,
Hugging Face targets). `generate(target, prompt, n, HeadDrafter(head))`, the evaluation callback and
`cost.measure_costs` take any of them; each family drafts its own way (see
`decode.speculative`), and `max_gamma` says how far a head may draft in one round.
`TargetVocabHead` is what the heads over a Hugging Face target and a draft vocabulary (EAGLE-3,
DFlash, P-EAGLE) share: the target, the vocabulary maps, the embedding and LM-head reads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DraftHead(nn.Module):
    """A draft head reading its target's hidden states (see the module docstring)."""

    @property
    def max_gamma(self) -> int:
        """The most tokens one decoding round may draft with this head."""
        raise NotImplementedError


class TargetVocabHead(DraftHead):
    """A draft head over a frozen Hugging Face target and a draft vocabulary (EAGLE-3's, DFlash's,
    P-EAGLE's): what they share about the target and the vocabulary maps. A subclass holds
    `config` (`target_vocab_size`, `draft_vocab_size`, `aux_layers`), `_target` (a one-item list:
    the target, not a submodule), the buffers `d2t` (draft id -> target id offset) and `t2d`
    (target id -> in the draft vocabulary), and the modules `fc`, `norm` and `lm_head`."""

    @property
    def target(self) -> Any:
        return self._target[0]

    @property
    def draft_ids(self) -> Tensor:
        """The target ids of the draft vocabulary (draft_vocab_size,), ascending."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    @property
    def vocab_size(self) -> int:
        """The target vocabulary the head drafts in (the `vocab_size` of its HFDecoder target)."""
        return self.config.target_vocab_size

    @property
    def aux_layers(self) -> list[int]:
        return self.config.aux_layers

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def embed(self, tokens: Tensor) -> Tensor:
        """The target's (frozen) token embeddings of tokens (..., n), in the head's dtype."""
        emb = self.target.get_input_embeddings()
        with torch.no_grad():
            x = emb(tokens.to(emb.weight.device))
        return x.to(device=self.device, dtype=self.fc.weight.dtype)

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary logits (..., draft_vocab_size) of the last layer's outputs."""
        return self.lm_head(self.norm(hidden))

    def target_ids(self, draft_tokens: Tensor) -> Tensor:
        """The target ids (...) of draft-vocabulary tokens (...)."""
        return draft_tokens + self.d2t.to(draft_tokens.device)[draft_tokens]

    def to_target_vocab(self, logits: Tensor) -> Tensor:
        """Draft logits (..., draft) spread over the target vocabulary (..., target vocab), -inf
        outside the draft vocabulary: what sampling and the verify step read."""
        if self.config.draft_vocab_size == self.config.target_vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.target_vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_ids.to(logits.device), logits)

    @torch.no_grad()
    def target_draft_logits(self, last: Tensor) -> Tensor:
        """The target's logits over the draft vocabulary (..., draft) from its last-layer hidden
        states after the final norm (..., H): its LM head's rows of the draft ids."""
        head = self.target.get_output_embeddings()
        w = head.weight[self.draft_ids.to(head.weight.device)]
        return F.linear(last.to(w), w).to(self.device).float()

    @torch.no_grad()
    def greedy_in_vocab(self, last: Tensor) -> Tensor:
        """Whether the target's greedy token (its full head's argmax) at each of last (..., H)
        lies in the draft vocabulary (...,): the full head, so for validation rather than every step."""
        head = self.target.get_output_embeddings()
        greedy = F.linear(last.to(head.weight), head.weight[: self.config.target_vocab_size]).argmax(-1)
        return self.t2d.to(greedy.device)[greedy].to(self.device)
