"""The training tasks, one file each: every module here that defines `TASK = Task(...)` is one.

Adding a task is adding a file here and its config `conf/task/<name>.yaml` (see README,
"Where to add a task"). `get_task(name)` and `TASKS` find them; nothing else lists them.
"""

from __future__ import annotations

import importlib
import pkgutil

from specdec_models.errors import check

from .base import SpeculativeModels, Task, TaskModule

__all__ = ["TASKS", "SpeculativeModels", "Task", "TaskModule", "get_task", "tasks"]

_found: dict[str, Task] | None = None


def tasks() -> dict[str, Task]:
    """Every task, by name (the task modules are imported on first call)."""
    global _found
    if _found is None:
        found: dict[str, Task] = {}
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
            task = getattr(importlib.import_module(f"{__name__}.{info.name}"), "TASK", None)
            if isinstance(task, Task):
                check(task.name not in found, f"two tasks are named {task.name!r}")
                found[task.name] = task
        _found = found
    return _found


def get_task(name: object) -> Task:
    """The task called `name`, or a one-line SpecdecError listing the known ones."""
    known = tasks()
    check(name in known, f"task.name must be one of {', '.join(known)}, got {name!r}")
    return known[name]


def __getattr__(name: str):
    if name == "TASKS":                 # train.tasks.TASKS: the dict, built on first access
        return tasks()
    raise AttributeError(name)
