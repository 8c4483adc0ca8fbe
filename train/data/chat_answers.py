"""The target answers conversations, turn by turn: the training text of a head for that target.

A head drafts well when it has learnt the target's own distribution, so SpecForge and vLLM's
speculators have the target rewrite every assistant turn of a chat dataset. `answer_conversations`
does that with a Hugging Face target: each assistant turn is answered through the chat template
from a context that holds the system prompt, the user turns and the target's *own* earlier answers
(`conversations.answer_prompts`), so turn 2 follows what the target said in turn 1, as it will when
it serves. An answer stops at the template's end-of-turn token (`regenerate.stop_token`), after
`max_new_tokens`, or when the row would pass seq_len + 1 tokens; a conversation ends at the first
answer that did not reach its end of turn (the row would be cut there anyway), recorded as
`truncated` so that rendering leaves out the end-of-turn token the target never wrote.
`keep_answers=True` writes the data's own answers and runs no model (EAGLE-1's way).

Two paths answer (`AnswerOptions.engine`), each conversation at its temperature
(temperatures[i mod len] for conversation i, greedy at 0), through one `Dialogue` per conversation:
- "batched" (the default, `answer_engine.AnswerEngine`): continuous batching over the answerer's
  `chunk` rows, a conversation's next turn taking its row as soon as an answer ends, and its KV
  cache kept from turn to turn (only the part of the next context not cached yet is prefilled);
  T > 0 draws from a generator of the conversation's own, seeded by (seed, its index);
- "simple" (`answer_batch`): turn k of every conversation of a batch of `batch_size` together,
  their contexts sorted by length and continued `chunk` at a time
  (`regenerate.continue_with_states`, each context prefilled whole, a finished row leaving the call
  at once), seeded by (seed, batch, turn).
Both give the same greedy answers (in fp32, up to the rounding of a near-tie). The output is a
function of the settings, so a killed run resumes to the same answers.

On disk, OUT/ (a folder marked as specdec "answers"):

    OUT/conversations.jsonl   one {"id", "source", "messages": [{role, content}], "truncated",
                              "answered"} per conversation, the answers the target's (`read_answers`
                              and any `messages` JSONL reader take it)
    OUT/answers.json          the settings, the target's identity, counts, tokens and seconds

A run writes into OUT.partial/: build.json first, then one `part-NNNNN.jsonl` per batch (atomic),
and the folder is renamed to OUT when all are done (`partial`: the protocol the cache shares); the
same command resumes a killed run from its finished parts. The batched engine writes a part as soon
as all its conversations are over; `max_seconds` stops it before its next model call: the
conversations finished by then, and those in work up to their last finished answer, are the output
(the simple path stops between batches).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec_models.errors import SpecdecError, check
from specdec_models.files import mark_dir, write_file

from .conversations import AnswerPrompt, Conversation, Turn, answer_prompts, check_chat_template, context_ids
from .partial import BUILD_FILE, finalize, open_partial

ANSWERS_KIND = "answers"
ANSWERS_FILE = "conversations.jsonl"
META_FILE = "answers.json"
FORMAT = "specdec-answers"
MIN_ROOM = 16  # an answer needs at least this many positions left in the row to be worth asking for


def part_name(k: int) -> str:
    return f"part-{k:05d}.jsonl"


def record(conversation: Conversation, truncated: bool = False, answered: int = 0) -> dict[str, Any]:
    """A conversation as one line of conversations.jsonl."""
    return {"id": conversation.id, "source": conversation.source,
            "messages": [{"role": t.role, "content": t.content} for t in conversation.turns],
            "truncated": truncated, "answered": answered}


def from_record(line: Mapping[str, Any]) -> tuple[Conversation, bool]:
    """(conversation, truncated) of one line of conversations.jsonl."""
    turns = tuple(Turn(m["role"], m["content"]) for m in line["messages"])
    return Conversation(str(line["id"]), turns, str(line.get("source", ""))), bool(line.get("truncated", False))


def read_answers(out: str | os.PathLike) -> tuple[list[tuple[Conversation, bool]], dict[str, Any]]:
    """The conversations (with their `truncated` flag) of an answers folder, and its answers.json."""
    out = Path(out).expanduser()
    meta_path = out / META_FILE
    check(meta_path.is_file(), f"{out} holds no answers ({META_FILE} is missing): write it with specdec eagle3 "
                               f"(step answers) or train.data.chat_answers.answer_conversations")
    meta = json.loads(meta_path.read_text())
    check(meta.get("format") == FORMAT, f"{meta_path} is not a specdec answers file")
    with open(out / ANSWERS_FILE, encoding="utf-8") as f:
        rows = [from_record(json.loads(line)) for line in f if line.strip()]
    return rows, meta


def length_groups(lengths: Sequence[int], most: int, slack: float = 1.25) -> list[list[int]]:
    """Indices of `lengths` sorted by length and cut into groups of at most `most`, a new group
    starting where a length passes `slack` times its group's shortest (plus 8): a right-padded
    prefill then spends at most about a quarter of its work on padding."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if not groups or len(groups[-1]) >= most or lengths[i] > slack * lengths[groups[-1][0]] + 8:
            groups.append([])
        groups[-1].append(i)
    return groups


