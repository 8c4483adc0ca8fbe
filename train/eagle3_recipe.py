"""One recipe for an EAGLE-3 head of any Hugging Face target: `scripts/eagle3.py` (`make eagle3`).

Steps, each resumed where a killed run stopped (a finished step is skipped; the answers and the
cache resume batch by batch inside their step):

1. data: conversations from `--data` (sharegpt, a ShareGPT/messages JSON(L) file, a save_to_disk
   folder, a dataset name), deduplicated, length-filtered, split by conversation id into training
   and held-out (`train.data.conversations`); a seeded sample of `--conversations` of them;
2. answers: the target answers every assistant turn, turn by turn, from its own earlier answers
   (`train.data.chat_answers`; `--keep-answers`: the data's own answers, no model run), within
   `--answer-minutes`;
3. cache: the answered conversations rendered through the chat template, loss on the answers only,
   and the target's hidden states at EAGLE-3's layers [2, L//2, L-3] and its last
   (`train.data.chat_rows.build_chat_cache`), the held-out conversations as validation rows;
4. draft_vocab: the target's greedy tokens on the cache's answers counted (`scripts/draft_vocab.py`);
5. train: `python -m train experiment=smollm2_eagle3 target.path=TARGET` (its CPU sizes;
   `hf_eagle3_gpu` with `--device cuda`; or `--experiment`) on the cache for `--train-minutes`;
6. peers (`--peers`): vLLM's speculators' and SpecForge's trainers on the same cache for the same
   minutes (`scripts/train_peers.py`, needs `make setup-interop`);
7. export: the head in the speculators and SGLang layouts (`scripts/export_eagle3.py`);
8. evaluate: MT-Bench and HumanEval, T=0 and T=1, batch 1 (`scripts/evaluate.py`): the head as a
   chain and as a tree, the peers' heads, prompt lookup and plain decoding;
9. report: OUT/report/: the evaluation's table, JSON and PNG, steps.md (each step's wall time) and
   recipe.json (the counts, the rows, the answers' tokens per second).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec_models.errors import SpecdecError, check
from specdec_models.files import write_file

REPO = Path(__file__).resolve().parents[1]
STEPS = ("data", "answers", "cache", "draft_vocab", "train", "peers", "export", "evaluate", "report")
RECIPE_KIND = "eagle3 recipe"     # the folder kind of --out (`specdec_models.files.mark_dir`)
SETTINGS_FILE = "settings.json"   # the recipe's Settings, which `python -m train.eagle3_recipe STEP OUT` reads


@dataclass
class Settings:
    """What scripts/eagle3.py parsed (its --help describes each)."""
    target: str
    data: str
    out: Path
    device: str = "cpu"
    conversations: int = 1200
    held_out: int = 16
    seq_len: int = 512
    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0, 1.0)
    answer_batch: int = 64
    answer_chunk: int = 64
    answer_minutes: float | None = 30.0
    keep_answers: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    cache_batch: int = 16
    train_minutes: float = 30.0
    experiment: str | None = None
    train_args: tuple[str, ...] = ()
    peers: bool = False
    peer_python: str | None = None
    benchmarks: tuple[str, ...] = ("mt_bench", "humaneval")
    subset: str | None = "mt_bench=1,humaneval=8"    # scripts/evaluate.py's --subset: 8 prompts per set
    eval_max_new_tokens: int = 128
    tree: str | None = "6,3,1,0.1"
    processes: int = 1               # answers and cache: that many processes here (each a share of the threads)
    seed: int = 0
    until: str = STEPS[-1]


def aux_layers(depth: int) -> list[int]:
    """EAGLE-3's default aux layers of a target of `depth` layers, as `hidden_states` indices."""
    from specdec_models.heads.eagle3 import default_aux_layers

    return list(default_aux_layers(depth))


