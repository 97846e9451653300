"""The package's modules import each other without a cycle: every import (at the top of a module or inside
a function) is an edge of kvflash_ggml's import graph, and the graph is acyclic."""
import ast
from pathlib import Path

import kvflash_ggml

ROOT = Path(kvflash_ggml.__file__).parent


def module_names() -> dict[str, Path]:
    """kvflash_ggml.x.y -> its file, for every .py module and compiled extension of the package."""
    out = {}
    for path in ROOT.rglob("*"):
        if path.suffix not in (".py", ".so") or "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        parts[-1] = parts[-1].split(".")[0]   # _core.cpython-311-x86_64-linux-gnu -> _core
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports (a module `from` which a name is taken; the submodule when
    the name is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as a list of modules (first == last), or [] if it has none."""
    state, stack = {}, []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_graph_builder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_package_imports_are_acyclic():
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items() if path.suffix == ".py"}
    graph.update({name: set() for name in modules if name not in graph})
    assert "kvflash_ggml.engine" in graph["kvflash_ggml.model"]   # the graph sees relative imports
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))
