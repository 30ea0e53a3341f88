"""Write ``assets/prompts/completion_dev.jsonl``: code-completion prompts, as assistants see them.

Each prompt is the source that precedes a documented function in a Python file (up to
``CONTEXT_LINES`` lines) plus the function's signature and docstring, and asks for the body:
a long prompt and a short answer, where copying from the context pays. The functions come
from NumPy's pure-Python modules, which the shipped draft heads never trained on (they saw
the standard library). It sits beside the prompt sets it makes; run it from the repository root,
in the project's environment::

    python assets/prompts/make_completion_prompts.py
"""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

COUNT = 24
CONTEXT_LINES = 60
ASK = "Complete the body of the last function. Reply with the code of the whole function only.\n\n```python\n{code}\n```"


def candidates(root: Path) -> list[tuple[Path, str]]:
    """(file, prompt code) for one documented function of at least 6 body lines per file."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if {"tests", "testing", "_examples"} & set(path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not ast.get_docstring(node) or len(node.body) < 2:
                continue
            if node.end_lineno - node.lineno < 8:
                continue
            doc_end = node.body[0].end_lineno  # the docstring is the first statement
            start = max(0, node.lineno - 1 - CONTEXT_LINES)
            code = "\n".join(lines[start:doc_end])
            if 1500 <= len(code) <= 6000:
                out.append((path, code))
                break
    return out


def main() -> None:
    import numpy

    root = Path(numpy.__file__).parent
    items = candidates(root)
    random.Random(0).shuffle(items)
    dest = Path(__file__).resolve().parent / "completion_dev.jsonl"
    with dest.open("w", encoding="utf-8") as f:
        for k, (path, code) in enumerate(items[:COUNT]):
            f.write(json.dumps({"question_id": 3000 + k, "category": "completion", "turns": [ASK.format(code=code)],
                                "source": f"numpy {numpy.__version__}: {path.relative_to(root.parent)}"}) + "\n")
    print(f"{min(COUNT, len(items))} prompts from {len(items)} candidates -> {dest}")


if __name__ == "__main__":
    main()
