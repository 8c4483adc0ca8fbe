"""Benchmark plain vs speculative decoding (draft model and prophet) on CPU, and check the timings
against the closed form of docs/DECODING.md.

Run `python scripts/bench_decode.py` (about 1-3 minutes on 2 cores): a target of the seed's size
(vocab 256, dim 512, depth 10, 8 heads of 64), a prophet (dim 512, depth 2) and a draft decoder
(dim 256, depth 2), all randomly initialised, decode a fixed prompt at batch 1 and 8 in fp32 under
`torch.inference_mode`. With random weights every distribution is nearly uniform, so acceptance is
high and means nothing about trained models: the speed-ups only show what the decoding machinery
costs and gains at that acceptance. Pass `--target-export DIR` (a model_with_prophet export
benchmarks its prophet too) and `--draft-export DIR` to benchmark trained weights instead. For each
setting it reports tokens/s, the speed-up over base decoding at the same batch, tokens per target
call, alpha, the acceptance rate, the measured cost ratios c (one draft or prophet step / one
1-token target step) and v (a verify step of gamma + 1 tokens / one 1-token target step), timed
directly on the models with a KV cache, and the predicted speed-up E / (gamma c + v) with
E = (1 - alpha^(gamma+1)) / (1 - alpha). It writes bench/decode.json and bench/decode.png (a bar
plot of measured and predicted speed-ups) and prints a markdown table. Repeats run round-robin
over the settings and report medians, so a burst of load from other processes hits all settings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from specdec_models import Decoder, ModelConfig, ModelWithProphet, ProphetConfig, SpecdecError, export_hash, load_export
from specdec_models.decode import generate

REPO = Path(__file__).resolve().parents[1]
TARGET = ModelConfig(vocab_size=256, dim=512, depth=10, heads=8, dim_head=64)
PROPHET = ProphetConfig(model=ModelConfig(vocab_size=256, dim=512, depth=2, heads=8, dim_head=64))
DRAFT = ModelConfig(vocab_size=256, dim=256, depth=2, heads=4, dim_head=64)
PROMPT = b"Speculative decoding: a small model drafts, the large model verifies in one pass. "


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-export", metavar="DIR", help="trained target (decoder or model_with_prophet)")
    parser.add_argument("--draft-export", metavar="DIR", help="trained draft decoder (needs --target-export)")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--cost-steps", type=int, default=30, help="timed calls per model to measure c and v")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "decode.json",
                        help="JSON output; the PNG goes next to it (default bench/decode.json)")
    args = parser.parse_args(argv)
    if args.draft_export and not args.target_export:
        parser.error("--draft-export needs --target-export (a trained draft against a random target means nothing)")
    for name in ("gamma", "max_new_tokens", "repeats", "cost_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batch) < 1:
        parser.error("--batch sizes must be >= 1")
    return args


def build_models(args: argparse.Namespace) -> tuple[Decoder, Decoder | None, ModelWithProphet | None, str]:
    """(target, draft or None, prophet or None, a description of the weights)."""
    if args.target_export is None:
        torch.manual_seed(args.seed)
        prophet = ModelWithProphet(TARGET, PROPHET).eval()
        draft = Decoder(DRAFT).eval()
        return prophet.model, draft, prophet, f"random init (seed {args.seed}): acceptance is meaningless"
    exported = load_export(args.target_export)
    prophet = exported if isinstance(exported, ModelWithProphet) else None
    target = exported.model if prophet is not None else exported
    weights = f"target export {args.target_export} (sha256 {export_hash(args.target_export)[:12]})"
    draft = None
    if args.draft_export:
        draft = load_export(args.draft_export)
        draft = draft.model if isinstance(draft, ModelWithProphet) else draft
        weights += f", draft export {args.draft_export} (sha256 {export_hash(args.draft_export)[:12]})"
    return target, draft, prophet, weights


# ---------------------------------------------------------------- cost ratios c and v

def _median_call_seconds(call: Callable[[], None], steps: int) -> float:
    for _ in range(3):       # warm-up: allocator, kernels' first-call setup
        call()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step_on_cache(model: Decoder, cache, tokens: torch.Tensor) -> Callable[[], None]:
    """A call that appends `tokens` to a filled cache and rolls back, so every call sees the same length."""
    lengths = cache.lengths.clone()

    def call() -> None:
        model(tokens, cache=cache)
        cache.rollback(lengths)

    return call


def measure_costs(target: Decoder, draft: Decoder | None, prophet: ModelWithProphet | None, batch: int,
                  context: int, gamma: int, steps: int) -> dict[str, float]:
    """Median seconds of one target step (1 token), one verify step (gamma + 1 tokens), one draft
    step and one prophet step, each on a KV cache filled with `context` positions, as in decoding."""
    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(0, target.vocab_size, (batch, n), generator=g)   # noqa: E731
    cache = target.new_cache(batch, context + gamma + 1)
    target(tok(context), cache=cache)
    costs = {"target_step_s": _median_call_seconds(_step_on_cache(target, cache, tok(1)), steps),
             "verify_step_s": _median_call_seconds(_step_on_cache(target, cache, tok(gamma + 1)), steps)}
    if draft is not None:
        dcache = draft.new_cache(batch, context + gamma + 1)
        draft(tok(context), cache=dcache)
        costs["draft_step_s"] = _median_call_seconds(_step_on_cache(draft, dcache, tok(1)), steps)
    if prophet is not None:
        # the prophet's cache holds S start tokens and the drafts of one round (as in generate)
        S = prophet.num_start_tokens
        start = prophet.start_tokens(target.hidden(tok(S)))                           # (b, S, prophet dim)
        pcache = prophet.prophet.new_cache(batch, S + gamma + 1)
        prophet.prophet(tok(1), start=start, cache=pcache)
        costs["prophet_step_s"] = _median_call_seconds(_step_on_cache(prophet.prophet, pcache, tok(1)), steps)
    return costs


def predicted_speedup(alpha: float | None, gamma: int, c: float, v: float) -> tuple[float | None, float | None]:
    """(E, E / (gamma c + v)): expected tokens per target call and the predicted wall-time speed-up."""
    if alpha is None:
        return None, None
    E = gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return E, E / (gamma * c + v)


# ---------------------------------------------------------------- decoding runs

def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    # other processes on a small machine distort every timing: record the load so readers can judge
    load_before = os.getloadavg()[0]
    target, draft, prophet, weights = build_models(args)
    methods = ["base"] + (["draft"] if draft is not None else []) + (["prophet"] if prophet is not None else [])
    prompt = torch.tensor([list(PROMPT)])
    kwargs = {"draft": {"draft": draft}, "prophet": {"prophet": prophet}, "base": {}}

    def decode(method: str, batch: int, max_new: int, seed: int):
        return generate(target, prompt.expand(batch, -1), max_new, gamma=args.gamma, temperature=args.temperature,
                        generator=torch.Generator().manual_seed(seed), **kwargs[method])

    settings = [(b, m) for b in args.batch for m in methods]
    for batch, method in settings:                      # warm-up, untimed
        decode(method, batch, 2 * (args.gamma + 1), args.seed)
    runs: dict[tuple[int, str], list] = {s: [] for s in settings}
    for r in range(args.repeats):
        for batch, method in settings:
            runs[(batch, method)].append(decode(method, batch, args.max_new_tokens, args.seed + r)[1])
            print(f"  repeat {r + 1}/{args.repeats} batch {batch} {method}: "
                  f"{runs[(batch, method)][-1].tokens_per_second:.1f} tokens/s", file=sys.stderr)

    context = len(PROMPT) + args.max_new_tokens // 2          # the mean context length of a run
    costs = {b: measure_costs(target, draft, prophet, b, context, args.gamma, args.cost_steps) for b in args.batch}

    results = []
    for batch, method in settings:
        stats = [s.to_dict() for s in runs[(batch, method)]]
        row: dict[str, Any] = {
            "batch": batch, "method": method,
            "tokens_per_second": statistics.median(s["tokens_per_second"] for s in stats),
            "wall_seconds": statistics.median(s["wall_seconds"] for s in stats),
            "tokens_per_call": statistics.mean(s["tokens_per_call"] for s in stats),
            "runs": stats,
        }
        if method != "base":
            alpha = statistics.mean(s["alpha"] for s in stats if s["alpha"] is not None)
            cost = costs[batch]
            c = cost[f"{method}_step_s"] / cost["target_step_s"]
            v = cost["verify_step_s"] / cost["target_step_s"]
            E, predicted = predicted_speedup(alpha, args.gamma, c, v)
            row.update(alpha=alpha, acceptance_rate=statistics.mean(s["acceptance_rate"] for s in stats),
                       per_position_acceptance=[statistics.mean(p) for p in
                                                zip(*(s["per_position_acceptance"] for s in stats))],
                       c=c, v=v, expected_tokens_per_call=E, predicted_speedup=predicted)
        results.append(row)
    for row in results:
        base = next(r for r in results if r["batch"] == row["batch"] and r["method"] == "base")
        row["speedup"] = row["tokens_per_second"] / base["tokens_per_second"]
        if row.get("predicted_speedup"):
            row["measured_over_predicted"] = row["speedup"] / row["predicted_speedup"]

    return {
        "weights": weights,
        "configs": {"target": target.cfg.to_dict(), "draft": None if draft is None else draft.cfg.to_dict(),
                    "prophet": None if prophet is None else prophet.prophet_cfg.to_dict()},
        "settings": {"gamma": args.gamma, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                     "repeats": args.repeats, "prompt": PROMPT.decode(), "prompt_tokens": len(PROMPT),
                     "cost_context": context, "dtype": "float32", "device": "cpu",
                     "threads": torch.get_num_threads(), "torch": torch.__version__,
                     "machine": platform.machine(), "processor": platform.processor() or None,
                     "cpu_count": os.cpu_count(), "load_average_1min": [load_before, os.getloadavg()[0]]},
        "costs": {str(b): c for b, c in costs.items()},
        "results": results,
    }


# ---------------------------------------------------------------- reporting

def markdown_table(report: dict[str, Any]) -> str:
    s = report["settings"]
    fmt = lambda x, spec=".2f": "–" if x is None else format(x, spec)  # noqa: E731
    lines = [f"Weights: {report['weights']}.",
             f"gamma {s['gamma']}, {s['max_new_tokens']} new tokens, temperature {s['temperature']}, fp32 CPU, "
             f"{s['threads']} threads, torch {s['torch']}, median of {s['repeats']} runs; 1-min load average "
             f"{s['load_average_1min'][0]:.1f} before, {s['load_average_1min'][1]:.1f} after on "
             f"{s['cpu_count']} CPUs (a load above the idle level means other processes skewed the timings).",
             "",
             "| batch | method | tokens/s | speed-up | tokens/call | E(alpha) | alpha | acceptance rate | c | v "
             "| predicted | measured/predicted |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        lines.append(
            f"| {r['batch']} | {r['method']} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x "
            f"| {r['tokens_per_call']:.2f} | {fmt(r.get('expected_tokens_per_call'))} | {fmt(r.get('alpha'), '.3f')} "
            f"| {fmt(r.get('acceptance_rate'), '.3f')} | {fmt(r.get('c'), '.3f')} | {fmt(r.get('v'))} "
            f"| {fmt(r.get('predicted_speedup'))}{'x' if r.get('predicted_speedup') else ''} "
            f"| {fmt(r.get('measured_over_predicted'))} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["method"] != "base"]
    if not rows:
        return
    labels = [f"{r['method']}\nbatch {r['batch']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 4))
    ax.bar([i - 0.2 for i in x], [r["speedup"] for r in rows], width=0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["predicted_speedup"] for r in rows], width=0.4, label="predicted E/(γc+v)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("speed-up over base decoding")
    ax.set_title(f"γ={report['settings']['gamma']}, {report['weights'].split(':')[0]}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with torch.inference_mode():
            report = run_benchmark(args)
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(markdown_table(report))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
