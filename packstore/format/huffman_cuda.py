"""Huffman frames (docs/format.md §1.4, method 2) decoded on a CUDA device with numba-cuda: one block per frame, one
thread per stream.

The CPU decoder (``packstore.format.huffman``) is the reference; this kernel writes the same bytes for every frame it
accepts and refuses every frame it refuses: the same size and code checks (made on the CPU too, before anything is
sent: ``huffman.check_frame``), and every stream must decode to exactly its symbols, ending in its last byte, reading
no byte outside its stream and writing none outside its frame's output. A block's threads build the frame's lookup
table (every 11-bit window: its first code's symbol and length) in shared memory together, then threads 0 to 3 each
decode one of the frame's four streams, one code per lookup, from a 64-bit bit buffer refilled a byte at a time.
Other blocks copy frames stored raw (or decompressed on the host) into place, so one launch fills a layer's planes.

numba-cuda is the ``gpu`` extra: it is imported on first use (``cuda_module``), never at import. The launch wrapper
takes anything numba-cuda takes as a device array (its own, a ``__cuda_array_interface__`` such as a torch CUDA
tensor's, or, under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), numpy arrays), so the kernel is tested on a
CPU in the simulator, bit for bit against the CPU decoder (tests/unit/test_huffman_cuda.py). No torch here.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

import numpy as np
from numba import types

from packstore.format.device_plan import COPY, DECODE, FRAME_COLUMNS
from packstore.format.huffman import _FRAME_FIXED, BAD_CODE, BAD_STREAM, MAX_LENGTH, SHIFT, STREAMS, TABLE, TRUNCATED

_LENGTHS = MAX_LENGTH + 1  # code lengths 0 .. MAX_LENGTH (a local array's size must be a constant)
THREADS = 32  # a block: builds one frame's table together (64 windows a thread), then 4 of them decode its streams
_LOCK = threading.Lock()
_LAUNCH = threading.Lock()
_KERNEL: dict[str, Any] = {}  # the compiled kernel, made on first use (numba-cuda compiles it for the device it runs on)
# ``numba.cuda`` once imported (``_make_kernel``): a module global, as the kernel names it, so that numba's simulator can
# put its own in its place while a kernel runs.
cuda: Any = None


def cuda_module() -> ModuleType:
    """``numba.cuda``, imported now (RuntimeError naming the ``gpu`` extra when numba-cuda is not installed)."""
    try:
        from numba import cuda
    except ImportError as exc:  # pragma: no cover - the gpu extra is installed where the tests run
        raise RuntimeError(f"decoding on the GPU needs numba-cuda (pip install 'packstore[gpu]'): {exc}") from None
    return cuda


def simulated() -> bool:
    """Whether numba-cuda runs kernels in its CPU simulator (``NUMBA_ENABLE_CUDASIM=1`` when it was imported)."""
    from numba.core import config

    return bool(config.ENABLE_CUDASIM)


def _make_kernel() -> Any:
    global cuda
    cuda = cuda_module()

    @cuda.jit
    def decode_frames(src: Any, frames: Any, out: Any, status: Any) -> None:  # pragma: no cover - runs on the device
        """Frame ``blockIdx.x`` of ``frames`` (method, start, stop, place, plain bytes): ``src[start:stop]`` Huffman-decoded
        or copied into ``out[place : place + plain]``; a refused frame sets ``status[0]`` to at least (frame + 1) * 16 +
        its error code (``huffman.ERRORS``)."""
        frame = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        method, start, stop = np.int64(frames[frame, 0]), np.int64(frames[frame, 1]), np.int64(frames[frame, 2])
        at, count = np.int64(frames[frame, 3]), np.int64(frames[frame, 4])
        if method != DECODE:
            for i in range(tid, count, threads):
                out[at + i] = src[start + i]
            return
        lookup = cuda.shared.array(TABLE, types.uint16)  # window -> symbol | length << 8
        codes = cuda.shared.array(256, types.int32)  # symbol index -> its code, bit-reversed (the stream is read from bit 0 up)
        lengths = cuda.shared.array(256, types.int32)
        verdict = cuda.shared.array(1, types.int32)
        # the frame's fixed part (every thread reads the same, so every thread leaves together)
        size = stop - start
        first, used = np.int64(src[start]), np.int64(src[start + 1]) + 1
        table_bytes = (used + 1) // 2
        error = 0
        if size < _FRAME_FIXED or size >= (1 << (SHIFT - 3)):
            error = TRUNCATED
        elif first + used > 256:
            error = BAD_CODE
        elif size < _FRAME_FIXED + table_bytes:
            error = TRUNCATED
        if error == 0:
            sizes = start + 2 + table_bytes
            stream_end = sizes + 4 * (STREAMS - 1)
            for k in range(STREAMS - 1):
                for b in range(4):
                    stream_end += np.int64(src[sizes + 4 * k + b]) << (8 * b)
            if stream_end > stop:
                error = TRUNCATED
        if error != 0:
            if tid == 0:
                cuda.atomic.max(status, 0, (frame + 1) * 16 + error)
            return
        if tid == 0:  # canonical codes (RFC 1951 §3.2.2): each length's first code, then symbols in order
            per_length = cuda.local.array(_LENGTHS, types.int32)
            next_code = cuda.local.array(_LENGTHS, types.int32)
            for length in range(_LENGTHS):
                per_length[length] = 0
            kraft = 0
            for i in range(used):
                packed = np.int64(src[start + 2 + i // 2])
                length = (packed >> 4) if i % 2 else (packed & 15)
                lengths[i] = length
                if length > MAX_LENGTH:
                    kraft = -1
                elif length > 0 and kraft >= 0:
                    kraft += 1 << (MAX_LENGTH - length)
                    per_length[length] += 1
            verdict[0] = 0 if kraft == TABLE else BAD_CODE
            code = 0
            next_code[0] = 0
            for length in range(1, MAX_LENGTH + 1):
                code = (code + per_length[length - 1]) << 1
                next_code[length] = code
            for i in range(used):
                length = np.int64(lengths[i])
                if 0 < length <= MAX_LENGTH:
                    code = np.int64(next_code[length])
                    next_code[length] = code + 1
                    reverse = 0
                    for _ in range(length):
                        reverse = (reverse << 1) | (code & 1)
                        code >>= 1
                    codes[i] = reverse
        cuda.syncthreads()
        if verdict[0] != 0:
            if tid == 0:
                cuda.atomic.max(status, 0, (frame + 1) * 16 + BAD_CODE)
            return
        for i in range(tid, used, threads):  # every window a code begins: a complete code fills each window once
            length = np.int64(lengths[i])
            if length > 0:
                entry = (first + i) | (length << 8)
                for window in range(np.int64(codes[i]), TABLE, 1 << length):
                    lookup[window] = entry
        cuda.syncthreads()
        if tid >= STREAMS:
            return
        # stream ``tid``: its bytes [begin, end) and the symbols it holds
        sizes = start + 2 + table_bytes
        begin = sizes + 4 * (STREAMS - 1)
        for k in range(tid):
            for b in range(4):
                begin += np.int64(src[sizes + 4 * k + b]) << (8 * b)
        end = stop
        if tid < STREAMS - 1:
            end = begin
            for b in range(4):
                end += np.int64(src[sizes + 4 * tid + b]) << (8 * b)
        quarter = (count + STREAMS - 1) // STREAMS
        symbol = min(tid * quarter, count)
        last = min((tid + 1) * quarter, count)
        byte, buffer, bits, good = begin, 0, 0, True
        while symbol < last:
            while bits <= 48 and byte < end:
                buffer |= np.int64(src[byte]) << bits
                byte += 1
                bits += 8
            entry = np.int64(lookup[buffer & (TABLE - 1)])
            length = entry >> 8
            if length > bits:  # the code runs past the stream's last byte
                good = False
                break
            out[at + symbol] = entry & 255
            buffer >>= length
            bits -= length
            symbol += 1
        if not good or byte != end or bits >= 8:  # the stream ends in its last byte, every byte of it read
            cuda.atomic.max(status, 0, (frame + 1) * 16 + BAD_STREAM)

    return decode_frames


def kernel() -> Any:
    """The compiled kernel (compiled on first use)."""
    with _LOCK:
        if "decode" not in _KERNEL:
            _KERNEL["decode"] = _make_kernel()
        return _KERNEL["decode"]


def prepare() -> None:
    """Compile the kernel now for the arrays ``decode_frames_on`` is given on a GPU (contiguous uint8 input and output,
    int64 frames and status), so that a missing piece of the CUDA toolchain (NVVM, NVRTC) shows at start, not in the
    first pack; nothing to do in the simulator."""
    if simulated():
        return
    contiguous = types.Array(types.uint8, 1, "C")
    kernel().compile((contiguous, types.Array(types.int64, 2, "C"), contiguous, types.Array(types.int64, 1, "C")))


def decode_frames_on(src: Any, frames: Any, out: Any, status: Any, stream: Any = 0) -> None:
    """Launch the decode of every frame of ``frames`` (int64 ``[F, FRAME_COLUMNS]``: method COPY or DECODE, start and
    stop in ``src``, place and plain bytes in ``out``; ``device_plan.gather``) from ``src`` (uint8) into ``out`` (uint8)
    on ``stream`` (a numba-cuda stream; 0: the default one); returns at once. A refused frame sets ``status[0]``
    (int64 or int32, zero before) to at least (its index + 1) * 16 + its error code. The frames must lie in ``src``
    and their places in ``out`` (``device_plan`` makes them so); every Huffman frame's bytes are checked here again."""
    count = frames.shape[0]
    if frames.shape[1:] != (FRAME_COLUMNS,):
        raise ValueError(f"frames must be [F, {FRAME_COLUMNS}], got {tuple(frames.shape)}")
    if count:
        compiled = kernel()
        with _LAUNCH:  # numba's simulator keeps one launch's state at a time (a real launch returns at once)
            compiled[count, THREADS, stream](src, frames, out, status)


def status_message(status: int) -> str:
    """What a nonzero ``status`` says, as the CPU decoder says it."""
    from packstore.format.huffman import ERRORS

    return f"{ERRORS.get(status % 16, 'Huffman frame is malformed')} (device frame {status // 16 - 1})"


__all__ = ["COPY", "DECODE", "THREADS", "cuda_module", "decode_frames_on", "kernel", "prepare", "simulated", "status_message"]
