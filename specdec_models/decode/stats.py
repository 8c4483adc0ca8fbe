"""`DecodeStats`: what a `generate` call did (docs/DECODING.md defines the metrics), and how the
stats of several calls merge into one."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import check
from .cost import StepTimes

# the bins of a tree node's cumulative draft probability q in `DecodeStats.nodes_by_q`: [0, 0.01),
# [0.01, 0.02), ..., [0.7, 1]
NODE_Q_EDGES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7)


def node_q_bins() -> list[str]:
    """The bins' labels: '<0.01', '0.01-0.02', ..., '>=0.7'."""
    edges = [f"{e:g}" for e in NODE_Q_EDGES]
    return [f"<{edges[0]}"] + [f"{a}-{b}" for a, b in itertools.pairwise(edges)] + [f">={edges[-1]}"]


@dataclass
class DecodeStats:
    """What one `generate` call (or several, merged) did. See docs/DECODING.md for the metric
    definitions.

    target_calls counts batched target forward passes (the prefill included); tokens_per_call is
    emitted tokens / row-calls (each active row's share of those passes), so it includes the
    bonus or correction token and equals 1 for plain decoding. per_position_acceptance[k] is the
    fraction of row-rounds that drafted position k + 1 and accepted it (and all before it).
    step_times holds the time of every model call when `generate(..., timing=True)`. With
    `gamma="auto"`, gamma is the gamma chosen, speed_profile what it was chosen from (a
    `cost.SpeedProfile` as a dict), predicted_speedup its prediction at that gamma, and
    measured_speedup (when generate calibrated) the call's tokens/s over plain decoding's model
    rate, batch / (its timed 1-token target step): neither counts plain decoding's own overhead.
    Tree drafting also counts its head's verified nodes by their cumulative draft probability q
    (`nodes_by_q[i]`, bins split at `NODE_Q_EDGES`) and how many of them the target accepted
    (`accepted_by_q[i]`): where the head's q tracks acceptance, these say which nodes pay for their
    place in the verify call (`TreeSpec`'s `min_prob` and `keep`)."""

    method: str
    batch: int | None
    gamma: int | None
    new_tokens: int = 0
    target_calls: int = 0
    row_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float | None = None
    tokens_per_call: float = 0.0
    alpha: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    tokens_per_second: float = 0.0
    step_times: StepTimes | None = None
    speed_profile: dict | None = None
    predicted_speedup: float | None = None
    measured_speedup: float | None = None
    # raw counters the rates above derive from (summed by `merge`)
    alpha_sum: float = 0.0
    alpha_count: int = 0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    nodes_by_q: list[int] = field(default_factory=list)        # tree drafting: head nodes per q bin
    accepted_by_q: list[int] = field(default_factory=list)     # and those accepted

    _INTERNAL = ("alpha_sum", "alpha_count", "accepted_at", "drafted_at")

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in self._INTERNAL}
        d["step_times"] = None if self.step_times is None else self.step_times.to_dict()
        return d

    def finish(self) -> DecodeStats:
        """Derive the rates from the counters; returns self."""
        self.tokens_per_call = self.new_tokens / max(self.row_calls, 1)
        self.tokens_per_second = self.new_tokens / max(self.wall_seconds, 1e-9)
        if self.method != "base":
            self.acceptance_rate = self.accepted / max(self.drafted, 1)
            self.alpha = self.alpha_sum / self.alpha_count if self.alpha_count else None
            self.per_position_acceptance = [a / max(d, 1)
                                            for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]
        return self

    @classmethod
    def merge(cls, items: Sequence[DecodeStats]) -> DecodeStats:
        """One DecodeStats for several generate calls of one method: counts, times and wall time
        add up and the rates are derived again (e.g. tokens_per_second = all tokens / all seconds).
        batch, gamma and the gamma choice stay when all calls agree, else they are None."""
        check(len(items) > 0, "nothing to merge")
        methods = {s.method for s in items}
        check(len(methods) == 1, f"cannot merge stats of different methods: {sorted(methods)}")
        def same(name: str):
            values = [getattr(s, name) for s in items]
            return values[0] if all(v == values[0] for v in values) else None

        out = cls(method=items[0].method, batch=same("batch"), gamma=same("gamma"),
                  speed_profile=same("speed_profile"), predicted_speedup=same("predicted_speedup"),
                  measured_speedup=same("measured_speedup"))
        for name in ("new_tokens", "target_calls", "row_calls", "drafted", "accepted", "wall_seconds",
                     "alpha_sum", "alpha_count"):
            setattr(out, name, sum(getattr(s, name) for s in items))
        # per-position and per-bin counts, summed position by position (a shorter list counts 0 beyond its end)
        for name in ("accepted_at", "drafted_at", "nodes_by_q", "accepted_by_q"):
            counts = [getattr(s, name) for s in items]
            setattr(out, name, [sum(c[i] for c in counts if i < len(c)) for i in range(max(map(len, counts)))])
        if any(s.step_times is not None for s in items):
            out.step_times = StepTimes.merge([s.step_times for s in items])
        return out.finish()
