"""The decode package's modules import one another without a circle: every import among them
(at the top, inside functions or under TYPE_CHECKING) points down a chain, so a new drafter is one
module that imports the protocol and nothing imports it back."""

import ast
from pathlib import Path

import specdec_models.decode as decode

PACKAGE = Path(decode.__file__).parent


def imports_within(path: Path, modules: set[str]) -> set[str]:
    """The modules of the package that the file imports (`from .x import`, `from . import x`;
    a name that is no module of the package, as `from . import generate`, is `__init__`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name if a.name in modules else "__init__" for a in node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found.update(n.split(".")[2] for n in names if n.startswith("specdec_models.decode.") and n.count(".") >= 2)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return {p.stem: imports_within(p, modules) - {p.stem} for p in PACKAGE.glob("*.py")}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated last), or None."""
    state: dict[str, int] = {}                 # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_decode_package_has_no_import_circle():
    graph = import_graph()
    assert {"speculative", "protocol", "chain", "tree", "lookup", "cost", "stats"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"decode modules import one another in a circle: {' -> '.join(cycle)}"


def test_the_protocol_and_the_loop_know_no_drafter_kind():
    # the protocol sits below every drafter; the loop (speculative) imports none of them
    graph = import_graph()
    assert graph["protocol"] == set()
    assert not graph["speculative"] & {"chain", "lookup", "drafters", "datastore"}


def test_the_cycle_finder_finds_a_planted_circle():
    # the test above must be able to fail: a planted circle through three modules is found
    graph = import_graph()
    graph["protocol"] = graph["protocol"] | {"tree"}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and {"protocol", "tree"} <= set(cycle)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
