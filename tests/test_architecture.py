"""The package's shape: imports go from higher layers to lower ones only, there are no import
circles, and no module grows past about 800 lines (one concept each: split by concept, never
to meet a count)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "stepwatch"

# Lowest first. A module may import modules of its own layer or below, never above.
LAYERS: list[tuple[str, ...]] = [
    (
        "stepwatch._validation",
        "stepwatch._version",
        "stepwatch._format",
        "stepwatch._lazy",
        "stepwatch._tensor",
        "stepwatch.monitor.*",
    ),
    (
        "stepwatch.dataset",
        "stepwatch.distributed",
        "stepwatch.context",
        "stepwatch.job",
        "stepwatch.rank_watch",
        "stepwatch.node_metrics",
        "stepwatch.store._schema",
        "stepwatch.store._runs",
        "stepwatch.store.base",
        "stepwatch.store.backends.*",
        "stepwatch.store.reader",
        "stepwatch.store.export",
        "stepwatch.store.writer",
        "stepwatch.store._records",
        "stepwatch.store.notify",
        "stepwatch.store.system",
        "stepwatch.plotting",
        "stepwatch.dashboard.*",
    ),
    ("stepwatch.train.sharded",),  # a sharded network's state, under every saver of it
    (
        "stepwatch.train.metrics",
        "stepwatch.train.serialization",
        "stepwatch.train.step",
        "stepwatch.train.eval_indexes",
    ),
    ("stepwatch.train.state",),
    ("stepwatch.train.resume", "stepwatch.train.checks"),
    ("stepwatch.view.*",),
    ("stepwatch.train.callback._params", "stepwatch.train.callback._callback_args"),
    ("stepwatch.train.callback._callback",),
    ("stepwatch.train.callback._monitor",),
    ("stepwatch.train.callback.*",),
    ("stepwatch.train.parts", "stepwatch.train.parallel"),
    ("stepwatch.train.evaluate",),
    # The one run engine; the trainers drive it: Model's loop, watch, the bridges.
    ("stepwatch.train.engine",),
    ("stepwatch.train.loop", "stepwatch.train.watched", "stepwatch.store.recorder"),
    ("stepwatch.train.model",),
    ("stepwatch.integrations._bridge",),
    ("stepwatch.integrations.*",),
    # The package faces re-export everything; only the top may import them.
    ("stepwatch.demo", "stepwatch.amp", "<faces>"),
    (
        "stepwatch.cli",
        "stepwatch._cli_checks",
        "stepwatch._cli_push",
        "stepwatch._cli_serve",
        "stepwatch.__main__",
    ),
]
# Modules are split by concept, not by a count; this only catches a module that has become
# several concepts at once.
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_face(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _layer(name: str, modules: dict[str, Path]) -> int:
    if _is_face(name, modules):
        name = "<faces>"
    best = None
    for index, patterns in enumerate(LAYERS):
        for pattern in patterns:
            exact = pattern == name
            wildcard = pattern.endswith(".*") and name.startswith(pattern[:-1])
            if exact or (wildcard and best is None):
                best = index
    assert best is not None, f"{name} has no layer in tests/test_architecture.py"
    return best


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names if a.name.startswith("stepwatch"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("stepwatch"):
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                targets.add(sub if sub in modules else module)
    targets.discard(name)
    return targets


def _graph() -> tuple[dict[str, set[str]], dict[str, Path]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}, modules


def test_imports_never_go_up_a_layer() -> None:
    graph, modules = _graph()
    upward = [
        f"{m} (layer {_layer(m, modules)}) imports {t} (layer {_layer(t, modules)})"
        for m, targets in graph.items()
        for t in targets
        if t in modules and _layer(t, modules) > _layer(m, modules)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circles_between_modules() -> None:
    graph, modules = _graph()
    # Importing a submodule runs its package's face first; that is Python, not a circle.
    edges = {
        m: {t for t in ts if t in modules and not _is_face(t, modules)}
        for m, ts in graph.items()
        if not _is_face(m, modules)
    }
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert not cycles, cycles


def test_no_module_is_over_about_800_lines() -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long
