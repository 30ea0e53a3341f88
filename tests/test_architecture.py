"""The engine never imports Qt: core/ must run headless, in tests, on servers."""

import ast
from pathlib import Path

FORBIDDEN = ("PySide6", "qasync", "pyqtgraph", "shiboken6", "app")


def test_core_imports_no_gui():
    offenders = []
    for path in Path(__file__).parent.parent.joinpath("core").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for n in names:
                if n.split(".")[0] in FORBIDDEN:
                    offenders.append(f"{path.name}: {n}")
    assert offenders == []
