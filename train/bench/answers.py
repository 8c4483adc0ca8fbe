"""The two in-process answering paths raced on the same ShareGPT conversations (`specdec bench answers`).

The first path ("simple": `chat_answers.answer_batch`, turn k of a batch of `slots` conversations
together, each turn's context prefilled whole) and the engine ("batched": `answer_engine`,
continuous batching over `slots` rows, each conversation's KV cache kept from turn to turn) answer
the same conversations greedily, as the recipe's answers step does (its seq_len and
max_new_tokens), in one process: the paths alternate round by round (ABBA), after an untimed
warm-up of each, so the load on the machine hits both alike. Greedy answers must be the same
(fp32 is the contract; in bf16 a near-tie may round either way); tokens per second are answer
tokens generated (stop tokens included) over the seconds of each path's runs.

With `servers` (URLs) a third path, "server", answers the same conversations through
`served_answers.answer_from_servers` (the recipe's `--answers-server`), `in_flight` requests per
server, in the same rotation; `llama_server` starts llama.cpp's server on the target GGUF with
`slots` parallel slots for the run (`llama_server.LlamaServer`). A server may run a quantized copy
of the target (llama.cpp multiplies the GGUF's own 4-bit weights), so its greedy answers are
counted against the engine's, not required equal. While one path runs the others idle, so a
server gets the machine's cores as the in-process paths do.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec_models.errors import check

PATHS = ("simple", "batched")
SERVER = "server"
NAMES = {"simple": "first path (simple)", "batched": "engine (batched)", SERVER: "server"}


@dataclass(frozen=True)
class AnswersBench:
    """What to race: `conversations` ShareGPT conversations of at least one answer, the target
    (a model directory or GGUF file) in `dtype`, rows of `seq_len` + 1 tokens, answers of at most
    `max_new_tokens`, `slots` rows decoded together (the engine's slots, the first path's chunk),
    `batch` conversations per batch of the first path (None: `slots`), `rounds` timed runs of each
    path; `first_path` False leaves the first path out (the engine against a server alone)."""
    target: str
    conversations: int = 64
    max_new_tokens: int = 256
    seq_len: int = 512
    slots: int = 64
    rounds: int = 1
    dtype: str = "float32"
    batch: int | None = None
    servers: tuple[str, ...] = ()
    in_flight: int | None = None
    llama_server: bool = False
    first_path: bool = True

    def check(self) -> None:
        from specdec_models.cpu import parse_dtype

        for name in ("conversations", "max_new_tokens", "seq_len", "slots", "rounds"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, f"--{name.replace('_', '-')} must be a positive integer, "
                                                         f"got {value!r}")
        check(self.batch is None or (isinstance(self.batch, int) and self.batch >= 1),
              f"--batch must be a positive integer, got {self.batch!r}")
        parse_dtype(self.dtype)
        check(self.in_flight is None or (isinstance(self.in_flight, int) and self.in_flight >= 1),
              f"--in-flight must be a positive integer, got {self.in_flight!r}")
        check(not (self.servers and self.llama_server), "give --server URL or --llama-server, not both")
        check(self.first_path or self.servers or self.llama_server,
              "--no-first-path leaves the engine alone: give --server URL or --llama-server to race it against")
        check(not self.llama_server or str(self.target).endswith(".gguf"),
              f"--llama-server serves a GGUF file; the target {self.target} is not one")


def sharegpt_conversations(count: int) -> list[Any]:
    """The first `count` ShareGPT conversations (the packaged file) with at least two turns,
    deduplicated, in the file's order."""
    from train.data.conversations import prepare_conversations

    convs, _, _ = prepare_conversations("sharegpt", min_turns=2, limit=2 * count + 16)
    check(len(convs) >= count, f"the ShareGPT file gives only {len(convs)} conversations, fewer than {count}")
    return convs[:count]


def answer_with(path: str, answerer: Any, conversations: Sequence[Any], batch: int) -> tuple[list[dict], int]:
    """(records, tokens generated) of `conversations` answered greedily by one path: the first path
    `batch` conversations at a time, the engine over the answerer's `chunk` rows."""
    from train.data.answer_engine import AnswerEngine
    from train.data.chat_answers import Dialogue, answer_batch, dialogue_counts

    with torch.inference_mode():
        if path == "simple":
            records, tokens = [], 0
            for first in range(0, len(conversations), batch):
                part, counts = answer_batch(conversations[first:first + batch], answerer, temperatures=(0.0,),
                                            first=first, seed=0)
                records += part
                tokens += counts["tokens"]
            return records, tokens
        engine = AnswerEngine(answerer.decoder, answerer.tokenizer, answerer.eos_id, answerer.seq_len,
                              answerer.max_new_tokens, slots=answerer.chunk)
        done = dict(engine.run(list(enumerate(conversations)),
                               lambda c: Dialogue(c, answerer.tokenizer, answerer.seq_len), (0.0,), seed=0))
        ordered = [done[i] for i in sorted(done)]
        return [d.record for d in ordered if d.record is not None], dialogue_counts(ordered)["tokens"]


