"""A prophet head for a frozen Hugging Face target: drafts from the target's last-layer hidden states.

The layout and the loss are the prophet's (`heads.prophet.ProphetHead`): for an
anchor t the head reads the target's hidden states h[t-S+1..t], projected to its width, as S
leading start tokens, then the tokens x[t+1], x[t+2], ...; it predicts x[t+1 .. t+L]. In decoding
it drafts from the hidden states the target's cache keeps (`HFDecoder.new_cache(keep_embeds=True)`)
through `generate(target, prompt, n, HeadDrafter(head))`, batched, ragged and lossless.

Which hidden states: the last layer's, after the final norm (transformers' `hidden_states[-1]`,
the input of the target's head). Three reasons: every causal LM in transformers exposes exactly
this tensor (no hooks into an architecture's internals); it is what the head maps linearly to
the target's next-token logits, so the start tokens carry the target's prediction; and it is
RMS-normalised, while the residual stream before the norm carries a few dimensions of very large
magnitude in trained LMs (Sun et al. 2024, "Massive activations in large language models") that
a small projection would first have to tame. (The native `Decoder`'s prophet reads the stream
before its final norm; there main model and prophet train together, so either works.)

Shared, frozen weights, as EAGLE does (Li et al. 2024): the head embeds its tokens with the
target's input embedding and computes logits with the target's output head (sliced to the
shared vocabulary), both held by reference, never registered as submodules, used without
gradient. A head for a 49k-token target thus stays small: its own parameters, the prophet blocks,
the final norm, the start projection and (when its width differs from the target's) an input and
an output projection, are all that `state_dict()` holds and an `hf_prophet` export writes; the
shared weights come from the target given at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import JsonConfig, ModelConfig, ProphetConfig
from ..errors import check, check_positive_int
from ..hf.adapter import HFDecoder, is_hf_model, logits_width, text_config
from ..model import Block, Decoder, RMSNorm, Rotary
from .prophet import ProphetHead


@dataclass(frozen=True)
class HFProphetConfig(JsonConfig):
    """A prophet head for a Hugging Face target: `prophet` is the prophet's ProphetConfig (its
    model.vocab_size is the vocabulary shared with the target, its other fields as for a native
    prophet; `detach_embeds` and `prophet_loss_weight` play no role, the target being frozen),
    `target_dim` the target's hidden size."""

    what = "hf prophet config"

    prophet: ProphetConfig
    target_dim: int

    def __post_init__(self) -> None:
        if isinstance(self.prophet, dict):
            object.__setattr__(self, "prophet", ProphetConfig.from_dict(self.prophet))
        check(isinstance(self.prophet, ProphetConfig), "hf prophet: prophet must be a ProphetConfig")
        check_positive_int(self.target_dim, "hf prophet target_dim")

    @classmethod
    def for_target(cls, target: Any, *, dim: int | None = None, depth: int = 1, heads: int | None = None,
                   dim_head: int = 64, ff_mult: int = 4, prophet_train_length: int = 7,
                   num_leading_start_tokens: int = 2, windows_per_seq: int | None = None,
                   vocab_size: int | None = None) -> HFProphetConfig:
        """A config sized for the HF causal LM `target`: width `dim` (default the target's hidden
        size, so no projections), heads = dim // dim_head by default, the target's vocabulary
        (or `vocab_size`, for a sliced head)."""
        check(is_hf_model(target), f"target must be a Hugging Face causal LM, got {type(target).__name__}")
        target_dim = int(text_config(target.config).hidden_size)
        dim = target_dim if dim is None else dim
        heads = max(1, dim // dim_head) if heads is None else heads
        model = ModelConfig(vocab_size=logits_width(target) if vocab_size is None else vocab_size, dim=dim,
                            depth=depth, heads=heads, dim_head=dim_head, ff_mult=ff_mult,
                            max_seq_len=max(64, num_leading_start_tokens + prophet_train_length + 16))
        prophet = ProphetConfig(model=model, prophet_train_length=prophet_train_length,
                                num_leading_start_tokens=num_leading_start_tokens, windows_per_seq=windows_per_seq)
        return cls(prophet=prophet, target_dim=target_dim)


class _Shared(nn.Module):
    """Holds one of the target's modules (frozen, not registered: out of parameters(), state_dict()
    and `.to()`) next to the head's own projection. `weight` is an empty tensor that follows the
    head's dtype and device: what `Decoder` reads them from (its inputs' dtype, its cache's)."""

    def __init__(self, module: nn.Module, proj: nn.Module) -> None:
        super().__init__()
        self._target = (module,)          # a tuple keeps it out of nn.Module's registry
        self.proj = proj
        self.register_buffer("weight", torch.empty(0), persistent=False)


class _SharedEmbedding(_Shared):
    """The target's token embedding, then a projection to the prophet's width."""

    def __init__(self, embedding: nn.Module, target_dim: int, dim: int) -> None:
        super().__init__(embedding, nn.Identity() if dim == target_dim else nn.Linear(target_dim, dim, bias=False))

    def forward(self, tokens: Tensor) -> Tensor:
        with torch.no_grad():
            x = self._target[0](tokens.to(self._target[0].weight.device))
        return self.proj(x.to(self.weight))


class _SharedHead(_Shared):
    """A projection to the target's width, then the target's head sliced to its first vocab_size rows."""

    def __init__(self, head: nn.Linear, target_dim: int, dim: int, vocab_size: int) -> None:
        super().__init__(head, nn.Identity() if dim == target_dim else nn.Linear(dim, target_dim, bias=False))
        self.vocab_size = vocab_size

    def forward(self, x: Tensor) -> Tensor:
        head = self._target[0]
        w = head.weight[: self.vocab_size].detach()
        bias = None if head.bias is None else head.bias[: self.vocab_size].detach()
        return F.linear(self.proj(x).to(w), w, bias).to(self.weight.dtype)


class SharedVocabDecoder(Decoder):
    """A `Decoder` whose token embedding and logits head are a Hugging Face target's: the prophet
    blocks, rotary embeddings, final norm and the cached forward are `Decoder`'s own, so the
    windows of `ProphetHead` and the drafting code of `generate` run through it unchanged."""

    def __init__(self, cfg: ModelConfig, target: Any, target_dim: int) -> None:
        nn.Module.__init__(self)        # Decoder.__init__ would allocate a vocabulary-sized embedding and head
        head = target.get_output_embeddings()
        check(isinstance(head, nn.Linear), f"{type(target).__name__}'s output head is a {type(head).__name__}, "
                                           "not a linear layer: a prophet head cannot share it")
        check(cfg.vocab_size <= head.weight.shape[0],
              f"prophet vocabulary {cfg.vocab_size} exceeds the target head's {head.weight.shape[0]} rows")
        self.cfg = cfg
        self.token_emb = _SharedEmbedding(target.get_input_embeddings(), target_dim, cfg.dim)
        self.rotary = Rotary(cfg.dim_head, cfg.max_seq_len)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = RMSNorm(cfg.dim)
        self.to_logits = _SharedHead(head, target_dim, cfg.dim, cfg.vocab_size)
        self.reset_parameters()          # Decoder's: touches registered parameters only


class HFProphet(ProphetHead):
    """A prophet head for the Hugging Face causal LM `target` (frozen, shared; see the module docstring).

    head = HFProphet(HFProphetConfig.for_target(model, depth=1), model)
    hidden, _ = head.target_hidden(seq[:, :-1])                  # the target's, no gradient
    loss = head.loss(seq, hidden)                                 # prophet loss over the windows
    tokens, stats = generate(model, prompt, 64, HeadDrafter(head))  # drafting from the target's cache

    The head lives on the target's device and takes its dtype; the target is not one of its
    submodules, so moving the head (`.to(...)`, Lightning) leaves the target where it is: move the
    target yourself. Training: keep the target frozen and in eval mode; `head.float()` trains fp32
    weights next to a bf16 target.
    """

    def __init__(self, config: HFProphetConfig, target: Any) -> None:
        super().__init__()
        check(isinstance(config, HFProphetConfig), f"config must be an HFProphetConfig, got {type(config).__name__}")
        check(is_hf_model(target), f"target must be a Hugging Face causal LM, got {type(target).__name__}")
        hidden = int(text_config(target.config).hidden_size)
        check(hidden == config.target_dim,
              f"the head was made for a target of hidden size {config.target_dim}, "
              f"{type(target).__name__} has {hidden}")
        self.config = config
        self.prophet_cfg = config.prophet
        self._target = (target,)
        dim = config.prophet.model.dim
        self.to_prophet_start = nn.Linear(config.target_dim, dim, bias=False)
        nn.init.normal_(self.to_prophet_start.weight, std=config.target_dim ** -0.5)
        self.prophet = SharedVocabDecoder(config.prophet.model, target, config.target_dim)
        weight = target.get_output_embeddings().weight
        # the target's device and dtype to decode; `.float()` gives fp32 weights to train (the
        # shared modules stay the target's: inputs and outputs are cast at the boundaries)
        self.to(device=weight.device, dtype=weight.dtype)

    @property
    def target(self) -> Any:
        """The Hugging Face model whose embeddings, head and hidden states the head uses."""
        return self._target[0]

    @property
    def vocab_size(self) -> int:
        return self.prophet_cfg.model.vocab_size

    def start_tokens(self, embeds: Tensor) -> Tensor:
        """Project the target's hidden states (..., target_dim) to start tokens (..., dim)."""
        return self.to_prophet_start(embeds.to(self.to_prophet_start.weight))

    @property
    def device(self) -> torch.device:
        return self.to_prophet_start.weight.device

    def target_hidden(self, tokens: Tensor, logits: bool = True) -> tuple[Tensor, Tensor | None]:
        """The frozen target's last-layer hidden states (b, n, target_dim), after its final norm,
        and its logits (b, n, vocab) on tokens (b, n), causal from position 0, without gradient:
        the inputs of `loss` and of a distillation toward the target. logits=False skips the
        target's head (its cost per position is that of several layers) and returns None."""
        decoder = HFDecoder(self.target, vocab_size=self.vocab_size)
        at = None if logits else torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
        out = decoder(tokens, embeds=True, logits_at=at)
        assert out.embeds is not None
        return out.embeds, out.logits if logits else None

    @torch.no_grad()
    def target_logits(self, hidden: Tensor) -> Tensor:
        """The target's logits (..., vocab) from its hidden states (..., target_dim): its head
        applied to them (exactly its logits, as `target_hidden` returns post-norm states, for the
        targets whose logits are their head's output: no soft-capping or scaling after it)."""
        head = self.target.get_output_embeddings()
        return head(hidden.to(head.weight))[..., : self.vocab_size].float()

    def loss(self, seq: Tensor, hidden: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        """The prophet loss on token sequences seq (b, n + 1) over its anchors (all, or
        `windows_per_seq` random ones), given the target's hidden states (b, n, target_dim) of
        seq[:, :n] (computed when None)."""
        if hidden is None:
            hidden, _ = self.target_hidden(seq[:, :-1])
        anchors = self.anchors(seq.shape[1] - 1, seq.shape[0], generator, seq.device)
        return self.prophet_loss(seq, hidden, anchors)

    def forward(self, seq: Tensor, hidden: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        return self.loss(seq, hidden, generator)
