"""The package layering of ARCHITECTURE.md holds for every import in src/longfit, lazy ones included."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).parents[1]
SOURCE = ROOT / "src" / "longfit"
FACADE = ("__init__", "__main__")  # the package root and `python -m longfit`


def declared_layers() -> dict[str, int]:
    """{package: layer} from the table in ARCHITECTURE.md."""
    layers = {}
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines():
        match = re.match(r"\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|", line)
        if match:
            for name in re.findall(r"[\w]+", match.group(2)):
                layers[name] = int(match.group(1))
    return layers


def module_name(path: Path, source: Path = SOURCE) -> str:
    parts = path.relative_to(source.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """longfit.plan.analytic -> plan; longfit.cli -> cli; longfit -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(source: Path = SOURCE) -> dict[str, set[str]]:
    """{module: modules of the `source` package it imports anywhere in its code}."""
    modules = {module_name(path, source): path for path in source.rglob("*.py")}
    found: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from longfit.bench import command` imports the module longfit.bench.command
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            found[name].update(t for t in targets if t in modules and t != name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_the_table_names_every_package():
    layers = declared_layers()
    packages = {package_of(module_name(path)) for path in SOURCE.rglob("*.py")}
    assert packages == set(layers), f"ARCHITECTURE.md is out of date: code {sorted(packages)}, table {sorted(layers)}"


def test_every_import_points_down_the_layers():
    layers = declared_layers()
    wrong = []
    for module, targets in imports().items():
        for target in targets:
            source, destination = package_of(module), package_of(target)
            if source != destination and layers[destination] >= layers[source]:
                wrong.append(f"{module} -> {target} ({source} layer {layers[source]}, {destination} layer {layers[destination]})")
    assert not wrong, "imports against ARCHITECTURE.md:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles_between_packages_or_modules():
    graph = imports()
    packages: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        packages[package_of(module)].update(package_of(t) for t in targets if package_of(t) != package_of(module))
    assert cycles(packages) == []
    assert cycles(graph) == []


def test_the_checker_sees_lazy_and_type_checking_imports(tmp_path):
    """A made-up package whose only cycle goes through a function-level and a TYPE_CHECKING import."""
    source = tmp_path / "longfit"
    (source / "low").mkdir(parents=True)
    (source / "high").mkdir()
    for init in (source / "__init__.py", source / "low" / "__init__.py", source / "high" / "__init__.py"):
        init.write_text("")
    (source / "low" / "a.py").write_text("def f():\n    from longfit.high.b import g\n")
    (source / "high" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from longfit.low import a\n")
    graph = imports(source)
    assert graph["longfit.low.a"] == {"longfit.high.b"} and "longfit.low.a" in graph["longfit.high.b"]
    assert cycles(graph) == [["longfit.high.b", "longfit.low.a"]]
