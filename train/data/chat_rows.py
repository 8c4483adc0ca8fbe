"""Conversation rows: answered conversations rendered through the chat template, loss on the answers.

`chat_rows` renders each conversation (`conversations.render_turns`: the template's own tokens,
the answers-only mask), cuts it at a turn boundary to seq_len + 1 tokens (`cut_at_turns`) and pads
it with the end-of-turn token. A conversation whose last answer was cut short (`truncated`, see
`chat_answers`) loses the end-of-turn token the template wrote after it, which the target never
emitted. A row is then

    tokens     (seq_len + 1,) the rendering, padded after valid_len
    loss_mask  (seq_len + 1,) 1 on every assistant turn's tokens (its end-of-turn token included)
    prompt_len where the first answer starts (the evaluation callback's prompt: the first turn)
    valid_len  the real tokens

Both ways of training a head take these rows:
- offline: `build_chat_cache` writes the embeddings cache of `train.data.embeddings_cache` from them
  (`ChatRows`; one teacher-forced pass per batch gives the hidden states, exactly what the online
  mode computes), and `data=hf_embeddings` trains from it;
- online: `HFChatDataModule` (`data=hf_chat`) hands the rows to the task, whose target computes the
  hidden states at every step.
The label of position j (token j + 1) counts where loss_mask[j + 1] is 1
(`hf_embeddings.label_mask`). Rows come from an answers folder (`chat_answers`, the target's own
answers) or, keeping the data's answers, from any conversation source (`conversations`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from specdec_models.errors import SpecdecError, check, check_positive_int

from .conversations import Conversation, cut_at_turns, render_turns
from .embeddings_cache import (
    MASK,
    BuildRun,
    CacheModel,
    CacheSettings,
    RowSource,
    normalize_layers,
    write_cache,
)
from .streams import SpecdecDataModule, StepBatches, stream_position


def chat_rows(tokenizer: Any, conversations: Sequence[tuple[Conversation, bool]], seq_len: int,
              chat_template_kwargs: dict | None = None, end_of_turn: int | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Rows (module docstring) of `conversations` ((conversation, truncated) pairs): {"tokens" (N,
    seq_len + 1) int64, "loss_mask" (N, seq_len + 1) uint8, "prompt_len" (N,), "valid_len" (N,),
    "offset" (N,) the conversation's index}, and counts {"rows", "refused": conversations the
    template refused, "no_answer": rows with no answer token left, "answer_tokens", "tokens"}."""
    from .regenerate import stop_token

    eot = stop_token(tokenizer, chat=True) if end_of_turn is None else end_of_turn
    pad = 0 if eot is None else eot
    n = seq_len + 1
    tokens, masks, prompt, valid, offset = [], [], [], [], []
    counts = {"rows": 0, "refused": 0, "no_answer": 0, "answer_tokens": 0, "tokens": 0}
    for index, (conversation, truncated) in enumerate(conversations):
        try:
            r = render_turns(tokenizer, conversation, chat_template_kwargs, end_of_turn=eot)
        except SpecdecError:
            counts["refused"] += 1
            continue
        ids, mask = list(r.input_ids), list(r.loss_mask)
        if truncated and 1 in mask:              # the last answer was cut: its end-of-turn token is the template's
            last = len(mask) - 1 - mask[::-1].index(1)
            if ids[last] == eot:
                ids, mask = ids[:last], mask[:last]
        ids, mask = cut_at_turns(ids, mask, [b for b in r.boundaries if b <= len(ids)], n)
        if 1 not in mask:
            counts["no_answer"] += 1
            continue
        row = np.full(n, pad, dtype=np.int64)
        row[:len(ids)] = ids
        m = np.zeros(n, dtype=np.uint8)
        m[:len(mask)] = mask
        tokens.append(row)
        masks.append(m)
        prompt.append(mask.index(1))
        valid.append(len(ids))
        offset.append(index)
        counts["answer_tokens"] += int(sum(mask))
        counts["tokens"] += len(ids)
    counts["rows"] = len(tokens)
    check(tokens, "no conversation left a row with an answer token")
    return {"tokens": np.stack(tokens), "loss_mask": np.stack(masks), "prompt_len": np.array(prompt, dtype=np.int32),
            "valid_len": np.array(valid, dtype=np.int32), "offset": np.array(offset, dtype=np.int64)}, counts


