"""The answers step through serving engines: `answer_from_servers` writes the same answers folder
as `chat_answers.answer_conversations`, its answers from OpenAI-compatible servers
(`answer_server`: vLLM, SGLang, llama.cpp's `llama-server`).

Each conversation is answered turn by turn as the in-process path answers it (`answer_prompts`:
turn k + 1 sees the target's own answer to turn k; a context that leaves fewer than `MIN_ROOM`
positions of the seq_len + 1 row ends the conversation before that turn; an answer cut at
max_tokens ends it, recorded `truncated`), each request asking for at most min(max_new_tokens,
room left) tokens at the conversation's temperature (temperatures[i mod len] for conversation i)
with a seed of (seed, i, turn). The engines batch: every conversation is its own chain of
requests, as many in flight as the pool has slots (`ServerPool`: `in_flight` per server, over every
URL), so a conversation's next turn is asked as soon as its answer is back.

On disk it is the in-process path's layout, record for record (`chat_answers.record`, read by
`read_answers` and `chat_rows`): OUT.partial/build.json, one `part-NNNNN.jsonl` (with its
`.stats.json`) per batch of `batch_size` conversations, written as soon as every conversation of the
batch is answered, and OUT/conversations.jsonl + OUT/answers.json when all are. answers.json adds
"engine": "server" and "servers" (each server's identity and the check's verdict, `ServerInfo`),
and "quantized": true when a server was judged a quantized copy of the target. A failure mid-run
(every server gone, or an empty or cut answer after its retries) raises SpecdecError, one line,
after the finished batches are written: the same call, against the same or other servers of the
same target, resumes from them (the URLs are not part of the settings). `max_seconds` is checked
before every request; the batches finished by then are the output.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec_models.errors import SpecdecError, check

from .answer_server import Reference, Request, Retry, ServerPool, Stopped, connect
from .chat_answers import FORMAT, MIN_ROOM, budget_text, join_parts, part_name, part_stats, record, write_part
from .conversations import Conversation, Turn, answer_prompts, context_ids
from .partial import finalize, open_partial, partial_dir

ENGINE = "server"


@dataclass(frozen=True)
class ServedSettings:
    """The answers step's settings on the server path (the in-process path's names): rows of
    seq_len + 1 tokens, at most `max_new_tokens` per answer, conversation i at
    temperatures[i mod len], batches of `batch_size` conversations (the unit of resume), request
    seeds from `seed`; `in_flight` requests per server, retried per `retry`."""
    seq_len: int
    max_new_tokens: int
    temperatures: Sequence[float] = (0.0,)
    batch_size: int = 64
    seed: int = 0
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    in_flight: int = 8
    retry: Retry = Retry()

    def check(self) -> None:
        for name in ("seq_len", "max_new_tokens", "batch_size", "in_flight"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
        check(len(self.temperatures) > 0 and all(t >= 0 for t in self.temperatures),
              f"temperatures must be >= 0, got {list(self.temperatures)}")

    def recorded(self, identity: Mapping[str, Any], data: Mapping[str, Any], conversations: Sequence[Conversation]
                 ) -> dict[str, Any]:
        """build.json's settings (compared on resume): the in-process path's keys, "engine": "server"."""
        return {"format": FORMAT, "engine": ENGINE, "target": dict(identity), "data": dict(data),
                "conversations": len(conversations), "ids_sha": _ids_digest(conversations),
                "temperatures": [float(t) for t in self.temperatures], "batch_size": self.batch_size,
                "seed": self.seed, "chat_template_kwargs": dict(self.chat_template_kwargs), "keep_answers": False,
                "seq_len": self.seq_len, "max_new_tokens": self.max_new_tokens, "chunk": None}


def _ids_digest(conversations: Sequence[Conversation]) -> str:
    """The in-process path's digest of the conversations' ids (build.json's "ids_sha")."""
    h = hashlib.sha256()
    for c in conversations:
        h.update(c.id.encode() + b"\0")
    return h.hexdigest()[:16]


class _Budget(Exception):
    """The time budget ran out before this conversation was answered."""


def answer_one(conversation: Conversation, index: int, pool: ServerPool, reference: Reference,
               settings: ServedSettings, deadline: float | None = None) -> tuple[dict[str, Any] | None, dict[str, int]]:
    """Conversation `index` answered turn by turn (module docstring): its record (None when its
    first context leaves no room for an answer) and counts {"tokens", "answers", "too_long"}."""
    tokenizer, s = reference.tokenizer, settings
    kwargs = dict(s.chat_template_kwargs)
    plan = answer_prompts(conversation)
    prompt = next(plan)
    counts = {"tokens": 0, "answers": 0, "too_long": 0}
    temperature = float(s.temperatures[index % len(s.temperatures)])
    c = conversation
    for turn in range(len(c.turns)):
        ids = context_ids(tokenizer, prompt.context, kwargs)
        room = s.seq_len + 1 - len(ids)
        if room < MIN_ROOM:                       # no room for an answer: the conversation ends before this turn
            if not counts["answers"]:
                return None, {**counts, "too_long": 1}
            last = max(j for j, t in enumerate(prompt.context) if t.role == "assistant")
            return record(Conversation(c.id, prompt.context[:last + 1], c.source), False, counts["answers"]), counts
        if deadline is not None and time.monotonic() > deadline:
            raise _Budget
        seed = (s.seed * 1_000_003 + index * 7919 + turn) % (1 << 31)
        request = Request(ids, tokenizer.decode(ids, skip_special_tokens=False), min(s.max_new_tokens, room),
                          temperature, seed, f"conversation {c.id!r}, turn {turn + 1}")
        answer = pool.complete(request)
        counts["tokens"] += answer.tokens
        counts["answers"] += 1
        if not answer.ended:                      # cut short: the conversation ends with this answer
            return record(Conversation(c.id, (*prompt.context, Turn("assistant", answer.text)), c.source), True,
                          counts["answers"]), counts
        try:
            prompt = plan.send(answer.text)
        except StopIteration as stop:
            return record(stop.value, False, counts["answers"]), counts
    raise AssertionError("a conversation has more answers than turns")


class _Batches:
    """Collects answered conversations per batch and writes a batch's part when it is whole."""

    def __init__(self, partial: Path, sizes: dict[int, int], servers: list[dict[str, Any]],
                 progress: Callable[[int, int, int, str], Any] | None, total: int, tokens: int) -> None:
        self.partial, self.sizes, self.progress, self.total = partial, sizes, progress, total
        self.servers = [{"url": s["url"], "model": s["model"]} for s in servers]
        self.done: dict[int, dict[int, tuple[dict | None, dict[str, int]]]] = {k: {} for k in sizes}
        self.tokens, self.written, self.conversations = tokens, 0, total - sum(sizes.values())
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, k: int, index: int, result: tuple[dict | None, dict[str, int]]) -> None:
        with self.lock:
            self.done[k][index] = result
            if len(self.done[k]) == self.sizes[k]:
                self._write(k)

    def _write(self, k: int) -> None:
        results = [r for _, r in sorted(self.done.pop(k).items())]
        counts = {name: sum(c[name] for _, c in results) for name in ("tokens", "answers", "too_long")}
        now = time.monotonic()
        stats = {**counts, "seconds": now - self.last, "rank": 0, "servers": self.servers}
        self.last = now
        write_part(self.partial, k, [r for r, _ in results if r is not None], stats)
        self.tokens += counts["tokens"]
        self.written += 1
        self.conversations += len(results)
        if self.progress is not None:
            self.progress(self.conversations, self.total, self.tokens, "")


