"""Plain and speculative decoding with KV caches: batched, ragged and lossless.

`generate` decodes a target `Decoder` plainly, or speculatively with one drafter object
(`decode.drafters`), and picks the method from the drafter's type:
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
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..errors import SpecdecError, check
from ..hf import HFDecoder, as_decoders
from ..model import Decoder
from ..sampling import SamplingConfig, greedy_tokens, residual, sample, to_probs
from .block import block_verify
from .cost import DRAFT, PREFILL, TAIL, TARGET, Clock, SpeedProfile, StepTimes, verify_key
from .drafters import Drafter, Lookup, TreeDrafter
from .inputs import AUTO, check_context, check_inputs, check_memory, prompt_rows
from .lookup import lookup_generate
from .stats import DecodeStats
from .tree import tree_generate

VERIFY = ("block", "token")   # how a sampled chain is accepted (generate's `verify`)
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

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..heads import Eagle3Head


class _Rows:
    """Per-row token history, emitted tokens and stop state (all left-aligned buffers), for the
    rows still decoding: `compact` drops finished rows, `orig` maps each row to its prompt.
    With `vocab` (a repetition penalty), `seen` (b, vocab + 1) marks the ids in each row's context
    (prompt and emitted tokens), updated as tokens are emitted; column `vocab` takes the writes
    of padding and of slots past a row's emitted tokens."""

    def __init__(self, rows: list[Tensor], max_new: int, gamma: int, device: torch.device,
                 vocab: int | None = None) -> None:
        b = len(rows)
        self.lens = torch.tensor([r.numel() for r in rows], device=device)
        width = int(self.lens.max()) + max_new + gamma + 2
        self.seq = torch.zeros(b, width, dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            self.seq[i, : r.numel()] = r.to(device)
        self.seq_len = self.lens.clone()
        self.out = torch.zeros(b, max_new + gamma + 1, dtype=torch.long, device=device)
        self.produced = torch.zeros(b, dtype=torch.long, device=device)
        self.done = torch.zeros(b, dtype=torch.bool, device=device)
        self.max_new = max_new
        self.capacity = width
        self.arange_b = torch.arange(b, device=device)
        self.orig = torch.arange(b, device=device)
        self.result: list[Tensor | None] = [None] * b
        self.vocab = vocab
        self.seen = None
        if vocab is not None:
            prompt = self.seq[:, : int(self.lens.max())]
            in_prompt = torch.arange(prompt.shape[1], device=device) < self.lens[:, None]
            self.seen = torch.zeros(b, vocab + 1, dtype=torch.bool, device=device)
            self.seen.scatter_(1, torch.where(in_prompt, prompt, vocab), True)

    def context(self) -> Tensor | None:
        """The ids in each row's context so far (b, vocab), for the repetition penalty."""
        return None if self.seen is None else self.seen[:, : self.vocab]

    @property
    def batch(self) -> int:
        return self.seq.shape[0]

    def last(self, count: int) -> Tensor:
        """The last `count` tokens of each row (batch, count)."""
        idx = self.seq_len[:, None] - count + torch.arange(count, device=self.seq.device)
        return self.seq.gather(1, idx)

    def emit(self, block: Tensor, valid: Tensor, eos_id: int | None) -> Tensor:
        """Append block (b, m) of which the first valid (b,) tokens are real, honouring EOS and
        max_new_tokens; return how many tokens each row emitted."""
        m = block.shape[1]
        j = torch.arange(m, device=block.device)
        n = torch.minimum(valid, self.max_new - self.produced)
        hit_eos = torch.zeros_like(self.done)
        if eos_id is not None:
            is_eos = (block == eos_id) & (j < n[:, None])
            first = torch.where(is_eos.any(1), is_eos.int().argmax(1), m)
            hit_eos = first < n
            n = torch.where(hit_eos, first + 1, n)
        n = torch.where(self.done, 0, n)
        # write all m slots; the ones past n are overwritten later or cut at the end
        self.out.scatter_(1, (self.produced[:, None] + j).clamp(max=self.out.shape[1] - 1), block)
        self.seq.scatter_(1, (self.seq_len[:, None] + j).clamp(max=self.capacity - 1), block)
        if self.seen is not None:
            self.seen.scatter_(1, torch.where(j < n[:, None], block, self.vocab), True)
        self.produced += n
        self.seq_len += n
        self.done |= hit_eos | (self.produced >= self.max_new)
        return n

    def _save(self, rows: list[int]) -> None:
        for i, orig, produced in zip(rows, self.orig[rows].tolist(), self.produced[rows].tolist()):
            self.result[orig] = self.out[i, :produced].clone()

    def compact(self) -> tuple[Tensor, Tensor, int]:
        """Drop the finished rows: keep their tokens aside and move the unfinished rows from the
        end into their slots (only those rows are copied); return (dst, src, batch) so that the
        caches do the same."""
        done = self.done
        batch = int((~done).sum())
        self._save(done.nonzero()[:, 0].tolist())
        dst = done[:batch].nonzero()[:, 0]
        src = (~done[batch:]).nonzero()[:, 0] + batch
        for name in ("lens", "seq", "seq_len", "out", "produced", "done", "orig") + (("seen",) if self.vocab else ()):
            t = getattr(self, name)
            t[dst] = t[src]
            setattr(self, name, t[:batch])
        self.arange_b = self.arange_b[:batch]
        return dst, src, batch

    def tokens(self) -> list[Tensor]:
        """The new tokens of every prompt row, in the prompts' order."""
        self._save(list(range(self.batch)))
        return list(self.result)


@torch.inference_mode()
def generate(
    target: Decoder | HFDecoder | PreTrainedModel,
    prompt: Tensor | list[Tensor],
    max_new_tokens: int,
    drafter: Drafter | None = None,
    *,
    sampling: SamplingConfig | None = None,
    gamma: int | str = 5,
    verify: str = "block",
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    vocab_size: int | str | None = None,
    timing: bool = False,
    speed_profile: SpeedProfile | None = None,
) -> tuple[list[Tensor], DecodeStats]:
    """Generate up to `max_new_tokens` new tokens per prompt row (a (batch, len) tensor or a list
    of 1-D rows of their own lengths), plainly without a `drafter`, else speculatively with it
    (`DraftModel`, `HeadDrafter`, `TreeDrafter` or `Lookup`: module docstring), sampled as `sampling`
    says (a `sampling.SamplingConfig`; `sampling.GREEDY` is temperature 0; None: temperature 1,
    unfiltered).

    Hugging Face causal LMs are wrapped in `HFDecoder`s; `vocab_size` (an integer, or "min" for
    the smaller head) slices their logits to the vocabulary target and draft share (see `hf.as_decoders`).
    `timing=True` times every model call (perf_counter; synchronised on accelerators) into
    `stats.step_times`, from which `cost.cost_ratios` gives c and v of this very run.

    `gamma="auto"` picks the gamma in 1..8 (1..prophet_train_length - 1 for a prophet) with the
    largest predicted speed-up E(gamma) / (gamma c + v(gamma)) (see `cost.SpeedProfile`): from
    `speed_profile` when given (measured with `cost.measure_costs`, or stored in an export's
    metadata), else by calibrating on the call itself: after the prefill it decodes 3 plain
    steps (their median time is the unit of c and v), then 12 speculative rounds at gammas
    8, 1, 4, 2, 8, 1, ... (`calibration_gammas`), timing every draft step and verify call and
    counting the per-position acceptance (positions 5-8 from the gamma-8 rounds); c and v are
    ratios of medians, v is interpolated between the measured gammas, and the rest is decoded at
    the best gamma, chosen again every 16 rounds from all samples so far (the calls at the chosen
    gamma sharpen its v and the acceptance of its positions). When no gamma is predicted to beat
    plain decoding (a speed-up <= 1: at batch 8 on a 2-core CPU every draft loses), gamma becomes 0
    and the call decodes plainly to its end, no longer feeding the draft. Every calibration token is a real,
    lossless output token. Calibrating times every model call, which on a GPU costs a
    synchronisation per call; a given profile times nothing. `stats.gamma`
    is the gamma chosen; `stats.predicted_speedup` and `stats.measured_speedup` compare.

    A repetition penalty (`sampling.repetition_penalty`, transformers' semantics, see
    `sampling.penalise`) stays lossless: every position, drafted ones included, is processed with
    the context before it (draft position i and the target's verify position that predicts it both
    see prompt + emitted + d_1..d_{i-1}). A `TreeDrafter` verifies its tree in one call per row
    (`decode.tree`: lossless at every temperature, rows one after another); the tree's depth takes
    gamma's place, so gamma must not be "auto", and it takes no repetition penalty or timing.
    `verify` ("block" or "token") picks how a sampled chain is accepted: block verification
    (`decode.block`, the default: lossless, and never fewer tokens per round in expectation) or
    token by token (the module docstring). A tree verifies by block only where its round is a
    single chain (`decode.tree`); greedy decoding accepts the same tokens either way.

    Returns (tokens, stats): one 1-D LongTensor of new tokens per row (cut after eos_id), and a
    `DecodeStats`."""
    check(drafter is None or isinstance(drafter, Drafter),
          f"drafter must be a decode DraftModel, HeadDrafter, TreeDrafter or Lookup, got {type(drafter).__name__}: wrap a "
          f"draft model in DraftModel(model), a draft head in HeadDrafter(head)")
    sampling = SamplingConfig() if sampling is None else sampling
    check(isinstance(sampling, SamplingConfig), f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    head = None if drafter is None else drafter.head
    target, draft = as_decoders(target, None if drafter is None else drafter.model, vocab_size)
    method = check_inputs(target, draft, head, gamma, max_new_tokens, eos_id, speed_profile)
    check(verify in VERIFY, f"verify must be one of {', '.join(VERIFY)}, got {verify!r}")
    check_memory(prompt, max_new_tokens, {"target": target, "draft": draft})
    rows_in = prompt_rows(prompt, target.vocab_size, target.cfg.max_seq_len)
    check_context(rows_in, max_new_tokens, {"target": target, "draft": draft})
    limit = head.prophet_cfg.prophet_train_length - 1 if method == "prophet" else None
    gamma_max = (AUTO_GAMMA_MAX if limit is None else min(AUTO_GAMMA_MAX, limit)) if gamma == AUTO else gamma
    if isinstance(drafter, (TreeDrafter, Lookup)):
        kind = "prompt lookup" if isinstance(drafter, Lookup) else "tree drafting"
        check(gamma != AUTO and speed_profile is None, f"{kind} has its own depth (the tree's or the lookup's): "
                                                       f"gamma='auto' and a speed_profile do not apply")
        check(not sampling.penalised and not timing, f"{kind} does not take a repetition penalty or timing=True")
        tree = drafter.tree
        t0 = time.perf_counter()
        if isinstance(drafter, Lookup):
            stats = DecodeStats(method=drafter.method, batch=len(rows_in), gamma=tree.lookup)
            tokens = lookup_generate(target, rows_in, max_new_tokens, tree, sampling, eos_id, generator, stats,
                                     datastore=drafter.datastore)
        else:
            stats = DecodeStats(method=drafter.method, batch=len(rows_in), gamma=tree.depth)
            tokens = tree_generate(target, head, rows_in, max_new_tokens, tree, sampling, eos_id, generator, stats,
                                   block=verify == "block", datastore=drafter.datastore)
        stats.wall_seconds = time.perf_counter() - t0
        stats.new_tokens = sum(t.numel() for t in tokens)
        return tokens, stats.finish()
    stats = DecodeStats(method=method, batch=len(rows_in), gamma=gamma_max if method != "base" else 0,
                        step_times=StepTimes() if timing else None)
    t0 = time.perf_counter()
    run = _Decoding(target, draft, head, rows_in, max_new_tokens, gamma_max, sampling, eos_id, generator, stats,
                    block=verify == "block")
    if max_new_tokens > 0:
        run.prefill()
        adapt = method != "base" and gamma == AUTO and speed_profile is None
        if method != "base" and gamma == AUTO:
            stats.gamma = gamma = run.choose_gamma(speed_profile)
        rounds = 0
        while not run.finished():
            if method == "base" or gamma == 0:      # gamma 0: auto found no gamma that beats plain decoding
                run.base_step(drafting=False)
                continue
            run.verify(gamma, run.draft_round(gamma))
            rounds += 1
            if adapt and rounds % RECHOOSE_ROUNDS == 0:
                stats.gamma = gamma = run.rechoose(gamma)
        stats.wall_seconds = time.perf_counter() - t0
    tokens = run.rows.tokens()
    run.count_into(stats, tokens)
    return tokens, stats.finish()


def _move_rows(t: Tensor, dst: Tensor, src: Tensor, batch: int) -> Tensor:
    """Rows `src` of t copied into rows `dst`, the first `batch` rows kept (how caches drop finished rows)."""
    if dst.numel():
        t[dst] = t[src]
    return t[:batch]


class _Decoding:
    """The state of one generate call: models, caches, rows, counters and the clock."""

    def __init__(self, target, draft, head, rows_in, max_new, gamma, sampling, eos_id, generator, stats,
                 block: bool = True) -> None:
        self.target, self.draft, self.head = target, draft, head
        self.block = block                                      # sampled chains verified by block
        self.sampling, self.eos_id, self.generator = sampling, eos_id, generator
        self.method = stats.method
        self.stats = stats
        self.device = target.device
        self.clock = Clock(stats.step_times, self.device)
        self.rows = _Rows(rows_in, max_new, gamma, self.device, target.vocab_size if sampling.penalised else None)
        self.cache = self.draft_cache = None
        self.head_next: tuple[Tensor, Tensor] | None = None     # eagle3: (logits of d_1 (b, draft), feature (b, 1, H))
        self.gamma_max = gamma
        self.calibration_samples: dict[str, list[float]] = {}
        # counters kept as tensors on the device: read once at the end, no host sync per round
        self.row_calls = torch.zeros((), dtype=torch.long, device=self.device)
        self.alpha_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.alpha_count = torch.zeros((), dtype=torch.long, device=self.device)
        self.accepted_at = torch.zeros(gamma, dtype=torch.long, device=self.device)
        self.drafted_at = torch.zeros(gamma, dtype=torch.long, device=self.device)

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
            for cache in (self.cache, self.draft_cache):
                if cache is not None:
                    cache.compact_rows(dst, src, batch)
            if self.head_next is not None:
                self.head_next = tuple(_move_rows(t, dst, src, batch) for t in self.head_next)
            self.clock.prefix = TAIL
        return False

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
        self.row_calls += (~self.rows.done).sum()

    def count_into(self, stats: DecodeStats, tokens: list[Tensor]) -> None:
        stats.new_tokens = sum(t.numel() for t in tokens)
        steps = self.calibration_samples.get(TARGET)
        if steps and stats.wall_seconds > 0:
            step = statistics.median(steps)
            # tokens per second per row, over the rate of one token per target step
            stats.measured_speedup = stats.new_tokens / stats.wall_seconds / len(tokens) * step
        stats.row_calls = int(self.row_calls)
        if self.method != "base":
            stats.alpha_sum, stats.alpha_count = float(self.alpha_sum), int(self.alpha_count)
            stats.accepted_at, stats.drafted_at = self.accepted_at.tolist(), self.drafted_at.tolist()
            stats.drafted, stats.accepted = sum(stats.drafted_at), sum(stats.accepted_at)

    def choose_gamma(self, profile: SpeedProfile | None) -> int:
        """The gamma for the rest of the call: the profile's best, calibrating when there is none."""
        if profile is None:
            profile = self.calibrate()
        if profile is None:                      # the call ended (or lost its full batch) first
            return min(5, self.gamma_max)
        return self._adopt(profile)

    def _adopt(self, profile: SpeedProfile) -> int:
        gamma = profile.best_gamma(limit=self.gamma_max, plain=True)
        self.stats.speed_profile = profile.to_dict()
        self.stats.predicted_speedup = profile.predicted(gamma)
        return gamma

    def calibrate(self) -> SpeedProfile | None:
        """Measure c, v and the per-position acceptance on this call's first tokens (see generate)."""
        samples: dict[str, list[float]] = {}
        plain, self.clock = self.clock, Clock(self.stats.step_times, self.device, samples)
        self.clock.prefix = plain.prefix
        try:
            for g in [None] * CALIBRATION_STEPS + calibration_gammas(self.gamma_max):
                if self.finished():
                    return None
                if g is None:
                    self.base_step()
                else:
                    self.verify(g, self.draft_round(g))
        except BaseException:
            plain.prefix, self.clock = self.clock.prefix, plain
            raise
        # the sampling clock stays: the rounds that follow keep adding samples for `rechoose`
        self.calibration_samples = samples
        return self._profile()

    def _profile(self) -> SpeedProfile | None:
        """The speed profile from the samples and acceptance counted so far."""
        accepted, drafted = self.accepted_at.tolist(), self.drafted_at.tolist()
        try:
            acceptance = [a / max(d, 1) for a, d in zip(accepted, drafted)]
            return SpeedProfile.from_samples(self.calibration_samples, acceptance, self.rows.batch)
        except SpecdecError:                     # no full-batch call of some kind was timed
            return None

    def rechoose(self, gamma: int) -> int:
        """The best gamma given every sample so far (the current one when there is no profile)."""
        profile = self._profile()
        return gamma if profile is None else self._adopt(profile)

    def prefill(self) -> None:
        """Right-padded prompts; each row's padding lies past its own length, where no query of
        that row looks, and the cache is rolled back to the real lengths afterwards."""
        rows, target = self.rows, self.target
        b, width = rows.seq.shape[0], int(rows.lens.max())
        padded = rows.seq[:, :width]
        eagle3 = self.method == "eagle3"
        self.cache = target.new_cache(b, rows.capacity, keep_embeds=self.method == "prophet",
                                      **({"keep_layers": self.head.aux_layers} if eagle3 else {}))
        last = self._logits_at(PREFILL, target, padded, self.cache, rows.lens - 1)
        self.cache.rollback(rows.lens)
        self.count_call()
        rows.emit(self.next_tokens(last, rows.context())[:, None], torch.ones_like(rows.lens), self.eos_id)
        if eagle3:
            self.draft_cache = self.head.new_cache(b, rows.capacity)
            self._extend_head(torch.zeros_like(rows.lens))
        if self.method == "draft":
            self.draft_cache = self.draft.new_cache(b, rows.capacity)
            self._logits_at(PREFILL, self.draft, padded, self.draft_cache, rows.lens - 1)
            self.draft_cache.rollback(torch.minimum(self.draft_cache.lengths, rows.lens))
        if self.method == "prophet":
            # one prophet cache for all rounds (each round empties it): S start tokens + gamma tokens
            self.draft_cache = self.head.prophet.new_cache(b, self.head.num_start_tokens + self.gamma_max)
            # the prophet needs S cached target positions per row: decode plainly until there are
            while not self.finished() and int(self.cache.lengths.min()) < self.head.num_start_tokens:
                self.base_step()

    def _logits_at(self, key: str, model, tokens: Tensor, cache, at: Tensor) -> Tensor:
        """Logits (b, vocab) of position at[i] of each row of tokens (b, n), fed to `cache`; a
        Hugging Face model computes its (large) head at those positions only."""
        if isinstance(model, HFDecoder):
            return self.clock(key, model, tokens, cache=cache, logits_at=at).logits[:, 0]
        return self.clock(key, model, tokens, cache=cache).logits[self.rows.arange_b, at]

    def base_step(self, drafting: bool = True) -> None:
        """One plain step: feed each row's pending token, sample the next one. `drafting`: keep
        a draft or EAGLE-3 head in step for later rounds (False once the call decodes plainly to its
        end: gamma 0)."""
        rows = self.rows
        pending = rows.last(1)
        before = self.cache.lengths.clone()
        logits = self._feed(self.target, self.cache, TARGET, pending)
        if drafting and self.draft is not None:   # a draft must not fall behind: its catch-up reads 2 tokens
            self._feed(self.draft, self.draft_cache, DRAFT, pending)
        self.count_call()
        rows.emit(self.next_tokens(logits, rows.context())[:, None], torch.ones_like(rows.lens), self.eos_id)
        if drafting and self.method == "eagle3":
            self._extend_head(before)

    def _extend_head(self, before: Tensor) -> None:
        """Feed an EAGLE-3 head the target's features of the positions its last call committed
        (each row's before[r] .. cache length - 1), with the token after each, and keep the head's
        prediction for the next draft (`head_next`). The head's cache then holds exactly the
        target's committed positions (the drafted ones of the last round are dropped first)."""
        head, rows, cache = self.head, self.rows, self.cache
        feats = cache.layer_states                                     # (b, n, A*H) of positions before ..
        n = feats.shape[1]
        idx = (before[:, None] + 1 + torch.arange(n, device=before.device)).clamp(max=rows.capacity - 1)
        tokens = rows.seq.gather(1, idx)                               # x_{t+1} for each position t
        self.draft_cache.rollback(before)
        last = (cache.lengths - before - 1).clamp(min=0)               # each row's last committed position

        def extend() -> tuple[Tensor, Tensor]:
            h = head.extend(tokens, head.fuse(feats), self.draft_cache)
            f = h[rows.arange_b, last][:, None]
            return head.logits(f[:, 0]), f

        self.head_next = self.clock(DRAFT, extend)
        self.draft_cache.rollback(cache.lengths)

    def _feed(self, model, cache, key: str, tokens: Tensor) -> Tensor:
        """Append tokens (b, 1) to the cache of the unfinished rows; the last logits (b, vocab)."""
        before = cache.lengths.clone()
        logits = self.clock(key, model, tokens, cache=cache).logits[:, -1]
        cache.rollback(torch.where(self.rows.done, before, cache.lengths))
        return logits

    def draft_round(self, gamma: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Propose gamma tokens per row; return (drafts (b, gamma), q (b, gamma, vocab), contexts)
        where q is exactly the distribution each draft token was sampled from, and contexts
        (b, gamma + 1, vocab), with a repetition penalty, the ids before each of the round's
        positions (context + d_1..d_i at position i), which the verify call uses alike. The draft
        keeps its cache across rounds; the prophet's is emptied at each round (its start tokens change)."""
        rows, draft_cache, clock = self.rows, self.draft_cache, self.clock
        if self.method == "eagle3":
            return self._eagle3_round(gamma)
        if self.draft is not None:
            # Catch the draft up: it lags one token after a full acceptance (it never saw d_gamma),
            # so when a row does it re-reads the last two tokens (re-writing a cached position is
            # harmless), else the pending one only.
            n = 2 if bool((draft_cache.lengths < rows.seq_len - 1).any()) else 1
            draft_cache.rollback(rows.seq_len - n)
            model, first, start = self.draft, rows.last(n), None
        else:
            prophet = self.head
            start = prophet.start_tokens(self.cache.last_embeds(prophet.num_start_tokens))
            draft_cache.rollback(torch.zeros_like(draft_cache.lengths))
            model, first = prophet.prophet, rows.last(1)
        kw = {} if start is None else {"start": start}
        logits = clock(DRAFT, model, first, cache=draft_cache, **kw).logits[:, -1]
        return self._sample_drafts(logits, gamma, lambda tok: clock(DRAFT, model, tok[:, None], cache=draft_cache
                                                                     ).logits[:, -1])

    def _eagle3_round(self, gamma: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """`draft_round` for an EAGLE-3 head: d_1 from the prediction the last extension left, then
        each step feeds the drafted token and the head's own feature (see `heads.eagle3`)."""
        head, cache = self.head, self.draft_cache
        logits, feature = self.head_next
        state = [feature]

        def step(tok: Tensor) -> Tensor:
            def call() -> Tensor:
                state[0] = head.extend(tok[:, None], state[0], cache)
                return head.logits(state[0][:, 0])
            return self.clock(DRAFT, call)

        return self._sample_drafts(logits, gamma, step, head=head)

    def _sample_drafts(self, logits: Tensor, gamma: int, step, head: Eagle3Head | None = None
                       ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Draw gamma drafts from the first draft logits (b, vocab) on, `step(token)` giving the
        next logits; (drafts, q, contexts) as `draft_round` returns them. `head`: the logits are an
        EAGLE-3 head's, over its draft vocabulary (`Eagle3Head.to_target_vocab` spreads them).
        Greedy decoding without a repetition penalty builds no q (None): a draft is its model's
        argmax (the head's mapped to the target's id; its draft ids ascend, so ties resolve as
        over the spread logits), which is all `verify` reads at temperature 0."""
        rows = self.rows
        drafts, qs = [], []
        seen, contexts = rows.seen, []                            # seen: (b, vocab + 1) or None
        argmax_only = self.sampling.greedy and not self.sampling.penalised
        for i in range(gamma):
            context = None if seen is None else seen[:, : rows.vocab]
            if argmax_only:
                tok = logits.argmax(-1)
                tok = tok if head is None else head.target_ids(tok)
            else:
                q = to_probs(logits if head is None else head.to_target_vocab(logits), self.sampling, context)
                tok = self.pick(q)
                qs.append(q)
            drafts.append(tok)
            if seen is not None:
                contexts.append(context)
                seen = seen.clone().scatter_(1, tok[:, None], True)
            if i + 1 < gamma:
                logits = step(tok)
        if seen is not None:
            contexts.append(seen[:, : rows.vocab])
        return (torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None,
                torch.stack(contexts, 1) if contexts else None)

    def verify(self, gamma: int, proposal: tuple[Tensor, Tensor | None, Tensor | None]) -> None:
        """Score [pending, drafts] in one target call, accept a prefix per row, emit the accepted
        drafts plus one correction or bonus token, and roll the cache back per row."""
        rows, cache, sampling = self.rows, self.cache, self.sampling
        drafts, q, contexts = proposal                  # (b, g), (b, g, vocab) or None (greedy), (b, g + 1, vocab)
        b, g = drafts.shape
        before = cache.lengths.clone()
        active = ~rows.done
        logits = self.clock(verify_key(g), self.target, torch.cat([rows.last(1), drafts], 1), cache=cache).logits
        self.count_call()
        if sampling.greedy:
            # the target's argmax at each position (no (b, g + 1, vocab) one-hot built): a draft is
            # accepted while it is the argmax, the next token is the argmax after the accepted ones,
            # and sum_x min(p, q) of two one-hots is 1 where they agree
            best = greedy_tokens(logits, sampling, contexts)         # (b, g + 1)
            accept = best[:, :g] == drafts
            prefix = accept.int().cumprod(1)                        # (b, g): 1 while all so far accepted
            k = prefix.sum(1)                                       # accepted drafts per row
            after = best[rows.arange_b, k]
            overlap = accept.float()
        else:
            p = to_probs(logits, sampling, contexts)                # (b, g + 1, vocab)
            u = torch.rand(b, g, device=q.device, generator=self.generator)   # one uniform per position
            if self.block:
                k, final = block_verify(p, q, drafts, u)            # accepted drafts per row, next token's p
                prefix = (torch.arange(g, device=k.device) < k[:, None]).int()
            else:
                # token by token: accept where u < p/q, without dividing
                px = p[:, :g].gather(-1, drafts[..., None])[..., 0]
                prefix = (u * q.gather(-1, drafts[..., None])[..., 0] < px).int().cumprod(1)
                k = prefix.sum(1)
                kc = k.clamp(max=g - 1)
                fix = residual(p[rows.arange_b, kc], q[rows.arange_b, kc])
                final = torch.where((k < g)[:, None], fix, p[:, g])
            after = self.pick(final)
            # alpha: sum_x min(p, q) at each position up to and including the first one not kept
            overlap = torch.minimum(p[:, :g], q).sum(-1)            # (b, g)
        block = torch.cat([drafts, drafts[:, :1]], 1)
        block[rows.arange_b, k] = after
        tested = (torch.arange(g, device=k.device) <= k[:, None]) & active[:, None]
        self.alpha_sum += (overlap * tested).sum()
        self.alpha_count += tested.sum()
        self.accepted_at[:g] += (prefix * active[:, None]).sum(0)
        self.drafted_at[:g] += active.sum()
        rows.emit(block, k + 1, self.eos_id)
        # keep [pending, accepted drafts]; a row cut short by EOS or max_new_tokens keeps less
        cache.rollback(torch.where(active, torch.minimum(before + 1 + k, rows.seq_len - 1), before))
        if self.method == "eagle3":
            self._extend_head(before)
