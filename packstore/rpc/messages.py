"""Conversions between packstore records and protocol messages."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from packstore.errors import InvalidInput
from packstore.format import PackHeader
from packstore.format.signature import Signature
from packstore.rpc.wire import ChunkPiece, piece_views
from packstore.store.records import PackSummary, StoredPack
from packstore.v1 import store_pb2


def summary_info(summary: PackSummary) -> store_pb2.PackInfo:
    """A pack's summary as a PackInfo without the header (what ListPacks pages carry)."""
    return store_pb2.PackInfo(**{**summary.__dict__, "names": list(summary.names), "parents": list(summary.parents)})


def pack_info(stored: StoredPack) -> store_pb2.PackInfo:
    """A pack's summary and its full sealed header."""
    info = summary_info(stored.summary)
    info.header_json = stored.header.to_json()
    info.signatures.extend(signature.to_json().decode() for signature in stored.signatures)
    return info


def pack_summary(info: store_pb2.PackInfo) -> PackSummary:
    """A PackInfo back to the summary it carries."""
    fields = {name: getattr(info, name) for name in PackSummary.__dataclass_fields__}
    return PackSummary(
        **{**fields, "names": tuple(info.names), "parents": tuple(info.parents), "composition": info.composition or "exact"}
    )


def stored_pack(info: store_pb2.PackInfo) -> StoredPack:
    """A PackInfo with its header back to a StoredPack; the header's seal is checked on the way."""
    header = PackHeader.from_json(info.header_json)
    return StoredPack(header=header, names=tuple(info.names), stored_bytes=info.stored_bytes, signatures=signatures_of(info.signatures))


def signatures_of(records) -> tuple[Signature, ...]:
    """Signature records (JSON strings) as Signatures; InvalidInput naming the first malformed one."""
    found = []
    for index, record in enumerate(records):
        try:
            found.append(Signature.from_json(record))
        except InvalidInput as exc:
            raise InvalidInput(f"signature {index}: {exc}") from None
    return tuple(found)


def chunk_pieces(index: int, data: bytes, digest: str) -> Iterator[store_pb2.Chunk]:
    """A chunk as consecutive Chunk messages with the same index (at least one, even when empty), made one at
    a time as they are sent, so a stream holds one piece beyond the chunk itself (an upload's; GetPack writes
    its chunk messages by hand: ``packstore.rpc.wire``)."""
    for piece in piece_views(data):
        yield store_pb2.Chunk(index=index, data=bytes(piece), digest=digest)


class ChunkAssembler:
    """Joins Chunk pieces back into whole chunks, using the header's stored sizes to know when each ends.
    ``indices``: the chunks expected, in order (a partial read's, or every chunk when None)."""

    def __init__(self, header: PackHeader, indices: Sequence[int] | None = None) -> None:
        self.header = header
        self.indices = tuple(indices) if indices is not None else tuple(range(len(header.chunks)))
        self.received = 0  # whole chunks so far
        self._parts: list[bytes | memoryview] = []
        self._size = 0

    def add(self, piece: store_pb2.Chunk | ChunkPiece) -> tuple[int, bytes | memoryview] | None:
        """Add one piece; returns (chunk index, whole chunk) when this piece completes it (a chunk that came in
        one piece is that piece's data, not copied)."""
        if self.received >= len(self.indices):
            raise InvalidInput(
                f"chunk {piece.index} arrived after the last chunk expected ({self.indices[-1] if self.indices else 'none'})"
            )
        index = self.indices[self.received]
        if piece.index != index:
            raise InvalidInput(f"chunk {piece.index} arrived where chunk {index} was expected")
        expected = self.header.chunks[index].stored_bytes
        data = piece.data  # each access of a protobuf bytes field copies it
        self._parts.append(data)
        self._size += len(data)
        if self._size > expected:
            raise InvalidInput(f"chunk {piece.index} is longer than the {expected} bytes the header states")
        if self._size < expected:
            return None
        data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts, self._size = [], 0
        self.received += 1
        return index, data

    @property
    def complete(self) -> bool:
        return self.received == len(self.indices) and not self._parts


def bank_info(meta, stored_bytes: int) -> store_pb2.BankInfo:
    return store_pb2.BankInfo(stored_bytes=stored_bytes, **meta.__dict__)


def bank_meta(info: store_pb2.BankInfo):
    """A BankInfo back to (BankMeta, stored bytes)."""
    from packstore.format.bank import BankMeta

    fields = {f: getattr(info, f) for f in BankMeta.__dataclass_fields__}
    return BankMeta(**fields), info.stored_bytes
