"""The evaluation's report (specdec evaluate): `evaluation.json`, `evaluation.md` and
`evaluation.png` written into one folder as a whole (`files.staged_dir`).

The report dict holds `results` = {benchmark: {temperature as text ("0", "1"): {part: {category
or "overall": {method: metrics}}}}}, the parts being "acceptance" (`evaluate.acceptance`: tau and
per-position acceptance of each drafter on every prompt) and "speed" (`evaluate.evaluate`: plain
decoding and each drafter, batch 1, timed: tokens/s and speed-up), and `prompts` = {benchmark:
{part: {"prompts", "turns", "ids"}}}, which prompts each part rests on; `parts` says in words how
each part was decoded. Beside them: the command, the date, the host (its CPU and the flags the
CPU corner reads, torch, threads, GPU), the device, the dtype, how the greedy check ran
(`greedy_check`: enforced in fp32, counted in bf16) and, in `settings`, each head's kind, layout,
chain and tree depth (`heads`) and the columns skipped (`skipped`), which the markdown's header
lists. `markdown(report)` renders per benchmark and
temperature a tau table (rows: categories then overall; a column of turns, then each drafter's
tau), the per-position acceptance (overall) and a speed table (plain decoding's tokens/s, then
each drafter's tokens/s and speed-up), each headed by its prompt and turn count; `plot(report,
file)` draws tau and speed-up per method, one panel per benchmark, a bar per temperature.
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


def _rests_on(part: dict) -> str:
    return f"{_prompts(part['prompts'])}, {part['turns']} turn{'s' * (part['turns'] != 1)}"


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown (module docstring)."""
    lines = ["# Evaluation: acceptance length and speed-up", "",
             f"`{report['command']}`", "",
             (f"{report['date']}; device {report['device']}, dtype {report['dtype']}; host {report['host']['cpu']} "
             f"(flags: {', '.join(report['host']['flags']) or 'none of the corner'}), torch {report['torch']}, "
             f"{report['host']['threads']} threads{'; GPU ' + report['gpu'] if report.get('gpu') else ''}."), "",
             ("tau: tokens emitted per target call (prefill and bonus tokens included; plain decoding is 1.00), "
              "from every prompt of the set, decoded by each drafter only. Speed-up: tokens/s over plain "
              "decoding's on the speed prompts, interleaved in one process, batch 1. Prompt lookup "
              "is its own column, never part of a head's tau; NAME+tree+lookup is the head's tree with a "
              "looked-up path."), "",
             f"Greedy check: {report['greedy_check']}.", "", *_head_lines(report)]
    if report.get("resumed"):
        lines += [f"Resumed: {', '.join(report['resumed'])} scored by an earlier run of this command (same "
                  "settings), which was stopped before the report.", ""]
    for bench, by_temperature in report["results"].items():
        for temperature, parts in by_temperature.items():
            lines += [f"## {bench}, T={temperature} ({_prompts(report['prompts'][bench]['acceptance']['prompts'])})",
                      ""]
            lines += _acceptance_lines(bench, temperature, parts["acceptance"], report)
            lines += _speed_lines(bench, temperature, parts["speed"], report)
    return "\n".join(lines).rstrip() + "\n"


def _head_lines(report: dict[str, Any]) -> list[str]:
    """Each head's kind, layout, chain and tree depth, and the columns skipped (reports that record
    them: `eval_job.head_columns`)."""
    heads = report.get("settings", {}).get("heads") or {}
    described = [f"{name}: {h['kind']} ({h['layout']} layout), chain of {h['gamma']}"
                 + (f", tree depth {h['tree_depth']}" if "tree_depth" in h else "")
                 for name, h in heads.items() if isinstance(h, dict)]
    if not described:
        return []
    lines = ["Heads: " + "; ".join(described) + ".", ""]
    skipped = report["settings"].get("skipped") or {}
    if skipped:
        lines += ["Skipped: " + "; ".join(f"{column} ({why})" for column, why in skipped.items()) + ".", ""]
    return lines


