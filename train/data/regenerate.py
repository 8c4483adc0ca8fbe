"""Training rows for a head of a Hugging Face target, and their cache of hidden states.

A head drafts well when it has learnt the target's own distribution, so its training text is best
written by the target itself (as Medusa's and EAGLE's self-distillation data is): `Regenerated`
reads prompts from a text or chat file (`read_prompts`), lets the target continue each one until
its end-of-turn token (`stop_token`: the chat template's, else the tokenizer's EOS) and keeps each
row as prompt + continuation up to and including that token, cut to seq_len + 1 tokens; a row that
ends sooner is padded with the stop token, and its `valid_len` column counts its real tokens.
`TextWindows` takes plain token windows of text files instead (tokenized as `data=hf_text` does).
`build_hf_cache` writes the embeddings cache of `train.data.embeddings_cache` (the one format and
writer; the hidden states of any `layers`) of either, tagged with the sha256 of the target's
weights; `task=hf_prophet` / `task=hf_eagle3` with `data=hf_embeddings` train from it.

No second read of regenerated rows. `continue_with_states` is a plain KV-cached sampling loop
(`sampling.to_probs` and `sample`, seeded per batch; greedy at temperature 0) whose target cache
keeps the hidden states of `layers` of each call's new positions (`HFKVCache.keep_layers`): the
prompts' from the right-padded prefill (rolled back to each row's length, as `generate` does),
each new token's from the call that feeds it. Those are exactly the states a teacher-forced pass
over the finished row gives (fp32: within 1e-4 relative, `tests/test_regenerate.py`), so
`Regenerated.rows` hands them to the writer, which then runs no model at all; text windows still
get one teacher-forced pass per batch. A row's last token is never fed, so its state and those of
the padding after it are zero: positions from valid_len - 1 on predict no real token, and the
eagle3 task's label mask (`prompt_len`, `valid_len`) drops them, and task=hf_prophet draws its
windows inside `valid_len` first (`ProphetHead.anchors`).

A row that ends leaves the batch at once (its cache rows too), so the long answers of a batch do
not drag finished rows through every call, and no row runs past seq_len + 1; that is also the
simplest loop (no finished row rides along). A build's batch is split by temperature, so the
recipe's `--batch-size 256` continues 128 rows per call (why 128: docs/eagle3.md).

The target is loaded from a local model directory or a GGUF file (`specdec_models.hf.weights`);
every input is checked before the weights load, the weights before any row is made.
`prompts_from_text` makes instruction prompts from snippets of any text (there is no chat dataset
on an offline machine); `specdec prompts` writes them as a chat file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from specdec_models.errors import SpecdecError, check
from specdec_models.hf import HFDecoder, logits_width, text_config
from specdec_models.hf.weights import check_source, load_causal_lm, load_config, load_tokenizer, target_identity
from specdec_models.sampling import SamplingConfig, sample, to_probs

from .embeddings_cache import (
    BuildRun,
    CacheModel,
    CacheSettings,
    RowSource,
    normalize_layers,
    open_cache,
    read_cache_meta,
    write_cache,
)

PROMPT_SUFFIXES = (".txt", ".jsonl", ".json")


def read_prompts(path: str | os.PathLike, tokenizer: Any, chat: bool) -> list[Tensor]:
    """Token ids (n,) of each prompt in a file: `.txt` (one prompt per non-empty line) or `.jsonl` /
    `.json` (records with "messages" (a list of {"role", "content"}), or "prompt" or "text").
    With `chat`, each prompt is the tokenizer's chat template with the assistant's turn opened;
    without, its plain tokens. A file that is not UTF-8 is one line with the offset of its first bad
    byte (`conversations.utf8_text`)."""
    from .conversations import utf8_text

    path = Path(path).expanduser()
    check(path.is_file(), f"prompts file {path} does not exist")
    check(path.suffix in PROMPT_SUFFIXES, f"prompts file {path}: use .txt, .jsonl or .json, got {path.suffix!r}")
    with utf8_text(path):
        text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        records: list[Any] = [line for line in text.splitlines() if line.strip()]
    else:
        if path.suffix == ".json":
            try:
                records = json.loads(text)
            except ValueError as error:
                raise SpecdecError(f"prompts file {path} is not valid JSON: {' '.join(str(error).split())}") from None
        else:
            records = []
            for number, line in enumerate(text.splitlines(), start=1):     # the file's own line numbers
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except ValueError as error:
                    # json's message counts from the line alone ("line 1 column 9"): keep only the column
                    reason = re.sub(r": line \d+ column (\d+) \(char \d+\)", r" at column \1", str(error))
                    raise SpecdecError(f"prompts file {path}, line {number} is not valid JSON: "
                                       f"{' '.join(reason.split())}") from None
    check(isinstance(records, list) and records, f"prompts file {path} holds no prompts")
    check(not chat or getattr(tokenizer, "chat_template", None), "chat prompts need a tokenizer with a chat template")
    prompts = []
    for i, record in enumerate(records):
        if isinstance(record, dict):
            messages = record.get("messages")
            content = record.get("prompt", record.get("text"))
            check(messages or isinstance(content, str),
                  f"prompts file {path}, record {i}: give 'messages', 'prompt' or 'text'")
        else:
            messages, content = None, record
        if chat:
            messages = messages or [{"role": "user", "content": content}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, Mapping) else ids         # transformers 5: a BatchEncoding
        else:
            check(messages is None, f"prompts file {path}, record {i} has chat messages: pass --chat")
            ids = tokenizer(content)["input_ids"]
        if len(ids):
            prompts.append(torch.tensor(ids, dtype=torch.long).reshape(-1))
    check(prompts, f"prompts file {path}: every prompt encodes to no tokens")
    return prompts


def stop_token(tokenizer: Any, chat: bool) -> int | None:
    """The token that ends the target's answer: with `chat`, the chat template's end-of-turn token
    (the first token after an assistant message, e.g. `<|im_end|>`) when it is a special token,
    else the tokenizer's EOS (None when it has none)."""
    eos = tokenizer.eos_token_id
    if chat and getattr(tokenizer, "chat_template", None):
        mark = "MARKER"
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}],
                                             tokenize=False)
        after = text[text.rfind(mark) + len(mark):].lstrip(" ") if mark in text else ""
        ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
        if ids and ids[0] in set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {})):
            return int(ids[0])
    return None if eos is None else int(eos)


