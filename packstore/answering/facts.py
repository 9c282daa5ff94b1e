"""Read fact and question files: plain text (one item a line) or JSONL with a text field."""

from __future__ import annotations

import json
from pathlib import Path

from packstore.errors import InvalidInput
from packstore.kv.records import Example, Pair


def _read_lines(path: str | Path) -> list[tuple[int, str]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidInput(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{path}: cannot read: {exc}") from None
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if line.strip()]


def _json_field(path: str | Path, number: int, line: str, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{path}:{number}: not valid JSON: {exc.msg}") from None
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(f"{path}:{number}: needs a non-empty string field {field!r}")
    return value.strip()


def read_items(path: str | Path, field: str) -> list[str]:
    """Items of a file: JSONL objects' ``field`` if every line is a JSON object, else one item per line."""
    lines = _read_lines(path)
    if not lines:
        raise InvalidInput(f"{path}: is empty")
    if all(line.startswith("{") for _, line in lines):
        return [_json_field(path, number, line, field) for number, line in lines]
    return [line for _, line in lines]


def read_facts(path: str | Path) -> list[str]:
    """Facts: one per line, or JSONL with ``text``."""
    return read_items(path, "text")


def read_questions(path: str | Path) -> list[str]:
    """Questions: JSONL with ``question`` (or one per line)."""
    return read_items(path, "question")


def read_pairs(path: str | Path) -> list[Pair]:
    """Contrastive pairs: JSONL lines ``{"good": ..., "bad": ...}``, both non-empty strings."""
    lines = _read_lines(path)
    if not lines:
        raise InvalidInput(f"{path}: is empty: a steering pack needs at least one {{good, bad}} pair")
    return [Pair(_json_field(path, number, line, "good"), _json_field(path, number, line, "bad")) for number, line in lines]


def read_examples(path: str | Path) -> list[Example]:
    """Adapter-training examples: JSONL lines ``{"documents": [TEXT, ...], "question": TEXT}``, at least two
    documents each; a document's lines are its facts."""
    examples = []
    for number, line in _read_lines(path):
        question = _json_field(path, number, line, "question")
        documents = json.loads(line).get("documents")
        if not isinstance(documents, list) or len(documents) < 2 or not all(isinstance(d, str) and d.strip() for d in documents):
            raise InvalidInput(f"{path}:{number}: needs 'documents', a list of at least 2 non-empty strings")
        facts = tuple(tuple(fact.strip() for fact in document.splitlines() if fact.strip()) for document in documents)
        examples.append(Example(facts, question))
    if not examples:
        raise InvalidInput(f"{path}: is empty")
    return examples
