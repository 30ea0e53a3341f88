"""The house's rules, checked on the source: one installed namespace, and a core without Qt.

Every import of the project's own code is absolute and full (``specplay.core.decoding.engine``), never a
bare ``core``/``app``/``assets``: in the checkout those folders would import a second time under
their bare names (the working folder is on ``sys.path``), installed they do not exist at all.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("app", "core", "tests", "packaging")
OWN = ("core", "app", "assets")
#: What specplay.core must never import: it runs headless, in tests, on servers.
GUI = ("PySide6", "qasync", "pyqtgraph", "shiboken6", "specplay.app")


def _imports(path: Path) -> list[str]:
    """Every absolute module name a file imports (``from X import y`` gives X and X.y)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_core_imports_no_gui():
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path in (ROOT / "core").rglob("*.py")
                 for name in _imports(path) if any(_within(name, gui) for gui in GUI)]
    assert offenders == []


def test_every_import_of_the_project_is_a_full_specplay_name():
    offenders = [f"{path.relative_to(ROOT)}: {name}" for top in SOURCES for path in (ROOT / top).rglob("*.py")
                 for name in _imports(path) if name.split(".")[0] in OWN]
    assert offenders == []
    relative = [str(path.relative_to(ROOT)) for top in SOURCES for path in (ROOT / top).rglob("*.py")
                if any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(ast.parse(path.read_text())))]
    assert relative == []


def test_installed_the_project_is_specplay_only(tmp_path):
    """Outside the checkout (as a user's script runs) only ``specplay.*`` imports: no top-level
    ``core``, ``app`` or ``assets`` from this project."""
    code = """
import importlib, importlib.util
import specplay.core.decoding.engine, specplay.app.launcher, specplay.assets
print([name for name in ("core", "app", "assets") if importlib.util.find_spec(name) is not None])
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------ layers
#: ``specplay.core``'s rooms, bottom to top (docs/architecture.md): a module may import its own
#: room and the rooms below it, never one above. ``specplay.core`` alone is its package file.
LAYERS = (
    ("the helpers", ("specplay.core", "specplay.core.errors", "specplay.core.paths", "specplay.core.atomic",
                     "specplay.core.text", "specplay.core.progress", "specplay.core.memory")),
    ("kernels", ("specplay.core.kernels",)),
    ("weights", ("specplay.core.weights",)),
    ("models", ("specplay.core.models",)),
    ("heads", ("specplay.core.heads",)),
    ("the decoding step", ("specplay.core.decoding",)),
    ("methods", ("specplay.core.methods",)),
    ("records", ("specplay.core.records",)),
    ("remote engines", ("specplay.core.remote",)),
    ("training", ("specplay.core.training",)),
    ("the tools that measure", ("specplay.core.measure",)),
    ("the command line", ("specplay.core.cli",)),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["specplay"] + parts)


def _project_modules() -> dict[str, Path]:
    return {_module_name(path): path for top in ("core", "app") for path in (ROOT / top).rglob("*.py")}


def _edges(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules a file imports, anywhere in it (inside functions too). ``from p import
    m`` is an import of module ``p.m`` where there is one; a module's own packages are not counted
    (importing a module runs them first, whoever imports it)."""
    me = _module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                found.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module)
    return {name for name in found if name in modules and name != me and not _within(me, name)}


def _layer(module: str) -> int:
    """The room of a module of ``specplay.core`` in :data:`LAYERS` (``specplay.core`` itself: only its package file)."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p if p == "specplay.core" else _within(module, p) for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no room of LAYERS: give it one")


def test_every_core_module_imports_only_its_room_and_those_below():
    modules = _project_modules()
    upward = []
    for name, path in modules.items():
        if not _within(name, "specplay.core"):
            continue
        mine = _layer(name)
        upward += [f"{name} ({LAYERS[mine][0]}) imports {other} ({LAYERS[_layer(other)][0]})"
                   for other in sorted(_edges(path, modules)) if _within(other, "specplay.core") and _layer(other) > mine]
    assert upward == []


def test_no_import_circle_anywhere():
    """Tarjan's strongly connected components over every import of the project's own modules."""
    modules = _project_modules()
    graph = {name: _edges(path, modules) for name, path in modules.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


def test_core_and_each_of_its_rooms_hold_few_modules_and_none_too_long():
    top = sorted(p.stem for p in (ROOT / "core").glob("*.py") if p.stem != "__init__")
    assert len(top) <= 10, top
    crowded = {room.name: n for room in (ROOT / "core").iterdir() if room.is_dir() and (room / "__init__.py").is_file()
               if (n := sum(1 for p in room.rglob("*") if p.suffix in (".py", ".c") and p.stem != "__init__")) > 10}
    assert crowded == {}
    sources = [p for top_dir in ("core", "app") for suffix in ("py", "c", "h")
               for p in (ROOT / top_dir).rglob(f"*.{suffix}")]
    long = [f"{p.relative_to(ROOT)}: {n}" for p in sources
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 700]
    assert long == []


def test_every_sub_package_of_core_says_what_it_holds_and_may_import():
    missing = [str(p.relative_to(ROOT)) for p in (ROOT / "core").glob("*/__init__.py")
               if "May import" not in (ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or "")]
    assert missing == []


def _names_storage(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "storage") or (isinstance(node, ast.Attribute)
                                                                    and node.attr == "storage")


def test_a_storage_kind_is_compared_as_its_enum_member_never_as_a_string():
    """``storage == "int8"`` hides a typo until it runs; ``Storage.INT8`` fails at import."""
    offenders = []
    for path in (ROOT / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare) or not any(map(_names_storage, [node.left, *node.comparators])):
                continue
            sides = [n for side in [node.left, *node.comparators]
                     for n in (side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side])]
            if any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in sides):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []

