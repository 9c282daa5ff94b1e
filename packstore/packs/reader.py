"""The one pack reader: any backend's bytes turned into verified chunks, packs, arriving packs and parts.

Backends (``packstore.store``) hand out headers and stored chunk bytes; this is the only place chunks are verified
and decoded. Fetching decodes on the ``Decoder`` the program built (its threads and buffers); ``get`` and ``verify``
need no torch, so store-only tools import this module without the model stack.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from packstore.errors import IntegrityError, InvalidInput, PackNotFound
from packstore.format import parse_key
from packstore.format.body import EncodedPack, check_pack_signatures, verify_chunk
from packstore.format.chunks import Buffer, adapter_digest, chunk_arrays
from packstore.format.header import PackHeader
from packstore.format.signature import Signature
from packstore.store.protocol import PackSource, VerifiesWhereStored
from packstore.store.records import VerifyResult

if TYPE_CHECKING:
    from packstore.packs.decoder import Decoder
    from packstore.packs.tensors import ArrivingPack, Pack, PackPart


def verified_chunks(header: PackHeader, chunks: Iterable[tuple[int, Buffer]]) -> Iterator[tuple[int, Buffer]]:
    """Each (index, stored bytes) of ``chunks`` once checked against its size and digest (IntegrityError otherwise)."""
    for index, data in chunks:
        verify_chunk(header, index, data)
        yield index, data


class PackReader:
    """Packs read from ``store``, verified and decoded on ``decoder`` (made, and owned, on first decode when None)."""

    def __init__(self, store: PackSource, decoder: Decoder | None = None) -> None:
        self.store, self._decoder, self._owns_decoder = store, decoder, False

    @property
    def decoder(self) -> Decoder:
        if self._decoder is None:
            from packstore.packs.decoder import Decoder  # the torch side, only once something is decoded

            self._decoder, self._owns_decoder = Decoder(), True
        return self._decoder

    def close(self) -> None:
        """Stop the decoder's threads when this reader made it (a decoder handed in belongs to its maker)."""
        if self._owns_decoder and self._decoder is not None:
            self._decoder.close()

    def __enter__(self) -> PackReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, ref: str, *, model_fp: str | None = None, template_fp: str | None = None) -> EncodedPack:
        """Header, every stored chunk (each verified) and the signatures; identities stated must match (PackMismatch)."""
        opened = self.store.open_pack(ref, model_fp=model_fp, template_fp=template_fp, keep=True, signatures=True)
        opened.header.check_identities(model_fp, template_fp)
        header, data = opened.header, list[bytes]()
        with opened.chunks() as chunks:
            for index, chunk in verified_chunks(header, chunks):
                if index != len(data):
                    raise IntegrityError(f"pack {header.key}: chunk {index} came where chunk {len(data)} belongs")
                data.append(chunk if isinstance(chunk, bytes) else bytes(chunk))
        if len(data) != len(header.chunks):
            raise IntegrityError(f"pack {header.key}: {len(header.chunks) - len(data)} of its {len(header.chunks)} chunks are missing")
        return EncodedPack(header=header, chunks=data, signatures=opened.signatures)

    def fetch(self, ref: str, *, device: object = None, model_fp: str | None = None, template_fp: str | None = None) -> Pack:
        """The whole pack decoded into tensors on ``device`` (CPU when None); PackMismatch when identities differ."""
        return self.start_fetch(ref, device=device, model_fp=model_fp, template_fp=template_fp).result()

    def start_fetch(
        self, ref: str, *, device: object = None, model_fp: str | None = None, template_fp: str | None = None
    ) -> ArrivingPack:
        """``fetch`` that returns once the header is read and the identities stated are checked (PackMismatch,
        PackNotFound at once); the chunks are read, verified and decoded in the background in layer order, and
        ``layer(i)`` of the result waits for layer i alone, so a model can start before the whole pack is in."""
        from packstore.packs.tensors import start_pack

        opened = self.store.open_pack(ref, model_fp=model_fp, template_fp=template_fp)
        opened.header.check_identities(model_fp, template_fp)
        return start_pack(opened.header, opened.chunks, self.decoder, device)

    def fetch_part(
        self,
        ref: str,
        *,
        layers: tuple[int, int] | None = None,
        prefix: int | None = None,
        device: object = None,
        model_fp: str | None = None,
        template_fp: str | None = None,
    ) -> PackPart:
        """Layers ``layers`` (first, last, inclusive; None: all) of a pack's body for its first ``prefix`` positions
        (None: all), decoded on ``device``, reading only the chunks that hold them (a prefix saves reads where the
        pack is split into token blocks), each verified; InvalidInput if the pack has no such layers or positions."""
        from packstore.packs.tensors import decode_part

        opened = self.store.open_pack(ref, model_fp=model_fp, template_fp=template_fp, layers=layers, prefix=prefix)
        opened.header.check_identities(model_fp, template_fp)
        with opened.chunks() as chunks:
            return decode_part(opened.header, layers, prefix, chunks, device, decoder=self.decoder)

    def verify(self, ref: str) -> VerifyResult:
        """Check one pack's header seal and signatures, every chunk's checksum, that every chunk decodes (without
        torch) and an adapter's tensor digest, in the stored copy (a service checks its own: ``VerifiesWhereStored``)."""
        if isinstance(self.store, VerifiesWhereStored):
            return self.store.verify(ref)
        key = ref if parse_key(ref) else self.store.resolve(ref)
        try:
            self._check(key)
        except (IntegrityError, InvalidInput, PackNotFound) as exc:
            return VerifyResult(key=key, error=str(exc))
        return VerifyResult(key=key, error=None)

    def verify_all(self) -> list[VerifyResult]:
        """``verify`` of every key the store lists, whatever damage made of it."""
        if isinstance(self.store, VerifiesWhereStored):
            return self.store.verify_all()
        results = []
        for key in self.store.keys():
            try:
                results.append(self.verify(key))
            except (IntegrityError, InvalidInput, PackNotFound) as exc:
                results.append(VerifyResult(key=key, error=str(exc)))
        return results

    def _check(self, key: str) -> None:
        opened = self.store.open_pack(key, signatures=True, as_stored=True)
        with opened.chunks() as chunks:
            check_pack(opened.header, opened.signatures, chunks)


def check_pack(header: PackHeader, signatures: tuple[Signature, ...], chunks: Iterable[tuple[int, Buffer]]) -> None:
    """IntegrityError unless the signatures sign the pack's digest, ``chunks`` are each of its chunks once, each
    matching its digest and decoding to exactly its layers' tensors (without torch), and an adapter's tensors
    match ``recipe.tensors_sha256``."""
    check_pack_signatures(header, signatures)
    seen: set[int] = set()
    adapter = header.tensor_names(header.body_layers.start) if header.kind == "adapter" else None
    for index, data in chunks:
        if index in seen or not 0 <= index < len(header.chunks):
            raise IntegrityError(f"pack {header.key}: chunk {index} is not a chunk of the pack, or came twice")
        seen.add(index)
        arrays = chunk_arrays(header, index, data)
        if adapter is not None and adapter[0] in arrays:
            assert header.recipe is not None  # an adapter's header always has its recipe (checked on parse)
            found = adapter_digest(arrays[adapter[0]].tobytes(), arrays[adapter[1]].tobytes())
            if found != header.recipe["tensors_sha256"]:
                raise IntegrityError(f"pack {header.key}: the adapter's tensors do not match recipe.tensors_sha256")
    if len(seen) != len(header.chunks):
        raise IntegrityError(f"pack {header.key}: {len(header.chunks) - len(seen)} of its {len(header.chunks)} chunks are missing")
