"""Decoding benchmark: plain, draft-model and prophet decoding (and lucidrains' prophet decoding)
side by side in one process, interleaved, with the cost ratios measured inside the same runs.

For each batch size the settings run round-robin (base, draft, prophet, lucidrains, lucidrains+ff, base,
draft, ...), so a burst of load from other processes hits every setting alike; each repeat's
stats are merged (`DecodeStats.merge`). c and v come from the very runs they predict:
`generate(timing=True)` times every model call, c = mean draft (or prophet) step / mean 1-token
target step of the base runs, v = mean verify call / the same step. The prediction is
E / (gamma c + v) with E = 1 + sum_{k <= gamma} ppa[k] from the run's per-position acceptance
(`decode.cost`), so measured / predicted isolates what the cost model leaves out: sampling,
acceptance and cache bookkeeping (their share of the wall time is reported too).

With random weights (the default: the seed's sizes, target 512 x 10, prophet 512 x 2, draft
256 x 2) every distribution is nearly uniform, so acceptance is high and means nothing about
trained models: the speed-ups show what the machinery costs and gains at that acceptance.
lucidrains' model (`train.bench.lucidrains`) gets our prophet model's weights and the same temperature and
top-k, so both sample from the same distributions.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from specdec_models.config import ModelConfig, ProphetConfig
from specdec_models.decode import DecodeStats, DraftModel, HeadDrafter, SamplingConfig, generate
from specdec_models.decode.cost import (
    DRAFT,
    TARGET,
    expected_tokens_from_acceptance,
    predicted_speedup,
    stored_profile,
    verify_key,
)
from specdec_models.errors import check
from specdec_models.export import export_hash, load_export, read_export_config
from specdec_models.heads.prophet import ModelWithProphet
from specdec_models.model import Decoder

from .report import pyplot
from .report import write_report as report_files

SEED_TARGET = ModelConfig(vocab_size=256, dim=512, depth=10, heads=8, dim_head=64)
SEED_PROPHET = ProphetConfig(model=ModelConfig(vocab_size=256, dim=512, depth=2, heads=8, dim_head=64))
SEED_DRAFT = ModelConfig(vocab_size=256, dim=256, depth=2, heads=4, dim_head=64)
PROMPT = b"Speculative decoding: a small model drafts, the large model verifies in one pass. "
METHODS = ("base", "draft", "prophet", "lucidrains")
LUCIDRAINS_VARIANTS = ("lucidrains", "lucidrains+ff")       # as published; with the feed-forward blocks applied


@dataclass
class DecodeBench:
    """What to run. gammas may hold "auto" (generate calibrates and picks gamma from its own
    measurements) and "stored" (gamma auto from the speed profile training's evaluation stored in
    the target export, `cost.stored_profile`: no calibration)."""

    batches: list[int] = field(default_factory=lambda: [1, 8])
    methods: list[str] = field(default_factory=lambda: ["base", "draft", "prophet"])
    gammas: list[int | str] = field(default_factory=lambda: [5])
    max_new_tokens: int = 200
    repeats: int = 3
    temperature: float = 1.0
    top_k: int | None = None
    seed: int = 0
    target_export: str | None = None
    draft_export: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "repeats"):
            check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        check(len(self.batches) > 0 and min(self.batches) >= 1, f"batch sizes must be >= 1, got {self.batches}")
        unknown = sorted(set(self.methods) - set(METHODS))
        check(not unknown, f"unknown method(s) {unknown}; known: {list(METHODS)}")
        check(all(g in ("auto", "stored") or (isinstance(g, int) and g >= 1) for g in self.gammas),
              f"gammas must be integers >= 1, 'auto' or 'stored', got {self.gammas}")
        check("stored" not in self.gammas or self.target_export is not None,
              "gamma 'stored' reads the speed profile of a trained export: give target_export")
        check(self.draft_export is None or self.target_export is not None,
              "a draft export needs a target export (a trained draft against a random target means nothing)")


@dataclass
class Models:
    target: Decoder
    draft: Decoder | None
    prophet: ModelWithProphet | None
    weights: str
    metadata: dict[str, Any] = field(default_factory=dict)      # the target export's


def build_models(bench: DecodeBench) -> Models:
    """Random models of the seed's sizes, or the given exports."""
    if bench.target_export is None:
        torch.manual_seed(bench.seed)
        prophet = ModelWithProphet(SEED_TARGET, SEED_PROPHET).eval()
        draft = Decoder(SEED_DRAFT).eval() if "draft" in bench.methods else None
        return Models(prophet.model, draft, prophet, f"random init (seed {bench.seed}): acceptance is meaningless")
    exported = load_export(bench.target_export)
    prophet = exported if isinstance(exported, ModelWithProphet) else None
    target = exported.model if prophet is not None else exported
    weights = f"target export {bench.target_export} (sha256 {export_hash(bench.target_export)[:12]})"
    draft = None
    if bench.draft_export:
        draft = load_export(bench.draft_export)
        draft = draft.model if isinstance(draft, ModelWithProphet) else draft
        weights += f", draft export {bench.draft_export} (sha256 {export_hash(bench.draft_export)[:12]})"
    metadata = read_export_config(bench.target_export).get("metadata", {})
    check("stored" not in bench.gammas or stored_profile(metadata, bench.temperature, 1) is not None,
          f"gamma 'stored': {bench.target_export} holds no speed profile (exports of training runs with the "
          f"evaluation callback's choose_gamma do)")
    return Models(target.eval(), draft, prophet, weights, metadata)


