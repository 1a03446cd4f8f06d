"""The house's layers (docs/architecture.md): each module of lit_model imports only lit_model modules of its own
layer or of layers below it, at the top of the module (never inside a function; under ``if TYPE_CHECKING`` counts as
the top), and no modules import each other round a circle. Read from the source with ``ast``: nothing is
imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lit_model"

# Lowest first; a module may import its own layer and the ones before it. The last layer is the commands: the
# flag parser, `lit-model`, and the `python -m lit_model.X` modules users know.
LAYERS = (
    ("core",), ("kernels",), ("model",), ("io", "data"), ("methods",), ("parallel",), ("run",), ("infer",),
    ("train",), ("plan",), ("recipes",), ("entry", "__main__", "config", "convert", "download", "lora"),
)
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer_of(module: str) -> int:
    """The layer of ``lit_model.X...``: its first part below lit_model (a module at the top: its own name); the
    package itself, which re-exports the public names, stands with the commands."""
    parts = module.split(".")
    return LEVEL[parts[1]] if len(parts) > 1 else len(LAYERS) - 1


def lit_model_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, whether the import stands inside a function) for every import of a lit_model module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(child) for child in ast.walk(node) if child is not node)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` imports the module; `from module import name`, the module
            names = [f"{node.module}.{a.name}" if is_module(f"{node.module}.{a.name}") else node.module for a in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(name, id(node) in inside) for name in names if name == "lit_model" or name.startswith("lit_model.")]
    return found


def violations() -> set[tuple[str, str, str]]:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative, level = str(path.relative_to(PACKAGE)), layer_of(module_name(path))
        for imported, in_function in lit_model_imports(path):
            if imported == "lit_model":
                continue
            if in_function:
                found.add((relative, imported, "in a function"))
            if layer_of(imported) > level:
                found.add((relative, imported, "upward"))
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = {module_name(p) for p in PACKAGE.rglob("*.py")} - {"lit_model"}
    unplaced = {m for m in unplaced if m.split(".")[1] not in LEVEL}
    assert not unplaced, f"modules in no layer of LAYERS: {sorted(unplaced)}"


def test_imports_point_down_and_stand_at_the_top() -> None:
    assert violations() == set(), "imports against the layers: move the code to its layer, or the import to the top"


def circles() -> set[frozenset[str]]:
    """The import circles: the strongly connected components of the import graph (Tarjan) with more than one
    module, or one module that imports itself."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        graph[module_name(path)] = {name for name, _ in lit_model_imports(path) if name != "lit_model"}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node] & graph.keys():
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1 or node in graph[node]:
                found.add(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_import_circle() -> None:
    assert circles() == set()


def source_of(module: str) -> Path:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imported_with(module: str) -> set[str]:
    """The lit_model modules that importing ``module`` runs: those it imports at the top, theirs, and so on, with the
    packages above each."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parent = name.rpartition(".")[0]
        todo += [parent] if parent else []
        todo += [imported for imported, in_function in lit_model_imports(source_of(name)) if not in_function]
    return seen


def imports_lightning(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(node, ast.Import) and any(a.name.split(".")[0] == "lightning" for a in node.names)
               or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning"
               for node in ast.walk(tree))


def test_generation_imports_no_training_stack() -> None:
    """generate and chat import generation's planner (for --plan) at the top: nothing they import reaches training
    (train/, lightning), which would add seconds to every start."""
    for command in ("lit_model.recipes.generate", "lit_model.recipes.chat"):
        training = sorted(m for m in imported_with(command)
                          if m == "lit_model.train" or m.startswith("lit_model.train.") or imports_lightning(source_of(m)))
        assert not training, f"{command} imports the training stack: {training}"
