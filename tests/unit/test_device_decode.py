"""Huffman frames decoded on the GPU (``format.huffman_cuda``, ``format.device_plan``, ``packs.device_decode``): bit for
bit what the CPU decoder writes, for every dtype and container, and refused where the CPU refuses.

Without a GPU the kernel runs in numba-cuda's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set below before numba.cuda
is first imported in this process) on tiny inputs, and the CPU stands in for the device in the whole path (planning,
one block per layer, the kernel, the join). With CUDA the same tests run on the GPU. The torch/CUDA glue proper (pinned
staging, the copy stream, fences) has its own test, which runs only where CUDA is; the planning runs anywhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from packstore.errors import IntegrityError
from packstore.format import codec, huffman
from packstore.format.body import EncodedPack
from packstore.format.device_plan import COPY, DECODE, gather, plan_chunk
from packstore.format.header import CODECS
from packstore.packs import device_decode
from packstore.packs.buffers import HostBuffers
from packstore.packs.decoder import Decoder
from packstore.packs.reader import PackReader
from packstore.packs.tensors import Pack, decode_pack, encode_pack
from packstore.store import LmdbStore
from tests.helpers.packs import make_pack

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()


def _numba_cuda() -> str | None:
    """Make numba.cuda usable here: the simulator unless a GPU is present (set before its first import). Returns why
    it cannot be, or None."""
    if "numba.cuda" not in sys.modules and not CUDA:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # numba reads it when numba.cuda is imported; kept for this process
        from numba.core import config

        config.reload_config()
    try:
        from numba import cuda
    except ImportError as exc:
        return f"numba-cuda is not installed (the gpu and test extras): {exc}"
    from packstore.format.huffman_cuda import simulated

    if not simulated() and not cuda.is_available():
        return "numba.cuda was imported in this process without its simulator and there is no GPU: run this file alone"
    return None


WHY_NOT = _numba_cuda()
kernel = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
DEVICE = "cuda" if CUDA else "cpu"  # where packs decode "on the device": the CPU stands in under the simulator
DTYPES = ["bfloat16", "float16", "float32"]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def run_kernel(src: np.ndarray, frames: np.ndarray, out_bytes: int) -> tuple[np.ndarray, int]:
    """The kernel on host arrays (the simulator's, or numba-cuda's copies to a GPU and back)."""
    from packstore.format.huffman_cuda import decode_frames_on

    out, status = np.zeros(out_bytes, np.uint8), np.zeros(1, np.int64)
    decode_frames_on(np.ascontiguousarray(src, np.uint8).copy(), np.ascontiguousarray(frames, np.int64), out, status)
    return out, int(status[0])


def cpu_frame(frame: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """The CPU decoder's bytes and verdict (0 or its error code) for one frame of ``count`` symbols."""
    out = np.zeros(count + 8, np.uint8)  # the CPU's fast path stores 4 bytes at a time
    failed = huffman._decode_frames(frame, np.array([0]), np.array([len(frame)]), out, np.array([0]), np.array([count]))
    return out[:count], 0 if failed < 0 else failed % 16


def skewed(n: int, seed: int) -> np.ndarray:
    """Bytes with an exponent plane's spread plus rare outliers: long codes (up to 11 bits) and short ones."""
    rng = np.random.default_rng(seed)
    plain = np.clip(rng.normal(120, 2.5, n), 0, 255).astype(np.uint8)
    outliers = rng.random(n) < 0.02
    plain[outliers] = rng.integers(0, 256, int(outliers.sum()))
    return plain


EDGE_CASES = {
    "one symbol": np.array([7], np.uint8),
    "fewer symbols than streams": np.array([3, 9, 3], np.uint8),
    "five": np.array([1, 2, 3, 4, 5], np.uint8),
    "single value alphabet": np.full(37, 0x7F, np.uint8),
    "single value 255": np.full(9, 0xFF, np.uint8),  # its unused second code is 254, below it
    "two values": np.array([0, 255] * 20 + [0], np.uint8),
    "all 256 values": np.arange(256, dtype=np.uint8).repeat(3),
    "odd length, long codes": skewed(1001, 1),
    "geometric (11-bit codes)": np.minimum(np.random.default_rng(2).geometric(0.45, 3000), 40).astype(np.uint8),
}


