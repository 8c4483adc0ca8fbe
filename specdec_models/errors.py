"""The one exception type users see for bad input.

Every check on user input (configs, prompts, sampling settings, export directories) raises
`SpecdecError` with a one-line message, so CLIs can print it and exit 2 instead of dumping a
traceback. It subclasses `ValueError`, so callers that already catch that keep working.
"""


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
