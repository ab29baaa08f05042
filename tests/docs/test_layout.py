"""The shape docs/ARCHITECTURE.md promises: no import cycle between the package's modules at run time, and no Python
module of the package (`hf_kvcache/`, `kernels/`, `eval/`) much over 500 lines.

Imports are read from the source (`ast`), wherever they stand (a lazy import inside a function is still an edge);
only those under `if TYPE_CHECKING:` are left out, since they never run."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = {"hf_kvcache": ROOT / "hf_kvcache", "hf_kvcache.kernels": ROOT / "kernels", "hf_kvcache.eval": ROOT / "eval"}
MAX_LINES = 520  # "about 500": the largest today, caches/tiered/layer.py, has 516


def modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's __init__)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            init = parts[-1] == "__init__"
            out[".".join([package] + (parts[:-1] if init else parts))] = (path, init)
    return out


def runtime_imports(tree: ast.AST):
    """Every Import / ImportFrom node of `tree` outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def known(name: str) -> str | None:
        while name and name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in mods else None

    graph = {name: set() for name in mods}
    for name, (path, init) in mods.items():
        for node in runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if init else name.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph[name].update(t for t in map(known, targets) if t and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
            elif nxt not in index:
                index[nxt] = low[nxt] = counter
                counter += 1
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return found


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 200  # the graph was read
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_much_over_500_lines():
    long = {str(path.relative_to(ROOT)): n for path, _ in modules().values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
