"""The whole SmolLM2-135M recipe in one command: data, three drafts, the comparison, the report.

    python scripts/smollm2.py --out outputs/smollm2          # `make smollm2`

Steps (each a command the README shows on its own; a finished step is skipped when the command
runs again, so a killed recipe resumes at the step it was in):
1. prompts: training prompts (half open-ended instructions, half made from text snippets) and two
   held-out evaluation sets: `text` (snippets of the text's validation split) and `open` (open-ended
   instructions on topics never trained on);
2. cache: SmolLM2, in the dtype it decodes in here (bf16 with bf16 instructions or on a GPU, else
   fp32: specdec_models/hardware.py), answers the training prompts itself (greedy and sampled rows,
   stopped at its end-of-turn token) and its hidden states of layers [2, 15, 27] and the last are
   cached: --rows of them, or as many as --cache-minutes allows;
3. draft vocabulary: the target's greedy tokens counted on the cache; coverage and c per size;
   datastore: the cache's training answers (`decode.datastore`: the target's own phrasing, for
   the trees' looked-up path where it matches a longer n-gram than prompt lookup);
4. training, side by side for the same wall time, at the same precision (--precision; by default
   the one faster on this CPU: train/hardware.py) and one thread each: the eagle3 head
   (experiment=smollm2_eagle3) and the prophet head (experiment=smollm2_prophet) on the same cache
   (the head that ends first, the prophet at its max_steps, hands its thread to the other: train.threads;
   one that fails stops the other, as the step then runs whole again on resume);
   then the 2-layer distilled student (experiment=smollm2_student) on the cache's text, two threads,
   for --student-minutes (--student-minutes 0 leaves it out);
5. comparison (scripts/compare_hf_drafts.py): every draft (the eagle3 head also at gamma auto,
   which decodes plainly where no gamma pays, as at batch 8 on a 2-core CPU; with a 6-deep
   chain grown while its draft probability stays >= 0.1, block-verified at T=1, the fastest there:
   docs/smollm2_history.md, "Block verification at T=1"; with an 8,4,3 tree grown only where its
   draft probability stays >= 0.2 plus an adaptive prompt-lookup path of 4..16 tokens, the fastest
   tree at T=1, and grown where it stays >= 0.1, which drafts the most at T=0
   (docs/smollm2_history.md, "Larger trees at T=0"; the 6,3,1 tree of earlier rounds left the
   comparison in r16, level with the 8,4,3 one and 4 minutes of its time); and with a 5-deep chain
   grown while it stays >= 0.4 plus a 2..4-token lookup, the fastest at T=0 in fp32 on a CPU:
   docs/smollm2_history.md, "Few-row fp32 matmuls"; and with an 8-deep tree of 2 children per node,
   one node expanded per depth, grown while it stays >= 0.2, plus a 2..8-token lookup, the fastest
   at T=0 in fp32 once verifies of up to 20 tokens got cheap: docs/smollm2_history.md, "A panel
   kernel for verify calls on the Zen 3 EPYC (r25)"; each tree with a lookup also with the
   datastore; trees at batch 1),
   transformers' prompt-lookup decoding and plain
   decoding on both prompt sets, batch 1 and 8, T=0 and T=1, in the dtype decoding runs in here,
   interleaved prompt by prompt at batch 1 (--compare-rounds rounds: 1 on a CPU, 2 on a GPU); on a
   CPU with bf16 instructions but no AMX also in fp32, where plain decoding may be faster, on one
   without them plain decoding also in bf16, for the same reason, and every speed-up is also given
   over the faster plain decoding (specdec_models/hardware.py, racing_dtype);
6. report: OUT/report/ holds the comparison (table.md, results.json, compare.png), the draft
   vocabulary table and steps.md, the wall time of each step.

--out must be new, empty or a folder the recipe ran in before (or `--force`): its steps replace
their own paths inside it.

On a machine with a CUDA GPU, `--device cuda` runs the cache, the heads' training and the comparison
there (GPU_DEFAULTS: 40,000 prompts, 12,288 rows, larger generation and training batches, 6 unroll
steps, 5 training minutes, validation every 500 steps: the settings of the H100 head that met the
goals; `--train-args` adds Hydra overrides to both heads' runs); `--heads eagle3` trains the eagle3
head alone and `--until STEP` stops after STEP (e.g. `--until train`, to compare elsewhere).
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
STEPS = ("prompts", "prompts_eval", "cache", "draft_vocab", "datastore", "train", "student_prep", "train_student",
         "compare")
HEADS = ("eagle3", "prophet")
RECIPE_KIND = "smollm2 recipe"          # the folder kind of --out (`specdec_models.files.mark_dir`)
# what --device cuda changes: rows generated per call, and the heads' training (rows per step, loader
# workers, validation every 500 steps rather than 100: a GPU makes hundreds of steps a minute). A
# cache batch of 4,096 rows is 2,048 per temperature and per call: on an H100 a generating step cost
# 86 ms at 512 and at 2,048 rows (the host's per-call work), and 2,048 rows at 257 tokens peak near
# 47 GB (docs/smollm2_history.md, "A head trained on an H100"). The prompts, rows and training are
# r13's H100 head's, which met issue 16's goals on both prompt sets: 40,000 prompts drawn (24,120
# distinct), 12,288 rows cached in 105 s of generation, 2,514 steps of 64 rows with 6 unroll steps in
# 4 min 50 s, 13 passes over the rows (docs/smollm2_history.md, "A head trained on a lent H100,
# decoded with packed bf16 weights"). On a CPU, CPU_DEFAULTS: 4,096 rows, or as many as --cache-minutes
# allows (a Zen 5 EPYC cached 2,048 in 10.5 minutes, and its head, 4.8 passes over them, stopped gaining
# on held-out rows while its training loss fell: docs/smollm2_history.md, "More rows, and the idle core")
GPU_DEFAULTS = {"cache_batch": 4096, "prompts": 40000, "rows": 12288, "train_minutes": 5,
                "train": ["trainer.accelerator=gpu", "data.batch_size=64", "data.num_workers=8",
                          "trainer.val_check_interval=500", "task.ttt_steps=6", "optim.warmup_steps=100",
                          "task.ttt_ramp=0"]}   # the head that met the goals unrolled every step; the ramp is for CPUs
CPU_DEFAULTS = {"prompts": 4096, "rows": 4096, "train_minutes": 30}


def device_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """--prompts, --rows and --train-minutes where not given: GPU_DEFAULTS' with --device cuda, else
    CPU_DEFAULTS'."""
    defaults = GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for name in CPU_DEFAULTS:
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    return args


