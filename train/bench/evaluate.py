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
    turns: int = 0

    def add(self, stats: DecodeStats, seconds: float) -> None:
        """Add one generate call's stats. A call on b rows counts each target pass once per row
        still decoding (`DecodeStats.row_calls`, the same as target_calls at batch 1), so tau is
        tokens per row's target call whatever the batch; `turns` counts the rows (prompt turns)."""
        self.tokens += stats.new_tokens
        self.target_calls += stats.row_calls if (stats.batch or 1) > 1 else stats.target_calls
        self.seconds += seconds
        self.turns += stats.batch or 1
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


def conversations(tokenizer, prompts: Sequence[BenchPrompt],
                  answers: Callable[[list[Tensor]], list[Tensor]],
                  chat_template_kwargs: Mapping | None = None) -> list[list[Tensor]]:
    """`conversation_turns` of every prompt, the answers asked for many prompts at once:
    `answers(ids)` takes the turn-k ids of every prompt that has a turn k + 1 and returns one 1-D
    answer each (e.g. the target's batched greedy decoding: `contexts`)."""
    check(tokenizer.chat_template is not None, "the tokenizer has no chat template")
    messages: list[list[dict]] = [[] for _ in prompts]
    out: list[list[Tensor]] = [[] for _ in prompts]
    for k in range(max((len(p.turns) for p in prompts), default=0)):
        asking = [i for i, p in enumerate(prompts) if k < len(p.turns)]
        for i in asking:
            messages[i].append({"role": "user", "content": prompts[i].turns[k]})
            out[i].append(_ids(tokenizer, messages[i], chat_template_kwargs))
        answering = [i for i in asking if k + 1 < len(prompts[i].turns)]
        if answering:
            for i, answer in zip(answering, answers([out[i][-1] for i in answering]), strict=True):
                text = tokenizer.decode(answer.tolist(), skip_special_tokens=True).strip()
                messages[i].append({"role": "assistant", "content": text})
    return out


def conversation_turns(tokenizer, prompt: BenchPrompt, answer_fn: Callable[[Tensor], Tensor],
                       chat_template_kwargs: Mapping | None = None) -> list[Tensor]:
    """One 1-D LongTensor of prompt ids per user turn of `prompt`, through the tokenizer's chat
    template with the generation prompt (and `chat_template_kwargs`, e.g. Qwen3's
    `enable_thinking`). Turn k + 1's context holds the earlier turns and the
    answer `answer_fn(turn k ids)` gives (1-D new token ids, e.g. the target's own greedy answer),
    decoded without special tokens (so its end-of-turn token is the template's, not doubled).
    answer_fn is not called after the last turn."""
    return conversations(tokenizer, [prompt], lambda ids: [answer_fn(x) for x in ids], chat_template_kwargs)[0]


@dataclass(frozen=True)
class EvalOptions:
    """The keyword options of `evaluate`, `acceptance` and `contexts`: chains of `gamma`, a Hugging
    Face target's logits sliced to `vocab_size`, greedy mismatches refused (`strict`) or counted,
    `progress(line)` told the pace, `batch` rows per `generate` call where rows share a call (the
    target's greedy answers that build second turns, `acceptance`'s chains), `turns`: each
    prompt's turns already built (`contexts`), else they are built here, and `decoded`: a dict
    that `evaluate` fills with each drafter's `DecodeStats` per (temperature, drafter, prompt id,
    turn) and in which `acceptance` finds the turns it need not decode again; `gammas`: {drafter
    name: its chain's length} for the drafters whose chain is not `gamma` long (a block head's,
    capped at its block)."""

    gamma: int = 5
    gammas: Mapping[str, int] | None = None
    vocab_size: int | None = None
    strict: bool = True
    progress: Callable[[str], None] | None = None
    batch: int = 16
    turns: Sequence[Sequence[Tensor]] | None = None
    decoded: dict | None = None

    def gamma_of(self, name: str) -> int:
        """The chain length drafter `name` drafts (`gammas`, else `gamma`)."""
        return (self.gammas or {}).get(name, self.gamma)


