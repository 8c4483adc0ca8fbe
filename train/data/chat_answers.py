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

Conversations are answered in batches of `batch_size`: turn k of every conversation of a batch
together, their contexts sorted by length and continued `chunk` at a time
(`regenerate.continue_with_states`, KV-cached, a finished row leaving the call at once), each at
its conversation's temperature (temperatures[i mod len] for conversation i, greedy at 0, all in one
call), seeded by (seed, batch, turn). So the output is a pure function of the settings, and a
killed run resumes to the same bytes.

On disk, OUT/ (a folder marked as specdec "answers"):

    OUT/conversations.jsonl   one {"id", "source", "messages": [{role, content}], "truncated",
                              "answered"} per conversation, the answers the target's (`read_answers`
                              and any `messages` JSONL reader take it)
    OUT/answers.json          the settings, the target's identity, counts, tokens and seconds

A run writes into OUT.partial/: build.json first, then one `part-NNNNN.jsonl` per batch (atomic),
and the folder is renamed to OUT when all are done (`partial`: the protocol the cache shares); the
same command resumes a killed run from its finished parts. `max_seconds` stops between batches
(the parts done are the output).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
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


def _part(k: int) -> str:
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
    check(meta_path.is_file(), f"{out} holds no answers ({META_FILE} is missing): write it with scripts/eagle3.py "
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
            for i, row, n in zip(mine, tokens.tolist(), valid.tolist()):
                answer = row[prompts[i].numel():n]
                ended = bool(answer) and self.eos_id is not None and answer[-1] == self.eos_id
                out[i] = (answer[:-1] if ended else answer, ended)
            if each is not None:
                each(int((valid - torch.tensor([prompts[i].numel() for i in mine], device=valid.device)).sum()))
        return out


def answer_batch(conversations: Sequence[Conversation], answerer: Answerer, *, temperatures: Sequence[float],
                 first: int, seed: int, chat_template_kwargs: Mapping | None = None,
                 answered: Callable[[int, int], Any] | None = None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Answer every assistant turn of `conversations` (global indices first, first + 1, ...), turn k
    of all of them together. Returns their records and counts {"tokens": generated, "answers",
    "too_long": conversations whose first context left no room for an answer (dropped)}.
    `answered(turn, tokens)` hears each generating call's new tokens (the answerer's `each`)."""
    tokenizer, kwargs = answerer.tokenizer, dict(chat_template_kwargs or {})
    plans = {i: answer_prompts(c) for i, c in enumerate(conversations)}
    pending: dict[int, AnswerPrompt] = {i: next(plan) for i, plan in plans.items()}
    done: dict[int, dict[str, Any]] = {}
    answers_of = {i: 0 for i in plans}          # answers written so far, per conversation
    counts = {"tokens": 0, "answers": 0, "too_long": 0}
    turn = 0
    while pending:
        ids = {i: torch.tensor(context_ids(tokenizer, p.context, kwargs), dtype=torch.long)
               for i, p in pending.items()}
        for i in [i for i, x in ids.items() if answerer.seq_len + 1 - x.numel() < MIN_ROOM]:
            p = pending.pop(i)                     # no room for an answer: the conversation ends before this turn
            context = p.context[:max((j for j, t in enumerate(p.context) if t.role == "assistant"), default=-1) + 1]
            if answers_of[i]:
                c = conversations[i]
                done[i] = record(Conversation(c.id, context, c.source), False, answers_of[i])
            else:
                counts["too_long"] += 1
        mine = list(pending)
        if mine:                                   # every pending context in one call, each at its own temperature
            g = torch.Generator(device=answerer.decoder.device).manual_seed(seed * 1_000_003 + first * 17 + turn * 7919)
            results = answerer([ids[i] for i in mine], [temperatures[(first + i) % len(temperatures)] for i in mine], g,
                               each=None if answered is None else (lambda tokens: answered(turn, tokens)))
            for i, (answer, ended) in zip(mine, results):
                counts["tokens"] += len(answer) + int(ended)
                counts["answers"] += 1
                answers_of[i] += 1
                text = tokenizer.decode(answer, skip_special_tokens=True)
                p, c = pending.pop(i), conversations[i]
                if not ended:                      # cut short: the conversation ends with this answer
                    done[i] = record(Conversation(c.id, (*p.context, Turn("assistant", text)), c.source), True,
                                     answers_of[i])
                    continue
                try:
                    pending[i] = plans[i].send(text)
                except StopIteration as stop:
                    done[i] = record(stop.value, False, answers_of[i])
        turn += 1
    return [done[i] for i in sorted(done)], counts


def answer_conversations(conversations: Sequence[Conversation], out: str | os.PathLike, *,
                         answerer: Answerer | None, identity: Mapping[str, Any], data: Mapping[str, Any],
                         temperatures: Sequence[float] = (0.0,), batch_size: int = 64, seed: int = 0,
                         chat_template_kwargs: Mapping | None = None, keep_answers: bool = False,
                         progress: Callable[[int, int, int, str], Any] | None = None,
                         report: Callable[[str], Any] | None = None, max_seconds: float | None = None,
                         rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Write OUT (module docstring): `conversations` answered by `answerer` (None with
    `keep_answers`: the data's answers). `identity`: the target's (recorded, and compared on resume);
    `data`: how the conversations were chosen (recorded). `progress(conversations done, of, tokens
    generated so far, where: "" after a batch, else the batch and turn in work)` follows each
    generating call; `report(line)` hears a resume. Returns answers.json's contents.

    As one of `world` processes (`rank`), it answers batches rank, rank + world, ... into the same
    OUT.partial/ (on a filesystem they share); whichever process finds every batch's part written
    when it ends joins them into OUT (a lock file keeps it to one), and the others return
    {"finalized": False}. A batch is a pure function of the settings, so OUT is the same bytes as
    one process writes, whatever the ranks, kills and resumes: a killed rank's batches are
    answered by the next run of any process set."""
    t0 = time.perf_counter()
    out = Path(out).expanduser()
    say = report or (lambda line: None)
    check(keep_answers or answerer is not None, "answering needs the target (or keep_answers=True)")
    check(len(conversations) > 0, "no conversations to answer")
    check(batch_size >= 1, f"the batch size must be >= 1, got {batch_size}")
    check(max_seconds is None or max_seconds > 0, f"the time budget must be > 0 seconds, got {max_seconds!r}")
    check(world >= 1 and 0 <= rank < world, f"rank {rank} of {world} processes is not a rank")
    batches = -(-len(conversations) // batch_size)
    check(world <= batches, f"{world} processes for {len(conversations)} conversations in {batches} batch(es) of "
                            f"{batch_size}: some would have nothing to answer; use at most {batches} processes")
    check(max_seconds is None or world == 1, "a time budget stops one process; with several, give none (the "
                                             "conversations they answer must be every batch)")
    if answerer is not None:
        check_chat_template(answerer.tokenizer, dict(chat_template_kwargs or {}))
    settings = {"format": FORMAT, "target": dict(identity), "data": dict(data), "conversations": len(conversations),
                "ids_sha": _ids_digest(conversations), "temperatures": [float(t) for t in temperatures],
                "batch_size": batch_size, "seed": seed, "chat_template_kwargs": dict(chat_template_kwargs or {}),
                "keep_answers": keep_answers,
                "seq_len": None if answerer is None else answerer.seq_len,
                "max_new_tokens": None if answerer is None else answerer.max_new_tokens,
                "chunk": None if answerer is None else answerer.chunk}
    partial = out.with_name(f"{out.name}.partial")
    _open_partial(partial, settings, rank)
    mine = [k for k in range(batches) if k % world == rank]
    todo = [k for k in mine if not (partial / _part(k)).is_file()]
    if len(todo) < len(mine):
        say(f"resuming {partial}: {len(mine) - len(todo)} of {len(mine)} batch(es)"
            f"{f' of rank {rank}' if world > 1 else ''} already answered")
    done_tokens = sum(_stats(partial, k).get("tokens", 0) for k in range(batches))
    last_seconds = 0.0
    for k in todo:
        began = time.perf_counter()
        if max_seconds is not None and began - t0 + last_seconds > max_seconds and k > 0:
            say(f"the time budget ({max_seconds / 60:.1f} min) ran out after {k} of {batches} batches")
            break
        part = conversations[k * batch_size:(k + 1) * batch_size]
        running = [done_tokens]

        def answered(turn: int, tokens: int, k: int = k) -> None:
            running[0] += tokens
            if progress is not None:
                progress(k * batch_size, len(conversations), running[0], f"batch {k + 1}/{batches}, turn {turn + 1}")

        if keep_answers:
            records = [record(c) for c in part]
            counts = {"tokens": 0, "answers": 0, "too_long": 0}
        else:
            with torch.inference_mode():
                records, counts = answer_batch(part, answerer, temperatures=temperatures, first=k * batch_size,
                                               seed=seed, chat_template_kwargs=chat_template_kwargs,
                                               answered=answered)
        last_seconds = time.perf_counter() - began
        stats = {**counts, "seconds": last_seconds, "rank": rank}
        done_tokens += counts["tokens"]
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        write_file(partial / _stats_name(k), lambda f: f.write(json.dumps(stats).encode()))
        write_file(partial / _part(k), lambda f: f.write(lines.encode("utf-8")))        # the part last: it marks done
        if progress is not None:
            progress(min((k + 1) * batch_size, len(conversations)), len(conversations), done_tokens, "")
    present = [k for k in range(batches) if (partial / _part(k)).is_file()]
    if world > 1 and len(present) < batches:
        say(f"rank {rank} answered its batches; {batches - len(present)} of other ranks are not written yet: the "
            f"last rank to finish writes {out}")
        return {"finalized": False, "rank": rank, "batches": len(mine)}
    check(present, "the time budget ran out before one batch was answered")
    return _finalize(partial, out, settings, present, rank, t0)


def _stats_name(k: int) -> str:
    return f"part-{k:05d}.stats.json"


def _stats(partial: Path, k: int) -> dict[str, Any]:
    path = partial / _stats_name(k)
    return json.loads(path.read_text()) if (partial / _part(k)).is_file() and path.is_file() else {}


def _open_partial(partial: Path, settings: dict[str, Any], rank: int) -> None:
    """OUT.partial/ for these settings (`partial.open_partial`: created with build.json, or resumed
    when its build.json is the same; another partial run is refused in one line). Only rank 0
    removes a stale temp file."""
    open_partial(partial.with_name(partial.name.removesuffix(".partial")), settings, rank=rank,
                 start_over="remove {partial} to start over")


def _finalize(partial: Path, out: Path, settings: dict[str, Any], present: list[int], rank: int,
              t0: float) -> dict[str, Any]:
    """Join the parts into OUT (`partial.finalize`: one process, the one that takes the lock)."""

    def join(partial: Path) -> dict[str, Any]:
        parts = [partial / _part(k) for k in present]
        totals = {"tokens": 0, "answers": 0, "too_long": 0, "seconds": 0.0}
        ranks = set()
        for k in present:
            stats = _stats(partial, k)
            for name in totals:
                totals[name] += stats.get(name, 0)
            ranks.add(stats.get("rank", 0))

        def concat(f) -> None:
            for p in parts:
                f.write(p.read_bytes())

        write_file(partial / ANSWERS_FILE, concat)
        written = sum(1 for p in parts for line in p.open(encoding="utf-8") if line.strip())
        meta = {**settings, "written": written, "batches_done": len(parts), **totals, "ranks": len(ranks),
                "tokens_per_second": totals["tokens"] / max(totals["seconds"], 1e-9)}
        write_file(partial / META_FILE, lambda f: f.write((json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()))
        for k in present:
            (partial / _part(k)).unlink(missing_ok=True)
            (partial / _stats_name(k)).unlink(missing_ok=True)
        (partial / BUILD_FILE).unlink(missing_ok=True)
        mark_dir(partial, ANSWERS_KIND)
        return meta

    done, meta = finalize(out, join)
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
