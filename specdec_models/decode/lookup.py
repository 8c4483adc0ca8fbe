"""Prompt-lookup decoding (Saxena 2023; Hugging Face's `prompt_lookup_num_tokens`): the drafter
`drafters.Lookup`, a draft tree of only its looked-up path.

Each round looks up the row's context (prompt and emitted tokens): the tokens that followed the
latest earlier occurrence of its last 3 (else 2, else 1) tokens (`tree.lookup_match`), or a
datastore's continuation where that follows a longer n-gram (`tree.looked_up_path`). They are fed
after the pending token in one causal target call: a chain is a tree of one path, so it needs no
tree mask and runs on a specdec `Decoder` as on a Hugging Face target. A round that finds nothing
feeds the pending token alone: one plain target step.

Lossless at every temperature, by the tree's own walk (`tree._TreeDecoding.walk`): a looked-up
token x is a point-mass draft (q = 1{x}), accepted with probability p(x); on rejection the token
is drawn from p without x, renormalised; greedy decoding follows the target's argmax. The path
depends only on the committed context, and an adaptive length (`lookup_max`, `TreeSpec.next_lookup`)
only on earlier rounds, so neither can bias a round's test.

Rows are decoded one after another, as the tree's are. `stats.drafted` counts looked-up tokens
verified, `stats.accepted` those accepted; `stats.per_position_acceptance[k]` is the fraction of
rounds with a looked-up path of k + 1 tokens or more that accepted k + 1 or more.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..hf import HFDecoder
from ..model import Decoder
from ..sampling import SamplingConfig, greedy_tokens, to_probs
from .datastore import Datastore
from .stats import DecodeStats
from .tree import TreeSpec, _Tree, _TreeDecoding, looked_up_path


def _last_logits(target: Decoder | HFDecoder, tokens: Tensor, cache) -> Tensor:
    """The logits (vocab,) after `tokens` (1, n) fed to `cache`; a Hugging Face target computes its
    head at the last position only."""
    if isinstance(target, HFDecoder):
        at = torch.tensor([tokens.shape[1] - 1], device=target.device)
        return target(tokens, cache=cache, logits_at=at).logits[0, 0]
    return target(tokens, cache=cache).logits[0, -1]


def _row(run: _TreeDecoding, prompt: Tensor, max_new: int) -> list[int]:
    """Decode one prompt (n,) to at most max_new tokens (cut after EOS)."""
    target, spec, stats, sampling = run.target, run.spec, run.stats, run.sampling
    device = target.device
    n = prompt.numel()
    context = prompt.tolist()
    cache = target.new_cache(1, n + max_new + spec.longest_lookup + 2)
    logits = _last_logits(target, prompt[None].to(device), cache)
    stats.target_calls += 1
    stats.row_calls += 1
    out = [run.pick(to_probs(logits.float(), sampling))]
    lookup = spec.lookup
    while len(out) < max_new and (run.eos_id is None or out[-1] != run.eos_id):
        path = looked_up_path(context + out, min(lookup, max_new - len(out)), run.datastore)
        tree = _Tree()
        tree.add_path(path)
        before = int(cache.lengths[0])
        logits = target(torch.tensor([[out[-1]] + path], device=device), cache=cache).logits[0]  # (1 + len(path), vocab)
        stats.target_calls += 1
        stats.row_calls += 1
        if sampling.greedy:
            kept, last = run.walk_greedy(tree, greedy_tokens(logits, sampling).tolist())
        else:
            kept, last = run.walk(tree, to_probs(logits.float(), sampling))
        cache.rollback(torch.tensor([before + 1 + len(kept)], device=cache.lengths.device))
        lookup = spec.next_lookup(lookup, len(kept) == len(path) if path else None)
        for k in range(len(path)):
            stats.drafted_at[k] += 1
            stats.accepted_at[k] += int(k < len(kept))
        stats.drafted += len(path)
        stats.accepted += len(kept)
        out += path[: len(kept)] + [last]
        if run.eos_id is not None and run.eos_id in out:
            out = out[: out.index(run.eos_id) + 1]
    return out[:max_new]


@torch.inference_mode()
def lookup_generate(target: Decoder | HFDecoder, rows: list[Tensor], max_new_tokens: int, spec: TreeSpec,
                    sampling: SamplingConfig, eos_id: int | None, generator: torch.Generator | None,
                    stats: DecodeStats, datastore: Datastore | None = None) -> list[Tensor]:
    """Decode each row by prompt lookup (module docstring) with the lookup lengths of `spec` (a
    `TreeSpec` whose head fields are unused); fills `stats`' counters. Called by
    `generate(..., Lookup(...))`, which has checked its arguments."""
    stats.accepted_at = [0] * spec.longest_lookup
    stats.drafted_at = [0] * spec.longest_lookup
    stats.drafted = stats.accepted = 0
    run = _TreeDecoding(target, None, spec, sampling, eos_id, generator, stats, block=False, datastore=datastore)
    out = []
    for row in rows:
        tokens = _row(run, row, max_new_tokens) if max_new_tokens > 0 else []
        out.append(torch.tensor(tokens, dtype=torch.long, device=row.device))
    return out
