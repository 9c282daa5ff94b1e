"""Writes the pack files in this folder with packstore as it was before format version 6 (``built_on`` with only
``device`` and ``dtype``): run from a checkout of commit 7d2a287 as ``python make_packs.py OUT``. The packs' tensors
are the seeded ones of ``knowledge``; tests/unit/test_format_hardware.py reads them back.

- ``v4-built-on.pack``: an exact knowledge pack (version 4) recording its prefill and ``built_on`` {cuda, bfloat16};
- ``v5-engine.pack``: a pack a serving engine prefilled (version 5), ``built_on`` {cpu, float32};
- ``v4-rope.pack``: a RoPE-spliced composition (version 4, layout 2) with ``built_on`` {cpu, float32}.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from packstore.format.header import PackHeader
from packstore.packs.admin import export_pack
from packstore.packs.tensors import Pack, encode_pack
from packstore.store import LmdbStore

FP_A, FP_B = "a" * 64, "b" * 64
ENGINE = {"name": "vllm", "version": "0.32.0", "block_size": 32}


def knowledge(tokens: int, seed: int, dtype: str = "float32", **fields) -> Pack:
    header = PackHeader(
        kind="knowledge", model_fp=FP_A, template_fp=FP_B, model_name="test", token_ids=tuple(range(10, 10 + tokens)),
        layers=3, kv_heads=2, head_dim=8, dtype=dtype, facts=(f"fact {seed}",), raw=False, created="2026-01-01T00:00:00Z",
        **fields,
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(2, tokens, 8, generator=gen).to(getattr(torch, dtype)) for _ in range(6)]
    return Pack(header, tensors[:3], tensors[3:])


def packs() -> dict[str, Pack]:
    built = knowledge(6, 11, "bfloat16", prefill_chunks=(0, 4, 6), built_on={"device": "cuda", "dtype": "bfloat16"})
    engine = knowledge(5, 12, prefill_chunks=(0, 5), built_on={"device": "cpu", "dtype": "float32"}, engine=ENGINE)
    rope = knowledge(7, 13, built_on={"device": "cpu", "dtype": "float32"})
    rope.header = dataclasses.replace(rope.header, composition="rope", parents=(built.header.key, engine.header.key))
    return {"v4-built-on": built, "v5-engine": engine, "v4-rope": rope}


def main(out: Path) -> None:
    with LmdbStore(out / "store") as store:
        for name, pack in packs().items():
            store.put(encode_pack(pack), name=name)
            export_pack(store, name, out / f"{name}.pack")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
