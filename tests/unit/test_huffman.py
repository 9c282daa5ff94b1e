"""The Huffman frames of container version 3: exact round trips, canonical codes as docs/format.md §1.4 defines
them, and refusal (never a read or write out of bounds) of every malformed frame."""

from __future__ import annotations

import ctypes
import mmap
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packstore.errors import IntegrityError
from packstore.format import huffman
from tests.helpers.reference_codec import huffman_decode

_LIBC = ctypes.CDLL(None, use_errno=True)


def guarded(size: int) -> np.ndarray:
    """A uint8 array of ``size`` bytes that ends where a page begins that may be neither read nor written: a decoder
    that touches a byte past it crashes the test instead of going unnoticed."""
    page = mmap.PAGESIZE
    total = (size // page + 2) * page
    region = np.frombuffer(mmap.mmap(-1, total), np.uint8)  # the array keeps the mapping alive
    if _LIBC.mprotect(ctypes.c_void_p(region.ctypes.data + total - page), ctypes.c_size_t(page), 0) != 0:  # PROT_NONE
        raise OSError(ctypes.get_errno(), "mprotect failed")
    return region[total - page - size : total - page]


def decode(frame: bytes, count: int, slack: int = 0) -> np.ndarray:
    """``frame`` (placed just before an inaccessible page) decoded into ``count`` bytes of a buffer ``slack`` bytes
    longer, itself just before an inaccessible page (the slack must stay untouched)."""
    src, out = guarded(len(frame)), guarded(count + slack)
    src[:], out[:] = np.frombuffer(frame, np.uint8), 0xA5
    huffman.decode_frames(src, np.array([0]), np.array([len(frame)]), out, np.array([0]), np.array([count]))
    assert (out[count:] == 0xA5).all(), "the decoder wrote past its output"
    return out[:count].copy()


def lengths_of(frame: bytes) -> dict[int, int]:
    first, count = frame[0], frame[1] + 1
    nibbles = [b >> shift & 15 for b in frame[2 : 2 + (count + 1) // 2] for shift in (0, 4)]
    return {first + i: n for i, n in enumerate(nibbles[:count]) if n}


RNG = np.random.default_rng(0)
CASES = {
    "one byte": np.zeros(1, np.uint8),
    "one value repeated": np.full(1000, 7, np.uint8),
    "the last value alone": np.full(9, 255, np.uint8),
    "every value once": np.arange(256, dtype=np.uint8),
    "uniform": RNG.integers(0, 256, 5000).astype(np.uint8),
    "skewed": RNG.geometric(0.3, 20_000).clip(0, 255).astype(np.uint8),
    "needs length limiting": np.repeat(np.arange(30, dtype=np.uint8), [2**i for i in range(18)] + [1] * 12),
    "fewer bytes than streams": np.array([3, 4, 3], np.uint8),
}


@pytest.mark.parametrize("name", CASES)
def test_round_trip_is_exact_and_writes_nothing_past_the_output(name: str) -> None:
    plain = CASES[name]
    frame = huffman.encode(plain)
    assert (decode(frame, len(plain), slack=16) == plain).all()
    lengths = lengths_of(frame)
    assert max(lengths.values()) <= huffman.MAX_LENGTH
    assert sum(2.0 ** -n for n in lengths.values()) == 1.0  # a complete prefix code
    assert set(np.unique(plain)) <= set(lengths)


def test_codes_come_close_to_the_entropy() -> None:
    plain = CASES["skewed"]
    counts = np.bincount(plain, minlength=256)
    p = counts[counts > 0] / len(plain)
    entropy_bytes = -(p * np.log2(p)).sum() * len(plain) / 8
    assert len(huffman.encode(plain)) < entropy_bytes * 1.03 + 64


def test_the_frame_is_the_documented_canonical_code() -> None:
    """A frame decodes with nothing but docs/format.md §1.4 (test_format_doc's reader of it)."""
    for name in ("skewed", "needs length limiting", "fewer bytes than streams", "one value repeated"):
        plain = CASES[name][:999]
        assert huffman_decode(huffman.encode(plain), len(plain)) == plain.tobytes()


def frame_with(lengths: dict[int, int], streams: list[bytes]) -> bytes:
    first, last = min(lengths), max(lengths)
    nibbles = [lengths.get(v, 0) for v in range(first, last + 1)] + [0]
    table = bytes(nibbles[i] | nibbles[i + 1] << 4 for i in range(0, last - first + 1, 2))
    return bytes([first, last - first]) + table + struct.pack("<3I", *map(len, streams[:3])) + b"".join(streams)


@pytest.mark.parametrize(
    "lengths",
    [
        {0: 1},  # one code: incomplete
        {0: 1, 1: 2},  # Kraft sum 3/4
        {0: 1, 1: 1, 2: 1},  # over-full
        {0: 12, 1: 1},  # longer than 11 bits
        {0: 15, 1: 15},
    ],
)
def test_code_lengths_that_are_not_a_complete_code_of_at_most_11_bits_are_refused(lengths: dict[int, int]) -> None:
    with pytest.raises(IntegrityError, match="complete prefix code"):
        decode(frame_with(lengths, [b"\0"] * 4), 4)


def test_streams_that_do_not_hold_exactly_their_symbols_are_refused() -> None:
    one_bit = {5: 1, 6: 1}  # a 0 bit is 5, a 1 bit is 6
    assert decode(frame_with(one_bit, [b"\x02"] * 4), 12).tolist() == [5, 6, 5] * 4
    with pytest.raises(IntegrityError, match="streams do not decode"):
        decode(frame_with(one_bit, [b"\x02\x00"] * 4), 12)  # a stream with a byte to spare
    with pytest.raises(IntegrityError, match="streams do not decode"):
        decode(frame_with(one_bit, [b"\x02"] * 4), 40)  # too few bits for 10 symbols a stream
    frame = frame_with(one_bit, [b"\x02"] * 4)
    with pytest.raises(IntegrityError, match="truncated"):
        decode(frame[: 2 + 1 + 8], 12)  # cut inside the stream sizes
    bad_sizes = bytearray(frame)
    struct.pack_into("<I", bad_sizes, 3, 1 << 30)  # stream 0 "runs" far past the frame
    with pytest.raises(IntegrityError, match="truncated"):
        decode(bytes(bad_sizes), 12)


def test_a_first_value_and_count_past_255_are_refused() -> None:
    frame = bytearray(frame_with({254: 1, 255: 1}, [b"\0"] * 4))
    frame[1] = 5  # 254 + 6 values
    with pytest.raises(IntegrityError):
        decode(bytes(frame), 4)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=200), st.integers(min_value=0, max_value=400))
def test_arbitrary_bytes_decode_or_are_refused(frame: bytes, count: int) -> None:
    """Whatever a frame holds, the decoder reads only the frame and writes only its output, then succeeds or refuses."""
    try:
        decode(frame, count, slack=32)
    except IntegrityError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_damaged_real_frames_decode_or_are_refused(data: st.DataObject) -> None:
    plain = CASES["skewed"][: data.draw(st.integers(min_value=1, max_value=3000))]
    frame = bytearray(huffman.encode(plain))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        frame[data.draw(st.integers(min_value=0, max_value=len(frame) - 1))] = data.draw(st.integers(min_value=0, max_value=255))
    cut = data.draw(st.integers(min_value=0, max_value=len(frame)))
    try:
        decode(bytes(frame[:cut]), len(plain), slack=32)
    except IntegrityError:
        pass


def test_several_frames_decode_in_one_call_and_a_failure_names_its_frame() -> None:
    parts = [CASES["skewed"][:500], CASES["uniform"][:300], CASES["one value repeated"]]
    frames = [huffman.encode(p) for p in parts]
    src = np.frombuffer(b"".join(frames), np.uint8)
    stops = np.cumsum([len(f) for f in frames])
    counts = np.array([len(p) for p in parts])
    out = np.zeros(counts.sum() + 1, np.uint8)
    huffman.decode_frames(src, stops - [len(f) for f in frames], stops, out, np.cumsum(counts) - counts, counts)
    assert (out[:-1] == np.concatenate(parts)).all()
    with pytest.raises(IntegrityError, match=r"\(frame 2\)"):
        huffman.decode_frames(src, stops - [len(f) for f in frames], stops, out, np.cumsum(counts) - counts, counts + [0, 0, 1])
