"""No import circles in src/gspo: every import of a gspo module counts, those deferred into a
function included (a circle hidden in a function still ties the two modules together)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under `root`."""
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports anywhere in its file: `import a.b`, `from a import
    b` (the module a.b if there is one, else a), relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = name.split(".")[0]

    def owner(dotted: str) -> str | None:  # the longest known module holding `dotted`
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {owner(a.name) for a in node.names if a.name.split(".")[0] == top}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] == top:
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else owner(base)
                        for a in node.names}
    return out - {None, name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as [a, b, ..., a], or None (depth-first, three colours)."""
    state, stack = {}, []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_gspo_has_no_import_circles():
    known = modules(SRC / "gspo")
    graph = {name: imports(name, path, known) for name, path in known.items()}
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle)}"


def test_a_circle_through_a_deferred_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("def f():\n    from .b import g\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    from .. import a\n")
    known = modules(pkg)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert graph["pkg.sub"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
