"""Writes the store in this folder with packstore as it was before container version 3 (codec
``byteplane-zstd-2``, docs/format.md §1.4): run from a checkout of commit 368c20e as ``python make_codec2_store.py OUT``.
The packs' tensors are seeded (``expected_packs``); tests/unit/test_format_versions.py reads them back bit-exact."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from packstore.format.header import PackHeader
from packstore.packs.tensors import Pack, encode_pack
from packstore.store import LmdbStore

FP_A, FP_B = "a" * 64, "b" * 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def knowledge(dtype: str, tokens: int, seed: int) -> Pack:
    """A knowledge pack of ``tokens`` positions whose K/V look like real KV (normal values, a few large ones)."""
    header = PackHeader(
        kind="knowledge", model_fp=FP_A, template_fp=FP_B, model_name="test", token_ids=tuple(range(1000 * seed, 1000 * seed + tokens)),
        layers=2, kv_heads=2, head_dim=64, dtype=dtype, facts=(f"fact {seed}",), raw=False, created="2026-01-01T00:00:00Z",
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(2, tokens, 64, generator=gen) * torch.rand(1, 1, 64, generator=gen) * 4).to(DTYPES[dtype]) for _ in range(4)]
    tensors[0][:, 0] = 300.0  # an attention sink's large values
    return Pack(header, tensors[:2], tensors[2:])


def expected_packs() -> dict[str, Pack]:
    return {
        "f32-blocks": knowledge("float32", 40, 1),
        "bf16": knowledge("bfloat16", 300, 2),
        "f16": knowledge("float16", 300, 3),
        "f16-blocks": knowledge("float16", 40, 4),
    }


def main(out: Path) -> None:
    with LmdbStore(out / "store") as store:
        for name, pack in expected_packs().items():
            store.put(encode_pack(pack, block_positions=16) if name.endswith("blocks") else encode_pack(pack), name=name)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
