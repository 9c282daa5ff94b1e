"""The torch side of the format: chunk bytes <-> K/V tensors.

``packstore.format`` holds everything about a pack's bytes that needs no torch (header, codec, chunk checksums,
opening a chunk); this module builds tensors on top of it, on a ``Decoder``'s threads and in its buffers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import save as safetensors_save

from packstore.errors import IntegrityError, InvalidInput, Unavailable
from packstore.format import codec
from packstore.format.body import BLOCK_POSITIONS, LAYERS_PER_CHUNK, EncodedPack, TensorEntry, chunk_digest
from packstore.format.chunks import UNSIGNED, Buffer, ChunkSource, OpenedChunk, adapter_digest, as_3d, open_chunk
from packstore.format.header import CHUNK_DIGEST, CODEC, ChunkInfo, PackHeader
from packstore.packs import device_decode
from packstore.packs.buffers import BufferProvider, Fence
from packstore.packs.decoder import Decoder
from packstore.packs.plane_join import join_planes_on

FETCH_SECONDS = 60.0  # the longest an answer waits for the next layer of a pack arriving from the store (docs/operations.md)
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


@dataclass
class Pack:
    """A pack in memory: header plus K and V for each layer of ``header.body_layers`` (every layer of
    a knowledge pack, each ``[kv_heads, tokens, head_dim]``; a steering pack's deltas, each ``[kv_heads, head_dim]``)."""

    header: PackHeader
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def to(self, device: torch.device | str) -> Pack:
        """The same pack with its tensors on ``device`` (no copy where they already are)."""
        return Pack(header=self.header, keys=[k.to(device) for k in self.keys], values=[v.to(device) for v in self.values])

    def check_shapes(self) -> None:
        """Raise InvalidInput unless every tensor matches the header's shape and dtype."""
        check_shapes(self.header, self.header.body_layers, self.keys, self.values)

    def layer(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the ``slot``-th body layer (what ``ArrivingPack.layer`` waits for; here at once)."""
        return self.keys[slot], self.values[slot]


def check_shapes(
    header: PackHeader, layers: range, keys: list[torch.Tensor], values: list[torch.Tensor], *, positions: int | None = None
) -> None:
    """Raise InvalidInput unless ``keys`` and ``values`` hold one tensor of the header's shape and dtype per layer
    of ``layers`` (of its first ``positions`` positions, when given)."""
    expected = header.tensor_shape if positions is None else (header.kv_heads, positions, header.head_dim)
    if len(keys) != len(layers) or len(values) != len(layers):
        raise InvalidInput(f"pack has {len(keys)} K / {len(values)} V layers, header says {len(layers)}")
    for i, k, v in zip(layers, keys, values):
        for name, t in (("K", k), ("V", v)):
            if tuple(t.shape) != expected or t.dtype != torch_dtype(header.dtype):
                raise InvalidInput(f"layer {i} {name} is {tuple(t.shape)} {t.dtype}, header says {expected} {header.dtype}")


@dataclass
class PackPart:
    """Part of a pack's body, read without the rest (``PackStore.fetch_part``): K and V of each of ``layers``
    for its first ``positions`` positions (each ``[kv_heads, positions, head_dim]``; a steering pack's or an
    adapter's tensors whole)."""

    header: PackHeader
    layers: range
    positions: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def adapter_tensors_sha256(header: torch.Tensor, trailer: torch.Tensor) -> str:
    """sha256 of an adapter's header then trailer embeddings, as stored (C order, little-endian)."""
    return adapter_digest(*(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes() for tensor in (header, trailer)))


def check_tensor_digest(pack: Pack) -> None:
    """An adapter's key covers its tensors through ``recipe.tensors_sha256``: IntegrityError unless they match."""
    if pack.header.kind != "adapter":
        return
    assert pack.header.recipe is not None  # an adapter's header always has its recipe (checked on parse)
    if adapter_tensors_sha256(pack.keys[0], pack.values[0]) != pack.header.recipe["tensors_sha256"]:
        raise IntegrityError(f"pack {pack.header.key}: the adapter's tensors do not match recipe.tensors_sha256")


def position_blocks(positions: int, block_positions: int = BLOCK_POSITIONS) -> list[range | None]:
    """The token blocks a knowledge pack of ``positions`` positions is split into, in order: blocks of
    ``block_positions`` positions when it is longer than that, else one (None: every position)."""
    if positions <= block_positions:
        return [None]
    return [range(p, min(p + block_positions, positions)) for p in range(0, positions, block_positions)]


def token_blocks(header: PackHeader, block_positions: int = BLOCK_POSITIONS) -> list[range | None]:
    """The position ranges a pack's layer runs are split into (``position_blocks`` of a knowledge pack; a steering
    pack or an adapter is not split: None)."""
    return position_blocks(header.positions, block_positions) if header.kind == "knowledge" else [None]


def chunk_plan(header: PackHeader, block_positions: int = BLOCK_POSITIONS) -> list[tuple[int, int, range | None]]:
    """The chunks ``encode_pack`` writes, in their order (a chunk's index is its place here): (first layer, stop layer,
    positions or None) for each run of ``LAYERS_PER_CHUNK`` layers (a steering pack's or an adapter's layers in one
    chunk), then each token block of the run."""
    layers = header.body_layers
    per_chunk = LAYERS_PER_CHUNK if header.kind == "knowledge" else len(layers)
    blocks = token_blocks(header, block_positions)
    runs = [(first, min(first + per_chunk, layers.stop)) for first in range(layers.start, layers.stop, per_chunk)]
    return [(first, stop, block) for first, stop in runs for block in blocks]


def encode_chunk(
    header: PackHeader, first: int, stop: int, block: range | None, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> tuple[bytes, ChunkInfo]:
    """Code layers ``first`` to ``stop - 1`` as one chunk: ``keys`` and ``values`` hold each of those layers' K and V,
    of the positions of ``block`` alone when it is given (each ``[kv_heads, len(block), head_dim]``)."""
    tensors = {}
    for layer, key, value in zip(range(first, stop), keys, values, strict=True):
        k_name, v_name = header.tensor_names(layer)
        tensors[k_name], tensors[v_name] = key.contiguous(), value.contiguous()
    stored = codec.encode(safetensors_save(tensors), header.dtype)
    info = ChunkInfo(
        first_layer=first,
        stop_layer=stop,
        raw_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        stored_bytes=len(stored),
        digest=chunk_digest(stored, CHUNK_DIGEST),
        first_position=None if block is None else block.start,
        stop_position=None if block is None else block.stop,
    )
    return stored, info


def _encode_chunk(pack: Pack, first: int, stop: int, block: range | None) -> tuple[bytes, ChunkInfo]:
    """Code layers ``first`` to ``stop - 1`` of ``pack`` (only the positions of ``block`` when given) as one chunk."""
    offset = pack.header.body_layers.start  # keys[i] holds body layer offset + i
    keys, values = pack.keys[first - offset : stop - offset], pack.values[first - offset : stop - offset]
    if block is not None:
        keys, values = [k[:, block.start : block.stop] for k in keys], [v[:, block.start : block.stop] for v in values]
    return encode_chunk(pack.header, first, stop, block, keys, values)


def encoded_header(header: PackHeader, infos: Iterable[ChunkInfo]) -> PackHeader:
    """``header`` as stored: the codec written, and its chunks' records in order."""
    return dataclasses.replace(header, codec=CODEC, chunks=tuple(infos))


def encode_pack(pack: Pack, *, block_positions: int = BLOCK_POSITIONS, decoder: Decoder | None = None) -> EncodedPack:
    """Serialize each run of ``LAYERS_PER_CHUNK`` layers as safetensors, compress and checksum it.

    A knowledge pack of more than ``block_positions`` positions is split further into token blocks of that
    many positions per layer run, so that a prefix can be read alone. A steering pack's deltas (a few KB)
    go in one chunk. Chunks are coded on ``decoder``'s threads (a short-lived pool of its own when None)."""
    pack.check_shapes()
    plan = chunk_plan(pack.header, block_positions)
    with using_decoder(decoder) as coder:
        results = coder.map(lambda chunk: _encode_chunk(pack, *chunk), plan)
    return EncodedPack(header=encoded_header(pack.header, (info for _, info in results)), chunks=[stored for stored, _ in results])


@contextmanager
def using_decoder(decoder: Decoder | None) -> Iterator[Decoder]:
    """``decoder``, or a short-lived one of the caller's own (closed on leaving) when None."""
    if decoder is not None:
        yield decoder
        return
    with Decoder() as own:
        yield own


def _torch_device(device: object) -> torch.device:
    """``device`` as torch names it (a ``torch.device``, a name such as ``"cuda:0"``, an index); the CPU when not given."""
    if device is None or device == "":
        return torch.device("cpu")
    if not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"not a device: {device!r}")
    return torch.device(device)


class BodyAssembler:
    """Decodes chunks straight into K and V per layer of ``layers`` for positions ``0 .. positions-1`` (all when
    None) on ``device``, in tensors from ``buffers``. Each chunk's planes are interleaved into their place in the
    layer's tensor (a token block's is a strided view), so no byte is copied after decoding; for a device other than
    the CPU that tensor is the layer's host staging (from ``buffers``), copied to the device in one piece per K and V
    as soon as the layer's last chunk is in; when the buffers ``join_on_device``, each chunk's planes are staged and
    copied instead, and joined on the device into the layer's tensor. ``add`` may be called from several threads,
    one chunk each."""

    def __init__(self, header: PackHeader, layers: range, positions: int | None, device: object, buffers: BufferProvider) -> None:
        self.header, self.layers, self.device, self.buffers = header, layers, _torch_device(device), buffers
        self.positions = header.positions if positions is None and header.kind == "knowledge" else positions
        shape = header.tensor_shape if self.positions is None else (header.kv_heads, self.positions, header.head_dim)
        tensors = buffers.layer_tensors(shape, torch_dtype(header.dtype), 2 * len(layers), self.device)
        self.keys, self.values = tensors[0::2], tensors[1::2]
        self._names = {}  # tensor name -> (K or V, slot)
        for slot, layer in enumerate(layers):
            k_name, v_name = header.tensor_names(layer)
            self._names[k_name], self._names[v_name] = (0, slot), (1, slot)
        self._host: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # slot -> its K and V elements to decode into
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> its host staging (not on the CPU)
        self._covered = [0] * len(layers)
        self._lock = threading.Lock()
        self._device_decode = device_decode.decodes_on(buffers, self.device)
        self._pending: list[device_decode.Planned] = []  # chunks planned for the device whose layers are not all in yet
        self._statuses: list[torch.Tensor] = []  # the device decode's verdicts, read once the pack is in (``finish``)

    def _elements_of(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Where chunks of layer ``slot`` decode to: the layer's own K and V on the CPU, else its host staging, taken
        from the buffers when the layer's first chunk comes."""
        found = self._host.get(slot)  # every chunk of the layer after its first: no lock (a dict read is atomic)
        if found is not None:
            return found
        key, value = self.keys[slot], self.values[slot]
        if self.device.type != "cpu":
            key, value = (self.buffers.staging(tuple(t.shape), t.dtype, self.device) for t in (key, value))
        host = key, value
        with self._lock:
            if slot not in self._host:  # another chunk of the layer may have come meanwhile: the first staging wins
                self._host[slot] = (_elements(host[0]), _elements(host[1]))
                if self.device.type != "cpu":
                    self._staged[slot] = host
            return self._host[slot]

    def add(self, index: int, data: Buffer, *, verified: bool = False) -> list[int]:
        """Open chunk ``index`` (``format.chunks.open_chunk``: its digest unless ``verified``, its planes, its table)
        and decode the tensors wanted of it into their places (those of other layers, and positions past those
        wanted, are not decoded). Returns the slots this chunk completed: every position wanted of their K and V is
        in, and on a device, their copy is issued. When the pack is decoded on its device (``device_decode``), the
        chunk is checked and planned here, and sent with the rest of its layer once the layer's last chunk is in."""
        if self._device_decode:
            return self._add_for_device(index, data, verified)
        header = self.header
        chunk = open_chunk(header, index, data, verified=verified)
        held = chunk.positions
        stop = held.stop if self.positions is None else min(held.stop, self.positions)
        if self.positions is not None and stop <= held.start:
            return []  # a block past the positions wanted holds nothing of them
        offset, count = (held.start, stop - held.start) if header.kind == "knowledge" else (0, chunk.block[1])
        wanted = [(entry, *self._names[entry.name]) for entry in chunk.entries if entry.name in self._names]
        if self.buffers.join_on_device:
            self._join_on_device(chunk, [(entry, (self.keys, self.values)[which][slot]) for entry, which, slot in wanted], offset, count)
        else:
            for entry, which, slot in wanted:
                chunk.planes.write(self._elements_of(slot)[which], chunk.first_element(entry), chunk.block, offset, count)
        written = {slot for _, _, slot in wanted}  # the slots this chunk wrote K or V of
        whole, done = 1 if self.positions is None else self.positions, []
        with self._lock:  # counted only now: a layer is complete only once every chunk wrote both its K and its V
            for slot in sorted(written):
                self._covered[slot] += 1 if self.positions is None else stop - held.start
                if self._covered[slot] == whole:
                    done.append(slot)
                    self._host.pop(slot, None)  # joined on the device, a layer has no host elements
        for slot in done:
            staged = self._staged.pop(slot, None)
            if staged is not None:
                self.buffers.copy(staged[0], self.keys[slot])
                self.buffers.copy(staged[1], self.values[slot])
        return done

    def _add_for_device(self, index: int, data: Buffer, verified: bool) -> list[int]:
        """``add`` when the device decodes: check and plan the chunk (``device_decode.plan``), hold it until every chunk
        of its layers is in, then issue them together (``device_decode.issue``: one copy, one kernel, the joins)."""
        header = self.header
        planned, opened = device_decode.plan(header, index, data, verified)
        if planned is not None:
            positions, block, entries = planned.positions, planned.block, [t.entry for t in planned.tensors]
        else:
            assert opened is not None  # a chunk the device path does not take is opened on the host
            positions, block, entries = opened.positions, opened.block, list(opened.entries)
        stop = positions.stop if self.positions is None else min(positions.stop, self.positions)
        if self.positions is not None and stop <= positions.start:
            return []  # a block past the positions wanted holds nothing of them
        offset, count = (positions.start, stop - positions.start) if header.kind == "knowledge" else (0, block[1])
        wanted = [(entry.name, *self._names[entry.name]) for entry in entries if entry.name in self._names]
        places = [(name, (self.keys, self.values)[which][slot]) for name, which, slot in wanted]
        places = [(name, place.view(as_3d(tuple(place.shape)))) for name, place in places]
        host = {} if opened is None else device_decode.host_elements(opened, {name for name, _ in places})
        written = frozenset(slot for _, _, slot in wanted)
        item = device_decode.Planned(planned, host, places, offset, count, data, written)
        whole, done = 1 if self.positions is None else self.positions, []
        with self._lock:
            self._pending.append(item)
            for slot in sorted(written):
                self._covered[slot] += 1 if self.positions is None else stop - positions.start
                if self._covered[slot] == whole:
                    done.append(slot)
            batch = [held for held in self._pending if held.slots & set(done)]
            self._pending = [held for held in self._pending if not held.slots & set(done)]
        if batch:
            device_decode.issue(batch, self.buffers, self.device, self._statuses)
        return done

    def _join_on_device(self, chunk: OpenedChunk, wanted: list[tuple[TensorEntry, torch.Tensor]], offset: int, count: int) -> None:
        """Stage the byte planes of each wanted tensor of ``chunk`` in one host block, copy it to the device, and join
        them there into their places (``plane_join``): the CPU has only checked and entropy-decoded the chunk."""
        tensors = []  # (its place, the spans of its planes in the block, the packed plane's first element and cover)
        arrays: list[np.ndarray] = []
        for entry, place in wanted:
            first = chunk.first_element(entry)
            planes, packed = chunk.planes.parts(first, first + math.prod(chunk.block))
            layout = [len(arrays) + j for j in range(len(planes) + (packed is not None))]
            arrays += planes if packed is None else [*planes, packed[0]]
            tensors.append((place.view(as_3d(tuple(place.shape))), layout, None if packed is None else packed[1:]))
        spans = [0, *itertools.accumulate(len(array) for array in arrays)]
        staged = self.buffers.staging((spans[-1],), torch.uint8, self.device)
        host = staged.numpy()
        for array, start, stop in zip(arrays, spans[:-1], spans[1:]):
            host[start:stop] = array

        def join(planes: torch.Tensor) -> None:
            for place, layout, packed in tensors:
                views = [planes[spans[j] : spans[j + 1]] for j in layout]
                packed_view = None if packed is None else (views.pop(), *packed)
                join_planes_on(views, chunk.block, place, offset, count, chunk.planes.rotated, packed_view)

        self.buffers.upload(staged, self.device, join)

    def finish(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V per layer; IntegrityError if the chunks placed did not cover every layer and position once."""
        whole = 1 if self.positions is None else self.positions
        for slot, covered in enumerate(self._covered):
            if covered != whole:
                raise IntegrityError(
                    f"pack {self.header.key}: the chunks read hold {covered} of the {whole} positions of layer {self.layers[slot]}"
                )
        self.buffers.synchronize(self.device)
        device_decode.check(self._statuses, self.header.key)
        return self.keys, self.values


_SIGNED = {2: torch.int16, 4: torch.int32}


def _elements(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's elements as unsigned integers of their width, ``[A, P, D]`` (``as_3d``): a view,
    so writing it writes the tensor."""
    width = tensor.element_size()
    return tensor.view(_SIGNED[width]).numpy().view(UNSIGNED[width]).reshape(as_3d(tuple(tensor.shape)))


def decode_part(
    header: PackHeader,
    layers: tuple[int, int] | None,
    prefix: int | None,
    chunks: Iterable[tuple[int, Buffer]],
    device: object = None,
    *,
    decoder: Decoder | None = None,
    verified: bool = False,
) -> PackPart:
    """Verify (unless ``verified``) and decode the chunks ``chunks_for(header, layers, prefix)`` as (index, bytes), in
    parallel on ``decoder``'s threads, into layers ``layers`` (first, last; None: all) for the first ``prefix``
    positions (None: all) on ``device``."""
    span = header.body_layers if layers is None else range(layers[0], layers[1] + 1)
    with using_decoder(decoder) as coder:
        assembler = BodyAssembler(header, span, prefix, device, coder.buffers)
        for future in [coder.submit(assembler.add, index, data, verified=verified) for index, data in chunks]:
            future.result()
    keys, values = assembler.finish()
    try:
        check_shapes(header, span, keys, values, positions=prefix)
    except InvalidInput as exc:
        raise IntegrityError(f"pack {header.key}: {exc}") from None
    return PackPart(header, span, header.positions if prefix is None else prefix, keys, values)


class ArrivingPack:
    """A whole pack whose chunks are still being read, verified and decoded, in layer order, in the background
    (``start_pack``). ``layer(i)`` waits for body layer i alone, so a model can run its first layers while later
    ones decode; ``result()`` waits for the whole pack. A damaged, missing or repeated chunk raises from both:
    no tensor of a pack that fails is handed out after the failure is known, and ``result()`` never returns one."""

    def __init__(self, header: PackHeader, decoder: Decoder, device: object = None) -> None:
        self.header, self._decoder = header, decoder
        self._assembler = BodyAssembler(header, header.body_layers, None, device, decoder.buffers)
        self._layer_done = [threading.Event() for _ in header.body_layers]
        self._fences: list[Fence | None] = [None] * len(header.body_layers)  # set with the layer's event
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self._error: BaseException | None = None
        self._pack: Pack | None = None
        self._callbacks: list[Callable[[Pack], None]] = []

    def arrived(self, slot: int, seconds: float | None = 0) -> bool:
        """Whether the ``slot``-th body layer is in (or the pack has failed), waiting up to ``seconds`` for it."""
        return self._layer_done[slot].wait(seconds)

    def late(self, slot: int, seconds: float) -> Unavailable:
        """The error of an answer that waited ``seconds`` for the ``slot``-th body layer in vain (a stalled store)."""
        layer = self.header.body_layers[slot]
        return Unavailable(f"pack {self.header.key}: layer {layer} did not arrive from the store within {seconds:g} s")

    def layer(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the ``slot``-th body layer once every chunk of it is verified and decoded."""
        self._layer_done[slot].wait()
        if self._error is not None:
            raise self._error
        fence = self._fences[slot]
        if fence is not None:
            fence()  # the caller's stream waits for this layer's copies (and those issued before them) alone
        return self._assembler.keys[slot], self._assembler.values[slot]

    def result(self, seconds: float | None = None) -> Pack:
        """The whole pack, once every chunk is in, the layers are complete and the ``when_complete`` callbacks have
        run; the first failure otherwise. ``seconds``: the longest to wait for each next layer, and then for the
        whole (Unavailable past it: the store stalled); None waits as long as it takes."""
        for slot in range(len(self._layer_done)):
            if not self.arrived(slot, seconds):
                raise self.late(slot, seconds or 0)
        if not self._done.wait(seconds):
            raise self.late(len(self._layer_done) - 1, seconds or 0)
        if self._error is not None:
            raise self._error
        assert self._pack is not None
        return self._pack

    def when_complete(self, callback: Callable[[Pack], None]) -> None:
        """Call ``callback(pack)`` once the whole pack is in (now, if it is); never for a pack that fails."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        if self._pack is not None:
            callback(self._pack)

    def _feed(self, source: ChunkSource, verified: bool) -> None:
        """Submit each chunk ``source`` yields to the decoder's threads as it comes; leave ``source`` only once every
        submitted decode is over (its bytes may be views of a read transaction); then check the whole."""
        try:
            with source() as chunks:
                futures = []
                try:
                    for index, data in chunks:
                        if self._error is not None:
                            break
                        futures.append(self._decoder.submit(self._add, index, data, verified))
                finally:
                    wait(futures)
            for future in futures:
                future.result()
            keys, values = self._assembler.finish()
            pack = Pack(header=self.header, keys=keys, values=values)
            check_tensor_digest(pack)
        except BaseException as exc:  # handed to every waiter
            self._fail(exc)
            return
        self._complete(pack)

    def _copy_from(self, pack: Pack) -> None:
        """Issue the copy of each layer of ``pack`` (a host pack) into this pack's tensors, layer by layer, each
        layer's fence set as soon as its copies are issued; a thread of its own then waits for the last copy."""
        buffers, device = self._decoder.buffers, self._assembler.device
        for slot, (key, value) in enumerate(zip(pack.keys, pack.values)):
            buffers.copy(key, self._assembler.keys[slot])
            buffers.copy(value, self._assembler.values[slot])
            self._fences[slot] = buffers.fence(device)
            self._layer_done[slot].set()

        def settle() -> None:
            try:
                buffers.synchronize(device)
            except BaseException as exc:
                self._fail(exc)
                return
            self._complete(Pack(header=self.header, keys=self._assembler.keys, values=self._assembler.values))

        threading.Thread(target=settle, name="packstore-copy", daemon=True).start()

    def _complete(self, pack: Pack) -> None:
        """Hand out ``pack`` to ``result`` once every ``when_complete`` callback has run."""
        while True:  # every callback has run when ``result`` returns
            with self._lock:
                callbacks, self._callbacks = self._callbacks, []
                if not callbacks:
                    self._pack = pack
                    self._done.set()
                    return
            for callback in callbacks:
                callback(pack)

    def _add(self, index: int, data: Buffer, verified: bool) -> None:
        if self._error is not None:
            return
        try:
            with self._lock:
                if not 0 <= index < len(self.header.chunks) or index in self._seen:
                    raise IntegrityError(f"pack {self.header.key}: chunk {index} is not a chunk of the pack, or came twice")
                self._seen.add(index)
            completed = self._assembler.add(index, data, verified=verified)
        except BaseException as exc:
            self._fail(exc)
            raise
        for slot in completed:
            self._fences[slot] = self._decoder.buffers.fence(self._assembler.device)  # after this chunk's copies
            self._layer_done[slot].set()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc
            self._callbacks = []
            self._done.set()
        for event in self._layer_done:
            event.set()


def start_pack(header: PackHeader, source: ChunkSource, decoder: Decoder, device: object = None, *, verified: bool = False) -> ArrivingPack:
    """Start reading a whole pack's chunks from ``source`` (a context that yields (index, bytes) in layer order and
    stays open until every chunk is decoded) and verifying (unless ``verified``) and decoding them in parallel on
    ``decoder``'s threads, on ``device``; returns at once. The pack reader's ``start_fetch`` hands this a backend's
    chunk source."""
    pack = ArrivingPack(header, decoder, device)
    threading.Thread(target=pack._feed, args=(source, verified), name="packstore-arrive", daemon=True).start()
    return pack


def start_copy(pack: Pack, device: object, decoder: Decoder) -> Pack | ArrivingPack:
    """``pack`` (held in host memory, pinned for link speed) on ``device``: each layer's copy is issued at once on
    the decoder's buffers (a copy stream on CUDA) and ``layer(i)`` waits for layer i's copy alone, so the model
    starts on the first layers while the rest cross; on the CPU the pack itself."""
    target = _torch_device(device)
    if target.type == "cpu":
        return pack
    arriving = ArrivingPack(pack.header, decoder, target)
    arriving._copy_from(pack)
    return arriving


def pack_from_chunks(
    header: PackHeader,
    chunks: Iterable[tuple[int, Buffer]],
    device: object = None,
    *,
    decoder: Decoder | None = None,
    verified: bool = False,
) -> Pack:
    """A whole pack from every chunk as (index, bytes), each verified (unless ``verified``) and decoded (in
    parallel, as they come) on ``device``: ``start_pack``'s reading and checks, run on the caller's thread."""
    with using_decoder(decoder) as coder:
        pack = ArrivingPack(header, coder, device)
        pack._feed(lambda: nullcontext(chunks), verified)
    return pack.result()


def decode_pack(encoded: EncodedPack, device: object = None, *, decoder: Decoder | None = None, verified: bool = False) -> Pack:
    """Verify every chunk's checksum (unless ``verified``), then decode the chunks (in parallel on ``decoder``'s
    threads; a short-lived pool when None) into per-layer tensors on ``device``."""
    header = encoded.header
    if len(encoded.chunks) != len(header.chunks):
        raise IntegrityError(f"pack {header.key}: has {len(encoded.chunks)} chunks, header lists {len(header.chunks)}")
    return pack_from_chunks(header, enumerate(encoded.chunks), device, decoder=decoder, verified=verified)
