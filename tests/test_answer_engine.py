"""train.data.answer_engine: continuous batching with each conversation's KV cache kept from turn to
turn answers exactly what the first path (`chat_answers.answer_batch`) answers, greedy in fp32, for
less prefill; its time budget stops generation mid-way and keeps the finished conversations; a
killed run resumes from its written parts. Tiny random Llama targets (fp32) over the word-level
tokenizer of test_hf_data: one that stops at its end of turn (multi-turn answers), one that never
stops less often (answers also cut at max_new_tokens or at the row's end)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from test_chat_rows import hf  # noqa: F401  (the recipe tests' tiny stopping target)
from test_hf_data import stopping_target, text_setup
from test_hf_distill import save_model

from specdec_models.errors import SpecdecError
from train.data import answer_engine
from train.data import chat_answers as ca
from train.data.answer_engine import AnswerEngine
from train.data.conversations import Conversation, Turn

pytestmark = pytest.mark.usefixtures("offline", "one_thread")
SEQ = 64
WORDS = "the quick fox jumps over a lazy dog one two three four five is it fast large small model".split()


def conversations(count: int, seed: int = 0) -> list[Conversation]:
    """`count` conversations of 1 to 4 user turns of 1 to 14 words (mixed lengths), and one whose
    first message leaves no room for an answer."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        turns = []
        if i % 5 == 1:
            turns.append(Turn("system", "be short"))
        for _ in range(rng.randint(1, 4)):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 14)))
            turns += [Turn("user", words), Turn("assistant", "x")]
        out.append(Conversation(f"c{i}", tuple(turns), "test"))
    out.insert(3, Conversation("huge", (Turn("user", " ".join(["one"] * 70)), Turn("assistant", "x")), "test"))
    return out


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine")
    setup = text_setup(d, docs=40, prompt_docs=4)
    stopping_target(d / "stop", setup["tok"])
    return {"stop": d / "stop", "random": save_model(d / "random", setup["tok"], "llama", 1)}


def answerer(targets, name, chunk=4, max_new_tokens=12):
    return ca.load_answerer(targets[name], seq_len=SEQ, max_new_tokens=max_new_tokens, chunk=chunk)[0]


def run_engine(answerer, convs, temperatures=(0.0,), slots=None, deadline=None):
    """The engine's records and counts, as answer_batch returns them, and the engine."""
    engine = AnswerEngine(answerer.decoder, answerer.tokenizer, answerer.eos_id, SEQ, answerer.max_new_tokens,
                          slots=slots or answerer.chunk)
    done = dict(engine.run(list(enumerate(convs)), lambda c: ca.Dialogue(c, answerer.tokenizer, SEQ),
                           temperatures, seed=3, deadline=deadline))
    ordered = [done[i] for i in sorted(done)]
    return [d.record for d in ordered if d.record is not None], ca.dialogue_counts(ordered), engine


