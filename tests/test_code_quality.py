"""The package's shape: imports point one way, every module imports on its own, and the code is
ruff-clean (check and format, configured in pyproject.toml)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vaswani_tx"
# What `save_pretrained` copies next to the weights for trust_remote_code: model/, whose files import torch,
# transformers and each other, nothing else of ours (the engine's one bridge, inside generate(), aside).
TRAVELLING = {path.stem for path in (PACKAGE / "model").glob("*.py") if path.name != "__init__.py"}
# The layers, top to bottom: a module imports only from its own subpackage and from layers below its own, counting
# imports inside functions. The shared helpers (folder checks, text reading, and below them atomic writes, whose
# rule of what is replaced the folder checks follow) sit just above model/.
LAYERS = [
    {"cli"},
    {"demo", "parsing"},
    {"training", "interop"},
    {"engine"},
    {"data", "metrics"},
    {"folders", "text_io"},
    {"atomic"},
    {"model"},
]
BRIDGE = ("vaswani_tx.model.generation_vaswani", "vaswani_tx.engine")  # generate() -> the engine, where installed


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> list[str]:
    """Every module of the package but `__main__` (which runs the CLI when imported)."""
    return sorted(module_name(p) for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


def is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`, whose imports never run."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def nodes_that_run(tree: ast.Module) -> list[ast.AST]:
    """Every node of a module, function bodies included, but for those inside `if TYPE_CHECKING:` blocks."""
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(
            node.orelse if isinstance(node, ast.If) and is_type_checking(node.test) else ast.iter_child_nodes(node)
        )
    return nodes


def imported_modules(path: Path, function_bodies: bool = False) -> set[str]:
    """The package modules `path` imports when it is imported: top-level statements only (imports
    inside functions run later, and `if TYPE_CHECKING:` blocks never). With `function_bodies`, the
    imports inside functions too (still not those of `if TYPE_CHECKING:` blocks)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    modules = set(package_modules())
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in nodes_that_run(tree) if function_bodies else tree.body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules  # `from . import module`
            found.update(submodules or {base})
    return {m for m in found if m in modules and m != name}


def test_no_import_cycle():
    """No cycle, counting imports inside functions: one that runs later still ties the two modules together
    (neither can be read, tested or moved without the other)."""
    graph = {module_name(p): imported_modules(p, function_bodies=True) for p in PACKAGE.rglob("*.py")}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycle = path[path.index(target) :] + [target] if target in path else [module, target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_files_that_travel_with_saved_models_import_only_each_other():
    for name in TRAVELLING:
        ours = {m for m in imported_modules(PACKAGE / "model" / f"{name}.py", function_bodies=True)}
        ours -= {BRIDGE[1]} if f"vaswani_tx.model.{name}" == BRIDGE[0] else set()
        outside = {m for m in ours if not m.startswith("vaswani_tx.model.")}
        assert not outside, f"model/{name}.py imports {sorted(outside)}, which saved models do not carry"


def layer_of(module: str) -> int | None:
    """The index in LAYERS of a module's subpackage (or top-level helper); None for the package itself."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return next(index for index, names in enumerate(LAYERS) if parts[1] in names)


def test_imports_point_one_way_down_the_layers():
    """cli; then demo, parsing; then training, interop; then engine; then data, metrics; then the helpers; then
    model: each module imports its own subpackage and the layers below it only, imports inside functions included."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        module = module_name(path)
        here = layer_of(module)
        if here is None:
            continue
        for target in imported_modules(path, function_bodies=True):
            there = layer_of(target)
            same = target.split(".")[1] == module.split(".")[1]
            if there is not None and not same and there <= here and (module, target) != BRIDGE:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_the_package_is_subpackages_and_at_most_three_helpers():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert top == ["atomic", "folders", "text_io"]
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()} == {
        name for names in LAYERS for name in names if (PACKAGE / name).is_dir()
    }


def test_each_module_imports_alone_in_a_fresh_process():
    """Each module first, with no other module of the package loaded before it (torch and transformers
    stay loaded: only the order of our own imports can hide a cycle)."""
    script = (
        "import importlib, sys, torch, transformers\n"
        f"for name in {package_modules()!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'vaswani_tx' or m.startswith('vaswani_tx.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as error:\n"
        "        print(f'{name}: {type(error).__name__}: {error}')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "", "modules that do not import on their own:\n" + result.stdout


def ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: it is in the dev extra (pip install -e '.[dev]')")
    return found


@pytest.mark.parametrize("command", [["check"], ["format", "--check", "--diff"]], ids=["check", "format"])
def test_ruff(command):
    result = subprocess.run(
        [ruff(), *command, "src", "tests", "benchmarks", "examples"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
