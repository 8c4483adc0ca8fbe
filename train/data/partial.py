"""The partial-parts-lock-finalize protocol of a folder that N processes write together.

A build of OUT (the answers of `chat_answers`, the embeddings cache of `embeddings_cache`) writes
into OUT.partial/:

1. `open_partial`: build.json first, the settings that make the parts (a partial folder of other
   settings is refused in one line, or with `overwrite` and one process started over);
2. each process writes its parts, each atomically (`specdec_models.files.write_file` or a temp
   renamed when complete), so a part is absent or whole and a killed build keeps its finished
   parts: the same command resumes it;
3. `finalize`: the process that finds every part written when it ends takes
   OUT.partial/finalize.lock (`take_lock`: one process, a lock left by a dead one taken over),
   writes the joined files into OUT.partial/ (and removes what OUT should not keep) and renames
   the folder to OUT (`files.replace_dir`); the lock goes with it, so no process finalizes twice.
   The others return without writing OUT.

So OUT is absent or complete, and parts are pure functions of the settings: N processes, kills and
resumes write the bytes one uninterrupted process writes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec_models.errors import check
from specdec_models.files import remove_stale_temps, replace_dir, write_file

BUILD_FILE = "build.json"
LOCK_FILE = "finalize.lock"


def partial_dir(out: Path) -> Path:
    """OUT.partial, beside OUT: where a build of OUT writes."""
    return out.with_name(f"{out.name}.partial")


def open_partial(out: Path, build: dict[str, Any], *, rank: int = 0, world: int = 1, overwrite: bool = False,
                 start_over: str = "remove {partial} to start over", temps: str = "") -> Path:
    """OUT.partial/ for the settings `build`: created with build.json, or resumed when its
    build.json holds the same settings. One of other settings is refused (one line; `start_over`
    says how to start over, `{partial}` replaced), unless `overwrite` with one process, which removes
    it (with several, another process may be starting this very build). A folder without build.json
    (killed before it was written) is taken over. Stale temps of dead processes in `temps` (a
    subfolder, '' the folder itself) are removed: by rank 0 only when `temps` is ''. Returns the
    partial folder."""
    partial = partial_dir(out)
    if partial.exists():
        path = partial / BUILD_FILE
        found = json.loads(path.read_text()) if path.is_file() else None
        if found != build:
            changed = sorted(k for k in build if found is not None and found.get(k) != build[k])
            check(found is None or (overwrite and world == 1),
                  f"{partial} holds a partial build with other settings ({', '.join(changed)} differ): run the "
                  f"command that started it to resume, or {start_over.format(partial=partial)}")
            if world == 1:
                shutil.rmtree(partial)
    (partial / temps).mkdir(parents=True, exist_ok=True)
    write_file(partial / BUILD_FILE, lambda f: f.write(json.dumps(build, indent=2, sort_keys=True).encode()))
    if temps or rank == 0:
        remove_stale_temps(partial / temps)      # (only a dead process's temps: the pid in a temp's name)
    return partial


def take_lock(lock: Path) -> bool:
    """Create `lock` holding this pid, or take it over from a dead process; False when a live
    process holds it or the folder is gone (another process finished)."""
    from specdec_models.files import _pid_alive

    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _pid_alive(pid):
                return False
            lock.unlink(missing_ok=True)
            continue
        except FileNotFoundError:
            return False
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True


def finalize(out: Path, join: Callable[[Path], Any]) -> tuple[bool, Any]:
    """Step 3 of the protocol: take OUT.partial/finalize.lock, `join(partial)` (write the joined
    files into the partial folder, remove what OUT should not keep), rename it to OUT. Returns
    (True, what join returned), or (False, None) where another process holds the lock or has
    finished."""
    partial = partial_dir(out)
    if not take_lock(partial / LOCK_FILE):
        return False, None
    result = join(partial)
    replace_dir(partial, out)                   # the lock goes with it: no process finalizes twice
    (out / LOCK_FILE).unlink(missing_ok=True)
    return True, result
