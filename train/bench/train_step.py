"""Training-step benchmark: our joint train step against lucidrains', side by side in one process.

Each contender is one `TrainStep` (a model, its optimizer, and a loss function of a batch): ours
(`ModelWithProphet`, every prophet window or `windows_per_seq` random ones) and lucidrains'
`ModelWithProphetWrapper` (`train.bench.lucidrains`), as published and with its feed-forward blocks applied.
All start from the same weights (ours, copied into lucidrains') and train on the same batches. A
step is forward + backward (+ gradient clipping when asked) + optimizer step, fp32.

`interleave` runs the steps round-robin, rotating who goes first each round (A B C, B C A,
C A B, ...), so a burst of load from other processes on a shared machine hits every contender
alike; ratios are medians of per-round ratios of step times, never divided by figures recorded
in another run.

Windows per sequence: both sides train the prophet on `ProphetConfig.anchor_count(seq_len)`
windows of a sequence of seq_len + 1 tokens (lucidrains' `seq_len + 1 - L - (S - 1)` is the same
count), unless ours samples `windows_per_seq`. A window of ours runs S + L - 1 positions and
scores L labels; lucidrains' runs L - 1 positions (S start tokens, L - S - 1 tokens) and scores
L - 1 labels (its first start token's output included, so only L - 2 past the anchor against
ours L), so ours does slightly more work per window.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from specdec_models.config import ModelConfig, ProphetConfig
from specdec_models.errors import check
from specdec_models.heads.prophet import ModelWithProphet

from .lucidrains import build_lucidrains, copy_weights

# the benchmarked sizes, "main dim x depth + prophet dim x depth" (the seed's is the second)
SIZES = ("256x4+256x1", "512x10+512x2")
LUCIDRAINS_VARIANTS = {"lucidrains": False, "lucidrains+ff": True}       # name -> patched_ff
_SIZE = re.compile(r"(\d+)x(\d+)\+(\d+)x(\d+)")


def size_configs(size: str, windows_per_seq: int | None = None, max_seq_len: int = 1024,
                 vocab_size: int = 256) -> tuple[ModelConfig, ProphetConfig]:
    """(main, prophet) configs of a size "DxN+DxM" (main dim x depth + prophet dim x depth; heads
    of 64, or one head of D below 64), prophet_train_length 7 and 2 leading start tokens as the seed."""
    match = _SIZE.fullmatch(size)
    check(match is not None, f"size {size!r} is not of the form DxN+DxM (main dim x depth + prophet dim x depth), "
                             f"e.g. {SIZES[1]}")
    dim, depth, prophet_dim, prophet_depth = map(int, match.groups())
    check(min(dim, depth, prophet_dim, prophet_depth) >= 1, f"size {size!r}: dims and depths must be >= 1")

    def model(d: int, n: int, length: int) -> ModelConfig:
        head = min(d, 64)
        check(d % head == 0, f"size {size!r}: dim {d} is not a multiple of the head size 64")
        return ModelConfig(vocab_size=vocab_size, dim=d, depth=n, heads=d // head, dim_head=head, max_seq_len=length)

    prophet = ProphetConfig(model=model(prophet_dim, prophet_depth, 64), prophet_train_length=7,
                            num_leading_start_tokens=2, windows_per_seq=windows_per_seq)
    return model(dim, depth, max_seq_len), prophet


@dataclass
class TrainStep:
    """One contender: `loss(batch)` gives the loss tensor; `step(batch)` runs one optimizer step
    and records its wall time in `seconds`."""

    name: str
    net: nn.Module
    loss: Callable[[Tensor], Tensor]
    optimizer: torch.optim.Optimizer
    windows: int                      # prophet windows trained per sequence
    clip: float | None = None
    seconds: list[float] = field(default_factory=list)

    def step(self, batch: Tensor) -> float:
        t0 = time.perf_counter()
        loss = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.clip)
        self.optimizer.step()
        self.seconds.append(time.perf_counter() - t0)
        return float(loss.detach())


def make_optimizer(net: nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    check(name in ("adam", "adamw"), f"optimizer must be adam or adamw, got {name!r}")
    return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(net.parameters(), lr=lr)


def ours(name: str, net: ModelWithProphet, seq_len: int, optimizer: str = "adamw", lr: float = 1e-4,
         clip: float | None = None, seed: int = 0) -> TrainStep:
    """Our joint train step; `windows_per_seq` anchors come from a generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    cfg = net.prophet_cfg
    windows = cfg.anchor_count(seq_len) if cfg.windows_per_seq is None else min(cfg.windows_per_seq,
                                                                                 cfg.anchor_count(seq_len))
    return TrainStep(name, net.train(), lambda b: net(b, generator=generator).loss, make_optimizer(net, optimizer, lr),
                     windows, clip)


def lucidrains(name: str, like: ModelWithProphet, patched_ff: bool, seq_len: int, optimizer: str = "adamw",
               lr: float = 1e-4, clip: float | None = None) -> TrainStep:
    """lucidrains' `ModelWithProphetWrapper` train step at `like`'s sizes, starting from its weights."""
    net = copy_weights(build_lucidrains(like.main_cfg, like.prophet_cfg, patched_ff), like).train()
    return TrainStep(name, net, lambda b: net(b)[0], make_optimizer(net, optimizer, lr),
                     like.prophet_cfg.anchor_count(seq_len), clip)


