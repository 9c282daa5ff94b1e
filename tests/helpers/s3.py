"""What the object-tier tests share: packs with chunks of their own, the objects a prefix holds on the server, and
the facts of a bank."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from packstore.packs.tensors import Pack
from tests.helpers.packs import make_pack

if TYPE_CHECKING:
    from tools.lib.seaweed import Seaweed

FACTS = [f"Locker {i} holds the {('red', 'green', 'blue', 'amber')[i % 4]} umbrella of guest {200 + i}." for i in range(40)]


def random_pack(model_fp: str, seed: int, *, layers: int = 3, tokens: int = 8) -> Pack:
    """A pack whose chunks no other pack shares (random tensors of its own)."""
    base = make_pack(layers=layers, tokens=tokens, heads=2, dim=16).header
    header = dataclasses.replace(base, model_fp=model_fp, token_ids=tuple(range(seed * 1000, seed * 1000 + tokens)))
    generator = torch.Generator().manual_seed(seed)
    shape = header.tensor_shape
    return Pack(header, [torch.randn(shape, generator=generator) for _ in range(layers)], [torch.randn(shape, generator=generator) for _ in range(layers)])


def objects(seaweed: Seaweed, url: str, below: str) -> dict[str, int]:
    """Object name (below the store's default namespace) -> size, straight from the server."""
    prefix = url.split("/", 3)[3] + "/ns/default/"
    pages = seaweed.client().get_paginator("list_objects_v2").paginate(Bucket=seaweed.bucket, Prefix=prefix + below)
    return {item["Key"][len(prefix) :]: item["Size"] for page in pages for item in page.get("Contents", [])}


def same_tensors(a: Pack, b: Pack) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))