def max_time(minutes: float) -> str:
    """trainer.max_time for a budget in minutes, as Lightning's Timer reads it: DD:HH:MM:SS, two
    digits each (it refuses 00:00:5:30)."""
    seconds = round(minutes * 60)
    days, seconds = divmod(seconds, 86400)
    return f"{days:02d}:{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def head_training(py: str, args: argparse.Namespace, cache: Path, counts: Path,
                  runs: dict[str, Path], threads_file: Path | None = None) -> list[list[str]]:
    """The commands that train the heads (--heads: eagle3 and prophet) side by side on the cache,
    for the same wall time at the same precision (--precision, else the one faster on the device).
    `threads_file`: on a CPU, each run takes its CPU threads from it (`train.threads`), where
    `side_by_side` hands over the threads of a head that ended."""
    from train.hardware import fast_precision

    gpu = args.device == "cuda"
    share = [f"callbacks.threads_file.path={threads_file}"] if threads_file is not None and not gpu else []
    # the evaluation callback decodes only at the end (every=0): the comparison decodes each head anyway, and
    # in the experiments' rhythm (every 3rd validation) its decoding took 9% of the eagle3 head's 30 minutes
    same = [f"data.cache={cache}", f"data.seq_len={args.seq_len}",
            f"trainer.max_time={max_time(args.train_minutes)}",
            f"trainer.precision={args.precision or fast_precision('gpu' if gpu else 'cpu')}",
            "callbacks.speculative_eval.every=0", *share, *(GPU_DEFAULTS["train"] if gpu else []), *args.train_args]
    commands = {"eagle3": [py, "-m", "train", "experiment=smollm2_eagle3", *same, f"head.draft_vocab={counts}",
                           f"output_dir={runs['eagle3']}", "overwrite=true"],
                "prophet": [py, "-m", "train", "experiment=smollm2_prophet", *same, f"output_dir={runs['prophet']}",
                            "overwrite=true"]}
    return [commands[h] for h in HEADS if h in args.heads]