def check_inputs(s: Settings) -> dict[str, Any]:
    """Everything checked before any work (one-line SpecdecError): the target and its chat template
    (with `chat_template_kwargs`: a warning when it ignores them), the data source, the benchmarks'
    packages, the sizes. Returns {"depth", "layers"} of the target."""
    from specdec_models.hf import text_config
    from specdec_models.hf.weights import check_source, load_config, load_tokenizer
    from train.bench.benchmarks import SOURCES, locate

    from .data.conversations import check_chat_template, check_data_file, sharegpt_path

    check(s.until in STEPS, f"--until must be one of {', '.join(STEPS)}")
    for name, value in [("--conversations", s.conversations), ("--seq-len", s.seq_len),
                        ("--max-new-tokens", s.max_new_tokens), ("--answer-batch", s.answer_batch),
                        ("--answer-chunk", s.answer_chunk),
                        ("--cache-batch", s.cache_batch), ("--eval-max-new-tokens", s.eval_max_new_tokens)]:
        check(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
    batches = -(-s.conversations // s.answer_batch)
    check(isinstance(s.processes, int) and 1 <= s.processes <= batches,
          f"--processes {s.processes} is more than the {batches} batch(es) of --answer-batch {s.answer_batch} that "
          f"--conversations {s.conversations} make: some processes would have nothing to answer")
    check(s.processes == 1 or s.device == "cpu", "--processes runs CPU processes here; on GPUs launch the answers "
                                                 "and cache steps with torchrun (docs/scale.md)")
    check(2 <= s.held_out < s.conversations, f"--held-out must be in [2, --conversations): the held-out "
                                             f"conversations are the validation rows, got {s.held_out}")
    check(s.train_minutes > 0, f"--train-minutes must be > 0, got {s.train_minutes}")
    check(s.answer_minutes is None or s.answer_minutes > 0, f"--answer-minutes must be > 0, got {s.answer_minutes}")
    check(all(0 <= t < float("inf") for t in s.temperatures) and s.temperatures,
          f"--temperatures must be finite numbers >= 0, got {list(s.temperatures)}")
    path = check_source(s.target, "--target")
    check_chat_template(load_tokenizer(path, "--target"), s.chat_template_kwargs)
    if s.data == "sharegpt":
        sharegpt_path()
    else:
        data = Path(s.data).expanduser()
        if data.is_file():
            check_data_file(data)
        else:
            check(data.is_dir() or not data.suffix, f"--data {s.data} does not exist")
    for name in s.benchmarks:
        check(name in SOURCES, f"unknown benchmark {name!r}: choose from {', '.join(sorted(SOURCES))}")
        locate(name)
    from train.bench.benchmarks import load_benchmark, parse_subset
    subsets = parse_subset(s.subset, list(s.benchmarks))
    for name in s.benchmarks:
        load_benchmark(name, subsets[name])             # --subset larger than a category: one line
    if s.device == "cuda":
        import torch
        check(torch.cuda.is_available(), "--device cuda: no CUDA device is available here")
    config = text_config(load_config(path, "--target"))
    depth = int(config.num_hidden_layers)
    return {"depth": depth, "vocab_size": int(config.vocab_size), "layers": sorted({*aux_layers(depth), depth}),
            "path": str(path.resolve())}


# ---------------------------------------------------------------- the steps run in this process

def step_data(s: Settings, out: Path) -> dict[str, Any]:
    """Conversations chosen for the recipe: data/train.jsonl and data/held_out.jsonl (messages
    JSONL), data/data.json the counts."""
    from .data.chat_answers import record
    from .data.conversations import prepare_conversations, split_held_out

    convs, _, counts = prepare_conversations(s.data, seed=str(s.seed), min_turns=2)
    # held out by id hash (a conversation wholly on one side), about three times --held-out of them to draw from
    train, held = split_held_out(convs, min(0.5, max(0.01, 3 * s.held_out / max(len(convs), 1))), str(s.seed))
    counts.held_out = len(held)
    check(train, f"--data {s.data} left no training conversation ({counts.line()})")
    rng = random.Random(s.seed)
    train = rng.sample(train, min(len(train), s.conversations - min(s.held_out, len(held))))
    held = rng.sample(held, min(len(held), s.held_out))
    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    for name, convs in (("train", train), ("held_out", held)):
        lines = "".join(json.dumps(record(c), ensure_ascii=False) + "\n" for c in convs)
        write_file(folder / f"{name}.jsonl", lambda f, lines=lines: f.write(lines.encode("utf-8")))
    info = {"source": s.data, "counts": vars(counts), "line": counts.line(), "train": len(train),
            "held_out": len(held)}
    write_file(folder / "data.json", lambda f: f.write(json.dumps(info, indent=1).encode()))
    print(f"[data] {counts.line()}; the recipe takes {len(train)} training and {len(held)} held-out conversations",
          flush=True)
    return info


def _read(path: Path):
    from .data.chat_answers import from_record
    return [from_record(json.loads(line))[0] for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def _eta(done: int, total: int, seconds: float) -> str:
    left = seconds / max(done, 1) * (total - done)
    return f"{seconds / 60:.1f} min, about {left / 60:.1f} min left"


def step_answers(s: Settings, out: Path, model_dtype, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """The target answers the held-out then the training conversations (answers/); as process
    `rank` of `world`, its batches of them (`chat_answers.answer_conversations`)."""
    from .data.chat_answers import AnswerOptions, answer_conversations, budget_text, load_answerer

    # the held-out conversations first: a time budget that runs out leaves fewer training rows, never no validation
    convs = _read(out / "data" / "held_out.jsonl") + _read(out / "data" / "train.jsonl")
    answerer = identity = None
    if not s.keep_answers:
        answerer, identity = load_answerer(s.target, seq_len=s.seq_len, max_new_tokens=s.max_new_tokens,
                                           device=s.device, dtype=model_dtype, chunk=s.answer_chunk)
    t0 = time.perf_counter()
    budget = f", budget {budget_text(s.answer_minutes)} min" if s.answer_minutes and world == 1 else ""

    def progress(done: int, total: int, tokens: int, where: str) -> None:
        seconds = time.perf_counter() - t0
        print(f"[answers{f' {rank}/{world}' if world > 1 else ''}] {done:,}/{total:,} conversations"
              f"{f' ({where})' if where else ''}, {tokens:,} tokens, "
              f"{tokens / max(seconds, 1e-9):,.0f} tokens/s, {seconds / 60:.1f} min{budget}", flush=True)

    options = AnswerOptions(temperatures=tuple(s.temperatures), batch_size=s.answer_batch, seed=s.seed,
                            chat_template_kwargs=s.chat_template_kwargs, keep_answers=s.keep_answers,
                            max_seconds=None if s.answer_minutes is None or world > 1 else 60 * s.answer_minutes,
                            rank=rank, world=world)
    meta = answer_conversations(convs, out / "answers", answerer=answerer, identity=identity or {"kind": "data"},
                                data={"source": s.data, "seed": s.seed}, options=options, progress=progress,
                                report=lambda line: print(f"[answers] {line}", flush=True))
    if not meta.get("finalized", True):
        return meta
    print(f"[answers] {meta['written']:,} conversations, {meta['answers']:,} answers, {meta['tokens']:,} tokens at "
          f"{meta['tokens_per_second']:,.0f} tokens/s ({meta['too_long']} too long to answer)", flush=True)
    return meta


def step_cache(s: Settings, out: Path, layers: list[int], model_dtype, rank: int = 0, world: int = 1
               ) -> dict[str, Any]:
    """The embeddings cache of the answered conversations (cache/), held-out ones last; as process
    `rank` of `world`, its shards of it."""
    from .data.chat_answers import read_answers
    from .data.chat_rows import build_chat_cache

    pairs, _ = read_answers(out / "answers")
    held_ids = {c.id for c in _read(out / "data" / "held_out.jsonl")}
    train = [p for p in pairs if p[0].id not in held_ids]
    held = [p for p in pairs if p[0].id in held_ids]
    t0 = time.perf_counter()
    total = [0]
    state = {"done": 0, "last": 0.0}

    def progress(tokens: int) -> None:
        state["done"] += tokens
        seconds = time.perf_counter() - t0
        if seconds - state["last"] >= 10 or state["done"] >= total[0]:
            state["last"] = seconds
            print(f"[cache] {state['done']:,}/{total[0]:,} tokens, {_eta(state['done'], total[0], seconds)}",
                  flush=True)

    def report(line: str) -> None:
        print(f"[cache] {line}", flush=True)

    total[0] = len(pairs) * s.seq_len
    meta = build_chat_cache(s.target, train, held, out / "cache", seq_len=s.seq_len, layers=layers,
                            describe={"answers": str((out / "answers").resolve())},
                            chat_template_kwargs=s.chat_template_kwargs, batch_size=s.cache_batch, device=s.device,
                            model_dtype=model_dtype, seed=s.seed, overwrite=world == 1, progress=progress,
                            report=report, rank=rank, world=world)
    if not meta.get("finalized", True):
        return meta
    rc = meta["row_counts"]
    print(f"[cache] {meta['windows']:,} rows ({meta['held_out_rows']} held out), {rc['tokens']:,} tokens of which "
          f"{rc['answer_tokens']:,} answer tokens ({rc['refused']} refused by the template, {rc['no_answer']} with no "
          f"answer left)", flush=True)
    return {"windows": meta["windows"], "held_out_rows": meta["held_out_rows"], **rc}


# ---------------------------------------------------------------- the steps run as commands

def max_time_minutes(text: str) -> float:
    """trainer.max_time (DD:HH:MM:SS) in minutes."""
    days, hours, minutes, seconds = (int(x) for x in str(text).split(":"))
    return (days * 24 + hours) * 60 + minutes + seconds / 60


def max_time(minutes: float) -> str:
    """trainer.max_time for a budget in minutes (DD:HH:MM:SS, as Lightning's Timer reads it)."""
    seconds = round(minutes * 60)
    days, seconds = divmod(seconds, 86400)
    return f"{days:02d}:{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


DRAFT_VOCAB_SIZES = (2048, 4096, 8192, 16384, 32768)


def commands(s: Settings, out: Path, py: str, held_out_rows: int, rows: int, vocab_size: int
             ) -> dict[str, list[list[str]]]:
    """The commands of the steps that run as their own processes (`rows`: the cache's, the last
    `held_out_rows` of them validation rows, which the peers do not train on either)."""
    from specdec_models.cpu import fast_precision

    gpu = s.device == "cuda"
    experiment = s.experiment or ("hf_eagle3_gpu" if gpu else "smollm2_eagle3")     # its CPU sizes, any target
    head = out / "eagle3"
    train = [py, "-m", "train", f"experiment={experiment}", f"target.path={s.target}", f"data.cache={out / 'cache'}",
             f"data.seq_len={s.seq_len}", f"data.val_windows={max(1, held_out_rows)}",
             f"head.draft_vocab={out / 'draft_vocab.json'}", f"trainer.max_time={max_time(s.train_minutes)}",
             f"trainer.precision={fast_precision('gpu' if gpu else 'cpu')}", "callbacks.speculative_eval.every=0",
             f"output_dir={head}", "overwrite=true", *s.train_args]
    exported = head / "export"
    layouts = [[py, "scripts/export_eagle3.py", str(exported), str(out / f"export_{layout}"), "--layout", layout,
                "--gguf" if s.target.endswith(".gguf") else "--hf-model", s.target, "--force"]
               for layout in ("speculators", "sglang")]
    heads = ["--head", f"specdec={exported}"]
    if s.peers:
        heads += ["--head", f"speculators={out / 'peers' / 'speculators' / 'head'}",
                  "--head", f"specforge={out / 'peers' / 'specforge' / 'head'}"]
    evaluate = [py, "scripts/evaluate.py", "--target", s.target, *heads, "--lookup",
                "--benchmarks", ",".join(s.benchmarks), "--temperatures", ",".join(map(str, (0, 1))),
                "--max-new-tokens", str(s.eval_max_new_tokens), "--dtype", "auto", "--device", s.device,
                "--out", str(out / "report" / "evaluation"), "--force"]
    if s.subset is not None:
        evaluate += ["--subset", str(s.subset)]
    if s.tree:
        evaluate += ["--tree", s.tree]
    if s.chat_template_kwargs:
        evaluate += ["--chat-template-kwargs", json.dumps(s.chat_template_kwargs)]
    peers = [py, "scripts/train_peers.py", "--cache", str(out / "cache"), "--draft-vocab",
             str(out / "draft_vocab.json"), "--target", s.target, "--out", str(out / "peers"), "--minutes",
             str(s.train_minutes), "--threads", "2",
             "--rows", str(max(1, rows - held_out_rows)), "--force",
             *(["--python", s.peer_python] if s.peer_python else [])]
    sizes = [str(n) for n in DRAFT_VOCAB_SIZES if n < vocab_size] or [str(max(1, vocab_size // 2))]
    return {"draft_vocab": [[py, "scripts/draft_vocab.py", "--cache", str(out / "cache"), "--out",
                             str(out / "draft_vocab.json"), "--val-windows", str(max(1, held_out_rows)),
                             "--sizes", *sizes, "--report", str(out / "draft_vocab_report.json"), "--force"]],
            "train": [train], "peers": [peers], "export": layouts, "evaluate": [evaluate]}


def markers(out: Path) -> dict[str, Path]:
    """The file each step leaves when it is done."""
    return {"data": out / "data" / "data.json", "answers": out / "answers" / "answers.json",
            "cache": out / "cache" / "cache.json", "draft_vocab": out / "draft_vocab.json",
            "train": out / "eagle3" / "export" / "config.json", "peers": out / "peers" / "peers.json",
            "export": out / "export_sglang" / "config.json",
            "evaluate": out / "report" / "evaluation" / "evaluation.json", "report": out / "report" / "steps.md"}


def write_report(out: Path, done: dict[str, float], facts: dict[str, Any]) -> None:
    """report/steps.md (each step's wall time and what it made) and report/recipe.json."""
    report = out / "report"
    report.mkdir(parents=True, exist_ok=True)
    lines = ["| step | minutes |", "|---|---:|"] + [f"| {k} | {v / 60:.1f} |" for k, v in done.items()]
    lines.append(f"| total | {sum(done.values()) / 60:.1f} |")
    answers = facts.get("answers") or {}
    if answers:
        lines += ["", f"answers: {answers.get('written', 0):,} conversations, {answers.get('answers', 0):,} answers, "
                      f"{answers.get('tokens', 0):,} tokens at {answers.get('tokens_per_second', 0):,.0f} tokens/s"]
    cache = facts.get("cache") or {}
    if cache:
        lines.append(f"cache: {cache.get('windows', 0):,} rows ({cache.get('held_out_rows', 0)} held out), "
                     f"{cache.get('answer_tokens', 0):,} answer tokens")
    text = "\n".join(lines) + "\n"
    write_file(report / "steps.md", lambda f: f.write(text.encode()))
    blob = json.dumps({"steps_seconds": done, **facts}, indent=1, default=str)
    write_file(report / "recipe.json", lambda f: f.write(blob.encode()))


def run_recipe(s: Settings, force: bool = False) -> int:
    """Run (or resume) the recipe into s.out; 2 with one line on bad input, before any work."""
    from specdec_models.cpu import resolve_dtype
    from specdec_models.files import check_output, mark_dir

    out = s.out.expanduser().resolve()
    try:
        target = check_inputs(s)
        check_output(out, "--out", kind=RECIPE_KIND, force=force, inputs=[s.target, s.data])
    except SpecdecError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    mark_dir(out, RECIPE_KIND)
    steps_file = out / "steps.json"
    state = json.loads(steps_file.read_text()) if steps_file.is_file() else {}
    done: dict[str, float] = state.get("done", {})
    facts: dict[str, Any] = state.get("facts", {})
    marks = markers(out)
    model_dtype = resolve_dtype("auto", s.device)
    py = sys.executable
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    blob = json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in vars(s).items()}, indent=1)
    write_file(out / SETTINGS_FILE, lambda f: f.write(blob.encode()))
    print(f"[recipe] {out}: target {target['path']} ({target['depth']} layers; cached hidden states "
          f"{target['layers']}), data {s.data}, device {s.device} ({model_dtype})", flush=True)

    def save() -> None:
        blob = json.dumps({"done": done, "facts": facts}, indent=1, default=str)
        write_file(steps_file, lambda f: f.write(blob.encode()))

    def step(name: str, work) -> bool:
        if STEPS.index(name) > STEPS.index(s.until):
            return False
        if name in done and marks[name].exists():
            print(f"[{name}] done before ({done[name] / 60:.1f} min)", flush=True)
            return True
        t0 = time.perf_counter()
        result = work()
        done[name] = time.perf_counter() - t0
        if result is not None:
            facts[name] = result
        save()
        print(f"[{name}] {done[name] / 60:.1f} min", flush=True)
        return True

    def run_commands(name: str) -> None:
        cache = facts.get("cache", {})
        cmds = commands(s, out, py, int(cache.get("held_out_rows", s.held_out)), int(cache.get("windows", 0)),
                        target["vocab_size"])[name]
        for cmd in cmds:
            print(f"[{name}] {' '.join(cmd)}", flush=True)
            code = subprocess.run(cmd, check=False, cwd=REPO, env=env).returncode
            if code:
                raise SystemExit(f"[{name}] failed (exit {code}): fix it and run the recipe again to resume here")

    try:
        step("data", lambda: step_data(s, out))
        step("answers", lambda: in_processes("answers", s, out) if s.processes > 1
             else step_answers(s, out, model_dtype))
        step("cache", lambda: in_processes("cache", s, out) if s.processes > 1
             else step_cache(s, out, target["layers"], model_dtype))
    except SpecdecError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    step("draft_vocab", lambda: run_commands("draft_vocab"))
    step("train", lambda: run_commands("train"))
    if s.peers:
        step("peers", lambda: run_commands("peers"))
    step("export", lambda: run_commands("export"))
    step("evaluate", lambda: run_commands("evaluate"))
    if STEPS.index("report") <= STEPS.index(s.until):
        write_report(out, done, facts)
        print((out / "report" / "steps.md").read_text(), flush=True)
        print(f"report: {out / 'report'}", flush=True)
    return 0


# ---------------------------------------------------------------- one step as one of several processes

def read_settings(out: Path) -> Settings:
    """The Settings a recipe run recorded in OUT/settings.json."""
    path = out / SETTINGS_FILE
    check(path.is_file(), f"{out} holds no recipe settings ({SETTINGS_FILE}): start the recipe with scripts/eagle3.py")
    raw = json.loads(path.read_text())
    raw["out"] = Path(raw["out"])
    for name in ("temperatures", "train_args", "benchmarks"):
        raw[name] = tuple(raw[name])
    return Settings(**raw)


def in_processes(name: str, s: Settings, out: Path) -> dict[str, Any]:
    """Step `name` (answers or cache) as `s.processes` processes on this machine, each with its
    share of the CPU threads (`python -m train.eagle3_recipe NAME OUT` with RANK and WORLD_SIZE);
    the last to finish writes the step's folder. Returns what the folder records."""
    world = s.processes
    threads = max(1, (os.cpu_count() or world) // world)
    env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": str(threads)}
    procs = [subprocess.Popen([sys.executable, "-m", "train.eagle3_recipe", name, str(out)], cwd=REPO,
                              env={**env, "RANK": str(rank)}) for rank in range(world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"[{name}] a process failed (exit codes {codes}): run the recipe again to resume here")
    if name == "answers":
        return json.loads((out / "answers" / "answers.json").read_text())
    meta = json.loads((out / "cache" / "cache.json").read_text())
    return {"windows": meta["windows"], "held_out_rows": meta["source"]["held_out_rows"],
            "rows": meta["source"]["rows"], "processes": world}


def main(argv: list[str] | None = None) -> int:
    """`python -m train.eagle3_recipe answers|cache OUT`: one process's share of a step of the recipe
    in OUT (its settings.json), rank and world from RANK and WORLD_SIZE (torchrun sets them; every
    process must see OUT: one machine, or a filesystem the nodes share)."""
    import argparse

    from specdec_models.cpu import resolve_dtype

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("step", choices=("answers", "cache"))
    p.add_argument("out")
    a = p.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        s = read_settings(Path(a.out))
        if s.device == "cuda":                       # one GPU per process (torchrun's LOCAL_RANK)
            from dataclasses import replace
            s = replace(s, device=f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        out = Path(a.out).expanduser().resolve()
        dtype = resolve_dtype("auto", s.device)
        if a.step == "answers":
            step_answers(s, out, dtype, rank, world)
        else:
            target = check_inputs(s)
            step_cache(s, out, target["layers"], dtype, rank, world)
    except SpecdecError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