class Answerer:
    """Answers a batch of contexts with the target: `__call__(prompts, temperature, generator)` ->
    [(answer token ids without the stop token, whether it reached the stop token)].

    The contexts are continued in groups of similar length (`length_groups`, at most `chunk` a
    call): the prefill is right-padded to the longest context of its call, and ShareGPT's first turns
    run from a few tokens to hundreds. SmolLM2 in bf16 on 2 cores, 128 first turns of 60 tokens on
    average and up to 300, 64 new tokens each: 100 tokens/s in one call, 131 in sorted calls of
    64, 160 in sorted calls of 32; one call's decoding steps alone make 315."""

    def __init__(self, decoder: Any, tokenizer: Any, eos_id: int | None, seq_len: int, max_new_tokens: int,
                 chunk: int = 64) -> None:
        self.decoder, self.tokenizer, self.eos_id = decoder, tokenizer, eos_id
        self.seq_len, self.max_new_tokens, self.chunk = seq_len, max_new_tokens, chunk

    def __call__(self, prompts: list[torch.Tensor], temperatures: Sequence[float], generator: torch.Generator,
                 each: Callable[[int], Any] | None = None) -> list[tuple[list[int], bool]]:
        """`each(new tokens)` hears every generating call (a group of similar lengths)."""
        from .regenerate import continue_with_states

        out: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
        for mine in length_groups([p.numel() for p in prompts], self.chunk):
            tokens, valid, _ = continue_with_states(self.decoder, [prompts[i] for i in mine], self.seq_len + 1, [],
                                                    [float(temperatures[i]) for i in mine], generator, self.eos_id,
                                                    max_new=self.max_new_tokens)
            for i, row, n in zip(mine, tokens.tolist(), valid.tolist(), strict=True):
                answer = row[prompts[i].numel():n]
                ended = bool(answer) and self.eos_id is not None and answer[-1] == self.eos_id
                out[i] = (answer[:-1] if ended else answer, ended)
            if each is not None:
                each(int((valid - torch.tensor([prompts[i].numel() for i in mine], device=valid.device)).sum()))
        return out