def side_by_side(commands: list[list[str]], env: dict[str, str], threads: int,
                 threads_file: Path | None = None) -> list[int]:
    """Run `commands` at once from the repository, `threads` CPU threads each (OMP_NUM_THREADS), and
    return their exit codes once all have ended. One that fails stops the others (SIGTERM): the
    step fails anyway and runs whole again when the recipe resumes, so their minutes would be lost.
    With `threads_file`, whenever one ends well the threads it held go to those still running: the
    file (read by their `ThreadsFromFile` callback, `train.threads`) then holds threads x commands
    // running; a file left by an earlier run is removed first."""
    from specdec_models.files import write_file

    if threads_file is not None:
        threads_file.unlink(missing_ok=True)
    procs = [subprocess.Popen(c, cwd=REPO, env={**env, "OMP_NUM_THREADS": str(threads)}) for c in commands]
    codes: list[int | None] = [None] * len(procs)
    while None in codes:
        time.sleep(0.5)
        for i, proc in enumerate(procs):
            if codes[i] is None and (code := proc.poll()) is not None:
                codes[i] = code
                running = codes.count(None)
                if code != 0 and running:
                    print(f"[side by side] command {i + 1} of {len(procs)} failed (exit {code}): stopping the "
                          f"{running} left", flush=True)
                    for j, other in enumerate(procs):
                        if codes[j] is None:
                            other.terminate()
                if threads_file is not None and code == 0 and running:
                    share = threads * len(procs) // running
                    write_file(threads_file, lambda f, share=share: f.write(f"{share}\n".encode()))
                    print(f"[side by side] command {i + 1} of {len(procs)} ended: the {running} left take "
                          f"{share} threads each", flush=True)
    return [int(code) for code in codes]


