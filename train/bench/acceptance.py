"""Where an eagle3 head's first draft token loses acceptance when decoding samples (T > 0).

At T > 0 the target accepts a drafted token x ~ q with probability min(1, p(x) / q(x)), so one
drawn candidate is accepted with probability sum_x min(p, q) = 1 - TV(p, q) (docs/DECODING.md):
the head's whole distribution must match the target's, and it can match at most the target's
mass inside the draft vocabulary (q is zero outside it). A tree offers several candidates at a
node. They can be drawn from q without replacement and tested by recursive rejection sampling
(what `specdec_models.decode.tree` does), or taken as the head's top k, tested one after another
as point masses (what it does with looked-up tokens): both are lossless, and which accepts more
depends on how q and p differ. `first_token_acceptance` measures each choice on the target's own
sampled answers, at every answer position the head drafts for, from one teacher-forced pass:

    target_top_1        max p: how peaked the target's distribution is
    mass_in_vocab       p's mass inside the draft vocabulary: the ceiling of any drawn candidate
    drawn_1             sum min(p, q): one candidate drawn from q (a chain's first token)
    top_1               p(argmax q): the head's top token as a fixed candidate
    drawn_k             k candidates drawn from q without replacement, recursive rejection sampling
                        (a Monte Carlo mean over `draws` draws of the candidates per position;
                        each draw's acceptance probability is computed exactly)
    top_k               p's mass on the head's top k: the top k as fixed candidates
    drawn_1/tau{t}      one candidate drawn from q sharpened to temperature t (logits / t)

p is the target's distribution under the decoding's sampling settings, q the head's under the
same settings (`specdec_models.sampling.to_probs`). These are acceptance probabilities of the
first draft position only, from the target's features; deeper positions compound them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from specdec_models.decode import generate
from specdec_models.errors import check, check_positive_int
from specdec_models.sampling import SamplingConfig, residual, to_probs


def rrs_acceptance(p: Tensor, q: Tensor, k: int, draws: int, generator: torch.Generator | None = None) -> float:
    """The probability that one of k candidates drawn from q (vocab,) without replacement is
    accepted by recursive rejection sampling against p (vocab,): the mean over `draws` draws of
    the candidates of the exact acceptance probability given them."""
    check_positive_int(k, "candidates")
    check_positive_int(draws, "draws")
    total = 0.0
    for _ in range(draws):
        p_i, q_i, missed = p.double(), q.double(), 1.0
        for _ in range(k):
            mass = float(q_i.sum())
            if mass <= 0:
                break
            q_i = q_i / mass
            x = int(torch.multinomial(q_i, 1, generator=generator))
            accept = min(1.0, float(p_i[x] / q_i[x]))
            total += missed * accept
            missed *= 1 - accept
            if missed <= 0:                             # accepted for sure: no residual to test against
                break
            p_i = residual(p_i, q_i)                    # what the next candidate is tested against
            q_i = q_i.clone()
            q_i[x] = 0
    return total / draws


@torch.no_grad()
def first_token_acceptance(target: Any, head: Any, prompts: Sequence[Tensor], *, temperature: float = 1.0,
                           top_p: float | None = None, max_new_tokens: int = 64, eos_id: int | None = None,
                           k: int = 3, draws: int = 16, taus: Sequence[float] = (0.7, 0.5),
                           seed: int = 0) -> dict[str, float]:
    """The module docstring's measures, averaged over every drafted answer position: the target
    (a Hugging Face causal LM) answers each prompt (1-D token ids) at `temperature` (seeded per
    prompt, stopped after `eos_id`), then one pass over prompt + answer gives p and the head's
    first draft step q."""
    check(temperature > 0, f"first-token acceptance is for sampling (T > 0), got temperature {temperature}")
    check_positive_int(k, "candidates")
    check(all(t > 0 for t in taus), f"draft temperatures must be > 0, got {list(taus)}")
    cfg = SamplingConfig(temperature=temperature, top_p=top_p)
    vocab = head.config.target_vocab_size
    ids = head.draft_ids
    sums: dict[str, float] = {}
    positions = 0
    mc = torch.Generator().manual_seed(seed)
    for i, prompt in enumerate(prompts):
        answer = generate(target, [prompt], max_new_tokens, temperature=temperature, top_p=top_p, eos_id=eos_id,
                          generator=torch.Generator(device=head.device).manual_seed(seed + i), vocab_size=vocab)[0][0]
        seq = torch.cat([prompt.to(head.device), answer.to(head.device)])[None]
        n, start = seq.shape[1], prompt.numel()
        if n - start < 2:                        # the head drafts from the second answer token on
            continue
        out = target(input_ids=seq, output_hidden_states=True, use_cache=False)
        aux = torch.cat([out.hidden_states[j] for j in head.aux_layers], -1)
        # head position t reads aux[t] and token t + 1 and predicts the target's distribution at t + 1
        logits = head.ttt_logits(torch.cat([seq, seq[:, -1:]], 1), aux, 1)[0][0].float()
        for t in range(start - 1, n - 2):
            p = to_probs(out.logits[0, t + 1, :vocab].float(), cfg)
            q = to_probs(head.to_target_vocab(logits[t])[:vocab], cfg)
            top = q.topk(min(k, ids.numel())).indices
            row = {"target_top_1": float(p.max()), "mass_in_vocab": float(p[ids].sum()),
                   "drawn_1": float(torch.minimum(p, q).sum()), "top_1": float(p[top[0]]),
                   f"drawn_{k}": rrs_acceptance(p, q, k, draws, mc), f"top_{k}": float(p[top].sum())}
            for tau in taus:
                sharp = to_probs(head.to_target_vocab(logits[t] / tau)[:vocab], cfg)
                row[f"drawn_1/tau{tau:g}"] = float(torch.minimum(p, sharp).sum())
            for name, value in row.items():
                sums[name] = sums.get(name, 0.0) + value
            positions += 1
    check(positions > 0, "no answer was long enough to draft for (2 tokens or more)")
    return {"positions": positions, **{name: value / positions for name, value in sums.items()}}
