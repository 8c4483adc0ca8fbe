"""Plain and speculative decoding with KV caches: batched, ragged and lossless.

`generate` decodes a target `Decoder` plainly, or speculatively with one drafter object
(`decode.drafters`), in one loop whatever the drafter (`decode.protocol`: the drafter proposes a
chain or a tree, one verify path accepts it, the drafter is told what was kept):
- base (no drafter): one target call per token (the baseline every speed-up is measured against);
- draft (`DraftModel(model)`): a smaller `Decoder` proposes gamma tokens, the target verifies them
  in one call (Leviathan et al. 2022, Algorithm 1; Chen et al. 2023, Algorithm 2);
- prophet (`HeadDrafter(head)`): a `ModelWithProphet` whose prophet drafts from the target's cached
  last-layer embeddings, verified the same way; for a Hugging Face target, an `hf.HFProphet` head
  drafting from the hidden states the target's cache keeps;
- eagle3 (`HeadDrafter(head)` with an `hf.Eagle3Head`, Hugging Face targets): after every target
  call the head's own KV cache is extended with the target's aux-layer features of the committed
  positions, and it drafts feeding its own features back (the draft vocabulary spread over the
  target's with q = 0 outside it, so the residual covers those tokens);
- eagle3_tree (`TreeDrafter(head, tree)`): the head drafts a tree, verified in one call (`decode.tree`);
- lookup (`Lookup(n)`): prompt lookup proposes n tokens copied from the context, verified in one
  call (`decode.lookup`).
Target and draft may also be Hugging Face causal LMs (wrapped in `hf.HFDecoder`, with per-row
rollback of their caches; `vocab_size` slices padded heads to the shared vocabulary).

Every round keeps this invariant per row: the target's cache holds all tokens but the last one
(the "pending" token, just emitted by the target). Drafting starts from the pending token; the
verify call feeds [pending, d_1 .. d_gamma] and yields p_1 .. p_{gamma+1}. Draft token i is
accepted with probability min(1, p_i(d_i) / q_i(d_i)) using its own uniform; at the first
rejection a correction is drawn from norm(max(0, p_i - q_i)), and after gamma acceptances a bonus
from p_{gamma+1} (token verification, `verify="token"`). By default a sampled chain is verified as
a block instead (`decode.block`, Sun et al. 2024): the same draws and uniforms, a weight carried
from token to token, never fewer accepted tokens in expectation. p and q come from the same
`sampling.to_probs`, so the output is distributed exactly as the processed target's tokens;
temperature 0 compares argmaxes exactly.

Rows of a batch accept different counts: each row keeps its own cache length (rollback is a
per-row length), so no row ever attends to padding or to another row's rejected tokens. Each row
stops at its own EOS (emitted, then cut) or after exactly `max_new_tokens` tokens, and finished
rows leave the batch, so they cost no model time while the others go on.

Also here: `gamma="auto"` (the gamma with the best predicted speed-up, `cost.SpeedProfile`),
the repetition penalty (the context of every drafted position includes the drafts before it),
and `timing=True` (every model call timed into `stats.step_times`, for c and v).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..errors import SpecdecError, check
from ..hf import HFDecoder, as_decoders
from ..model import Decoder
from ..sampling import SamplingConfig, greedy_tokens, residual, sample, to_probs
from .block import block_verify
from .cost import PREFILL, TAIL, TARGET, Clock, SpeedProfile, StepTimes, verify_key
from .inputs import AUTO, check_context, check_inputs, check_memory, prompt_rows
from .protocol import Draft, Drafter, Plain, Plan, Verdict
from .rows import Rows
from .stats import DecodeStats
from .tree import Draws, walk, walk_greedy

if TYPE_CHECKING:
    from transformers import PreTrainedModel

VERIFY = ("block", "token")   # how a sampled chain is accepted (`DecodeOptions.verify`)
AUTO_GAMMA_MAX = 8          # gamma="auto" chooses among 1..8 (fewer when a prophet was trained for fewer)
CALIBRATION_STEPS = 3       # plain target steps timed as the unit of c and v
RECHOOSE_ROUNDS = 16        # after calibrating, choose again every 16 rounds from all the samples


def calibration_gammas(gamma_max: int) -> list[int]:
    """The gammas of the calibration rounds, in order: three passes over gamma_max, 1,
    gamma_max // 2 and 2, so v is measured at both ends and in the middle (on a CPU, v(1) is
    far above 1: a 2-token call costs much more than a 1-token one) and acceptance is counted
    up to gamma_max."""
    cycle = list(dict.fromkeys(g for g in (gamma_max, 1, gamma_max // 2, 2) if 1 <= g <= gamma_max))
    return cycle * 3


@dataclass(frozen=True)
class DecodeOptions:
    """generate's less common settings (its `**options`).

    verify: how a sampled chain is accepted: "block" (`decode.block`, the default: lossless, and
    never fewer tokens per round in expectation) or "token" by token (the module docstring). A
    tree verifies by block only where its round is a single chain (`decode.tree`); greedy
    decoding accepts the same tokens either way.
    timing: time every model call (perf_counter; synchronised on accelerators) into
    `stats.step_times`, from which `cost.cost_ratios` gives c and v of this very run.
    speed_profile: with gamma="auto", the `cost.SpeedProfile` to choose gamma from (measured with
    `cost.measure_costs`, or stored in an export's metadata) instead of calibrating on the call."""

    verify: str = "block"
    timing: bool = False
    speed_profile: SpeedProfile | None = None


@dataclass(frozen=True)
class _Settings:
    """What one generate call decodes with, besides its models and rows."""

    sampling: SamplingConfig
    eos_id: int | None
    generator: torch.Generator | None
    max_new: int
    plan: Plan
    block: bool                 # sampled chains verified by block


@torch.inference_mode()
def generate(
    target: Decoder | HFDecoder | PreTrainedModel,
    prompt: Tensor | list[Tensor],
    max_new_tokens: int,
    drafter: Drafter | None = None,
    *,
    sampling: SamplingConfig | None = None,
    gamma: int | str = 5,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    vocab_size: int | str | None = None,
    **options,
) -> tuple[list[Tensor], DecodeStats]:
    """Generate up to `max_new_tokens` new tokens per prompt row (a (batch, len) tensor or a list
    of 1-D rows of their own lengths), plainly without a `drafter`, else speculatively with it
    (`DraftModel`, `HeadDrafter`, `TreeDrafter` or `Lookup`: `decode.drafters`), sampled as
    `sampling` says (a `sampling.SamplingConfig`; `sampling.GREEDY` is temperature 0; None:
    temperature 1, unfiltered). `options`: `verify`, `timing` and `speed_profile` (`DecodeOptions`).

    Hugging Face causal LMs are wrapped in `HFDecoder`s; `vocab_size` (an integer, or "min" for
    the smaller head) slices their logits to the vocabulary target and draft share (see `hf.as_decoders`).

    `gamma="auto"` picks the gamma in 1..8 (1..prophet_train_length - 1 for a prophet) with the
    largest predicted speed-up (`_Decoding.choose_gamma`): `stats.gamma` is the gamma chosen;
    `stats.predicted_speedup` and `stats.measured_speedup` compare. A repetition penalty
    (`sampling.repetition_penalty`, transformers' semantics, see `sampling.penalise`) stays
    lossless: every position, drafted ones included, is processed with the context before it. A
    `TreeDrafter` or `Lookup` verifies one row after another (`decode.tree`: lossless at every
    temperature); its own depth takes gamma's place, so gamma must not be "auto", and it takes no
    repetition penalty or timing.

    Returns (tokens, stats): one 1-D LongTensor of new tokens per row (cut after eos_id), and a
    `DecodeStats`."""
    check(drafter is None or isinstance(drafter, Drafter),
          f"drafter must be a decode DraftModel, HeadDrafter, TreeDrafter or Lookup, got {type(drafter).__name__}: "
          f"wrap a draft model in DraftModel(model), a draft head in HeadDrafter(head)")
    opts = DecodeOptions(**options)
    sampling = SamplingConfig() if sampling is None else sampling
    check(isinstance(sampling, SamplingConfig), f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    drafter = Plain() if drafter is None else drafter
    target, draft = as_decoders(target, drafter.model, vocab_size)
    check_inputs(target, draft, drafter.head, gamma, max_new_tokens, eos_id, opts.speed_profile)
    check(opts.verify in VERIFY, f"verify must be one of {', '.join(VERIFY)}, got {opts.verify!r}")
    check_memory(prompt, max_new_tokens, {"target": target, "draft": draft})
    rows_in = prompt_rows(prompt, target.vocab_size, target.cfg.max_seq_len)
    check_context(rows_in, max_new_tokens, {"target": target, "draft": draft})
    drafter.check(gamma, sampling, opts.timing, opts.speed_profile)
    plan = drafter.plan(min(AUTO_GAMMA_MAX, drafter.max_gamma) if gamma == AUTO else gamma)
    settings = _Settings(sampling, eos_id, generator, max_new_tokens, plan, opts.verify == "block")
    stats = DecodeStats(method=drafter.method, batch=len(rows_in), gamma=plan.gamma,
                        step_times=StepTimes() if opts.timing else None)
    counters = _Counters(plan.positions, target.device)
    t0 = time.perf_counter()
    size = plan.rows or len(rows_in)
    tokens, samples = [], {}
    for start in range(0, len(rows_in), size):          # all rows at once, or one after another
        group = rows_in[start:start + size]
        run = _Decoding(target, draft, drafter, group, settings, stats, counters)
        if max_new_tokens > 0:
            run.decode(gamma, opts.speed_profile)
        samples = run.calibration_samples
        out = run.rows.tokens()          # a row decoded alone comes back on its prompt's device
        tokens += out if plan.rows is None else [t.to(r.device) for t, r in zip(out, group, strict=True)]
    stats.wall_seconds = time.perf_counter() - t0 if max_new_tokens > 0 else 0.0
    counters.count_into(stats, tokens, samples)
    return tokens, stats.finish()


class _Counters:
    """The counts of one generate call, kept as tensors on the device (read once at the end: no
    host sync per round): row-calls, alpha's sum and count, and per position the rounds that
    drafted it and those that accepted it (and every position before it); a tree's rounds, whose
    verdicts are on the host, count on the host (`host`: drafted_at, accepted_at, drafted)."""

    def __init__(self, positions: int, device: torch.device) -> None:
        self.row_calls = torch.zeros((), dtype=torch.long, device=device)
        self.drafted = torch.zeros((), dtype=torch.long, device=device)
        self.alpha_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.alpha_count = torch.zeros((), dtype=torch.long, device=device)
        self.accepted_at = torch.zeros(positions, dtype=torch.long, device=device)
        self.drafted_at = torch.zeros(positions, dtype=torch.long, device=device)
        self.host = ([0] * positions, [0] * positions, [0])

    def count_host(self, depth: int, kept: int, nodes: int) -> None:
        """Count a round of one (active) row whose verdict is on the host."""
        drafted_at, accepted_at, drafted = self.host
        for k in range(depth):
            drafted_at[k] += 1
            accepted_at[k] += k < kept
        drafted[0] += nodes

    def count_into(self, stats: DecodeStats, tokens: list[Tensor], samples: dict[str, list[float]]) -> None:
        stats.new_tokens = sum(t.numel() for t in tokens)
        steps = samples.get(TARGET)
        if steps and stats.wall_seconds > 0:
            step = statistics.median(steps)
            # tokens per second per row, over the rate of one token per target step
            stats.measured_speedup = stats.new_tokens / stats.wall_seconds / len(tokens) * step
        stats.row_calls = int(self.row_calls)
        if stats.method != "base":
            stats.alpha_sum, stats.alpha_count = float(self.alpha_sum), int(self.alpha_count)
            drafted_at, accepted_at, drafted = self.host
            stats.accepted_at = [a + b for a, b in zip(self.accepted_at.tolist(), accepted_at, strict=True)]
            stats.drafted_at = [a + b for a, b in zip(self.drafted_at.tolist(), drafted_at, strict=True)]
            stats.drafted, stats.accepted = int(self.drafted) + drafted[0], sum(stats.accepted_at)


class _Decoding:
    """The state of one generate call's rows (all of them, or one at a time: `Plan.rows`): the
    target and its cache, the rows, the drafter, counters and the clock. Drafters read it
    (`decode.protocol`)."""

    def __init__(self, target, draft, drafter: Drafter, rows_in: list[Tensor], settings: _Settings,
                 stats: DecodeStats, counters: _Counters) -> None:
        self.target, self.draft, self.drafter = target, draft, drafter
        self.sampling, self.eos_id, self.generator = settings.sampling, settings.eos_id, settings.generator
        self.plan, self.block, self.max_new = settings.plan, settings.block, settings.max_new
        self.stats, self.counters = stats, counters
        self.device = target.device
        self.clock = Clock(stats.step_times, self.device)
        self.draws = Draws(self.generator)
        self.rows = Rows(rows_in, self.max_new, self.plan.nodes, self.device,
                         target.vocab_size if self.sampling.penalised else None)
        self.cache = None
        self.calibration_samples: dict[str, list[float]] = {}

    # -- the loop ----------------------------------------------------------------------------------

    def decode(self, gamma: int | str, profile: SpeedProfile | None) -> None:
        """Prefill, then rounds until every row is done; gamma="auto" chooses the gamma first
        and again every RECHOOSE_ROUNDS rounds when it calibrated. Gamma 0 (no gamma beats plain
        decoding) decodes plainly to the end, no longer feeding the drafter."""
        self.prefill()
        adapt = gamma == AUTO and profile is None
        if gamma == AUTO:                        # a drafter's gamma; plain decoding stays plain
            self.stats.gamma = gamma = self.choose_gamma(profile) if self.plan.gamma else 0
        rounds = 0
        while not self.finished():
            if gamma == 0:
                self.drafter = Plain()
            self.round(gamma)
            rounds += 1
            if adapt and gamma and rounds % RECHOOSE_ROUNDS == 0:
                self.stats.gamma = gamma = self.rechoose(gamma)

    def round(self, gamma: int) -> None:
        """One round: the drafter proposes, the target verifies, the drafter is told the verdict."""
        self.drafter.accept(self, self.verify(self.drafter.propose(self, gamma)))

    def prefill(self) -> None:
        """Right-padded prompts; each row's padding lies past its own length, where no query of
        that row looks, and the cache is rolled back to the real lengths afterwards."""
        rows = self.rows
        self.cache = self.target.new_cache(rows.batch, rows.capacity, **self.drafter.cache_options())
        last = self.logits_at(PREFILL, self.target, rows.prompt, self.cache, rows.lens - 1)
        self.cache.rollback(rows.lens)
        self.count_call()
        rows.emit(self.next_tokens(last, rows.context())[:, None], torch.ones_like(rows.lens), self.eos_id)
        self.drafter.start(self)

    def finished(self) -> bool:
        """Whether every row is done; drops finished rows from the batch (one host read per round).

        A finished row would otherwise ride along in every model call until the slowest row ends:
        at batch 8 and 200 tokens that wasted 9% (draft) to 18% (prophet) of the row-calls here.
        Compacting copies only the rows that move, so it runs as soon as 1/8 of the rows are done."""
        rows = self.rows
        active = int((~rows.done).sum())
        if active == 0:
            return True
        if rows.batch - active >= max(1, rows.batch // 8):
            dst, src, batch = rows.compact()
            self.cache.compact_rows(dst, src, batch)
            self.drafter.compact(dst, src, batch)
            self.clock.prefix = TAIL
        return False

    # -- what drafters call ------------------------------------------------------------------------

    def empty_draft(self) -> Draft:
        """A proposal of nothing: the round is one plain target step."""
        contexts = self.rows.context()
        return Draft(self.rows.seq.new_zeros(self.rows.batch, 0), 0,
                     contexts=None if contexts is None else contexts[:, None])

    def logits_at(self, key: str, model, tokens: Tensor, cache, at: Tensor) -> Tensor:
        """Logits (b, vocab) of position at[i] of each row of tokens (b, n), fed to `cache`; a
        Hugging Face model computes its (large) head at those positions only."""
        if isinstance(model, HFDecoder):
            return self.clock(key, model, tokens, cache=cache, logits_at=at).logits[:, 0]
        return self.clock(key, model, tokens, cache=cache).logits[self.rows.arange_b, at]

    def pick(self, probs: Tensor) -> Tensor:
        return probs.argmax(-1) if self.sampling.greedy else sample(probs, self.generator)

    def next_tokens(self, logits: Tensor, seen: Tensor | None) -> Tensor:
        """The token of each row after logits (b, vocab): the argmax when greedy (no one-hot of
        the vocabulary built: `sampling.greedy_tokens`), else a draw from the processed distribution."""
        if self.sampling.greedy:
            return greedy_tokens(logits, self.sampling, seen)
        return sample(to_probs(logits, self.sampling, seen), self.generator)

    def count_call(self) -> None:
        self.stats.target_calls += 1
        self.counters.row_calls += (~self.rows.done).sum()

    # -- the one verify path -----------------------------------------------------------------------

    def verify(self, draft: Draft) -> Verdict:
        """Score [pending, draft] in one target call (a chain causally, a tree through its mask),
        accept a path per row (a chain for the whole batch in closed form, a tree by its walk),
        emit the kept drafts plus one correction or bonus token, and roll the cache back per row."""
        rows, cache = self.rows, self.cache
        n = draft.tokens.shape[1]
        before = cache.lengths.clone()
        active = ~rows.done
        tree = {} if draft.mask is None else {"tree": draft.mask}
        logits = self.clock(verify_key(n) if n else TARGET, self.target, torch.cat([rows.last(1), draft.tokens], 1),
                            cache=cache, **tree).logits
        self.count_call()
        if draft.tree is None:
            kept, after = self._accept_chain(logits, draft, active)
            verdict = Verdict(before, kept)
            block = torch.cat([draft.tokens, after[:, None]], 1)
            block[rows.arange_b, kept] = after
        else:
            verdict, block = self._accept_tree(logits, draft, before)
        if draft.tree is not None:              # one row, active (finished() ends a batch of one)
            self.counters.count_host(draft.depth, len(verdict.path), n)
        elif draft.depth:
            self._count(draft, verdict.kept, active)
        rows.emit(block, verdict.kept + 1, self.eos_id)
        if draft.mask is None:
            # keep [pending, accepted drafts]; a row cut short by EOS or max_new_tokens keeps less
            cache.rollback(torch.where(active, torch.minimum(before + 1 + verdict.kept, rows.seq_len - 1), before))
        else:
            keep = torch.zeros(1, n + 1, dtype=torch.bool, device=self.device)
            keep[0, verdict.order[0]] = True
            cache.keep_new(keep)
        return verdict

    def _accept_chain(self, logits: Tensor, draft: Draft, active: Tensor) -> tuple[Tensor, Tensor]:
        """(kept (b,), the token after them (b,)) for a chain (b, g): at T = 0 a draft is kept while
        it is the target's argmax (no (b, g + 1, vocab) one-hot built); at T > 0 by block or token
        verification. Counts alpha: sum_x min(p, q) at each position up to the first one not kept."""
        sampling, drafts, q = self.sampling, draft.tokens, draft.q
        b, g = drafts.shape
        if sampling.greedy:
            best = greedy_tokens(logits, sampling, draft.contexts)       # (b, g + 1)
            if g == 0:
                return torch.zeros_like(best[:, 0]), best[:, 0]
            accept = best[:, :g] == drafts
            k = accept.int().cumprod(1).sum(1)                          # accepted drafts per row
            after = best[self.rows.arange_b, k]
            overlap = accept.float()                                    # sum_x min(p, q) of two one-hots
        else:
            p = to_probs(logits, sampling, draft.contexts)              # (b, g + 1, vocab)
            if g == 0:
                after = self.pick(p[:, 0])
                return torch.zeros_like(after), after
            u = torch.rand(b, g, device=q.device, generator=self.generator)   # one uniform per position
            if self.block:
                k, final = block_verify(p, q, drafts, u)                # accepted drafts per row, next token's p
            else:
                # token by token: accept where u < p/q, without dividing
                px = p[:, :g].gather(-1, drafts[..., None])[..., 0]
                k = (u * q.gather(-1, drafts[..., None])[..., 0] < px).int().cumprod(1).sum(1)
                kc = k.clamp(max=g - 1)
                fix = residual(p[self.rows.arange_b, kc], q[self.rows.arange_b, kc])
                final = torch.where((k < g)[:, None], fix, p[:, g])
            after = self.pick(final)
            overlap = torch.minimum(p[:, :g], q).sum(-1)                # (b, g)
        tested = (torch.arange(g, device=k.device) <= k[:, None]) & active[:, None]
        self.counters.alpha_sum += (overlap * tested).sum()
        self.counters.alpha_count += tested.sum()
        return k, after

    def _accept_tree(self, logits: Tensor, draft: Draft, before: Tensor) -> tuple[Verdict, Tensor]:
        """The verdict and the emitted block (1, len(path) + 1) of a tree (one row) by its walk
        (`decode.tree`): exact argmax at T = 0, recursive rejection sampling at T > 0."""
        tree, sampling, device = draft.tree, self.sampling, self.rows.seq.device
        if sampling.greedy:
            path, last = walk_greedy(tree, greedy_tokens(logits[0], sampling).tolist())
        else:
            path, last = walk(tree, to_probs(logits[0].float(), sampling), self.draws)
        slots, tokens = [0] + [i + 1 for i in path], [tree.tokens[i] for i in path] + [last]
        host = torch.tensor([len(path)] + slots + tokens, dtype=torch.long, device=device)   # one copy to the device
        kept, order, block = host[:1], host[1:len(slots) + 1][None], host[len(slots) + 1:][None]
        return Verdict(before, kept, order, len(slots), path, tokens), block

    def _count(self, draft: Draft, kept: Tensor, active: Tensor) -> None:
        """Per-position counts of the round (positions 1..draft.depth) and the drafts verified."""
        counters, depth = self.counters, draft.depth
        n_active = active.sum()
        counters.accepted_at[:depth] += ((torch.arange(depth, device=kept.device) < kept[:, None])
                                         & active[:, None]).sum(0)
        counters.drafted_at[:depth] += n_active
        counters.drafted += n_active * draft.tokens.shape[1]

    # -- gamma="auto" ------------------------------------------------------------------------------

    def choose_gamma(self, profile: SpeedProfile | None) -> int:
        """The gamma for the rest of the call, the one with the largest predicted speed-up
        E(gamma) / (gamma c + v(gamma)) (`cost.SpeedProfile`): from `profile` when given, else by
        calibrating on the call itself. Calibrating decodes 3 plain steps (their median time is the
        unit of c and v), then 12 rounds at gammas 8, 1, 4, 2, 8, 1, ... (`calibration_gammas`),
        timing every draft step and verify call and counting the per-position acceptance; c and v
        are ratios of medians, v is interpolated between the measured gammas, and the choice is
        made again every 16 rounds from all samples so far. Where no gamma is predicted to beat
        plain decoding (a speed-up <= 1) gamma becomes 0. Every calibration token is a real,
        lossless output token; calibrating times every model call, which on a GPU costs a
        synchronisation per call (a given profile times nothing)."""
        if profile is None:
            profile = self.calibrate()
        if profile is None:                      # the call ended (or lost its full batch) first
            return min(5, self.plan.gamma)
        return self._adopt(profile)

    def _adopt(self, profile: SpeedProfile) -> int:
        gamma = profile.best_gamma(limit=self.plan.gamma, plain=True)
        self.stats.speed_profile = profile.to_dict()
        self.stats.predicted_speedup = profile.predicted(gamma)
        return gamma

    def calibrate(self) -> SpeedProfile | None:
        """Measure c, v and the per-position acceptance on this call's first tokens (`choose_gamma`)."""
        samples: dict[str, list[float]] = {}
        plain, self.clock = self.clock, Clock(self.stats.step_times, self.device, samples)
        self.clock.prefix = plain.prefix
        try:
            for g in [0] * CALIBRATION_STEPS + calibration_gammas(self.plan.gamma):
                if self.finished():
                    return None
                self.round(g)
        except BaseException:
            plain.prefix, self.clock = self.clock.prefix, plain
            raise
        # the sampling clock stays: the rounds that follow keep adding samples for `rechoose`
        self.calibration_samples = samples
        return self._profile()

    def _profile(self) -> SpeedProfile | None:
        """The speed profile from the samples and acceptance counted so far."""
        accepted, drafted = self.counters.accepted_at.tolist(), self.counters.drafted_at.tolist()
        try:
            acceptance = [a / max(d, 1) for a, d in zip(accepted, drafted, strict=True)]
            return SpeedProfile.from_samples(self.calibration_samples, acceptance, self.rows.batch,
                                             getattr(self.drafter, "one_pass", False))
        except SpecdecError:                     # no full-batch call of some kind was timed
            return None

    def rechoose(self, gamma: int) -> int:
        """The best gamma given every sample so far (the current one when there is no profile)."""
        profile = self._profile()
        return gamma if profile is None else self._adopt(profile)
