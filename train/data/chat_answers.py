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
together (`regenerate.continue_with_states`, KV-cached, a finished row leaving the batch at once),
sampled at temperatures[i mod len] for conversation i (greedy at 0), seeded by (seed, batch, turn,
temperature). So the output is a pure function of the settings and a killed run resumes exactly.

On disk, OUT/ (a folder marked as specdec "answers"):

    OUT/conversations.jsonl   one {"id", "source", "messages": [{role, content}], "truncated",
                              "answered"} per conversation, the answers the target's (`read_answers`
                              and any `messages` JSONL reader take it)
    OUT/answers.json          the settings, the target's identity, counts, tokens and seconds

A run writes into OUT.partial/: build.json first, then one `part-NNNNN.jsonl` per batch (atomic),
and the folder is renamed to OUT when all are done; the same command resumes a killed run from its
finished parts. `max_seconds` stops between batches (the parts done are the output).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from specdec_models.errors import SpecdecError, check
from specdec_models.files import mark_dir, remove_stale_temps, replace_dir, write_file

from .conversations import AnswerPrompt, Conversation, Turn, answer_prompts, check_chat_template, context_ids

ANSWERS_KIND = "answers"
ANSWERS_FILE = "conversations.jsonl"
META_FILE = "answers.json"
BUILD_FILE = "build.json"
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


class Answerer:
    """Answers a batch of contexts with the target: `__call__(prompts, temperature, generator)` ->
    [(answer token ids without the stop token, whether it reached the stop token)].

    The contexts are sorted by length and continued `chunk` at a time: the prefill is right-padded
    to the longest context of its call, and ShareGPT's first turns run from a few tokens to
    hundreds, so unsorted calls spent most of their prefill on padding (SmolLM2, bf16, 2 cores: a
    call of 128 contexts of 60 tokens on average and up to 300 made 100 tokens/s, where its decoding
    steps alone make 315)."""

    def __init__(self, decoder: Any, tokenizer: Any, eos_id: int | None, seq_len: int, max_new_tokens: int,
                 chunk: int = 64) -> None:
        self.decoder, self.tokenizer, self.eos_id = decoder, tokenizer, eos_id
        self.seq_len, self.max_new_tokens, self.chunk = seq_len, max_new_tokens, chunk

    def __call__(self, prompts: list[torch.Tensor], temperature: float, generator: torch.Generator
                 ) -> list[tuple[list[int], bool]]:
        from .regenerate import continue_with_states

        order = sorted(range(len(prompts)), key=lambda i: prompts[i].numel())
        out: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
        for start in range(0, len(order), self.chunk):
            mine = order[start:start + self.chunk]
            tokens, valid, _ = continue_with_states(self.decoder, [prompts[i] for i in mine], self.seq_len + 1, [],
                                                    temperature, generator, self.eos_id, max_new=self.max_new_tokens)
            for i, row, n in zip(mine, tokens.tolist(), valid.tolist()):
                answer = row[prompts[i].numel():n]
                ended = bool(answer) and self.eos_id is not None and answer[-1] == self.eos_id
                out[i] = (answer[:-1] if ended else answer, ended)
        return out


