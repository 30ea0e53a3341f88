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
