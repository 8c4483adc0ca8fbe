"""Drafters of one Hugging Face target side by side: tokens per target call and wall-clock speed-up.

`compare_drafters(target, prompts, drafters)` decodes the same prompts plainly and with each
drafter (`generate`'s keyword arguments: {"drafter": HeadDrafter(head)} or {"drafter":
DraftModel(model)}, or {"prompt_lookup": n}: transformers' own prompt-lookup decoding,
`generate(prompt_lookup_num_tokens=n)`, which needs no training and decodes one row at a time, so
it runs at batch 1 only, as does tree drafting, {"drafter": TreeDrafter(head, TreeSpec(...))}), at each
temperature and batch size, interleaved round by round and, within a round, batch by batch (base,
A, B, ... on the first batch of prompts, then on the next: at batch 1 even one round interleaves
prompt by prompt) in one process, so each speed-up is a ratio of runs that saw the same machine
load: the median over rounds of (drafter tokens/s) / (plain tokens/s), each over the round's
batches (plain seconds / drafter seconds where every row emits the same tokens). Tokens per call,
per-position acceptance, acceptance rate and alpha are exact counts over the same runs (every
round, at temperature 1 with another seed); prompt lookup's target calls are counted with a forward
hook. Without `eos_id` every row emits exactly `max_new_tokens` tokens, so the times compare; with
it every method stops a row at that token, as a user's decoding does (a chat answer ends at
`<|im_end|>`), and each speed-up is a ratio of token rates (at T > 0 the methods' answers differ in
length). A drafter's keyword arguments may hold its own "gamma" (each drafter at the gamma that
suits its cost and acceptance).

`compare_hf(loaded, target, prompt_sets, HFDrafters(...), CompareSettings(...))` is the
comparison of specdec bench compare-hf-drafts: the drafters of one Hugging Face target (eagle3 heads
in any layout, a prophet head, a distilled student, prompt lookup, an untrained head) on each
prompt set, then greedy exactness in fp32. `greedy_matches_transformers` checks greedy output
against transformers' own `generate()`; `write_report` writes results.json, table.md
(`markdown_table`) and compare.png (`plot`, matplotlib) together. `first_layers`
(`train.bench.hf`) makes the student a distilled draft starts from (specdec bench compare-hf-drafts).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdec_models.cpu import prepare_for_device
from specdec_models.decode import DraftModel, HeadDrafter, SamplingConfig, TreeDrafter, generate
from specdec_models.errors import check
from specdec_models.files import staged_dir

from .report import pyplot

COUNTS = ("new_tokens", "target_calls", "row_calls", "drafted", "accepted", "alpha_sum", "alpha_count")


def _decode(target: Any, prompts: list[Tensor], batch: int, kwargs: dict[str, Any], seed: int,
            **settings: Any) -> tuple[float, dict[str, Any], list[list[int]]]:
    """Decode `prompts` in batches of `batch`; (seconds, summed counts of the DecodeStats (and
    per-position accepted_at / drafted_at), new tokens per row). A "target" in `kwargs` decodes with
    that model in place of `target` (the same target in another dtype)."""
    if "target" in kwargs:
        target, kwargs = kwargs["target"], {k: v for k, v in kwargs.items() if k != "target"}
    if "prompt_lookup" in kwargs:
        return _prompt_lookup(target, prompts, kwargs["prompt_lookup"], seed, **settings)
    sampling = SamplingConfig(settings["temperature"])
    settings = {k: v for k, v in settings.items() if k != "temperature"} | {"sampling": sampling}
    counts: dict[str, Any] = {key: 0.0 for key in COUNTS}
    counts.update(accepted_at=[], drafted_at=[], nodes_by_q=[], accepted_by_q=[])
    rows: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        generator = torch.Generator(device=target.device).manual_seed(seed + i)
        tokens, stats = generate(target, prompts[i:i + batch], generator=generator, **{**settings, **kwargs})
        rows.extend(t.tolist() for t in tokens)
        for key in COUNTS:
            counts[key] += float(getattr(stats, key))
        for key in ("accepted_at", "drafted_at", "nodes_by_q", "accepted_by_q"):
            counts[key] = _add(counts[key], getattr(stats, key))
    return time.perf_counter() - t0, counts, rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _add(a: list[int], b: list[int]) -> list[int]:
    width = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(width)]


def _prompt_lookup(target: Any, prompts: list[Tensor], n: int, seed: int, *, max_new_tokens: int,
                   temperature: float, gamma: int = 5, vocab_size: int | None = None,
                   eos_id: int | None = None) -> tuple[float, dict, list]:
    """transformers' prompt-lookup decoding of each prompt alone (its assisted generation takes
    one row), stopped at `eos_id` like the other methods; the target's forward calls are counted
    with a hook (the prefill is one, as in `generate`'s row_calls)."""
    from transformers import GenerationConfig

    # without eos_id exactly max_new_tokens like the other methods: a stop id no token has
    # (min_new_tokens would instead mask the EOS logit, which changes greedy output where EOS is the argmax)
    stop = int(target.get_output_embeddings().weight.shape[0]) + 1 if eos_id is None else eos_id
    sample = temperature > 0
    config = GenerationConfig(**{**target.generation_config.to_dict(), "max_new_tokens": max_new_tokens,
                                 "prompt_lookup_num_tokens": n, "do_sample": sample, "eos_token_id": stop,
                                 "pad_token_id": stop, "temperature": temperature if sample else None,
                                 "top_k": None, "top_p": None, "repetition_penalty": None})
    calls = [0]
    hook = target.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    rows: list[list[int]] = []
    try:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            torch.manual_seed(seed + i)
            ids = p[None].to(target.device)
            out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            rows.append(out[0, p.numel():].tolist())
        seconds = time.perf_counter() - t0
    finally:
        hook.remove()
    counts = {key: 0.0 for key in COUNTS}
    counts.update(new_tokens=float(sum(len(r) for r in rows)), target_calls=float(calls[0]), row_calls=float(calls[0]),
                  accepted_at=[], drafted_at=[])
    return seconds, counts, rows


@dataclass(frozen=True)
class RaceSettings:
    """How `compare_drafters` decodes: chains of `gamma` (a drafter's own "gamma" wins),
    `max_new_tokens` per row, each row stopped at `eos_id` (None: never), logits over the first
    `vocab_size` tokens (None: all), `rounds` interleaved rounds, draws seeded from `seed`."""

    gamma: int = 5
    max_new_tokens: int = 64
    rounds: int = 2
    seed: int = 0
    vocab_size: int | None = None
    eos_id: int | None = None


def compare_drafters(target: Any, prompts: list[Tensor], drafters: dict[str, dict[str, Any]],
                     settings: RaceSettings | None = None, *, temperatures: tuple[float, ...] = (0.0, 1.0),
                     batches: dict[int, int] | None = None,
                     report: Callable[[str], Any] | None = None) -> list[dict[str, Any]]:
    """One row per (temperature, batch size, method): tokens_per_call, acceptance_rate, alpha,
    seconds (median over rounds), tokens_per_second (median over rounds), speedup over plain
    decoding (the median of the per-round ratios of token rates: of seconds, where every row emits
    max_new_tokens; rows stop at `eos_id` when it is given), at temperature 0 greedy_equal_plain
    (every row's tokens equal plain decoding's, every round), and the counts summed over the rounds
    (new_tokens, target_calls, row_calls, drafted, accepted: tokens_per_call = new_tokens / row_calls;
    at batch 8, target_calls against plain decoding's shows what the slowest row costs: a batch
    makes calls until its last row is done, so a draft saves calls only as far as that row's
    acceptance goes, whatever the others'), and at
    temperature 0 greedy_agreement, the mean fraction of a row emitted before its first difference
    from plain decoding (in bf16 a multi-token verify may round differently from a 1-token step).
    `settings` (`RaceSettings`): gamma, max_new_tokens, rounds, seed, vocab_size, eos_id.
    `batches`: batch size -> how many of `prompts` are decoded at that size (default {1: 4, 8:
    all}). `report` gets a line per (temperature, batch size) when it is done: each method's
    tokens per call and speed-up so far (a comparison runs for minutes).

    A drafter's keyword arguments may name another instance of the target, {"target": model} (e.g.
    the same weights in another dtype); {"target": model} alone is plain
    decoding with it. Each method is then compared with the plain decoding of its own target
    instance (speedup, greedy_equal_plain, greedy_agreement), and every row also gets
    speedup_over_fastest_plain: the median over rounds of its token rate over the fastest plain
    decoding's in that round, the speed-up a user gets over the best they could do without a draft.
    Drafters on another target instance decode at batch 1 only; at larger batches that instance's
    plain decoding still runs, so the fastest plain decoding is still found there (on a 2-core CPU
    drafts run below plain decoding at batch 8, and their batch-8 runs would cost the comparison
    minutes)."""
    s = settings or RaceSettings()
    batches = batches or {1: min(4, len(prompts)), 8: len(prompts)}
    check(s.rounds >= 1 and all(1 <= n <= len(prompts) for n in batches.values()),
          "rounds must be >= 1 and each batch size decode between 1 and len(prompts) prompts")
    every = {"plain": {}, **drafters}
    plains = [name for name, kw in every.items() if not set(kw) - {"target"}]
    plain_of = {name: next(p for p in plains if every[p].get("target") is kw.get("target"))
                for name, kw in every.items()}
    rows = []
    for temperature in temperatures:
        for batch, count in batches.items():
            # at batch 1 only: prompt lookup and tree drafting (they decode one row at a time), and the
            # drafters on another target instance (its plain decoding runs at every batch size)
            methods = {name: kw for name, kw in every.items()
                       if batch == 1 or not ("prompt_lookup" in kw or isinstance(kw.get("drafter"), TreeDrafter)
                                             or (name not in plains and "target" in kw))}
            race = _Race(target, prompts[:count], batch, methods, s, temperature)
            race.warm_up()
            for r in range(s.rounds):
                race.round(r, plains, plain_of)
            rows += [race.row(name, plains, plain_of[name]) for name in methods]
            if report is not None:
                report(f"T={temperature:g} batch {batch}: " + ", ".join(
                    f"{r['method']} {r['tokens_per_call']:.2f} tokens/call {r['speedup']:.2f}x"
                    for r in rows[-len(methods):]))
    return rows


class _Race:
    """The `methods` on the `chosen` prompts at one batch size and temperature: warmed up, then
    timed round by round, interleaved batch by batch, each beside its own target's plain decoding."""

    def __init__(self, target: Any, chosen: list[Tensor], batch: int, methods: dict[str, dict[str, Any]],
                 s: RaceSettings, temperature: float) -> None:
        self.target, self.chosen, self.batch, self.methods, self.s = target, chosen, batch, methods, s
        self.temperature = temperature
        self.decoding = dict(max_new_tokens=s.max_new_tokens, gamma=s.gamma, vocab_size=s.vocab_size, eos_id=s.eos_id)
        self.seconds: dict[str, list[float]] = {name: [] for name in methods}
        self.emitted: dict[str, list[int]] = {name: [] for name in methods}       # new tokens per round
        self.totals: dict[str, dict[str, Any]] = {}
        self.equal, self.plain = dict.fromkeys(methods, True), {}
        self.agree: dict[str, list[float]] = {name: [] for name in methods}

    def warm_up(self) -> None:
        """First calls at a shape pay one-time costs: one short decode of each method first."""
        for kwargs in self.methods.values():
            _decode(self.target, self.chosen[:self.batch], self.batch, kwargs, self.s.seed,
                    temperature=self.temperature,
                    **{**self.decoding, "max_new_tokens": min(self.s.max_new_tokens, 2 * self.s.gamma + 2)})

    def round(self, r: int, plains: list[str], plain_of: dict[str, str]) -> None:
        """Round r, interleaved batch by batch too (at batch 1: A, B, ... on the first prompt, then
        on the second), so that even one round times every method beside the others."""
        for name in self.methods:
            self.seconds[name].append(0.0)
            self.emitted[name].append(0)
        for i in range(0, len(self.chosen), self.batch):
            for name, kwargs in self.methods.items():
                s, counts, tokens = _decode(self.target, self.chosen[i:i + self.batch], self.batch, kwargs,
                                            self.s.seed + 1000 * r + i, temperature=self.temperature, **self.decoding)
                self.seconds[name][-1] += s
                self.emitted[name][-1] += sum(len(t) for t in tokens)
                old = self.totals.get(name, {})
                self.totals[name] = {k: _add(old.get(k, []), v) if isinstance(v, list) else old.get(k, 0.0) + v
                                     for k, v in counts.items()}
                if name in plains:                   # each method beside its own target's plain
                    self.plain[name] = tokens
                base = self.plain[plain_of[name]]
                self.equal[name] = self.equal[name] and tokens == base
                self.agree[name] += [_common_prefix(a, b) / max(len(b), 1)
                                     for a, b in zip(tokens, base, strict=False)]

    def rate(self, name: str) -> list[float]:
        return [n / s for n, s in zip(self.emitted[name], self.seconds[name], strict=False)]

    def row(self, name: str, plains: list[str], plain: str) -> dict[str, Any]:
        """The method's row (`compare_drafters`' docstring), `plain` the plain decoding it is beside."""
        c, rate, greedy = self.totals[name], self.rate(name), self.temperature == 0
        return {
            "temperature": self.temperature, "batch": self.batch, "prompts": len(self.chosen), "method": name,
            "tokens_per_call": c["new_tokens"] / max(c["row_calls"], 1),
            "acceptance_rate": c["accepted"] / c["drafted"] if c["drafted"] else None,
            "alpha": c["alpha_sum"] / c["alpha_count"] if c["alpha_count"] else None,
            "per_position_acceptance": [a / d if d else None
                                        for a, d in zip(c["accepted_at"], c["drafted_at"], strict=False)],
            "seconds": statistics.median(self.seconds[name]),
            "tokens_per_second": statistics.median(rate),
            "speedup": statistics.median(r / b for b, r in zip(self.rate(plain), rate, strict=False)),
            **({"speedup_over_fastest_plain": statistics.median(
                r / max(self.rate(p)[i] for p in plains) for i, r in enumerate(rate))}
               if len(plains) > 1 else {}),
            "greedy_equal_plain": self.equal[name] if greedy else None,
            "greedy_agreement": statistics.mean(self.agree[name]) if greedy else None,
            # the exact counts the rates come from, over every round
            **{k: int(c[k]) for k in ("new_tokens", "target_calls", "row_calls", "drafted", "accepted")},
            # tree drafting: the head's verified nodes by cumulative draft probability, and those accepted
            **({"nodes_by_q": c["nodes_by_q"], "accepted_by_q": c["accepted_by_q"]}
               if any(c.get("nodes_by_q", [])) else {}),
        }


def greedy_matches_transformers(target: Any, prompts: list[Tensor], drafters: dict[str, dict[str, Any]], *,
                                gamma: int = 5, max_new_tokens: int = 64) -> dict[str, bool]:
    """{method: greedy `generate` (plain, and with each drafter) gives exactly transformers' own
    greedy `target.generate()` on every prompt} (`train.bench.hf.compare_with_hf_generate`;
    one prompt per call: transformers' left padding would change its own numbers). A drafter's own
    "gamma" (an eagle3 chain's, `HFDrafters.eagle3_gammas`) overrides `gamma`."""
    from .hf import compare_with_hf_generate

    return {name: all(compare_with_hf_generate(target, [p], max_new_tokens, repeats=0,
                                               **{"gamma": gamma, **kwargs})["equal"]
                      for p in prompts)
            for name, kwargs in {"plain": {}, **drafters}.items()}


def node_table(rows: list[dict[str, Any]]) -> list[str]:
    """The tree rows' verified head nodes by cumulative draft probability q, each cell 'nodes,
    share accepted' (`DecodeStats.nodes_by_q`): where a share is below what a verified node costs,
    a higher `keep` or `min_prob` pays. [] when no row drafted a tree."""
    from specdec_models.decode.stats import node_q_bins

    trees = [r for r in rows if any(r.get("nodes_by_q", []))]
    if not trees:
        return []
    sets = "prompt_set" in trees[0]
    lines = ["", ("Tree drafting: the head's verified nodes by their cumulative draft probability q (nodes, share "
                  "accepted by the target):"), "",
             ("| prompts " if sets else "") + "| temperature | method | "
             + " | ".join(f"q {b}" for b in node_q_bins()) + " |",
             ("|---" if sets else "") + "|---:|---|" + "---|" * len(node_q_bins())]
    for r in trees:
        cells = [f"{n:,}, {a / n:.3f}" if n else "–" for n, a in zip(r["nodes_by_q"], r["accepted_by_q"], strict=False)]
        lines.append((f"| {r['prompt_set']} " if sets else "") + f"| {r['temperature']:g} | {r['method']} | "
                     + " | ".join(cells) + " |")
    return lines


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """`compare_drafters`' rows as the lines of a markdown table."""
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    sets = "prompt_set" in (rows[0] if rows else {})
    fastest = any("speedup_over_fastest_plain" in r for r in rows)
    lines = [("| prompts " if sets else "") + "| temperature | batch | method | tokens/call | acceptance per position "
             "| alpha | tokens/s | speed-up |" + (" over the fastest plain |" if fastest else ""),
             ("|---" if sets else "") + "|---:|---:|---|---:|---|---:|---:|---:|" + ("---:|" if fastest else "")]
    for r in rows:
        per = " ".join(fmt(a, ".2f") for a in r.get("per_position_acceptance") or []) or "–"
        lines.append((f"| {r['prompt_set']} " if sets else "")
                     + f"| {r['temperature']:g} | {r['batch']} | {r['method']} | "
                     f"{r['tokens_per_call']:.2f} | {per} | {fmt(r['alpha'], '.3f')} | {r['tokens_per_second']:.1f} | "
                     f"{r['speedup']:.2f}x |" + (f" {r['speedup_over_fastest_plain']:.2f}x |" if fastest else ""))
    return lines


def bar_styles(methods: list[str]) -> dict[str, tuple[Any, str | None]]:
    """(colour, hatch) of each method's bars: one colour per method, shared by its twin in the
    comparison's second dtype ("eagle3 specdec [float32]" beside "eagle3 specdec"), whose bars are
    hatched. tab10 up to 10 colours, tab20 up to 20, then tab20 again with the other hatch: a
    comparison racing two dtypes has over 20 bars per group (the recipe's: 26), and a colormap
    indexed past its end gives every later method its last colour."""
    plt = pyplot()
    bases = list(dict.fromkeys(_base_method(m) for m in methods))
    cmap = plt.get_cmap("tab10" if len(bases) <= 10 else "tab20")
    size = cmap.N
    styles = {}
    for m in methods:
        i = bases.index(_base_method(m))
        twin = m != _base_method(m)
        hatch = ("//" if twin else None) if i < size else ("xx" if twin else "..")
        styles[m] = (cmap(i % size), hatch)
    return styles


def twin_name(method: str, dtype: str) -> str:
    """The name of `method` decoding the comparison's second dtype: "plain [float32]"."""
    return f"{method} [{dtype}]"


def _base_method(method: str) -> str:
    """A method's name without `twin_name`'s dtype tag: "plain [float32]" -> "plain"."""
    for dtype in ("float32", "bfloat16", "float16"):
        suffix = twin_name("", dtype)
        if method.endswith(suffix):
            return method[:-len(suffix)]
    return method


def plot(rows: list[dict[str, Any]], path: Path, where: str = "2 CPU cores", target: str = "the target") -> None:
    """Per prompt set: tokens per target call at batch 1 and the speed-up per (temperature, batch)
    of each drafter (a method absent at a setting, prompt lookup at batch 8, gets no bar);
    `target` names the target in the title."""
    plt = pyplot()

    sets = list(dict.fromkeys(r.get("prompt_set", "") for r in rows))
    # with plain decoding in two dtypes, every bar is over the faster of the two (the other plain's included)
    key = "speedup_over_fastest_plain" if any("speedup_over_fastest_plain" in r for r in rows) else "speedup"
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "plain" or key != "speedup"]
    pick = {(r.get("prompt_set", ""), r["method"], r["temperature"], r["batch"]): r for r in rows}
    fig, axes = plt.subplots(len(sets), 2, figsize=(12, 3.8 * len(sets)), squeeze=False)
    width = 0.8 / max(len(methods), 1)
    styles = bar_styles(methods)
    for row, name in enumerate(sets):
        keys = sorted({(r["temperature"], r["batch"]) for r in rows if r.get("prompt_set", "") == name})
        temps = sorted({t for t, _ in keys})
        ax_calls, ax_speed = axes[row]
        for i, m in enumerate(methods):
            calls = [(j, pick[name, m, t, 1]["tokens_per_call"]) for j, t in enumerate(temps)
                     if (name, m, t, 1) in pick]
            speed = [(j, pick[(name, m, *k)][key]) for j, k in enumerate(keys) if (name, m, *k) in pick]
            color, hatch = styles[m]
            for ax, bars in ((ax_calls, calls), (ax_speed, speed)):
                ax.bar([j + i * width for j, _ in bars], [v for _, v in bars], width, label=m, color=color,
                       hatch=hatch, edgecolor="white" if hatch else None, linewidth=0)
        ax_calls.set_xticks([j + 0.4 - width / 2 for j in range(len(temps))], [f"T={t:g}" for t in temps])
        ax_calls.set_ylabel("tokens per target call\n(batch 1)")
        ax_speed.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], [f"T={t:g}, b{b}" for t, b in keys])
        ax_speed.axhline(1.0, color="grey", lw=0.8)
        ax_speed.set_ylabel("speed-up over\nplain decoding" if key == "speedup"
                            else "speed-up over the\nfastest plain decoding")
        if name:
            ax_calls.set_title(f"{name} prompts", fontsize=10)
            ax_speed.set_title(f"{name} prompts", fontsize=10)
    handles, labels = axes[0][1].get_legend_handles_labels()      # every method has a speed-up bar
    # fewer columns for long labels (a tree's label with its lookup, floors and datastore), so none is cut
    longest = max((len(label) for label in labels), default=0)
    ncol = max(1, min(len(methods), 3 if longest <= 45 else 2 if longest <= 80 else 1))
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.suptitle(f"Drafts for {target} on {where}")
    fig.tight_layout(rect=(0, 0.03 + 0.03 * ((len(methods) - 1) // ncol), 1, 1))   # room for the legend below
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_report(report: dict[str, Any], out: Path, kind: str | None = None) -> list[str]:
    """results.json, table.md and compare.png of a comparison ({"rows": compare_drafters' rows,
    "greedy_equals_transformers_generate": ...}), written together: `out` is replaced whole
    (`files.staged_dir`, marked as a `kind` folder when given). Returns the table's lines."""
    lines = markdown_table(report["rows"])
    greedy = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in report["greedy_equals_transformers_generate"].items())
    lines += ["", f"Greedy output equals transformers' generate(): {greedy}"]
    settings = report.get("settings", {})
    if "dtype" in settings:
        layers = f", {settings['layers']}" if settings.get("layers") else ""
        lines += ["", f"Target and drafters in {settings['dtype']}{layers} (specdec_models/cpu)."]
    if "rounds" in settings:
        n = settings["rounds"]
        stopped = settings.get("no_eos_stop") is False          # earlier reports decoded a fixed length
        ratio = ("the method's tokens per second over plain decoding's (every row stops at the end of its answer)"
                 if stopped else "plain decoding's seconds over the method's (every row decodes max_new_tokens)")
        lines += ["", (f"Speed-up: {ratio}, the median over {n} "
                       f"round{'s' * (n > 1)} in one process; within a round every method decodes a batch of "
                       "prompts before the next batch (at batch 1: prompt by prompt).")]
    agree = [f"{r.get('prompt_set', '')} b{r['batch']} {r['method']}: {r['greedy_agreement']:.2f}"
             for r in report["rows"] if r.get("greedy_agreement") is not None and r["method"] != "plain"]
    if agree:
        lines += ["", "Greedy agreement with plain decoding in the comparison's dtype (mean fraction of a row "
                      "emitted before its first difference): " + "; ".join(agree)]
    lines += node_table(report["rows"])
    with staged_dir(out, kind=kind) as tmp:
        (tmp / "results.json").write_text(json.dumps(report, indent=1))
        (tmp / "table.md").write_text("\n".join(lines) + "\n")
        settings = report.get("settings", {})
        device, target = settings.get("device", "cpu"), settings.get("target")
        plot(report["rows"], tmp / "compare.png", "2 CPU cores" if device == "cpu" else device_name(device),
             Path(target).name.removesuffix(".gguf") if target else "the target")
    return lines


def device_name(device: str) -> str:
    """A CUDA device's name ("NVIDIA H200"), else the device string."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return device


NAMES = {"prophet": "prophet (trained)", "student": "student (distilled)", "random": "random head (untrained)"}


@dataclass(frozen=True)
class HFDrafters:
    """The drafters of one Hugging Face target to compare: eagle3 heads (name, directory) in any
    layout (each also with tree drafting for every `decode.TreeSpec` in `trees`), an hf_prophet
    export, a student model directory, transformers' prompt lookup proposing
    `prompt_lookup` tokens (0: none), and an untrained head of the prophet's config (seed 0). With
    `token_verify`, each eagle3 chain, and each tree of one child per node, is also decoded with
    `verify="token"` beside the default block verification (the same drafts, side by side); with
    `auto_gamma`, each eagle3 head also decodes with gamma "auto" (calibrated on each call's first
    tokens: plain decoding for the rest of the call where no gamma pays); with a `datastore`
    (`decode.datastore.Datastore`), each tree with a lookup also drafts with it (its looked-up path
    from the datastore where that matches a longer n-gram than prompt lookup)."""

    eagle3: list[tuple[str, str]] = field(default_factory=list)
    eagle3_gammas: tuple[int, ...] = ()   # the eagle3 chains' gammas (none: the comparison's; several: a chain each)
    trees: list[Any] = field(default_factory=list)   # decode.TreeSpec: each eagle3 head also drafts these trees
    prophet: str | None = None
    student: str | None = None
    prompt_lookup: int = 0
    random_head: bool = False
    token_verify: bool = False     # each eagle3 chain (and chain-shaped tree) also verified token by token
    auto_gamma: bool = False       # each eagle3 head also decodes with gamma "auto" (calibrated in the call)
    datastore: Any = None          # decode.datastore.Datastore: each tree with a lookup also drafts with it

    def build(self, model: Any) -> dict[str, dict[str, Any]]:
        """`generate` keyword arguments by drafter name, built on `model` (in its dtype)."""
        from specdec_models.export import load_eagle3, load_export
        from specdec_models.heads.hf_prophet import HFProphet
        from specdec_models.hf.weights import load_causal_lm

        weight = next(model.parameters())
        dtype, device = weight.dtype, weight.device
        drafters = {}
        for name, directory in self.eagle3:
            head = load_eagle3(directory, model).to(device=device, dtype=dtype)
            gammas = self.eagle3_gammas or (None,)
            for gamma in gammas:
                chain = {"drafter": HeadDrafter(head), **({"gamma": gamma} if gamma else {})}
                label = f"eagle3 {name}" + (f" gamma {gamma}" if len(gammas) > 1 else "")
                drafters[label] = chain
                if self.token_verify:
                    drafters[f"{label} (token verify)"] = {**chain, "verify": "token"}
            if self.auto_gamma:
                drafters[f"eagle3 {name} gamma auto"] = {"drafter": HeadDrafter(head), "gamma": "auto"}
            for tree in self.trees:
                drafters[f"eagle3 {name} tree {tree.label}"] = {"drafter": TreeDrafter(head, tree)}
                if self.datastore is not None and tree.lookup:
                    drafters[f"eagle3 {name} tree {tree.label} + datastore"] = {
                        "drafter": TreeDrafter(head, tree, self.datastore)}
                if self.token_verify and tree.topk == 1:
                    drafters[f"eagle3 {name} tree {tree.label} (token verify)"] = {"drafter": TreeDrafter(head, tree),
                                                                                 "verify": "token"}
        if self.prophet:
            head = load_export(self.prophet, target=model).to(device=device, dtype=dtype)
            drafters[NAMES["prophet"]] = {"drafter": HeadDrafter(head)}
        if self.student:
            student = load_causal_lm(self.student, dtype=dtype, what="student").to(device)
            drafters[NAMES["student"]] = {"drafter": DraftModel(student)}
        if self.prompt_lookup:
            drafters[f"prompt lookup (transformers, n={self.prompt_lookup})"] = {"prompt_lookup": self.prompt_lookup}
        if self.prophet and self.random_head:
            torch.manual_seed(0)
            random_head = HFProphet(head.config, model).to(device=device, dtype=dtype).eval()
            drafters[NAMES["random"]] = {"drafter": HeadDrafter(random_head)}
        return drafters


@dataclass(frozen=True)
class CompareSettings:
    """How `compare_hf` decodes: the target's and drafters' `dtype` ("float32", "bfloat16"), chains
    of `gamma`, `max_new_tokens` per row, `rounds` interleaved rounds, `batch1_count` prompts at
    batch 1 (0: none) and all at batch 8 (not without `batch8`), the first `check_count` checked
    against transformers, on `device`, at `temperatures`, every row stopped at `eos_id` (None: none)."""

    dtype: str
    gamma: int
    max_new_tokens: int
    rounds: int
    batch1_count: int
    check_count: int
    batch8: bool = True
    device: str = "cpu"
    temperatures: tuple[float, ...] = (0.0, 1.0)
    eos_id: int | None = None


def compare_hf(loaded: Any, target: str, prompt_sets: list[tuple[str, list[Tensor]]], drafters: HFDrafters,
               settings: CompareSettings) -> dict[str, Any]:
    """`compare_drafters` of `drafters` on the loaded target (`hf.weights.LoadedModel`, cast to
    settings.dtype) for each (name, prompts) set, at batch 1 and batch 8 (`CompareSettings`), then
    greedy exactness against transformers' own `generate()` in fp32 on the first set's first
    `check_count` prompts (the target reloaded from `target`: bf16's multi-token verify may round
    differently from a 1-token step, and the rows' greedy_equal_plain say how often it did).
    Everything runs on `device` ("cpu", "cuda"); each method's time ends with its tokens copied to
    the host, so a GPU's queued work is inside it. The target and every drafter are prepared for the
    device as the decoding CLI prepares them (`specdec_models.cpu.prepare_for_device`: on a CPU,
    few-row linear layers where they pay, plain decoding and prompt lookup included; the fp32 check
    against transformers keeps torch's own layers). `eos_id`: every method stops a row there (the
    check against transformers decodes `max_new_tokens` whole, a stricter test).
    Returns {"rows", "greedy_equals_transformers_generate"} (`write_report`)."""
    from specdec_models.hf.weights import load_causal_lm

    s = settings
    dtype, gamma, max_new_tokens, device = s.dtype, s.gamma, s.max_new_tokens, s.device
    batch1_count, batch8 = s.batch1_count, s.batch8
    check(batch1_count >= 0 and (batch1_count or batch8), "nothing to decode: batch1_count is 0 and batch8 is off")
    model = loaded.model.to(device=device, dtype=getattr(torch, dtype))
    built = drafters.build(model)
    prepare_for_device([model] + [kw[k] for kw in built.values() for k in ("prophet", "draft") if k in kw], device,
                       getattr(torch, dtype))
    rows = []
    for name, prompts in prompt_sets:
        race = RaceSettings(gamma=gamma, max_new_tokens=max_new_tokens, rounds=s.rounds,
                            vocab_size=len(loaded.tokenizer), eos_id=s.eos_id)
        for row in compare_drafters(model, prompts, built, race, temperatures=tuple(s.temperatures),
                                    batches={**({1: batch1_count} if batch1_count else {}),
                                             **({8: len(prompts)} if batch8 else {})},
                                    report=lambda line, name=name: print(f"[{name}] {line}", flush=True)):
            rows.append({"prompt_set": name, **row})
    del model, built
    fp32 = load_causal_lm(target, dtype=torch.float32, what="target").to(device)
    # prompt lookup is transformers' own; a token-verified twin accepts at T=0 what its drafter does
    checked = {k: v for k, v in drafters.build(fp32).items() if not {"prompt_lookup", "verify"} & set(v)}
    greedy = greedy_matches_transformers(fp32, prompt_sets[0][1][:s.check_count], checked, gamma=gamma,
                                         max_new_tokens=max_new_tokens)
    return {"rows": rows, "greedy_equals_transformers_generate": greedy, "device_name": device_name(device)}