def answer_batch(conversations: Sequence[Conversation], answerer: Answerer, *, temperatures: Sequence[float],
                 first: int, seed: int, chat_template_kwargs: Mapping | None = None
                 ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Answer every assistant turn of `conversations` (global indices first, first + 1, ...), turn k
    of all of them together. Returns their records and counts {"tokens": generated, "answers",
    "too_long": conversations whose first context left no room for an answer (dropped)}."""
    tokenizer, kwargs = answerer.tokenizer, dict(chat_template_kwargs or {})
    plans = {i: answer_prompts(c) for i, c in enumerate(conversations)}
    pending: dict[int, AnswerPrompt] = {i: next(plan) for i, plan in plans.items()}
    done: dict[int, dict[str, Any]] = {}
    answered = {i: 0 for i in plans}
    counts = {"tokens": 0, "answers": 0, "too_long": 0}
    turn = 0
    while pending:
        ids = {i: torch.tensor(context_ids(tokenizer, p.context, kwargs), dtype=torch.long)
               for i, p in pending.items()}
        for i in [i for i, x in ids.items() if answerer.seq_len + 1 - x.numel() < MIN_ROOM]:
            p = pending.pop(i)                     # no room for an answer: the conversation ends before this turn
            context = p.context[:max((j for j, t in enumerate(p.context) if t.role == "assistant"), default=-1) + 1]
            if answered[i]:
                c = conversations[i]
                done[i] = record(Conversation(c.id, context, c.source), False, answered[i])
            else:
                counts["too_long"] += 1
        for k, temperature in enumerate(temperatures):
            mine = [i for i in pending if (first + i) % len(temperatures) == k]
            if not mine:
                continue
            g = torch.Generator(device=answerer.decoder.device).manual_seed(
                seed * 1_000_003 + first * 17 + turn * 7919 + k)
            for i, (answer, ended) in zip(mine, answerer([ids[i] for i in mine], float(temperature), g)):
                counts["tokens"] += len(answer) + int(ended)
                counts["answers"] += 1
                answered[i] += 1
                text = tokenizer.decode(answer, skip_special_tokens=True)
                p, c = pending.pop(i), conversations[i]
                if not ended:                      # cut short: the conversation ends with this answer
                    done[i] = record(Conversation(c.id, (*p.context, Turn("assistant", text)), c.source), True,
                                     answered[i])
                    continue
                try:
                    pending[i] = plans[i].send(text)
                except StopIteration as stop:
                    done[i] = record(stop.value, False, answered[i])
        turn += 1
    return [done[i] for i in sorted(done)], counts


def answer_conversations(conversations: Sequence[Conversation], out: str | os.PathLike, *,
                         answerer: Answerer | None, identity: Mapping[str, Any], data: Mapping[str, Any],
                         temperatures: Sequence[float] = (0.0,), batch_size: int = 64, seed: int = 0,
                         chat_template_kwargs: Mapping | None = None, keep_answers: bool = False,
                         progress: Callable[[int, int, int], Any] | None = None,
                         report: Callable[[str], Any] | None = None, max_seconds: float | None = None
                         ) -> dict[str, Any]:
    """Write OUT (module docstring): `conversations` answered by `answerer` (None with
    `keep_answers`: the data's answers). `identity`: the target's (recorded, and compared on resume);
    `data`: how the conversations were chosen (recorded). `progress(conversations done, of, tokens
    generated)` follows each batch; `report(line)` hears a resume. Returns answers.json's contents."""
    t0 = time.perf_counter()
    out = Path(out).expanduser()
    say = report or (lambda line: None)
    check(keep_answers or answerer is not None, "answering needs the target (or keep_answers=True)")
    check(len(conversations) > 0, "no conversations to answer")
    check(batch_size >= 1, f"the batch size must be >= 1, got {batch_size}")
    check(max_seconds is None or max_seconds > 0, f"the time budget must be > 0 seconds, got {max_seconds!r}")
    if answerer is not None:
        check_chat_template(answerer.tokenizer, dict(chat_template_kwargs or {}))
    settings = {"format": FORMAT, "target": dict(identity), "data": dict(data), "conversations": len(conversations),
                "ids_sha": _ids_digest(conversations), "temperatures": [float(t) for t in temperatures],
                "batch_size": batch_size, "seed": seed, "chat_template_kwargs": dict(chat_template_kwargs or {}),
                "keep_answers": keep_answers,
                "seq_len": None if answerer is None else answerer.seq_len,
                "max_new_tokens": None if answerer is None else answerer.max_new_tokens}
    partial = out.with_name(f"{out.name}.partial")
    if partial.exists():
        found = partial / BUILD_FILE
        old = json.loads(found.read_text()) if found.is_file() else None
        if old != settings:
            changed = sorted(k for k in settings if old is not None and old.get(k) != settings[k])
            check(old is None, f"{partial} holds a partial run with other settings ({', '.join(changed)} differ): run "
                               f"the command that started it to resume, or remove {partial} to start over")
            shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    write_file(partial / BUILD_FILE, lambda f: f.write(json.dumps(settings, indent=2, sort_keys=True).encode()))
    remove_stale_temps(partial)
    batches = -(-len(conversations) // batch_size)
    kept = [k for k in range(batches) if (partial / _part(k)).is_file()]
    if kept:
        say(f"resuming {partial}: {len(kept)} of {batches} batch(es) already answered")
    totals = {"tokens": 0, "answers": 0, "too_long": 0, "seconds": 0.0}
    stats_path = partial / "stats.json"
    if stats_path.is_file():
        totals.update(json.loads(stats_path.read_text()))
    finished = batches
    last_seconds = 0.0
    for k in range(batches):
        if k in kept:
            continue
        began = time.perf_counter()
        if max_seconds is not None and began - t0 + last_seconds > max_seconds and k > 0:
            finished = k
            say(f"the time budget ({max_seconds / 60:.1f} min) ran out after {k} of {batches} batches")
            break
        part = conversations[k * batch_size:(k + 1) * batch_size]
        if keep_answers:
            records = [record(c) for c in part]
            counts = {"tokens": 0, "answers": 0, "too_long": 0}
        else:
            with torch.inference_mode():
                records, counts = answer_batch(part, answerer, temperatures=temperatures, first=k * batch_size,
                                               seed=seed, chat_template_kwargs=chat_template_kwargs)
        last_seconds = time.perf_counter() - began
        for name in ("tokens", "answers", "too_long"):
            totals[name] += counts[name]
        totals["seconds"] += last_seconds
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        write_file(partial / _part(k), lambda f: f.write(lines.encode("utf-8")))
        write_file(stats_path, lambda f: f.write(json.dumps(totals).encode()))
        if progress is not None:
            progress(min((k + 1) * batch_size, len(conversations)), len(conversations), int(totals["tokens"]))
    parts = [partial / _part(k) for k in range(finished) if (partial / _part(k)).is_file()]
    check(parts, "the time budget ran out before one batch was answered")

    def concat(f) -> None:
        for p in parts:
            f.write(p.read_bytes())

    write_file(partial / ANSWERS_FILE, concat)
    written = sum(1 for p in parts for line in p.open(encoding="utf-8") if line.strip())
    meta = {**settings, "written": written, "batches_done": len(parts), **totals,
            "tokens_per_second": totals["tokens"] / max(totals["seconds"], 1e-9)}
    write_file(partial / META_FILE, lambda f: f.write((json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()))
    for p in [*parts, partial / BUILD_FILE, stats_path]:
        p.unlink(missing_ok=True)
    mark_dir(partial, ANSWERS_KIND)
    replace_dir(partial, out)
    meta["wall_seconds"] = time.perf_counter() - t0
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