class _Pace:
    """`progress(line)` with the seconds since this pace began, when a progress is given."""

    def __init__(self, progress: Callable[[str], None] | None) -> None:
        self.progress, self.start = progress, time.perf_counter()

    def __call__(self, line: str) -> None:
        if self.progress is not None:
            self.progress(f"{line} ({time.perf_counter() - self.start:.0f} s)")


def contexts(target, tokenizer, prompts: Sequence[BenchPrompt], max_new_tokens: int = 256,
             chat_template_kwargs: Mapping | None = None, **options: Any) -> list[list[Tensor]]:
    """Each prompt's turn ids (`conversations`) on the target's device, a later turn asked after
    the target's greedy answer to the one before (stopped at `end_of_turn_id` or after
    `max_new_tokens`), those answers decoded plainly `batch` prompts per `generate` call, no
    drafter. Built once, they are shared by every drafter and temperature. A batched greedy answer
    may differ from a batch-1 one where two logits tie to the last bit (padding changes the
    reduction order); it is context, the same for every method, so no figure is biased by it.
    `progress` hears one line per prompt whose later turns are built. `options`: `EvalOptions`."""
    o = EvalOptions(**options)
    check(o.batch >= 1, f"batch must be >= 1, got {o.batch}")
    eos_id = end_of_turn_id(tokenizer)
    device = next(target.parameters()).device
    tell = _Pace(o.progress)

    def greedy_answers(ids: list[Tensor]) -> list[Tensor]:
        out = []
        for start in range(0, len(ids), o.batch):
            rows = [x.to(device) for x in ids[start:start + o.batch]]
            tokens, _ = generate(target, rows, max_new_tokens, sampling=GREEDY, eos_id=eos_id, vocab_size=o.vocab_size)
            out += [t[t != eos_id].cpu() for t in tokens]
        return out

    turns = conversations(tokenizer, prompts, greedy_answers, chat_template_kwargs)
    for i, p in enumerate(prompts):
        if len(p.turns) > 1:
            tell(f"context: prompt {i + 1} of {len(prompts)}, turn 2 after the target's own answer")
    return [[t.to(device) for t in per_prompt] for per_prompt in turns]


def _sampling(temperature: float) -> SamplingConfig:
    return GREEDY if temperature == 0 else SamplingConfig(temperature=temperature)


def _seed(seed: int, prompt: int, turn: int) -> int:
    """The generator seed of prompt `prompt`'s turn `turn`, the same for every method."""
    return seed * 1_000_003 + prompt * 101 + turn


def _timed(target, ids: Tensor, max_new_tokens: int, drafter, sampling, eos_id, generator, gamma=5,
           vocab_size=None):
    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    tokens, stats = generate(target, [ids], max_new_tokens, drafter, sampling=sampling, eos_id=eos_id,
                             generator=generator, gamma=gamma, vocab_size=vocab_size)
    sync()
    return tokens[0], stats, time.perf_counter() - t0


