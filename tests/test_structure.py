"""The shape of the code (issue 19): files a reader can hold in their head, functions
that fit on a screen, and imports that run one way. Measured on the source, so a change
that grows a file past the limit or closes an import circle fails here, not in review."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"daemon": "llmd", "client": "llmd_client", "tools": "llmd_tools"}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    """Import name -> file, for every module of the three packages."""
    modules = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported(module: str, path: Path, tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports, at the top or inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imported(m, p, ast.parse(p.read_text()), modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    assert _cycles(_import_graph()) == []


def test_the_daemon_and_client_never_import_the_tools():
    graph = _import_graph()
    offenders = {m: sorted(t for t in targets if t.startswith("llmd_tools"))
                 for m, targets in graph.items() if not m.startswith("llmd_tools")}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_the_client_imports_nothing_of_the_daemon():
    graph = _import_graph()
    offenders = {m: sorted(t for t in targets if t.startswith("llmd."))
                 for m, targets in graph.items() if m.startswith("llmd_client")}
    assert {m: t for m, t in offenders.items() if t} == {}


def _sources():
    for folder in ("daemon", "client"):
        yield from sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", list(_sources()), ids=lambda p: str(p.relative_to(ROOT)))
def test_file_and_function_sizes(path: Path):
    text = path.read_text()
    num_lines = text.count("\n")
    assert num_lines <= MAX_FILE_LINES, f"{path.name} has {num_lines} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
            for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


# -- the worker side's packages (issue 26) -------------------------------------------------

def test_sampling_knows_nothing_of_the_runner():
    """gpu/sample takes logits and SamplingMetadata: it imports no worker module (the
    runner, its batch and types, the draft model) and no model."""
    graph = _import_graph()
    offenders = {m: sorted(t for t in targets if t.startswith(("llmd.gpu.worker", "llmd.gpu.models")))
                 for m, targets in graph.items() if m.startswith("llmd.gpu.sample")}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_no_module_left_flat_beside_the_gpu_packages():
    flat = sorted(p.name for p in (ROOT / "daemon/gpu").glob("*.py") if p.name != "__init__.py")
    assert flat == []


def test_layers_import_no_worker_and_no_model():
    graph = _import_graph()
    offenders = {m: sorted(t for t in targets if t.startswith(("llmd.gpu.worker", "llmd.gpu.models")))
                 for m, targets in graph.items() if m.startswith("llmd.gpu.layers")}
    assert {m: t for m, t in offenders.items() if t} == {}



def test_the_scheduler_side_imports_no_worker_actor_or_server():
    graph = _import_graph()
    banned = ("llmd.gpu", "llmd.actors", "llmd.server", "llmd.http")
    offenders = {m: sorted(t for t in targets if t.startswith(banned))
                 for m, targets in graph.items() if m.startswith("llmd.core")}
    assert {m: t for m, t in offenders.items() if t} == {}
