"""Stored chunks decoded on the GPU: the CPU checks, the copy carries the compressed bytes, the device decodes and joins.

With ``HostBuffers(decode_on_device=True)`` (the worker's ``--decode device``), a ``BodyAssembler`` bound for a CUDA
device gives each chunk to ``plan`` on a decoding thread: its digest is checked (``body.verify_chunk``, the reader's
one check) and its frame table and tensor table read (``format.device_plan``), and nothing is entropy-decoded. Once
every chunk of a layer is in (a knowledge pack's layer: its token blocks), ``issue`` lays their stored bytes end to end
in one block of the pinned staging pool, with the frames' table behind them, and on the copy stream: one host-to-device
copy of the block, one kernel launch that decodes every Huffman frame (``format.huffman_cuda``: one block per frame, a
thread per stream) and copies every other frame into the layer's plane bytes, then the device plane join
(``plane_join.join_planes_on``) of each tensor into its place. The assembler's per-layer fence (an event recorded on
the copy stream once the layer is issued) is what the model's stream waits on before that layer.

Chunks the kernel does not decode still arrive: a zstd frame (the first layers' repeated rows) is decompressed on the
host into the same block and copied into place by the kernel; a chunk of a container without Huffman frames and plane
segments (codec ``byteplane-zstd``) or a float16 split whose packed planes do not line up (``device_plan``) is decoded
on the host as on the host path and its elements sent in the same block, then copied into place on the device. Every
pack, of every codec and dtype, decodes exactly as the CPU decodes it.

What the device finds wrong in a Huffman stream (a frame that passed its digest and the CPU's checks, so written
wrong) is reported when the pack completes (``finish``): the layers handed out before are then of a pack that fails.

Under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the CPU stands in for the device: the same planning, blocks,
kernel (run by the simulator on the block's numpy views) and join, on CPU tensors, so the whole path is tested without
a GPU (tests/unit/test_device_decode.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from packstore.errors import IntegrityError
from packstore.format import huffman_cuda
from packstore.format.chunks import Buffer, OpenedChunk, open_chunk
from packstore.format.device_plan import FRAME_COLUMNS, ChunkPlan, gather, plan_chunk
from packstore.format.header import PackHeader
from packstore.packs.buffers import BufferProvider
from packstore.packs.plane_join import join_planes_on

_ALIGN = 8  # elements and the frame table start at multiples of 8 bytes in a block (int64 rows, 4-byte elements)
_SIGNED = {2: torch.int16, 4: torch.int32}
_STREAMS: dict[tuple[int, int], Any] = {}  # (device, torch stream pointer) -> numba-cuda's handle of that stream
_STREAMS_LOCK = threading.Lock()


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def decodes_on(buffers: BufferProvider, device: torch.device) -> bool:
    """Whether a pack bound for ``device`` is decoded there: ``buffers.decode_on_device`` and a CUDA device, or the CPU
    while numba-cuda's simulator stands in for the GPU. Any other device decodes on the host."""
    if not getattr(buffers, "decode_on_device", False):
        return False
    return device.type == "cuda" or (device.type == "cpu" and huffman_cuda.simulated())


def unavailable(device: torch.device) -> str | None:
    """Why packs bound for ``device`` cannot be decoded there (None: they can): a device other than CUDA, or numba-cuda
    (the ``gpu`` extra) missing or without a GPU it can use."""
    if device.type != "cuda":
        return f"the model runs on {device.type}, not on a CUDA device"
    if not torch.cuda.is_available():
        return "torch finds no CUDA device"
    try:
        cuda = huffman_cuda.cuda_module()
        if not cuda.is_available():
            return "numba-cuda finds no CUDA device it can use"
    except (RuntimeError, ImportError) as exc:
        return str(exc)
    try:
        huffman_cuda.prepare()
    except Exception as exc:  # numba-cuda's toolchain errors (no NVVM, no NVRTC) have no common base
        return f"numba-cuda cannot compile the decode kernel: {exc}"
    return None


@dataclass
class Planned:
    """One chunk ready to be sent: its ``plan`` (device path), or its tensors decoded on the host (``host``: tensor
    name -> ``[A, T, D]`` unsigned elements); ``wanted``: (tensor name, its place); where its positions go
    (``offset``, ``count``); ``data``: its stored bytes, held until the layer is issued; ``slots``: the layers it writes.
    A place is the tensor seen as ``[A, P, D]`` (``chunks.as_3d``)."""

    plan: ChunkPlan | None
    host: dict[str, np.ndarray]
    wanted: list[tuple[str, torch.Tensor]]
    offset: int
    count: int
    data: Buffer
    slots: frozenset[int]


def plan(header: PackHeader, index: int, data: Buffer, verified: bool) -> tuple[ChunkPlan | None, OpenedChunk | None]:
    """Chunk ``index`` checked (its digest unless ``verified``) and planned for the device; where the device path does
    not take it, opened on the host instead (its digest checked once: ``verified`` then)."""
    planned = plan_chunk(header, index, data, verified=verified)
    if planned is not None:
        return planned, None
    return None, open_chunk(header, index, data, verified=True)


def host_elements(chunk: OpenedChunk, names: set[str]) -> dict[str, np.ndarray]:
    """The tensors ``names`` of an opened chunk, decoded on the host into new arrays (the device copies them into place)."""
    unsigned = {2: np.uint16, 4: np.uint32}[chunk.planes.element_size]
    arrays = {}
    for entry in chunk.entries:
        if entry.name in names:
            out = np.empty(chunk.block, dtype=unsigned)
            chunk.planes.write(out, chunk.first_element(entry), chunk.block, 0, chunk.block[1])
            arrays[entry.name] = out
    return arrays


