"""Packs that arrive layer by layer (``start_pack``), and caches that take each layer when the model reaches it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from packstore.errors import IntegrityError
from packstore.format import codec
from packstore.format.body import EncodedPack
from packstore.kv.inject import PackLayer, cache_from_pack
from packstore.packs.decoder import Decoder
from packstore.packs.tensors import ArrivingPack, BodyAssembler, encode_pack, start_pack
from tests.helpers.packs import make_pack

DECODER = Decoder()  # the chunk threads these tests decode on, as a program makes one


def gated_source(encoded: EncodedPack, gate: threading.Event, before_gate: int, log: list[str]):
    """A chunk source that yields the first ``before_gate`` chunks, then waits for ``gate``; it logs when it is left."""

    @contextmanager
    def source() -> Iterator[Iterator[tuple[int, bytes]]]:
        def chunks() -> Iterator[tuple[int, bytes]]:
            for index, data in enumerate(encoded.chunks):
                if index == before_gate:
                    assert gate.wait(10)
                yield index, data

        yield chunks()
        log.append("left")

    return source


def test_a_layer_is_handed_out_before_the_later_layers_arrive() -> None:
    pack = make_pack(layers=3)
    encoded = encode_pack(pack)
    gate, log = threading.Event(), []
    arriving = start_pack(encoded.header, gated_source(encoded, gate, 1, log), DECODER)
    k, v = arriving.layer(0)  # layers 1 and 2 are still held back
    assert torch.equal(k, pack.keys[0]) and torch.equal(v, pack.values[0]) and not log
    completed = []
    arriving.when_complete(completed.append)
    assert not completed
    gate.set()
    whole = arriving.result()
    assert all(torch.equal(a, b) for a, b in zip(pack.keys + pack.values, whole.keys + whole.values))
    assert completed == [whole] and log == ["left"]
    late = []
    arriving.when_complete(late.append)  # a callback added after the pack is whole runs at once
    assert late == [whole]


def damaged(encoded: EncodedPack, index: int) -> EncodedPack:
    chunks = list(encoded.chunks)
    chunks[index] = chunks[index][:-1] + bytes([chunks[index][-1] ^ 1])
    return EncodedPack(header=encoded.header, chunks=chunks)


@pytest.mark.parametrize(
    "case, feed",
    [
        ("damaged chunk", lambda e: enumerate(damaged(e, 2).chunks)),
        ("repeated chunk", lambda e: [(0, e.chunks[0]), (0, e.chunks[0]), (2, e.chunks[2])]),
        ("unknown chunk", lambda e: [(0, e.chunks[0]), (7, e.chunks[1])]),
        ("missing chunk", lambda e: [(0, e.chunks[0]), (1, e.chunks[1])]),
    ],
)
def test_a_pack_that_fails_hands_out_no_tensor_after_the_failure_and_never_completes(case: str, feed) -> None:
    encoded = encode_pack(make_pack(layers=3))

    @contextmanager
    def source():
        yield iter(feed(encoded))

    arriving = start_pack(encoded.header, source, DECODER)
    completed = []
    arriving.when_complete(completed.append)
    with pytest.raises(IntegrityError):
        arriving.result()
    for slot in range(3):
        with pytest.raises(IntegrityError):
            arriving.layer(slot)
    assert not completed


def test_a_source_that_fails_is_left_only_after_the_chunks_it_gave_are_decoded() -> None:
    encoded = encode_pack(make_pack(layers=3))
    log: list[str] = []

    @contextmanager
    def source():
        def chunks():
            yield 0, encoded.chunks[0]
            raise ConnectionError("the stream broke")

        try:
            yield chunks()
        finally:
            log.append("left")

    arriving = start_pack(encoded.header, source, DECODER)
    with pytest.raises(ConnectionError, match="the stream broke"):
        arriving.layer(2)
    with pytest.raises(ConnectionError):
        arriving.result()
    assert log == ["left"]


def test_a_cache_takes_each_layer_when_the_model_first_updates_it_and_leaves_the_pack_as_it_is() -> None:
    pack = make_pack(layers=3, tokens=5)
    before = [t.clone() for t in pack.keys + pack.values]
    encoded = encode_pack(pack)
    gate, log = threading.Event(), []
    arriving: ArrivingPack = start_pack(encoded.header, gated_source(encoded, gate, 1, log), DECODER)
    cache = cache_from_pack(arriving, torch.device("cpu"), tokens=4)
    assert all(isinstance(layer, PackLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 4  # known from the header, before any layer is in
    new = torch.ones(1, 2, 1, 4)
    keys, _ = cache.update(new, new, 0)  # layer 0 is in; layers 1 and 2 are not yet
    assert torch.equal(keys[0, :, :4], pack.keys[0][:, :4]) and torch.equal(keys[0, :, 4:], new[0])
    gate.set()
    for layer in (1, 2):
        keys, values = cache.update(new, new, layer)
        assert torch.equal(values[0, :, :4], pack.values[layer][:, :4]) and keys.shape == (1, 2, 5, 4)
    assert cache.get_seq_length() == 5
    assert all(torch.equal(a, b) for a, b in zip(before, pack.keys + pack.values))  # updates never write the pack
    ready = cache_from_pack(pack, torch.device("cpu"))
    assert torch.equal(ready.layers[2].keys[0], pack.keys[2])  # read before any update: the pack's layer itself


def test_a_layer_that_fails_to_arrive_raises_where_the_model_takes_it() -> None:
    encoded = encode_pack(make_pack(layers=3))

    @contextmanager
    def source():
        yield enumerate(damaged(encoded, 1).chunks)

    cache = cache_from_pack(start_pack(encoded.header, source, DECODER), torch.device("cpu"))
    with pytest.raises(IntegrityError):
        for layer in range(3):
            cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), layer)


def test_a_layer_in_token_blocks_is_complete_only_once_every_block_wrote_its_values_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of one layer decode in parallel threads: the block that completes the layer's positions with its K must
    not mark the layer complete while its V is still being written (the model would read a half-written V)."""
    pack = make_pack(layers=1, tokens=8)
    encoded = encode_pack(pack, block_positions=4)  # one layer in two token blocks
    assembler = BodyAssembler(encoded.header, encoded.header.body_layers, None, None, DECODER.buffers)
    writing_values, resume = threading.Event(), threading.Event()
    write = codec.Planes.write

    def slow_values(planes, out, first, *args, **kwargs) -> None:
        if threading.current_thread().name == "second-block" and first > 0:  # the chunk's second tensor: V
            writing_values.set()
            assert resume.wait(10)
        write(planes, out, first, *args, **kwargs)

    monkeypatch.setattr(codec.Planes, "write", slow_values)
    assert assembler.add(0, encoded.chunks[0]) == []
    completed: list[list[int]] = []
    second = threading.Thread(target=lambda: completed.append(assembler.add(1, encoded.chunks[1])), name="second-block")
    second.start()
    assert writing_values.wait(10)  # the second block's K is written, its V is not
    assert assembler._covered == [4]  # the first block's positions only: the layer is not complete
    resume.set()
    second.join()
    assert completed == [[0]]
    keys, values = assembler.finish()
    assert torch.equal(keys[0], pack.keys[0]) and torch.equal(values[0], pack.values[0])
