"""Synthetic packs for tests and benchmarks that need a valid pack but no model: random K/V of a small shape under
fixed fingerprints, and a store holding one named pack."""

from __future__ import annotations

from pathlib import Path

import torch

from packstore.format import PackHeader
from packstore.packs.admin import export_pack
from packstore.packs.tensors import Pack, encode_pack, torch_dtype
from packstore.store import LmdbStore

FP_A = "a" * 64  # the model fingerprint of every synthetic pack
FP_B = "b" * 64  # its template fingerprint
NAME = "light"  # the name ``make_store`` gives its pack


def make_pack(dtype: str = "float32", layers: int = 3, tokens: int = 5, heads: int = 2, dim: int = 4) -> Pack:
    """A knowledge pack of seeded random K/V (the same for the same arguments) with two facts, one of them non-ASCII."""
    header = PackHeader(
        kind="knowledge",
        model_fp=FP_A,
        template_fp=FP_B,
        model_name="test",
        token_ids=tuple(range(10, 10 + tokens)),
        layers=layers,
        kv_heads=heads,
        head_dim=dim,
        dtype=dtype,
        facts=("one fact", "another fact, with ünïcode"),
        raw=False,
        created="2026-01-01T00:00:00Z",
    )
    gen = torch.Generator().manual_seed(0)
    shape = (heads, tokens, dim)
    keys = [torch.randn(shape, generator=gen).to(torch_dtype(dtype)) for _ in range(layers)]
    values = [torch.randn(shape, generator=gen).to(torch_dtype(dtype)) for _ in range(layers)]
    return Pack(header=header, keys=keys, values=values)


def make_store(root: Path) -> tuple[Path, str, Path]:
    """A store under ``root`` holding one pack named ``NAME``, and that pack as a pack file: (store, key, file)."""
    with LmdbStore(root / "store") as store:
        key, _ = store.put(encode_pack(make_pack(tokens=24)), name=NAME)
        export_pack(store, key, root / "light.pack")
    return root / "store", key, root / "light.pack"
