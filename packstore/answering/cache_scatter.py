"""A pack's rows written straight into a paged KV cache whose layout has been checked against the engine's own update.

vLLM's CPU attention backend keeps each layer's cache as ``[blocks, kv heads, block size, 2 * head dim]``: per head
and block, K transposed (``[head dim, block size]``, so attention reads keys position-major) then V
(``[block size, head dim]``). Its cache update (``cpu_attn_reshape_and_cache``) writes a token at a time; on one core
it took 40 ms to write a 2k-token pack of SmolLM2-135M, about as long as reading and decoding it. ``scatter_rows``
writes runs of consecutive slots per head instead (21 ms), with the GIL released. It is used for a layer only once
``probe`` has found that, on a scratch cache of that layer's shape and dtype, it writes bit for bit what the
backend's own update writes (any other ISA layout, dtype or backend keeps the update).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numba import njit

_INTEGER_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # elements moved as their bits

# an attention backend's cache update: (layer, key [tokens, kv heads, head dim], value, kv cache, slots)
CacheUpdate = Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@njit(nogil=True, cache=True)
def _scatter(keys: np.ndarray, values: np.ndarray, cache: np.ndarray, slots: np.ndarray, block: int) -> None:  # pragma: no cover - compiled
    """Rows ``t`` of ``keys``/``values`` (``[H, T, D]``) into slot ``slots[t]`` of ``cache`` (``[blocks, H, 2 * block * D]``:
    K as ``[D, block]`` then V as ``[block, D]``), a run of consecutive slots in one block at a time."""
    heads, tokens, width = keys.shape
    t = 0
    while t < tokens:
        at_block, row = slots[t] // block, slots[t] % block
        run = 1
        while t + run < tokens and row + run < block and slots[t + run] == slots[t] + run:
            run += 1
        for h in range(heads):
            base = cache[at_block, h]
            for d in range(width):
                start = d * block + row
                for i in range(run):
                    base[start + i] = keys[h, t + i, d]
            start = block * width + row * width
            for i in range(run):
                for d in range(width):
                    base[start + i * width + d] = values[h, t + i, d]
        t += run


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """The elements of a CPU tensor as integers of their width (a view: NaNs and signed zeros are moved as bits)."""
    return tensor.view(_INTEGER_VIEWS[tensor.element_size()]).numpy()


def scatter_rows(keys: torch.Tensor, values: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write K and V (``[kv heads, tokens, head dim]``, any strides, the cache's dtype) into ``slots`` of a CPU cache
    ``[blocks, kv heads, block size, 2 * head dim]`` in the layout ``probe`` checks."""
    blocks, heads, block, _ = kv_cache.shape
    flat = _bits(kv_cache).reshape(blocks, heads, -1)
    _scatter(_bits(keys), _bits(values), flat, slots.numpy().astype(np.int64, copy=False), block)


def writes_like(update: CacheUpdate, layer: Any, kv_cache: torch.Tensor, *, seed: int = 0) -> bool:
    """Whether ``scatter_rows`` writes what ``update`` (the backend's own cache update of ``layer``) writes into a
    cache shaped and typed as ``kv_cache``: both write the same random rows (a partial block, a whole one, a block
    out of order) into two scratch caches, compared bit for bit. False where the cache is not on the CPU, not
    ``[blocks, kv heads, block size, 2 * head dim]``, or the update refuses the scratch cache."""
    if kv_cache.device.type != "cpu" or kv_cache.dim() != 4 or kv_cache.shape[3] % 2 or kv_cache.element_size() not in _INTEGER_VIEWS:
        return False
    _, heads, block, double = kv_cache.shape
    width = double // 2
    generator = torch.Generator().manual_seed(seed)
    slots = torch.cat([torch.arange(2 * block + 3, 3 * block), torch.arange(0, block), torch.arange(block + 1, block + 5)])
    keys, values = (torch.randn(heads, len(slots), width, generator=generator).to(kv_cache.dtype) for _ in range(2))
    theirs, ours = (torch.zeros(3, heads, block, double, dtype=kv_cache.dtype) for _ in range(2))
    try:
        update(layer, keys.transpose(0, 1).contiguous(), values.transpose(0, 1).contiguous(), theirs, slots)
    except Exception:  # a backend whose update takes no cache of ours is written with its own update
        return False
    scatter_rows(keys, values, ours, slots)
    return bool(np.array_equal(_bits(theirs), _bits(ours)))
