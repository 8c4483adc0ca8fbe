"""The evaluation's report (scripts/evaluate.py): `evaluation.json`, `evaluation.md` and
`evaluation.png` written into one folder as a whole (`files.staged_dir`).

The report dict holds `results` = {benchmark: {temperature as text ("0", "1"): {category or
"overall": {method: metrics}}}} as `evaluate.evaluate` returns them per benchmark, beside the
command, the date, the host (its CPU and the flags the CPU corner reads, torch, threads, GPU), the
device, the dtype and how the greedy check ran (`greedy_check`: enforced in fp32, counted in
bf16). `markdown(report)` renders one table per benchmark and temperature (rows: categories then
overall; columns: plain decoding's tokens/s, then each drafter's tau and speed-up) and one of
per-position acceptance (overall); `plot(report, file)` draws tau and speed-up per method, one
panel per benchmark, a bar per temperature.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, BinaryIO

from specdec_models.files import staged_dir, write_file

from .evaluate import OVERALL, PLAIN
from .report import pyplot

KIND = "evaluation"
NAMES = ("evaluation.json", "evaluation.md", "evaluation.png")


def temperature_key(temperature: float) -> str:
    """A temperature as the report's key: 0 -> "0", 0.7 -> "0.7"."""
    return f"{temperature:g}"


def methods(report: dict[str, Any]) -> list[str]:
    """The methods in the report's order: plain, the heads (and their trees), lookup."""
    return list(report["methods"])


def _groups(by_group: dict[str, dict]) -> list[str]:
    return [g for g in by_group if g != OVERALL] + [OVERALL]


def _cell(metrics: dict | None, key: str, fmt: str) -> str:
    return "-" if metrics is None else format(metrics[key], fmt)


def _prompts(count: int) -> str:
    return f"{count} prompt{'s' * (count != 1)}"


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown (module docstring)."""
    names = methods(report)
    lines = ["# Evaluation: acceptance length and speed-up", "",
             f"`{report['command']}`", "",
             (f"{report['date']}; device {report['device']}, dtype {report['dtype']}; host {report['host']['cpu']} "
             f"(flags: {', '.join(report['host']['flags']) or 'none of the corner'}), torch {report['torch']}, "
             f"{report['host']['threads']} threads{'; GPU ' + report['gpu'] if report.get('gpu') else ''}."), "",
             ("tau: tokens emitted per target call (prefill and bonus tokens included; plain decoding is 1.00). "
             "Speed-up: tokens/s over plain decoding's, interleaved in one process, batch 1. Prompt lookup "
             "is its own column, never part of a head's tau."), "",
             f"Greedy check: {report['greedy_check']}.", ""]
    for bench, by_temperature in report["results"].items():
        for temperature, by_group in by_temperature.items():
            drafting = [m for m in names if m != PLAIN]
            lines += [f"## {bench}, T={temperature} ({_prompts(report['prompts'][bench])})", "",
                      "| category | plain tokens/s | " + " | ".join(f"{m} tau | {m} speed-up" for m in drafting) + " |",
                      "|---|---:|" + "---:|" * (2 * len(drafting))]
            for group in _groups(by_group):
                row = by_group[group]
                cells = [_cell(row.get(PLAIN), "tokens_per_second", ".1f")]
                for m in drafting:
                    cells += [_cell(row.get(m), "tau", ".2f"), _cell(row.get(m), "speedup", ".2f") + "x"]
                label = f"**{group}**" if group == OVERALL else group
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
            lines.append("")
            overall = by_group[OVERALL]
            drafting = [m for m in drafting if m in overall]
            depth = max((len(overall[m]["per_position_acceptance"]) for m in drafting), default=0)
            if depth:
                lines += [(f"Per-position acceptance, {bench}, T={temperature} (overall: accepted at position k "
                          f"/ rounds that drafted k):"), "",
                          "| method | " + " | ".join(str(k + 1) for k in range(depth)) + " |",
                          "|---|" + "---:|" * depth]
                for m in drafting:
                    rates = overall[m]["per_position_acceptance"]
                    lines.append(f"| {m} | " + " | ".join(f"{rates[k]:.2f}" if k < len(rates) else "-"
                                                         for k in range(depth)) + " |")
                lines.append("")
            mismatched = {m: overall[m]["greedy_mismatches"] for m in drafting
                          if overall[m].get("greedy_mismatches")}
            if mismatched:
                lines += ["Turns whose greedy output differed from plain decoding: "
                          + ", ".join(f"{m} {n}" for m, n in mismatched.items()) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict[str, Any], f: BinaryIO) -> None:
    """tau (top row) and speed-up (bottom row) of each method over all the benchmark's prompts,
    one column per benchmark, one bar per temperature; PNG into `f`."""
    plt = pyplot()
    names = methods(report)
    benches = list(report["results"])
    fig, axes = plt.subplots(2, len(benches), figsize=(max(6.0, 1.1 * len(names) + 3) * len(benches), 8),
                             squeeze=False)
    for col, bench in enumerate(benches):
        by_temperature = report["results"][bench]
        width = 0.8 / max(len(by_temperature), 1)
        for row, (key, label) in enumerate((("tau", "tau (tokens per target call)"),
                                            ("speedup", "speed-up over plain decoding (x)"))):
            ax = axes[row][col]
            for j, (temperature, by_group) in enumerate(by_temperature.items()):
                overall = by_group[OVERALL]
                values = [overall[m][key] if m in overall else 0.0 for m in names]
                xs = [i + (j - (len(by_temperature) - 1) / 2) * width for i in range(len(names))]
                bars = ax.bar(xs, values, width, label=f"T={temperature}")
                ax.bar_label(bars, fmt="%.2f", fontsize=8)
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
            ax.set_ylim(0, 1.2 * max(ax.get_ylim()[1], 1.0))      # room for the labels and the legend
            ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
            ax.set_ylabel(label)
            ax.set_title(f"{bench}: {key if key == 'tau' else 'speed-up'} ({_prompts(report['prompts'][bench])})")
            ax.legend()
    fig.suptitle(f"{report['device']}, {report['dtype']}, batch 1")
    fig.tight_layout()
    fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def write(report: dict[str, Any], out: Path) -> list[Path]:
    """Write the three files into `out` as a whole (an old `out` is replaced only once all three
    are written); `check_output(out, ..., kind=KIND)` comes first, before any work."""
    out = Path(out)
    text = markdown(report)
    with staged_dir(out, KIND) as tmp:
        write_file(tmp / NAMES[0], lambda f: f.write((json.dumps(report, indent=2, allow_nan=False) + "\n").encode()))
        write_file(tmp / NAMES[1], lambda f: f.write(text.encode()))
        write_file(tmp / NAMES[2], lambda f: plot(report, f))
    return [out / name for name in NAMES]
