"""Which precision trains an eagle3 head faster on this machine: its training step timed per
precision, interleaved, on the rows of a hidden-state cache.

    specdec bench train --eagle3-step CACHE --draft-vocab COUNTS.json --threads 1

One copy of the head per precision (`32-true`, `bf16-mixed`), all starting from the same weights,
each trained with its own AdamW on the same batches; a round steps every copy once on the round's
batch, in an order that alternates between rounds (A B, B A, ...), so load on a shared machine
hits each precision alike. A step is what `task=hf_eagle3` runs: the training-time-test loss
(`Eagle3Head.ttt_loss`, 4 unrolled steps by default) forward and backward, then AdamW; bf16-mixed
runs the forward under `torch.autocast("cpu", torch.bfloat16)`, as Lightning's bf16-mixed does on
a CPU, the weights fp32. The target runs in the dtype the SmolLM2 experiments give it
(`fast_dtype`); it only supplies the embedding and the KL's rows of its LM head.

The report: seconds per step per precision (median over the timed rounds), the median over rounds
of each precision's step time over the first precision's (a paired ratio: both ran on the same
batch, back to back), the faster precision, and what `specdec_models.cpu.fast_precision("cpu")`
chooses on this machine's flags, so a host where the flag rule picks the slower one shows it.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec_models.cpu import fast_dtype, fast_precision
from specdec_models.errors import check

from ..data.embeddings_cache import cache_rows, check_cache, open_cache
from ..data.hf_embeddings import label_mask

PRECISIONS = ("32-true", "bf16-mixed")


@dataclass(frozen=True)
class Eagle3StepSettings:
    """What `bench_eagle3_step` times: `rounds` interleaved steps per precision after `warmup`
    untimed rounds, `batch_size` cache rows a step, `ttt_steps` unrolled draft steps, a draft
    vocabulary of `draft_vocab_size` tokens (None: the whole vocabulary), the fused `aux_layers`
    (None: the default [2, L//2, L-3]), AdamW at `lr`, rows drawn with `seed`."""

    precisions: tuple[str, ...] = PRECISIONS
    rounds: int = 12
    warmup: int = 1
    batch_size: int = 4
    ttt_steps: int = 4
    draft_vocab_size: int | None = 8192
    aux_layers: list[int] | None = None
    lr: float = 1e-3
    seed: int = 0


def _autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()


def bench_eagle3_step(cache: str | Path, counts: str | Path | None, *, log=print, **settings: Any) -> dict[str, Any]:
    """Time interleaved training steps per precision (module docstring) by `settings`, the fields
    of `Eagle3StepSettings`; `counts`: a specdec draft-vocab file (needed when the draft
    vocabulary is below the target's; None: the whole vocabulary); `log` hears a line per round."""
    precisions, rounds, warmup, batch_size, ttt_steps, draft_vocab_size, aux_layers, lr, seed = astuple(
        Eagle3StepSettings(**settings))
    from specdec_models.heads.eagle3 import Eagle3Config, Eagle3Head, choose_draft_vocab
    from specdec_models.hf import logits_width
    from specdec_models.hf.weights import load_model

    from ..tasks.hf_eagle3 import cached_layers, read_token_counts

    check(len(precisions) >= 1 and all(p in PRECISIONS for p in precisions) and len(set(precisions)) == len(precisions),
          f"--precisions: give distinct ones of {', '.join(PRECISIONS)}, got {list(precisions)}")
    check(rounds >= 1 and warmup >= 0 and batch_size >= 1 and ttt_steps >= 1,
          "--rounds, --batch-size and --ttt-steps must be >= 1, --warmup >= 0")
    check(draft_vocab_size is None or counts is not None,
          f"a draft vocabulary of {draft_vocab_size} tokens is chosen from token counts: give --draft-vocab "
          f"COUNTS.json "
          f"(specdec draft-vocab), or --draft-vocab-size 0 for the target's whole vocabulary")
    check(counts is None or Path(counts).expanduser().is_file(), f"--draft-vocab {counts} does not exist")
    meta = check_cache(cache)
    check(meta["model"]["kind"] == "hf", f"{cache} caches a specdec export's embeddings, not a Hugging Face target's")
    dtype = fast_dtype("cpu")
    target = load_model(meta["model"]["path"], dtype=dtype)
    model = target.model
    vocab = min(len(target.tokenizer), logits_width(model))
    size = vocab if draft_vocab_size is None else draft_vocab_size
    check(size <= vocab, f"--draft-vocab-size {size} exceeds the target's vocabulary ({vocab})")
    ids = None if size == vocab else choose_draft_vocab(read_token_counts(counts, target.tokenizer, vocab), size)
    config = Eagle3Config.for_target(model, draft_vocab_size=size, aux_layers=aux_layers, vocab_size=vocab)
    order = [int(i) for i in meta["layers"]]
    needed = [*config.aux_layers, config.target_layers]
    missing = [i for i in needed if i not in order]
    check(not missing, f"{cache} holds hidden states of layers {order}; the head needs {needed}")
    check(meta["windows"] >= batch_size, f"{cache} holds {meta['windows']} rows, fewer than --batch-size {batch_size}")
    torch.manual_seed(seed)
    start = Eagle3Head(config, model, ids).float()
    heads = {p: copy.deepcopy(start) for p in precisions}
    optims = {p: torch.optim.AdamW([w for w in heads[p].parameters() if w.requires_grad], lr=lr) for p in precisions}
    dataset = open_cache(cache, meta)
    rng = np.random.default_rng(seed)

    def batch() -> tuple[torch.Tensor, ...]:
        rows = cache_rows(dataset, np.sort(rng.choice(meta["windows"], batch_size, replace=False)), meta)
        aux, last = cached_layers(rows["embeds"], order, config.aux_layers, config.target_layers)
        return rows["tokens"], aux, last, label_mask(rows, rows["embeds"].shape[1])

    def step(precision: str, inputs: tuple[torch.Tensor, ...]) -> float:
        t0 = time.perf_counter()
        with _autocast(precision):
            out = heads[precision].ttt_loss(*inputs, steps=ttt_steps)
        out.loss.backward()
        optims[precision].step()
        optims[precision].zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        check(bool(torch.isfinite(out.loss)), f"{precision}: the loss is not finite")
        return seconds

    times: dict[str, list[float]] = {p: [] for p in precisions}
    for r in range(warmup + rounds):
        inputs = batch()
        for p in (precisions if r % 2 == 0 else precisions[::-1]):
            seconds = step(p, inputs)
            if r >= warmup:
                times[p].append(seconds)
        if r >= warmup:
            log(f"round {r - warmup + 1}/{rounds}: " + ", ".join(f"{p} {times[p][-1]:.2f} s" for p in precisions))
    first = precisions[0]
    rows = [{"precision": p, "median_seconds": statistics.median(times[p]), "seconds": times[p],
             f"median_ratio_over_{first}": statistics.median(
                 a / b for a, b in zip(times[p], times[first], strict=True))}
            for p in precisions]
    fastest = min(rows, key=lambda row: row["median_seconds"])["precision"]
    return {"mode": "eagle3_step", "cache": str(cache), "target_dtype": str(dtype).removeprefix("torch."),
            "draft_vocab_size": size, "batch_size": batch_size, "seq_len": meta["seq_len"], "ttt_steps": ttt_steps,
            "rounds": rounds, "warmup": warmup, "threads": torch.get_num_threads(), "precisions": rows,
            "fastest": fastest, "rule": fast_precision("cpu")}


def markdown(report: dict[str, Any]) -> str:
    first = report["precisions"][0]["precision"]
    title = (f"eagle3 training step: {report['batch_size']} rows x {report['seq_len']} tokens, "
             f"{report['ttt_steps']} unrolled steps, draft vocabulary {report['draft_vocab_size']}, target in "
             f"{report['target_dtype']}, {report['threads']} thread(s), {report['rounds']} interleaved rounds")
    lines = [title, "",
             f"| precision | median s/step | median step time over {first}'s (paired) |", "|---|---:|---:|"]
    lines += [f"| {row['precision']} | {row['median_seconds']:.3f} | {row[f'median_ratio_over_{first}']:.3f} |"
              for row in report["precisions"]]
    agree = "agrees" if report["rule"] == report["fastest"] else "DISAGREES"
    lines += ["", f"faster here: {report['fastest']}; specdec_models/cpu's rule picks {report['rule']} ({agree})"]
    return "\n".join(lines)
