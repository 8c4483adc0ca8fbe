"""The cost model of speculative decoding: tokens per target call, the cost ratios c and v, the
predicted speed-up, and the gamma that maximises it.

Leviathan et al. 2022 (sections 3.1 and 3.4); definitions in docs/DECODING.md:
- E(gamma), the expected tokens per target call: the closed form (1 - alpha^(gamma+1)) / (1 - alpha)
  under i.i.d. acceptance, or 1 + sum_{k <= gamma} ppa[k] from measured per-position acceptance
  (ppa[k]: the fraction of rounds whose draft k was accepted, all drafts before it too), which
  needs no i.i.d. assumption (a trained prophet accepts less at later positions);
- c = one draft (or prophet) step / one 1-token target step, and v(gamma) = one verify call of
  gamma + 1 tokens / one 1-token target step;
- the predicted wall-time speed-up E(gamma) / (gamma c + v(gamma)), or E(gamma) / (c + v(gamma)) where
  one draft pass gives all gamma drafts (a block head, `decode.block_draft`: `SpeedProfile.one_pass`).

Times come from two places: `StepTimes`, which `generate(..., timing=True)` fills with the
perf_counter time of every model call, so c and v come from the very runs whose speed they predict;
and `measure_costs`, a micro-benchmark on a KV cache for gammas no run used. `SpeedProfile` holds
c, v(gamma) and the per-position acceptance of one batch size and answers `predicted(gamma)` and
`best_gamma()`; `choose_gamma` is the same as one call, for code that writes a gamma into exports.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import check
from ..heads import Eagle3Head

TARGET, DRAFT, PREFILL, TAIL = "target", "draft", "prefill", "tail/"


def verify_key(gamma: int) -> str:
    """The StepTimes key of verify calls that score gamma drafts (gamma + 1 tokens)."""
    return f"verify/{gamma}"


# ---------------------------------------------------------------- expected tokens, speed-up

def expected_tokens(alpha: float, gamma: int) -> float:
    """E(gamma) = (1 - alpha^(gamma+1)) / (1 - alpha): tokens per target call under i.i.d. acceptance."""
    check(0 <= alpha <= 1, f"alpha must be in [0, 1], got {alpha!r}")
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_tokens_from_acceptance(per_position_acceptance: Sequence[float], gamma: int) -> float:
    """E(gamma) = 1 + sum_{k <= gamma} ppa[k]: each round emits its accepted drafts plus one token."""
    check(len(per_position_acceptance) >= gamma,
          f"per-position acceptance covers {len(per_position_acceptance)} positions, gamma {gamma} needs {gamma}")
    return 1.0 + float(sum(per_position_acceptance[:gamma]))


def predicted_speedup(expected: float, gamma: int, c: float, v: float, one_pass: bool = False) -> float:
    """E / (gamma c + v): a round costs gamma draft steps and one verify call, in target steps;
    E / (c + v) for a drafter whose gamma drafts come from one pass (`one_pass`: a block head)."""
    return expected / ((c if one_pass else gamma * c) + v)


# ---------------------------------------------------------------- step times

@dataclass
class StepTimes:
    """Seconds spent in model calls and how many calls, by kind: "target" (a 1-token target step
    of plain decoding), "draft" (one draft or prophet step), "verify/<gamma>" (a target call
    scoring gamma drafts), "prefill". Calls made after decoding dropped finished rows from the
    batch carry a "tail/" prefix: c and v describe the full batch, so they leave those out (the
    tail still counts in `total` and in the wall time). Sums, so several runs merge by adding."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, seconds: float, calls: int = 1) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.calls[key] = self.calls.get(key, 0) + calls

    def mean(self, key: str) -> float | None:
        """Mean seconds per call of this kind, None when there was none."""
        n = self.calls.get(key, 0)
        return self.seconds[key] / n if n else None

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def verify_gammas(self) -> list[int]:
        return sorted(int(k.split("/")[1]) for k in self.calls if k.startswith("verify/"))

    @classmethod
    def merge(cls, items: Sequence[StepTimes | None]) -> StepTimes:
        out = cls()
        for item in items:
            if item is not None:
                for key, seconds in item.seconds.items():
                    out.add(key, seconds, item.calls[key])
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": dict(self.seconds), "calls": dict(self.calls)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTimes:
        return cls(dict(data["seconds"]), dict(data["calls"]))