@kernel
def test_every_edge_case_decodes_bit_for_bit_in_one_launch_with_copied_frames() -> None:
    """Huffman frames and raw frames side by side (one launch, places end to end), each as the CPU decodes it."""
    src, rows, expected = bytearray(), [], bytearray()
    for name, plain in EDGE_CASES.items():
        frame = np.frombuffer(huffman.encode(plain), np.uint8)
        decoded, verdict = cpu_frame(frame, len(plain))
        assert verdict == 0 and np.array_equal(decoded, plain), name
        rows.append((DECODE, len(src), len(src) + len(frame), len(expected), len(plain)))
        src += frame.tobytes()
        expected += plain.tobytes()
        rows.append((COPY, len(src) - len(frame), len(src), len(expected), len(frame)))  # a raw frame: the bytes as they are
        expected += frame.tobytes()
    out, status = run_kernel(np.frombuffer(bytes(src), np.uint8), np.array(rows, np.int64), len(expected))
    assert status == 0
    assert out.tobytes() == bytes(expected)


def _mutations(frame: bytes) -> dict[str, bytes]:
    table_bytes = (frame[1] + 2) // 2
    sizes = 2 + table_bytes
    bad_length = bytearray(frame)
    bad_length[2] = (bad_length[2] & 0xF0) | 12  # a 12-bit code
    incomplete = bytearray(frame)
    incomplete[2] = (incomplete[2] & 0xF0) | min((incomplete[2] & 15) + 1, 11)  # the lengths no longer fill the code space
    long_size = bytearray(frame)
    long_size[sizes + 3] = 0x7F  # stream 0 said to run far past the frame
    flipped = bytearray(frame)
    flipped[-1] ^= 0xFF  # stream 3's last byte: its codes no longer end where it does
    inside = bytearray(frame)
    inside[min(sizes + 12, len(inside) - 1)] ^= 0x5A  # stream 0's first byte: other codes, maybe other lengths
    return {
        "a byte short": frame[:-1],
        "a byte long": frame + b"\x00",
        "too short for its table": frame[:3],
        "a 12-bit code": bytes(bad_length),
        "incomplete code": bytes(incomplete),
        "stream past the frame": bytes(long_size),
        "last byte flipped": bytes(flipped),
        "a byte inside stream 0 flipped": bytes(inside),
    }


@kernel
@pytest.mark.parametrize("name", ["odd length, long codes", "all 256 values", "five"])
def test_a_malformed_frame_is_refused_with_the_cpu_decoders_verdict(name: str) -> None:
    plain = EDGE_CASES[name]
    for mutation, frame in _mutations(huffman.encode(plain)).items():
        src = np.frombuffer(frame, np.uint8)
        _, expected = cpu_frame(src, len(plain))
        out, status = run_kernel(src, np.array([(DECODE, 0, len(src), 0, len(plain))], np.int64), len(plain))
        if expected == 0:  # a flip the code happens to absorb: both decoders agree on the bytes too
            assert status == 0 and np.array_equal(out, cpu_frame(src, len(plain))[0]), mutation
        else:
            assert status and status % 16 == expected and status // 16 == 1, (mutation, status, expected)
            from packstore.format.huffman_cuda import status_message

            assert huffman.ERRORS[expected] in status_message(status)


def _chunk(dtype: str, tokens: int = 40, **kwargs: int) -> tuple[EncodedPack, Pack]:
    pack = make_pack(dtype=dtype, layers=2, tokens=tokens, heads=2, dim=8)
    return encode_pack(pack, **kwargs), pack


def _cpu_planes(stored: bytes, max_plain: int) -> bytes:
    """The CPU's plane bytes of a container: every plane's segments end to end."""
    planes = codec.decode_planes(stored, max_plain)
    return b"".join(bytes(segment) for plane in planes.segments for segment in plane)


@kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_chunks_planes_decode_on_the_device_as_on_the_cpu(dtype: str) -> None:
    encoded, _ = _chunk(dtype, tokens=70)
    plans = [plan_chunk(encoded.header, i, data) for i, data in enumerate(encoded.chunks)]
    assert all(p is not None for p in plans)
    assert any((p.frames[:, 0] == DECODE).any() for p in plans if p is not None)  # the exponent planes are Huffman-coded
    inputs, planes, frames = gather([p for p in plans if p is not None])
    src = b"".join(b"".join(bytes(piece) for piece in p.inputs) for p in plans if p is not None)
    assert len(src) == inputs[-1]
    out, status = run_kernel(np.frombuffer(src, np.uint8), frames, planes[-1])
    assert status == 0
    for i, data in enumerate(encoded.chunks):
        assert out[planes[i] : planes[i + 1]].tobytes() == _cpu_planes(data, encoded.header.chunks[i].raw_bytes + 4096)


# -- planning: no numba.cuda, no device ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_plan_places_every_frame_and_tensor(dtype: str) -> None:
    encoded, _ = _chunk(dtype)
    plan = plan_chunk(encoded.header, 0, encoded.chunks[0])
    assert plan is not None
    assert plan.input_bytes == len(encoded.chunks[0])  # no zstd frame: the stored bytes alone
    frames = plan.frames
    assert set(frames[:, 0].tolist()) <= {COPY, DECODE}
    assert frames[:, 3].min() == 0 and (frames[:, 3] + frames[:, 4]).max() == plan.plane_bytes
    assert sorted(t.entry.name for t in plan.tensors) == sorted(encoded.header.tensor_names(0))
    for tensor in plan.tensors:
        assert all(stop - start == int(np.prod(plan.block)) for start, stop in tensor.planes)
        assert (tensor.packed is not None) == (dtype == "float16")


def test_a_damaged_chunk_is_refused_before_anything_is_planned() -> None:
    encoded, _ = _chunk("bfloat16")
    damaged = bytearray(encoded.chunks[0])
    damaged[-1] ^= 1
    with pytest.raises(IntegrityError, match="damaged"):
        plan_chunk(encoded.header, 0, bytes(damaged))
    assert plan_chunk(encoded.header, 0, bytes(damaged), verified=True) is not None  # the caller checked: not again


def test_a_version_1_container_and_a_float16_split_across_odd_segments_decode_on_the_host(monkeypatch) -> None:
    encoded, _ = _chunk("bfloat16")
    assert plan_chunk(_with_codec(encoded, "byteplane-zstd"), 0, b"", verified=True) is None
    monkeypatch.setattr(codec, "segment_for", lambda sizes: 300)  # 300 elements: not a multiple of 256, tensors cross
    odd, _ = _chunk("float16")
    assert plan_chunk(odd.header, 0, odd.chunks[0]) is None
    monkeypatch.setattr(codec, "segment_for", lambda sizes: 512)  # packed segments that join into one plane
    aligned, _ = _chunk("float16")
    plan = plan_chunk(aligned.header, 0, aligned.chunks[0])
    assert plan is not None and len(plan.frames) > 3


def _with_codec(encoded: EncodedPack, name: str) -> object:
    assert CODECS[name] == 1

    class Header:
        codec, key, chunks = name, encoded.header.key, encoded.header.chunks

    return Header()


def repeated_rows(dtype: str) -> Pack:
    """A pack whose values repeat a row (a first layer's): zstd wins those segments."""
    pack = make_pack(dtype=dtype, layers=2, tokens=300, heads=2, dim=32)
    values = [v.clone() for v in pack.values]
    values[0][:] = values[0][:, :1]
    return Pack(pack.header, pack.keys, values)


def test_a_zstd_frame_is_decompressed_into_the_plan() -> None:
    encoded = encode_pack(repeated_rows("bfloat16"))
    plan = plan_chunk(encoded.header, 0, encoded.chunks[0])
    assert plan is not None and len(plan.inputs) > 1 and plan.input_bytes > len(encoded.chunks[0])


# -- the whole path, on the device (the CPU standing in under the simulator) ---------------------------------


class CountingBuffers(HostBuffers):
    """Counts the blocks sent (one per layer on the device path)."""

    def __init__(self) -> None:
        super().__init__(staging_bytes=256 << 10, decode_on_device=True)
        self.uploads = 0

    def upload(self, staged, device, then) -> None:  # type: ignore[no-untyped-def]
        self.uploads += 1
        super().upload(staged, device, then)


@kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_packs_decoded_on_the_device_are_bit_for_bit_the_pack(tmp_path, dtype: str) -> None:
    pack = make_pack(dtype=dtype, layers=3, tokens=50, heads=2, dim=8)
    encoded = encode_pack(pack, block_positions=16)  # 4 token blocks a layer
    buffers = CountingBuffers()
    with LmdbStore(tmp_path / "store") as store, Decoder(workers=2, buffers=buffers) as decoder:
        key, _ = store.put(encoded)
        reader = PackReader(store, decoder)
        whole = reader.fetch(key, device=DEVICE)
        assert buffers.uploads == 3  # one block, one copy, one launch per layer
        arriving = reader.start_fetch(key, device=DEVICE)
        layers = [arriving.layer(slot) for slot in range(3)]
        part = reader.fetch_part(key, layers=(1, 2), prefix=20, device=DEVICE)
        decoded = decode_pack(encoded, DEVICE, decoder=decoder)
    for got in (whole, decoded):
        assert same(got.keys, pack.keys) and same(got.values, pack.values)
    assert same([k for k, _ in layers], pack.keys) and same([v for _, v in layers], pack.values)
    assert same(part.keys, [k[:, :20] for k in pack.keys[1:3]]) and same(part.values, [v[:, :20] for v in pack.values[1:3]])


