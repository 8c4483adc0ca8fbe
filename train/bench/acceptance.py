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

The answers are decoded with the head itself (a chain of `gamma` drafts: lossless, so they are
distributed as the target's own), and each round's start is observed. That separates two reasons
why a chain's first draft is accepted less in decoding than `drawn_1` says:

    rounds              the decoding rounds (each drafts its first token at a round start)
    decoded_1           the share of rounds whose first draft was accepted (DecodeStats'
                        accepted_at[0] / drafted_at[0])
    round_drawn_1       sum min(p, q) at the round starts only: a round starts after a rejection
                        (at a correction token drawn where the head was wrong) or after a full
                        acceptance, not at an average position
    round_logit_error   the largest difference between the first-draft logits decoding computed
                        (through the head's KV cache, rolled back and extended round by round) and
                        the teacher-forced head's at the same position

decoded_1 estimates round_drawn_1 (the same expectation, drawn once per round); round_logit_error
is rounding when the head's cache is right.

The decoding's own rounds also compare the two ways to verify a sampled chain
(`specdec_models.decode.block`), on the very chains drafted, exactly over the uniforms (so the
comparison carries no sampling noise of its own):

    round_kept_token    expected drafts kept per round under token verification:
                        sum_k prod_{i<=k} min(1, p_i(x_i) / q_i(x_i))
    round_kept_block    the same under block verification: sum_i i P(tau = i)

A round emits one token more than it keeps, so 1 + round_kept_* is its expected tokens per call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from typing import Any

import torch
from torch import Tensor

from specdec_models.decode import HeadDrafter, chain, generate, speculative
from specdec_models.decode.block import block_weights
from specdec_models.errors import check, check_positive_int
from specdec_models.sampling import SamplingConfig, residual, to_probs


def rrs_acceptance(p: Tensor, q: Tensor, k: int, draws: int, generator: torch.Generator | None = None) -> float:
    """The probability that one of k candidates drawn from q (vocab,) without replacement is
    accepted by recursive rejection sampling against p (vocab,): the mean over `draws` draws of
    the candidates of the exact acceptance probability given them (`rrs_acceptance_rows` on one row)."""
    return float(rrs_acceptance_rows(p[None], q[None], k, draws, generator)[0])


def rrs_acceptance_rows(p: Tensor, q: Tensor, k: int, draws: int,
                        generator: torch.Generator | None = None) -> Tensor:
    """`rrs_acceptance` for many rows at once: p, q (rows, vocab) -> (rows,) float64, each row's
    mean over `draws` draws of its k candidates of the exact acceptance probability given them."""
    check_positive_int(k, "candidates")
    check_positive_int(draws, "draws")
    rows = p.shape[0]
    total = torch.zeros(rows, dtype=torch.float64)
    for _ in range(draws):
        p_i, q_i = p.double().cpu(), q.double().cpu()
        missed = torch.ones(rows, dtype=torch.float64)
        for _ in range(k):
            mass = q_i.sum(-1, keepdim=True)
            live = mass[:, 0] > 0                         # a row whose q is spent has no candidate left
            q_i = torch.where(mass > 0, q_i / mass.clamp_min(torch.finfo(q_i.dtype).tiny), q_i)
            x = torch.multinomial(torch.where(live[:, None], q_i, 1.0), 1, generator=generator)      # (rows, 1)
            qx = q_i.gather(1, x)[:, 0]
            accept = torch.where(live, (p_i.gather(1, x)[:, 0] / qx.clamp_min(1e-300)).clamp(max=1.0), 0.0)
            total += missed * accept
            missed = missed * (1 - accept)
            p_i = residual(p_i, q_i)                      # what the next candidate is tested against
            q_i = q_i.scatter(1, x, 0.0)
    return total / draws


@contextmanager
def observed_round_starts(seen: list[tuple[int, Tensor]]) -> Iterator[None]:
    """While inside, every chain-drafting round of an eagle3 head at batch 1 appends (the row's
    length before the round, the head's first-draft logits (draft,)) to `seen`."""
    original = chain.Eagle3Drafter.propose

    def observed(self: Any, run: Any, gamma: int) -> Any:
        seen.append((int(run.rows.seq_len[0]), self.head_next[0][0].detach().clone()))
        return original(self, run, gamma)

    chain.Eagle3Drafter.propose = observed
    try:
        yield
    finally:
        chain.Eagle3Drafter.propose = original


def expected_kept(p: Tensor, q: Tensor, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """Expected drafts kept per row under token and under block verification, exact over the
    uniforms, for chains `drafts` (b, g) drawn from q (b, g, vocab), the target's p (b, g + 1, vocab)."""
    px = p[:, : drafts.shape[1]].gather(-1, drafts[..., None])[..., 0].double()
    qx = q.gather(-1, drafts[..., None])[..., 0].double()
    token = torch.clamp(px / qx, max=1.0).cumprod(1).sum(1)
    _, h = block_weights(p, q, drafts)
    later = torch.cat([torch.flip(torch.cumprod(torch.flip(1 - h, [1]), 1), [1])[:, 1:],
                       torch.ones_like(h[:, :1])], 1)                 # prod_{j > i} (1 - h_j)
    steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype, device=h.device)
    return token, (steps * h * later).sum(1)


@contextmanager
def observed_block_rounds(seen: list[tuple[float, float]]) -> Iterator[None]:
    """While inside, every block-verified round (`generate`'s default when sampling) appends each
    row's (expected kept drafts under token verification, under block verification) to `seen`."""
    original = speculative.block_verify

    def observed(p: Tensor, q: Tensor, drafts: Tensor, u: Tensor) -> Any:
        token, block = expected_kept(p, q, drafts)
        seen.extend(zip(token.tolist(), block.tolist(), strict=True))
        return original(p, q, drafts, u)

    speculative.block_verify = observed
    try:
        yield
    finally:
        speculative.block_verify = original


@dataclass(frozen=True)
class AcceptanceSettings:
    """How `first_token_acceptance` decodes and measures: sampling at `temperature` (> 0) and
    `top_p`, answers of up to `max_new_tokens` stopped after `eos_id`, chains of `gamma`, seeded
    by `seed` (per prompt); `k` candidates drawn `draws` times for the k-draft measures, and the
    draft temperatures `taus`."""

    temperature: float = 1.0
    top_p: float | None = None
    max_new_tokens: int = 64
    eos_id: int | None = None
    k: int = 3
    draws: int = 16
    taus: Sequence[float] = (0.7, 0.5)
    gamma: int = 4
    seed: int = 0


@torch.no_grad()
def first_token_acceptance(target: Any, head: Any, prompts: Sequence[Tensor], **settings: Any) -> dict[str, float]:
    """The module docstring's measures, averaged over every drafted answer position (round_*: over
    the round starts): the target (a Hugging Face causal LM) answers each prompt (1-D token ids) at
    `temperature`, drafted by the head in chains of `gamma` (seeded per prompt, stopped after
    `eos_id`), then one pass over prompt + answer gives p and the head's first draft step q.
    `settings`: the fields of `AcceptanceSettings`."""
    temperature, top_p, max_new_tokens, eos_id, k, draws, taus, gamma, seed = astuple(AcceptanceSettings(**settings))
    check(temperature > 0, f"first-token acceptance is for sampling (T > 0), got temperature {temperature}")
    check_positive_int(k, "candidates")
    check_positive_int(gamma, "gamma")
    check(all(t > 0 for t in taus), f"draft temperatures must be > 0, got {list(taus)}")
    cfg = SamplingConfig(temperature=temperature, top_p=top_p)
    vocab = head.config.target_vocab_size
    ids = head.draft_ids
    sums: dict[str, float] = {}
    positions, rounds, accepted, at_starts, error = 0, 0, 0, [], 0.0
    kept: list[tuple[float, float]] = []                 # per round: expected kept drafts, token and block
    mc = torch.Generator().manual_seed(seed)
    for i, prompt in enumerate(prompts):
        seen: list[tuple[int, Tensor]] = []
        with observed_round_starts(seen), observed_block_rounds(kept):
            answers, stats = generate(target, [prompt], max_new_tokens, HeadDrafter(head), sampling=cfg,
                                      eos_id=eos_id, gamma=gamma, vocab_size=vocab,
                                      generator=torch.Generator(device=head.device).manual_seed(seed + i))
        answer = answers[0]
        seq = torch.cat([prompt.to(head.device), answer.to(head.device)])[None]
        n, start = seq.shape[1], prompt.numel()
        # every round observed is one the decoding counted (and drafted for within the answer, below)
        check(len(seen) == (stats.drafted_at[0] if stats.drafted_at else 0), "round starts went unobserved")
        rounds += len(seen)
        accepted += int(stats.accepted_at[0]) if seen else 0
        if n - start < 2:                        # the head drafts from the second answer token on
            continue
        out = target(input_ids=seq, output_hidden_states=True, use_cache=False)
        aux = torch.cat([out.hidden_states[j] for j in head.aux_layers], -1)
        # head position t reads aux[t] and token t + 1 and predicts the target's distribution at t + 1
        logits = head.ttt_logits(torch.cat([seq, seq[:, -1:]], 1), aux, 1)[0][0].float()
        drawn_1: dict[int, float] = {}
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
            drawn_1[t] = row["drawn_1"]
        for length, decoded in seen:        # a round after `length` tokens drafts its first token at t = length - 2
            if length - 2 in drawn_1:       # (a round always has a token after it: the answer goes on)
                at_starts.append(drawn_1[length - 2])
                error = max(error, float((decoded.float() - logits[length - 2]).abs().max()))
    check(len(kept) == rounds, "block-verified rounds went unobserved")       # every sampled chain round is one
    check(positions > 0, "no answer was long enough to draft for (2 tokens or more)")
    return {"positions": positions, **{name: value / positions for name, value in sums.items()},
            "rounds": rounds, "decoded_1": accepted / max(rounds, 1),
            "round_drawn_1": sum(at_starts) / max(len(at_starts), 1), "round_logit_error": error,
            "round_kept_token": sum(t for t, _ in kept) / max(len(kept), 1),
            "round_kept_block": sum(b for _, b in kept) / max(len(kept), 1)}


@torch.no_grad()
def heldout_acceptance(head: Any, rows: dict[str, Tensor], layers: Sequence[int], *, steps: int = 4,
                       temperature: float = 1.0, k: int = 4, draws: int = 4, taus: Sequence[float] = (),
                       seed: int = 0, chunk: int = 256) -> list[dict[str, float]]:
    """The acceptance of an eagle3 head's drafts at every unroll step, on a regenerated cache's
    rows (`rows`: a batch of `train.data.hf_embeddings`, e.g. its held-out validation rows, whose
    "embeds" concatenate the hidden states of `layers`), with no decoding and no timing: each
    step's q is the head's training-time-test prediction (exactly what draft step k + 1 of a round
    computes, fed its own features: `Eagle3Head.ttt_logits`), p the target's distribution from the
    cached last layer through its full LM head, both under `temperature` (> 0). Only answer labels
    count (the training loss's mask). One row per step: positions, H_p and H_q (mean entropies,
    nats), mass_in_vocab, drawn_1 (sum min(p, q)), drawn_1/tau{t} (q from logits / t), and
    drawn_{k} (k candidates drawn without replacement, recursive rejection sampling: a Monte
    Carlo mean over `draws` draws per position, each exact given its candidates)."""
    from train.data.hf_embeddings import label_mask
    from train.tasks.hf_eagle3 import cached_layers

    check(temperature > 0, f"held-out acceptance is for sampling (T > 0), got temperature {temperature}")
    check_positive_int(steps, "unroll steps")
    check(all(t > 0 for t in taus), f"draft temperatures must be > 0, got {list(taus)}")
    cfg = SamplingConfig(temperature=temperature)
    vocab = head.config.target_vocab_size
    tokens = rows["tokens"].to(head.device)
    aux, last = cached_layers(rows["embeds"], list(layers), head.aux_layers, head.config.target_layers)
    n = aux.shape[1]
    mask = label_mask(rows, n)
    mask = torch.ones(tokens.shape[0], n, dtype=torch.bool) if mask is None else mask.cpu()
    weight = head.target.get_output_embeddings().weight[:vocab]
    mc = torch.Generator().manual_seed(seed)
    out = []
    for step, logits in enumerate(head.ttt_logits(tokens, aux.to(head.device, head.fc.weight.dtype), steps)):
        span = logits.shape[1]                       # head position t predicts the distribution at t + 1 + step
        sel = mask[:, 1 + step:1 + step + span]
        drafted = logits.float().cpu()[sel]                                                  # (M, draft)
        states = last[:, 1 + step:1 + step + span][sel]                                       # (M, H)
        sums = {"H_p": 0.0, "H_q": 0.0, "mass_in_vocab": 0.0, "drawn_1": 0.0,
                **{f"drawn_1/tau{t:g}": 0.0 for t in taus}, f"drawn_{k}": 0.0}
        for lo in range(0, drafted.shape[0], chunk):
            full = torch.nn.functional.linear(states[lo:lo + chunk].to(weight), weight).float().cpu()
            p = to_probs(full, cfg)
            spread = head.to_target_vocab(drafted[lo:lo + chunk].to(head.draft_ids.device)).cpu()
            q = to_probs(spread, cfg)
            sums["H_p"] += float(-(p * p.clamp_min(1e-30).log()).sum())
            sums["H_q"] += float(-(q * q.clamp_min(1e-30).log()).sum())
            sums["mass_in_vocab"] += float(p[:, head.draft_ids.cpu()].sum())
            sums["drawn_1"] += float(torch.minimum(p, q).sum())
            for t in taus:
                sums[f"drawn_1/tau{t:g}"] += float(torch.minimum(p, to_probs(spread / t, cfg)).sum())
            sums[f"drawn_{k}"] += float(rrs_acceptance_rows(p, q, k, draws, mc).sum())
        count = max(drafted.shape[0], 1)
        out.append({"step": step, "positions": drafted.shape[0], **{name: v / count for name, v in sums.items()}})
    return out
