"""Scoring drafters as EAGLE-3 does (Li et al., 2025): batch 1, every benchmark prompt decoded
plainly and by each drafter, interleaved, at temperatures 0 and 1; reported per category and
overall as the acceptance length tau, the per-position acceptance, tokens/s and the speed-up
over plain decoding. `evaluate` returns the numbers and writes nothing.

- `acceptance_length`: tau, emitted tokens per target call (the bonus token included).
- `Score` / `score`: tau and per-position acceptance summed over many calls.
- `conversation_turns`: each turn's prompt ids through the chat template, MT-Bench's second turn
  asked after the target's own answer to the first, so every drafter sees the same context.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specdec_models.decode import GREEDY, DecodeStats, Drafter, SamplingConfig, generate
from specdec_models.errors import check

from .benchmarks import BenchPrompt

PLAIN = "plain"
OVERALL = "overall"
# end-of-turn tokens of the common chat templates (ChatML, Llama 3, Gemma); the first one the
# tokenizer knows stops an answer, else its eos_token
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")


def acceptance_length(emitted_tokens: int, target_calls: int) -> float:
    """tau: emitted tokens per target forward pass, the bonus (or correction) token of every
    verify call included. As specdec's `DecodeStats.target_calls` counts, the prefill that emits
    the first token is a target call too, so plain decoding (one token per call) has tau = 1.0
    and a round that accepts k of gamma drafted tokens adds k + 1 tokens for one call."""
    check(target_calls >= 1, f"target_calls must be >= 1, got {target_calls}")
    check(0 <= emitted_tokens, f"emitted_tokens must be >= 0, got {emitted_tokens}")
    return emitted_tokens / target_calls


@dataclass
class Score:
    """One method's totals over many generate calls. Rates are ratios of sums (all tokens / all
    calls, all accepted at position k / all rounds that drafted k): a mean of per-prompt ratios
    would weigh a 5-token answer like a 500-token one and bias tau towards short answers."""

    tokens: int = 0
    target_calls: int = 0
    seconds: float = 0.0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    mismatches: int = 0

    def add(self, stats: DecodeStats, seconds: float) -> None:
        self.tokens += stats.new_tokens
        self.target_calls += stats.target_calls
        self.seconds += seconds
        for name in ("accepted_at", "drafted_at"):
            mine, theirs = getattr(self, name), getattr(stats, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, c in enumerate(theirs):
                mine[i] += c

    @property
    def tau(self) -> float:
        return acceptance_length(self.tokens, self.target_calls)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / max(d, 1) for a, d in zip(self.accepted_at, self.drafted_at, strict=False)]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def score(stats: Sequence[DecodeStats]) -> Score:
    """tau and per-position acceptance of several calls, summed (`Score`)."""
    out = Score()
    for s in stats:
        out.add(s, s.wall_seconds)
    return out


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an answer: the chat template's end-of-turn token when the tokenizer
    knows one of `END_OF_TURN`, else its eos_token_id."""
    vocab = tokenizer.get_vocab()
    for t in END_OF_TURN:
        if t in vocab:
            return vocab[t]
    check(tokenizer.eos_token_id is not None, "the tokenizer has neither an end-of-turn nor an eos token")
    return tokenizer.eos_token_id


def _ids(tokenizer, messages: list[dict], chat_template_kwargs: Mapping | None) -> Tensor:
    # render then tokenize: apply_chat_template(tokenize=True) returns a list or a BatchEncoding
    # depending on the transformers version; the template already holds any special tokens
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **dict(chat_template_kwargs or {}))
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def conversation_turns(tokenizer, prompt: BenchPrompt, answer_fn: Callable[[Tensor], Tensor],
                       chat_template_kwargs: Mapping | None = None) -> list[Tensor]:
    """One 1-D LongTensor of prompt ids per user turn of `prompt`, through the tokenizer's chat
    template with the generation prompt (and `chat_template_kwargs`, e.g. Qwen3's
    `enable_thinking`). Turn k + 1's context holds the earlier turns and the
    answer `answer_fn(turn k ids)` gives (1-D new token ids, e.g. the target's own greedy answer),
    decoded without special tokens (so its end-of-turn token is the template's, not doubled).
    answer_fn is not called after the last turn."""
    check(tokenizer.chat_template is not None, "the tokenizer has no chat template")
    messages, out = [], []
    for k, turn in enumerate(prompt.turns):
        messages.append({"role": "user", "content": turn})
        out.append(_ids(tokenizer, messages, chat_template_kwargs))
        if k + 1 < len(prompt.turns):
            answer = tokenizer.decode(answer_fn(out[-1]).tolist(), skip_special_tokens=True).strip()
            messages.append({"role": "assistant", "content": answer})
    return out


def _sampling(temperature: float) -> SamplingConfig:
    return GREEDY if temperature == 0 else SamplingConfig(temperature=temperature)


def _timed(target, ids: Tensor, max_new_tokens: int, drafter, sampling, eos_id, generator, gamma=5,
           vocab_size=None):
    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    tokens, stats = generate(target, [ids], max_new_tokens, drafter, sampling=sampling, eos_id=eos_id,
                             generator=generator, gamma=gamma, vocab_size=vocab_size)
    sync()
    return tokens[0], stats, time.perf_counter() - t0


@dataclass(frozen=True)
class EvalOptions:
    """`evaluate`'s keyword options: chains of `gamma`, a Hugging Face target's logits sliced to
    `vocab_size`, greedy mismatches refused (`strict`) or counted, `progress(line)` told the pace."""

    gamma: int = 5
    vocab_size: int | None = None
    strict: bool = True
    progress: Callable[[str], None] | None = None