def comparison(py: str, args: argparse.Namespace, ev_text: Path, ev_open: Path, runs: dict[str, Path],
               out: Path, datastore: Path | None = None) -> list[str]:
    """The comparison's command: every draft trained (--heads, the student unless --student-minutes
    is 0), prompt lookup and plain decoding on both evaluation sets, in --compare-rounds rounds (1 on
    a CPU, where at batch 1 it is still interleaved prompt by prompt; 2 on a GPU); on a CPU with bf16
    instructions but no AMX, in fp32 too, and on one without them plain decoding in bf16 too
    (`hardware.racing_dtype`). `datastore`: the eagle3 head's
    trees with a lookup also draft with it."""
    from specdec_models.hardware import race_drafters, racing_dtype

    rounds = args.compare_rounds or (2 if args.device == "cuda" else 1)
    command = [py, "scripts/compare_hf_drafts.py", "compare", "--prompt-lookup", "10", "--prompts", f"text={ev_text}",
               "--prompts", f"open={ev_open}", "--chat", "--count", str(args.eval_prompts), "--batch1-count", "2",
               "--max-new-tokens", str(args.max_new_tokens), "--rounds", str(rounds), "--gamma", "4", "--dtype",
               "auto", "--device", args.device, "--out", str(out), "--force"]
    # where bf16 instructions make trees cheap but fp32 plain decoding is faster (no AMX), both race; without bf16
    # instructions, bf16's plain decoding races the fp32 drafters
    other = racing_dtype(args.device)
    if other is not None:
        command += ["--also-dtype", str(other).removeprefix("torch.")]
        if not race_drafters(args.device):
            command += ["--also-plain-only"]
    if "eagle3" in args.heads:
        command += ["--eagle3", f"specdec={runs['eagle3'] / 'export'}", "--eagle3-auto", "--tree", "6,1,1,0.1",
                    "--tree", "8,4,3,4..16,0.2", "--tree", "8,4,3,4..16,0.1", "--tree", "5,1,1,2..4,0.4",
                    "--tree", "8,2,1,2..8,0.2"]
        if datastore is not None:
            command += ["--datastore", str(datastore)]
    if "prophet" in args.heads:
        command += ["--prophet", str(runs["prophet"] / "export")]
    if args.student_minutes:
        command += ["--student", str(runs["student"] / "export")]
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/smollm2", help="the recipe's folder (steps resume inside it)")
    parser.add_argument("--text", default=str(TEXT), help="text for prompts (raw, .zip or .gz)")
    # the cache's 21 minutes and 6 student minutes keep the recipe inside 90 minutes on the slowest host so far, an
    # Intel Xeon without bf16 instructions: 2,048 rows in 20.6 minutes there, the recipe 83.7 (README, "Wall time")
    parser.add_argument("--prompts", type=int, default=None, help="training prompts (default 4096; 40000 with "
                                                                   "--device cuda)")
    parser.add_argument("--rows", type=int, default=None,
                        help="cached rows, the target's answers (default 4096; 12288 with --device cuda)")
    parser.add_argument("--cache-minutes", type=float, default=21,
                        help="time budget of making the rows (the target loaded): a slower machine caches fewer than "
                             "--rows rather than overrun the recipe's 90 minutes; 0: no budget")
    parser.add_argument("--cache-batch", type=int, default=None,
                        help="rows per cache batch, half per temperature (default 256 on a CPU, 4096 with --device "
                             "cuda, which needs about 48 GB of GPU memory: halve it on a smaller GPU)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--train-minutes", type=float, default=None,
                        help="wall time of each draft's training (default 30; 5 with --device cuda)")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="the two heads' training precision (default: the faster on this CPU, "
                             "train/hardware.py: bf16-mixed with AMX or with avx512_bf16 on AMD, where it trained "
                             "the eagle3 head 1.76x faster, else 32-true, 1.48x faster on an Intel Xeon without "
                             "AMX: docs/smollm2_history.md)")
    parser.add_argument("--student-minutes", type=float, default=6,
                        help="wall time of the 2-layer student's training (two threads); 0 leaves the student out")
    parser.add_argument("--eval-prompts", type=int, default=8, help="prompts per evaluation set (batch 8 decodes all)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    # on the AMD EPYC (AVX2, fp32) 2 rounds took the comparison 31.6 minutes and the recipe to 104.7
    # (docs/smollm2_history.md, "On the EPYC the recipe first overran its 90 minutes"); at batch 1 one
    # round is still interleaved prompt by prompt
    parser.add_argument("--compare-rounds", type=int, default=None,
                        help="interleaved rounds of every method in the comparison (default 1 on a CPU, 2 with "
                             "--device cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the cache, the heads' training and the comparison run (the student trains on "
                             "the CPU); default cpu")
    parser.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS), help="the heads to train and compare")
    parser.add_argument("--train-args", nargs="+", default=[], metavar="OVERRIDE",
                        help="Hydra overrides added to each head's training run, e.g. task.ttt_steps=6")
    parser.add_argument("--until", choices=STEPS, default=STEPS[-1], help="stop after this step")
    parser.add_argument("--force", action="store_true",
                        help="run in an --out folder that holds files the recipe did not write (its steps replace "
                             "their own paths there: prompts.jsonl, cache/, eagle3/, ...)")
    args = device_defaults(parser.parse_args(argv))
    if args.train_minutes * 60 < 1:
        parser.error(f"--train-minutes must be > 0, got {args.train_minutes}")
    if args.student_minutes < 0:
        parser.error(f"--student-minutes must be >= 0 (0: no student), got {args.student_minutes}")
    if args.compare_rounds is not None and args.compare_rounds < 1:
        parser.error(f"--compare-rounds must be >= 1, got {args.compare_rounds}")
    if args.cache_batch is not None and args.cache_batch < 2:
        parser.error(f"--cache-batch must be >= 2 (half a batch per temperature), got {args.cache_batch}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available here")

    from specdec_models.errors import SpecdecError, check
    from specdec_models.files import check_output, mark_dir

    out = Path(args.out).expanduser().resolve()
    steps_file = out / "steps.json"
    done: dict[str, float] = json.loads(steps_file.read_text()) if steps_file.is_file() else {}
    try:
        check({"prompts", "prompts_eval"} <= set(done) or Path(args.text).expanduser().is_file(),
              f"--text {args.text} does not exist or is not a file (the prompts are made from it)")
        # its steps replace their own paths inside: a folder of other files is refused (steps.json: a
        # recipe folder from before folders were marked)
        check_output(out, "--out", kind=RECIPE_KIND, force=args.force, inputs=[args.text], records=["steps.json"])
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    mark_dir(out, RECIPE_KIND)
    py = sys.executable
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}

    def step(name: str, commands: list[list[str]], marker: Path, threads: int = 2,
             threads_file: Path | None = None) -> None:
        if STEPS.index(name) > STEPS.index(args.until):
            return
        if name in done and marker.exists():
            print(f"[{name}] done before ({done[name] / 60:.1f} min): {marker}")
            return
        print(f"[{name}] " + "\n    & ".join(" ".join(c) for c in commands), flush=True)
        t0 = time.perf_counter()
        codes = side_by_side(commands, env, threads, threads_file)
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
                    "--batch-size", str(args.cache_batch or (GPU_DEFAULTS["cache_batch"] if args.device == "cuda"
                                                             else 256)),
                    "--layers", "2", "15", "27", "30", "--model-dtype", "auto", "--device", args.device,
                    *(["--max-minutes", str(args.cache_minutes)] if args.cache_minutes else []),
                    "--out", str(cache), "--overwrite"]],
         cache / "cache.json")
    counts = out / "draft_vocab.json"
    step("draft_vocab", [[py, "scripts/draft_vocab.py", "--cache", str(cache), "--out", str(counts), "--force",
                          "--report", str(out / "draft_vocab_report.json")]], counts)
    datastore = out / "datastore.npz"
    step("datastore", [[py, "scripts/compare_hf_drafts.py", "datastore", "--cache", str(cache), "--out",
                        str(datastore), "--force"]], datastore)
    runs = {"eagle3": out / "eagle3", "prophet": out / "prophet", "student": out / "student"}
    threads_file = out / "train_threads"
    train = head_training(py, args, cache, counts, runs, threads_file)
    step("train", train, runs[args.heads[0]] / "export" / "config.json", threads=1, threads_file=threads_file)
    if args.student_minutes:
        student_models, corpus = out / "student_models", out / "student_corpus.jsonl"
        step("student_prep", [[py, "scripts/compare_hf_drafts.py", "student", "--out", str(student_models),
                               "--force"],
                              [py, "scripts/compare_hf_drafts.py", "corpus", "--cache", str(cache), "--out",
                               str(corpus), "--force"]], corpus)
        step("train_student", [[py, "-m", "train", "experiment=smollm2_student",
                                f"teacher.path={student_models / 'target'}", f"student.path={student_models / 'student'}",
                                f"data.files=[{corpus}]",
                                f"trainer.max_time={max_time(args.student_minutes)}",
                                f"output_dir={runs['student']}", "overwrite=true"]],
             runs["student"] / "export" / "config.json")
    report = out / "report"
    compare = comparison(py, args, ev_text, ev_open, runs, report / "compare", datastore)
    step("compare", [compare], report / "compare" / "table.md")
    report.mkdir(parents=True, exist_ok=True)
    lines = ["| step | minutes |", "|---|---:|"] + [f"| {k} | {v / 60:.1f} |" for k, v in done.items()]
    lines.append(f"| total | {sum(done.values()) / 60:.1f} |")
    (report / "steps.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
