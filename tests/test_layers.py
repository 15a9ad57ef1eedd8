"""The import graph of src/diffgemma follows DESIGN.md's layers (issue #58, "Must show"): every import, function
level and TYPE_CHECKING ones included, parsed with `ast`; no package imports one above it and no cycle joins
packages. The arrows the rest of #58 has still to remove are listed in KNOWN, each with the item that removes it;
the list can only shrink: an arrow in it that no longer exists fails the test too, so that its entry is deleted."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "diffgemma"

# Each package's (or top-level module's) layer: it may import its own layer and those below, never one above.
# "__init__" is the package itself (`import diffgemma`: Engine, load, Session, all from session.client), the public
# face under the front ends.
LAYER = {
    # front ends: `diffgemma` runs bench, train and serve, so they sit beside cli
    "cli": 8,
    "server": 8,
    "bench": 8,
    "train": 8,
    "census": 8,  # campaigns of arms over batteries, through `diffgemma.load`
    "__init__": 7,
    "session": 6,
    "engine": 5,
    "runner": 4,
    "weights": 3,  # the loader that builds the model, the pack writer, the community FP8 reader
    "model": 2,
    "kernels": 1,
    # the bottom: imports nothing above it
    "chat": 0,
    "quant": 0,  # the formats only
    "config": 0,
    "config_fields": 0,
    "version": 0,
    "testing": 0,
}
# A helper for tests and the front ends that make tiny models: nothing in the engine's stack imports it.
TESTING_USERS = {"bench", "train"}

# Arrows not yet removed (the other items of #58 own the files they are in). Delete an entry when its arrow goes.
KNOWN: set[tuple[str, str]] = set()


def _package(path: Path) -> str:
    """The layer unit a source file belongs to: its top-level package, or a top-level module's stem."""
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _module(path: Path) -> list[str]:
    """The dotted name of the file's module, as a list ("diffgemma", ...); a package's __init__ is the package."""
    parts = ["diffgemma", *path.relative_to(SRC).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _targets(node: ast.AST, path: Path) -> list[str]:
    """The diffgemma modules an import statement names, absolute and dotted."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "diffgemma"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from the file's package
        here = _module(path) if path.name == "__init__.py" else _module(path)[:-1]
        base = here[: len(here) - node.level + 1] + ([node.module] if node.module else [])
        module = ".".join(base)
    else:
        module = node.module or ""
    if module.split(".")[0] != "diffgemma":
        return []
    # `from diffgemma import x`: x a subpackage or module, else a name of the package
    if module == "diffgemma":
        return [f"diffgemma.{a.name}" if _is_unit(a.name) else "diffgemma" for a in node.names]
    return [module]


def _is_unit(name: str) -> bool:
    return (SRC / name).is_dir() or (SRC / f"{name}.py").is_file()


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def import_graph() -> dict[tuple[str, str], list[str]]:
    """Every arrow between layer units: (importer, imported) -> the "file:line" of each import that makes it."""
    arrows: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        src = _package(path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _targets(node, path):
                dst = _unit(target)
                if dst != src:
                    arrows[src, dst].append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    return dict(arrows)


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan's algorithm)."""
    succ: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        succ[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted({u for e in edges for u in e}):
        if v not in index:
            visit(v)
    return found


def test_every_unit_has_a_layer():
    units = {_package(p) for p in SRC.rglob("*.py")}
    assert units <= set(LAYER), f"give these a layer in LAYER: {sorted(units - set(LAYER))}"


def test_no_upward_import():
    graph = import_graph()
    bad = {
        arrow: where
        for arrow, where in graph.items()
        if arrow not in KNOWN
        and (LAYER[arrow[0]] < LAYER[arrow[1]] or (arrow[1] == "testing" and arrow[0] not in TESTING_USERS))
    }
    assert not bad, "upward imports:\n" + "\n".join(
        f"{a} -> {b}: {', '.join(w)}" for (a, b), w in bad.items()
    )


def test_no_cycle_between_packages():
    edges = set(import_graph()) - KNOWN
    assert not _cycles(edges), f"import cycles between packages: {_cycles(edges)}"


def test_known_violations_only_shrink():
    graph = import_graph()
    gone = sorted(KNOWN - set(graph))
    assert not gone, f"these arrows are gone: delete them from KNOWN: {gone}"
    allowed = {a for a in KNOWN if LAYER[a[0]] >= LAYER[a[1]]}
    assert not allowed, f"these arrows are not violations: delete them from KNOWN: {sorted(allowed)}"


def test_the_graph_is_read_whole():
    """The parser sees function-level imports and `from diffgemma import x` (a guard on the guard)."""
    graph = import_graph()
    assert ("cli", "__init__") in graph  # `import diffgemma` inside cli's commands only
    assert ("weights", "model") in graph and ("model", "kernels") in graph
