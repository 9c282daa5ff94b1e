"""Decoders written from docs/format.md alone (no packstore code): the contract the format tests hold the codec to."""

from __future__ import annotations

import struct


def huffman_decode(frame: bytes, count: int) -> bytes:
    """A Huffman frame (method 2) of docs/format.md §1.4, decoded from its description, one bit at a time."""
    first, used = frame[0], frame[1] + 1
    nibbles = [byte >> shift & 15 for byte in frame[2 : 2 + (used + 1) // 2] for shift in (0, 4)]
    lengths = {first + i: length for i, length in enumerate(nibbles[:used]) if length}
    assert max(lengths.values()) <= 11 and sum(2 ** (11 - length) for length in lengths.values()) == 2**11
    codes, code = {}, 0
    for length in range(1, 12):
        for value in sorted(v for v, n in lengths.items() if n == length):
            codes[(length, code)] = value
            code += 1
        code <<= 1
    at = 2 + (used + 1) // 2
    sizes = list(struct.unpack_from("<3I", frame, at))
    bounds = [at + 12]
    for size in sizes + [len(frame) - at - 12 - sum(sizes)]:
        bounds.append(bounds[-1] + size)
    quarter = -(-count // 4)
    out = []
    for k in range(4):
        stream = frame[bounds[k] : bounds[k + 1]]
        bit = 0
        for _ in range(max(0, min((k + 1) * quarter, count) - k * quarter)):
            length = code = 0
            while (length, code) not in codes:
                code, length, bit = code << 1 | (stream[bit // 8] >> (bit % 8)) & 1, length + 1, bit + 1
            out.append(codes[(length, code)])
        assert (bit + 7) // 8 == len(stream)
    return bytes(out)
