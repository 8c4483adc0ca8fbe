"""Training rows for a prophet of a Hugging Face target, and their cache of hidden states.

A head drafts well when it has learnt the target's own distribution, so its training text is best
written by the target itself (as Medusa's and EAGLE's self-distillation data is): `Regenerated`
reads prompts from a text or chat file (`read_prompts`), lets the target continue each one
(`specdec_models.decode.generate`: batched, KV-cached, seeded per batch) until its end-of-turn
token (`stop_token`: the chat template's, else the tokenizer's EOS) and keeps each row as prompt +
continuation up to and including that token, cut to seq_len + 1 tokens; a row that ends sooner is
padded with the stop token, and its `valid_len` column counts its real tokens. `TextWindows` takes
plain token windows of text files instead (tokenized as `data=hf_text` does). `build_hf_cache`
runs the target over either and writes the embeddings cache of `train.data.embeddings_cache` (the one
format and writer; the hidden states of any `layers`, all from one batched teacher-forced pass per
batch of rows), tagged with the sha256 of the target's weights; `task=hf_prophet
data=hf_embeddings` trains from it.

Why a second, teacher-forced pass over generated rows rather than the hidden states the target
computes while it generates: that pass is one batched forward over seq_len positions for every
layer at once, and it gives exactly the hidden states training reads online, with no change to
decoding. Measured on tiny random Llamas, one CPU thread, seq_len 256: it took 5% (hidden 64, 4
layers) to 15% (hidden 256, 8 layers) of a build at batch 8, 20-28% at batch 64, where generating
is closest to compute-bound; keeping the states during generation (the target's cache with
keep_embeds) would save at most that, and needs `generate` to hand back the states of rows it
drops from its batch.

The target is loaded from a local model directory or a GGUF file (`specdec_models.hf.weights`);
every input is checked before the weights load, the weights before any row is made.
`prompts_from_text` makes instruction prompts from snippets of any text (there is no chat dataset
on an offline machine); `scripts/make_prompts.py` writes them as a chat file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from specdec_models.decode import generate
from specdec_models.errors import SpecdecError, check
from specdec_models.hf import HFDecoder, logits_width, text_config
from specdec_models.hf.weights import check_source, load_causal_lm, load_config, load_tokenizer, target_identity

from .embeddings_cache import CacheModel, RowSource, check_build, normalize_layers, shard_size_bytes, write_cache

PROMPT_SUFFIXES = (".txt", ".jsonl", ".json")


def read_prompts(path: str | os.PathLike, tokenizer: Any, chat: bool) -> list[Tensor]:
    """Token ids (n,) of each prompt in a file: `.txt` (one prompt per non-empty line) or `.jsonl` /
    `.json` (records with "messages" (a list of {"role", "content"}), or "prompt" or "text").
    With `chat`, each prompt is the tokenizer's chat template with the assistant's turn opened;
    without, its plain tokens."""
    path = Path(path).expanduser()
    check(path.is_file(), f"prompts file {path} does not exist")
    check(path.suffix in PROMPT_SUFFIXES, f"prompts file {path}: use .txt, .jsonl or .json, got {path.suffix!r}")
    if path.suffix == ".txt":
        records: list[Any] = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        text = path.read_text(encoding="utf-8")
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


class Regenerated(RowSource):
    """Prompts continued by the target: row i is prompt perm[i mod P] (perm a seeded permutation,
    drawn anew for each pass over the prompts) followed by the target's tokens sampled at
    temperatures[i mod len(temperatures)] up to and including `eos_id` (None: no stop), cut to
    seq_len + 1 tokens and padded after the stop with `eos_id`; column `valid_len` counts the real
    tokens. Prompts longer than seq_len // 2 are left out. Each generate call is seeded by (seed,
    first row, temperature)."""

    columns: ClassVar[dict[str, str]] = {"offset": "int64", "prompt_len": "int32", "valid_len": "int32"}

    def __init__(self, target: Any, prompts: list[Tensor], vocab_size: int, seq_len: int, seed: int,
                 temperatures: Sequence[float] = (1.0,), source: str = "", eos_id: int | None = None) -> None:
        check(len(temperatures) > 0 and all(float(t) >= 0 for t in temperatures),
              f"temperatures must be numbers >= 0, got {list(temperatures)!r}")
        check(eos_id is None or 0 <= eos_id < vocab_size, f"the stop token {eos_id} is not among the target's "
                                                           f"{vocab_size} tokens")
        self.keep = [i for i, p in enumerate(prompts) if p.numel() <= seq_len // 2]
        check(self.keep, f"every prompt is longer than seq_len // 2 = {seq_len // 2} tokens: raise seq_len")
        self.target, self.prompts, self.vocab_size = target, prompts, vocab_size
        self.seq_len, self.seed, self.temperatures = seq_len, seed, [float(t) for t in temperatures]
        self.source, self.eos_id = source, eos_id

    def describe(self) -> dict[str, Any]:
        return {"kind": "regenerated", "prompts": self.source, "prompt_count": len(self.keep),
                "temperatures": self.temperatures, "eos_id": self.eos_id}

    def prompt_index(self, i: int) -> int:
        n = len(self.keep)
        return self.keep[int(np.random.default_rng([self.seed, i // n]).permutation(n)[i % n])]

    def rows(self, start: int, count: int) -> tuple[Tensor, dict[str, np.ndarray]]:
        index = np.array([self.prompt_index(start + j) for j in range(count)])
        tokens = torch.full((count, self.seq_len + 1), 0 if self.eos_id is None else self.eos_id, dtype=torch.long)
        valid = np.zeros(count, dtype=np.int32)
        for k, temperature in enumerate(self.temperatures):
            mine = [j for j in range(count) if (start + j) % len(self.temperatures) == k]
            if not mine:
                continue
            prompts = [self.prompts[index[j]] for j in mine]
            new = self.seq_len + 1 - min(p.numel() for p in prompts)
            g = torch.Generator(device=self.target.device).manual_seed(self.seed * 1_000_003 + start * 17 + k)
            out, _ = generate(self.target, prompts, new, temperature=temperature, generator=g,
                              vocab_size=self.vocab_size, eos_id=self.eos_id)             # cut after the stop
            for j, p, o in zip(mine, prompts, out):
                row = torch.cat([p, o.cpu()])[: self.seq_len + 1]
                tokens[j, : len(row)], valid[j] = row, len(row)
        lengths = np.array([self.prompts[i].numel() for i in index])
        return tokens, {"offset": index.astype(np.int64), "prompt_len": lengths.astype(np.int32), "valid_len": valid}


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


def build_hf_cache(target: str | os.PathLike, out: str | os.PathLike, *, text: Sequence[str] | None = None,
                   prompts: str | os.PathLike | None = None, chat: bool = False,
                   temperatures: Sequence[float] = (1.0,), seq_len: int = 256, windows: int = 1024,
                   dtype: str = "bfloat16", shard_size: str | int = "500MB", seed: int = 0, batch_size: int = 8,
                   layers: Sequence[int] | None = None, device: str | torch.device = "cpu",
                   model_dtype: torch.dtype = torch.float32, overwrite: bool = False,
                   progress: Callable[[int], Any] | None = None,
                   report: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Cache a Hugging Face target's hidden states at `layers` (`hidden_states` indices, negative
    ones from the end; None: the last layer, after its final norm) of `windows` rows: token
    windows of the `text` files, or the target's continuations of the `prompts` file (see the
    module docstring); `write_cache` writes (and resumes) the cache."""
    out = check_build(out, seq_len=seq_len, windows=windows, dtype=dtype, top_k_logits=0, batch_size=batch_size,
                      overwrite=overwrite)
    shard_size_bytes(shard_size)
    check((text is None) != (prompts is None), "give either text files or a prompts file")
    path = check_source(target, "target")
    depth = int(text_config(load_config(path, "target")).num_hidden_layers)
    layers = normalize_layers([depth] if layers is None else list(layers), depth)
    tokenizer = load_tokenizer(path, "target")
    prompt_ids = read_prompts(prompts, tokenizer, chat) if prompts is not None else None
    model = load_causal_lm(path, dtype=model_dtype, what="target").to(device)
    model.requires_grad_(False)
    vocab = min(len(tokenizer), logits_width(model))
    dim = int(text_config(model.config).hidden_size)
    if prompt_ids is not None:
        check(max(int(p.max()) for p in prompt_ids) < vocab, f"the prompts hold token ids >= the target's {vocab}")
        source: RowSource = Regenerated(model, prompt_ids, vocab, seq_len, seed, temperatures,
                                        str(Path(prompts).expanduser().resolve()), stop_token(tokenizer, chat))
    else:
        source = TextWindows(text, path, seq_len, windows, seed, chat=chat)
    decoder = HFDecoder(model, vocab)

    def hidden(tokens: Tensor) -> Tensor:                            # (b, n) -> (b, n, len(layers) dim)
        at = torch.zeros(tokens.shape[0], dtype=torch.long)          # the head at one position only
        return decoder(tokens.to(device), embeds=True, logits_at=at, layers=layers).embeds

    limit = decoder.cfg.max_seq_len
    identity = {"kind": "hf", **target_identity(model, path.resolve())}      # "kind": a cache also records exports
    cached = CacheModel(identity, dim, vocab, limit, hidden, depth=depth, layers=tuple(layers))
    return write_cache(cached, source, out, seq_len=seq_len, windows=windows, dtype=dtype, top_k_logits=0,
                       shard_size=shard_size, seed=seed, batch_size=batch_size, overwrite=overwrite,
                       progress=progress, report=report)


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
        rows = [r[:n] for r, n in zip(rows, table["valid_len"].to_pylist())]
    lines = "".join(json.dumps({"text": tokenizer.decode(r)}) + "\n" for r in rows)
    write_file(Path(out), lambda f: f.write(lines.encode("utf-8")))
    return len(rows)


# ---------------------------------------------------------------- prompts from any text

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