def _settings(bench: DecodeBench, models: Models) -> list[tuple[str, int | str | None]]:
    """(method, gamma) pairs of one round-robin, base first."""
    out: list[tuple[str, int | str | None]] = [("base", None)]
    for method in ("draft", "prophet"):
        available = models.draft if method == "draft" else models.prophet
        if method in bench.methods and available is not None:
            # a prophet trained for L positions drafts at most L - 1 (generate refuses more)
            top = models.prophet.prophet_cfg.prophet_train_length - 1 if method == "prophet" else None
            out += [(method, g) for g in bench.gammas if isinstance(g, str) or top is None or g <= top]
    if "lucidrains" in bench.methods and models.prophet is not None:
        out += [(v, g) for v in LUCIDRAINS_VARIANTS for g in bench.gammas if isinstance(g, int)]
    return out


def run(bench: DecodeBench, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """Run the benchmark; return the report (see `markdown` for what it holds)."""
    load_before = os.getloadavg()[0]
    models = build_models(bench)
    settings = _settings(bench, models)
    theirs = {}
    if any(m in LUCIDRAINS_VARIANTS for m, _ in settings):
        from .lucidrains import build_lucidrains, copy_weights

        p = models.prophet
        theirs = {v: copy_weights(build_lucidrains(p.main_cfg, p.prophet_cfg, v == "lucidrains+ff"), p).eval()
                 for v in LUCIDRAINS_VARIANTS}
    prompt = torch.tensor([list(PROMPT)], device=models.target.device)

    def decode(method: str, gamma, batch: int, max_new: int, seed: int):
        rows = prompt.expand(batch, -1)
        if method in LUCIDRAINS_VARIANTS:
            from .lucidrains import lucidrains_prophet_decode

            return lucidrains_prophet_decode(theirs[method], rows, max_new, gamma, bench.temperature, bench.top_k, seed)
        drafter = {"draft": lambda: DraftModel(models.draft), "prophet": lambda: HeadDrafter(models.prophet),
                   "base": lambda: None}[method]()
        profile = stored_profile(models.metadata, bench.temperature, batch) if gamma == "stored" else None
        gamma = 5 if gamma is None else "auto" if gamma == "stored" else gamma
        return generate(models.target, rows, max_new, drafter, gamma=gamma, speed_profile=profile,
                        sampling=SamplingConfig(bench.temperature, top_k=bench.top_k),
                        generator=torch.Generator().manual_seed(seed), timing=True)[1]

    results = []
    with torch.inference_mode():
        for batch in bench.batches:
            for method, gamma in settings:                   # warm-up, untimed
                decode(method, gamma, batch, 16, bench.seed)
            runs: dict[tuple, list] = {s: [] for s in settings}
            for r in range(bench.repeats):
                for method, gamma in settings:
                    out = decode(method, gamma, batch, bench.max_new_tokens, bench.seed + r)
                    runs[(method, gamma)].append(out)
                    rate = (out.tokens_per_second if isinstance(out, DecodeStats)
                            else batch * bench.max_new_tokens / out[1])
                    log(f"  batch {batch} repeat {r + 1}/{bench.repeats} {method} gamma {gamma}: {rate:.1f} tokens/s")
            results += _rows(batch, runs, bench)
    return {
        "weights": models.weights,
        "configs": {"target": models.target.cfg.to_dict(),
                    "draft": None if models.draft is None else models.draft.cfg.to_dict(),
                    "prophet": None if models.prophet is None else models.prophet.prophet_cfg.to_dict()},
        "settings": {**asdict(bench), "prompt": PROMPT.decode(), "prompt_tokens": len(PROMPT),
                     "dtype": str(next(models.target.parameters()).dtype).removeprefix("torch."),
                     "device": str(models.target.device), "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count(),
                     "load_average_1min": [load_before, os.getloadavg()[0]]},
        "results": results,
    }


def _rows(batch: int, runs: dict[tuple, list], bench: DecodeBench) -> list[dict[str, Any]]:
    """One report row per setting of this batch size, from its merged runs."""
    base = DecodeStats.merge(runs[("base", None)])
    step = base.step_times.mean(TARGET)
    rows = []
    for (method, gamma), outs in runs.items():
        row: dict[str, Any] = {"batch": batch, "method": method, "gamma": gamma}
        if method in LUCIDRAINS_VARIANTS:
            seconds = sum(o[1] for o in outs)
            row.update(tokens_per_second=batch * bench.max_new_tokens * len(outs) / seconds,
                       accepted_per_round=sum(o[2] for o in outs) / len(outs),
                       runs_tokens_per_second=[batch * bench.max_new_tokens / o[1] for o in outs])
            ours = runs.get(("prophet", gamma))
            if ours:
                merged = DecodeStats.merge(ours)
                row["ours_tokens_per_second"] = merged.tokens_per_second
                row["ours_over_lucidrains"] = merged.tokens_per_second / row["tokens_per_second"]
                row["ours_accepted_per_round"] = merged.accepted / max(merged.drafted / merged.gamma, 1)
        else:
            s = DecodeStats.merge(outs)
            model_seconds = s.step_times.total
            row.update(tokens_per_second=s.tokens_per_second, tokens_per_call=s.tokens_per_call,
                       non_model_share=1 - model_seconds / s.wall_seconds, target_step_s=step,
                       runs_tokens_per_second=[o.tokens_per_second for o in outs])
            if method != "base":
                row.update(_prediction(s, step, outs))
        row["speedup"] = row["tokens_per_second"] / base.tokens_per_second
        if row.get("predicted_speedup"):
            row["measured_over_predicted"] = row["speedup"] / row["predicted_speedup"]
        rows.append(row)
    return rows


def _prediction(s: DecodeStats, step: float, outs: list[DecodeStats]) -> dict[str, Any]:
    """c, v and the predicted speed-up of a speculative setting, from its own timed calls.
    With gamma "auto" each run may settle on another gamma: the prediction weighs the gammas
    by the verify calls made at each."""
    t = s.step_times
    c = t.mean(DRAFT) / step
    gammas = t.verify_gammas()
    calls = sum(t.calls[verify_key(g)] for g in gammas)
    # a round at gamma g costs g c + v(g) target steps and yields E(g) tokens: average over rounds
    share = {g: t.calls[verify_key(g)] / calls for g in gammas}
    v = {g: t.mean(verify_key(g)) / step for g in gammas}
    tokens = sum(share[g] * expected_tokens_from_acceptance(s.per_position_acceptance, g) for g in gammas)
    mean_gamma, mean_v = sum(share[g] * g for g in gammas), sum(share[g] * v[g] for g in gammas)
    chosen = sorted({o.gamma for o in outs})
    out = {"alpha": s.alpha, "acceptance_rate": s.acceptance_rate, "per_position_acceptance": s.per_position_acceptance,
           "c": c, "v_by_gamma": v, "expected_tokens_per_call": tokens, "gammas_used": chosen,
           "predicted_speedup": predicted_speedup(tokens, mean_gamma, c, mean_v)}
    return out


# ---------------------------------------------------------------- reporting

def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    fmt = lambda x, spec=".2f": "–" if x is None else format(x, spec)  # noqa: E731
    lines = [f"Weights: {report['weights']}.",
             f"{s['max_new_tokens']} new tokens per row, temperature {s['temperature']}, top_k {s['top_k']}, "
             f"{s['dtype']} on {s['device']}, {s['threads']} threads, torch {s['torch']}; {s['repeats']} repeats "
             f"interleaved, merged; 1-min load average {s['load_average_1min'][0]:.1f} before, "
             f"{s['load_average_1min'][1]:.1f} after on {s['cpu_count']} CPUs.",
             "",
             "| batch | method | gamma | tokens/s | speed-up | tokens/call | E | alpha | c | v | predicted "
             "| measured/predicted | non-model time |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        if r["method"] in LUCIDRAINS_VARIANTS:
            continue
        v = "/".join(f"{x:.2f}" for x in r["v_by_gamma"].values()) if r.get("v_by_gamma") else "–"
        gamma = r["gamma"] if isinstance(r["gamma"], int) or r["gamma"] is None else \
            f"{r['gamma']} (" + ",".join(map(str, r["gammas_used"])) + ")"
        lines.append(
            f"| {r['batch']} | {r['method']} | {fmt(gamma, '')} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x "
            f"| {r['tokens_per_call']:.2f} | {fmt(r.get('expected_tokens_per_call'))} | {fmt(r.get('alpha'), '.3f')} "
            f"| {fmt(r.get('c'), '.3f')} | {v} "
            f"| {fmt(r.get('predicted_speedup'))} | {fmt(r.get('measured_over_predicted'))} "
            f"| {100 * r['non_model_share']:.1f}% |")
    versus = [r for r in report["results"] if r["method"] in LUCIDRAINS_VARIANTS]
    if versus:
        lines += ["", "| batch | lucidrains | gamma | lucidrains tokens/s | ours (prophet) tokens/s "
                      "| ours / lucidrains | lucidrains accepted/round | ours accepted/round |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in versus:
            lines.append(f"| {r['batch']} | {r['method']} | {r['gamma']} | {r['tokens_per_second']:.1f} "
                         f"| {fmt(r.get('ours_tokens_per_second'), '.1f')} | {fmt(r.get('ours_over_lucidrains'))}x "
                         f"| {r['accepted_per_round']:.2f} | {fmt(r.get('ours_accepted_per_round'))} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], f: BinaryIO) -> None:
    """Measured and predicted speed-ups per setting, and ours / lucidrains', as a PNG into `f`."""
    plt = pyplot()
    spec = [r for r in report["results"] if r.get("predicted_speedup")]
    versus = [r for r in report["results"] if r.get("ours_over_lucidrains")]
    panels = 1 + bool(versus)
    fig, axes = plt.subplots(1, panels, figsize=(max(6, 1.3 * len(spec) + 2) + 4 * (panels - 1), 4), squeeze=False)
    ax = axes[0][0]
    x = range(len(spec))
    ax.bar([i - 0.2 for i in x], [r["speedup"] for r in spec], width=0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["predicted_speedup"] for r in spec], width=0.4, label="predicted E/(γc+v)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), [f"{r['method']} γ={r['gamma']}\nbatch {r['batch']}" for r in spec], fontsize=8)
    ax.set_ylabel("speed-up over plain decoding")
    ax.set_title(report["weights"].split(":")[0], fontsize=9)
    ax.legend()
    if versus:
        ax = axes[0][1]
        ax.bar(range(len(versus)), [r["ours_over_lucidrains"] for r in versus], color="tab:green")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(versus)), [f"vs {r['method']}\nbatch {r['batch']}" for r in versus], fontsize=8)
        ax.set_ylabel("ours / lucidrains' tokens per second (prophet)")
    fig.tight_layout()
    fig.savefig(f, dpi=120, format="png")
    plt.close(fig)


def write_report(report: dict[str, Any], out: Path) -> list[Path]:
    """Write OUT.json, OUT.md and OUT.png next to each other (each atomically); return the paths."""
    return report_files(report, out, markdown(report), plot)