class Dialogue:
    """One conversation answered turn by turn through its plan (`conversations.answer_prompts`),
    what both answering paths share. `ids`: the token ids of the context of the turn to answer
    (`context_ids`), None once the conversation is over: then `record` is its line of
    conversations.jsonl, or `too_long` says its first context left no room for an answer (it is
    dropped). A context with fewer than MIN_ROOM positions left in the row ends the conversation
    before that turn. `answered(answer, ended)` takes the target's answer (token ids without the
    stop token, whether it reached the stop token) and returns the next context's ids, or None; a
    cut answer (not `ended`) ends the conversation, `truncated`."""

    def __init__(self, conversation: Conversation, tokenizer: Any, seq_len: int,
                 chat_template_kwargs: Mapping | None = None) -> None:
        self.conversation, self.tokenizer, self.seq_len = conversation, tokenizer, seq_len
        self.kwargs = dict(chat_template_kwargs or {})
        self.plan = answer_prompts(conversation)
        self.prompt: AnswerPrompt = next(self.plan)
        self.answers = self.tokens = 0
        self.record: dict[str, Any] | None = None
        self.too_long = False
        self.ids = self._open()

    def _open(self) -> list[int] | None:
        ids = context_ids(self.tokenizer, self.prompt.context, self.kwargs)
        if self.seq_len + 1 - len(ids) >= MIN_ROOM:
            return ids
        self.close()                                          # no room: the conversation ends before this turn
        self.too_long = not self.answers
        return None

    def close(self) -> None:
        """End the conversation before the turn in work (no room for it, or a time budget ran
        out): its record holds the turns up to its last answer, none without an answer."""
        c, context = self.conversation, self.prompt.context
        context = context[:max((j for j, t in enumerate(context) if t.role == "assistant"), default=-1) + 1]
        if self.answers and self.record is None:
            self.record = record(Conversation(c.id, context, c.source), False, self.answers)
        self.ids = None

    def answered(self, answer: Sequence[int], ended: bool) -> list[int] | None:
        self.tokens += len(answer) + int(ended)
        self.answers += 1
        text = self.tokenizer.decode(list(answer), skip_special_tokens=True)
        c = self.conversation
        self.ids = None
        if not ended:                      # cut short: the conversation ends with this answer
            self.record = record(Conversation(c.id, (*self.prompt.context, Turn("assistant", text)), c.source), True,
                                 self.answers)
            return None
        try:
            self.prompt = self.plan.send(text)
        except StopIteration as stop:
            self.record = record(stop.value, False, self.answers)
            return None
        self.ids = self._open()
        return self.ids


def dialogue_counts(dialogues: Sequence[Dialogue]) -> dict[str, int]:
    """{"tokens": generated (stop tokens included), "answers", "too_long"} of finished dialogues."""
    return {"tokens": sum(d.tokens for d in dialogues), "answers": sum(d.answers for d in dialogues),
            "too_long": sum(d.too_long for d in dialogues)}


