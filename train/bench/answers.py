"""The two in-process answering paths raced on the same ShareGPT conversations (`scripts/bench_answers.py`).

The first path ("simple": `chat_answers.answer_batch`, turn k of a batch of `slots` conversations
together, each turn's context prefilled whole) and the engine ("batched": `answer_engine`,
continuous batching over `slots` rows, each conversation's KV cache kept from turn to turn) answer
the same conversations greedily, as the recipe's answers step does (its seq_len and
max_new_tokens), in one process: the paths alternate round by round (ABBA), after an untimed
warm-up of each, so the load on the machine hits both alike. Greedy answers must be the same
(fp32 is the contract; in bf16 a near-tie may round either way); tokens per second are answer
tokens generated (stop tokens included) over the seconds of each path's runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec_models.errors import check

PATHS = ("simple", "batched")


@dataclass(frozen=True)
class AnswersBench:
    """What to race: `conversations` ShareGPT conversations of at least one answer, the target
    (a model directory or GGUF file) in `dtype`, rows of `seq_len` + 1 tokens, answers of at most
    `max_new_tokens`, `slots` rows decoded together (the engine's slots, the first path's chunk),
    `batch` conversations per batch of the first path (None: `slots`), `rounds` timed runs of each
    path."""
    target: str
    conversations: int = 64
    max_new_tokens: int = 256
    seq_len: int = 512
    slots: int = 64
    rounds: int = 1
    dtype: str = "float32"
    batch: int | None = None

    def check(self) -> None:
        for name in ("conversations", "max_new_tokens", "seq_len", "slots", "rounds"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, f"--{name.replace('_', '-')} must be a positive integer, "
                                                         f"got {value!r}")
        check(self.batch is None or (isinstance(self.batch, int) and self.batch >= 1),
              f"--batch must be a positive integer, got {self.batch!r}")
        check(self.dtype in ("auto", "float32", "bfloat16"), f"--dtype must be auto, float32 or bfloat16, got "
                                                             f"{self.dtype!r}")


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


def differences(a: Sequence[dict], b: Sequence[dict]) -> list[str]:
    """The ids of conversations whose records differ (or that only one side answered)."""
    left, right = {r["id"]: r for r in a}, {r["id"]: r for r in b}
    return sorted(i for i in left.keys() | right.keys() if left.get(i) != right.get(i))


def run(bench: AnswersBench, say: Callable[[str], Any] = print) -> dict[str, Any]:
    """Race the paths (module docstring); `say` hears each line, `speed-up X.XXx` last. Returns
    {"tokens_per_second": {path: ...}, "speed_up", "identical", "differ": ids, "conversations"}."""
    from specdec_models.cpu import resolve_dtype
    from train.data.chat_answers import Answerer, load_answerer

    bench.check()
    convs = sharegpt_conversations(bench.conversations)
    dtype = resolve_dtype(bench.dtype)
    answerer, _ = load_answerer(bench.target, seq_len=bench.seq_len, max_new_tokens=bench.max_new_tokens,
                                dtype=dtype, chunk=bench.slots)
    batch = bench.batch or bench.slots
    say(f"{len(convs)} ShareGPT conversations ({sum(len(c.turns) for c in convs)} turns), seq_len {bench.seq_len}, "
        f"max_new_tokens {bench.max_new_tokens}, {bench.slots} slots (the first path: batches of {batch}), {dtype}, "
        f"{torch.get_num_threads()} threads")
    warm = Answerer(answerer.decoder, answerer.tokenizer, answerer.eos_id, bench.seq_len, 4, bench.slots)  # untimed
    for path in PATHS:
        answer_with(path, warm, convs[:2], batch)
    seconds, tokens, records = dict.fromkeys(PATHS, 0.0), dict.fromkeys(PATHS, 0), {}
    for r in range(bench.rounds):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            began = time.perf_counter()
            records[path], generated = answer_with(path, answerer, convs, batch)
            seconds[path] += time.perf_counter() - began
            tokens[path] += generated
    rates = {path: tokens[path] / max(seconds[path], 1e-9) for path in PATHS}
    for path, name in zip(PATHS, ("first path (simple)", "engine (batched)"), strict=True):
        say(f"{name}: {tokens[path]:,} tokens in {seconds[path]:.1f} s, {rates[path]:,.1f} tokens/s")
    differ = differences(records["simple"], records["batched"])
    listed = f" (differ: {', '.join(differ)})" if differ else ""
    say(f"greedy answers identical: {len(convs) - len(differ)}/{len(convs)} conversations{listed}")
    speed_up = rates["batched"] / max(rates["simple"], 1e-9)
    say(f"speed-up {speed_up:.2f}x")
    return {"tokens_per_second": rates, "speed_up": speed_up, "identical": not differ, "differ": differ,
            "conversations": len(convs)}