@kernel
@pytest.mark.parametrize("segment", [300, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_segments_that_cross_tensors_decode_on_the_device_or_fall_back(monkeypatch, dtype: str, segment: int) -> None:
    """Several segments a plane; a float16 split over odd segments is decoded on the host and sent as elements."""
    monkeypatch.setattr(codec, "segment_for", lambda sizes: segment)
    pack = make_pack(dtype=dtype, layers=2, tokens=30, heads=2, dim=8)
    encoded = encode_pack(pack)
    with Decoder(workers=2, buffers=HostBuffers(decode_on_device=True)) as decoder:
        got = decode_pack(encoded, DEVICE, decoder=decoder)
    assert same(got.keys, pack.keys) and same(got.values, pack.values)


@kernel
def test_zstd_frames_and_a_steering_packs_whole_tensors_decode_on_the_device() -> None:
    pack = repeated_rows("float16")
    with Decoder(workers=2, buffers=HostBuffers(decode_on_device=True)) as decoder:
        got = decode_pack(encode_pack(pack), DEVICE, decoder=decoder)
    assert same(got.keys, pack.keys) and same(got.values, pack.values)


@kernel
def test_every_older_container_decodes_on_the_device_bit_exact(tmp_path: Path) -> None:
    """Containers of versions 1 (host fallback) and 2 (zstd frames, copied into place) through the device path."""
    from tests.data.codec2 import make_codec2_store as codec2
    from tests.data.version3.make_store import knowledge, steering

    old = {"v1-exact": knowledge(5, 1), "v1-blocks": knowledge(40, 2), "v2-rope": knowledge(7, 4), "v3-steering": steering()}
    shutil.copytree(ROOT / "tests" / "data" / "version3" / "store", tmp_path / "v3")
    shutil.copytree(ROOT / "tests" / "data" / "codec2" / "store", tmp_path / "codec2")
    with Decoder(workers=2, buffers=HostBuffers(decode_on_device=True)) as decoder:
        for path, expected in ((tmp_path / "v3", old), (tmp_path / "codec2", codec2.expected_packs())):
            with LmdbStore(path) as store:
                for name, pack in expected.items():
                    fetched = PackReader(store, decoder).fetch(name, device=DEVICE)
                    assert same(fetched.keys + fetched.values, pack.keys + pack.values), name


def test_a_stream_the_device_refused_fails_the_pack() -> None:
    device_decode.check([torch.zeros(1, dtype=torch.int64)], "k")
    with pytest.raises(IntegrityError, match=r"pack k: .*do not decode to exactly"):
        device_decode.check([torch.zeros(1, dtype=torch.int64), torch.tensor([2 * 16 + huffman.BAD_STREAM])], "k")


def test_packs_bound_for_the_cpu_decode_on_the_host_outside_the_simulator() -> None:
    buffers = HostBuffers(decode_on_device=True)
    assert not device_decode.decodes_on(HostBuffers(), torch.device("cuda"))
    assert device_decode.decodes_on(buffers, torch.device("cuda"))
    assert not device_decode.decodes_on(buffers, torch.device("meta"))
    assert "not on a CUDA device" in (device_decode.unavailable(torch.device("cpu")) or "")


@pytest.mark.skipif(WHY_NOT is not None or "NUMBA_ENABLE_CUDASIM" not in os.environ, reason=WHY_NOT or "the simulator is not on")
def test_the_kernel_types_and_lowers_for_a_real_gpu() -> None:
    """The simulator runs the kernel as Python; numba-cuda's compiler types it and lowers it to LLVM for the device
    (no GPU needed), so no integer silently turns into a float there."""
    script = textwrap.dedent(
        """
        from numba import types
        from numba.cuda.compiler import compile_cuda
        from packstore.format import huffman_cuda
        contiguous = types.Array(types.uint8, 1, "C")
        signature = (contiguous, types.Array(types.int64, 2, "C"), contiguous, types.Array(types.int64, 1, "C"))
        result = compile_cuda(huffman_cuda.kernel().py_func, types.void, signature, cc=(8, 0))
        ir = result.library.get_llvm_str()
        assert " double " not in ir and " float " not in ir, "a floating-point value in the kernel"
        print("lowered", len(ir))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "lowered" in done.stdout, done.stderr[-2000:]


# -- the CUDA glue: where CUDA is -----------------------------------------------------------------------------


@pytest.mark.skipif(not CUDA or WHY_NOT is not None, reason="needs CUDA and numba-cuda (the pinned block, the copy stream, fences)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_on_cuda_each_layer_is_one_pinned_block_behind_its_own_fence(tmp_path, dtype: str) -> None:
    pack = make_pack(dtype=dtype, layers=4, tokens=300, heads=2, dim=32)
    buffers = CountingBuffers()
    assert device_decode.unavailable(torch.device("cuda", 0)) is None
    with LmdbStore(tmp_path / "store") as store, Decoder(workers=4, buffers=buffers) as decoder:
        key, _ = store.put(encode_pack(pack, block_positions=64))
        arriving = PackReader(store, decoder).start_fetch(key, device=torch.device("cuda", 0))
        layers = [arriving.layer(slot) for slot in range(4)]  # each behind its fence, on this thread's stream
        whole = arriving.result()
    assert buffers.uploads == 4
    pool = buffers._pool
    assert pool is not None and pool._pinned is not None and pool._pinned.is_pinned()
    assert same([k for k, _ in layers], pack.keys) and same([v for _, v in layers], pack.values)
    assert same(whole.keys, pack.keys) and all(t.device.type == "cuda" for t in whole.keys + whole.values)


# -- the worker's flag ----------------------------------------------------------------------------------------


def test_decode_device_without_cuda_is_an_error_naming_the_problem(tmp_path, capsys) -> None:
    from packstore.cli.packstore_main import main as packstore_main

    base = ["--store", str(tmp_path / "s"), "worker", "--model", "smollm2-135m", "--device", "cpu"]
    assert packstore_main([*base, "--decode", "device"]) != 0
    assert "decode='device': the model runs on cpu, not on a CUDA device" in capsys.readouterr().err
    assert packstore_main([*base, "--decode", "host", "--plane-join", "device"]) != 0
    assert "give decode alone" in capsys.readouterr().err


def test_plane_join_is_deprecated_and_keeps_its_meaning(capsys) -> None:
    import argparse

    from packstore.worker.config import decode_modes

    def modes(**given: object) -> tuple[bool, bool]:
        return decode_modes(argparse.Namespace(**{"device": "cpu", "decode": None, "plane_join": None, **given}))

    assert modes() == (False, False) and modes(decode="host") == (False, False)
    assert capsys.readouterr().err == ""
    assert modes(plane_join="device") == (False, True)
    assert "--plane-join is deprecated" in capsys.readouterr().err
