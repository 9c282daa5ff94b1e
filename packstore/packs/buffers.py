"""Where decoded tensors live: the buffer provider a ``Decoder`` hands every pack it decodes.

The provider is the seam between decoding and the device: ``HostBuffers`` gives CPU tensors (in a touched-once
``PackMemory`` when the program made one) and, for an accelerator, decodes each chunk into a pinned host tensor and
copies it from there. A provider for another device strategy (pinned pools and a copy stream of its own) implements
the same four methods.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from packstore.packs.memory import PackMemory


@runtime_checkable
class BufferProvider(Protocol):
    """Memory for decoded packs, and the copy from host staging to an accelerator."""

    def layer_tensors(self, shape: tuple[int, ...], dtype: torch.dtype, count: int, device: torch.device) -> list[torch.Tensor]:
        """``count`` new (uninitialised) tensors of ``shape`` and ``dtype`` on ``device``: one K or V per layer."""
        ...

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A host tensor one chunk's part of a layer is decoded into before it is copied to ``device`` (not the CPU)."""
        ...

    def copy(self, staged: torch.Tensor, place: torch.Tensor) -> None:
        """Start copying ``staged`` into ``place`` on its device; ``staged`` must stay valid until ``synchronize``."""
        ...

    def synchronize(self, device: torch.device) -> None:
        """Wait until every copy started to ``device`` is done (a pack is handed out only after)."""
        ...


class HostBuffers:
    """CPU tensors from ``memory`` when it has room (else allocated as usual); accelerator tensors allocated on the
    device, filled from pinned staging tensors on the device's current stream."""

    def __init__(self, memory: PackMemory | None = None) -> None:
        self.memory = memory

    def layer_tensors(self, shape: tuple[int, ...], dtype: torch.dtype, count: int, device: torch.device) -> list[torch.Tensor]:
        if device.type != "cpu" or self.memory is None or not count:
            return [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
        each = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        block = self.memory.take(each * count)
        if block is None:
            return [torch.empty(shape, dtype=dtype) for _ in range(count)]
        return [block[i * each : (i + 1) * each].view(dtype).view(shape) for i in range(count)]

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")

    def copy(self, staged: torch.Tensor, place: torch.Tensor) -> None:
        place.copy_(staged, non_blocking=True)  # torch keeps ``staged`` alive until the copy is done

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