def row_order(train_rows: int, held_out_rows: int, windows: int | None, seed: int) -> np.ndarray:
    """Which rendered row each cache row is: `windows - held_out_rows` training rows (a seeded
    permutation of the first `train_rows`, drawn anew each pass when more are asked for), then the
    held-out rows in order, last, as the cache's validation rows (data.val_windows = held_out_rows).
    windows None: every row once."""
    check(train_rows > 0, "no training conversation left a row")
    total = train_rows + held_out_rows if windows is None else windows
    check(total > held_out_rows, f"{total} rows leave none for training after {held_out_rows} held-out rows")
    k = total - held_out_rows
    passes = [np.random.default_rng([seed, p]).permutation(train_rows) for p in range(-(-k // train_rows))]
    return np.concatenate([np.concatenate(passes)[:k], train_rows + np.arange(held_out_rows)])


class ChatRows(RowSource):
    """The rows of `chat_rows` in `row_order`, for `write_cache` (the writer runs the target over
    each batch for the hidden states)."""

    columns: ClassVar[dict[str, str]] = {"offset": "int64", "prompt_len": "int32", "valid_len": "int32",
                                         "loss_mask": MASK}

    def __init__(self, rows: dict[str, np.ndarray], order: np.ndarray, vocab_size: int, describe: dict) -> None:
        self.data, self.order, self.vocab_size, self._describe = rows, order, vocab_size, describe
        check(int(rows["tokens"].max()) < vocab_size, f"the rows hold token ids >= the target's {vocab_size}")

    def describe(self) -> dict[str, Any]:
        return {"kind": "conversations", **self._describe}

    def rows(self, start: int, count: int) -> tuple[torch.Tensor, dict[str, Any]]:
        pick = self.order[start:start + count]
        extra = {name: self.data[name][pick] for name in ("offset", "prompt_len", "valid_len", "loss_mask")}
        return torch.from_numpy(self.data["tokens"][pick]), extra


@dataclass(frozen=True)
class ChatSource:
    """The rows of a conversation cache: the `train` then the `held_out` conversations ((conversation,
    truncated) pairs), rendered with `chat_template_kwargs`, `windows` rows of them (`row_order`;
    None: every row once), the hidden states at `layers` (`build_hf_cache`'s convention), and
    `describe` (what cache.json records as their source)."""

    train: Sequence[tuple[Conversation, bool]]
    held_out: Sequence[tuple[Conversation, bool]]
    layers: Sequence[int] | None
    describe: dict
    windows: int | None = None
    chat_template_kwargs: dict | None = None


def build_chat_cache(target: str | os.PathLike, source: ChatSource, out: str | os.PathLike,
                     settings: CacheSettings | None = None, run: BuildRun | None = None, device: str = "cpu",
                     model_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The embeddings cache of the rows of `source` (`ChatSource`; settings.windows is the rows it
    makes), through `write_cache` (resumable; as process run.rank of run.world, its shards of it).
    Returns cache.json's contents plus "row_counts" (`chat_rows`' counts) and "held_out_rows"
    ({"finalized": False, ...} from a process that did not write cache.json). `settings` None:
    `CacheSettings(batch_size=16)`; `run` None: `BuildRun()`."""
    from specdec_models.hf import HFDecoder, logits_width, text_config
    from specdec_models.hf.weights import check_source, load_causal_lm, load_config, load_tokenizer, target_identity

    settings, run = settings or CacheSettings(batch_size=16), run or BuildRun()
    path = check_source(target, "target")
    tokenizer = load_tokenizer(path, "target")
    rows, counts = chat_rows(tokenizer, [*source.train, *source.held_out], settings.seq_len,
                             source.chat_template_kwargs)
    held = int((rows["offset"] >= len(source.train)).sum())
    order = row_order(len(rows["offset"]) - held, held, source.windows, settings.seed)
    settings = replace(settings, windows=len(order))
    depth = int(text_config(load_config(path, "target")).num_hidden_layers)
    layers = normalize_layers([depth] if source.layers is None else list(source.layers), depth)
    out = settings.check(out, run.overwrite and run.world == 1)
    model = load_causal_lm(path, dtype=model_dtype, what="target").to(device)
    model.requires_grad_(False)
    vocab = min(len(tokenizer), logits_width(model))
    decoder = HFDecoder(model, vocab)
    rows_source = ChatRows(rows, order, vocab, {**source.describe, "held_out_rows": held, "rows": counts["rows"]})

    def hidden(tokens: torch.Tensor) -> torch.Tensor:                 # (b, n) -> (b, n, len(layers) dim)
        at = torch.zeros(tokens.shape[0], dtype=torch.long)
        return decoder(tokens.to(device), embeds=True, logits_at=at, layers=layers).embeds

    identity = {"kind": "hf", **target_identity(model, path.resolve())}
    cached = CacheModel(identity, int(text_config(model.config).hidden_size), vocab, decoder.cfg.max_seq_len, hidden,
                        depth=depth, layers=tuple(layers))
    meta = write_cache(cached, rows_source, out, settings, run)
    return {**meta, "row_counts": counts, "held_out_rows": held}


# ---------------------------------------------------------------- online: data=hf_chat

class _Rows(Dataset):
    def __init__(self, rows: dict[str, np.ndarray], index: np.ndarray) -> None:
        self.rows, self.index = rows, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        j = int(self.index[i])
        return {"tokens": torch.from_numpy(self.rows["tokens"][j]),
                "loss_mask": torch.from_numpy(self.rows["loss_mask"][j].astype(bool)),
                "prompt_len": torch.tensor(int(self.rows["prompt_len"][j])),
                "valid_len": torch.tensor(int(self.rows["valid_len"][j]))}


class ChatBatches(StepBatches):
    """Batch k of rank r: `batch_size` random training rows, a pure function of (seed, r, k)."""

    def __init__(self, rows: dict[str, np.ndarray], train: np.ndarray, batch_size: int, seed: int, rank: int,
                 start: int) -> None:
        self.start = start
        self.rows, self.train, self.batch_size, self.seed, self.rank = rows, train, batch_size, seed, rank

    def batch(self, k: int) -> dict[str, torch.Tensor]:
        pick = self.train[np.random.default_rng([self.seed, self.rank, k]).integers(0, len(self.train),
                                                                                     self.batch_size)]
        return {"tokens": torch.from_numpy(self.rows["tokens"][pick]),
                "loss_mask": torch.from_numpy(self.rows["loss_mask"][pick].astype(bool)),
                "prompt_len": torch.from_numpy(self.rows["prompt_len"][pick].astype(np.int64)),
                "valid_len": torch.from_numpy(self.rows["valid_len"][pick].astype(np.int64))}


class HFChatDataModule(SpecdecDataModule):
    """data=hf_chat: conversation rows for a head whose target computes the hidden states online.
    `answers`: an answers folder (`chat_answers`, the target's own answers); or `conversations`: any
    source of `conversations.read_conversations` with the data's own answers (EAGLE-1's way).
    Conversations held out by id hash (`held_out` of them, `conversations.split_held_out`) are
    the fixed validation rows (`val_windows` of them at most). (A smaller share of a source is a
    smaller source: `specdec eagle3 --conversations N` samples one.)"""

    def __init__(self, answers: str | None = None, conversations: str | None = None, tokenizer: str | None = None,
                 seq_len: int = 512, batch_size: int = 4, val_windows: int = 16, val_batch_size: int = 4,
                 held_out: float = 0.02, chat_template_kwargs: dict | None = None, seed: int = 0) -> None:
        super().__init__()
        for name, value in [("seq_len", seq_len), ("batch_size", batch_size), ("val_windows", val_windows),
                            ("val_batch_size", val_batch_size)]:
            check_positive_int(value, f"data.{name}")
        check((answers is None) != (conversations is None),
              "data=hf_chat needs data.answers (an answers folder) or data.conversations (a conversation source)")
        check(tokenizer is not None, "data.tokenizer must be the target's model directory or GGUF")
        self.answers, self.conversations, self.tokenizer_path = answers, conversations, tokenizer
        self.seq_len, self.batch_size, self.val_windows, self.val_batch_size = seq_len, batch_size, val_windows, \
            val_batch_size
        self.held_out, self.kwargs, self.seed = held_out, dict(chat_template_kwargs or {}), seed
        self._rows: dict[str, np.ndarray] | None = None
        self._train = self._val = None
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from specdec_models.hf import load_tokenizer
            self._tokenizer = load_tokenizer(Path(self.tokenizer_path).expanduser(), "data.tokenizer")
        return self._tokenizer

    def _load(self) -> None:
        from .chat_answers import read_answers
        from .conversations import is_held_out, read_conversations

        if self.answers is not None:
            pairs, _ = read_answers(self.answers)
        else:
            convs, _ = read_conversations(self.conversations)
            pairs = [(c, False) for c in convs]
        rows, _ = chat_rows(self.tokenizer, pairs, self.seq_len, self.kwargs)
        held = np.array([is_held_out(pairs[i][0].id, self.held_out, str(self.seed)) for i in rows["offset"]], bool)
        val = np.nonzero(held)[0][:self.val_windows]
        if len(val) == 0:                         # too few conversations to hold any out: the last rows validate
            val = np.arange(len(held))[-self.val_windows:]
        train = np.setdiff1d(np.arange(len(held)), val)
        check(len(train) > 0, f"{len(held)} rows leave none for training after {len(val)} validation rows")
        self._rows, self._train, self._val = rows, train, val

    def setup(self, stage: str | None = None) -> None:
        if self._rows is None:
            self._load()

    @property
    def train_rows(self) -> int:
        self.setup()
        return len(self._train)

    def train_dataloader(self) -> DataLoader:
        self.setup()
        rank, start = stream_position(self.trainer)
        batches = ChatBatches(self._rows, self._train, self.batch_size, self.seed, rank, start)
        return DataLoader(batches, batch_size=None)

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(_Rows(self._rows, self._val), batch_size=self.val_batch_size, shuffle=False)

    def prompts(self, count: int, length: int) -> list[torch.Tensor]:
        """`count` fixed prompts: validation rows' first turns (up to where the first answer starts)."""
        self.setup()
        check(count <= len(self._val), f"{count} prompts need as many validation rows; there are {len(self._val)}")
        pick = self._val[np.linspace(0, len(self._val) - 1, count).round().astype(int)]
        return [torch.from_numpy(self._rows["tokens"][j, :int(self._rows["prompt_len"][j])]) for j in pick]

    def decode_text(self, tokens: torch.Tensor) -> str:
        return self.tokenizer.decode(tokens.tolist())
