"""Fixtures of the object-tier tests: the session's SeaweedFS (``seaweed``, tests/conftest.py), a prefix of its bucket
per test, and two replicas on it."""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the s3 extra (boto3): imported where used, so that collecting these tests needs no boto3
    from packstore.store.objects.store import ObjectStore
    from tools.lib.seaweed import Seaweed

# boto3 (the s3 extra) is these tests' own need: a host without it (a GPU machine) collects none of them.
collect_ignore_glob = [] if importlib.util.find_spec("boto3") else ["test_*.py"]


@pytest.fixture
def url(seaweed: Seaweed, request) -> str:
    """This test's own prefix of the bucket (the module's name too: the SeaweedFS is the session's)."""
    test = request.node.name.replace("[", "-").rstrip("]")
    return f"s3://{seaweed.bucket}/{request.module.__name__.rsplit('.', 1)[-1]}/{test}"


@pytest.fixture
def replicas(url: str, tmp_path: Path) -> Iterator[tuple[ObjectStore, ObjectStore]]:
    """Two stores on one bucket and prefix, each with its own cache: two replicas of a service."""
    from packstore.store.objects.store import ObjectStore

    with ObjectStore(url, cache_dir=tmp_path / "a") as a, ObjectStore(url, cache_dir=tmp_path / "b") as b:
        yield a, b


@pytest.fixture
def model_fp(request) -> str:
    return hashlib.sha256(request.node.name.encode()).hexdigest()
