"""The layout of the code: no import cycle between packages, the library's packages in one order,
and the library below the training side.

`import_graph` reads every module's imports with `ast`, those inside functions and `if
TYPE_CHECKING:` blocks too (a lazy import is still a dependency: it only hides a cycle until the
function runs), and maps each module to its node: a subpackage directly under a root
(`specdec_models.hf`) or a module directly under it (`specdec_models.errors`); a root's own
`__init__.py` is the node of the root itself (`specdec_models`, the facade re-exporting the public
names). An import names the node that holds what it imports: `from specdec_models import errors`
the module, `from specdec_models import Decoder` the facade. Each check has a planted-bug twin on a
tiny fake tree, so each provably fails when the bug it looks for is there.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

ROOTS = ("specdec_models", "train")
# the library's packages, lowest first: a package imports only the base modules (the modules directly under
# specdec_models: errors, files, config, model, ...) and the packages before it, never one after it, not even
# lazily (issue 60's layout)
LIBRARY_ORDER = ("hf", "heads", "export", "cpu", "decode")
FORBIDDEN_IN_LIBRARY = ("train", "lightning", "hydra", "omegaconf", "wandb")


def _module_name(path: Path, base: Path) -> tuple[str, bool]:
    """(dotted name, is a package's __init__) of a .py file under `base`."""
    parts = list(path.relative_to(base).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def imported_names(path: Path, base: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of everything `path` imports, anywhere in it: `import a.b` gives
    a.b, `from a import b, c` gives a.b and a.c (a submodule or a name of `a`), relative imports
    resolved against the module's package."""
    name, is_package = _module_name(path, base)
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if alias.name != "*"]
            if any(alias.name == "*" for alias in node.names):
                found.append((node.lineno, module))
    return found


def _node(dotted: str, base: Path, roots: tuple[str, ...]) -> str | None:
    """The node holding `dotted` (see the module docstring), or None outside `roots`."""
    parts = dotted.split(".")
    if parts[0] not in roots:
        return None
    if len(parts) == 1:
        return parts[0]
    child = base / parts[0] / parts[1]
    return f"{parts[0]}.{parts[1]}" if child.is_dir() or child.with_suffix(".py").is_file() else parts[0]


def import_graph(base: Path, roots: tuple[str, ...] = ROOTS) -> dict[str, dict[str, list[str]]]:
    """{node: {node it imports: ["path:line", ...]}} over every module of `roots` under `base`."""
    graph: dict[str, dict[str, list[str]]] = {}
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            source = _node(_module_name(path, base)[0], base, roots)
            edges = graph.setdefault(source, {})
            for line, dotted in imported_names(path, base):
                target = _node(dotted, base, roots)
                where = f"{path.relative_to(base)}:{line}"
                if target is not None and target != source and where not in edges.get(target, ()):
                    edges.setdefault(target, []).append(where)
    return graph


def find_cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Every strongly connected set of more than one node (Tarjan), each sorted: an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, {}):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                cycles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def describe(cycle: list[str], graph: dict[str, dict[str, list[str]]]) -> str:
    """Where each import inside a cycle is: the lines to change."""
    return "; ".join(f"{a} -> {b} ({', '.join(graph[a][b][:3])})"
                     for a in cycle for b in cycle if b in graph.get(a, {}))


def order_violations(graph: dict[str, dict[str, list[str]]], root: str, order: tuple[str, ...],
                     base: Path) -> list[str]:
    """Each import of `root`'s graph against `order` (its subpackages, lowest first; the modules
    directly under `root` come before all of them): a node importing a later one, or a subpackage
    missing from `order`."""
    def rank(node: str) -> int | None:
        name = node.removeprefix(f"{root}.")
        if name in order:
            return order.index(name) + 1
        return 0 if (base / root / f"{name}.py").is_file() else None

    problems = []
    for source, edges in sorted(graph.items()):
        if not source.startswith(f"{root}."):
            continue                                  # the facade re-exports from every package
        if rank(source) is None:
            problems.append(f"{source} is a package missing from the order {order}: give it its place")
            continue
        for target, where in sorted(edges.items()):
            if target.startswith(f"{root}.") and rank(target) is not None and rank(target) > rank(source):
                problems.append(f"{source} imports {target}, which comes after it ({', '.join(where[:3])})")
            if target == root:
                problems.append(f"{source} imports the {root} facade, which imports every package "
                                f"({', '.join(where[:3])})")
    return problems


def forbidden_imports(base: Path, root: str, forbidden: tuple[str, ...]) -> list[str]:
    """Every import in `root` (anywhere in a module) of a top-level name in `forbidden`."""
    return [f"{path.relative_to(base)}:{line} imports {dotted}"
            for path in sorted((base / root).rglob("*.py")) for line, dotted in imported_names(path, base)
            if dotted.split(".")[0] in forbidden]


# ---------------------------------------------------------------------------------- the real tree

def test_no_import_cycle_between_packages_of_the_library_or_the_training_side():
    graph = import_graph(REPO)
    assert {"specdec_models.hf", "specdec_models.heads", "specdec_models.export", "specdec_models.decode",
            "train.tasks", "train.data"} <= set(graph)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + " | ".join(describe(c, graph) for c in cycles)


def test_the_library_packages_import_in_one_order_not_even_lazily_upward():
    problems = order_violations(import_graph(REPO), "specdec_models", LIBRARY_ORDER, REPO)
    assert not problems, "\n".join(problems)


def test_the_library_imports_no_training_side():
    """specdec_models is pure PyTorch: no module of it imports train (benchmarks included: they
    live in train/bench/), lightning, hydra or wandb."""
    for path in (REPO / "specdec_models").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                assert name.split(".")[0] not in ("train", "lightning", "hydra", "omegaconf", "wandb"), \
                    f"{path}:{node.lineno} imports {name}"
    assert forbidden_imports(REPO, "specdec_models", FORBIDDEN_IN_LIBRARY) == []


# ------------------------------------------------------------------------- planted-bug twins

def _tree(base: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = base / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return base


@pytest.fixture
def fake(tmp_path):
    """A tiny library `lib`: base module errors.py, packages low (lower) and high (higher), and a
    facade; clean as written, each twin plants one bug in it."""
    return {
        "lib/__init__.py": "from .high import go\nfrom .errors import Oops\n",
        "lib/errors.py": "class Oops(Exception):\n    pass\n",
        "lib/low/__init__.py": "from ..errors import Oops\n",
        "lib/low/parts.py": "from .. import errors\n",
        "lib/high/__init__.py": "from ..low import parts\n\ndef go():\n    from lib.low.parts import errors\n",
    }


def test_twin_a_clean_fake_tree_has_no_cycle_and_keeps_its_order(fake, tmp_path):
    base = _tree(tmp_path, fake)
    graph = import_graph(base, ("lib",))
    assert graph["lib.high"] == {"lib.low": ["lib/high/__init__.py:1", "lib/high/__init__.py:4"]}
    assert graph["lib.low"] == {"lib.errors": ["lib/low/__init__.py:1", "lib/low/parts.py:1"]}
    assert find_cycles(graph) == []
    assert order_violations(graph, "lib", ("low", "high"), base) == []


def test_twin_a_cycle_hidden_in_a_function_is_reported_with_its_lines(fake, tmp_path):
    fake["lib/low/parts.py"] += "\n\ndef later():\n    from ..high import go\n    return go\n"
    base = _tree(tmp_path, fake)
    graph = import_graph(base, ("lib",))
    assert find_cycles(graph) == [["lib.high", "lib.low"]]
    assert "lib.low -> lib.high (lib/low/parts.py:5)" in describe(["lib.high", "lib.low"], graph)
    assert order_violations(graph, "lib", ("low", "high"), base) == [
        "lib.low imports lib.high, which comes after it (lib/low/parts.py:5)"]


def test_twin_a_cycle_through_the_facade_and_a_three_package_cycle_are_reported(fake, tmp_path):
    fake["lib/low/__init__.py"] += "from lib import go\n"          # the facade imports high, high imports low
    fake["lib/mid/__init__.py"] = "from ..third import x\n"
    fake["lib/third/__init__.py"] = "if True:\n    import lib.side.deep\nx = 1\n"
    fake["lib/side/__init__.py"] = ""
    fake["lib/side/deep.py"] = "from lib.mid import x\n"
    base = _tree(tmp_path, fake)
    graph = import_graph(base, ("lib",))
    assert find_cycles(graph) == [["lib", "lib.high", "lib.low"], ["lib.mid", "lib.side", "lib.third"]]
    problems = order_violations(graph, "lib", ("low", "high"), base)
    assert "lib.low imports the lib facade, which imports every package (lib/low/__init__.py:2)" in problems
    assert "lib.mid is a package missing from the order ('low', 'high'): give it its place" in problems


def test_twin_a_base_module_importing_a_package_breaks_the_order(fake, tmp_path):
    fake["lib/errors.py"] += "\n\ndef hint():\n    from .high import go\n    return go\n"
    base = _tree(tmp_path, fake)
    assert order_violations(import_graph(base, ("lib",)), "lib", ("low", "high"), base) == [
        "lib.errors imports lib.high, which comes after it (lib/errors.py:6)"]


def test_twin_a_library_importing_the_training_side_lazily_is_reported(tmp_path):
    base = _tree(tmp_path, {"lib/__init__.py": "", "lib/model.py": "def fit():\n    import lightning as L\n"
                                                                    "    from train.run import run\n"})
    assert forbidden_imports(base, "lib", FORBIDDEN_IN_LIBRARY) == [
        "lib/model.py:2 imports lightning", "lib/model.py:3 imports train.run.run"]
