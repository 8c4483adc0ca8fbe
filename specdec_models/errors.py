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