def evaluate(target, tokenizer, drafters: Mapping[str, Drafter | None], prompts: Sequence[BenchPrompt],
             temperatures: Sequence[float] = (0.0, 1.0), max_new_tokens: int = 256, seed: int = 0,
             chat_template_kwargs: Mapping | None = None, **options: Any) -> dict:
    """The speed part: each drafter in `drafters` (name -> a Drafter; None decodes plainly, as a
    control) against plain decoding of `target` on `prompts`, batch 1; `options`: the fields of
    `EvalOptions`.

    Each prompt's turns come from `options["turns"]` or `contexts` (the target's greedy answers),
    built once and shared by every method and temperature. For every
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
    target_calls, seconds, tokens_per_second, speedup, turns (and greedy_mismatches at
    temperature 0): the method's tokens/s over plain's tokens/s on the same prompts (sums of
    tokens over sums of seconds; at temperature 0 the tokens are the same, so it is plain's
    seconds over the method's)."""
    o = EvalOptions(**options)
    check(PLAIN not in drafters, f"{PLAIN!r} names plain decoding; give the drafter another name")
    check(len(prompts) > 0, "no prompts to evaluate")
    eos_id = end_of_turn_id(tokenizer)
    tell = _Pace(o.progress)
    turns = o.turns if o.turns is not None else contexts(target, tokenizer, prompts, max_new_tokens,
                                                         chat_template_kwargs, **{**options, "turns": None})
    check(len(turns) == len(prompts), f"{len(turns)} prompts' turns for {len(prompts)} prompts")
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
                    g = torch.Generator(device=ids.device).manual_seed(_seed(seed, i, k))
                    tokens, stats, seconds = _timed(target, ids, max_new_tokens, drafters.get(name), sampling,
                                                    eos_id, g, o.gamma_of(name), o.vocab_size)
                    emitted[name] = tokens
                    if o.decoded is not None and name != PLAIN:
                        o.decoded[temperature, name, prompt.id, k] = stats
                    for group in (prompt.category, OVERALL):
                        scores.setdefault(group, {}).setdefault(name, Score()).add(stats, seconds)
                if temperature == 0:
                    _check_greedy(emitted, drafters, scores, prompt, k, o.strict)
                tell(f"T={temperature:g}: prompt {i + 1} of {len(prompts)} turn {k + 1} of {len(ids_per_turn)} "
                     f"decoded by {len(methods)} methods")
        out[temperature] = {group: _metrics(by_method, temperature == 0) for group, by_method in scores.items()}
    return out


def _check_greedy(emitted: dict[str, Tensor], drafters, scores: dict[str, dict[str, Score]], prompt: BenchPrompt,
                  turn: int, strict: bool) -> None:
    """Every drafter's greedy tokens of one turn against plain decoding's: raise (`strict`) or count."""
    for name in drafters:
        if torch.equal(emitted[name].cpu(), emitted[PLAIN].cpu()):
            continue
        check(not strict, f"drafter {name} changed the greedy output of prompt {prompt.id} "
                          f"turn {turn + 1}: speculative decoding must be lossless")
        for group in (prompt.category, OVERALL):
            scores[group][name].mismatches += 1


def _metrics(by_method: dict[str, Score], greedy: bool) -> dict[str, dict]:
    plain = by_method[PLAIN].tokens_per_second
    return {name: {"tau": s.tau, "per_position_acceptance": s.per_position_acceptance, "tokens": s.tokens,
                   "target_calls": s.target_calls, "seconds": s.seconds, "turns": s.turns,
                   "tokens_per_second": s.tokens_per_second, "speedup": s.tokens_per_second / max(plain, 1e-9),
                   **({"greedy_mismatches": s.mismatches} if greedy else {})}
            for name, s in by_method.items()}


def _calls(prompts: Sequence[BenchPrompt], turns: Sequence[Sequence[Tensor]], rows: int, done: Callable):
    """The acceptance part's generate calls: [(category, [(prompt index, turn, ids), ...])], at most
    `rows` turns each, never two categories in one call (a call's stats cover all its rows); the
    turns `done(prompt, turn)` left out."""
    by_category: dict[str, list] = {}
    for i, (prompt, ids_per_turn) in enumerate(zip(prompts, turns, strict=True)):
        by_category.setdefault(prompt.category, []).extend((i, k, ids) for k, ids in enumerate(ids_per_turn)
                                                           if not done(prompt, k))
    return [(category, items[start:start + rows]) for category, items in by_category.items()
            for start in range(0, len(items), rows)]


