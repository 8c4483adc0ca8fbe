"""lucidrains' speculative-decoding package, built at our sizes for side-by-side benchmarks.

Its prophet decoding is `speculative_decoding_with_prophet_model` over a `ModelWithProphetWrapper`
(speculative_decoding/speculative_decoding_with_prophet.py, version 0.2.0). Its `Decoder` builds
a feed-forward block in every layer but its forward never applies it, so the published model is
a stack of attention layers, cheaper per token than a transformer of the same sizes.
`build_lucidrains(..., patched_ff=True)` builds `PatchedDecoder`s instead: a subclass whose layers run
attention and then the feed-forward block (which starts with its own RMSNorm, so each layer is
the pre-norm block ours is), i.e. the model the sizes describe.

`copy_weights(theirs, ours)` copies a `ModelWithProphet`'s weights into lucidrains' model, so the
patched one computes our function (up to the RMSNorm epsilon) and accepts drafts as ours does;
the published one then differs from ours by the missing feed-forward alone. `copy_weights_to_ours`
goes the other way (a published model becomes ours with zero feed-forward outputs), so a trained
one is evaluated by our decoding code. Its decoding filters
with `top_k(thres)` (the top ceil((1 - thres) vocab) logits, thres 0.9 by default) and samples
with the global torch RNG: `lucidrains_prophet_decode` takes our `top_k` (None: the whole
vocabulary) and turns it into its threshold, and seeds the RNG.

The package is imported lazily (`pip install speculative-decoding==0.2.0`): `specdec_models`
never needs it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

from specdec_models.config import ModelConfig, ProphetConfig
from specdec_models.errors import SpecdecError
from specdec_models.heads.prophet import ModelWithProphet

PACKAGE = "speculative-decoding==0.2.0"


def _package():
    try:
        from speculative_decoding import speculative_decoding_with_prophet as package
    except ImportError:
        raise SpecdecError(f"lucidrains' speculative-decoding is not installed: pip install {PACKAGE} "
                           "(the `lucidrains` extra)") from None
    return package


class _AttentionThenFeedForward(nn.Module):
    """Wraps one of lucidrains' layers' attention so that the layer adds the feed-forward output too:
    its loop computes x + out, so returning out + ff(x + out) makes the layer
    h = x + attn(x); h + ff(h)."""

    def __init__(self, attn: nn.Module, ff: nn.Module) -> None:
        super().__init__()
        self.attn, self.ff = attn, ff

    def forward(self, x: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
        out, cached_kv = self.attn(x, **kwargs)
        return out + self.ff(x + out), cached_kv


def patched_decoder_class() -> type:
    """`PatchedDecoder`: lucidrains' Decoder with the feed-forward block applied in every layer."""
    package = _package()

    class PatchedDecoder(package.Decoder):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            for i, (attn, ff) in enumerate(self.layers):
                self.layers[i] = nn.ModuleList([_AttentionThenFeedForward(attn, ff), nn.Identity()])

    return PatchedDecoder


def _decoder(cfg: ModelConfig, patched_ff: bool) -> nn.Module:
    cls = patched_decoder_class() if patched_ff else _package().Decoder
    return cls(num_tokens=cfg.vocab_size, dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, dim_head=cfg.dim_head,
               ff_mult=cfg.ff_mult)


def build_lucidrains(main_cfg: ModelConfig, prophet_cfg: ProphetConfig, patched_ff: bool) -> nn.Module:
    """lucidrains' ModelWithProphetWrapper (main model + prophet) at the sizes of our configs,
    as published (`patched_ff=False`) or with the feed-forward blocks applied (`True`)."""
    return _package().ModelWithProphetWrapper(
        _decoder(main_cfg, patched_ff), _decoder(prophet_cfg.model, patched_ff),
        prophet_train_length=prophet_cfg.prophet_train_length,
        detach_model_embed_for_prophet=prophet_cfg.detach_embeds,
        num_leading_start_tokens=prophet_cfg.num_leading_start_tokens)