def answer_batch(conversations: Sequence[Conversation], answerer: Answerer, *, temperatures: Sequence[float],
                 first: int, seed: int, chat_template_kwargs: Mapping | None = None,
                 answered: Callable[[int, int], Any] | None = None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Answer every assistant turn of `conversations` (global indices first, first + 1, ...), turn k
    of all of them together. Returns their records and counts {"tokens": generated, "answers",
    "too_long": conversations whose first context left no room for an answer (dropped)}.
    `answered(turn, tokens)` hears each generating call's new tokens (the answerer's `each`)."""
    dialogues = [Dialogue(c, answerer.tokenizer, answerer.seq_len, chat_template_kwargs) for c in conversations]
    pending = {i: d for i, d in enumerate(dialogues) if d.ids is not None}
    turn = 0
    while pending:                                 # every pending context in one call, each at its own temperature
        mine = list(pending)
        g = torch.Generator(device=answerer.decoder.device).manual_seed(seed * 1_000_003 + first * 17 + turn * 7919)
        results = answerer([torch.tensor(pending[i].ids, dtype=torch.long) for i in mine],
                           [temperatures[(first + i) % len(temperatures)] for i in mine], g,
                           each=None if answered is None else (lambda tokens, turn=turn: answered(turn, tokens)))
        for i, (answer, ended) in zip(mine, results, strict=True):
            if pending[i].answered(answer, ended) is None:
                del pending[i]
        turn += 1
    return [d.record for d in dialogues if d.record is not None], dialogue_counts(dialogues)


ENGINES = ("batched", "simple")  # answer_engine.AnswerEngine; Answerer and answer_batch (turn k of a batch together)
PROGRESS_SECONDS = 15.0  # the batched engine reports progress at most this often between finished parts


@dataclass(frozen=True)
class AnswerOptions:
    """How `answer_conversations` answers. `temperatures`: conversation i's is temperatures[i mod
    len] (greedy at 0); `batch_size`: conversations per part of OUT.partial/ (what a killed run
    keeps, and the first path's batch); `chat_template_kwargs` go to the chat template;
    `keep_answers`: the data's answers, no model run; `max_seconds`: the time budget (None: none),
    from the call's start, checked before every model call by the batched engine (between batches
    by the simple one); as process `rank` of `world` (module docstring); `engine`: "batched"
    (`answer_engine`: continuous batching, the KV cache kept from turn to turn, the answerer's
    `chunk` rows decoded together) or "simple" (`Answerer`: turn k of a batch together)."""
    temperatures: tuple[float, ...] = (0.0,)
    batch_size: int = 64
    seed: int = 0
    chat_template_kwargs: Mapping | None = None
    keep_answers: bool = False
    max_seconds: float | None = None
    rank: int = 0
    world: int = 1
    engine: str = "batched"

    def check(self, conversations: int, answerer: Answerer | None) -> int:
        """One line unless these options can answer `conversations` conversations; their batches."""
        check(self.keep_answers or answerer is not None, "answering needs the target (or keep_answers=True)")
        check(conversations > 0, "no conversations to answer")
        check(self.batch_size >= 1, f"the batch size must be >= 1, got {self.batch_size}")
        check(self.max_seconds is None or self.max_seconds > 0,
              f"the time budget must be > 0 seconds, got {self.max_seconds!r}")
        check(self.world >= 1 and 0 <= self.rank < self.world,
              f"rank {self.rank} of {self.world} processes is not a rank")
        check(self.engine in ENGINES, f"the answering engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        batches = -(-conversations // self.batch_size)
        check(self.world <= batches, f"{self.world} processes for {conversations} conversations in {batches} batch(es) "
                                     f"of {self.batch_size}: some would have nothing to answer; use at most {batches} "
                                     "processes")
        check(self.max_seconds is None or self.world == 1, "a time budget stops one process; with several, give none "
                                                           "(the conversations they answer must be every batch)")
        return batches


def budget_text(minutes: float) -> str:
    """A time budget in minutes as a progress line prints it: 30, 0.5, 22.25."""
    return f"{minutes:.2f}".rstrip("0").rstrip(".")


def answer_conversations(conversations: Sequence[Conversation], out: str | os.PathLike, *,
                         answerer: Answerer | None, identity: Mapping[str, Any], data: Mapping[str, Any],
                         options: AnswerOptions = AnswerOptions(),
                         progress: Callable[[int, int, int, str], Any] | None = None,
                         report: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Write OUT (module docstring): `conversations` answered by `answerer` (None with
    `options.keep_answers`: the data's answers). `identity`: the target's (recorded, and compared on
    resume); `data`: how the conversations were chosen (recorded). `progress(conversations done, of,
    tokens generated so far, where: "" after a part is written, else what is in work)` follows the
    work; `report(line)` hears a resume and a time budget that ran out. Returns answers.json's contents.

    As one of `options.world` processes (`options.rank`), it answers batches rank, rank + world, ...
    into the same OUT.partial/ (on a filesystem they share); whichever process finds every batch's
    part written when it ends joins them into OUT (a lock file keeps it to one), and the others
    return {"finalized": False}. Each conversation's answers are a function of the settings (up to
    the rounding of a near-tie, which the rows sharing a call may change), so a killed rank's
    batches are answered by the next run of any process set."""
    t0 = time.perf_counter()
    out, o = Path(out).expanduser(), options
    say = report or (lambda line: None)
    batches = o.check(len(conversations), answerer)
    if answerer is not None:
        check_chat_template(answerer.tokenizer, dict(o.chat_template_kwargs or {}))
    settings = _settings(conversations, answerer, identity, data, o)
    partial = out.with_name(f"{out.name}.partial")
    _open_partial(partial, settings, o.rank)
    mine = [k for k in range(batches) if k % o.world == o.rank]
    todo = [k for k in mine if not (partial / part_name(k)).is_file()]
    if len(todo) < len(mine):
        say(f"resuming {partial}: {len(mine) - len(todo)} of {len(mine)} batch(es)"
            f"{f' of rank {o.rank}' if o.world > 1 else ''} already answered")
    tokens = sum(part_stats(partial, k).get("tokens", 0) for k in range(batches))
    parts = _Parts(partial, conversations, o, progress, tokens)
    if o.keep_answers:
        for k in todo:
            parts.write(k, [record(c) for c in parts.batch(k)], {"tokens": 0, "answers": 0, "too_long": 0})
    elif o.engine == "simple":
        _answer_simple(parts, todo, answerer, t0, say)
    else:
        _answer_batched(parts, todo, answerer, t0, say)
    present = [k for k in range(batches) if (partial / part_name(k)).is_file()]
    if o.world > 1 and len(present) < batches:
        say(f"rank {o.rank} answered its batches; {batches - len(present)} of other ranks are not written yet: the "
            f"last rank to finish writes {out}")
        return {"finalized": False, "rank": o.rank, "batches": len(mine)}
    check(present, "the time budget ran out before one conversation was answered")
    return _finalize(partial, out, settings, present, o.rank, t0)