def contenders(size: str, seq_len: int, windows_per_seq: Sequence[int] = (),
               variants: Sequence[str] = tuple(LUCIDRAINS_VARIANTS),
               optimizer: str = "adamw", lr: float = 1e-4, clip: float | None = None, seed: int = 0) -> list[TrainStep]:
    """Ours (every window, then each `windows_per_seq`), then lucidrains' `variants`, all from the same
    initial weights (torch seeded with `seed`)."""
    for name in variants:
        check(name in LUCIDRAINS_VARIANTS,
              f"unknown lucidrains variant {name!r}: choose from {', '.join(LUCIDRAINS_VARIANTS)}")
    main, prophet = size_configs(size, max_seq_len=max(1024, seq_len))
    check(prophet.anchor_count(seq_len) >= 1, f"seq_len {seq_len} holds no prophet window of {prophet.window_len}")
    torch.manual_seed(seed)
    base = ModelWithProphet(main, prophet)
    out = [ours("ours", base, seq_len, optimizer, lr, clip, seed)]
    for k in windows_per_seq:
        net = ModelWithProphet(main, size_configs(size, k, max_seq_len=main.max_seq_len)[1])
        net.load_state_dict(base.state_dict())
        out.append(ours(f"ours wps={k}", net, seq_len, optimizer, lr, clip, seed))
    for name in variants:
        out.append(lucidrains(name, base, LUCIDRAINS_VARIANTS[name], seq_len, optimizer, lr, clip))
    return out


def round_order(n: int, r: int) -> list[int]:
    """Who steps in round r: all n contenders, starting with contender r mod n."""
    return [(r + i) % n for i in range(n)]


def interleave(steps: Sequence[TrainStep], batches: Iterable[Tensor], warmup: int = 1) -> list[list[float]]:
    """One step of every contender per batch, in `round_order`; the first `warmup` rounds are not
    kept. Returns the kept rounds' step seconds, [round][contender]."""
    rounds = []
    for r, batch in enumerate(batches):
        for i in round_order(len(steps), r):
            steps[i].step(batch)
        if r >= warmup:
            rounds.append([s.seconds[-1] for s in steps])
    check(len(rounds) > 0, f"no timed rounds: give more than warmup = {warmup} batches")
    return rounds


def step_rows(steps: Sequence[TrainStep], rounds: list[list[float]], tokens_per_step: int) -> list[dict]:
    """Per contender: median step time, tokens/s, and ours-over-it ratio (median over rounds of
    its step time / ours), ours being the first contender."""
    rows = []
    for i, s in enumerate(steps):
        times = [r[i] for r in rounds]
        rows.append({"contender": s.name, "prophet_windows_per_seq": s.windows,
                     "seconds_per_step": statistics.median(times), "step_seconds": times,
                     "tokens_per_second": tokens_per_step / statistics.median(times)})
    for i, row in enumerate(rows):
        # every contender against every one of ours: median of the paired per-round ratios
        row["speedup_over"] = {other["contender"]: statistics.median(r[j] / r[i] for r in rounds)
                               for j, other in enumerate(rows) if j != i}
    return rows


def bench_steps(size: str, batch_of: Callable[[int], Tensor], seq_len: int = 512, batch_size: int = 4,
                windows_per_seq: Sequence[int] = (), variants: Sequence[str] = tuple(LUCIDRAINS_VARIANTS),
                steps: int = 4, warmup: int = 1, seed: int = 0) -> dict:
    """Our train step (fp32 AdamW) against lucidrains' `variants` at `size`, interleaved over `warmup + steps`
    batches from `batch_of(k)` (each (batch_size, seq_len + 1))."""
    check(steps >= 1 and warmup >= 0, f"steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    shape = tuple(batch_of(0).shape)
    check(shape == (batch_size, seq_len + 1), f"batches are {shape}, expected (batch_size, seq_len + 1) = "
                                              f"{(batch_size, seq_len + 1)}")
    runners = contenders(size, seq_len, windows_per_seq, variants, seed=seed)
    batches = (batch_of(k) for k in range(warmup + steps))
    rounds = interleave(runners, batches, warmup)
    return {"size": size, "seq_len": seq_len, "batch_size": batch_size, "steps": steps, "warmup": warmup,
            "contenders": step_rows(runners, rounds, batch_size * seq_len)}


def markdown(report: dict) -> str:
    """One table per size: tokens/s per contender and ours over each lucidrains variant."""
    lines = []
    for size in report["sizes"]:
        rows = size["contenders"]
        theirs = [r["contender"] for r in rows if r["contender"] in LUCIDRAINS_VARIANTS]
        lines += [f"{size['size']}: seq {size['seq_len']}, batch {size['batch_size']}, fp32 AdamW, "
                  f"{size['steps']} interleaved rounds after {size['warmup']} warm-up", "",
                  "| contender | prophet windows / seq | s / step (median) | tokens/s | "
                  + " | ".join(f"ours / {p}" for p in theirs) + " |", "|---" * (4 + len(theirs)) + "|"]
        for r in rows:
            ratios = " | ".join("-" if r["contender"] in LUCIDRAINS_VARIANTS else f"{r['speedup_over'][p]:.2f}x"
                                for p in theirs)
            lines.append(f"| {r['contender']} | {r['prophet_windows_per_seq']} | {r['seconds_per_step']:.2f} | "
                         f"{r['tokens_per_second']:,.0f} | {ratios} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def plot(report: dict, f) -> None:
    """Ours (each variant) over each lucidrains variant, per size."""
    from .report import pyplot

    plt = pyplot()
    bars = [(f"{r['contender']}\n/ {p}\n{s['size']}", r["speedup_over"][p]) for s in report["sizes"]
            for r in s["contenders"] if r["contender"] not in LUCIDRAINS_VARIANTS
            for p in r["speedup_over"] if p in LUCIDRAINS_VARIANTS]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(bars)), 4))
    ax.bar(range(len(bars)), [b[1] for b in bars], color="tab:green")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.set_ylabel("train-step speed, ours / lucidrains' (median of rounds)")
    fig.tight_layout()
    fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
