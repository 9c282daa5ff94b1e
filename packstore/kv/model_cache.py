"""Where the model side caches what it computes once per model: converted checkpoints, embedders, identities."""

from __future__ import annotations

import os
from pathlib import Path


def model_cache_dir() -> Path:
    """``$PACKSTORE_MODEL_CACHE``, else ``$XDG_CACHE_HOME/packstore/models``, else ``~/.cache/packstore/models``."""
    if os.environ.get("PACKSTORE_MODEL_CACHE"):
        return Path(os.environ["PACKSTORE_MODEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "packstore" / "models"
