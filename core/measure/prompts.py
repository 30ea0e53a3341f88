"""Prompt files in Spec-Bench's question format: the built-in sets and any file of the same shape,
read with a message that names the line of whatever is wrong in it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


from specplay.core.errors import ConfigError
from specplay.core.paths import assets_dir
from specplay.core.text import lone_surrogate_at

BUILTIN_SETS = {"code": "code_prompts_dev.jsonl", "spec_bench": "spec_bench_dev.jsonl",
                "completion": "completion_dev.jsonl"}
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@dataclass(frozen=True)
class Question:
    question_id: object
    category: str
    turns: tuple[str, ...]


def load_questions(source: str, categories: list[str] | None = None, limit: int | None = None,
                   per_category: int | None = None) -> list[Question]:
    """Read a Spec-Bench question file (or a built-in set name); bad lines are errors that name the line.

    ``per_category`` keeps the first N questions of each category; ``limit`` the first N overall.
    """
    path = Path(source)
    if source in BUILTIN_SETS:
        path = assets_dir() / "prompts" / BUILTIN_SETS[source]
    if not path.is_file():
        raise ConfigError(f"prompt file not found: {source} (built-in sets: {', '.join(BUILTIN_SETS)})")
    questions = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not valid UTF-8 (byte {exc.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}, line {n}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}, line {n}: expected a JSON object")
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise ConfigError(f"{path}, line {n}: 'turns' must be a non-empty list of non-empty strings")
        for i, turn in enumerate(turns, 1):
            at = lone_surrogate_at(turn)
            if at is not None:
                raise ConfigError(f"{path}, line {n}: turn {i} is not valid UTF-8 text (a lone surrogate at "
                                  f"character {at})")
        if "question_id" not in obj:
            raise ConfigError(f"{path}, line {n}: missing 'question_id'")
        questions.append(Question(obj["question_id"], str(obj.get("category", "default")), tuple(turns)))
    if categories:
        wanted = set(categories)
        if "mt_bench" in wanted:
            wanted |= MT_BENCH
        questions = [q for q in questions if q.category in wanted]
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for q in questions:
            seen[q.category] = seen.get(q.category, 0) + 1
            if seen[q.category] <= per_category:
                kept.append(q)
        questions = kept
    if limit is not None:
        questions = questions[:limit]
    if not questions:
        raise ConfigError(f"no questions selected from {path}")
    return questions
