"""No import cycles among weightsync's modules: the strongly connected components of grimp's module graph.

import-linter 2.17's `acyclic_siblings` contract looks for cycles between sibling packages (each squashed),
not between modules, and not through a package's __init__; this check takes the graph as it is, one node per
module, with every import of a weightsync module (inside functions and under TYPE_CHECKING too), from the
root packages pyproject.toml's [tool.importlinter] names. A cycle is reported with its modules and the
imports between them (module:line).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Run in the directory the graph is built for: prints {"location": ..., "imports": {importer: {imported: [line]}}}.
GRAPH_SCRIPT = """
import importlib.util, json, os, sys
import grimp
roots = sys.argv[1:]
graph = grimp.build_graph(*roots, cache_dir=None)
imports = {}
for importer in sorted(graph.modules):
    imports[importer] = {
        imported: sorted(d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported))
        for imported in sorted(graph.find_modules_directly_imported_by(importer))
    }
location = [os.path.realpath(p) for p in importlib.util.find_spec(roots[0]).submodule_search_locations]
print(json.dumps({"location": location, "imports": imports}))
"""

Imports = Mapping[str, Mapping[str, list[int]]]


def cycles(imports: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """The import cycles: every strongly connected component of more than one module (or a module importing
    itself), each sorted, in sorted order. Tarjan's algorithm, iterative (no recursion limit on a deep chain)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> Any:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return iter(sorted(imports.get(node, ())))

    for start in sorted(imports):
        if start in index:
            continue
        work = [(start, visit(start))]
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    work.append((nxt, visit(nxt)))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in imports.get(node, ()):
                        found.append(sorted(component))
    return sorted(found)


def describe(cycle: list[str], imports: Imports) -> str:
    """One cycle: its modules, then each import inside it as `importer:line -> imported`."""
    members = set(cycle)
    lines = [f"import cycle among {len(cycle)} modules: {', '.join(cycle)}"]
    for importer in cycle:
        for imported, numbers in sorted(imports.get(importer, {}).items()):
            if imported in members:
                lines.append(f"    {importer}:{','.join(map(str, numbers))} -> {imported}")
    return "\n".join(lines)


@pytest.fixture
def module_graph(python_in: Callable[..., Any], importlinter_config: dict[str, Any]) -> Callable[[Path], dict[str, Any]]:
    """module_graph(root): grimp's graph of the `weightsync` found in ROOT, and where that was."""

    def build(root: Path) -> dict[str, Any]:
        proc = python_in(root, "-c", GRAPH_SCRIPT, *importlinter_config["root_packages"])
        assert proc.returncode == 0, proc.stderr
        graph: dict[str, Any] = json.loads(proc.stdout)
        return graph

    return build


def test_no_import_cycles(module_graph: Callable[[Path], dict[str, Any]]) -> None:
    graph = module_graph(REPO)
    assert graph["location"] == [str(REPO / "weightsync")]  # the checkout's package, links resolved below it
    assert "weightsync.operator.main" in graph["imports"]  # the namespace portion is in the graph
    found = cycles(graph["imports"])
    assert not found, "\n".join(describe(c, graph["imports"]) for c in found)


def test_a_cycle_through_an_import_inside_a_function_is_found(
        package_copy: Path, add_module: Callable[[str, str], Path], module_graph: Callable[[Path], dict[str, Any]]) -> None:
    add_module("weightsync.crds._fixture_cycle_a", "from weightsync.crds import _fixture_cycle_b")
    add_module("weightsync.crds._fixture_cycle_b", "def late() -> None:\n    from weightsync.crds import _fixture_cycle_a")
    graph = module_graph(package_copy)
    assert graph["location"] == [str(package_copy.resolve() / "weightsync")]  # the copy, not the checkout
    found = cycles(graph["imports"])
    assert found == [["weightsync.crds._fixture_cycle_a", "weightsync.crds._fixture_cycle_b"]]
    assert describe(found[0], graph["imports"]).splitlines()[1:] == [
        "    weightsync.crds._fixture_cycle_a:3 -> weightsync.crds._fixture_cycle_b",
        "    weightsync.crds._fixture_cycle_b:4 -> weightsync.crds._fixture_cycle_a",
    ]


def test_cycles_of_a_small_graph() -> None:
    imports = {
        "a": {"b": [1]}, "b": {"c": [1]}, "c": {"a": [1], "d": [1]},  # a -> b -> c -> a
        "d": {"e": [1]}, "e": {},  # a chain out of it: no cycle
        "f": {"f": [1]},  # a module importing itself
        "g": {"h": [1]}, "h": {"g": [1], "e": [1]},  # a second cycle
    }
    assert cycles(imports) == [["a", "b", "c"], ["f"], ["g", "h"]]
    assert cycles({"x": {"y": [1]}, "y": {}}) == []
    deep = {f"m{i}": {f"m{i + 1}": [1]} for i in range(5000)} | {"m5000": {"m0": [1]}}
    assert cycles(deep) == [sorted(deep)]
