"""Every `specdec ...` command the docs show runs as written, so a flag or verb that changes breaks
this test instead of a reader.

The commands are taken from README.md's and docs/*.md's code blocks and from the Makefile's
recipes (`$(SPECDEC) VERB ...`), continuation lines joined and comments, pipes and redirections
cut. Each runs in this process, twice: with `--help` appended (the verb exists: exit 0), and
parsed as written, its parser stopped right after `parse_args` returns (every flag known, every
value of the right type: a list comma-separated, a tree in the grammar, a dtype by name), before
any work. `specdec train`'s overrides are composed by Hydra instead (`train.run.compose`). Shell
expansions (`$M`, `$(...)`, `$((L/2))`) stand for values the reader supplies: they become a
placeholder path, so a flag that needs a number must show one.
"""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from conftest import REPO

from train import cli

PLACEHOLDER = "PATH"
CUT = {"|", "||", "&&", ";", "&"}


class _Parsed(Exception):
    """Raised by the patched `parse_args`: the command line parsed, nothing run."""


def _code_blocks(text: str) -> list[str]:
    """The fenced code blocks of a markdown text (any language but python, whose lines are code)."""
    blocks = re.findall(r"^```([\w-]*)\n(.*?)^```", text, flags=re.M | re.S)
    return [body for lang, body in blocks if lang not in ("python", "py", "json", "yaml", "toml")]


def _makefile_lines(text: str) -> list[str]:
    """The Makefile's `$(SPECDEC) VERB ...` recipe lines as shell lines: make's functions that add
    optional arguments dropped, its other variables a placeholder."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = []
    for line in joined.splitlines():
        if not line.startswith("\t") or "$(SPECDEC)" not in line:
            continue
        line = line.strip().replace("$(SPECDEC)", "specdec")
        line = re.sub(r"\$\((foreach|if) [^()]*(\([^()]*\)[^()]*)*\)", "", line)   # optional arguments
        line = re.sub(r"\$\(\w+_ARGS\)", "", line)
        while re.search(r"\$\$?\([^()]*\)", line):
            line = re.sub(r"\$\$?\([^()]*\)", PLACEHOLDER, line)
        lines.append(line)
    return lines


def _commands(lines: str) -> list[list[str]]:
    """The `specdec ...` commands of shell text, each as its argv after `specdec`."""
    found = []
    for line in re.sub(r"\\\n", " ", lines).splitlines():
        line = re.sub(r"\$\(\([^()]*\)\)", "1", line)                   # $((L/2)): arithmetic
        while re.search(r"\$\([^()]*\)", line):
            line = re.sub(r"\$\([^()]*\)", PLACEHOLDER, line)           # $(...): a command's output
        line = re.sub(r"\$\{?\w+\}?", PLACEHOLDER, line)                # $M, ${R}
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        while words and re.fullmatch(r"\w+=.*", words[0]):            # VAR=value before the command
            words = words[1:]
        if words[:1] != ["specdec"]:
            continue
        argv = []
        for word in words[1:]:
            if word in CUT or word.startswith((">", "2>", "<")):
                break
            argv.append(word)
        found.append(argv)
    return found


def doc_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every `specdec` command in README.md, docs/*.md and the Makefile."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in _code_blocks(path.read_text()):
            found += [(path.name, argv) for argv in _commands(block)]
    found += [("Makefile", argv) for argv in _commands("\n".join(_makefile_lines((REPO / "Makefile").read_text())))]
    return found


COMMANDS = doc_commands()


def test_the_docs_show_the_journeys_commands():
    verbs = {argv[0] for _, argv in COMMANDS if argv}
    assert {"plan", "eagle3", "evaluate", "train", "cache", "export-head", "decode"} <= verbs, verbs
    assert any(where == "Makefile" and argv[:1] == ["eagle3"] for where, argv in COMMANDS)


def test_a_wrong_flag_or_verb_in_a_doc_would_fail_this_test(monkeypatch):
    """The planted-bug twin: an unknown flag, a space-separated list, an unknown verb are caught."""
    for argv in (["evaluate", "--target", "x", "--no-such-flag"], ["cache", "--out", "c", "--temperatures", "0", "1"],
                 ["evaluate", "--target", "x", "--tree", "6,3"]):
        assert _parse_only(monkeypatch, argv) != "parsed", argv
    assert cli.main(["fly", "--help"]) == 2


def _parse_only(monkeypatch, argv: list[str]) -> str:
    """'parsed', or what stopped the command line before its parser returned."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    try:
        code = cli.main(argv)
    except _Parsed:
        return "parsed"
    finally:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    return f"exit {code}"


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[f"{w}:{' '.join(a)[:60]}" for w, a in COMMANDS])
def test_each_doc_command_names_a_verb_and_parses_as_written(where, argv, monkeypatch, capsys):
    if argv[:1] == ["train"]:
        from train.run import compose

        overrides = [a for a in argv[1:] if not a.startswith("-")]
        compose(overrides)                                   # an unknown key or group option raises
        return
    assert cli.main([*argv, "--help"]) == 0, f"{where}: specdec {shlex.join(argv)}: {capsys.readouterr().err}"
    result = _parse_only(monkeypatch, argv)
    assert result == "parsed", f"{where}: specdec {shlex.join(argv)}: {result}: {capsys.readouterr().err.strip()}"