def answer_from_servers(conversations: Sequence[Conversation], out: str | os.PathLike, urls: Sequence[str],
                        reference: Reference, settings: ServedSettings, *, data: Mapping[str, Any],
                        progress: Callable[[int, int, int, str], Any] | None = None,
                        report: Callable[[str], Any] | None = None,
                        max_seconds: float | None = None) -> dict[str, Any]:
    """Write OUT (module docstring): `conversations` answered by the servers at `urls`, checked
    against `reference` (the in-process target) before anything is written. `data`: how the
    conversations were chosen (recorded). `progress(conversations done, of, tokens generated so
    far, "")` follows each written batch; `report(line)` hears a resume and a budget that ran out.
    Returns answers.json's contents (plus "finalized": True)."""
    t0 = time.monotonic()
    out = Path(out).expanduser()
    say = report or (lambda line: None)
    settings.check()
    check(len(conversations) > 0, "no conversations to answer")
    check(max_seconds is None or max_seconds > 0, f"the time budget must be > 0 seconds, got {max_seconds!r}")
    pool, servers = connect(list(urls), reference, settings.seq_len, settings.in_flight, settings.retry)
    recorded = settings.recorded(reference.identity, data, conversations)
    partial = open_partial(out, recorded)
    b = settings.batch_size
    batches = -(-len(conversations) // b)
    todo = [k for k in range(batches) if not (partial / part_name(k)).is_file()]
    if len(todo) < batches:
        say(f"resuming {partial}: {batches - len(todo)} of {batches} batch(es) already answered")
    done_tokens = sum(part_stats(partial, k).get("tokens", 0) for k in range(batches))
    sizes = {k: len(conversations[k * b:(k + 1) * b]) for k in todo}
    writer = _Batches(partial, sizes, servers, progress, len(conversations), done_tokens)
    deadline = None if max_seconds is None else t0 + max_seconds
    ran_out = _run(conversations, todo, b, pool, reference, settings, writer, deadline, partial)
    if ran_out:
        say(f"the time budget ({budget_text(max_seconds / 60)} min) ran out after {writer.written} of {len(todo)} "
            "batches")
    present = [k for k in range(batches) if (partial / part_name(k)).is_file()]
    check(present, "the time budget ran out before one batch was answered")
    return _finalize(out, recorded, present, servers)


def _run(conversations: Sequence[Conversation], todo: list[int], b: int, pool: ServerPool, reference: Reference,
         settings: ServedSettings, writer: _Batches, deadline: float | None, partial: Path) -> bool:
    """Answer the conversations of batches `todo` on a thread per pool slot; True when the budget
    ran out. A failure stops the pool, lets the requests in flight end, and is raised (one line)
    once the finished batches are written."""
    work = [(k, i) for k in todo for i in range(k * b, min((k + 1) * b, len(conversations)))]

    def one(k: int, i: int) -> None:
        writer.add(k, i, answer_one(conversations[i], i, pool, reference, settings, deadline))

    with ThreadPoolExecutor(max_workers=pool.slots, thread_name_prefix="answers") as executor:
        futures: list[Future] = [executor.submit(one, k, i) for k, i in work]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in finished):
            pool.stop()                           # the threads waiting for a slot leave; requests in flight end
            for f in futures:
                f.cancel()
    errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    failure = next((e for e in errors if not isinstance(e, (_Budget, Stopped))), None)
    if failure is None:
        return any(isinstance(e, _Budget) for e in errors)
    if isinstance(failure, SpecdecError):
        raise SpecdecError(f"{failure}; the {writer.written} batch(es) finished are kept in {partial}: run the same "
                           "command again to resume") from None
    raise failure


def _finalize(out: Path, settings: dict[str, Any], present: list[int], servers: list[dict[str, Any]]
              ) -> dict[str, Any]:
    """Join the parts into OUT (`partial.finalize`): conversations.jsonl and answers.json (the
    in-process path's fields, plus the servers of this run and of the runs it resumed)."""

    def servers_of(stats: list[dict[str, Any]]) -> dict[str, Any]:
        earlier: list[dict[str, Any]] = []
        for one in stats:
            earlier += [s for s in one.get("servers", []) if s not in earlier]
        return {"servers": servers, "servers_of_parts": earlier,
                "quantized": any(s["weights"] == "quantized" for s in servers)}

    done, meta = finalize(out, lambda partial: join_parts(partial, present, settings, servers_of))
    check(done, f"another process is finishing {partial_dir(out)}: answer from servers with one process")
    return {**meta, "finalized": True}
