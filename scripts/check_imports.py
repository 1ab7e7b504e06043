#!/usr/bin/env python3
"""The layering check `make lint` runs (and tests/test_layering.py).

Reads every import statement, function-level ones included, of the
project's packages and fails (exit 1, one line per problem) when:
- a module of ``reference_model/`` imports torch (the model is pure Python);
- ``allocators/`` or ``reference_model/`` import the harness (or each other's
  layer above them);
- two modules import each other, directly or around a longer cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("allocators", "reference_model", "state_machines")
# package -> packages of ours it may import
MAY_IMPORT = {
    "allocators": set(),
    "reference_model": set(),
    "state_machines": {"allocators", "reference_model"},
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str) -> set[str]:
    """Every module of ours (or torch) that ``path`` imports, by full name."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            # `from pkg import module` imports the module too.
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def problems(root: Path = ROOT) -> list[str]:
    modules = {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    found = []
    for name, path in modules.items():
        raw = imports_of(path, name)
        top = name.split(".")[0]
        if top == "reference_model" and any(m == "torch" or m.startswith("torch.") for m in raw):
            found.append(f"{path.relative_to(root)}: reference_model imports torch")
        for other in {m.split(".")[0] for m in raw} & set(PACKAGES) - {top}:
            if other not in MAY_IMPORT[top]:
                found.append(f"{path.relative_to(root)}: {top} imports {other}")
        # An import of a package's module also runs the package's __init__;
        # a module's own packages are not counted (they always come first).
        edges = set()
        for m in raw:
            if m in modules:
                edges.add(m)
            parts = m.split(".")
            edges.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules)
        graph[name] = edges - {name} - {p for p in edges if name.startswith(p + ".")}
    found += [f"import cycle: {' -> '.join(c + [c[0]])}" for c in cycles(graph)]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    if not found:
        print(f"layering: ok ({', '.join(PACKAGES)}: no torch in the model, no upward import, no cycle)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
