"""The rooms' imports point one way: the import graph of ``zoo/`` (function-level imports included, read from the
source) has no circle; the MoE core imports nothing of the demos or the command line, and the kernels nothing
that calls them."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zoo"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if {"scaffold_templates", "_data"} & set(path.parts):
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def lazy_names() -> dict[str, str]:
    """``zoo``'s public names -> the module defining them (``from zoo import load`` imports ``zoo.io.load``)."""
    for node in ast.walk(ast.parse((PACKAGE / "__init__.py").read_text())):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in ("_LAZY",):
            return ast.literal_eval(node.value)
    return {}


def imported(module: str, path: Path, known: dict, lazy: dict) -> set[str]:
    """The zoo modules ``module`` imports anywhere in its source (the nearest known module of each name)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.append(full if full in known else lazy.get(alias.name, base) if base == "zoo" else base)
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name not in (module, "zoo"):
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    known, lazy = modules(), lazy_names()
    return {m: imported(m, p, known, lazy) for m, p in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_walker_sees_a_circle_and_function_level_imports():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    known = modules()
    assert "zoo.io.convert" in imported("zoo.io.load", known["zoo.io.load"], known, {})  # imported inside load()


def test_the_import_graph_has_no_circle():
    found = circles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_moe_core_imports_no_room_above_its_declarations():
    """The MoE core imports itself, the component declarations (controls, options, the registry) and the finite
    checks (a leaf that imports nothing of zoo): nothing of io, editing, the demos or the command line."""
    allowed = ("zoo.moe", "zoo.components.controls", "zoo.components.options", "zoo.components.registry",
               "zoo.io.finite")
    for module, targets in graph().items():
        if module.startswith("zoo.moe"):
            above = sorted(t for t in targets if not t.startswith(allowed))
            assert not above, f"{module} imports {above}"


def test_the_kernels_import_nothing_that_calls_them():
    edges = graph()
    callers = {m for m, targets in edges.items() if any(t.startswith("zoo.moe.kernels") for t in targets)}
    for module, targets in edges.items():
        if module.startswith("zoo.moe.kernels"):
            assert not (targets & callers), f"{module} imports {sorted(targets & callers)}, which call the kernels"
