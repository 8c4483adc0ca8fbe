"""The peer: lucidrains' speculative-decoding package, built at our sizes for side-by-side benchmarks.

Its prophet decoding is `speculative_decoding_with_prophet_model` over a `ModelWithProphetWrapper`
(speculative_decoding/speculative_decoding_with_prophet.py, version 0.2.0). Its `Decoder` builds
a feed-forward block in every layer but its forward never applies it, so the published model is
a stack of attention layers, cheaper per token than a transformer of the same sizes.
`build_peer(..., patched_ff=True)` builds `PatchedDecoder`s instead: a subclass whose layers run
attention and then the feed-forward block (which starts with its own RMSNorm, so each layer is
the pre-norm block ours is), i.e. the model the sizes describe.

`copy_weights(peer, ours)` copies a `ModelWithProphet`'s weights into the peer, so the patched
peer computes our function (up to the RMSNorm epsilon) and accepts drafts as ours does; the
published peer then differs from ours by the missing feed-forward alone. `copy_weights_to_ours`
goes the other way (a published peer becomes ours with zero feed-forward outputs), so a trained
peer is evaluated by our decoding code. Its decoding filters
with `top_k(thres)` (the top ceil((1 - thres) vocab) logits, thres 0.9 by default) and samples
with the global torch RNG: `peer_prophet_decode` takes our `top_k` (None: the whole vocabulary)
and turns it into the peer's threshold, and seeds the RNG.

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

PEER_PACKAGE = "speculative-decoding==0.2.0"


def _peer_module():
    try:
        from speculative_decoding import speculative_decoding_with_prophet as peer
    except ImportError:
        raise SpecdecError(f"the peer is not installed: pip install {PEER_PACKAGE} "
                           "(lucidrains' speculative-decoding)") from None
    return peer


class _AttentionThenFeedForward(nn.Module):
    """Wraps one peer layer's attention so that the layer adds the feed-forward output too:
    the peer's loop computes x + out, so returning out + ff(x + out) makes the layer
    h = x + attn(x); h + ff(h)."""

    def __init__(self, attn: nn.Module, ff: nn.Module) -> None:
        super().__init__()
        self.attn, self.ff = attn, ff

    def forward(self, x: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
        out, cached_kv = self.attn(x, **kwargs)
        return out + self.ff(x + out), cached_kv


def patched_decoder_class() -> type:
    """`PatchedDecoder`: the peer's Decoder with the feed-forward block applied in every layer."""
    peer = _peer_module()

    class PatchedDecoder(peer.Decoder):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            for i, (attn, ff) in enumerate(self.layers):
                self.layers[i] = nn.ModuleList([_AttentionThenFeedForward(attn, ff), nn.Identity()])

    return PatchedDecoder


def _peer_decoder(cfg: ModelConfig, patched_ff: bool) -> nn.Module:
    cls = patched_decoder_class() if patched_ff else _peer_module().Decoder
    return cls(num_tokens=cfg.vocab_size, dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, dim_head=cfg.dim_head,
               ff_mult=cfg.ff_mult)


def build_peer(main_cfg: ModelConfig, prophet_cfg: ProphetConfig, patched_ff: bool) -> nn.Module:
    """The peer's ModelWithProphetWrapper (main model + prophet) at the sizes of our configs,
    as published (`patched_ff=False`) or with the feed-forward blocks applied (`True`)."""
    peer = _peer_module()
    return peer.ModelWithProphetWrapper(
        _peer_decoder(main_cfg, patched_ff), _peer_decoder(prophet_cfg.model, patched_ff),
        prophet_train_length=prophet_cfg.prophet_train_length,
        detach_model_embed_for_prophet=prophet_cfg.detach_embeds,
        num_leading_start_tokens=prophet_cfg.num_leading_start_tokens)


