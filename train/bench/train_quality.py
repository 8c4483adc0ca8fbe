"""Training time-to-quality: wall time of each contender's own train steps until its prophet
reaches a fixed acceptance at temperature 0 on validation text.

The contenders (`train.bench.train_step`: ours, ours with `windows_per_seq`, lucidrains' model as
published and with its feed-forward applied) start from the same weights and train interleaved in one
process, one optimizer step each per batch on the same batches (who goes first rotates, as in
`train_step.interleave`), so load from other processes hits them alike; each accumulates its
own step seconds only. Every `eval_every` steps each contender still short of the threshold is
scored by the same evaluator on the same validation windows, after its weights are mapped into
one `ModelWithProphet` with every window (`lucidrains.copy_weights_to_ours` for lucidrains', whose
published form's missing feed-forward becomes a zero one):

- the quality, `tokens_per_call`: greedy (T=0) acceptance against the validation text itself,
  teacher-forced: a_i = top-1 accuracy of the prophet's drafted position i over every window
  (`prophet.drafted_hits`), and 1 + sum_k prod_{i<=k} a_i the tokens per target call a gamma
  round would emit (`prophet.simulated_tokens_per_call`; docs/DECODING.md);
- for information, the real T=0 acceptance of our lossless `decode.generate` with prophet
  drafting on validation prompts. It cannot be the quality here: the main model is trained
  jointly, and after a few steps main model and prophet both emit the same repeated byte at
  T=0, so acceptance is 1.0 long before either model is any good.

A contender stops training once its quality reaches the threshold; the run stops when all have,
or after `max_steps`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from specdec_models.decode import GREEDY, HeadDrafter, generate
from specdec_models.errors import check
from specdec_models.heads.prophet import ModelWithProphet, drafted_hits, simulated_tokens_per_call

from .lucidrains import copy_weights_to_ours
from .train_step import LUCIDRAINS_VARIANTS, TrainStep, contenders, round_order, size_configs


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
    variants: list[str] = field(default_factory=lambda: list(LUCIDRAINS_VARIANTS))   # lucidrains'
    threshold: float = 1.6          # tokens per call (teacher-forced, T=0, gamma): a contender stops there
    also_report: list[float] = field(default_factory=list)   # lower thresholds read off the same curves
    eval_every: int = 20
    max_steps: int = 200
    gamma: int = 5
    new_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        size_configs(self.size)                 # checks the size's form
        for name in ("seq_len", "batch_size", "eval_every", "max_steps", "gamma", "new_tokens"):
            check(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, f"{name} must be an integer >= 1")
        for t in [self.threshold, *self.also_report]:
            check(1 < t <= 1 + self.gamma, f"threshold must be tokens per call in (1, 1 + gamma], got {t}")
        check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        check(self.gamma <= 6, f"gamma must be <= prophet_train_length - 1 = 6, got {self.gamma}")


def acceptance(net: ModelWithProphet, valid: Tensor, prompts: Tensor, gamma: int, new_tokens: int
               ) -> dict[str, float]:
    """Teacher-forced greedy acceptance on `valid` (k, seq_len + 1) (per-position a_i and tokens
    per call, the quality), and decoding's real T=0 acceptance on `prompts` (k, prompt_len)."""
    modes = net.training
    net.eval()
    try:
        with torch.no_grad():
            out = net(valid)
            a = (drafted_hits(out.prophet_logits, out.labels, gamma) / out.labels.shape[0]).tolist()
            _, stats = generate(net.model, prompts, new_tokens, HeadDrafter(net), gamma=gamma, sampling=GREEDY)
    finally:
        net.train(modes)
    return {"tokens_per_call": simulated_tokens_per_call(a), "per_position_accuracy": a,
            "prophet_loss": float(out.prophet_loss), "main_loss": float(out.main_loss),
            "decode_acceptance_rate": float(stats.acceptance_rate),
            "decode_tokens_per_call": float(stats.tokens_per_call)}


def evaluator(valid: Tensor, prompts: Tensor, gamma: int, new_tokens: int, template: ModelWithProphet
              ) -> Callable[[TrainStep], dict[str, float]]:
    """Score a contender with `acceptance` on one `ModelWithProphet` with every window (template's
    sizes): ours are loaded into it, lucidrains' weights mapped into it."""
    prophet = replace(template.prophet_cfg, windows_per_seq=None)
    scratch = ModelWithProphet(template.main_cfg, prophet)

    def score(step: TrainStep) -> dict[str, float]:
        if isinstance(step.net, ModelWithProphet):
            scratch.load_state_dict(step.net.state_dict())
        else:
            copy_weights_to_ours(scratch, step.net)
        return acceptance(scratch, valid, prompts, gamma, new_tokens)

    return score