def _settings(conversations: Sequence[Conversation], answerer: Answerer | None, identity: Mapping[str, Any],
              data: Mapping[str, Any], o: AnswerOptions) -> dict[str, Any]:
    """build.json and answers.json's settings: a partial run resumes only under the same ones."""
    return {"format": FORMAT, "target": dict(identity), "data": dict(data), "conversations": len(conversations),
            "ids_sha": _ids_digest(conversations), "temperatures": [float(t) for t in o.temperatures],
            "batch_size": o.batch_size, "seed": o.seed, "chat_template_kwargs": dict(o.chat_template_kwargs or {}),
            "keep_answers": o.keep_answers,
            "seq_len": None if answerer is None else answerer.seq_len,
            "max_new_tokens": None if answerer is None else answerer.max_new_tokens,
            "chunk": None if answerer is None else answerer.chunk,
            "engine": None if o.keep_answers else o.engine}


class _Parts:
    """The parts this process writes into OUT.partial/ (part k: batch k's lines, then its stats
    beside it: `seconds` is the time since the previous part was written), and the progress
    reports between them."""

    def __init__(self, partial: Path, conversations: Sequence[Conversation], options: AnswerOptions,
                 progress: Callable[[int, int, int, str], Any] | None, tokens: int) -> None:
        self.partial, self.conversations, self.options, self.progress = partial, conversations, options, progress
        self.tokens, self.last = tokens, time.perf_counter()
        self.batches = -(-len(conversations) // options.batch_size)

    def batch(self, k: int) -> Sequence[Conversation]:
        return self.conversations[k * self.options.batch_size:(k + 1) * self.options.batch_size]

    def heard(self, done: int, tokens: int, where: str) -> None:
        if self.progress is not None:
            self.progress(done, len(self.conversations), tokens, where)

    def write(self, k: int, records: list[dict[str, Any]], counts: dict[str, int], done: int | None = None) -> None:
        now = time.perf_counter()
        stats = {**counts, "seconds": now - self.last, "rank": self.options.rank}
        self.last = now
        self.tokens += counts["tokens"]
        write_part(self.partial, k, records, stats)
        self.heard(min((k + 1) * self.options.batch_size, len(self.conversations)) if done is None else done,
                   self.tokens, "")


def _answer_simple(parts: _Parts, todo: list[int], answerer: Answerer, t0: float, say: Callable[[str], Any]) -> None:
    """The first path: batch by batch, turn k of a batch together (`answer_batch`); the time budget
    is checked between batches (a batch that would pass it is not begun)."""
    o, size = parts.options, parts.options.batch_size
    last_seconds = 0.0
    for k in todo:
        began = time.perf_counter()
        if o.max_seconds is not None and began - t0 + last_seconds > o.max_seconds and k > 0:
            say(f"the time budget ({budget_text(o.max_seconds / 60)} min) ran out after {k} of {parts.batches} batches")
            break
        running = [parts.tokens]

        def answered(turn: int, tokens: int, k: int = k, running: list[int] = running) -> None:
            running[0] += tokens
            parts.heard(k * size, running[0], f"batch {k + 1}/{parts.batches}, turn {turn + 1}")

        with torch.inference_mode():
            records, counts = answer_batch(parts.batch(k), answerer, temperatures=o.temperatures, first=k * size,
                                           seed=o.seed, chat_template_kwargs=o.chat_template_kwargs, answered=answered)
        last_seconds = time.perf_counter() - began
        parts.write(k, records, counts)


def _answer_batched(parts: _Parts, todo: list[int], answerer: Answerer, t0: float, say: Callable[[str], Any]) -> None:
    """The engine (`answer_engine`) on every conversation of the batches `todo`, in order; a part
    is written as soon as all its conversations are over. When the time budget runs out, the
    conversations in work end at their last finished answer, and the unfinished batches are written
    with the conversations that have one."""
    from .answer_engine import AnswerEngine

    o, size = parts.options, parts.options.batch_size
    engine = AnswerEngine(answerer.decoder, answerer.tokenizer, answerer.eos_id, answerer.seq_len,
                          answerer.max_new_tokens, slots=answerer.chunk)
    waiting: dict[int, dict[int, Dialogue]] = {k: {} for k in todo}           # batch -> its finished dialogues
    queue = [(i, c) for k in todo for i, c in enumerate(parts.batch(k), k * size)]
    done, tokens, heard = len(parts.conversations) - len(queue), parts.tokens, time.perf_counter()

    def dialogue(c: Conversation) -> Dialogue:
        return Dialogue(c, answerer.tokenizer, answerer.seq_len, o.chat_template_kwargs)

    with torch.inference_mode():
        for i, d in engine.run(queue, dialogue, o.temperatures, o.seed, None if o.max_seconds is None
                               else t0 + o.max_seconds):
            k, done = i // size, done + 1
            waiting[k][i] = d
            if len(waiting[k]) == len(parts.batch(k)):
                parts.write(k, *_records(waiting.pop(k)), done=done)
            elif time.perf_counter() - heard >= PROGRESS_SECONDS:
                heard = time.perf_counter()
                parts.heard(done, tokens + engine.counts.generated, f"{done - len(parts.conversations) + len(queue)}"
                            f"/{len(queue)} answered here, {engine.slots} rows")
    left = sum(len(parts.batch(k)) - len(w) for k, w in waiting.items())
    for k, finished in waiting.items():           # only when the budget ran out: the finished conversations stay
        if finished:
            parts.write(k, *_records(finished), done=done)
    if left or engine.stopped:
        say(f"the time budget ({budget_text(o.max_seconds / 60)} min) ran out: {engine.stopped} conversation(s) in "
            f"work end at their last finished answer, {left} were not begun")


def _records(dialogues: dict[int, Dialogue]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """A part's lines (by conversation index) and counts."""
    ordered = [dialogues[i] for i in sorted(dialogues)]
    return [d.record for d in ordered if d.record is not None], dialogue_counts(ordered)


def stats_name(k: int) -> str:
    return f"part-{k:05d}.stats.json"


def part_stats(partial: Path, k: int) -> dict[str, Any]:
    path = partial / stats_name(k)
    return json.loads(path.read_text()) if (partial / part_name(k)).is_file() and path.is_file() else {}


def write_part(partial: Path, k: int, records: Sequence[dict[str, Any]], stats: dict[str, Any]) -> None:
    """Batch k's part in OUT.partial/: its stats, then its records as JSON lines, each atomic; the
    part last, since its presence marks the batch done (a killed run redoes a batch without it)."""
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    write_file(partial / stats_name(k), lambda f: f.write(json.dumps(stats).encode()))
    write_file(partial / part_name(k), lambda f: f.write(lines.encode("utf-8")))


def join_parts(partial: Path, present: list[int], settings: dict[str, Any],
               extra: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Inside OUT.partial/ (under `partial.finalize`'s lock): the parts `present` joined into
    conversations.jsonl, answers.json written (`settings`, the counts summed over the parts'
    stats, and `extra(the parts' stats)` where given), the parts and build.json removed, the folder
    marked as answers. Shared by the in-process paths and the servers' (`served_answers`)."""
    parts = [partial / part_name(k) for k in present]
    stats = [part_stats(partial, k) for k in present]
    totals = {"tokens": 0, "answers": 0, "too_long": 0, "seconds": 0.0}
    for one in stats:
        for name in totals:
            totals[name] += one.get(name, 0)

    def concat(f) -> None:
        for p in parts:
            f.write(p.read_bytes())

    write_file(partial / ANSWERS_FILE, concat)
    written = sum(1 for p in parts for line in p.open(encoding="utf-8") if line.strip())
    meta = {**settings, "written": written, "batches_done": len(parts), **totals,
            "ranks": len({one.get("rank", 0) for one in stats}),
            "tokens_per_second": totals["tokens"] / max(totals["seconds"], 1e-9), **(extra(stats) if extra else {})}
    write_file(partial / META_FILE, lambda f: f.write((json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()))
    for k in present:
        (partial / part_name(k)).unlink(missing_ok=True)
        (partial / stats_name(k)).unlink(missing_ok=True)
    (partial / BUILD_FILE).unlink(missing_ok=True)
    mark_dir(partial, ANSWERS_KIND)
    return meta


def _open_partial(partial: Path, settings: dict[str, Any], rank: int) -> None:
    """OUT.partial/ for these settings (`partial.open_partial`: created with build.json, or resumed
    when its build.json is the same; another partial run is refused in one line). Only rank 0
    removes a stale temp file."""
    open_partial(partial.with_name(partial.name.removesuffix(".partial")), settings, rank=rank,
                 start_over="remove {partial} to start over")


def _finalize(partial: Path, out: Path, settings: dict[str, Any], present: list[int], rank: int,
              t0: float) -> dict[str, Any]:
    """Join the parts into OUT (`partial.finalize`: one process, the one that takes the lock)."""

    done, meta = finalize(out, lambda partial: join_parts(partial, present, settings))
    if not done:
        return {"finalized": False, "rank": rank}
    meta["wall_seconds"] = time.perf_counter() - t0
    meta["finalized"] = True
    return meta


def _ids_digest(conversations: Sequence[Conversation]) -> str:
    import hashlib

    h = hashlib.sha256()
    for c in conversations:
        h.update(c.id.encode() + b"\0")
    return h.hexdigest()[:16]


def load_answerer(target: str | os.PathLike, *, seq_len: int, max_new_tokens: int, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, chunk: int = 64) -> tuple[Answerer, dict[str, Any]]:
    """The target (a model directory or GGUF file) loaded for answering, and its identity."""
    from specdec_models.hf import HFDecoder, logits_width
    from specdec_models.hf.weights import check_source, load_causal_lm, load_tokenizer, target_identity

    from .regenerate import stop_token

    path = check_source(target, "target")
    tokenizer = load_tokenizer(path, "target")
    check_chat_template(tokenizer)
    model = load_causal_lm(path, dtype=dtype, what="target").to(device)
    model.requires_grad_(False)
    decoder = HFDecoder(model, min(len(tokenizer), logits_width(model)))
    check(seq_len + 1 <= decoder.cfg.max_seq_len, f"seq_len + 1 = {seq_len + 1} exceeds the target's "
                                                  f"{decoder.cfg.max_seq_len} positions")
    eos = stop_token(tokenizer, chat=True)
    if eos is None:
        raise SpecdecError(f"the target {path} has no end-of-turn or EOS token: its answers would never stop")
    return Answerer(decoder, tokenizer, eos, seq_len, max_new_tokens, chunk), {"kind": "hf", **target_identity(model,
                                                                                                       path.resolve())}
