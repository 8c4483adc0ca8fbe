"""train.data.chat_answers and train.data.chat_rows: the target answers conversations turn by turn
(its own earlier answers in the context), resumably; the answered conversations become rows with the
answers-only mask, an embeddings cache (offline) and data=hf_chat batches (online); task=hf_eagle3
trains from both. Tiny random Llama targets over the word-level tokenizer of test_hf_data."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_hf_data import stopping_target, text_setup
from test_hf_distill import save_model

import train.run as train_run
from specdec_models.errors import SpecdecError
from train.data import chat_answers as ca
from train.data.chat_rows import HFChatDataModule, chat_rows, row_order
from train.data.conversations import Conversation, Turn, render_turns
from train.data.embeddings_cache import cache_rows, check_cache, open_cache
from train.data.hf_embeddings import label_mask

pytestmark = pytest.mark.usefixtures("offline", "one_thread")
SEQ = 48


def conv(cid, *texts, system=None):
    turns = [Turn("system", system)] if system else []
    for i, text in enumerate(texts):
        turns.append(Turn("user" if i % 2 == 0 else "assistant", text))
    return Conversation(cid, tuple(turns), "test")


CONVS = [conv(f"c{i}", "the quick fox", "a draft", "one two three", "four five", "is it fast", "ten")
         for i in range(6)] + [conv("short", "large model", "small model")]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    setup = text_setup(d, docs=40, prompt_docs=4)
    stopping_target(d / "stop", setup["tok"])
    return {**setup, "stop": d / "stop", "random": save_model(d / "random", setup["tok"], "llama", 1)}


@pytest.fixture(scope="module")
def answered(hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("answers") / "answers"
    answerer, identity = ca.load_answerer(hf["stop"], seq_len=SEQ, max_new_tokens=8)
    heard = []
    meta = ca.answer_conversations(CONVS, out, answerer=answerer, identity=identity, data={"source": "test"},
                                   options=ca.AnswerOptions(temperatures=(0.0, 1.0), batch_size=3, seed=1,
                                                            engine="simple"),
                                   progress=lambda *a: heard.append(a))
    assert heard[-1] == (len(CONVS), len(CONVS), meta["tokens"], "")         # after the last batch
    assert any(where.startswith("batch 1/3, turn 2") for *_, where in heard)   # and within each batch, per turn
    return out, meta


class Canned:
    """An answerer that answers each context with the words "fast" repeated (number of user turns
    so far) times, ending its turn, and records every context it was given."""

    def __init__(self, tok, seq_len=200):
        self.tokenizer, self.seq_len, self.max_new_tokens, self.seen = tok, seq_len, 8, []
        self.decoder = type("D", (), {"device": torch.device("cpu")})()

    def __call__(self, prompts, temperature, generator, each=None):
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p.tolist())
            self.seen.append(text)
            n = text.count(" user ")
            out.append((self.tokenizer.convert_tokens_to_ids(["fast"] * n), True))
        if each is not None:
            each(sum(len(a) + 1 for a, _ in out))
        return out


def test_each_turn_is_answered_from_the_targets_own_earlier_answers(hf):
    answerer = Canned(hf["tok"])
    records, counts = ca.answer_batch([CONVS[0], CONVS[-1]], answerer, temperatures=(0.0,), first=0, seed=0)
    first = [m["content"] for m in records[0]["messages"] if m["role"] == "assistant"]
    assert first == ["fast", "fast fast", "fast fast fast"]          # the data's answers ("a draft", ...) replaced
    assert [m["content"] for m in records[0]["messages"] if m["role"] == "user"] == \
        ["the quick fox", "one two three", "is it fast"]
    turn3 = [s for s in answerer.seen if s.count(" user ") == 3][0]
    assert "assistant fast <eos>" in turn3 and "assistant fast fast <eos>" in turn3 and "a draft" not in turn3
    assert counts["answers"] == 4 and counts["tokens"] == 1 + 2 + 3 + 1 + 4     # each answer's eos counted
    assert not records[0]["truncated"] and records[0]["answered"] == 3


def test_a_context_without_room_ends_the_conversation_and_one_that_never_fits_is_counted(hf):
    long = conv("long", " ".join(["one"] * 25), "two", " ".join(["three"] * 30), "four")
    records, counts = ca.answer_batch([long, conv("huge", " ".join(["one"] * 80), "x")], Canned(hf["tok"], seq_len=48),
                                      temperatures=(0.0,), first=0, seed=0)
    assert [r["id"] for r in records] == ["long"] and counts["too_long"] == 1
    assert [m["role"] for m in records[0]["messages"]] == ["user", "assistant"]   # turn 2's context left no room


def test_answers_stop_at_end_of_turn_are_recorded_and_read_back(hf, answered):
    out, meta = answered
    pairs, read_meta = ca.read_answers(out)
    assert len(pairs) == meta["written"] == len(CONVS) and meta["too_long"] == 0
    assert read_meta["temperatures"] == [0.0, 1.0] and meta["tokens"] > 0 and meta["tokens_per_second"] > 0
    data = {c.id: c for c in CONVS}
    for c, _truncated in pairs:
        users = [t.content for t in c.turns if t.role == "user"]
        assert users == [t.content for t in data[c.id].turns if t.role == "user"][:len(users)]
        assert all(t.content not in ("a draft", "four five", "ten") for t in c.turns if t.role == "assistant")
    assert any(not t and len([x for x in c.turns if x.role == "assistant"]) == 3 for c, t in pairs)
    assert (out / ".specdec").read_text().strip() == ca.ANSWERS_KIND
    assert not out.with_name(out.name + ".partial").exists()


def test_a_killed_run_resumes_to_the_uninterrupted_answers(hf, answered, tmp_path, monkeypatch):
    out, _ = answered
    answerer, identity = ca.load_answerer(hf["stop"], seq_len=SEQ, max_new_tokens=8)
    real = ca.answer_batch
    calls = []

    def dies_on_the_second_batch(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ca, "answer_batch", dies_on_the_second_batch)
    options = ca.AnswerOptions(temperatures=(0.0, 1.0), batch_size=3, seed=1, engine="simple")
    kwargs = dict(answerer=answerer, identity=identity, data={"source": "test"}, options=options)
    with pytest.raises(KeyboardInterrupt):
        ca.answer_conversations(CONVS, tmp_path / "a", **kwargs)
    assert (tmp_path / "a.partial" / "part-00000.jsonl").is_file() and not (tmp_path / "a").exists()
    lines = []
    meta = ca.answer_conversations(CONVS, tmp_path / "a", report=lines.append, **kwargs)
    assert lines == [f"resuming {tmp_path / 'a.partial'}: 1 of 3 batch(es) already answered"]
    assert (tmp_path / "a" / ca.ANSWERS_FILE).read_bytes() == (out / ca.ANSWERS_FILE).read_bytes()
    assert meta["written"] == len(CONVS)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        ca.answer_conversations(CONVS, tmp_path / "b", **kwargs)
    with pytest.raises(SpecdecError, match=r"other settings \(seed differ"):   # a partial run of other settings is kept
        ca.answer_conversations(CONVS, tmp_path / "b", **{**kwargs, "options": replace(options, seed=2)})
    assert (tmp_path / "b.partial" / "part-00000.jsonl").is_file()


def test_rows_mask_the_answers_only_and_a_cut_answer_loses_the_templates_end_of_turn(hf):
    tok = hf["tok"]
    c = conv("x", "the quick fox", "a draft", "one two", "four five")
    rows, counts = chat_rows(tok, [(c, False), (c, True)], SEQ)
    r = render_turns(tok, c)
    n = len(r.input_ids)
    assert rows["tokens"][0, :n].tolist() == r.input_ids and rows["loss_mask"][0, :n].tolist() == r.loss_mask
    assert rows["valid_len"].tolist() == [n, n - 1] and rows["loss_mask"][:, n:].sum() == 0
    assert rows["tokens"][1, n - 1] == tok.eos_token_id == rows["tokens"][1, -1]       # padded with the stop token
    assert rows["loss_mask"][1, n - 1] == 0 and rows["loss_mask"][1, :n - 1].tolist() == r.loss_mask[:n - 1]
    assert rows["prompt_len"][0] == r.loss_mask.index(1)
    assert counts["rows"] == 2 and counts["answer_tokens"] == 2 * sum(r.loss_mask) - 1
    # the eagle3 task's labels: position j counts where token j + 1 is an answer token
    batch = {"tokens": torch.from_numpy(rows["tokens"]), "loss_mask": torch.from_numpy(rows["loss_mask"]).bool()}
    assert label_mask(batch, SEQ)[0].tolist() == [bool(m) for m in rows["loss_mask"][0, 1:]]


def test_row_order_puts_held_out_rows_last_and_repeats_training_rows_by_pass():
    order = row_order(4, 2, 10, seed=0)
    assert order[-2:].tolist() == [4, 5] and sorted(order[:4].tolist()) == [0, 1, 2, 3]
    assert sorted(order[4:8].tolist()) == [0, 1, 2, 3] and len(order) == 10
    assert row_order(4, 2, None, 0).tolist()[:4] != [] and len(row_order(4, 2, None, 0)) == 6


@pytest.fixture(scope="module")
def chat_cache(hf, answered, tmp_path_factory):
    from train.data.chat_rows import ChatSource, build_chat_cache
    from train.data.embeddings_cache import CacheSettings
    pairs, _ = ca.read_answers(answered[0])
    out = tmp_path_factory.mktemp("cc") / "cache"
    source = ChatSource(pairs[:-2], pairs[-2:], layers=[0, 1, 2], describe={"answers": str(answered[0])})
    meta = build_chat_cache(hf["stop"], source, out, CacheSettings(seq_len=SEQ, dtype="bfloat16", batch_size=2))
    return out, meta


def test_the_cache_of_conversation_rows_holds_their_mask_and_the_teacher_forced_states(hf, chat_cache):
    from specdec_models.hf.weights import load_causal_lm
    out, meta = chat_cache
    assert meta["held_out_rows"] == 2 and meta["windows"] == len(CONVS) and meta["source"]["kind"] == "conversations"
    meta = check_cache(out)
    batch = cache_rows(open_cache(out, meta), np.arange(meta["windows"]), meta)
    assert batch["loss_mask"].shape == (len(CONVS), SEQ + 1) and batch["loss_mask"].dtype == torch.bool
    assert all(batch["loss_mask"][i, :int(batch["prompt_len"][i])].sum() == 0 for i in range(len(CONVS)))
    model = load_causal_lm(hf["stop"]).eval()
    with torch.no_grad():
        states = model(batch["tokens"][:, :-1], output_hidden_states=True).hidden_states
    want = torch.cat([states[i] for i in (0, 1, 2)], -1)
    torch.testing.assert_close(batch["embeds"].float(), want, rtol=2e-2, atol=2e-2)   # bf16 storage


def _cfg(hf, out, *extra):
    """experiment=hf_eagle3 at test sizes on the stopping target (test_hf_prophet_task's settings)."""
    return train_run.compose([
        "experiment=hf_eagle3", f"target.path={hf['stop']}", f"output_dir={out}", "trainer=cpu", f"data.seq_len={SEQ}",
        "data.batch_size=4", "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.num_sanity_val_steps=0",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "optim.lr=3e-3", "optim.warmup_steps=1", "head.draft_vocab_size=null", "head.aux_layers=[0,1,2]",
        "task.ttt_steps=2", "callbacks.progress_bar=null", "callbacks.speculative_eval.num_prompts=2",
        "callbacks.speculative_eval.prompt_len=8", "callbacks.speculative_eval.max_new_tokens=8", *extra])


def test_eagle3_trains_from_the_conversation_cache_and_online_from_the_answers(hf, answered, chat_cache, tmp_path):
    cached = train_run.run(_cfg(hf, tmp_path / "cached", "data=hf_embeddings", f"data.cache={chat_cache[0]}",
                                "data.val_windows=2", "data.val_batch_size=2", "callbacks.speculative_eval=null"))
    online = train_run.run(_cfg(hf, tmp_path / "online", "data=hf_chat", f"data.answers={answered[0]}",
                                "data.val_windows=2", "data.val_batch_size=2", "data.held_out=0.7",
                                "callbacks.speculative_eval.num_prompts=2"))
    for result in (cached, online):
        assert result["global_step"] == 6 and np.isfinite(result["metrics"]["val/loss"])
    assert json.loads((tmp_path / "online" / "export" / "config.json").read_text())


def test_hf_chat_batches_are_pure_functions_of_the_step_and_hold_the_mask(hf, answered):
    dm = HFChatDataModule(answers=str(answered[0]), tokenizer=str(hf["stop"]), seq_len=SEQ, batch_size=3,
                          val_windows=2, held_out=0.7)
    dm.setup()
    a = next(iter(dm.train_dataloader()))
    b = next(iter(dm.train_dataloader()))
    assert torch.equal(a["tokens"], b["tokens"]) and a["loss_mask"].dtype == torch.bool
    assert a["tokens"].shape == a["loss_mask"].shape == (3, SEQ + 1)
    assert len(dm.prompts(2, 8)) == 2 and all(p.numel() > 0 for p in dm.prompts(2, 8))
    with pytest.raises(SpecdecError, match="needs data.answers"):
        HFChatDataModule(tokenizer=str(hf["stop"]))


def test_the_peers_rows_carry_the_conversation_mask_as_the_eagle3_task_reads_it(chat_cache):
    from train.data.peer_formats import iter_rows
    out, _ = chat_cache
    meta = check_cache(out)
    batch = cache_rows(open_cache(out, meta), np.arange(meta["windows"]), meta)
    for r, row in enumerate(iter_rows(out)):
        T = len(row["tokens"])
        assert T == min(int(batch["valid_len"][r]), SEQ)
        assert row["mask"].tolist() == batch["loss_mask"][r, 1:T + 1].tolist()


def test_a_line_separator_inside_an_answer_does_not_split_its_record(hf, tmp_path):
    # str.splitlines() also breaks at U+2028, which json.dumps(ensure_ascii=False) leaves raw in ShareGPT text
    from train.data.conversations import read_conversations
    path = tmp_path / "m.jsonl"
    rows = [ca.record(conv("a", "one\u2028two", "three")), ca.record(conv("b", "four", "five\u2029six"))]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    convs, counts = read_conversations(path)
    assert [c.id for c in convs] == ["a", "b"] and convs[0].turns[0].content == "one\u2028two"
    from train.eagle3_recipe import _read
    assert [c.turns[1].content for c in _read(path)] == ["three", "five\u2029six"]
