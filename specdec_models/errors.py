"""The one exception type users see for bad input.

Every check on user input (configs, prompts, sampling settings, export directories) raises
`SpecdecError` with a one-line message, so CLIs can print it and exit 2 instead of dumping a
traceback. It subclasses `ValueError`, so callers that already catch that keep working.
`cli_main` is the one place that turns it into that line and exit code 2; `prog` names a command
in its usage line (`specdec VERB` when the `specdec` command runs it).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator


class SpecdecError(ValueError):
    """Bad input or a bad file, with a one-line message that says what to fix."""


def check(condition: bool, message: str) -> None:
    """Raise `SpecdecError(message)` unless `condition` holds."""
    if not condition:
        raise SpecdecError(message)


def check_positive_int(value: object, name: str) -> None:
    """Raise `SpecdecError` unless `value` is an integer >= 1 (booleans are not integers here)."""
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
          f"{name} must be a positive integer, got {value!r}")


def cli_main(main: Callable[..., int | None]) -> Callable[..., int]:
    """Decorate a command's `main(argv=None)`: a `SpecdecError` raised anywhere inside becomes one
    line, `error: ...` on stderr (a multi-line message folded onto one), and exit code 2; any other
    return value is the exit code (None is 0). Commands check their inputs first, so the error comes
    before any work."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            code = main(*args, **kwargs)
        except SpecdecError as error:
            print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
            return 2
        return 0 if code is None else int(code)

    return wrapper


_COMMAND: list[str] = []      # `specdec VERB` while the `specdec` command runs a verb (`command_name`)


def prog(default: str) -> str:
    """The name a command's usage line shows: `specdec VERB` while the `specdec` command runs it
    (`command_name`), else `default` (e.g. "specdec evaluate")."""
    return _COMMAND[-1] if _COMMAND else default


@contextlib.contextmanager
def command_name(name: str) -> Iterator[None]:
    """Within the block, commands name themselves `name` in their usage lines (`prog`). sys.argv
    stays as it was: Lightning's DDP launcher starts its processes from it."""
    _COMMAND.append(name)
    try:
        yield
    finally:
        _COMMAND.pop()