def _decoder_pairs(peer: nn.Module, ours: nn.Module) -> tuple[list[tuple[Tensor, Tensor]], list[nn.Linear]]:
    """(peer tensor, our tensor) for every weight the two decoders share, and our feed-forward
    output projections whose peer layer never applies its feed-forward (the published Decoder)."""
    pairs, unused_ff = [(peer.token_emb.weight, ours.token_emb.weight)], []
    for (attn, ff), block in zip(peer.layers, ours.layers):
        applied = isinstance(attn, _AttentionThenFeedForward)
        if applied:
            attn, ff = attn.attn, attn.ff
        else:
            unused_ff.append(block.ff[2])
        pairs += [(attn.norm.weight, block.attn_norm.weight), (attn.to_qkv.weight, block.to_qkv.weight),
                  (attn.to_out.weight, block.to_out.weight), (ff[0].weight, block.ff_norm.weight)]
        for mine, theirs in ((ff[1], block.ff[0]), (ff[3], block.ff[2])):
            pairs += [(mine.weight, theirs.weight), (mine.bias, theirs.bias)]
    pairs += [(peer.to_logits[0].weight, ours.norm.weight), (peer.to_logits[1].weight, ours.to_logits.weight)]
    return pairs, unused_ff


def _pairs(peer: nn.Module, ours: ModelWithProphet) -> tuple[list[tuple[Tensor, Tensor]], list[nn.Linear]]:
    main, main_unused = _decoder_pairs(peer.model, ours.model)
    prophet, prophet_unused = _decoder_pairs(peer.prophet, ours.prophet)
    start = ([(peer.to_prophet_start_token.weight, ours.to_prophet_start.weight)]
             if isinstance(ours.to_prophet_start, nn.Linear) else [])
    return main + prophet + start, main_unused + prophet_unused


@torch.no_grad()
def copy_weights(peer: nn.Module, ours: ModelWithProphet) -> nn.Module:
    """Copy our main model, prophet and start projection into the peer (built at the same sizes)."""
    for theirs, mine in _pairs(peer, ours)[0]:
        theirs.copy_(mine)
    return peer


@torch.no_grad()
def copy_weights_to_ours(ours: ModelWithProphet, peer: nn.Module) -> ModelWithProphet:
    """The reverse of `copy_weights`: the peer's weights into `ours` (built at the same sizes), so
    our decoding and evaluation run the peer's function (up to the RMSNorm epsilon). A published
    peer layer never applies its feed-forward block: ours gets it with a zero output projection,
    which adds nothing to the residual stream, i.e. the same layer."""
    pairs, unused_ff = _pairs(peer, ours)
    for theirs, mine in pairs:
        mine.copy_(theirs)
    for linear in unused_ff:
        linear.weight.zero_()
        linear.bias.zero_()
    return ours


def filter_thres(top_k: int | None, vocab_size: int) -> float:
    """The peer's `filter_thres` that keeps the top `top_k` logits (all of them for None): it keeps
    ceil((1 - thres) vocab)."""
    return 0.0 if top_k is None or top_k >= vocab_size else 1 - (top_k - 0.5) / vocab_size


@torch.no_grad()
def peer_prophet_decode(peer: nn.Module, prompt: Tensor, max_new_tokens: int, gamma: int,
                        temperature: float = 1.0, top_k: int | None = None,
                        seed: int = 0) -> tuple[Tensor, float, float]:
    """Run the peer's prophet decoding: (new tokens (b, max_new_tokens), wall seconds, its mean
    accepted drafts per round). Its sampling uses the global torch RNG, seeded here."""
    decode = _peer_module().speculative_decoding_with_prophet_model
    thres = filter_thres(top_k, peer.model.token_emb.num_embeddings)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out, accepted = decode(peer, prompt, prompt.shape[1] + max_new_tokens, gamma=gamma, temperature=temperature,
                           filter_thres=thres)
    seconds = time.perf_counter() - t0
    return out, seconds, float(accepted)