def count_fed(model, monkeypatch):
    """{"calls", "tokens", "prefill": tokens of calls of more than one token per row} fed to `model`."""
    fed = {"calls": 0, "tokens": 0, "prefill": 0}
    forward = model.forward

    def counting(*args, input_ids=None, **kwargs):
        fed["calls"] += 1
        fed["tokens"] += input_ids.numel()
        fed["prefill"] += input_ids.numel() if input_ids.shape[1] > 1 else 0
        return forward(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(model, "forward", counting)
    return fed


@pytest.mark.parametrize("name", ["stop", "random"])
def test_greedy_answers_are_the_first_paths_in_fp32_with_more_conversations_than_slots(targets, name):
    a = answerer(targets, name)
    convs = conversations(13)
    with torch.inference_mode():
        expected, counts = ca.answer_batch(convs, a, temperatures=(0.0,), first=0, seed=0)
        records, engine_counts, engine = run_engine(a, convs)
    assert records == expected and engine_counts == counts
    assert counts["too_long"] == 1 and len(records) == len(convs) - 1
    assert engine.counts.generated == counts["tokens"] and engine.stopped == 0
    if name == "stop":                              # answers end their turn: later turns are answered
        assert max(r["answered"] for r in records) >= 3 and not any(r["truncated"] for r in records)
    else:                                           # some answers run to max_new_tokens or the row's end: cut
        assert any(r["truncated"] for r in records)


def test_answers_files_are_the_same_bytes_from_both_engines(targets, tmp_path):
    a = answerer(targets, "stop")
    convs = conversations(9, seed=1)
    files = {}
    for engine in ca.ENGINES:
        meta = ca.answer_conversations(convs, tmp_path / engine, answerer=a, identity={"kind": "test"}, data={},
                                       options=ca.AnswerOptions(batch_size=3, engine=engine))
        files[engine] = (tmp_path / engine / ca.ANSWERS_FILE).read_bytes()
        assert meta["engine"] == engine and meta["written"] == len(convs) - 1 and meta["batches_done"] == 4
    assert files["batched"] == files["simple"]


def test_the_kept_cache_prefills_fewer_tokens_than_the_first_path(targets, monkeypatch):
    a = answerer(targets, "stop")
    convs = conversations(13)
    fed = count_fed(a.decoder.model, monkeypatch)
    with torch.inference_mode():
        ca.answer_batch(convs, a, temperatures=(0.0,), first=0, seed=0)
        simple = dict(fed)
        fed.update(calls=0, tokens=0, prefill=0)
        _, counts, engine = run_engine(a, convs)
    assert engine.counts.prefilled < simple["prefill"] / 2            # the context tokens, padding aside
    assert fed["prefill"] < simple["prefill"] and fed["tokens"] < simple["tokens"]
    # every token fed is counted once: the prefills' (and their padding) and the steps' (one a row, idle rows too)
    c = engine.counts
    assert fed["tokens"] == c.prefilled + c.padding + c.stepped + c.idle and c.padding < c.prefilled
    assert engine.counts.stepped == counts["tokens"]  # each answer's tokens but its last, after its context's last
    assert engine.counts.fresh == 0                 # this template extends each context as a prefix


def test_a_context_that_does_not_extend_the_cached_one_is_prefilled_afresh(targets, monkeypatch):
    # a "template" that writes the number of turns first: no later context extends the earlier one
    a = answerer(targets, "stop")
    real = ca.context_ids
    marks = a.tokenizer.convert_tokens_to_ids(["one", "two", "three", "four", "five"])

    def numbered(tokenizer, turns, kwargs=None):
        return [marks[min(len(turns) // 2, 4)], *real(tokenizer, turns, kwargs)]

    monkeypatch.setattr(ca, "context_ids", numbered)
    convs = conversations(7, seed=2)
    with torch.inference_mode():
        expected, counts = ca.answer_batch(convs, a, temperatures=(0.0,), first=0, seed=0)
        records, engine_counts, engine = run_engine(a, convs)
    assert records == expected and engine_counts == counts
    assert engine.counts.fresh == counts["answers"] - (len(convs) - counts["too_long"])    # every later turn


def test_sampled_answers_do_not_depend_on_the_rows_they_share_calls_with(targets):
    a = answerer(targets, "random")
    convs = conversations(9, seed=3)
    with torch.inference_mode():
        runs = [run_engine(a, convs, temperatures=(1.0, 0.0), slots=slots)[0] for slots in (1, 3, 8)]
    assert runs[0] == runs[1] == runs[2]
    greedy = {r["id"]: r for r in run_engine(a, convs, temperatures=(0.0,), slots=3)[0]}
    hot = {c.id for i, c in enumerate(convs) if i % 2 == 0}           # temperatures[i mod 2] = 1
    sampled = [r for r in runs[0] if r["id"] in hot]
    assert any(r != greedy[r["id"]] for r in sampled)   # T=1 rows did sample


class Clock:
    """A clock the answers' modules read instead of time's (their `time.perf_counter`), moved on by
    `seconds` at every model forward: a budget test that no machine's load can make fail."""

    def __init__(self, model, monkeypatch, seconds):
        self.now = 0.0
        forward = model.forward

        def tick(*args, **kwargs):
            self.now += seconds
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", tick)
        for module in (answer_engine, ca):
            monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: self.now))


def test_the_time_budget_stops_generation_within_a_call_and_keeps_finished_conversations(targets, tmp_path,
                                                                                           monkeypatch):
    a = answerer(targets, "stop", chunk=3)
    convs = conversations(30, seed=4)
    clock = Clock(a.decoder.model, monkeypatch, 0.03)          # about 4 s of calls uninterrupted; the budget 1 s
    lines, heard = [], []
    meta = ca.answer_conversations(convs, tmp_path / "a", answerer=a, identity={"kind": "test"}, data={},
                                   options=ca.AnswerOptions(batch_size=4, max_seconds=1.0), report=lines.append,
                                   progress=lambda *x: heard.append(x))
    assert 1.0 <= clock.now <= 1.0 + 2 * 0.03 + 1e-9, clock.now  # stopped within a call or two of the budget
    assert 0 < meta["written"] < len(convs) - 1
    assert len(lines) == 1 and lines[0].startswith("the time budget (0.02 min) ran out:") and "in work" in lines[0]
    pairs, _ = ca.read_answers(tmp_path / "a")
    ids = [c.id for c, _ in pairs]
    assert ids == [c.id for c in convs if c.id in set(ids)]     # in order, whichever batches they came from
    assert heard[-1][2] == meta["tokens"]


def test_a_deadline_ends_the_conversations_in_work_at_their_last_finished_answer(targets, monkeypatch):
    a = answerer(targets, "stop")
    convs = conversations(13)
    with torch.inference_mode():
        whole = {r["id"]: r for r in run_engine(a, convs)[0]}
        checks = []

        def past(deadline):                         # the deadline passes at the 15th check
            checks.append(1)
            return deadline is not None and len(checks) > 15

        monkeypatch.setattr(answer_engine, "_past", past)
        records, counts, engine = run_engine(a, convs, deadline=0.0)
    assert engine.stopped > 0 and 0 < len(records) < len(whole)
    for r in records:                               # each kept conversation: the uninterrupted one's first turns
        assert r["messages"] == whole[r["id"]]["messages"][:len(r["messages"])]
        assert r["messages"][-1]["role"] == "assistant"
    assert any(r["answered"] < whole[r["id"]]["answered"] for r in records)


def test_budget_text_keeps_the_decimals_of_a_budget():
    assert [ca.budget_text(m) for m in (0.5, 30, 22.25, 90.0, 1 / 3)] == ["0.5", "30", "22.25", "90", "0.33"]


def test_a_killed_run_resumes_from_its_written_parts_to_the_uninterrupted_answers(targets, tmp_path, monkeypatch):
    a = answerer(targets, "stop")
    convs = conversations(11, seed=5)
    options = ca.AnswerOptions(temperatures=(0.0, 1.0), batch_size=3, seed=1)
    kwargs = dict(answerer=a, identity={"kind": "test"}, data={}, options=options)
    ca.answer_conversations(convs, tmp_path / "whole", **kwargs)
    real, writes = ca._Parts.write, []

    def dies_after_two_parts(self, *args, **kw):
        real(self, *args, **kw)
        writes.append(args[0])
        if len(writes) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(ca._Parts, "write", dies_after_two_parts)
    with pytest.raises(KeyboardInterrupt):
        ca.answer_conversations(convs, tmp_path / "a", **kwargs)
    partial = tmp_path / "a.partial"
    assert sorted(p.name for p in partial.glob("part-*.jsonl")) == [ca.part_name(k) for k in sorted(writes)]
    monkeypatch.setattr(ca._Parts, "write", real)
    lines = []
    meta = ca.answer_conversations(convs, tmp_path / "a", report=lines.append, **kwargs)
    assert lines == [f"resuming {partial}: 2 of 4 batch(es) already answered"]
    assert (tmp_path / "a" / ca.ANSWERS_FILE).read_bytes() == (tmp_path / "whole" / ca.ANSWERS_FILE).read_bytes()
    assert meta["batches_done"] == 4 and not partial.exists()


def test_an_unknown_engine_is_refused_in_one_line_before_any_work(targets, tmp_path):
    a = answerer(targets, "stop")
    with pytest.raises(SpecdecError, match="the answering engine must be one of batched, simple, got 'fast'"):
        ca.answer_conversations(conversations(2), tmp_path / "a", answerer=a, identity={}, data={},
                                options=ca.AnswerOptions(engine="fast"))
    assert not (tmp_path / "a.partial").exists()


def test_the_recipes_answers_step_runs_the_engine_and_prints_the_budget_with_its_decimals(hf, tmp_path, capsys):  # noqa: F811
    from test_eagle3_recipe import base, main, sharegpt_file

    assert main(*base(hf, sharegpt_file(tmp_path / "c.json"), tmp_path / "r"), "--until", "answers",
                "--answer-minutes", "0.5") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[answers] ")]
    assert lines and all(line.endswith("budget 0.5 min") for line in lines if "tokens/s," in line)
    meta = ca.read_answers(tmp_path / "r" / "answers")[1]
    assert meta["engine"] == "batched" and meta["written"] + meta["too_long"] == 20


@pytest.mark.real
def test_smollm2s_engine_answers_are_its_first_paths_greedy_in_fp32(smollm2):
    from specdec_models.hf import HFDecoder, logits_width
    from train.data.regenerate import stop_token

    model, tok, _ = smollm2
    a = ca.Answerer(HFDecoder(model, min(len(tok), logits_width(model))), tok, stop_token(tok, chat=True),
                    seq_len=160, max_new_tokens=20, chunk=3)
    chats = [("What is the capital of France?", "Name one river there.", "How long is it?"),
             ("Write a haiku about the sea.", "Now one about the mountains."),
             ("Hi!",), ("List three prime numbers.", "Add them up.", "Is the sum prime?"),
             ("Explain photosynthesis to a child in one sentence.", "Why are leaves green?")]
    convs = [Conversation(f"s{i}", tuple(t for q in qs for t in (Turn("user", q), Turn("assistant", "x"))), "test")
             for i, qs in enumerate(chats)]
    with torch.inference_mode():
        expected, counts = ca.answer_batch(convs, a, temperatures=(0.0,), first=0, seed=0)
        engine = AnswerEngine(a.decoder, tok, a.eos_id, a.seq_len, a.max_new_tokens, slots=a.chunk)
        done = dict(engine.run(list(enumerate(convs)), lambda c: ca.Dialogue(c, tok, a.seq_len), (0.0,), seed=0))
    records = [done[i].record for i in sorted(done) if done[i].record is not None]
    assert records == expected and counts["answers"] > len(convs)          # later turns answered too
    assert engine.counts.generated == counts["tokens"]
