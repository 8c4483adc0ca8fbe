"""The flag vocabulary every command shares: its parser, and lists written one way.

Every `specdec` verb builds its command line with `Parser`, whose errors (an unknown flag, a
missing value, a value of the wrong type) are `SpecdecError`s: one line and exit status 2 under
`errors.cli_main`, like every other bad input.

A flag taking several numbers or names takes them comma-separated, one word:
`--temperatures 0,1`, `--layers 2,16,29,32`, `--benchmarks mt_bench,humaneval` (`add_list_argument`,
`comma_list`). Flags taking several files or Hydra overrides take them as separate words instead,
because a comma is legal inside a path and inside an override (`trainer.devices=[0,1]`). The other
shared pieces: dtype names (`specdec_models.cpu.add_dtype_argument`), device names
(`specdec_models.device`) and the draft tree's grammar (`specdec_models.decode.tree.add_tree_argument`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .errors import SpecdecError


class Parser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose usage errors raise `SpecdecError` (one line, exit 2 under
    `cli_main`) instead of printing the usage and exiting; `--help` still prints and exits 0."""

    def error(self, message: str):
        raise SpecdecError(message)

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, except that a `--flag` this parser (or a subcommand's) does not know is the
        error even when a required flag is missing too: the typo is what the user has to fix."""
        words = sys.argv[1:] if args is None else list(args)
        if self._subparsers is None and "--" not in words:
            known = tuple(self._option_string_actions)
            for word in words:
                flag = word.partition("=")[0]
                if flag.startswith("--") and not any(k.startswith(flag) for k in known):
                    self.error(f"unrecognized arguments: {word}")
        return super().parse_known_args(args, namespace)


def comma_list(convert: Callable[[str], Any] = str, flag: str = "the list", *, choices: Sequence | None = None,
               distinct: bool = False) -> Callable[[str], list]:
    """An argparse type: 'A,B,C' as [convert(A), convert(B), convert(C)], each one of `choices` when
    given, each once when `distinct`; one line naming `flag` otherwise."""
    kind = {int: "integers", float: "numbers"}.get(convert, "names")

    def parse(text: str) -> list:
        values = []
        for part in (p.strip() for p in text.split(",") if text.strip()):   # '' is the empty list
            try:
                value = convert(part)
            except (ValueError, TypeError):
                raise argparse.ArgumentTypeError(f"{flag} is comma-separated {kind} (e.g. "
                                                  f"{'0,1' if kind != 'names' else 'a,b'}), got {text!r}") from None
            if choices is not None and value not in choices:
                raise argparse.ArgumentTypeError(f"{flag}: {part!r} is not one of {', '.join(map(str, choices))}")
            if distinct and value in values:
                raise argparse.ArgumentTypeError(f"{flag}: {part} is given twice")
            values.append(value)
        return values

    parse.__name__ = f"comma-separated {kind}"
    return parse


def add_list_argument(parser: argparse.ArgumentParser, flag: str, convert: Callable[[str], Any] = str, *,
                      help: str, default: Sequence | None = None, choices: Sequence | None = None,
                      distinct: bool = False, metavar: str | None = None, **kwargs) -> argparse.Action:
    """Add `flag` to `parser`: comma-separated values (`comma_list`), a list; `help` says what they
    are, the default and the syntax are appended to it."""
    shown = "" if default is None else f" (default {','.join(map(str, default))})"
    if metavar is None:
        metavar = "A,B,..." if choices is None else "{" + ",".join(map(str, choices)) + "},..."
    return parser.add_argument(flag, type=comma_list(convert, flag, choices=choices, distinct=distinct),
                               default=None if default is None else list(default), metavar=metavar,
                               help=f"{help}, comma-separated{shown}", **kwargs)


__all__ = ["Parser", "add_list_argument", "comma_list"]
