"""One recipe for an EAGLE-3 head of any Hugging Face target: `specdec eagle3` (`make eagle3`).

Steps, each resumed where a killed run stopped (a finished step is skipped; the answers and the
cache resume batch by batch inside their step):

1. data: conversations from `--data` (sharegpt, a ShareGPT/messages JSON(L) file, a save_to_disk
   folder, a dataset name), deduplicated, length-filtered (no message longer than a row can hold,
   counted in characters), split by conversation id into training and held-out
   (`train.data.conversations`); or with `--data text:FILE` single-turn prompts made from a text
   file (`train.data.regenerate.text_conversations`), answered like any conversation; a seeded
   sample of `--conversations` of them, chosen before --out is created (`choose_data`);
2. answers: the target answers every assistant turn, turn by turn, from its own earlier answers
   (`train.data.chat_answers`; `--keep-answers`: the data's own answers, no model run), within
   `--answer-minutes`;
3. cache: the answered conversations rendered through the chat template, loss on the answers only,
   and the target's hidden states at EAGLE-3's layers [2, L//2, L-3] and its last
   (`train.data.chat_rows.build_chat_cache`), the held-out conversations as validation rows;
4. draft_vocab: the target's greedy tokens on the cache's answers counted (`train.draft_vocab`);
5. train: each head kind of `--head` (eagle3 by default; `HEAD_RECIPES`, one row per kind) in
   turn, into OUT/<kind>/: `experiment=smollm2_eagle3` (its CPU sizes, target.path=TARGET;
   `hf_eagle3_gpu` with `--device cuda`; smollm2_dflash or hf_dflash for dflash; or `--experiment`
   with one kind, any whose task is that kind's) on the same cache for the same `--train-minutes`,
   with the draft vocabulary size `train.plan` gives the target (`Settings.draft_vocab_size`),
   composed and run in this process (`train.run.compose`, `train.run.run`), each writing its
   specdec export (OUT/<kind>/export);
6. peers (`--peers`): vLLM's speculators' and SpecForge's trainers on the same cache for the same
   minutes (`specdec peers`, in their own environment: `make setup-interop`);
7. export: the eagle3 head in the speculators and SGLang layouts (`train.eagle3_export`), the
   speculators layout's `speculative_tokens` the evaluated chain's gamma (or `--speculative-tokens`),
   printed and recorded with where it comes from; each block head in speculators' layout
   (OUT/<kind>/export_speculators), drafting its whole block;
8. evaluate: MT-Bench and HumanEval, T=0 and T=1 (`train.bench.eval_job`): each kind's head as a
   chain and as a tree, side by side (one --head per kind), the peers' heads and prompt lookup; tau
   on every prompt of `--subset`, the speed-up over plain decoding on `--speed-subset` of them, batch 1;
9. report: OUT/report/: the evaluation's table, JSON and PNG, steps.md (each step's wall time) and
   recipe.json (the counts, the rows, the answers' tokens per second).

Each step is a library call with typed inputs and a typed result (a dataclass, recorded in
steps.json); only two run as other processes: the answers and the cache with `--processes N`
(`python -m train.eagle3_recipe STEP OUT`, as torchrun runs them on GPUs) and the peers (their own
Python environment). Every input is checked before step 1 (`check_inputs`): the sizes, the target,
the data, the training config composed with `--experiment` and every `--train-args` override, the
export and the evaluation's settings. A bad one is one line, exit 2, nothing written; so is data
that leaves nothing to train on (the data step's choice comes before --out is created).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Any

from specdec_models.cli_args import Parser
from specdec_models.errors import SpecdecError, check, cli_main
from specdec_models.files import write_file

from .plan import CPU_SIZES, max_time, max_time_minutes  # noqa: F401  (max_time_minutes: the recipe's API too)

REPO = Path(__file__).resolve().parents[1]
STEPS = ("data", "answers", "cache", "draft_vocab", "train", "peers", "export", "evaluate", "report")
RECIPE_KIND = "eagle3 recipe"     # the folder kind of --out (`specdec_models.files.mark_dir`)
TRAIN_RESULT = "recipe_train.json"   # OUT/<kind>/: the train step's result for that kind, once it is trained
SETTINGS_FILE = "settings.json"   # the recipe's Settings, which `python -m train.eagle3_recipe STEP OUT` reads
# The shortest --seq-len: a row holds at least one user turn under the chat template (ChatML's headers
# and a short question: about 16 tokens) and the 16 positions an answer needs to be asked for at all
# (`train.data.chat_answers.MIN_ROOM`); a shorter row could never hold an answer token.
MIN_SEQ_LEN = 32
# --answers-server's name for llama.cpp's llama-server started here on the GGUF target, for the answers step
# only: on a CPU it multiplies the GGUF's 4-bit weights as they are (docs/scale.md has the rates side by side)
LOCAL = "local"
# Characters per token that no tokenizer reaches on real text (BPE tokens average 3 to 5 characters):
# a message of more than seq_len * this many characters cannot fit in a row, and the data step drops
# its conversation by a character count, before anything tokenizes it.
MAX_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class HeadRecipe:
    """How the recipe trains one head kind: its training task, its experiment on a CPU and on a
    GPU, and its column in the evaluation (eagle3's is "specdec", the name its reports have always
    had). The export the run writes is OUT/<kind>/export (the task's own export kind)."""

    task: str
    cpu: str
    gpu: str
    column: str
    sizes: str            # "module:Class" of the task's typed `head:` node, checked before step 1

    def sizes_type(self) -> type:
        import importlib

        module, _, name = self.sizes.partition(":")
        return getattr(importlib.import_module(module), name)


# the head kinds --head trains, by name: a new head kind is one row
HEAD_RECIPES = {
    "eagle3": HeadRecipe("hf_eagle3", "smollm2_eagle3", "hf_eagle3_gpu", "specdec",
                         "train.tasks.hf_eagle3:Eagle3Sizes"),
    "dflash": HeadRecipe("hf_dflash", "smollm2_dflash", "hf_dflash", "dflash", "train.tasks.hf_dflash:DFlashSizes"),
    "peagle": HeadRecipe("hf_peagle", "smollm2_peagle", "hf_peagle", "peagle", "train.tasks.hf_peagle:PEagleSizes"),
}


@dataclass
class Settings:
    """What specdec eagle3 parsed (its --help describes each)."""
    target: str
    data: str
    out: Path
    device: str = "cpu"
    conversations: int = CPU_SIZES["conversations"]      # the sizes: measured on 2 CPU cores (`train.plan`)
    held_out: int = 16
    seq_len: int = 512
    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0, 1.0)
    answer_batch: int = CPU_SIZES["answer_batch"]
    answer_chunk: int = CPU_SIZES["answer_chunk"]
    answer_minutes: float | None = 30.0
    keep_answers: bool = False
    answers_server: tuple[str, ...] = ()    # OpenAI-compatible servers of the target (LOCAL: llama-server started here)
    answers_in_flight: int = 32              # requests in flight per server
    chat_template_kwargs: dict = field(default_factory=dict)
    cache_batch: int = CPU_SIZES["cache_batch"]
    train_minutes: float = CPU_SIZES["train_minutes"]
    draft_vocab_size: int | None = None     # head.draft_vocab_size (`train.plan`): None the experiment's, 0 the whole
    experiment: str | None = None
    heads: tuple[str, ...] = ("eagle3",)    # the head kinds trained (HEAD_RECIPES), each into OUT/<kind>/
    train_args: tuple[str, ...] = ()
    peers: bool = False
    peer_python: str | None = None
    benchmarks: tuple[str, ...] = ("mt_bench", "humaneval")
    subset: str | None = "mt_bench=1,humaneval=8"    # specdec evaluate's --subset: 8 prompts per set
    speed_subset: str | None = None                   # specdec evaluate's --speed-subset (None: 8 per set)
    eval_max_new_tokens: int = 128
    tree: str | None = "6,3,1,0.1"
    speculative_tokens: int | None = None    # the export's tokens per step (None: the evaluated chain's gamma)
    processes: int = 1               # answers and cache: that many processes here (each a share of the threads)
    seed: int = 0
    until: str = STEPS[-1]


