"""specdec's `generate` against Hugging Face's own `generate()` on the same model, timed side by side.

`compare_with_hf_generate(model, prompts, max_new_tokens)` decodes greedily with transformers'
`model.generate()` and with `specdec_models.decode.generate` (plain, or speculative with a
`drafter`), interleaved in one process (hf, ours, hf, ours, ...) after a warm-up pair, so both
see the same machine load; the speed figure is the median over pairs of the per-pair ratio of
tokens per second (ours / hf). Both emit exactly `max_new_tokens` tokens per row (no EOS), and
the result says whether every row's tokens are equal. The batch is left-padded for transformers
(its convention) and given as ragged rows to specdec.

`first_layers(model, k)`: the model's first k decoder layers with its embedding, final norm and
head, as a stand-in draft (untrained, so it measures overhead at about 1 token per call).

    python -m train.bench.hf                                  # SmolLM2-135M, batch 1, plain
    python -m train.bench.hf --draft-layers 8 --gamma 4       # with an 8-layer draft
    python -m train.bench.hf --prophet HEAD_DIR                  # a trained hf_prophet head
    python -m train.bench.hf --hf-model DIR --batch 8 --json out.json
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from specdec_models.decode import GREEDY, Drafter, DraftModel, generate
from specdec_models.errors import check
from specdec_models.hf import logits_width
from specdec_models.hf.adapter import cache_argument

PROMPTS = [
    "What is the capital of France? Explain briefly.",
    "Write a short poem about the sea.",
    "Give three tips for learning a new language.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How do I boil an egg?",
    "Name four planets of the solar system and one fact about each.",
    "What does a compiler do?",
]


def _hf_generate(model: Any, prompts: list[Tensor], n: int, pad_id: int) -> list[list[int]]:
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():], mask[i, width - p.numel():] = p, 1
    config = copy.deepcopy(model.generation_config)
    # exactly n tokens, as specdec with eos_id=None: generate() fills a None EOS from the model's
    # config, so give it an id its head cannot emit (it still runs its EOS check every step)
    config.eos_token_id = [logits_width(model)]
    config.pad_token_id = pad_id
    config.max_new_tokens, config.do_sample = n, False
    out = model.generate(ids, attention_mask=mask, generation_config=config)
    return out[:, width:].tolist()


def compare_with_hf_generate(model: Any, prompts: list[Tensor], max_new_tokens: int, drafter: Drafter | None = None,
                             *, gamma: int = 4, repeats: int = 3, pad_id: int = 0) -> dict[str, Any]:
    """Time HF greedy `generate()` and specdec's `generate` (temperature 0) interleaved; return
    {"hf": {...}, "ours": {...}, "ratio": median of per-pair (ours tokens/s) / (hf tokens/s),
    "equal": every row identical, "tokens_per_call", ...}. Seconds are per call, tokens/s count
    all rows' new tokens; repeats=0 only checks the tokens (no timing)."""
    check(isinstance(repeats, int) and repeats >= 0, f"repeats must be an integer >= 0, got {repeats!r}")
    check(len(prompts) >= 1, "give at least one prompt")
    kwargs = dict(drafter=drafter, gamma=gamma, sampling=GREEDY)

    def ours() -> tuple[list[list[int]], Any]:
        tokens, stats = generate(model, prompts, max_new_tokens, **kwargs)
        return [t.tolist() for t in tokens], stats

    def hf() -> list[list[int]]:
        with torch.no_grad():
            return _hf_generate(model, prompts, max_new_tokens, pad_id)

    ref = hf()                                      # warm-up pair, also the equality check
    got, stats = ours()
    times: dict[str, list[float]] = {"hf": [], "ours": []}
    for _ in range(repeats):
        for name, fn in (("hf", hf), ("ours", ours)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    new = len(prompts) * max_new_tokens
    result: dict[str, Any] = {
        name: {"seconds": [round(s, 4) for s in secs],
               "tokens_per_second": round(new / statistics.median(secs), 2) if secs else None}
        for name, secs in times.items()}
    ratios = [h / o for h, o in zip(times["hf"], times["ours"], strict=True)]
    result.update(
        ratio=round(statistics.median(ratios), 4) if repeats else None,
        equal=got == ref, rows_equal=[g == r for g, r in zip(got, ref, strict=True)], tokens=got,
        method=stats.method, batch=len(prompts), max_new_tokens=max_new_tokens, gamma=kwargs["gamma"],
        tokens_per_call=round(stats.tokens_per_call, 3), target_calls=stats.target_calls,
        threads=torch.get_num_threads(), load_average=[round(x, 2) for x in os.getloadavg()])
    return result


@torch.no_grad()
def call_seconds(model: Any, context: Tensor, n: int, repeats: int = 5) -> float:
    """Median seconds of one forward of n new tokens (batch as in `context` (b, c)) after a cached
    context of c tokens: transformers' own DynamicCache, contiguous, logits at every new position."""
    from transformers import DynamicCache

    cache = DynamicCache()
    kv = {cache_argument(model): cache}
    model(input_ids=context, use_cache=True, **kv)
    new = context[:, -n:]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(input_ids=new, use_cache=True, **kv)
        times.append(time.perf_counter() - t0)
        cache.crop(-n)
    return statistics.median(times)


@torch.no_grad()
def verify_costs(model: Any, context: int, sizes: list[int], repeats: int = 10,
                 seed: int = 0) -> dict[str, dict[int, float]]:
    """What a target call on n new tokens costs over a 1-token step, through specdec's own cache
    (`HFDecoder`, batch 1, after `context` random tokens): {"chain": {n: ratio}, "tree": {n:
    ratio}}, "tree" passing a 4-D mask (a chain-shaped one, so the work is the same) as tree
    drafting does. The model's layers are timed as they are: a model prepared for the CPU
    (`specdec_models.cpu.prepare_for_device`) times its few-row layers. Medians over `repeats`
    rounds, every size and mask interleaved within a round; the unit is the chain's 1-token call."""
    from specdec_models.hf import HFDecoder

    check(1 in sizes and all(isinstance(n, int) and n >= 1 for n in sizes),
          f"sizes must be integers >= 1 and include 1 (the unit), got {sizes}")
    g = torch.Generator().manual_seed(seed)
    target = HFDecoder(model)
    vocab = target.vocab_size
    ctx = torch.randint(0, vocab, (1, context), generator=g)
    kinds = ("chain", "tree")
    times: dict[tuple[str, int], list[float]] = {(kind, n): [] for n in sizes for kind in kinds}
    for _ in range(repeats):
        for (kind, n), seconds in times.items():
            cache = target.new_cache(1, context + n + 1)
            target(ctx, cache=cache)
            tokens = torch.randint(0, vocab, (1, n), generator=g)
            tree = (torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()) if kind == "tree" else None
            t0 = time.perf_counter()
            target(tokens, cache=cache, tree=tree)
            seconds.append(time.perf_counter() - t0)
    unit = statistics.median(times["chain", 1])
    return {kind: {n: round(statistics.median(times[kind, n]) / unit, 3) for n in sizes} for kind in kinds}


def plot_verify_costs(result: dict[str, Any], f) -> None:
    """A PNG of `verify_costs`' result (a dict holding its kinds, e.g. bench_hf's JSON) into the
    binary file f: a call's cost in 1-token steps against the new tokens it carries, one line per
    kind (solid: a chain's verify; dashed: through a tree's mask), the cheapest 1-token step as a dotted line."""
    from .report import pyplot

    plt = pyplot()
    kinds = {k: v for k, v in result.items() if isinstance(v, dict) and v and all(str(n).isdigit() for n in v)}
    check(bool(kinds), "no verify costs to plot")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    dtype = result.get("dtype", "")
    for name, costs in kinds.items():
        sizes = sorted(int(n) for n in costs)
        values = [costs[n] if n in costs else costs[str(n)] for n in sizes]
        ax.plot(sizes, values, marker="o", ms=3, ls="--" if name.startswith("tree") else "-", label=name)
    floor = min(c.get(1, c.get("1")) for c in kinds.values())
    ax.axhline(floor, color="grey", ls=":", lw=1, label=f"cheapest 1-token step ({floor:.2f})")
    ax.set_xlabel("new tokens in the call")
    ax.set_ylabel(f"cost in {dtype} 1-token steps".replace("  ", " "))
    ax.set_title(f"A target call's cost, {result.get('context', '?')} cached tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def model_call_floor(result: dict[str, Any], model: Any, prompts: list[Tensor], draft: Any = None) -> dict[str, Any]:
    """What the model calls of specdec's run in `result` cost alone, timed in isolation with
    transformers' contiguous cache (prefills excluded): target calls x one call of 1 (plain) or
    gamma + 1 tokens, plus gamma one-token draft calls per round. Compared with the measured run,
    the rest is specdec's own work (sampling, acceptance, cache bookkeeping, masks)."""
    b = len(prompts)
    width = min(p.numel() for p in prompts)
    context = torch.stack([p[-width:] for p in prompts])
    rounds = result["target_calls"] - 1
    gamma = result["gamma"] if draft is not None else 0
    target = call_seconds(model, context, gamma + 1)
    drafting = call_seconds(draft, context, 1) if draft is not None else 0.0
    floor = rounds * (target + gamma * drafting)
    ours = result["ours"]["seconds"]
    return {"target_call_ms": round(target * 1e3, 2), "draft_call_ms": round(drafting * 1e3, 2),
            "model_calls_seconds": round(floor, 3), "ours_over_model_calls": round(statistics.median(ours) / floor, 3),
            "rows": b}


def first_layers(model: Any, k: int) -> Any:
    """A copy of the HF causal LM `model` that keeps only its first k decoder layers (embedding,
    final norm and head included): an untrained stand-in draft on the same vocabulary."""
    layers = model.config.num_hidden_layers
    check(isinstance(k, int) and 1 <= k <= layers, f"draft layers must be in [1, {layers}], got {k!r}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = k
    for attr in ("layer_types",):            # per-layer lists must shrink with the depth
        if isinstance(getattr(config, attr, None), list):
            setattr(config, attr, getattr(config, attr)[:k])
    if "quantization_config" in vars(config):
        del config.quantization_config       # GGUF weights are dequantized on load: the copy is plain
    draft = type(model)(config).to(dtype=model.dtype)
    missing, _ = draft.load_state_dict(model.state_dict(), strict=False)
    check(not [m for m in missing if "rotary" not in m], f"the {k}-layer copy misses weights: {missing[:4]}")
    return draft.eval()


def chat_prompts(tokenizer: Any, batch: int) -> list[Tensor]:
    """`batch` chat prompts (the tokenizer's chat template, generation prompt added), cycling PROMPTS."""
    rows = []
    for i in range(batch):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                            add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, Mapping) else ids      # BatchEncoding (a UserDict) or ids
        rows.append(torch.tensor(ids, dtype=torch.long).reshape(-1))
    return rows


ASSISTED_PROMPT = "Speculative decoding: a small model drafts, the large model verifies in one pass."


def prompt_ids(path: Any, vocab: int) -> Tensor:
    """ASSISTED_PROMPT through the tokenizer in model directory `path`, or fixed random ids when
    the directory has none."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        ids = tokenizer(ASSISTED_PROMPT, return_tensors="pt").input_ids[0]
        if ids.numel() > 0:
            return ids
    except (OSError, ValueError, TypeError):
        pass
    return torch.randint(0, vocab, (16,), generator=torch.Generator().manual_seed(0))


def best_time(fn: Any, repeats: int, device: str) -> tuple[float, Any]:
    """(the best wall time of `repeats` calls of fn, the last call's result); CUDA synchronised."""
    best, result = float("inf"), None
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, result


def compare_with_assisted(target: Any, draft: Any, ids: Tensor, *, max_new_tokens: int, gamma: int, batch: int = 1,
                          vocab_size: int | str | None = None, repeats: int = 3, device: str = "cpu"
                          ) -> dict[str, dict[str, Any]]:
    """Greedy decoding of prompt `ids` (1-D) by transformers' `generate` (hf, the reference tokens),
    its assisted generation with `draft` (hf_assisted) and specdec's `generate` without and with
    the draft (specdec_base, specdec_draft), best of `repeats` each: tokens/s, whether the output
    equals the reference, specdec's tokens per call and acceptance. `batch` > 1 adds specdec rows
    at that batch (ragged prompts), which transformers cannot run assisted (specdec bench compare-hf)."""
    n = max_new_tokens
    hf_kw = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False, "pad_token_id": 0,
             "attention_mask": torch.ones_like(ids[None])}
    results = {}
    t, out = best_time(lambda: target.generate(ids[None], **hf_kw), repeats, device)
    reference = out[0, ids.numel():].tolist()
    results["hf"] = {"tokens_per_second": n / t, "equal": True}
    t, out = best_time(lambda: target.generate(ids[None], assistant_model=draft, **hf_kw), repeats, device)
    results["hf_assisted"] = {"tokens_per_second": n / t, "equal": out[0, ids.numel():].tolist() == reference}
    for name, kw in (("specdec_base", {}), ("specdec_draft", {"drafter": DraftModel(draft), "gamma": gamma})):
        t, (tokens, stats) = best_time(lambda kw=kw: generate(target, [ids], n, sampling=GREEDY,
                                                              vocab_size=vocab_size, **kw), repeats, device)
        results[name] = {"tokens_per_second": n / t, "equal": tokens[0].tolist() == reference,
                         "tokens_per_call": stats.tokens_per_call, "acceptance_rate": stats.acceptance_rate}
    if batch > 1:
        g = torch.Generator().manual_seed(1)
        rows = [ids[: int(torch.randint(4, ids.numel() + 1, (1,), generator=g))] for _ in range(batch)]
        for name, kw in (("base", {}), ("draft", {"drafter": DraftModel(draft), "gamma": gamma})):
            t, (_, stats) = best_time(lambda kw=kw: generate(target, rows, n, sampling=GREEDY,
                                                             vocab_size=vocab_size, **kw), repeats, device)
            results[f"specdec_{name}_batch{batch}"] = {"tokens_per_second": stats.new_tokens / t,
                                                        "tokens_per_call": stats.tokens_per_call}
    return results
