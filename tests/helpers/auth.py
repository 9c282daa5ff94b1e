"""Tenants for the auth tests: tokens (secret, namespaces, role), the ``--auth`` file naming them, and the message of
a refused read."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from packstore.errors import PackNotFound

TOKENS = {
    "a-writer": ("secret-a-writer", ["a"], "write"),
    "a-reader": ("secret-a-reader", ["a"], "read"),
    "b-writer": ("secret-b-writer", ["b"], "write"),
    "ab-reader": ("secret-ab-reader", ["a", "b"], "read"),
    "operator": ("secret-operator", ["*"], "admin"),
}


def tokens_file(path: Path, tokens: dict = TOKENS) -> Path:
    entries = [
        f'[[token]]\nname = "{name}"\nsha256 = "{hashlib.sha256(secret.encode()).hexdigest()}"\nnamespaces = {json.dumps(spaces)}\nrole = "{role}"\n'
        for name, (secret, spaces, role) in tokens.items()
    ]
    path.write_text("\n".join(entries))
    return path


def refusal(read: Callable[[], object]) -> str:
    """The message of the NOT_FOUND that ``read()`` gets."""
    with pytest.raises(PackNotFound) as refused:
        read()
    return str(refused.value)
