"""train.data.hf_text: text through a Hugging Face tokenizer, cached as memory-mapped Arrow windows.
A tiny word-level tokenizer built locally (no hub), saved with save_pretrained as a model
directory would hold it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from specdec_models.errors import SpecdecError

pytestmark = pytest.mark.usefixtures("offline", "one_thread")

WORDS = ("the quick brown fox jumps over lazy dog a draft verifies target model tokens speculative decoding "
         "is fast small large one two three four five six seven eight nine ten").split()
SPECIALS = ["<unk>", "<pad>", "<eos>", "<bos>"]
CHAT_TEMPLATE = ("{% for m in messages %}<bos> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}<bos> assistant {% endif %}")


def build_tokenizer(path, words=WORDS, eos="<eos>", extra=(), chat_template=CHAT_TEMPLATE):
    """A word-level tokenizer over `words` (+ the roles of the chat template), saved to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIALS, *extra, *words, "user", "assistant", "system"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token=eos,
                                  bos_token="<bos>")
    tok.chat_template = chat_template
    tok.save_pretrained(path)
    return tok


def write_corpus(path, docs=60, seed=0):
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, rng.integers(3, 12))) for _ in range(docs)]
    path.write_text("\n".join(lines) + "\n")
    return lines


def text_setup(d, docs, prompt_docs) -> dict:
    """In folder `d`: the tokenizer (tok/), a corpus of `docs` documents and a chat prompts file of
    `prompt_docs` user messages (another seed): {"tok", "corpus", "prompts", "root"}, what the tests
    of Hugging Face caches and heads start from."""
    tok = build_tokenizer(d / "tok")
    corpus = d / "corpus.txt"
    write_corpus(corpus, docs=docs)
    prompts = d / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": line}]})
                                 for line in write_corpus(d / "p.txt", docs=prompt_docs, seed=1)) + "\n")
    return {"tok": tok, "corpus": corpus, "prompts": prompts, "root": d}


def stopping_target(path, tok, **model) -> None:
    """Save at `path` a tiny random Llama (test_hf_distill.save_model) whose EOS logit copies the
    row of the token its greedy chat answers emit most, so regenerated rows stop at EOS."""
    import torch

    from test_hf_distill import save_model

    from specdec_models.hf.weights import load_causal_lm

    save_model(path, tok, "llama", 5, **model)
    target = load_causal_lm(path)
    with torch.no_grad():
        text = tok.apply_chat_template([{"role": "user", "content": "the quick fox"}], add_generation_prompt=True,
                                       tokenize=False)
        ids = torch.tensor(tok(text)["input_ids"])[None]
        new = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                              pad_token_id=0, eos_token_id=[len(tok)])[0, ids.shape[1]:]
        target.lm_head.weight[tok.eos_token_id] = 1.5 * target.lm_head.weight[int(new.mode().values)]
    target.save_pretrained(path)


@pytest.fixture
def setup(tmp_path):
    tok_dir = tmp_path / "tok"
    tok = build_tokenizer(tok_dir)
    corpus = tmp_path / "corpus.txt"
    lines = write_corpus(corpus)
    return tok, tok_dir, corpus, lines


def datamodule(tok_dir, files, cache, **kw):
    from train.data.hf_text import HFTextDataModule

    args = dict(files=[str(files)] if not isinstance(files, list) else files, tokenizer=str(tok_dir), seq_len=15,
                batch_size=4, val_windows=3, val_batch_size=2, windows_dir=str(cache))
    dm = HFTextDataModule(**{**args, **kw})
    dm.prepare_data()
    dm.setup("fit")
    return dm


def expected_stream(tok, lines):
    ids = []
    for line in lines:
        ids += tok(line)["input_ids"] + [tok.eos_token_id]
    return np.array(ids)


def test_windows_are_the_tokenized_documents_cut_into_seq_len_plus_one(setup, tmp_path):
    tok, tok_dir, corpus, lines = setup
    dm = datamodule(tok_dir, corpus, tmp_path / "cache")
    stream = expected_stream(tok, lines)
    n = len(stream) // 16
    windows = dm.windows()[:]["input_ids"]
    assert windows.shape == (n, 16)
    np.testing.assert_array_equal(windows.reshape(-1), stream[: n * 16])
    np.testing.assert_array_equal(dm.validation_windows(), windows[-3:])
    assert dm.train_rows == n - 3
    val = torch.cat(list(dm.val_dataloader()))
    assert val.dtype == torch.long and val.tolist() == windows[-3:].tolist()
    # train batches: (batch, seq_len + 1) from the training rows only, a pure function of (seed, rank, k)
    loader = iter(dm.train_dataloader())
    first = [next(loader) for _ in range(3)]
    train_rows = {tuple(r) for r in windows[:-3].tolist()}
    assert all(b.shape == (4, 16) and {tuple(r) for r in b.tolist()} <= train_rows for b in first)
    from train.data.hf_text import RandomRows

    again = RandomRows(dm.windows(), dm.train_rows, 4, 0, 0, start=2)
    assert torch.equal(next(iter(again)), first[2])          # a resumed stream continues where it stopped
    prompts = dm.prompts(2, 5)
    flat = windows[-3:].reshape(-1).tolist()
    assert prompts.shape == (2, 5)
    assert all(any(flat[i:i + 5] == p for i in range(len(flat))) for p in prompts.tolist())
    assert dm.decode_text(prompts[0]) == tok.decode(prompts[0].tolist())