def _acceptance_lines(bench: str, temperature: str, by_group: dict, report: dict) -> list[str]:
    drafting = [m for m in methods(report) if m != PLAIN]
    lines = [f"Acceptance ({_rests_on(report['prompts'][bench]['acceptance'])}; drafters only, no timing):", "",
             "| category | turns | " + " | ".join(f"{m} tau" for m in drafting) + " |",
             "|---|---:|" + "---:|" * len(drafting)]
    for group in _groups(by_group):
        row = by_group[group]
        turns = next((row[m]["turns"] for m in drafting if m in row), 0)
        label = f"**{group}**" if group == OVERALL else group
        lines.append(f"| {label} | {turns} | " + " | ".join(_cell(row.get(m), "tau", ".2f") for m in drafting) + " |")
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
    return lines


def _speed_lines(bench: str, temperature: str, by_group: dict, report: dict) -> list[str]:
    drafting = [m for m in methods(report) if m != PLAIN]
    lines = [f"Speed, {bench}, T={temperature} ({_rests_on(report['prompts'][bench]['speed'])}; "
             "plain and each drafter, batch 1, interleaved):", "",
             "| category | plain tokens/s | " + " | ".join(f"{m} tokens/s | {m} speed-up" for m in drafting) + " |",
             "|---|---:|" + "---:|" * (2 * len(drafting))]
    for group in _groups(by_group):
        row = by_group[group]
        cells = [_cell(row.get(PLAIN), "tokens_per_second", ".1f")]
        for m in drafting:
            cells += [_cell(row.get(m), "tokens_per_second", ".1f"), _cell(row.get(m), "speedup", ".2f") + "x"]
        label = f"**{group}**" if group == OVERALL else group
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    overall = by_group[OVERALL]
    mismatched = {m: overall[m]["greedy_mismatches"] for m in drafting
                  if m in overall and overall[m].get("greedy_mismatches")}
    if mismatched:
        lines += ["Turns whose greedy output differed from plain decoding: "
                  + ", ".join(f"{m} {n}" for m, n in mismatched.items()) + ".", ""]
    return lines


def plot(report: dict[str, Any], f: BinaryIO) -> None:
    """tau (top row, the acceptance part) and speed-up (bottom row, the speed part) of each method,
    overall, one column per benchmark, one bar per temperature; PNG into `f`."""
    plt = pyplot()
    names = methods(report)
    benches = list(report["results"])
    fig, axes = plt.subplots(2, len(benches), figsize=(max(6.0, 1.1 * len(names) + 3) * len(benches), 8),
                             squeeze=False)
    for col, bench in enumerate(benches):
        by_temperature = report["results"][bench]
        width = 0.8 / max(len(by_temperature), 1)
        for row, (part, key, label) in enumerate((("acceptance", "tau", "tau (tokens per target call)"),
                                                  ("speed", "speedup", "speed-up over plain decoding (x)"))):
            ax = axes[row][col]
            for j, (temperature, parts) in enumerate(by_temperature.items()):
                overall = parts[part][OVERALL]
                values = [overall[m][key] if m in overall else (1.0 if m == PLAIN else 0.0) for m in names]
                xs = [i + (j - (len(by_temperature) - 1) / 2) * width for i in range(len(names))]
                bars = ax.bar(xs, values, width, label=f"T={temperature}")
                ax.bar_label(bars, fmt="%.2f", fontsize=8)
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
            ax.set_ylim(0, 1.2 * max(ax.get_ylim()[1], 1.0))      # room for the labels and the legend
            ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
            ax.set_ylabel(label)
            title = "tau" if key == "tau" else "speed-up"
            ax.set_title(f"{bench}: {title} ({_rests_on(report['prompts'][bench][part])})")
            ax.legend()
    fig.suptitle(f"{report['device']}, {report['dtype']}; speed batch 1")
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
