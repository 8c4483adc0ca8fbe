"""`DraftHead`: the base class of every head that drafts from a target's hidden states.

Two families share it: the prophet's (`prophet.ProphetHead`: `ModelWithProphet` for specdec's
own decoders, `hf_prophet.HFProphet` for Hugging Face targets) and EAGLE-3's (`eagle3.Eagle3Head`,
Hugging Face targets). `generate(target, prompt, n, HeadDrafter(head))`, the evaluation callback and
`cost.measure_costs` take any of them; each family drafts its own way (see
`decode.speculative`), and `max_gamma` says how far a head may draft in one round.
"""

from __future__ import annotations

from torch import nn


class DraftHead(nn.Module):
    """A draft head reading its target's hidden states (see the module docstring)."""

    @property
    def max_gamma(self) -> int:
        """The most tokens one decoding round may draft with this head."""
        raise NotImplementedError