@torch.inference_mode()
def continue_with_states(target: HFDecoder, prompts: list[Tensor], length: int, layers: Sequence[int],
                         temperature: float | Sequence[float], generator: torch.Generator | None = None,
                         eos_id: int | None = None, max_new: int | None = None
                         ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Each prompt continued by the target, KV-cached, one token per row per call, sampled at
    `temperature` with `generator` (greedy at 0, `sampling.to_probs`), up to and including
    `eos_id` (None: no stop) or up to `length` tokens in all, recording the hidden states at
    `layers` (`hidden_states` indices) of every position the target is fed: the prompt's from the
    prefill (right-padded, rolled back to each row's length, as `generate` does), each new token's
    from the call that feeds it. Returns tokens (b, length) padded after each row's end with
    eos_id (0 without one), valid (b,) each row's real tokens, and states (b, length - 1,
    len(layers) * hidden) of tokens[:, :length - 1] in the target's dtype: exactly the hidden states
    a teacher-forced pass gives at positions < valid - 1, and zero from valid - 1 on (a row's last
    token is never fed). A row that ends leaves the batch (the cache drops it too). `max_new`: a
    row also ends after that many new tokens. No `layers`: no states are kept (None), for answers
    whose states a later teacher-forced pass computes (`train.data.chat_answers`). `temperature`: one
    for every row, or one per row (rows of several temperatures in one call: a larger batch per
    call, which a CPU runs at more tokens per second)."""
    b, device = len(prompts), target.device
    lens = torch.tensor([p.numel() for p in prompts], device=device)
    width = int(lens.max())
    check(width < length, f"prompts of up to {width} tokens leave no room for an answer within {length} tokens")
    tokens = torch.full((b, length), 0 if eos_id is None else eos_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : p.numel()] = p.to(device)
    per_row = not isinstance(temperature, (int, float))
    sampling = SamplingConfig(1.0 if per_row else float(temperature))
    if per_row:
        check(len(temperature) == b, f"{len(temperature)} temperatures for {b} prompts")
        temps = torch.tensor([float(t) for t in temperature], device=device)
        check_temperatures(temperature)
    cache = target.new_cache(b, length, keep_layers=list(layers) or None)
    logits = target(tokens[:, :width], cache=cache, logits_at=lens - 1).logits[:, 0]        # (b, vocab)
    states = None
    if layers:
        fed = cache.layer_states                                                          # (b, width, k h)
        states = fed.new_zeros(b, length - 1, fed.shape[-1])
        states[:, :width] = fed.masked_fill((torch.arange(width, device=device) >= lens[:, None])[..., None], 0)
    last = lens + (length if max_new is None else max_new)       # the position after each row's last new token
    cache.rollback(lens)
    row = torch.arange(b, device=device)             # the output row of each row still in the batch
    at = lens.clone()                                # the position each row's next token takes
    valid = lens.clone()
    while True:
        if per_row:                                  # greedy rows take the argmax; the others sample at their own T
            t = temps[row]
            nxt = torch.where(t == 0, logits.argmax(-1),
                              sample((logits.float() / t.clamp(min=1e-6)[:, None]).softmax(-1), generator))
        else:
            probs = to_probs(logits, sampling)
            nxt = probs.argmax(-1) if sampling.greedy else sample(probs, generator)       # (a,)
        tokens[row, at], valid[row] = nxt, at + 1
        done = (at + 1 >= length) | (at + 1 >= last[row]) | (False if eos_id is None else nxt == eos_id)
        if bool(done.any()):                         # a finished row leaves at once (module docstring)
            batch = int((~done).sum())
            if batch == 0:
                break
            dst, src = done[:batch].nonzero()[:, 0], (~done[batch:]).nonzero()[:, 0] + batch
            cache.compact_rows(dst, src, batch)      # rows src move into rows dst, the first batch stay
            order = torch.arange(len(done), device=device)
            order[dst] = src
            row, at, nxt = row[order[:batch]], at[order[:batch]], nxt[order[:batch]]
        logits = target(nxt[:, None], cache=cache).logits[:, -1]
        if states is not None:
            states[row, at] = cache.layer_states[:, 0]
        at = at + 1
    return tokens, valid, states


class Regenerated(RowSource):
    """Prompts continued by the target: row i is prompt perm[i mod P] (perm a seeded permutation,
    drawn anew for each pass over the prompts) followed by the target's tokens sampled at
    temperatures[i mod len(temperatures)] up to and including `eos_id` (None: no stop), cut at
    seq_len + 1 tokens and padded after the stop with `eos_id`; column `valid_len` counts the real
    tokens. Prompts longer than seq_len // 2 are left out. Each batch's rows of one temperature are
    continued together (`continue_with_states`), seeded by (seed, first row, temperature), and
    `rows` hands back the hidden states at `layers` those very calls computed ("embeds"), so the
    cache needs no second pass over the rows."""

    columns: ClassVar[dict[str, str]] = {"offset": "int64", "prompt_len": "int32", "valid_len": "int32"}

    def __init__(self, target: HFDecoder, prompts: list[Tensor], seq_len: int, seed: int, layers: Sequence[int],
                 temperatures: Sequence[float] = (1.0,), source: str = "", eos_id: int | None = None,
                 left_out: Sequence[int] = (), left_out_because: Sequence[str] = ()) -> None:
        check_temperatures(temperatures)
        check(eos_id is None or 0 <= eos_id < target.vocab_size,
              f"the stop token {eos_id} is not among the target's {target.vocab_size} tokens")
        skip = set(left_out)
        check(len(skip) < len(prompts),
              "every prompt was left out (--exclude-prompts-of): no prompt is left to continue")
        self.keep = [i for i, p in enumerate(prompts) if p.numel() <= seq_len // 2 and i not in skip]
        check(self.keep, f"every prompt left is longer than seq_len // 2 = {seq_len // 2} tokens: raise seq_len")
        self.left_out = {"caches": list(left_out_because), "prompts": len(skip)} if left_out_because else None
        self.target, self.prompts, self.vocab_size, self.layers = target, prompts, target.vocab_size, list(layers)
        self.seq_len, self.seed, self.temperatures = seq_len, seed, [float(t) for t in temperatures]
        self.source, self.eos_id = source, eos_id

    def describe(self) -> dict[str, Any]:
        # "states": the hidden states come from the generating calls (a partial build of the
        # second-pass rows, whose sampled tokens differ, is not resumed into this one)
        return {"kind": "regenerated", "prompts": self.source, "prompt_count": len(self.keep),
                "temperatures": self.temperatures, "eos_id": self.eos_id, "states": "generation",
                **({"left_out": self.left_out} if self.left_out else {})}

    def prompt_index(self, i: int) -> int:
        n = len(self.keep)
        return self.keep[int(np.random.default_rng([self.seed, i // n]).permutation(n)[i % n])]

    def rows(self, start: int, count: int) -> tuple[Tensor, dict[str, Any]]:
        index = np.array([self.prompt_index(start + j) for j in range(count)])
        tokens = torch.zeros(count, self.seq_len + 1, dtype=torch.long)
        valid = np.zeros(count, dtype=np.int32)
        states: Tensor | None = None                              # (count, seq_len, len(layers) hidden)
        for k, temperature in enumerate(self.temperatures):
            mine = [j for j in range(count) if (start + j) % len(self.temperatures) == k]
            if not mine:
                continue
            g = torch.Generator(device=self.target.device).manual_seed(self.seed * 1_000_003 + start * 17 + k)
            out, n, fed = continue_with_states(self.target, [self.prompts[index[j]] for j in mine], self.seq_len + 1,
                                               self.layers, temperature, g, self.eos_id)
            if states is None:
                states = fed.new_zeros(count, *fed.shape[1:])
            tokens[mine], valid[mine], states[mine] = out.cpu(), n.cpu().numpy(), fed
        lengths = np.array([self.prompts[i].numel() for i in index])
        return tokens, {"offset": index.astype(np.int64), "prompt_len": lengths.astype(np.int32), "valid_len": valid,
                        "embeds": states}


def continued_prompts(cache: str | os.PathLike, rows: range | None = None) -> set[tuple[int, ...]]:
    """The prompts (token ids, as the cache's build tokenized them) whose continuations a
    regenerated cache holds: each row's first prompt_len tokens (of `rows` only, if given)."""
    meta = read_cache_meta(cache)
    check(meta.get("source", {}).get("kind") == "regenerated",
          f"{cache} holds no continuations of prompts (its rows are {meta.get('source', {}).get('kind')!r}): "
          f"--exclude-prompts-of takes caches built with --prompts")
    table = open_cache(cache, meta).select_columns(["tokens", "prompt_len"])
    table = (table if rows is None else table.select(rows))[:]
    tokens = table.column("tokens").combine_chunks().values.to_numpy(zero_copy_only=False).reshape(len(table), -1)
    lengths = table.column("prompt_len").to_numpy()
    return {tuple(row[:n].tolist()) for row, n in zip(tokens, lengths, strict=True)}


class TextWindows(RowSource):
    """Random token windows of seq_len + 1 tokens of text files, tokenized as `data=hf_text` does
    (its windows file, kept under `windows_dir`), drawn with a seeded generator."""

    def __init__(self, files: Sequence[str], tokenizer_path: Path, seq_len: int, windows: int, seed: int,
                 windows_dir: str = "~/.cache/specdec/hf_text", chat: bool = False) -> None:
        from .hf_text import HFTextDataModule

        data = HFTextDataModule(files=[str(f) for f in files], tokenizer=str(tokenizer_path), seq_len=seq_len,
                                val_windows=1, windows_dir=windows_dir, chat=chat, add_eos=not chat)
        data.prepare_data()
        self.windows = data.windows()
        self.vocab_size = len(data.tokenizer)
        self.files = [str(Path(f).expanduser().resolve()) for f in files]
        self.index = np.random.default_rng(seed).integers(0, len(self.windows), size=windows)

    def describe(self) -> dict[str, Any]:
        return {"kind": "text_windows", "files": self.files, "available_windows": len(self.windows)}

    def rows(self, start: int, count: int) -> tuple[Tensor, dict[str, np.ndarray]]:
        part = self.index[start:start + count]
        tokens = torch.from_numpy(self.windows[part.tolist()]["input_ids"].astype(np.int64))
        return tokens, {"offset": part.astype(np.int64)}


def check_temperatures(temperatures: Sequence[float]) -> None:
    """One line unless `temperatures` are one or more finite numbers >= 0."""
    check(len(temperatures) > 0 and all(0 <= float(t) < float("inf") for t in temperatures),
          f"temperatures must be finite numbers >= 0, got {list(temperatures)!r}")


@dataclass(frozen=True)
class HFRows:
    """The rows of a Hugging Face target's cache: token windows of the `text` files, or the target's
    continuations of the `prompts` file (one of the two), through the chat template with `chat`,
    sampled at `temperatures` (row i at the (i mod len)-th), the hidden states at `layers`
    (`hidden_states` indices, negative ones from the end; None: the last layer, after its final
    norm); `exclude_prompts_of`: regenerated caches whose prompts are left out (the same prompt's
    token ids), so that a cache to train on with (`head.init_from`) holds answers to prompts the
    first one did not continue (the cache records them: source.left_out)."""

    text: Sequence[str] | None = None
    prompts: str | os.PathLike | None = None
    chat: bool = False
    temperatures: Sequence[float] = (1.0,)
    layers: Sequence[int] | None = None
    exclude_prompts_of: Sequence[str | os.PathLike] = ()

    def check(self) -> set[tuple[int, ...]]:
        """One line unless the rows are given one way; returns the prompts the excluded caches
        continued (read before the target loads: bad input fails fast)."""
        check((self.text is None) != (self.prompts is None), "give either text files or a prompts file")
        check_temperatures(self.temperatures)
        check(not self.exclude_prompts_of or self.prompts is not None,
              "--exclude-prompts-of leaves out prompts: give --prompts")
        continued: set[tuple[int, ...]] = set()
        for cache in self.exclude_prompts_of:
            continued |= continued_prompts(cache)
        return continued


def build_hf_cache(target: str | os.PathLike, out: str | os.PathLike, rows: HFRows,
                   settings: CacheSettings | None = None, run: BuildRun | None = None,
                   device: str | torch.device = "cpu", model_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Cache a Hugging Face target's hidden states at `rows.layers` of `settings.windows` rows (see
    `HFRows` and the module docstring) with the target in `model_dtype` on `device`; `write_cache`
    writes (and resumes) the cache, within `run.max_seconds` of work once the target is loaded when
    given (fewer rows if it runs out). `settings` None: `CacheSettings()`; `run` None: `BuildRun()`."""
    settings, run = settings or CacheSettings(), run or BuildRun()
    out = settings.check(out, run.overwrite)
    check(run.max_seconds is None or run.max_seconds > 0,
          f"the cache's time budget must be > 0 seconds, got {run.max_seconds!r}")
    continued = rows.check()
    path = check_source(target, "target")
    depth = int(text_config(load_config(path, "target")).num_hidden_layers)
    layers = normalize_layers([depth] if rows.layers is None else list(rows.layers), depth)
    tokenizer = load_tokenizer(path, "target")
    prompt_ids = read_prompts(rows.prompts, tokenizer, rows.chat) if rows.prompts is not None else None
    model = load_causal_lm(path, dtype=model_dtype, what="target").to(device)
    model.requires_grad_(False)
    vocab = min(len(tokenizer), logits_width(model))
    decoder = HFDecoder(model, vocab)
    if prompt_ids is not None:
        source: RowSource = _regenerated(decoder, prompt_ids, rows, settings, layers, tokenizer, continued, run)
    else:
        source = TextWindows(rows.text, path, settings.seq_len, settings.windows, settings.seed, chat=rows.chat)

    def hidden(tokens: Tensor) -> Tensor:                            # (b, n) -> (b, n, len(layers) dim)
        at = torch.zeros(tokens.shape[0], dtype=torch.long)          # the head at one position only
        return decoder(tokens.to(device), embeds=True, logits_at=at, layers=layers).embeds

    identity = {"kind": "hf", **target_identity(model, path.resolve())}      # "kind": a cache also records exports
    cached = CacheModel(identity, int(text_config(model.config).hidden_size), vocab, decoder.cfg.max_seq_len, hidden,
                        depth=depth, layers=tuple(layers))
    return write_cache(cached, source, out, settings, run)


def _regenerated(decoder: HFDecoder, prompt_ids: list[Tensor], rows: HFRows, settings: CacheSettings,
                 layers: list[int], tokenizer: Any, continued: set[tuple[int, ...]], run: BuildRun) -> Regenerated:
    """The target's continuations of the prompts, those `continued` by the excluded caches left out."""
    vocab = decoder.vocab_size
    check(max(int(p.max()) for p in prompt_ids) < vocab, f"the prompts hold token ids >= the target's {vocab}")
    left_out = [i for i, p in enumerate(prompt_ids) if tuple(p.tolist()) in continued]
    if rows.exclude_prompts_of:
        run.say(f"left out {len(left_out):,} of the {len(prompt_ids):,} prompts: continued by "
                f"{', '.join(map(str, rows.exclude_prompts_of))}")
    return Regenerated(decoder, prompt_ids, settings.seq_len, settings.seed, layers, rows.temperatures,
                       str(Path(rows.prompts).expanduser().resolve()), stop_token(tokenizer, rows.chat), left_out,
                       [str(Path(c).expanduser().resolve()) for c in rows.exclude_prompts_of])


def write_cache_text(cache: str | os.PathLike, tokenizer: Any, out: str | os.PathLike, val_windows: int) -> int:
    """Write a cache's training rows (all but its last `val_windows`, data=hf_embeddings'
    validation) as text, special tokens kept, one {"text": ...} per line: a corpus for
    data=hf_text (chat=false, add_eos=false) holding what a head trained from the cache saw (each
    row up to its valid_len: the padding after an answer's stop token is left out).
    Returns the number of rows written."""
    from specdec_models.files import write_file

    from .embeddings_cache import open_cache, read_cache_meta

    meta = read_cache_meta(cache)
    check(0 <= val_windows < meta["windows"], f"val_windows must be in [0, {meta['windows']}), got {val_windows}")
    table = open_cache(cache, meta).select(range(meta["windows"] - val_windows))
    rows = table["tokens"].to_pylist()
    if "valid_len" in table.column_names:                       # the padding after each answer's stop goes
        rows = [r[:n] for r, n in zip(rows, table["valid_len"].to_pylist(), strict=True)]
    lines = "".join(json.dumps({"text": tokenizer.decode(r)}) + "\n" for r in rows)
    write_file(Path(out), lambda f: f.write(lines.encode("utf-8")))
    return len(rows)


def cache_answers(cache: str | os.PathLike, val_windows: int = 0) -> list[list[int]]:
    """The answers of a regenerated cache's training rows (all but its last `val_windows`), as
    token lists: each row from its prompt's end to its valid_len (the stop token included, the
    padding after it left out). A `decode.datastore.Datastore` of them proposes the target's own
    phrasing to a draft tree (`decode.tree.looked_up_path`)."""
    from .embeddings_cache import open_cache, read_cache_meta

    meta = read_cache_meta(cache)
    check(meta.get("source", {}).get("kind") == "regenerated",
          f"{cache} holds windows of a text, not the target's answers: a datastore is built from a cache of "
          f"specdec cache --prompts")
    check(0 <= val_windows < meta["windows"], f"val_windows must be in [0, {meta['windows']}), got {val_windows}")
    table = open_cache(cache, meta).select_columns(["tokens", "prompt_len", "valid_len"])
    table = table.select(range(meta["windows"] - val_windows))
    return [r[p:n] for r, p, n in zip(table["tokens"].to_pylist(), table["prompt_len"].to_pylist(),
                                        table["valid_len"].to_pylist(), strict=True)]


# ---------------------------------------------------------------- prompts from any text

TEXT_SOURCE = "text:"      # the recipe's --data text:FILE (`text_conversations`)

TEMPLATES = (
    "Explain the following text in simple words:\n\n{}",
    "Summarize this in one or two sentences:\n\n{}",
    "What is this text about?\n\n{}",
    "Rewrite the following more clearly:\n\n{}",
    "Write a short paragraph that continues this text:\n\n{}",
    "List three key points from this text:\n\n{}",
    "Give an example that illustrates this:\n\n{}",
    "Write a question a student might ask about this text, then answer it:\n\n{}",
)


def prompts_from_text(text: str, count: int, seed: int = 0, words: tuple[int, int] = (8, 40)) -> list[str]:
    """`count` instruction prompts: a template of `TEMPLATES` around a snippet of `text` (a random
    stretch of 400 characters, markup removed, cut to whole words, kept when it has between
    words[0] and words[1] words of letters). Seeded: the same text and seed give the same prompts."""
    rng = np.random.default_rng(seed)
    out: list[str] = []
    tries = 0
    while len(out) < count:
        tries += 1
        check(tries < 100 * count + 1000, f"the text gives too few snippets of {words[0]}+ words for {count} prompts")
        start = int(rng.integers(0, max(1, len(text) - 400)))
        snippet = re.sub(r"<[^>]*>?|^[^<]*>|&[#\w]+;|\[[^\]]*\]?|^[^\[]*\]|[{}\\]", " ", text[start:start + 400])
        kept = [w for w in snippet.split()[1:-1] if re.search(r"[A-Za-z]", w)]   # the cut words at both ends go
        if not words[0] <= len(kept) <= words[1] * 2:
            continue
        out.append(TEMPLATES[int(rng.integers(len(TEMPLATES)))].format(" ".join(kept[: words[1]])))
    return out


def text_conversations(path: str | os.PathLike, count: int, seed: int = 0):
    """`count` single-turn conversations made from a text file (raw, .zip or .gz; its training
    split, enwik8's 90/5/5 bytes): a user turn of `prompts_from_text` and an empty assistant turn
    that the target answers (the recipe's --data text:FILE), deduplicated. Returns
    (conversations, `conversations.Counts`)."""
    from .conversations import Conversation, Counts, Turn, deduplicate
    from .enwik8 import ENWIK8_BYTES, read_bytes, split_bounds

    path = Path(path).expanduser()
    check(path.is_file(), f"--data text:{path}: no such file")
    data = read_bytes(path)[:ENWIK8_BYTES]
    text = data[:split_bounds(len(data))[0]].tobytes().decode("utf-8", errors="ignore")
    prompts = prompts_from_text(text, count, seed)
    convs = [Conversation(f"text-{seed}-{i}", (Turn("user", p), Turn("assistant", "")), f"text:{path.name}")
             for i, p in enumerate(prompts)]
    convs, duplicates = deduplicate(convs)
    return convs, Counts(read=len(prompts), kept=len(convs), duplicates=duplicates)
