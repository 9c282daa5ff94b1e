"""The identity of a model's files: what a bank records of its embedder and a route of its reranker, so that
vectors or scores from any other files are refused or told apart."""

from __future__ import annotations

import hashlib
from pathlib import Path

from packstore.format.header import canonical_json


def files_digest(directory: Path) -> str:
    """sha256 over every file's relative path and bytes, in path order (weights, config, tokenizer, pooling)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")):
        digest.update(canonical_json([str(path.relative_to(directory)), path.stat().st_size]))
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()