def test_the_cache_is_reused_and_keyed_by_settings_tokenizer_and_files(setup, tmp_path, monkeypatch):
    from train.data import hf_text as hf_data

    tok, tok_dir, corpus, lines = setup
    calls = []
    real = hf_data.tokenize_documents
    monkeypatch.setattr(hf_data, "tokenize_documents", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = tmp_path / "cache"
    first = datamodule(tok_dir, corpus, cache)
    assert first.built and len(calls) == 1
    second = datamodule(tok_dir, corpus, cache)
    assert not second.built and len(calls) == 1                 # not tokenized again
    assert second.windows_path == first.windows_path
    assert second.windows()[:]["input_ids"].tolist() == first.windows()[:]["input_ids"].tolist()
    assert not list(first.windows_path.parent.glob(".tmp-*"))
    # another window length, another tokenizer, a changed file: a new cache entry each
    assert datamodule(tok_dir, corpus, cache, seq_len=7).windows_path != first.windows_path
    other = build_tokenizer(tmp_path / "tok2", extra=("<sep>",))
    assert datamodule(tmp_path / "tok2", corpus, cache).windows_path != first.windows_path
    corpus.write_text(corpus.read_text() + "one two three\n")
    assert datamodule(tok_dir, corpus, cache).windows_path != first.windows_path
    assert len(calls) == 4 and len(other) == len(tok) + 1


def test_jsonl_records_and_a_save_to_disk_directory_give_the_same_windows(setup, tmp_path):
    import datasets

    tok, tok_dir, corpus, lines = setup
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": line, "id": i}) + "\n" for i, line in enumerate(lines)))
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": lines}).save_to_disk(str(saved))
    from_txt = datamodule(tok_dir, corpus, tmp_path / "c1").windows()[:]["input_ids"]
    from_json = datamodule(tok_dir, jsonl, tmp_path / "c2", text_field="body").windows()[:]["input_ids"]
    from_disk = datamodule(tok_dir, saved, tmp_path / "c3", text_field="body").windows()[:]["input_ids"]
    assert from_txt.tolist() == from_json.tolist() == from_disk.tolist()


def test_chat_documents_go_through_the_chat_template(setup, tmp_path):
    tok, tok_dir, corpus, lines = setup
    jsonl = tmp_path / "chat.jsonl"
    convs = [[{"role": "user", "content": lines[i]}, {"role": "assistant", "content": lines[i + 1]}]
             for i in range(0, 40, 2)]
    jsonl.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    dm = datamodule(tok_dir, jsonl, tmp_path / "cache", chat=True, add_eos=False)
    stream = []
    for c in convs:
        stream += tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"]
    windows = dm.windows()[:]["input_ids"].reshape(-1)
    assert windows.tolist() == stream[: len(windows)]
    assert windows[0] == tok.bos_token_id and tok.convert_tokens_to_ids("user") in windows[:3]


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("suffix", "use .txt, .json or .jsonl"),
    ("short", "more than data.val_windows"),
    ("field", "text_field 'content' is not a field"),
    ("no_template", "chat template"),
])
def test_bad_data_gives_a_one_line_error(setup, tmp_path, case, message):
    tok, tok_dir, corpus, lines = setup
    kw = {}
    files = corpus
    if case == "missing":
        files = tmp_path / "nope.txt"
    elif case == "suffix":
        files = tmp_path / "data.csv"
        files.write_text("a,b\n")
    elif case == "short":
        kw["val_windows"] = 1000
    elif case == "field":
        files = tmp_path / "d.jsonl"
        files.write_text(json.dumps({"text": "the fox"}) + "\n")
        kw["text_field"] = "content"
    else:
        build_tokenizer(tmp_path / "plain", chat_template=None)
        tok_dir, kw["chat"] = tmp_path / "plain", True
    with pytest.raises(SpecdecError, match=message) as err:
        datamodule(tok_dir, files, tmp_path / "cache", **kw)
    assert "\n" not in str(err.value)