def aux_layers(depth: int) -> list[int]:
    """EAGLE-3's default aux layers of a target of `depth` layers, as `hidden_states` indices."""
    from specdec_models.heads.eagle3 import default_aux_layers

    return list(default_aux_layers(depth))


@dataclass(frozen=True)
class Target:
    """The target as the recipe uses it: its path (resolved), depth, vocabulary and the hidden
    states the cache holds (EAGLE-3's aux layers and the last)."""

    path: str
    depth: int
    vocab_size: int
    layers: list[int]


def check_inputs(s: Settings, out: Path | None = None) -> Target:
    """Everything checked before any work (one-line SpecdecError): the sizes, the target and its
    chat template (with `chat_template_kwargs`: a warning when it ignores them), the data source,
    the device; with `out`, also the later steps' inputs (`check_later_steps`): the training config,
    the export and the evaluation (its benchmarks' packages and subset)."""
    from specdec_models.hf import text_config
    from specdec_models.hf.weights import check_source, load_config, load_tokenizer

    from .data.conversations import check_chat_template

    check_sizes(s)
    path = check_source(s.target, "--target")
    check_chat_template(load_tokenizer(path, "--target"), s.chat_template_kwargs)
    check_data(s)
    if s.device == "cuda":
        import torch
        check(torch.cuda.is_available(), "--device cuda: no CUDA device is available here")
    config = text_config(load_config(path, "--target"))
    positions = getattr(config, "max_position_embeddings", None)
    check(positions is None or s.seq_len + 1 <= positions,
          f"--seq-len {s.seq_len}: a row of seq_len + 1 tokens exceeds the target's {positions} positions")
    depth = int(config.num_hidden_layers)
    target = Target(str(path.resolve()), depth, int(config.vocab_size), sorted({*aux_layers(depth), depth}))
    if out is not None:
        check_later_steps(s, out)
    return target