def time_to_quality(steps: Sequence[TrainStep], batch_of: Callable[[int], Tensor],
                    score: Callable[[TrainStep], dict[str, Any]], threshold: float, eval_every: int,
                    max_steps: int, metric: str = "tokens_per_call",
                    log: Callable[[str], None] = lambda s: None) -> list[dict[str, Any]]:
    """Train `steps` interleaved on batches `batch_of(k)`; per contender its curve [(step, own
    train seconds, score)] and when (step, seconds) its score's `metric` first reached `threshold`."""
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
            log(f"[step {k + 1}] {steps[i].name}: {metric} {metrics[metric]:.3f} after {seconds:.0f} s")
            rows[i]["reached"] = first_reached(rows[i]["curve"], threshold, metric)
        active = [i for i in active if rows[i]["reached"] is None]
        if not active:
            break
    for row, s in zip(rows, steps, strict=True):
        row["train_seconds"] = sum(s.seconds)
        row["steps"] = len(s.seconds)
    return rows


def first_reached(curve: list[dict[str, Any]], threshold: float, metric: str = "tokens_per_call"
                  ) -> dict[str, Any] | None:
    """The first evaluation (step, train seconds) of `curve` whose `metric` is >= threshold."""
    hit = next((p for p in curve if p[metric] >= threshold), None)
    return None if hit is None else {"step": hit["step"], "train_seconds": hit["train_seconds"]}


def bench_quality(bench: QualityBench, batch_of: Callable[[int], Tensor], valid: Tensor, prompts: Tensor,
                  log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Time-to-quality of ours (every window, then each windows_per_seq) and lucidrains' variants."""
    runners = contenders(bench.size, bench.seq_len, bench.windows_per_seq, bench.variants, bench.optimizer, bench.lr,
                         bench.clip, bench.seed)
    score = evaluator(valid, prompts, bench.gamma, bench.new_tokens, runners[0].net)
    rows = time_to_quality(runners, batch_of, score, bench.threshold, bench.eval_every, bench.max_steps, log=log)
    for t in [bench.threshold, *bench.also_report]:
        for row in rows:
            row.setdefault("by_threshold", {})[str(t)] = first_reached(row["curve"], t)
    return {"mode": "quality", "settings": asdict(bench), "valid": list(valid.shape), "prompts": list(prompts.shape),
            "evaluator": "teacher-forced greedy acceptance on validation windows (drafted_hits, "
                         "simulated_tokens_per_call), and decode.generate T=0; "
                         "lucidrains' mapped into ModelWithProphet",
            "contenders": rows}


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    thresholds = [str(t) for t in [s["threshold"], *s["also_report"]]]
    lines = [f"{s['size']}, seq {s['seq_len']}, batch {s['batch_size']}, {s['optimizer']} lr {s['lr']} "
             f"clip {s['clip']}, fp32; quality: tokens per call at T=0, gamma {s['gamma']}, "
             f"teacher-forced on {report['valid'][0]} "
             f"validation windows of {report['valid'][1]} bytes (stop at {s['threshold']}); evaluated every "
             f"{s['eval_every']} steps (at most {s['max_steps']})", "",
             "| contender | prophet windows / seq | steps | own train seconds | "
             + " | ".join(f"time to {t} (s, x ours)" for t in thresholds)
             + " | last tokens/call | last decode acceptance (T=0) |", "|---" * (6 + len(thresholds)) + "|"]
    ours = report["contenders"][0]["by_threshold"]
    for r in report["contenders"]:
        cells = []
        for t in thresholds:
            hit, base = r["by_threshold"][t], ours[t]
            ratio = f", {hit['train_seconds'] / base['train_seconds']:.2f}x" if hit and base else ""
            cells.append(f"{hit['train_seconds']:.0f} (step {hit['step']}{ratio})" if hit else "not reached")
        nan = float("nan")
        last = r["curve"][-1] if r["curve"] else {"tokens_per_call": nan, "decode_acceptance_rate": nan}
        lines.append(f"| {r['contender']} | {r['prophet_windows_per_seq']} | {r['steps']} | {r['train_seconds']:.0f} | "
                     + " | ".join(cells) + f" | {last['tokens_per_call']:.3f} | {last['decode_acceptance_rate']:.3f} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], f) -> None:
    """Acceptance rate against each contender's own train seconds."""
    from .report import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for r in report["contenders"]:
        label = f"{r['contender']} ({r['prophet_windows_per_seq']} windows/seq)"
        seconds = [p["train_seconds"] for p in r["curve"]]
        axes[0].plot(seconds, [p["tokens_per_call"] for p in r["curve"]], marker="o", markersize=3, label=label)
        axes[1].plot(seconds, [p["decode_acceptance_rate"] for p in r["curve"]], marker="o", markersize=3, label=label)
    axes[0].axhline(report["settings"]["threshold"], color="black", linewidth=0.8, linestyle="--", label="stop")
    axes[0].set_ylabel("tokens per call, T=0, teacher-forced on validation")
    axes[1].set_ylabel("decoding acceptance rate, T=0 (not the quality)")
    for ax in axes:
        ax.set_xlabel("own train-step seconds (interleaved, shared CPU)")
        ax.legend(fontsize=7)
    axes[0].set_title(f"time to quality, {report['settings']['size']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