@dataclass(frozen=True)
class Layout:
    """Where everything of a batch of chunks lies in its block: each planned chunk's input (``inputs``, one longer:
    the last is their end), each host-decoded tensor's elements (``elements``: (start, stop)), the frames' table
    (``table``: (start, stop)); the plane bytes the device decodes into (``planes``, one longer: the total); ``size``."""

    inputs: list[int]
    planes: list[int]
    frames: np.ndarray
    elements: list[tuple[int, int]]
    table: tuple[int, int]
    size: int


def layout(batch: list[Planned]) -> Layout:
    """The block of ``batch``: planned chunks' inputs end to end, then host-decoded elements, then the frame table."""
    plans = [item.plan for item in batch if item.plan is not None]
    inputs, planes, frames = gather(plans)
    at, elements = _aligned(inputs[-1]), []
    for item in batch:
        for name, _ in item.wanted if item.plan is None else []:
            size = item.host[name].nbytes
            elements.append((at, at + size))
            at = _aligned(at + size)
    table = (at, at + frames.size * 8)
    return Layout(inputs, planes, frames, elements, table, table[1])


def fill(block: np.ndarray, batch: list[Planned], where: Layout) -> None:
    """Write ``batch`` into its host ``block`` (uint8) as ``where`` lays it out."""
    plans = [item.plan for item in batch if item.plan is not None]
    for plan_, start in zip(plans, where.inputs):
        for piece in plan_.inputs:
            size = len(piece) if not isinstance(piece, memoryview) else piece.nbytes
            block[start : start + size] = np.frombuffer(piece, np.uint8)
            start += size
    spans = iter(where.elements)
    for item in batch:
        for name, _ in item.wanted if item.plan is None else []:
            start, stop = next(spans)
            block[start:stop] = item.host[name].reshape(-1).view(np.uint8)
    start, stop = where.table
    block[start:stop] = where.frames.reshape(-1).view(np.uint8)


def issue(batch: list[Planned], buffers: BufferProvider, device: torch.device, statuses: list[torch.Tensor]) -> None:
    """Send ``batch`` (the chunks of a layer) to ``device`` in one staging block and one copy, then decode and join it
    there, all on the buffers' copy stream; the kernel's status (nonzero: a malformed Huffman stream) is appended to
    ``statuses`` for ``check``."""
    where = layout(batch)
    staged = buffers.staging((where.size,), torch.uint8, device)
    fill(staged.numpy(), batch, where)

    def decode(block: torch.Tensor) -> None:  # on the copy stream (on the device) once the block is there
        planes = torch.empty(where.planes[-1], dtype=torch.uint8, device=block.device)
        status = torch.zeros(1, dtype=torch.int64, device=block.device)
        statuses.append(status)
        table = block[where.table[0] : where.table[1]].view(torch.int64).view(-1, FRAME_COLUMNS)
        launch(block[: where.inputs[-1]], table, planes, status)
        plans = iter(where.planes)
        spans = iter(where.elements)
        for item in batch:
            if item.plan is None:
                for name, place in item.wanted:
                    start, stop = next(spans)
                    bits = _SIGNED[place.element_size()]
                    elements = block[start:stop].view(bits).view(item.host[name].shape)[:, : item.count]
                    place.view(bits)[:, item.offset : item.offset + item.count].copy_(elements)
                continue
            base = next(plans)
            tensors = {t.entry.name: t for t in item.plan.tensors}
            for name, place in item.wanted:
                found = tensors[name]
                views = [planes[base + start : base + stop] for start, stop in found.planes]
                packed = None
                if found.packed is not None:
                    start, stop, first, covered = found.packed
                    packed = (planes[base + start : base + stop], first, covered)
                join_planes_on(views, item.plan.block, place, item.offset, item.count, item.plan.rotated, packed)

    buffers.upload(staged, device, decode)


def launch(block: torch.Tensor, table: torch.Tensor, planes: torch.Tensor, status: torch.Tensor) -> None:
    """The kernel over torch tensors on one device, on the current stream: CUDA tensors through their
    ``__cuda_array_interface__`` (no synchronisation: the launch is ordered on the stream), CPU tensors as numpy arrays
    (numba's simulator)."""
    if block.device.type != "cuda":
        huffman_cuda.decode_frames_on(block.numpy(), table.numpy(), planes.numpy(), status.numpy())
        return
    cuda = huffman_cuda.cuda_module()
    with cuda.gpus[block.device.index if block.device.index is not None else torch.cuda.current_device()]:
        src, frames, out, refused = (cuda.as_cuda_array(t, sync=False) for t in (block, table, planes, status))
        huffman_cuda.decode_frames_on(src, frames, out, refused, stream=_numba_stream(block.device))


def _numba_stream(device: torch.device) -> Any:
    """numba-cuda's handle of torch's current stream on ``device`` (made once per stream)."""
    pointer = torch.cuda.current_stream(device).cuda_stream
    key = (device.index or 0, pointer)
    with _STREAMS_LOCK:
        if key not in _STREAMS:
            _STREAMS[key] = huffman_cuda.cuda_module().external_stream(pointer)
        return _STREAMS[key]


def check(statuses: list[torch.Tensor], key: str) -> None:
    """IntegrityError if the device refused a Huffman stream of the pack ``key`` (its copies and kernels are done)."""
    if not statuses:
        return
    found = int(torch.cat(statuses).max())  # one wait for the device, once the pack's copies are done
    if found:
        raise IntegrityError(f"pack {key}: a chunk cannot be decoded: {huffman_cuda.status_message(found)}")


__all__ = ["Planned", "check", "decodes_on", "host_elements", "issue", "launch", "layout", "plan", "unavailable"]