def answer_served(urls: Sequence[str], reference: Any, conversations: Sequence[Any], bench: AnswersBench,
                  out: str) -> tuple[list[dict], int, float]:
    """(records, tokens generated, seconds) of `conversations` answered greedily by the servers at
    `urls` into the answers folder `out` (`served_answers.answer_from_servers`); the seconds are
    the answering's, without the servers' check before it (a few greedy probes)."""
    import json
    from pathlib import Path

    from train.data.chat_answers import ANSWERS_FILE
    from train.data.served_answers import ServedSettings, answer_from_servers

    settings = ServedSettings(seq_len=bench.seq_len, max_new_tokens=bench.max_new_tokens, temperatures=(0.0,),
                              batch_size=len(conversations), in_flight=bench.in_flight or bench.slots)
    meta = answer_from_servers(conversations, out, list(urls), reference, settings, data={"source": "bench"})
    with open(Path(out) / ANSWERS_FILE, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records, int(meta["tokens"]), float(meta["seconds"])


def differences(a: Sequence[dict], b: Sequence[dict]) -> list[str]:
    """The ids of conversations whose records differ (or that only one side answered)."""
    left, right = {r["id"]: r for r in a}, {r["id"]: r for r in b}
    return sorted(i for i in left.keys() | right.keys() if left.get(i) != right.get(i))


def run(bench: AnswersBench, say: Callable[[str], Any] = print) -> dict[str, Any]:
    """Race the paths (module docstring); `say` hears each line, `speed-up X.XXx` last. Returns
    {"tokens_per_second": {path: ...}, "speed_up", "identical", "differ": ids, "conversations"},
    plus "server_speed_up" (the server's tokens/s over the engine's) and "server_differ" with servers."""
    import contextlib

    from specdec_models.cpu import resolve_dtype
    from train.data.chat_answers import Answerer, load_answerer

    bench.check()
    convs = sharegpt_conversations(bench.conversations)
    dtype = resolve_dtype(bench.dtype)
    answerer, identity = load_answerer(bench.target, seq_len=bench.seq_len, max_new_tokens=bench.max_new_tokens,
                                       dtype=dtype, chunk=bench.slots)
    batch = bench.batch or bench.slots
    with contextlib.ExitStack() as stack:
        urls = list(bench.servers)
        if bench.llama_server:
            from train.data.llama_server import LlamaServer

            urls = [stack.enter_context(LlamaServer(bench.target, parallel=bench.in_flight or bench.slots,
                                                    context=bench.seq_len + 1)).url]
        paths = (*(PATHS if bench.first_path else PATHS[1:]), *([SERVER] if urls else []))
        say(f"{len(convs)} ShareGPT conversations ({sum(len(c.turns) for c in convs)} turns), seq_len "
            f"{bench.seq_len}, max_new_tokens {bench.max_new_tokens}, {bench.slots} slots (the first path: batches of "
            f"{batch}), {dtype}, {torch.get_num_threads()} threads"
            + (f"; servers {', '.join(urls)}, {bench.in_flight or bench.slots} in flight each" if urls else ""))
        warm = Answerer(answerer.decoder, answerer.tokenizer, answerer.eos_id, bench.seq_len, 4, bench.slots)
        for path in paths[:-1] if urls else paths:                            # untimed
            answer_with(path, warm, convs[:2], batch)
        reference = _reference(answerer, identity) if urls else None
        seconds, tokens, records = dict.fromkeys(paths, 0.0), dict.fromkeys(paths, 0), {}
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-answers-"))
        for r in range(bench.rounds):
            for path in paths if r % 2 == 0 else paths[::-1]:
                began = time.perf_counter()
                if path == SERVER:
                    records[path], generated, took = answer_served(urls, reference, convs, bench, f"{scratch}/{r}")
                else:
                    records[path], generated = answer_with(path, answerer, convs, batch)
                    took = time.perf_counter() - began
                seconds[path] += took
                tokens[path] += generated
    return _report(paths, seconds, tokens, records, len(convs), say)


def _reference(answerer: Any, identity: dict[str, Any]) -> Any:
    """The in-process target as the `Reference` the servers are checked against."""
    from train.data.answer_server import hf_reference

    return hf_reference(answerer.decoder.model, answerer.tokenizer, answerer.eos_id, identity)


def _report(paths: Sequence[str], seconds: dict[str, float], tokens: dict[str, int], records: dict[str, list],
            conversations: int, say: Callable[[str], Any]) -> dict[str, Any]:
    rates = {path: tokens[path] / max(seconds[path], 1e-9) for path in paths}
    for path in paths:
        say(f"{NAMES[path]}: {tokens[path]:,} tokens in {seconds[path]:.1f} s, {rates[path]:,.1f} tokens/s")
    out: dict[str, Any] = {"tokens_per_second": rates, "conversations": conversations}
    if SERVER in paths:
        served = differences(records["batched"], records[SERVER])
        out["server_differ"] = served
        out["server_speed_up"] = rates[SERVER] / max(rates["batched"], 1e-9)
        say(f"server's greedy answers as the engine's: {conversations - len(served)}/{conversations} conversations "
            "(a quantized server may differ)")
        say(f"server over engine: {out['server_speed_up']:.2f}x")
    if "simple" not in paths:
        return {**out, "identical": True, "differ": []}
    differ = differences(records["simple"], records["batched"])
    listed = f" (differ: {', '.join(differ)})" if differ else ""
    say(f"greedy answers identical: {conversations - len(differ)}/{conversations} conversations{listed}")
    out["speed_up"] = rates["batched"] / max(rates["simple"], 1e-9)
    say(f"speed-up {out['speed_up']:.2f}x")
    return {**out, "identical": not differ, "differ": differ}
