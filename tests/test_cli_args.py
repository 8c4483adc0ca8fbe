"""One flag vocabulary: the tree grammar parsed by one function with one help text, lists written
comma-separated, usage errors one line and exit 2 (`specdec_models.cli_args`,
`specdec_models.decode.tree.add_tree_argument`)."""

from __future__ import annotations

import pytest

from specdec_models.cli_args import Parser, comma_list
from specdec_models.decode.tree import TREE_HELP, TREE_METAVAR, TreeSpec, add_tree_argument
from specdec_models.errors import SpecdecError
from train import cli


def test_a_comma_list_parses_numbers_names_and_the_empty_list():
    assert comma_list(float, "--temperatures")("0,1") == [0.0, 1.0]
    assert comma_list(int, "--layers")("2,16,-1") == [2, 16, -1]
    assert comma_list(str, "--methods", choices=("base", "draft"))("base, draft") == ["base", "draft"]
    assert comma_list(int, "--sizes")("") == []


@pytest.mark.parametrize("argv, message", [
    (["--temperatures", "0 1"], "--temperatures is comma-separated numbers"),
    (["--methods", "base,peer"], "--methods: 'peer' is not one of base, draft"),
    (["--layers", "2,2"], "--layers: 2 is given twice"),
    (["--tree", "6,3"], "a tree is DEPTH,TOPK,WIDTH"),
    (["--bogus", "1"], "unrecognized arguments: --bogus"),
])
def test_a_bad_list_tree_or_flag_is_the_parsers_one_line_error(argv, message):
    p = Parser(prog="t")
    p.add_argument("--temperatures", type=comma_list(float, "--temperatures"))
    p.add_argument("--methods", type=comma_list(str, "--methods", choices=("base", "draft")))
    p.add_argument("--layers", type=comma_list(int, "--layers", distinct=True))
    add_tree_argument(p, "the tree")
    with pytest.raises(SpecdecError, match="^") as err:
        p.parse_args(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_tree_flag_shares_the_one_grammar_and_help():
    p = Parser(prog="t")
    action = add_tree_argument(p, "what it does here", default="6,3,1,0.1")
    assert action.metavar == TREE_METAVAR and action.help.endswith(TREE_HELP)
    assert p.parse_args([]).tree == "6,3,1,0.1" and p.parse_args(["--tree", ""]).tree == ""
    assert TreeSpec.parse(p.parse_args(["--tree", "8,4,3,4..16,0.2"]).tree) == TreeSpec(
        8, 4, 3, lookup=4, lookup_max=16, min_prob=0.2)


@pytest.mark.parametrize("verb", ["eagle3", "evaluate", "decode", "export-eagle3", "bench"])
def test_each_verb_that_drafts_a_tree_shows_the_one_tree_grammar(verb, capsys):
    argv = [verb, "cpu", "--help"] if verb == "bench" else [verb, "--help"]
    assert cli.main(argv) == 0
    assert TREE_METAVAR in capsys.readouterr().out


def test_evaluate_accepts_the_lookup_trees_the_docs_suggest(tmp_path):
    from train.bench.eval_job import EvalJob, check_job

    for tree in ("8,4,3,4..16,0.2", "6,3,1,4..16,0.3", "6,3,1,0.1"):
        job = EvalJob(target=str(tmp_path), heads=("mine=x",), tree=tree, lookup="4..16", out=str(tmp_path / "o"))
        with pytest.raises(SpecdecError) as err:     # the target folder is empty: refused after the tree's check
            check_job(job, load_prompts=False, heads_exist=False)
        assert "tree" not in str(err.value)


def _every_parser(monkeypatch) -> list:
    """The parser of every `specdec` verb (each `bench` tool's and subcommand's too), caught as it
    parses, before any work."""
    import argparse

    found = []

    class Caught(Exception):
        pass

    def parse_args(self, args=None, namespace=None):
        found.append(self)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                found.extend(action.choices.values())
        raise Caught

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    verbs = [[v] for v in {**cli.VERBS, **cli.TOOLS} if v not in ("bench", "train")]
    for verb in verbs + [["bench", name] for name in cli.BENCH]:
        with pytest.raises(Caught):
            cli.main(verb)
    return found


def test_every_flag_of_every_verb_has_its_help(monkeypatch):
    parsers = _every_parser(monkeypatch)
    assert len(parsers) >= len(cli.VERBS) + len(cli.TOOLS) + len(cli.BENCH) - 3
    missing = [f"{p.prog} {a.option_strings[0]}" for p in parsers for a in p._actions
               if a.option_strings and not a.help and a.dest != "help"]
    assert missing == []
    for p in parsers:
        p.format_help()                      # every help text formats (a stray '%' would raise)