def _decoder_pairs(net: nn.Module, ours: nn.Module) -> tuple[list[tuple[Tensor, Tensor]], list[nn.Linear]]:
    """(lucidrains' tensor, our tensor) for every weight the two decoders share, and our
    feed-forward output projections whose lucidrains layer never applies its feed-forward (the
    published Decoder)."""
    pairs, unused_ff = [(net.token_emb.weight, ours.token_emb.weight)], []
    for (attn, ff), block in zip(net.layers, ours.layers, strict=True):
        applied = isinstance(attn, _AttentionThenFeedForward)
        if applied:
            attn, ff = attn.attn, attn.ff
        else:
            unused_ff.append(block.ff[2])
        pairs += [(attn.norm.weight, block.attn_norm.weight), (attn.to_qkv.weight, block.to_qkv.weight),
                  (attn.to_out.weight, block.to_out.weight), (ff[0].weight, block.ff_norm.weight)]
        for mine, theirs in ((ff[1], block.ff[0]), (ff[3], block.ff[2])):
            pairs += [(mine.weight, theirs.weight), (mine.bias, theirs.bias)]
    pairs += [(net.to_logits[0].weight, ours.norm.weight), (net.to_logits[1].weight, ours.to_logits.weight)]
    return pairs, unused_ff


def _pairs(net: nn.Module, ours: ModelWithProphet) -> tuple[list[tuple[Tensor, Tensor]], list[nn.Linear]]:
    main, main_unused = _decoder_pairs(net.model, ours.model)
    prophet, prophet_unused = _decoder_pairs(net.prophet, ours.prophet)
    start = ([(net.to_prophet_start_token.weight, ours.to_prophet_start.weight)]
             if isinstance(ours.to_prophet_start, nn.Linear) else [])
    return main + prophet + start, main_unused + prophet_unused


@torch.no_grad()
def copy_weights(net: nn.Module, ours: ModelWithProphet) -> nn.Module:
    """Copy our main model, prophet and start projection into lucidrains' `net` (built at the same
    sizes)."""
    for theirs, mine in _pairs(net, ours)[0]:
        theirs.copy_(mine)
    return net


@torch.no_grad()
def copy_weights_to_ours(ours: ModelWithProphet, net: nn.Module) -> ModelWithProphet:
    """The reverse of `copy_weights`: lucidrains' weights into `ours` (built at the same sizes), so
    our decoding and evaluation run its function (up to the RMSNorm epsilon). A published
    lucidrains layer never applies its feed-forward block: ours gets it with a zero output
    projection, which adds nothing to the residual stream, i.e. the same layer."""
    pairs, unused_ff = _pairs(net, ours)
    for theirs, mine in pairs:
        mine.copy_(theirs)
    for linear in unused_ff:
        linear.weight.zero_()
        linear.bias.zero_()
    return ours


def filter_thres(top_k: int | None, vocab_size: int) -> float:
    """lucidrains' `filter_thres` that keeps the top `top_k` logits (all of them for None): it keeps
    ceil((1 - thres) vocab)."""
    return 0.0 if top_k is None or top_k >= vocab_size else 1 - (top_k - 0.5) / vocab_size


@torch.no_grad()
def lucidrains_prophet_decode(net: nn.Module, prompt: Tensor, max_new_tokens: int, gamma: int,
                              temperature: float = 1.0, top_k: int | None = None,
                              seed: int = 0) -> tuple[Tensor, float, float]:
    """Run lucidrains' prophet decoding on `net`: (new tokens (b, max_new_tokens), wall seconds,
    its mean accepted drafts per round). Its sampling uses the global torch RNG, seeded here."""
    decode = _package().speculative_decoding_with_prophet_model
    thres = filter_thres(top_k, net.model.token_emb.num_embeddings)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out, accepted = decode(net, prompt, prompt.shape[1] + max_new_tokens, gamma=gamma, temperature=temperature,
                           filter_thres=thres)
    seconds = time.perf_counter() - t0
    return out, seconds, float(accepted)
