"""The whole SmolLM2-135M recipe in one command: data, three drafts, the comparison, the report.

    python scripts/smollm2.py --out outputs/smollm2          # `make smollm2`

Steps (each a command the README shows on its own; a finished step is skipped when the command
runs again, so a killed recipe resumes at the step it was in):
1. prompts: training prompts (half open-ended instructions, half made from text snippets) and two
   held-out evaluation sets: `text` (snippets of the text's validation split) and `open` (open-ended
   instructions on topics never trained on);
2. cache: SmolLM2, in bf16 as it decodes, answers the training prompts itself (greedy and sampled
   rows, stopped at its end-of-turn token) and its hidden states of layers [2, 15, 27] and the last
   are cached;
3. draft vocabulary: the target's greedy tokens counted on the cache; coverage and c per size;
4. training, side by side for the same wall time, at the same precision (--precision; by default
   the one faster on this CPU: train/hardware.py) and one thread each: the eagle3 head
   (experiment=smollm2_eagle3) and the prophet head (experiment=smollm2_prophet) on the same cache;
   then the 2-layer distilled student (experiment=smollm2_student) on the cache's text, two threads,
   for --student-minutes (--student-minutes 0 leaves it out);
5. comparison (scripts/compare_hf_drafts.py): every draft (the eagle3 head also with a 3,2,1 draft
   tree, and with a 6,3,1 tree grown only where its draft probability stays >= 0.3 plus an adaptive
   prompt-lookup path of 4..16 tokens, at batch 1), transformers' prompt-lookup decoding and plain
   decoding on both prompt sets,
   batch 1 and 8, T=0 and T=1, bf16, interleaved;
6. report: OUT/report/ holds the comparison (table.md, results.json, compare.png), the draft
   vocabulary table and steps.md, the wall time of each step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "data" / "textmix100m.gz"


PRECISIONS = ("bf16-mixed", "32-true")


def head_training(py: str, args: argparse.Namespace, cache: Path, counts: Path,
                  runs: dict[str, Path]) -> list[list[str]]:
    """The commands that train the eagle3 and prophet heads side by side on the cache, for the
    same wall time at the same precision (--precision, else the one faster on this CPU)."""
    from train.hardware import fast_precision

    same = [f"data.cache={cache}", f"data.seq_len={args.seq_len}",
            f"trainer.max_time=00:00:{args.train_minutes:02d}:00",
            f"trainer.precision={args.precision or fast_precision('cpu')}"]
    return [[py, "-m", "train", "experiment=smollm2_eagle3", *same, f"head.draft_vocab={counts}",
             f"output_dir={runs['eagle3']}", "overwrite=true"],
            [py, "-m", "train", "experiment=smollm2_prophet", *same, f"output_dir={runs['prophet']}", "overwrite=true"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/smollm2", help="the recipe's folder (steps resume inside it)")
    parser.add_argument("--text", default=str(TEXT), help="text for prompts (raw, .zip or .gz)")
    # 2,048 rows and 6 student minutes keep the recipe inside 90 minutes on a host without AMX, where the cache
    # of 3,072 rows took 38.9 minutes (README, "The same recipe on a host without AMX")
    parser.add_argument("--prompts", type=int, default=2048, help="training prompts")
    parser.add_argument("--rows", type=int, default=2048, help="cached rows (the target's answers)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--train-minutes", type=int, default=30, help="wall time of each draft's training")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="the two heads' training precision (default: the faster on this CPU, "
                             "train/hardware.py: bf16-mixed with AMX, else 32-true, which trained the eagle3 head "
                             "1.48x faster on a host without AMX: README)")
    parser.add_argument("--student-minutes", type=int, default=6,
                        help="wall time of the 2-layer student's training (two threads); 0 leaves the student out")
    parser.add_argument("--eval-prompts", type=int, default=8, help="prompts per evaluation set (batch 8 decodes all)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    steps_file = out / "steps.json"
    done: dict[str, float] = json.loads(steps_file.read_text()) if steps_file.is_file() else {}

    def step(name: str, commands: list[list[str]], marker: Path, threads: int = 2) -> None:
        if name in done and marker.exists():
            print(f"[{name}] done before ({done[name] / 60:.1f} min): {marker}")
            return
        print(f"[{name}] " + "\n    & ".join(" ".join(c) for c in commands), flush=True)
        t0 = time.perf_counter()
        procs = [subprocess.Popen(c, cwd=REPO, env={**env, "OMP_NUM_THREADS": str(threads)}) for c in commands]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"[{name}] failed (exit {codes}): fix it and run the recipe again to resume here")
        done[name] = time.perf_counter() - t0
        steps_file.write_text(json.dumps(done, indent=1))
        print(f"[{name}] {done[name] / 60:.1f} min", flush=True)

    gguf = subprocess.run([py, "-c", "from specdec_models.hf.weights import smollm2_gguf; print(smollm2_gguf())"],
                          cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip()
    prompts, ev_text, ev_open = out / "prompts.jsonl", out / "eval_text.jsonl", out / "eval_open.jsonl"
    step("prompts", [[py, "scripts/make_prompts.py", "--kind", "mix", "--text", args.text, "--count", str(args.prompts),
                      "--out", str(prompts), "--force"]], prompts)
    step("prompts_eval", [[py, "scripts/make_prompts.py", "--kind", "text", "--split", "valid", "--text", args.text,
                           "--count", str(args.eval_prompts), "--out", str(ev_text), "--force"],
                          [py, "scripts/make_prompts.py", "--kind", "open", "--split", "valid",
                           "--count", str(args.eval_prompts), "--out", str(ev_open), "--force"]], ev_open)
    cache = out / "cache"
    step("cache", [[py, "scripts/cache_embeddings.py", "--gguf", gguf, "--prompts", str(prompts), "--chat",
                    "--temperatures", "0", "1", "--seq-len", str(args.seq_len), "--windows", str(args.rows),
                    "--batch-size", "256", "--layers", "2", "15", "27", "30", "--model-dtype", "bfloat16",
                    "--out", str(cache), "--overwrite"]],
         cache / "cache.json")
    counts = out / "draft_vocab.json"
    step("draft_vocab", [[py, "scripts/draft_vocab.py", "--cache", str(cache), "--out", str(counts), "--force",
                          "--report", str(out / "draft_vocab_report.json")]], counts)
    runs = {"eagle3": out / "eagle3", "prophet": out / "prophet", "student": out / "student"}
    train = head_training(py, args, cache, counts, runs)
    step("train", train, runs["eagle3"] / "export" / "config.json", threads=1)
    if args.student_minutes:
        student_models, corpus = out / "student_models", out / "student_corpus.jsonl"
        step("student_prep", [[py, "scripts/compare_hf_drafts.py", "student", "--out", str(student_models)],
                              [py, "scripts/compare_hf_drafts.py", "corpus", "--cache", str(cache), "--out",
                               str(corpus)]], corpus)
        step("train_student", [[py, "-m", "train", "experiment=smollm2_student",
                                f"teacher.path={student_models / 'target'}", f"student.path={student_models / 'student'}",
                                f"data.files=[{corpus}]", f"trainer.max_time=00:00:{args.student_minutes:02d}:00",
                                f"output_dir={runs['student']}", "overwrite=true"]],
             runs["student"] / "export" / "config.json")
    report = out / "report"
    compare = [py, "scripts/compare_hf_drafts.py", "compare", "--eagle3", f"specdec={runs['eagle3'] / 'export'}",
               "--tree", "3,2,1", "--tree", "6,3,1,4..16,0.3", "--prophet", str(runs["prophet"] / "export"),
               "--prompt-lookup", "10", "--prompts", f"text={ev_text}", "--prompts", f"open={ev_open}", "--chat",
               "--count", str(args.eval_prompts), "--batch1-count", "2", "--max-new-tokens", str(args.max_new_tokens),
               "--rounds", "2", "--gamma", "4", "--dtype", "bfloat16", "--out", str(report / "compare")]
    if args.student_minutes:
        compare += ["--student", str(runs["student"] / "export")]
    step("compare", [compare], report / "compare" / "table.md")
    lines = ["| step | minutes |", "|---|---:|"] + [f"| {k} | {v / 60:.1f} |" for k, v in done.items()]
    lines.append(f"| total | {sum(done.values()) / 60:.1f} |")
    (report / "steps.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
