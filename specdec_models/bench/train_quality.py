"""Training time-to-quality: wall time of each contender's own train steps until its prophet
reaches a fixed acceptance at temperature 0 on validation prompts.

The contenders (`bench.train_step`: ours, ours with `windows_per_seq`, the peer as published
and with its feed-forward applied) start from the same weights and train interleaved in one
process, one optimizer step each per batch on the same batches (who goes first rotates, as in
`train_step.interleave`), so load from other processes hits them alike; each accumulates its
own step seconds only. Every `eval_every` steps each contender still short of the threshold is
evaluated by the same evaluator, `acceptance`: our lossless `decode.generate` with prophet
drafting at T=0 (gamma 5) on fixed prompts. A peer's weights are first mapped into a
`ModelWithProphet` (`peer.copy_weights_to_ours`; the published peer's missing feed-forward
becomes a zero one), so every contender is scored by the same decoding code. A contender stops
training once it reaches the threshold; the run stops when all have, or after `max_steps`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ..decode import generate
from ..errors import check
from ..prophet import ModelWithProphet
from .peer import copy_weights_to_ours
from .train_step import PEER_VARIANTS, TrainStep, contenders, round_order, size_configs


@dataclass
class QualityBench:
    """The seed's recipe (Adam, clip 0.5, prophet_train_length 7, 2 start tokens, fp32) at a CPU
    size; lr and steps scaled for a run of minutes."""

    size: str = "256x4+256x1"
    seq_len: int = 256
    batch_size: int = 4
    optimizer: str = "adam"
    lr: float = 1e-3
    clip: float | None = 0.5
    windows_per_seq: list[int] = field(default_factory=lambda: [64])
    peers: list[str] = field(default_factory=lambda: list(PEER_VARIANTS))
    threshold: float = 0.4          # acceptance rate (accepted / drafted) at T=0
    eval_every: int = 20
    max_steps: int = 200
    gamma: int = 5
    new_tokens: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        size_configs(self.size)                 # checks the size's form
        for name in ("seq_len", "batch_size", "eval_every", "max_steps", "gamma", "new_tokens"):
            check(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, f"{name} must be an integer >= 1")
        check(0 < self.threshold <= 1, f"threshold must be an acceptance rate in (0, 1], got {self.threshold}")
        check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        check(self.gamma <= 6, f"gamma must be <= prophet_train_length - 1 = 6, got {self.gamma}")


def acceptance(net: ModelWithProphet, prompts: Tensor, gamma: int, new_tokens: int) -> dict[str, float]:
    """Prophet drafting at T=0 on `prompts` (k, prompt_len): acceptance rate and tokens per call."""
    modes = net.training
    net.eval()
    try:
        with torch.no_grad():
            _, stats = generate(net.model, prompts, new_tokens, prophet=net, gamma=gamma, temperature=0.0)
    finally:
        net.train(modes)
    return {"acceptance_rate": float(stats.acceptance_rate), "tokens_per_call": float(stats.tokens_per_call)}


def evaluator(prompts: Tensor, gamma: int, new_tokens: int, template: ModelWithProphet
              ) -> Callable[[TrainStep], dict[str, float]]:
    """Score a contender with `acceptance`; a peer's weights go into a copy of `template` first."""
    scratch = ModelWithProphet(template.main_cfg, template.prophet_cfg)

    def score(step: TrainStep) -> dict[str, float]:
        net = step.net if isinstance(step.net, ModelWithProphet) else copy_weights_to_ours(scratch, step.net)
        return acceptance(net, prompts, gamma, new_tokens)

    return score