@dataclass
class _Acceptance:
    """`acceptance`'s shared inputs; `score` decodes one drafter at one temperature."""

    target: Any
    prompts: Sequence[BenchPrompt]
    turns: Sequence[Sequence[Tensor]]
    max_new_tokens: int
    seed: int
    eos_id: int
    o: EvalOptions
    tell: _Pace

    def score(self, name: str, drafter: Drafter, temperature: float) -> dict[str, Score]:
        """{category or "overall": Score} of `drafter` on every turn: the turns the speed part
        decoded (`o.decoded`) counted from there, the rest decoded here."""
        decoded, scores = self.o.decoded or {}, {}

        def add(category: str, stats: DecodeStats) -> None:
            for group in (category, OVERALL):
                scores.setdefault(group, Score()).add(stats, 0.0)

        def known(prompt: BenchPrompt, k: int) -> DecodeStats | None:
            return decoded.get((temperature, name, prompt.id, k))

        for prompt, ids_per_turn in zip(self.prompts, self.turns, strict=True):
            for k in range(len(ids_per_turn)):
                if known(prompt, k) is not None:
                    add(prompt.category, known(prompt, k))
        gamma = self.o.gamma_of(name)
        rows = self.o.batch if drafter.plan(gamma).rows is None else 1
        calls = _calls(self.prompts, self.turns, rows, lambda p, k: known(p, k) is not None)
        done, total = 0, sum(len(items) for _, items in calls)
        for category, items in calls:
            i, k, ids = items[0]
            g = torch.Generator(device=ids.device).manual_seed(_seed(self.seed, i, k))
            _, stats = generate(self.target, [x for _, _, x in items], self.max_new_tokens, drafter,
                                sampling=_sampling(temperature), eos_id=self.eos_id, generator=g, gamma=gamma,
                                vocab_size=self.o.vocab_size)
            add(category, stats)
            done += len(items)
            self.tell(f"acceptance T={temperature:g}: {name} decoded {done} of {total} turns")
        return scores


def acceptance(target, tokenizer, drafters: Mapping[str, Drafter], prompts: Sequence[BenchPrompt],
               temperatures: Sequence[float] = (0.0, 1.0), max_new_tokens: int = 256, seed: int = 0,
               chat_template_kwargs: Mapping | None = None, **options: Any) -> dict:
    """The acceptance part: tau and per-position acceptance of each drafter on every prompt and
    turn, no plain decoding and no timing (tau counts tokens and target calls, not seconds);
    `options`: the fields of `EvalOptions` (`strict` unused: no plain output to compare with).

    A drafter whose `Plan.rows` is None (a chain: `HeadDrafter`, `DraftModel`) decodes up to
    `batch` turns of one category per `generate` call, each call's generator seeded with its first
    turn's (seed, prompt index, turn); a tree or prompt lookup (`Plan.rows` 1) decodes one turn
    per call with that turn's seed. At T=0 batching changes nothing but where two logits tie to
    the last bit (padding changes the reduction order). At T=1 a call's rows draw from one shared
    generator, so a turn's draws depend on the rows beside it: the same distribution, other
    samples than batch 1's. Each turn's ids come from `options["turns"]` or `contexts`. A turn
    found in `options["decoded"]` (the speed part's batch-1 decoding of the same turn by the same
    drafter) is counted from there, not decoded again.

    Returns {temperature: {category or "overall": {drafter: metrics}}}, metrics a dict of tau,
    per_position_acceptance, tokens, target_calls (each row's share of the batched calls) and
    turns (the prompt turns decoded). `progress` hears one line per generate call."""
    o = EvalOptions(**options)
    check(PLAIN not in drafters, f"{PLAIN!r} names plain decoding; give the drafter another name")
    check(all(d is not None for d in drafters.values()), "the acceptance part scores drafters only: no None")
    check(len(prompts) > 0, "no prompts to evaluate")
    check(o.batch >= 1, f"batch must be >= 1, got {o.batch}")
    tell = _Pace(o.progress)
    turns = o.turns if o.turns is not None else contexts(target, tokenizer, prompts, max_new_tokens,
                                                         chat_template_kwargs, **{**options, "turns": None})
    check(len(turns) == len(prompts), f"{len(turns)} prompts' turns for {len(prompts)} prompts")
    part = _Acceptance(target, prompts, turns, max_new_tokens, seed, end_of_turn_id(tokenizer), o, tell)
    out = {}
    for temperature in temperatures:
        by_group: dict[str, dict[str, dict]] = {}
        for name, drafter in drafters.items():
            for group, s in part.score(name, drafter, temperature).items():
                by_group.setdefault(group, {})[name] = {
                    "tau": s.tau, "per_position_acceptance": s.per_position_acceptance, "tokens": s.tokens,
                    "target_calls": s.target_calls, "turns": s.turns}
        out[temperature] = by_group
    return out
