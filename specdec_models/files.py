"""Crash-safe writing: a file or directory appears whole or not at all, under temp names we own.

A writer puts its bytes under `.tmp-<name>-<pid>-<8 hex>` in the target's own directory (so the
final `os.replace` is one atomic rename on the same filesystem), fsyncs them, renames, and fsyncs
the directory. A process killed mid-write leaves its temp behind; the next writer of the same
directory removes the temps whose process is gone (`remove_stale_temps`), so leftovers never
pile up. Temps of a live process (another writer, on this machine) are left alone.

Files end with the mode the umask gives new files (0644 under the usual umask 022), also those
a library created 0600 through its own temp file (safetensors does): exports are shared between
users. Used by the export writer, training checkpoints, the metrics CSV and the embeddings cache.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .errors import SpecdecError, check

TMP_PREFIX = ".tmp"      # every temp this project writes starts with ".tmp-"; safetensors' own are ".tmpXXXXXX"
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


@contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """Build a directory that replaces `target` whole: yields an empty temp directory beside it;
    when the block ends without error, its files get the umask's mode and it is renamed to
    `target` (an old `target` is moved aside first, to `.tmp-<name>.old-...`, and removed after).
    On error `target` is unchanged. If the process dies, the next `staged_dir(target)` removes its
    temps, after moving an old `target` back should the crash have come between the two renames."""
    target.parent.mkdir(parents=True, exist_ok=True)
    aside = target.with_name(f"{target.name}.old")
    if not target.exists():                  # a crash between the two renames below: put the old one back
        for path in sorted(target.parent.iterdir()):
            match = _OURS.match(path.name)
            if match and match["name"] == aside.name and not _pid_alive(int(match["pid"])) and path.is_dir():
                path.rename(target)
                break
    remove_stale_temps(target.parent, target.name)
    remove_stale_temps(target.parent, aside.name)
    tmp = temp_path(target)
    tmp.mkdir()
    old = None
    try:
        yield tmp
        set_file_modes(tmp)
        if target.exists():
            old = temp_path(aside)
            target.rename(old)
        try:
            tmp.rename(target)
        except OSError:
            if old is not None:
                old.rename(target)
                old = None
            raise
        fsync_dir(target.parent)
    finally:
        for path in (tmp, old):
            if path is not None and path.exists():
                shutil.rmtree(path, ignore_errors=True)


def one_line(error: BaseException) -> str:
    """An exception's message on one line (its type name when it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


def os_error(error: OSError, doing: str) -> SpecdecError:
    """A one-line SpecdecError for an OSError while `doing` something (e.g. "writing the export to X")."""
    reason = error.strerror or one_line(error)
    where = f" ({error.filename})" if error.filename else ""
    return SpecdecError(f"{doing}: {reason}{where}")