class Clock:
    """Times model calls into a StepTimes and/or, call by call, into `samples` (key -> seconds);
    does nothing when given neither. On an accelerator it synchronises before reading the clock,
    so a call's time is its own."""

    def __init__(self, times: StepTimes | None, device: torch.device,
                 samples: dict[str, list[float]] | None = None) -> None:
        self.times = times
        self.samples = samples
        self.prefix = ""                     # TAIL once decoding has dropped finished rows
        self._sync = torch.cuda.synchronize if device.type == "cuda" else None

    def __call__(self, key: str, fn: Callable, *args, **kwargs):
        if self.times is None and self.samples is None:
            return fn(*args, **kwargs)
        if self._sync:
            self._sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if self._sync:
            self._sync()
        seconds, key = time.perf_counter() - t0, self.prefix + key
        if self.times is not None:
            self.times.add(key, seconds)
        if self.samples is not None:
            self.samples.setdefault(key, []).append(seconds)
        return out


def cost_ratios(times: StepTimes, target_times: StepTimes | None = None) -> tuple[float, dict[int, float]]:
    """(c, {gamma: v(gamma)}) from the draft steps and verify calls in `times`, relative to the mean
    1-token target step in `target_times` (a plain decoding run's times; default `times` itself)."""
    step = (target_times or times).mean(TARGET)
    check(step is not None, "no 1-token target step was timed: c and v need one as their unit")
    draft = times.mean(DRAFT)
    check(draft is not None, "no draft step was timed")
    return draft / step, {g: times.mean(verify_key(g)) / step for g in times.verify_gammas()}


def measure_costs(target, batch: int, context: int, gammas: Sequence[int], drafter: Any = None, *,
                  steps: int = 20, warmup: int = 3) -> StepTimes:
    """Time 1-token target steps, verify calls of gamma + 1 tokens for each gamma, and the drafter's
    steps (a `DraftModel`'s or a `HeadDrafter`'s; a block head's one pass) on KV caches filled with `context`
    random tokens, each call rolled back so all see the same length. For gammas a decoding run did
    not use; a run's own `StepTimes` (timed inside `generate`) is the better source for the gamma it ran."""
    # the drafter is told by its method: this module is below the drafters (decode.protocol)
    one_pass = getattr(drafter, "one_pass", False)
    check(drafter is None or one_pass or getattr(drafter, "method", None) in ("draft", "prophet", "eagle3"),
          f"measure_costs times a chain's draft steps: pass a DraftModel or a HeadDrafter, "
          f"not {type(drafter).__name__}")
    draft, prophet = (None, None) if drafter is None else (drafter.model, drafter.head)
    if one_pass:        # a block head: a draft step is its one pass (decode.block_draft)
        draft, prophet, block = None, None, prophet
    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(0, target.vocab_size, (batch, n), generator=g).to(target.device)  # noqa: E731
    times = StepTimes()
    clock = Clock(times, target.device)

    def repeat(key: str, model, cache, tokens: torch.Tensor, **kwargs) -> None:
        lengths = cache.lengths.clone()
        for i in range(warmup + steps):
            if i < warmup:
                model(tokens, cache=cache, **kwargs)
            else:
                clock(key, model, tokens, cache=cache, **kwargs)
            cache.rollback(lengths)

    with torch.inference_mode():
        eagle3 = isinstance(prophet, Eagle3Head)
        taps = prophet.aux_layers if eagle3 else block.aux_layers if one_pass else None
        cache = target.new_cache(batch, context + max(gammas) + 1, keep_embeds=prophet is not None and not eagle3,
                                 **({"keep_layers": taps} if taps else {}))
        target(tok(context), cache=cache)
        context_states = cache.layer_states if taps else None
        repeat(TARGET, target, cache, tok(1))
        for gamma in gammas:
            repeat(verify_key(gamma), target, cache, tok(gamma + 1))
        if draft is not None:
            dcache = draft.new_cache(batch, context + 1)
            draft(tok(context), cache=dcache)
            repeat(DRAFT, draft, dcache, tok(1))
        if one_pass:
            # the head's cache holds the context's target taps; a draft step is one pass over a block
            bcache = block.new_cache(batch, context + 1)
            block.extend(tok(context), context_states, bcache)
            repeat(DRAFT, lambda tokens, cache: block.draft_block(tokens[:, 0], cache), bcache, tok(1))
        if eagle3:
            # the head's cache holds the context's target features; a draft step feeds a token and a feature
            hcache = prophet.new_cache(batch, context + max(gammas) + 1)
            feature = prophet.extend(tok(context), prophet.fuse(context_states), hcache)[:, -1:]

            def step(tokens: torch.Tensor, cache) -> torch.Tensor:
                return prophet.logits(prophet.extend(tokens, feature, cache)[:, -1])

            repeat(DRAFT, step, hcache, tok(1))
        elif prophet is not None:
            # the prophet's cache holds its S start tokens and one round's drafts, as in generate
            S = prophet.num_start_tokens
            start = prophet.start_tokens(cache.last_embeds(S))
            pcache = prophet.prophet.new_cache(batch, S + max(gammas) + 1)
            prophet.prophet(tok(1), start=start, cache=pcache)
            repeat(DRAFT, prophet.prophet, pcache, tok(1))
    return times


