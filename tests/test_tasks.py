"""The task registry: every task file is found, each has its config, the wiring names no task."""

from __future__ import annotations

import ast

import pytest

from conftest import CONF, REPO

from specdec_models.errors import SpecdecError
from train.tasks import Task, TaskModule, get_task, tasks

TRAIN = REPO / "train"


def test_every_task_file_is_registered_with_its_config_and_module():
    found = tasks()
    files = {p.stem for p in (TRAIN / "tasks").glob("*.py")
             if any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "TASK" for t in n.targets)
                    for n in ast.parse(p.read_text()).body)}
    assert set(found) == files >= {"prophet", "prophet_frozen", "draft_distill", "hf_draft_distill"}
    assert set(found) == {p.stem for p in (CONF / "task").glob("*.yaml")}
    for name, task in found.items():
        assert isinstance(task, Task) and task.name == name
        assert issubclass(task.module, TaskModule) and task.module.task == name
        assert task.data and all(isinstance(cls, type) for cls in task.data)


def test_only_prophet_tasks_carry_the_prophet_objective_and_tracking():
    from train.tasks.prophet_common import ProphetTaskModule

    prophets = {name for name, task in tasks().items() if issubclass(task.module, ProphetTaskModule)}
    assert prophets == {"prophet", "prophet_frozen", "hf_prophet"}
    assert not any(hasattr(TaskModule, name) for name in ("prophet_objective", "track_drafted", "log_drafted"))


def test_an_unknown_task_is_a_one_line_error_listing_the_known_ones():
    with pytest.raises(SpecdecError, match="task.name must be one of draft_distill, ") as error:
        get_task("prophet_typo")
    assert "\n" not in str(error.value) and "prophet_frozen" in str(error.value)


def test_no_module_of_train_but_the_benchmarks_imports_run_and_none_probes_tasks():
    for path in TRAIN.rglob("*.py"):
        if path.name == "__main__.py":              # the Hydra shell: it exists to call run(cfg)
            continue
        # the benchmarks and the EAGLE-3 recipe stand above run(cfg) and train through it
        above_run = path.parent == TRAIN / "bench" or path == TRAIN / "eagle3_recipe.py"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not above_run:
                assert not (node.module or "").endswith("run") and node.module != "train.run", path
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "hasattr":
                raise AssertionError(f"{path}:{node.lineno} probes an object with hasattr")
    run_source = (TRAIN / "run.py").read_text()
    for name in tasks():
        assert f'"{name}"' not in run_source, f"run.py special-cases task {name}"
    assert "SpeculativeEval" not in run_source, "run.py special-cases a callback"


def test_the_data_package_imports_nothing_else_of_train():
    """What makes the data (caches, regenerated rows) lives in train/data/ with what reads it: no
    import loop between train/ and train/data/."""
    for path in (TRAIN / "data").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                assert node.level <= 1 and not (module.startswith("train.") and not module.startswith("train.data")), \
                    f"{path}:{node.lineno} imports {'.' * node.level}{module}"



def _train_modules_reached(start: str) -> set[str]:
    """The train.* modules `start` imports, directly or through each other (anywhere in a file, lazily too)."""
    from test_layout import imported_names

    def module_of(dotted: str) -> str | None:
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            path = REPO.joinpath(*parts[:end])
            if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
                return ".".join(parts[:end])
        return None

    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = REPO.joinpath(*name.split("."))
        path = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        for _, dotted in imported_names(path, REPO):
            module = module_of(dotted) if dotted.startswith("train.") else None
            if module is not None:
                todo.append(module)
    return seen


def test_the_eagle3_task_imports_nothing_from_the_prophet_task():
    """The Hugging Face target machinery lives in train.tasks.hf_target, which both head tasks use."""
    reached = _train_modules_reached("train.tasks.hf_eagle3")
    assert "train.tasks.hf_target" in reached
    assert "train.tasks.hf_prophet" not in reached
    assert "train.tasks.hf_target" in _train_modules_reached("train.tasks.hf_prophet")


def test_settings_read_into_their_dataclass_and_an_unknown_key_reads_as_a_signatures_error():
    """A DataModule, callback or task module takes `**settings` read into a typed dataclass
    (`train.data.settings.read_settings`): defaults fill what is not given, and an unknown key is
    the TypeError a signature of those fields would raise, naming the class built."""
    from dataclasses import dataclass

    from train.data.settings import read_settings
    from train.tasks.hf_eagle3 import HFEagle3Module, HFEagle3Settings

    @dataclass(frozen=True)
    class Sizes:
        depth: int
        width: int = 2

    assert read_settings(Sizes, HFEagle3Module, {"depth": 1}) == Sizes(1, 2)
    with pytest.raises(TypeError, match=r"^HFEagle3Module.__init__\(\) got an unexpected keyword argument 'bogus'$"):
        read_settings(Sizes, HFEagle3Module, {"depth": 1, "bogus": 0})
    with pytest.raises(TypeError, match="unexpected keyword argument 'ttt_step'"):
        HFEagle3Module(target_path="x", weights_sha256="0" * 64, head={}, ttt_step=3)
    assert {"target_path", "ttt_ramp", "cache_layers", "target_shard"} <= set(HFEagle3Settings.__dataclass_fields__)
