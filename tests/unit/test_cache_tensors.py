"""cache_tensors: per-layer K and V of a filled cache as CPU tensors of the first positions (on CUDA through one pinned
buffer, copied without waiting and synchronized once), and the chunk threads' count."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache

from packstore.kv.build import cache_tensors
from packstore.packs import decoder


def filled(device: str, layers: int = 3, positions: int = 9) -> tuple[DynamicCache, list[torch.Tensor], list[torch.Tensor]]:
    cache = DynamicCache()
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, 2, positions, 4, generator=gen).to(device) for _ in range(layers)]
    values = [torch.randn(1, 2, positions, 4, generator=gen).to(device) for _ in range(layers)]
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)
    return cache, keys, values


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))])
@pytest.mark.parametrize("tokens", [None, 5])
def test_layers_come_to_the_cpu_whole_or_their_first_positions(device: str, tokens: int | None) -> None:
    cache, keys, values = filled(device)
    got_keys, got_values = cache_tensors(cache, tokens)
    for got, expected in zip(got_keys + got_values, keys + values):
        assert got.device.type == "cpu" and got.is_contiguous()
        assert torch.equal(got, expected[0, :, :tokens].cpu())


def test_the_chunk_pool_follows_the_cores_this_process_may_use_up_to_a_bound() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    assert decoder.WORKERS == max(1, min(decoder.MAX_WORKERS, cores))
