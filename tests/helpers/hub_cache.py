"""A local Hugging Face cache holding a model directory under a hub id, laid out as the hub's download leaves it (refs,
snapshots of links), so that code given a hub id can be tested offline (``HF_HUB_OFFLINE=1``)."""

from __future__ import annotations

from pathlib import Path

COMMIT = "a" * 40


def hub_cache(model_dir: Path, root: Path, repo: str, commit: str = COMMIT) -> Path:
    """``root``, a cache holding ``model_dir``'s files as hub id ``repo`` at ``commit`` (its main ref)."""
    entry = root / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.is_file():
            (snapshot / item.name).symlink_to(item.resolve())
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return root