def evaluate(target, tokenizer, drafters: Mapping[str, Drafter | None], prompts: Sequence[BenchPrompt],
             temperatures: Sequence[float] = (0.0, 1.0), max_new_tokens: int = 256, seed: int = 0,
             chat_template_kwargs: Mapping | None = None, **options: Any) -> dict:
    """Score each drafter in `drafters` (name -> a Drafter; None decodes plainly, as a control)
    against plain decoding of `target` on `prompts`, batch 1; `options`: the fields of `EvalOptions`.

    Each prompt's turns come from `conversation_turns` with the target's greedy answer (stopped at
    `end_of_turn_id`), built once and shared by every method and temperature. For every
    temperature, prompt and turn, plain decoding and each drafter run one after the other, the
    order rotated by one per prompt so no method always runs first (warm caches, clocks); each
    call's generator is seeded with (seed, prompt index, turn), the same for every method.
    Answers stop at the end-of-turn token or after `max_new_tokens`; chains draft `gamma` tokens
    a round and `vocab_size` slices a Hugging Face target's logits (`generate`). At temperature 0
    every drafter's tokens must equal plain decoding's: with `strict` a mismatch raises
    `SpecdecError` naming the drafter, prompt and turn; run the target in fp32 for that check,
    since in bf16 a verify call's logits may differ from a one-token step's in the last bit and
    flip a near tie, so there `strict=False` counts the turns that differ instead
    (`greedy_mismatches`, at temperature 0 only). `progress(line)`, when given, hears one line
    per prompt whose second-turn context is built and per prompt and turn decoded by every
    method, with the seconds elapsed.

    Returns {temperature: {category or "overall": {method: metrics}}}, the methods being "plain"
    and the drafters' names, metrics a dict of tau, per_position_acceptance, tokens,
    target_calls, seconds, tokens_per_second, speedup (and greedy_mismatches at temperature 0):
    the method's tokens/s over plain's tokens/s on the same prompts (sums of tokens over sums of
    seconds; at temperature 0 the tokens are the same, so it is plain's seconds over the method's)."""
    o = EvalOptions(**options)
    gamma, vocab_size, strict, progress = o.gamma, o.vocab_size, o.strict, o.progress
    check(PLAIN not in drafters, f"{PLAIN!r} names plain decoding; give the drafter another name")
    check(len(prompts) > 0, "no prompts to evaluate")
    eos_id = end_of_turn_id(tokenizer)
    device = next(target.parameters()).device
    start = time.perf_counter()

    def tell(line: str) -> None:
        if progress is not None:
            progress(f"{line} ({time.perf_counter() - start:.0f} s)")

    def greedy_answer(ids: Tensor) -> Tensor:
        tokens, _ = generate(target, [ids.to(device)], max_new_tokens, sampling=GREEDY, eos_id=eos_id,
                             vocab_size=vocab_size)
        return tokens[0][tokens[0] != eos_id].cpu()

    turns = []
    for i, p in enumerate(prompts):
        turns.append([t.to(device) for t in conversation_turns(tokenizer, p, greedy_answer, chat_template_kwargs)])
        if len(p.turns) > 1:
            tell(f"context: prompt {i + 1} of {len(prompts)}, turn 2 after the target's own answer")
    methods = [PLAIN, *drafters]
    out = {}
    for temperature in temperatures:
        sampling = _sampling(temperature)
        scores: dict[str, dict[str, Score]] = {}
        for i, (prompt, ids_per_turn) in enumerate(zip(prompts, turns, strict=True)):
            order = methods[i % len(methods):] + methods[:i % len(methods)]
            for k, ids in enumerate(ids_per_turn):
                emitted = {}
                for name in order:
                    g = torch.Generator(device=ids.device).manual_seed(seed * 1_000_003 + i * 101 + k)
                    tokens, stats, seconds = _timed(target, ids, max_new_tokens, drafters.get(name), sampling,
                                                    eos_id, g, gamma, vocab_size)
                    emitted[name] = tokens
                    for group in (prompt.category, OVERALL):
                        scores.setdefault(group, {}).setdefault(name, Score()).add(stats, seconds)
                if temperature == 0:
                    for name in drafters:
                        if torch.equal(emitted[name].cpu(), emitted[PLAIN].cpu()):
                            continue
                        check(not strict, f"drafter {name} changed the greedy output of prompt {prompt.id} "
                                          f"turn {k + 1}: speculative decoding must be lossless")
                        for group in (prompt.category, OVERALL):
                            scores[group][name].mismatches += 1
                tell(f"T={temperature:g}: prompt {i + 1} of {len(prompts)} turn {k + 1} of {len(ids_per_turn)} "
                     f"decoded by {len(methods)} methods")
        out[temperature] = {group: _metrics(by_method, temperature == 0) for group, by_method in scores.items()}
    return out


def _metrics(by_method: dict[str, Score], greedy: bool) -> dict[str, dict]:
    plain = by_method[PLAIN].tokens_per_second
    return {name: {"tau": s.tau, "per_position_acceptance": s.per_position_acceptance, "tokens": s.tokens,
                   "target_calls": s.target_calls, "seconds": s.seconds,
                   "tokens_per_second": s.tokens_per_second, "speedup": s.tokens_per_second / max(plain, 1e-9),
                   **({"greedy_mismatches": s.mismatches} if greedy else {})}
            for name, s in by_method.items()}
