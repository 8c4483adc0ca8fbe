"""Files users hand in or ask for, outside training configs: scripts/make_prompts.py's --out and
--count, a prompts file's malformed line (`train.data.regenerate.read_prompts`), a model source that is
a plain file (`specdec_models.hf.weights.check_source`). Each mistake is one line (exit status 2
for the script) and changes nothing. No models: milliseconds."""

from __future__ import annotations

import json

import pytest

from conftest import command

from specdec_models.errors import SpecdecError
from specdec_models.hf.weights import check_source
from train.data.regenerate import read_prompts


def make_prompts():
    return command("make_prompts").main


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(" ".join(f"word{i} alpha beta gamma delta" for i in range(3000)))
    return path


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


def test_make_prompts_refuses_an_existing_out_file_unless_force(text, tmp_path, capsys):
    main, out = make_prompts(), tmp_path / "prompts.jsonl"
    out.write_text("my own prompts\n")
    assert main(["--text", str(text), "--count", "3", "--out", str(out)]) == 2
    assert one_line_error(capsys) == f"error: --out {out} exists: choose another file, or replace it with --force"
    assert out.read_text() == "my own prompts\n"
    assert main(["--text", str(text), "--count", "3", "--out", str(out), "--force"]) == 0
    assert len([json.loads(line) for line in out.read_text().splitlines()]) == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []     # written through a temp


@pytest.mark.parametrize("count", ["0", "-2"])
def test_make_prompts_count_must_be_positive(text, tmp_path, capsys, count):
    assert make_prompts()(["--text", str(text), "--count", count, "--out", str(tmp_path / "p.jsonl")]) == 2
    assert one_line_error(capsys) == f"error: --count must be a positive integer, got {int(count)}"
    assert not (tmp_path / "p.jsonl").exists()


def test_make_prompts_out_directory_is_one_line(text, tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    assert make_prompts()(["--text", str(text), "--count", "2", "--out", str(folder), "--force"]) == 2
    assert one_line_error(capsys) == f"error: --out {folder} is a directory: give the .jsonl file to write"
    assert list(folder.iterdir()) == []


class Tokenizer:
    chat_template = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": list(text.encode())}


def test_a_malformed_prompts_line_is_reported_at_its_own_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n{"prompt": x}\n')
    with pytest.raises(SpecdecError) as error:
        read_prompts(path, Tokenizer(), chat=False)
    assert str(error.value) == f"prompts file {path}, line 4 is not valid JSON: Expecting value at column 12"
    path.write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n')
    assert [len(p) for p in read_prompts(path, Tokenizer(), chat=False)] == [3, 3]


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_a_prompts_file_that_is_not_utf8_is_one_line_with_the_byte_offset(tmp_path, suffix):
    path = tmp_path / f"prompts{suffix}"
    head = '{"prompt": "où"}\n{"prompt": "caf'.encode()            # 33 bytes, 32 characters
    path.write_bytes(head + b"\xe9" + b'"}\n')
    with pytest.raises(SpecdecError) as error:
        read_prompts(path, Tokenizer(), chat=False)
    assert str(error.value).startswith(f"{path}: not UTF-8 text (invalid continuation byte at byte offset 33)")
    assert len(head) == 33 and "\n" not in str(error.value)


def test_a_plain_file_as_a_model_source_says_what_it_is(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    with pytest.raises(SpecdecError) as error:
        check_source(notes, "target.path")
    assert str(error.value) == (f"target.path: {notes} is a file, not a GGUF file (.gguf) or a Hugging Face "
                                f"model directory")
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    with pytest.raises(SpecdecError, match=r"^target.path: .*model.gguf is not a GGUF file"):
        check_source(fake, "target.path")
    unnamed = tmp_path / "model.bin"
    unnamed.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(SpecdecError, match=r"is a GGUF file without the .gguf suffix"):
        check_source(unnamed, "target.path")
    with pytest.raises(SpecdecError, match=r"model directory .*missing does not exist"):
        check_source(tmp_path / "missing", "target.path")
