"""Crash-safe writing: a file or directory appears whole or not at all, under temp names we own.

A writer puts its bytes under `.tmp-<name>-<pid>-<8 hex>` in the target's own directory (so the
final `os.replace` is one atomic rename on the same filesystem), fsyncs them, renames, and fsyncs
the directory. A process killed mid-write leaves its temp behind; the next writer of the same
directory removes the temps whose process is gone (`remove_stale_temps`), so leftovers never
pile up. Temps of a live process (another writer, on this machine) are left alone.

Files end with the mode the umask gives new files (0644 under the usual umask 022), also those
a library created 0600 through its own temp file (safetensors does): exports are shared between
users. Used by the export writer, training checkpoints, the metrics CSV and the embeddings cache.

Whether a command may write a path at all is `check_output`'s one rule, which every script and
`train.run` follow: a file that exists is replaced only with --force; a folder only when it is
absent, empty, or marked by specdec as the same kind of folder (`MARKER`, written into each folder
a writer makes), else with --force; and never a path that is, holds, or lies inside one of the
command's own inputs, whatever the flags.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .errors import SpecdecError, check

TMP_PREFIX = ".tmp"      # every temp this project writes starts with ".tmp-"; safetensors' own are ".tmpXXXXXX"
MARKER = ".specdec"      # in each folder a specdec writer made: one line, the kind of folder (`mark_dir`)
_OURS = re.compile(r"^\.tmp-(?P<name>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def temp_path(target: Path) -> Path:
    """A fresh temp name for `target`, in the same directory: `.tmp-<name>-<pid>-<8 hex>`."""
    return target.with_name(f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def file_mode() -> int:
    """The mode a plain `open()` gives a new file under this process's umask (0o644 under 022)."""
    umask = os.umask(0)        # reading the umask means setting it: put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def fsync_dir(directory: Path) -> None:
    """Make the renames in `directory` durable (POSIX); platforms that cannot open a directory skip it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:        # exists, owned by another user
        return True
    return True


def remove_stale_temps(directory: Path, name: str | None = None) -> list[Path]:
    """Remove the temps in `directory` left by processes that are gone (all `.tmp-*` of ours whose
    pid is not running, and any other `.tmp*` entry: a library's own temp file); with `name`, only
    the temps of that target. Returns what was removed."""
    removed = []
    if not directory.is_dir():
        return removed
    for path in directory.iterdir():
        if not path.name.startswith(TMP_PREFIX):
            continue
        ours = _OURS.match(path.name)
        if name is not None and (ours is None or ours["name"] != name):
            continue
        if ours is not None and _pid_alive(int(ours["pid"])):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def check_writable_dir(directory: str | os.PathLike, what: str) -> None:
    """Raise a one-line SpecdecError unless `directory` is, or can be created as, a directory this
    process can write in (checked on the nearest existing ancestor). Creates nothing."""
    directory = Path(directory)
    check(not directory.exists() or directory.is_dir(), f"{what} {directory} exists and is not a directory")
    probe = directory
    while not probe.exists():
        probe = probe.parent
    check(probe.is_dir(), f"{what} {directory}: {probe} is a file, not a directory")
    check(os.access(probe, os.W_OK | os.X_OK),
          f"{what} {directory}: {probe} is not writable (read-only folder or file system)")


def mark_dir(directory: Path, kind: str) -> None:
    """Record in `directory` (which this process made) that specdec wrote it, as a `kind` folder."""
    write_file(Path(directory) / MARKER, lambda f: f.write(f"{kind}\n".encode()))


def folder_kind(directory: str | os.PathLike) -> str | None:
    """The kind `mark_dir` recorded in `directory`, or None (not marked, or unreadable)."""
    try:
        return (Path(directory) / MARKER).read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} entries)" if len(names) > n else "")


def check_not_input(target: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], what: str,
                    flag: str = "--force") -> None:
    """Raise a one-line SpecdecError when `target` is, holds, or lies inside one of `inputs` (what
    the same command reads; None and "" are skipped): writing there would replace or mix with what
    the command reads, which no `flag` allows."""
    resolved = Path(target).expanduser().resolve()
    for given in inputs:
        if given is None or str(given) == "":
            continue
        source = Path(given).expanduser().resolve()
        relation = ("is" if resolved == source else "holds" if source.is_relative_to(resolved)
                    else "lies inside" if resolved.is_relative_to(source) else None)
        check(relation is None, f"{what} {target} {relation} the input {given}: write elsewhere (an input of the "
                                f"command is never replaced, not even with {flag})")


def check_output(target: str | os.PathLike, what: str, *, kind: str | None = None, force: bool = False,
                 inputs: Iterable[str | os.PathLike | None] = (), flag: str = "--force",
                 force_does: str = "replace it", records: Iterable[str] = ()) -> bool:
    """May this command write `target`? The one rule of every writer (module docstring); raises a
    one-line SpecdecError naming `what` (e.g. "--out") and `flag` otherwise, before any work.

    kind None: `target` is a file; one that exists needs `force`. kind "...": `target` is a folder
    the command fills and marks as `kind` (`staged_dir(target, kind)` or `mark_dir`); a non-empty
    one needs `force` unless specdec marked it as `kind` (or, for folders written before markers
    existed, it holds one of `records`). `inputs`: the paths the command reads (`check_not_input`).
    `force_does`: what `flag` does to the folder, for the message. Returns whether `target` holds
    something the command will replace (or write beside)."""
    check_not_input(target, inputs, what, flag)
    path = Path(target).expanduser()
    if kind is None:
        check(not path.is_dir(), f"{what} {target} is a directory: give the file to write")
        check(force or not path.exists(), f"{what} {target} exists: choose another file, or {force_does} with {flag}")
        check_writable_dir(path.parent, f"{what}'s folder")
        return path.exists()
    check_writable_dir(path, what)
    if not path.is_dir():
        return False
    entries = sorted(p.name for p in path.iterdir() if p.name != MARKER and not p.name.startswith(TMP_PREFIX))
    if not entries:
        return False
    found = folder_kind(path) or (kind if any((path / name).exists() for name in records) else None)
    if force or found == kind:
        return True
    if found is not None:
        raise SpecdecError(f"{what} {target} holds specdec's {found} ({_few(entries)}), not a {kind}: choose "
                           f"another {what}, or {force_does} with {flag}")
    raise SpecdecError(f"{what} {target} holds files specdec did not write ({_few(entries)}): choose another "
                       f"{what}, or {force_does} with {flag}")


def write_file(path: Path, write: Callable[[BinaryIO], None]) -> Path:
    """Write `path` atomically: `write(f)` fills a temp file beside it, which is fsynced and
    renamed over `path`. A crash leaves the old `path` (or none) and a temp that
    `remove_stale_temps` removes later."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return path


def set_file_modes(root: Path) -> None:
    """Give every file under `root` (or `root` itself) the umask's mode."""
    mode = file_mode()
    paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    for path in paths:
        os.chmod(path, mode)


def _restore_aside(target: Path) -> None:
    """Undo a crash between the two renames of `replace_dir`: put the old `target` back, then
    remove the temps of dead builds of `target`."""
    aside = target.with_name(f"{target.name}.old")
    if not target.exists():
        for path in sorted(target.parent.iterdir()):
            match = _OURS.match(path.name)
            if match and match["name"] == aside.name and not _pid_alive(int(match["pid"])) and path.is_dir():
                path.rename(target)
                break
    remove_stale_temps(target.parent, target.name)
    remove_stale_temps(target.parent, aside.name)


def replace_dir(src: Path, target: Path) -> None:
    """Rename the finished directory `src` (in target's folder) to `target`, replacing an old
    `target` whole: the old one is moved aside to `.tmp-<name>.old-...` first and removed after;
    a crash between the two renames is undone by the next `staged_dir(target)` or `replace_dir`."""
    _restore_aside(target)
    set_file_modes(src)
    old = None
    if target.exists():
        old = temp_path(target.with_name(f"{target.name}.old"))
        target.rename(old)
    try:
        src.rename(target)
    except OSError:
        if old is not None:
            old.rename(target)
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_dir(target: Path, kind: str | None = None) -> Iterator[Path]:
    """Build a directory that replaces `target` whole: yields an empty temp directory beside it
    (marked as a `kind` folder by `mark_dir` when `kind` is given: check `target` with
    `check_output(target, ..., kind=kind)` first); when the block ends without error, its files
    get the umask's mode and it is renamed to `target` (`replace_dir`: an old `target` is moved
    aside first, to `.tmp-<name>.old-...`, and removed after). On error `target` is unchanged. If
    the process dies, the next `staged_dir(target)` removes its temps, after moving an old
    `target` back should the crash have come between the two renames."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _restore_aside(target)
    tmp = temp_path(target)
    tmp.mkdir()
    try:
        if kind is not None:
            mark_dir(tmp, kind)
        yield tmp
        replace_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def one_line(error: BaseException) -> str:
    """An exception's message on one line (its type name when it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


def os_error(error: OSError, doing: str) -> SpecdecError:
    """A one-line SpecdecError for an OSError while `doing` something (e.g. "writing the export to X")."""
    reason = error.strerror or one_line(error)
    where = f" ({error.filename})" if error.filename else ""
    return SpecdecError(f"{doing}: {reason}{where}")