def time_to_quality(steps: Sequence[TrainStep], batch_of: Callable[[int], Tensor],
                    score: Callable[[TrainStep], dict[str, float]], threshold: float, eval_every: int,
                    max_steps: int, log: Callable[[str], None] = lambda s: None) -> list[dict[str, Any]]:
    """Train `steps` interleaved on batches `batch_of(k)`; per contender its curve [(step, own
    train seconds, metrics)] and when (step, seconds) its acceptance rate first reached `threshold`."""
    rows = [{"contender": s.name, "prophet_windows_per_seq": s.windows, "curve": [], "reached": None}
            for s in steps]
    active = list(range(len(steps)))
    for k in range(max_steps):
        batch = batch_of(k)
        for i in round_order(len(active), k):
            steps[active[i]].step(batch)
        if (k + 1) % eval_every and k + 1 < max_steps:
            continue
        for i in active:
            metrics = score(steps[i])
            seconds = sum(steps[i].seconds)
            rows[i]["curve"].append({"step": k + 1, "train_seconds": seconds, **metrics})
            log(f"[step {k + 1}] {steps[i].name}: acceptance {metrics['acceptance_rate']:.3f} after {seconds:.0f} s")
            if metrics["acceptance_rate"] >= threshold:
                rows[i]["reached"] = {"step": k + 1, "train_seconds": seconds}
        active = [i for i in active if rows[i]["reached"] is None]
        if not active:
            break
    for row, s in zip(rows, steps):
        row["train_seconds"] = sum(s.seconds)
        row["steps"] = len(s.seconds)
    return rows


def bench_quality(bench: QualityBench, batch_of: Callable[[int], Tensor], prompts: Tensor,
                  log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Time-to-quality of ours (every window, then each windows_per_seq) and the peer variants."""
    runners = contenders(bench.size, bench.seq_len, bench.windows_per_seq, bench.peers, bench.optimizer, bench.lr,
                         bench.clip, bench.seed)
    score = evaluator(prompts, bench.gamma, bench.new_tokens, runners[0].net)
    rows = time_to_quality(runners, batch_of, score, bench.threshold, bench.eval_every, bench.max_steps, log)
    ours = rows[0]["reached"]
    for row in rows:
        if ours and row["reached"]:
            row["time_over_ours"] = row["reached"]["train_seconds"] / ours["train_seconds"]
    return {"mode": "quality", "settings": asdict(bench), "prompts": list(prompts.shape),
            "evaluator": "specdec_models.decode.generate, prophet drafting, T=0, peers mapped into ModelWithProphet",
            "contenders": rows}


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [f"{s['size']}, seq {s['seq_len']}, batch {s['batch_size']}, {s['optimizer']} lr {s['lr']} clip {s['clip']}, "
             f"fp32; threshold: acceptance rate >= {s['threshold']} at T=0, gamma {s['gamma']}, "
             f"{report['prompts'][0]} validation prompts x {s['new_tokens']} new tokens, evaluated every "
             f"{s['eval_every']} steps (at most {s['max_steps']})", "",
             "| contender | prophet windows / seq | steps to threshold | train seconds to threshold | "
             "time / ours | last acceptance |", "|---|---|---|---|---|---|"]
    for r in report["contenders"]:
        hit = r["reached"]
        last = r["curve"][-1]["acceptance_rate"] if r["curve"] else float("nan")
        ratio = f"{r['time_over_ours']:.2f}x" if "time_over_ours" in r else "-"
        seconds = f"{hit['train_seconds']:.0f}" if hit else f"> {r['train_seconds']:.0f}"
        lines.append(f"| {r['contender']} | {r['prophet_windows_per_seq']} | {hit['step'] if hit else 'not reached'} "
                     f"| {seconds} | {ratio} | {last:.3f} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], f) -> None:
    """Acceptance rate against each contender's own train seconds."""
    from .report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in report["contenders"]:
        ax.plot([p["train_seconds"] for p in r["curve"]], [p["acceptance_rate"] for p in r["curve"]], marker="o",
                markersize=3, label=f"{r['contender']} ({r['prophet_windows_per_seq']} windows/seq)")
    ax.axhline(report["settings"]["threshold"], color="black", linewidth=0.8, linestyle="--", label="threshold")
    ax.set_xlabel("own train-step seconds (interleaved, shared CPU)")
    ax.set_ylabel("prophet acceptance rate, T=0")
    ax.set_title(f"time to quality, {report['settings']['size']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
