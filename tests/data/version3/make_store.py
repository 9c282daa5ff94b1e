"""Writes the store and pack file in this folder with packstore as it was before format version 4 (sha256
chunk digests): run from a checkout of commit dcd4730 as ``python make_store.py OUT``. The packs' tensors
are the seeded ones of ``expected_packs`` in tests/unit/test_format_versions.py, which reads them back."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from packstore.format.header import PackHeader
from packstore.packs.admin import export_pack
from packstore.packs.tensors import Pack, encode_pack
from packstore.security.trust import SigningKey
from packstore.store import LmdbStore

FP_A, FP_B = "a" * 64, "b" * 64
SIGNING_SEED = bytes(range(32))  # a fixed Ed25519 key, so the signature is reproducible


def knowledge(tokens: int, seed: int) -> Pack:
    header = PackHeader(
        kind="knowledge", model_fp=FP_A, template_fp=FP_B, model_name="test", token_ids=tuple(range(10, 10 + tokens)),
        layers=3, kv_heads=2, head_dim=8, dtype="float32", facts=(f"fact {seed}",), raw=False, created="2026-01-01T00:00:00Z",
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(2, tokens, 8, generator=gen) for _ in range(6)]
    return Pack(header, tensors[:3], tensors[3:])


def steering() -> Pack:
    recipe = {"pairs": [{"good": "a kind word", "bad": "a cruel word"}], "pooling": "last", "layers": [1, 2]}
    header = PackHeader(
        kind="steering", model_fp=FP_A, template_fp=FP_B, model_name="test", token_ids=(), layers=3, kv_heads=2,
        head_dim=8, dtype="float32", facts=(), raw=False, created="2026-01-01T00:00:00Z", recipe=recipe, metrics={},
    )
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(2, 8, generator=gen) for _ in range(4)]
    return Pack(header, tensors[:2], tensors[2:])


def main(out: Path) -> None:
    signer = SigningKey(Ed25519PrivateKey.from_private_bytes(SIGNING_SEED))
    exact = encode_pack(knowledge(5, 1))
    exact = dataclasses.replace(exact, signatures=(signer.sign("pack", exact.header.pack_sha256),))
    blocks = encode_pack(knowledge(40, 2), block_positions=16)
    spliced = knowledge(7, 4)
    spliced.header = dataclasses.replace(spliced.header, composition="rope", parents=(exact.header.key, blocks.header.key))
    rope = encode_pack(spliced)
    with LmdbStore(out / "store") as store:
        for name, encoded in (("v1-exact", exact), ("v1-blocks", blocks), ("v2-rope", rope), ("v3-steering", encode_pack(steering()))):
            store.put(encoded, name=name)
        export_pack(store, "v1-exact", out / "v1-exact.pack")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