def check_sizes(s: Settings) -> None:
    """The recipe's numbers: positive sizes, processes that each have batches, the held-out share,
    the minutes and temperatures."""
    check(s.until in STEPS, f"--until must be one of {', '.join(STEPS)}")
    check_heads(s)
    for name, value in [("--conversations", s.conversations), ("--seq-len", s.seq_len),
                        ("--max-new-tokens", s.max_new_tokens), ("--answer-batch", s.answer_batch),
                        ("--answer-chunk", s.answer_chunk),
                        ("--cache-batch", s.cache_batch), ("--eval-max-new-tokens", s.eval_max_new_tokens)]:
        check(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
    check(s.seq_len >= MIN_SEQ_LEN, f"--seq-len must be at least {MIN_SEQ_LEN} tokens (a user turn under the chat "
                                    f"template and room for an answer), got {s.seq_len}")
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
    if s.answers_server:
        from .data.answer_server import normalize_url

        check(not s.keep_answers, "--answers-server asks servers for the target's answers; --keep-answers keeps the "
                                  "data's own: give one of them")
        check(s.processes == 1, "--answers-server fans the answers out over the servers; leave out --processes")
        check(isinstance(s.answers_in_flight, int) and s.answers_in_flight >= 1,
              f"--answers-in-flight must be a positive integer, got {s.answers_in_flight!r}")
        if LOCAL in s.answers_server:
            from .data.llama_server import llama_server_binary

            check(s.answers_server.count(LOCAL) == 1, f"--answers-server names {LOCAL} twice")
            check(s.target.endswith(".gguf"), f"--answers-server {LOCAL} starts llama.cpp's llama-server on a GGUF "
                                              f"target; {s.target} is not a .gguf file")
            check(llama_server_binary() is not None, f"--answers-server {LOCAL}: llama.cpp's llama-server is not "
                                                     "installed: run `make setup-server`")
        s.answers_server = tuple(u if u == LOCAL else normalize_url(u) for u in s.answers_server)
    check(all(0 <= t < float("inf") for t in s.temperatures) and s.temperatures,
          f"--temperatures must be finite numbers >= 0, got {list(s.temperatures)}")


def check_heads(s: Settings) -> None:
    """--head: one or more distinct kinds of `HEAD_RECIPES`; --experiment names one kind's experiment."""
    check(s.heads, f"--head names no head kind: choose from {', '.join(HEAD_RECIPES)}")
    for kind in s.heads:
        check(kind in HEAD_RECIPES, f"--head: unknown head kind {kind!r}: choose from {', '.join(HEAD_RECIPES)}")
    check(len(set(s.heads)) == len(s.heads), f"--head names a kind twice: {','.join(s.heads)}")
    check(s.experiment is None or len(s.heads) == 1, f"--experiment replaces one head kind's experiment; --head "
                                                     f"{','.join(s.heads)} trains several: leave it out")


def check_data(s: Settings) -> None:
    """--data: sharegpt (the package installed), an existing file of a known format or folder, a
    dataset name, or text:FILE (an existing text file; its prompts have no answers to keep)."""
    from .data.conversations import check_data_file, sharegpt_path
    from .data.regenerate import TEXT_SOURCE

    if s.data.startswith(TEXT_SOURCE):
        text = Path(s.data.removeprefix(TEXT_SOURCE)).expanduser()
        check(text.is_file(), f"--data {s.data}: {text} does not exist or is not a file")
        check(not s.keep_answers, f"--keep-answers trains on the data's own answers; --data {s.data} makes prompts "
                                  "without answers: leave it out")
    elif s.data == "sharegpt":
        sharegpt_path()
    else:
        data = Path(s.data).expanduser()
        if data.is_file():
            check_data_file(data)
        else:
            check(data.is_dir() or not data.suffix, f"--data {s.data} does not exist")


def check_later_steps(s: Settings, out: Path) -> None:
    """The inputs of the steps after the cache, made as those steps make them and checked now: the
    training config of each --head kind composed (`train_config`, with --experiment and every
    --train-args override; the cache's held-out rows taken as --held-out), the eagle3 export
    layouts (with eagle3 among the kinds), the evaluation (its
    benchmarks' packages and --subset; the heads as names, before they are trained) and the peers'
    environment."""
    from train.bench.eval_job import check_job

    for kind in s.heads:
        train_config(s, out, s.held_out, kind)
    for job in export_jobs(s, out).values():
        job.check()
    check_job(eval_job(s, out), heads_exist=False)
    if s.peers:
        python = Path(s.peer_python or REPO / ".venv-interop" / "bin" / "python")
        check(python.exists(), f"--peers runs the peers' trainers with {python}, which does not exist: make "
                               "setup-interop, or give --peer-python")


# ---------------------------------------------------------------- the steps run in this process

@dataclass(frozen=True)
class DataChoice:
    """The data step's choice, made before --out is written (`choose_data`): the training and
    held-out conversations and data.json's record of them."""

    train: list
    held_out: list
    info: dict[str, Any]


def choose_data(s: Settings) -> DataChoice:
    """Conversations chosen for the recipe (or made from a text: --data text:FILE), nothing written:
    read, deduplicated, length-bounded (a message of more than seq_len * MAX_CHARS_PER_TOKEN
    characters cannot fit in a row: its conversation is dropped and counted out of the length
    bounds), held out by id and sampled. Data that leaves no training conversation (unknown roles,
    only system turns, every conversation out of bounds) is one SpecdecError line."""
    from .data.conversations import prepare_conversations, split_held_out
    from .data.regenerate import TEXT_SOURCE, text_conversations

    if s.data.startswith(TEXT_SOURCE):        # enough prompts for --conversations after the held-out draw below
        convs, counts = text_conversations(s.data.removeprefix(TEXT_SOURCE), s.conversations + 4 * s.held_out,
                                           s.seed)
    else:
        convs, _, counts = prepare_conversations(s.data, seed=str(s.seed), min_turns=2,
                                                 max_message_chars=MAX_CHARS_PER_TOKEN * s.seq_len)
    # held out by id hash (a conversation wholly on one side), about three times --held-out of them to draw from
    train, held = split_held_out(convs, min(0.5, max(0.01, 3 * s.held_out / max(len(convs), 1))), str(s.seed))
    counts.held_out = len(held)
    check(train, f"--data {s.data} left no training conversation ({counts.line()})")
    rng = random.Random(s.seed)
    train = rng.sample(train, min(len(train), s.conversations - min(s.held_out, len(held))))
    held = rng.sample(held, min(len(held), s.held_out))
    info = {"source": s.data, "counts": vars(counts), "line": counts.line(), "train": len(train),
            "held_out": len(held)}
    return DataChoice(train, held, info)


def step_data(out: Path, choice: DataChoice) -> dict[str, Any]:
    """Step 1: the chosen conversations written as data/train.jsonl and data/held_out.jsonl
    (messages JSONL), data/data.json the counts."""
    from .data.chat_answers import record

    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    for name, convs in (("train", choice.train), ("held_out", choice.held_out)):
        lines = "".join(json.dumps(record(c), ensure_ascii=False) + "\n" for c in convs)
        write_file(folder / f"{name}.jsonl", lambda f, lines=lines: f.write(lines.encode("utf-8")))
    write_file(folder / "data.json", lambda f: f.write(json.dumps(choice.info, indent=1).encode()))
    print(f"[data] {choice.info['line']}; the recipe takes {len(choice.train)} training and "
          f"{len(choice.held_out)} held-out conversations", flush=True)
    return choice.info


def _read(path: Path):
    from .data.chat_answers import from_record
    return [from_record(json.loads(line))[0] for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def _eta(done: int, total: int, seconds: float) -> str:
    left = seconds / max(done, 1) * (total - done)
    return f"{seconds / 60:.1f} min, about {left / 60:.1f} min left"


def step_answers(s: Settings, out: Path, model_dtype, rank: int = 0, world: int = 1, reference=None,
                 urls: Sequence[str] = ()) -> dict[str, Any]:
    """The target answers the held-out then the training conversations (answers/); as process
    `rank` of `world`, its batches of them (`chat_answers.answer_conversations`); with
    --answers-server, the servers at `urls` answer (`start_servers`; `reference`: the target
    loaded to check them, if loaded)."""
    from .data.chat_answers import AnswerOptions, answer_conversations, budget_text, load_answerer

    # the held-out conversations first: a time budget that runs out leaves fewer training rows, never no validation
    convs = _read(out / "data" / "held_out.jsonl") + _read(out / "data" / "train.jsonl")
    if s.answers_server:
        return _answers_from_servers(s, out, convs, model_dtype, reference, urls)
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


def server_reference(s: Settings, model_dtype, urls: Sequence[str]):
    """The target loaded here as the reference the --answers-server servers are checked against,
    and every server checked with it (reachable, OpenAI-compatible, a long enough context, the same
    tokenizer, the same weights or a quantized copy: `data.answer_server.connect`), one line on the
    first that fails. The recipe calls it before its first step, so a bad server writes nothing."""
    from .data.answer_server import check_reachable, connect, load_reference

    check_reachable(urls)
    reference = load_reference(s.target, device=s.device, dtype=model_dtype,
                               chat_template_kwargs=s.chat_template_kwargs)
    connect(list(urls), reference, s.seq_len, s.answers_in_flight)
    return reference


def start_servers(s: Settings, stack: contextlib.ExitStack) -> list[str]:
    """--answers-server's URLs, LOCAL replaced by a llama-server started on the GGUF target with
    --answers-in-flight parallel slots of seq_len + 1 positions (`data.llama_server`), killed when
    `stack` closes."""
    from .data.llama_server import LlamaServer

    urls = list(s.answers_server)
    if LOCAL in urls:
        print(f"[answers] starting llama.cpp's llama-server on {s.target} ({s.answers_in_flight} slots)", flush=True)
        server = stack.enter_context(LlamaServer(s.target, parallel=s.answers_in_flight, context=s.seq_len + 1,
                                                 seed=s.seed))
        urls[urls.index(LOCAL)] = server.url
    return urls


def _answers_from_servers(s: Settings, out: Path, convs: list, model_dtype, reference=None,
                          urls: Sequence[str] = ()) -> dict[str, Any]:
    """The answers step on --answers-server: every turn answered by the servers
    (`data.served_answers.answer_from_servers`, which checks them again against `reference`, the
    target loaded here), in the same answers folder format."""
    from .data.chat_answers import budget_text
    from .data.served_answers import ServedSettings, answer_from_servers

    check(urls and LOCAL not in urls, f"the answers step needs the servers' URLs (--answers-server {LOCAL} is "
                                      "started by the recipe's run)")
    if reference is None:
        from .data.answer_server import load_reference

        reference = load_reference(s.target, device=s.device, dtype=model_dtype,
                                   chat_template_kwargs=s.chat_template_kwargs)
    t0 = time.perf_counter()
    budget = f", budget {budget_text(s.answer_minutes)} min" if s.answer_minutes else ""

    def progress(done: int, total: int, tokens: int, where: str) -> None:
        seconds = time.perf_counter() - t0
        print(f"[answers] {done:,}/{total:,} conversations from {len(urls)} server(s), {tokens:,} tokens, "
              f"{tokens / max(seconds, 1e-9):,.0f} tokens/s, {seconds / 60:.1f} min{budget}", flush=True)

    settings = ServedSettings(seq_len=s.seq_len, max_new_tokens=s.max_new_tokens, temperatures=tuple(s.temperatures),
                              batch_size=s.answer_batch, seed=s.seed, chat_template_kwargs=s.chat_template_kwargs,
                              in_flight=s.answers_in_flight)
    meta = answer_from_servers(convs, out / "answers", urls, reference, settings,
                               data={"source": s.data, "seed": s.seed}, progress=progress,
                               report=lambda line: print(f"[answers] {line}", flush=True),
                               max_seconds=None if s.answer_minutes is None else 60 * s.answer_minutes)
    print(f"[answers] {meta['written']:,} conversations, {meta['answers']:,} answers, {meta['tokens']:,} tokens at "
          f"{meta['tokens_per_second']:,.0f} tokens/s from {len(urls)} server(s)", flush=True)
    return meta


def step_cache(s: Settings, out: Path, layers: list[int], model_dtype, rank: int = 0, world: int = 1
               ) -> dict[str, Any]:
    """The embeddings cache of the answered conversations (cache/), held-out ones last; as process
    `rank` of `world`, its shards of it."""
    from .data.chat_answers import read_answers
    from .data.chat_rows import ChatSource, build_chat_cache
    from .data.embeddings_cache import BuildRun, CacheSettings

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
    source = ChatSource(train, held, layers, {"answers": str((out / "answers").resolve())},
                        chat_template_kwargs=s.chat_template_kwargs)
    meta = build_chat_cache(s.target, source, out / "cache", CacheSettings(seq_len=s.seq_len, seed=s.seed,
                                                                          batch_size=s.cache_batch),
                            BuildRun(world == 1, progress, report, None, rank, world), s.device, model_dtype)
    if not meta.get("finalized", True):
        return meta
    rc = meta["row_counts"]
    print(f"[cache] {meta['windows']:,} rows ({meta['held_out_rows']} held out), {rc['tokens']:,} tokens of which "
          f"{rc['answer_tokens']:,} answer tokens ({rc['refused']} refused by the template, {rc['no_answer']} with no "
          f"answer left)", flush=True)
    return {"windows": meta["windows"], "held_out_rows": meta["held_out_rows"], **rc}


# ---------------------------------------------------------------- the steps after the cache: their inputs

def experiment(s: Settings, kind: str = "eagle3") -> str:
    """--experiment, else the kind's CPU experiment (smollm2_eagle3: its CPU sizes, any target) or its
    GPU one (hf_eagle3_gpu) with --device cuda (`HEAD_RECIPES`)."""
    row = HEAD_RECIPES[kind]
    return s.experiment or (row.gpu if s.device == "cuda" else row.cpu)


def train_overrides(s: Settings, out: Path, held_out_rows: int, kind: str = "eagle3") -> list[str]:
    """The Hydra overrides of the train step: the experiment on the recipe's cache (data=hf_embeddings,
    the cache's last `held_out_rows` rows validating), its draft vocabulary, --train-minutes (added
    where the experiment sets no max_time), the planned draft vocabulary size (`train.plan`), the
    precision faster on the device, decoding at the end only, OUT/<kind> as the output folder, then
    --train-args (which win): each applies to every kind, one written KIND:OVERRIDE
    (dflash:head.block_size=16) to that kind only (`kind_args`)."""
    from specdec_models.cpu import fast_precision

    return [f"experiment={experiment(s, kind)}", f"target.path={s.target}", "data=hf_embeddings",
            f"data.cache={out / 'cache'}", f"data.seq_len={s.seq_len}", f"data.val_windows={max(1, held_out_rows)}",
            f"head.draft_vocab={out / 'draft_vocab.json'}", f"++trainer.max_time={max_time(s.train_minutes)}",
            *([f"head.draft_vocab_size={s.draft_vocab_size or 'null'}"] if s.draft_vocab_size is not None else []),
            f"trainer.precision={fast_precision('gpu' if s.device == 'cuda' else 'cpu')}",
            "callbacks.speculative_eval.every=0", f"output_dir={out / kind}", "overwrite=true", *kind_args(s, kind)]


def kind_args(s: Settings, kind: str) -> list[str]:
    """--train-args of head kind `kind`: those without a kind prefix, and those written KIND:OVERRIDE
    with the prefix taken off (a prefix is a `HEAD_RECIPES` name before the first colon)."""
    picked = []
    for arg in s.train_args:
        prefix, sep, rest = arg.partition(":")
        if sep and prefix in HEAD_RECIPES:
            if prefix == kind:
                picked.append(rest)
        else:
            picked.append(arg)
    return picked


def train_config(s: Settings, out: Path, held_out_rows: int, kind: str = "eagle3"):
    """The train step's config for head kind `kind`, composed (`train.run.compose`) and checked as
    far as it can be before the cache exists: the run-level keys (`train.run.validate_run`), the
    kind's task, its `task:` and `head:` nodes. One line on any error, a Hydra one included."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from specdec_models.files import one_line

    from .run import compose, validate_run
    from .tasks.base import from_dict, to_plain

    row = HEAD_RECIPES[kind]
    try:
        task = compose([f"experiment={experiment(s, kind)}"]).task.name      # the experiment's own task first
        what = "an EAGLE-3 head" if kind == "eagle3" else f"a {kind} head"
        check(task == row.task, f"--experiment {experiment(s, kind)} trains task={task}; the recipe trains {what}: "
                                f"choose an experiment whose task is {row.task}")
        cfg = compose(train_overrides(s, out, held_out_rows, kind))
    except (HydraException, OmegaConfBaseException) as error:
        raise SpecdecError(f"the training config does not compose (--experiment, --train-args): "
                           f"{one_line(error)}") from None
    validate_run(cfg).typed_config(cfg)
    from_dict(row.sizes_type(), to_plain(cfg.get("head")), "head")
    return cfg


def drafting(s: Settings, out: Path):
    """The tokens per step the export writes (`train.eagle3_export.Drafting`): --speculative-tokens,
    else the gamma of the chain the evaluate step drafts (a server such as vLLM drafts a chain)."""
    from train.bench.eval_job import CHAIN

    from .eagle3_export import Drafting

    gamma = eval_job(s, out).gamma
    return Drafting.of(s.speculative_tokens, gamma=CHAIN if gamma is None else gamma)


def export_jobs(s: Settings, out: Path) -> list:
    """The export step, {name: ExportJob} in --head's order: the eagle3 head in the speculators and
    SGLang layouts (OUT/export_speculators, OUT/export_sglang: names "speculators" and "sglang",
    drafting `drafting`), each block head in speculators' layout (OUT/<kind>/export_speculators:
    name "<kind>:speculators", drafting its whole block); SGLang has no layout specdec writes for
    those (`train.eagle3_export.NO_LAYOUT`)."""
    from .eagle3_export import ExportJob

    jobs = {}
    for kind in s.heads:
        head = str(out / kind / "export")
        if kind == "eagle3":
            plan = drafting(s, out)
            jobs |= {layout: ExportJob(head, str(out / f"export_{layout}"), layout, s.target, force=True,
                                       drafting=plan) for layout in ("speculators", "sglang")}
        else:
            jobs[f"{kind}:speculators"] = ExportJob(head, str(out / kind / "export_speculators"), "speculators",
                                                    s.target, force=True)
    return jobs


def eval_job(s: Settings, out: Path):
    """The evaluate step: each kind's head side by side (named by `HEAD_RECIPES`' column, from
    OUT/<kind>/export) and the peers' heads, as chains and as a --tree, prompt lookup and plain
    decoding, at T=0 and T=1, into OUT/report/evaluation."""
    from train.bench.eval_job import EvalJob

    heads = [f"{HEAD_RECIPES[kind].column}={out / kind / 'export'}" for kind in s.heads]
    if s.peers:
        heads += [f"speculators={out / 'peers' / 'speculators' / 'head'}",
                  f"specforge={out / 'peers' / 'specforge' / 'head'}"]
    return EvalJob(target=s.target, heads=tuple(heads), tree=s.tree, lookup="4..16", benchmarks=",".join(s.benchmarks),
                   subset=s.subset, speed_subset=s.speed_subset, temperatures="0,1",
                   max_new_tokens=s.eval_max_new_tokens, dtype="auto",
                   device=s.device, chat_template_kwargs=json.dumps(s.chat_template_kwargs) if s.chat_template_kwargs
                   else None, out=str(out / "report" / "evaluation"), force=True)


def draft_vocab_job(out: Path, held_out_rows: int, vocab_size: int):
    """The draft_vocab step: counts on the cache's training rows, coverage on its held-out ones."""
    from .draft_vocab import DRAFT_VOCAB_SIZES, DraftVocabJob

    sizes = tuple(n for n in DRAFT_VOCAB_SIZES if n < vocab_size) or (max(1, vocab_size // 2),)
    return DraftVocabJob(cache=str(out / "cache"), out=str(out / "draft_vocab.json"), sizes=sizes,
                         val_windows=max(1, held_out_rows), report=str(out / "draft_vocab_report.json"), force=True)


def peers_command(s: Settings, out: Path, held_out_rows: int, rows: int) -> list[str]:
    """The peers step, a process of its own (their trainers run in another Python environment):
    trained on the cache's training rows, for the same minutes."""
    return [sys.executable, "-m", "train.commands.train_peers", "--cache", str(out / "cache"), "--draft-vocab",
            str(out / "draft_vocab.json"), "--target", s.target, "--out", str(out / "peers"), "--minutes",
            str(s.train_minutes), "--threads", "2", "--rows", str(max(1, rows - held_out_rows)), "--force",
            *(["--python", s.peer_python] if s.peer_python else [])]


# ---------------------------------------------------------------- the steps after the cache, typed

@dataclass(frozen=True)
class TrainResult:
    """What the train step made of one head kind (`train.run.run`'s return): the run's folder, its
    export, its steps and final logged metrics."""

    output_dir: str
    export_dir: str | None
    global_step: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class ExportResult:
    """The export step's folders, {name: path} (`export_jobs`' names), and the tokens a server drafts
    per step written into the first one's speculators layout (the eagle3 head's, when it is among
    the kinds), with where that number comes from."""

    layouts: dict[str, str]
    speculative_tokens: int
    speculative_tokens_from: str


@dataclass(frozen=True)
class EvaluateResult:
    """The evaluate step's report files (evaluation.json, .md, .png)."""

    files: list[str]


def step_draft_vocab(out: Path, held_out_rows: int, vocab_size: int):
    """Step 4: `train.draft_vocab.draft_vocab` on the cache; prints its coverage table."""
    from .draft_vocab import draft_vocab

    result = draft_vocab(draft_vocab_job(out, held_out_rows, vocab_size))
    print(f"[draft_vocab] {result.counted:,} greedy tokens counted on {result.train_rows} rows\n{result.table()}",
          flush=True)
    return result


def step_train(s: Settings, out: Path, held_out_rows: int, done: dict[str, Any] | None = None) -> dict[str, Any]:
    """Step 5: each --head kind's training config composed with the cache's held-out rows and run
    here, in turn, each recording its result in OUT/<kind>/TRAIN_RESULT; a kind a killed run finished
    (its export and its result there, or in `done`: an earlier run's record of the step) is not
    trained again. Returns {kind: TrainResult as a dict}."""
    from .run import run

    os.environ.setdefault("WANDB_MODE", "offline")     # a W&B logger asked for in --train-args logs offline
    results = dict(done or {})
    for kind in s.heads:
        record = out / kind / TRAIN_RESULT
        if kind not in results and record.is_file():
            results[kind] = json.loads(record.read_text())
        if kind in results and (out / kind / "export" / "config.json").is_file():
            print(f"[train] {kind} done before", flush=True)
            continue
        print(f"[train] {kind}: experiment={experiment(s, kind)} into {out / kind}", flush=True)
        result = run(train_config(s, out, held_out_rows, kind))
        export = result["export_dir"]
        results[kind] = asdict(TrainResult(str(result["output_dir"]), None if export is None else str(export),
                                           int(result["global_step"]), dict(result["metrics"])))
        blob = json.dumps(results[kind], indent=1, default=str)
        write_file(record, lambda f, blob=blob: f.write(blob.encode()))
    return {kind: results[kind] for kind in s.heads}


def step_peers(s: Settings, out: Path, held_out_rows: int, rows: int) -> None:
    """Step 6: the peers' trainers, through specdec peers in a process of its own."""
    cmd = peers_command(s, out, held_out_rows, rows)
    print(f"[peers] {' '.join(cmd)}", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    code = subprocess.run(cmd, check=False, cwd=REPO, env=env).returncode
    if code:
        raise SystemExit(f"[peers] failed (exit {code}): fix it and run the recipe again to resume here")


def step_export(s: Settings, out: Path) -> ExportResult:
    """Step 7: `train.eagle3_export.export_head` for each of `export_jobs`; prints each one's
    folder and the tokens per step written."""
    from .eagle3_export import export_head

    done = {name: export_head(job) for name, job in export_jobs(s, out).items()}
    for name, result in done.items():
        print(f"[export] {name}: {result.path}; {result.drafting.describe(name.rpartition(':')[2])}", flush=True)
    first = next(iter(done.values())).drafting
    return ExportResult({name: str(result.path) for name, result in done.items()}, first.tokens, first.source)


def step_evaluate(s: Settings, out: Path) -> EvaluateResult:
    """Step 8: `train.bench.eval_job.run_evaluation` of `eval_job`."""
    from train.bench.eval_job import run_evaluation

    files = run_evaluation(eval_job(s, out), f"specdec eagle3 --out {out} (its evaluate step)")
    return EvaluateResult([str(f) for f in files])


def markers(out: Path, heads: Sequence[str] = ("eagle3",)) -> dict[str, Path]:
    """The file each step leaves when it is done (the train step: the last kind's export)."""
    return {"data": out / "data" / "data.json", "answers": out / "answers" / "answers.json",
            "cache": out / "cache" / "cache.json", "draft_vocab": out / "draft_vocab.json",
            "train": out / heads[-1] / "export" / "config.json", "peers": out / "peers" / "peers.json",
            "export": (out / "export_sglang" if heads[-1] == "eagle3" else out / heads[-1] / "export_speculators")
            / "config.json",
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
    export = facts.get("export") or {}
    if export.get("speculative_tokens"):
        lines.append(f"export: speculative_tokens {export['speculative_tokens']} "
                     f"({export.get('speculative_tokens_from')}): vLLM's num_speculative_tokens")
    text = "\n".join(lines) + "\n"
    write_file(report / "steps.md", lambda f: f.write(text.encode()))
    blob = json.dumps({"steps_seconds": done, **facts}, indent=1, default=str)
    write_file(report / "recipe.json", lambda f: f.write(blob.encode()))


class _Steps:
    """The recipe's record in OUT/steps.json: each finished step's seconds and result. `step(name,
    work)` skips a step done before (its marker file there) or after --until, else runs it and
    records it."""

    def __init__(self, s: Settings, out: Path) -> None:
        self.s, self.file, self.marks = s, out / "steps.json", markers(out, s.heads)
        state = json.loads(self.file.read_text()) if self.file.is_file() else {}
        self.done: dict[str, float] = state.get("done", {})
        self.facts: dict[str, Any] = state.get("facts", {})

    def wanted(self, name: str) -> bool:
        return STEPS.index(name) <= STEPS.index(self.s.until)

    def finished(self, name: str) -> bool:
        """Whether a run before this one finished step `name` (recorded, and its marker there)."""
        return name in self.done and self.marks[name].exists()

    def step(self, name: str, work, seconds_before: float = 0.0) -> None:
        """Run `work` for step `name` unless skipped; its time recorded, plus `seconds_before` (what
        the step did before --out existed: the data step's choice)."""
        if not self.wanted(name):
            return
        if self.finished(name):
            print(f"[{name}] done before ({self.done[name] / 60:.1f} min)", flush=True)
            return
        t0 = time.perf_counter()
        result = work()
        self.done[name] = time.perf_counter() - t0 + seconds_before
        if result is not None:
            self.facts[name] = asdict(result) if is_dataclass(result) else result
        blob = json.dumps({"done": self.done, "facts": self.facts}, indent=1, default=str)
        write_file(self.file, lambda f: f.write(blob.encode()))
        print(f"[{name}] {self.done[name] / 60:.1f} min", flush=True)


def run_recipe(s: Settings, force: bool = False) -> int:
    """Run (or resume) the recipe into s.out. Every input is checked first (`check_inputs`, a
    one-line SpecdecError, nothing written), and so is the data: the data step chooses its
    conversations (`choose_data`) before --out is created, so data that leaves nothing to train on
    is refused with nothing written either."""
    from specdec_models.cpu import resolve_dtype
    from specdec_models.files import check_output

    out = s.out.expanduser().resolve()
    target = check_inputs(s, out)
    check_output(out, "--out", kind=RECIPE_KIND, force=force, inputs=[s.target, s.data.removeprefix("text:")])
    steps = _Steps(s, out)
    model_dtype = resolve_dtype("auto", s.device)
    with contextlib.ExitStack() as servers:             # a llama-server started here lives for the answers step
        reference, urls = None, []
        if s.answers_server and steps.wanted("answers") and not steps.finished("answers"):
            urls = start_servers(s, servers)
            reference = server_reference(s, model_dtype, urls)
        _data_and_answers(s, out, steps, target, model_dtype, reference, urls)
    steps.step("cache", lambda: in_processes("cache", s, out) if s.processes > 1
               else step_cache(s, out, target.layers, model_dtype))
    cache = steps.facts.get("cache", {})
    held, rows = int(cache.get("held_out_rows", s.held_out)), int(cache.get("windows", 0))
    steps.step("draft_vocab", lambda: step_draft_vocab(out, held, target.vocab_size))
    steps.step("train", lambda: step_train(s, out, held, _trained(steps.facts.get("train"))))
    if s.peers:
        steps.step("peers", lambda: step_peers(s, out, held, rows))
    if "eagle3" in s.heads:
        steps.step("export", lambda: step_export(s, out))
    steps.step("evaluate", lambda: step_evaluate(s, out))
    if steps.wanted("report"):
        write_report(out, steps.done, steps.facts)
        print((out / "report" / "steps.md").read_text(), flush=True)
        print(f"report: {out / 'report'}", flush=True)
    return 0


def _trained(fact: Any) -> dict[str, Any]:
    """The train step's record of the kinds it finished: {kind: result}; a run before several kinds
    recorded eagle3's result alone."""
    if not isinstance(fact, dict):
        return {}
    return {"eagle3": fact} if "output_dir" in fact else fact


def _data_and_answers(s: Settings, out: Path, steps: _Steps, target, model_dtype, reference, urls: list[str]) -> None:
    """The data step (its conversations chosen before --out is created), --out's settings, the
    answers step."""
    from specdec_models.files import mark_dir

    t0 = time.perf_counter()
    data = choose_data(s) if steps.wanted("data") and not steps.finished("data") else None
    chose = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    mark_dir(out, RECIPE_KIND)
    blob = json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in vars(s).items()}, indent=1)
    write_file(out / SETTINGS_FILE, lambda f: f.write(blob.encode()))
    print(f"[recipe] {out}: target {target.path} ({target.depth} layers; cached hidden states "
          f"{target.layers}), data {s.data}, device {s.device} ({model_dtype})", flush=True)
    steps.step("data", lambda: step_data(out, data), seconds_before=chose)
    steps.step("answers", lambda: in_processes("answers", s, out) if s.processes > 1
               else step_answers(s, out, model_dtype, reference=reference, urls=urls))


# ---------------------------------------------------------------- one step as one of several processes

def read_settings(out: Path) -> Settings:
    """The Settings a recipe run recorded in OUT/settings.json."""
    path = out / SETTINGS_FILE
    check(path.is_file(), f"{out} holds no recipe settings ({SETTINGS_FILE}): start the recipe with specdec eagle3")
    raw = json.loads(path.read_text())
    raw["out"] = Path(raw["out"])
    for name in ("temperatures", "train_args", "benchmarks", "answers_server", "heads"):
        if name in raw:
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


@cli_main
def main(argv: list[str] | None = None) -> int:
    """`python -m train.eagle3_recipe answers|cache OUT`: one process's share of a step of the recipe
    in OUT (its settings.json), rank and world from RANK and WORLD_SIZE (torchrun sets them; every
    process must see OUT: one machine, or a filesystem the nodes share)."""

    from specdec_models.cpu import resolve_dtype

    p = Parser(description=main.__doc__.splitlines()[0])
    p.add_argument("step", choices=("answers", "cache"))
    p.add_argument("out")
    a = p.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    s = read_settings(Path(a.out))
    if s.device == "cuda":                       # one GPU per process (torchrun's LOCAL_RANK)
        s = replace(s, device=f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    out = Path(a.out).expanduser().resolve()
    dtype = resolve_dtype("auto", s.device)
    if a.step == "answers":
        step_answers(s, out, dtype, rank, world)
    else:
        step_cache(s, out, check_inputs(s).layers, dtype, rank, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
