"""SHA256SUMS: the checksum file written beside the weights of the vLLM (speculators) and SGLang layouts.

specdec's own export records its weights' sha256 in its config.json (`export.specdec`) and refuses
a weights file that no longer hashes to it. A foreign layout's config.json belongs to the server
that reads it (speculators validates its fields), so there the same check lives in a file of its
own, in the format `sha256sum` writes and checks (`cd DIR && sha256sum -c SHA256SUMS`): one line
per weights file, `<64 hex digits>  <file name>`.

`write_checksums` writes it with the layout (`export.layouts.save_layout`); `check_checksums`
verifies it, when it is there, before the weights are read (`export.layouts.read_weights`): a
file that hashes otherwise, a listed file that is missing, or a weights file it does not list is
refused in one line naming the file. A folder without it (a head written by speculators or
SpecForge) loads unchecked, as before. It covers the weights only: config.json is checked field by
field on load, and a user may edit it for the server (its `speculative_tokens`, say).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ..errors import SpecdecError, check

CHECKSUMS_NAME = "SHA256SUMS"
# sha256sum's line: the digest, then "  NAME" (text mode) or " *NAME" (binary mode)
_LINE = re.compile(r"^(?P<digest>[0-9a-fA-F]{64}) [ *](?P<name>[^/\\]+)$")


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 (hex) of a file's bytes, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_checksums(directory: Path, names: list[str]) -> Path:
    """Write `directory`/SHA256SUMS for the files `names` in it (fsynced; the caller makes the
    folder appear whole, `files.staged_dir`) and return its path."""
    text = "".join(f"{sha256_file(directory / name)}  {name}\n" for name in sorted(names))
    path = directory / CHECKSUMS_NAME
    with open(path, "wb") as f:
        f.write(text.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    return path


def read_checksums(directory: Path) -> dict[str, str] | None:
    """{file name: sha256} from `directory`/SHA256SUMS, or None where there is no such file; a
    line that is not sha256sum's `<digest>  <name>` is refused in one line."""
    path = directory / CHECKSUMS_NAME
    if not path.is_file():
        return None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise SpecdecError(f"cannot read {path} ({error}): export the head again") from None
    sums: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        found = _LINE.match(line.rstrip("\r"))
        check(found is not None, f"{path} line {number} is not '<sha256>  <file name>' ({line[:80]!r}): the file is "
                                 f"damaged, export the head again")
        sums[found["name"]] = found["digest"].lower()
    return sums


def check_checksums(directory: Path, names: list[str]) -> None:
    """When `directory` holds SHA256SUMS: every file it lists is there and hashes to its line, and
    each of `names` (the weights files about to be read) is listed; else one line naming the file.
    Without SHA256SUMS, nothing is checked."""
    sums = read_checksums(directory)
    if sums is None:
        return
    path = directory / CHECKSUMS_NAME
    for name in names:
        check(name in sums, f"{directory / name} is not listed in {path}: a weights file added after the export; "
                            f"remove it, or export the head again")
    for name, want in sums.items():
        file = directory / name
        check(file.is_file(), f"{file}, listed in {path}, is missing: the export is incomplete, export the head again")
        digest = sha256_file(file)
        check(digest == want, f"weights file {file} has sha256 {digest[:16]}..., {path} records {want[:16]}...: the "
                              f"file is truncated or corrupt, export the head again")


__all__ = ["CHECKSUMS_NAME", "check_checksums", "read_checksums", "sha256_file", "write_checksums"]