# ---------------------------------------------------------------- choosing gamma

@dataclass(frozen=True)
class SpeedProfile:
    """What the speed-up at each gamma depends on, for one batch size: c, v(gamma) for the measured
    gammas (interpolated linearly in between, with v(0) = 1, a 1-token target step) and the
    per-position acceptance. Candidate gammas run from 1 to the largest gamma both cover.

    From a measurement: `SpeedProfile.from_times(stats.step_times, stats.per_position_acceptance,
    batch, base_stats.step_times)` or with `measure_costs`; from an export: `from_dict(metadata[...])`."""

    c: float
    v_by_gamma: dict[int, float]
    per_position_acceptance: tuple[float, ...]
    batch: int | None = None
    one_pass: bool = False            # a round's drafts cost one draft pass (a block head), not gamma

    def __post_init__(self) -> None:
        object.__setattr__(self, "v_by_gamma", {int(g): float(v) for g, v in dict(self.v_by_gamma).items()})
        object.__setattr__(self, "per_position_acceptance", tuple(float(a) for a in self.per_position_acceptance))
        check(isinstance(self.c, (int, float)) and math.isfinite(self.c) and self.c >= 0,
              f"c must be a finite number >= 0, got {self.c!r}")
        check(len(self.v_by_gamma) > 0
              and all(g >= 1 and math.isfinite(v) and v > 0 for g, v in self.v_by_gamma.items()),
              f"v_by_gamma must map gammas >= 1 to costs > 0, got {self.v_by_gamma!r}")
        check(len(self.per_position_acceptance) > 0 and all(0 <= a <= 1 for a in self.per_position_acceptance),
              f"per_position_acceptance must be fractions in [0, 1], got {list(self.per_position_acceptance)!r}")

    @property
    def gamma_max(self) -> int:
        return min(len(self.per_position_acceptance), max(self.v_by_gamma))

    def v(self, gamma: int) -> float:
        """v(gamma): measured, or interpolated between the nearest measured gammas (v(0) = 1), and
        never below 1: a verify call does a plain step's work and more, so a measured v < 1 is timing
        noise (tiny models, a loaded machine), and taken at face value it would predict a gain from
        a draft that is never accepted (E = 1)."""
        check(0 <= gamma <= max(self.v_by_gamma), f"v is known up to gamma {max(self.v_by_gamma)}, not {gamma}")
        known = {0: 1.0, **{g: max(1.0, v) for g, v in self.v_by_gamma.items()}}
        if gamma in known:
            return known[gamma]
        lo = max(g for g in known if g < gamma)
        hi = min(g for g in known if g > gamma)
        return known[lo] + (known[hi] - known[lo]) * (gamma - lo) / (hi - lo)

    def expected_tokens(self, gamma: int) -> float:
        return expected_tokens_from_acceptance(self.per_position_acceptance, gamma)

    def predicted(self, gamma: int) -> float:
        """The predicted speed-up over plain decoding at this gamma (1 at gamma 0: plain decoding)."""
        return predicted_speedup(self.expected_tokens(gamma), gamma, self.c, self.v(gamma), self.one_pass)

    def best_gamma(self, limit: int | None = None, *, plain: bool = False) -> int:
        """The gamma in 1..gamma_max (and <= limit) with the largest predicted speed-up (the
        smaller gamma on a tie). With `plain`, 0 (plain decoding, speed-up 1 by definition) when
        no gamma is predicted to beat it: drafting can lose, e.g. at batch 8 on a CPU, where a
        verify call of 8 x (gamma + 1) tokens costs far more than a step of 8."""
        top = self.gamma_max if limit is None else min(self.gamma_max, limit)
        best = max(range(1, top + 1), key=lambda g: (self.predicted(g), -g))
        return 0 if plain and self.predicted(best) <= 1.0 else best

    @classmethod
    def from_samples(cls, samples: dict[str, list[float]], per_position_acceptance: Sequence[float],
                     batch: int | None = None, one_pass: bool = False) -> SpeedProfile:
        """From call-by-call times (`Clock` samples): medians, so a burst of load on a few calls
        does not move the choice. Keys as in StepTimes; the "tail/" ones are left out."""
        check(bool(samples.get(TARGET)) and bool(samples.get(DRAFT)),
              "the samples need 1-token target steps and draft steps")
        step = statistics.median(samples[TARGET])
        v = {int(k.split("/")[1]): statistics.median(x) / step for k, x in samples.items() if k.startswith("verify/")}
        return cls(statistics.median(samples[DRAFT]) / step, v, tuple(per_position_acceptance), batch, one_pass)

    @classmethod
    def from_times(cls, times: StepTimes, per_position_acceptance: Sequence[float], batch: int | None = None,
                   target_times: StepTimes | None = None, one_pass: bool = False) -> SpeedProfile:
        c, v = cost_ratios(times, target_times)
        return cls(c, v, tuple(per_position_acceptance), batch, one_pass)

    def to_dict(self) -> dict[str, Any]:
        return {"c": self.c, "v_by_gamma": {str(g): v for g, v in sorted(self.v_by_gamma.items())},
                "per_position_acceptance": list(self.per_position_acceptance), "batch": self.batch,
                **({"one_pass": True} if self.one_pass else {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeedProfile:
        check(isinstance(data, dict) and {"c", "v_by_gamma", "per_position_acceptance"} <= set(data),
              "a speed profile needs c, v_by_gamma and per_position_acceptance")
        return cls(data["c"], data["v_by_gamma"], data["per_position_acceptance"], data.get("batch"),
                   bool(data.get("one_pass", False)))


def choose_gamma(per_position_acceptance: Sequence[float], c: float, v_by_gamma: dict[int, float]) -> tuple[int, float]:
    """(gamma, predicted speed-up): the gamma maximising E(gamma) / (gamma c + v(gamma)) given the
    measured per-position acceptance (e.g. from the training evaluation) and cost ratios."""
    profile = SpeedProfile(c, v_by_gamma, tuple(per_position_acceptance))
    gamma = profile.best_gamma()
    return gamma, profile.predicted(gamma)


def stored_profile(metadata: dict[str, Any], temperature: float, batch: int) -> SpeedProfile | None:
    """The speed profile an export's metadata holds for decoding at `temperature` and `batch`:
    from `speed_profiles` (a list of profiles, each with the "temperature" it was measured at, as
    training's evaluation writes them) the nearest temperature, then the nearest batch size;
    else the single `speed_profile`; None when there is none."""
    profiles = metadata.get("speed_profiles")
    if profiles:
        check(isinstance(profiles, list) and all(isinstance(p, dict) and "temperature" in p for p in profiles),
              "metadata speed_profiles must be a list of profiles, each with its temperature")
        best = min(profiles, key=lambda p: (abs(float(p["temperature"]) - temperature),
                                            abs(int(p.get("batch") or 1) - batch)))
        return SpeedProfile.from_dict(best)
    single = metadata.get("speed_profile")
    return None if single is None else SpeedProfile.from_dict(single)
