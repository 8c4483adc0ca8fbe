"""Plot training runs side by side: each run's validation figures (and a training one) against the
minutes it had trained, read from its output folder (`csv/metrics.csv`, and `train.log` for the time
of each logged step).

    specdec plot --run "1,008 rows=outputs/rows1008" --run "504 rows=outputs/rows504" \\
        --out docs/figures/runs.png [--metric val/ttt_kl/step0 --metric val/simulated_tokens_per_call] \\
        [--train-metric train/kl/step0] [--title TEXT]

Minutes come from the progress lines of train.log (`train.progress`: "step N/..."), from the line
"training starts" on; a run without train.log is plotted against steps instead. A metric a run did
not log is left out of its panel, and one no run logged is refused.
"""

from __future__ import annotations

import csv
import re
import sys
from datetime import datetime
from pathlib import Path

from specdec_models.cli_args import Parser
from specdec_models.errors import check, cli_main, prog
from specdec_models.files import check_output

DEFAULT_METRICS = ["val/ttt_kl/step0", "val/simulated_tokens_per_call"]
LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+)\].*step (\d+)/\d+")


def step_minutes(log: Path) -> dict[int, float]:
    """{step: minutes since training started} from a run's train.log progress lines."""
    found: dict[int, float] = {}
    start = None
    for line in log.read_text(errors="replace").splitlines():
        match = LINE.match(line)
        if not match:
            continue
        when = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(match[2]) / 1000
        start = when if start is None else start
        found[int(match[3])] = (when - start) / 60
    return found


def read_run(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[int, float]]:
    """({metric: [(step, value)]}, {step: minutes}) of a run's output folder."""
    metrics = folder / "csv" / "metrics.csv"
    check(metrics.is_file(), f"{metrics} is missing: --run takes a training run's output_dir (logger=csv)")
    series: dict[str, list[tuple[int, float]]] = {}
    with metrics.open() as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    series.setdefault(key, []).append((int(row["step"]), float(value)))
    log = folder / "train.log"
    return series, step_minutes(log) if log.is_file() else {}


def minutes_at(steps: list[int], known: dict[int, float]) -> list[float] | None:
    """The minutes of each step, interpolated between the logged ones; None without a log."""
    if len(known) < 2:
        return None
    points = sorted(known.items())
    out = []
    for s in steps:
        below = max((p for p in points if p[0] <= s), default=points[0])
        above = min((p for p in points if p[0] >= s), default=points[-1])
        span = above[0] - below[0]
        out.append(below[1] if span == 0 else below[1] + (above[1] - below[1]) * (s - below[0]) / span)
    return out


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog=prog("specdec plot"), description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=DIR",
                        help="a run's label and output folder (repeat)")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--metric", action="append", default=None,
                        help=f"a validation metric, one panel each (default: {' '.join(DEFAULT_METRICS)})")
    parser.add_argument("--train-metric", default=None,
                        help="a training metric drawn dashed in the first panel (e.g. train/kl/step0)")
    parser.add_argument("--title", default=None,
                        help="the plot's title")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    args = parser.parse_args(argv)
    runs = []
    for item in args.run:
        label, sep, folder = item.partition("=")
        check(bool(sep and label and folder), f"--run takes LABEL=DIR, got {item!r}")
        runs.append((label, *read_run(Path(folder))))
    metrics = args.metric or DEFAULT_METRICS
    for metric in metrics + ([args.train_metric] if args.train_metric else []):
        check(any(metric in series for _, series, _ in runs),
              f"no run logged {metric!r}: name a column of the runs' csv/metrics.csv")
    out = Path(args.out)
    check(out.suffix.lower() == ".png", f"--out must name a .png file, got {out}")
    check_output(out, "--out", force=args.force, inputs=[item.partition("=")[2] for item in args.run])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 4), squeeze=False)
    timed = all(len(known) >= 2 for _, _, known in runs)     # every run has a train.log to time its steps
    for ax, metric in zip(axes[0], metrics, strict=True):
        for k, (label, series, known) in enumerate(runs):
            color = f"C{k}"
            for name, style in [(metric, "-o"), *([(args.train_metric, "--")] if args.train_metric and
                                                   ax is axes[0][0] else [])]:
                points = series.get(name)
                if not points:
                    continue
                steps, values = zip(*points, strict=True)
                x = minutes_at(list(steps), known) if timed else list(steps)
                if name != metric:                      # a training metric: a running mean of 10 logs
                    values = [sum(values[max(0, i - 9): i + 1]) / len(values[max(0, i - 9): i + 1])
                              for i in range(len(values))]
                ax.plot(x, values, style, color=color, markersize=3, linewidth=1.2,
                        label=label if name == metric else f"{label} ({name})")
        shown = [v for _, series, _ in runs for _, v in series.get(metric, [])]
        if args.train_metric and ax is axes[0][0] and shown:       # the training curve's start stays off the scale
            ax.set_ylim(0, 1.1 * max(shown))
        ax.set_title(metric)
        ax.set_xlabel("minutes of training" if timed else "step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial.png")
    fig.savefig(partial, dpi=110)
    partial.replace(out)                                    # written whole or not at all
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
