"""The gRPC client tier: ``RemoteStore`` implements the PackStore protocol over ``packstore serve``.

``open_pack`` starts GetPack and hands out the chunks as they arrive, over the bulk port when the service offers
it, so a pack reader decodes each one while the next is on the wire. Verify and banks run on the service.
"""

from __future__ import annotations

import builtins
import logging
import socket
import ssl
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from itertools import chain
from typing import TYPE_CHECKING

import grpc

from packstore.errors import LimitExceeded, PackNotFound, PackstoreError, Unauthenticated
from packstore.format import EncodedPack, PackHeader
from packstore.format.bank import DEFAULT_VECTORS
from packstore.format.body import chunks_for
from packstore.rpc.channel import Connection, GrpcClient
from packstore.rpc.fields import signatures_of
from packstore.rpc.wire import ChunkAssembler, ChunkPiece, chunk_pieces, get_pack_method
from packstore.store.protocol import DEFAULT_EMBEDDER, DEFAULT_PAGE, DEFAULT_TOP_K, MAX_PAGE, OpenedPack, check_name
from packstore.store.records import Caller, GcReport, PackPage, PackSummary, Route, StoreCounts, StoredPack, VerifyResult
from packstore.store.remote.bulk_reads import ReceiveBuffers, bulk_chunks, connect, connect_local, first_frame
from packstore.store.remote.from_messages import bank_meta, pack_summary, stored_pack
from packstore.v1 import store_pb2, store_pb2_grpc

if TYPE_CHECKING:
    from packstore.format.bank import BankMeta
    from packstore.format.chunks import Buffer
    from packstore.format.signature import Signature
    from packstore.store.protocol import BankStore, PackStore, ServesBanks, VerifiesWhereStored

log = logging.getLogger("packstore.remote")
RECEIVE_BUFFER_BYTES = 256 << 20


class RemoteStore(GrpcClient):
    """A pack store served by ``packstore serve``, addressed as ``grpc://HOST:PORT`` or ``grpcs://HOST:PORT`` (TLS).

    ``bulk``: read GetPack's chunks over the service's bulk port when it offers one (protocol.md, "Bulk
    transfer"); False keeps them on the gRPC stream. ``local_bulk``: on the service's host, read them over its local
    bulk socket instead of TCP (the same frames; a hot pack is sent from the service's memory).
    ``receive_buffer_bytes``: how much of the buffers bulk reads received into the client keeps for the next fetch
    (0: none)."""

    what = "pack service"

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        connection: Connection | None = None,
        bulk: bool = True,
        local_bulk: bool = True,
        receive_buffer_bytes: int = RECEIVE_BUFFER_BYTES,
    ) -> None:
        super().__init__(target, timeout=timeout, connection=connection)
        self._stub = store_pb2_grpc.PackStoreStub(self._channel)  # type: ignore[no-untyped-call]  # (generated, untyped)
        self._get_pack = get_pack_method(self._channel)  # chunk messages read without copying their bytes
        self.bulk = bulk  # ask GetPack for the bulk port (off after the port could not be reached once)
        self.local_bulk = bulk and local_bulk  # use the service's local bulk socket when offered (off once it could not be reached)
        self._buffers = ReceiveBuffers(receive_buffer_bytes)
        self._tls: ssl.SSLContext | None = None
        self._fallbacks: set[str] = set()  # why bulk transfers fell back to the stream, each logged once

    # -- reads -----------------------------------------------------------------------------------

    def stat(self, ref: str, *, model_fp: str | None = None) -> StoredPack:
        request = store_pb2.StatPackRequest(ref=ref, model_fp=model_fp or "")
        return stored_pack(self._call(lambda: self._stub.StatPack(request, timeout=self.timeout)))

    def resolve(self, ref: str, *, model_fp: str | None = None) -> str:
        return self.stat(ref, model_fp=model_fp).key

    def list_page(
        self,
        *,
        page_size: int = DEFAULT_PAGE,
        page_token: str = "",
        model_fp: str | None = None,
        template_fp: str | None = None,
        name: str | None = None,
    ) -> PackPage:
        request = store_pb2.ListPacksRequest(
            page_size=page_size, page_token=page_token, model_fp=model_fp or "", template_fp=template_fp or "", name=name or ""
        )
        page = self._call(lambda: self._stub.ListPacks(request, timeout=self.timeout))
        return PackPage(packs=[pack_summary(info) for info in page.packs], next_token=page.next_page_token)

    def list(self, *, model_fp: str | None = None, template_fp: str | None = None, name: str | None = None) -> list[PackSummary]:
        """Every matching pack's summary, fetched page by page."""
        packs: list[PackSummary] = []
        token = ""
        while True:
            page = self.list_page(page_size=MAX_PAGE, page_token=token, model_fp=model_fp, template_fp=template_fp, name=name)
            packs += page.packs
            token = page.next_token
            if not token:
                return packs

    def keys(self) -> builtins.list[str]:  # (list: the method above)
        return [p.key for p in self.list()]

    def counts(self) -> StoreCounts:
        reply = self._call(lambda: self._stub.StoreStats(store_pb2.StoreStatsRequest(), timeout=self.timeout))
        return StoreCounts(packs=reply.packs, stored_bytes=reply.stored_bytes)

    def caller(self) -> Caller:
        """Who the service takes this client to be (its token's name, role and namespace)."""
        reply = self._call(lambda: self._stub.WhoAmI(store_pb2.WhoAmIRequest(), timeout=self.timeout))
        return Caller(token=reply.token, role=reply.role, namespace=reply.namespace)

    def open_pack(
        self,
        ref: str,
        *,
        model_fp: str | None = None,
        template_fp: str | None = None,
        layers: tuple[int, int] | None = None,
        prefix: int | None = None,
        keep: bool = False,
        signatures: bool = False,
        as_stored: bool = False,
    ) -> OpenedPack:
        """Start GetPack of the chunks asked for: the service refuses (FAILED_PRECONDITION) a pack whose identities
        differ from those stated, and sends the signatures with the header (``signatures`` and ``as_stored`` ask
        nothing more). Without ``keep`` the chunks are only good until the source's context ends, their receive
        buffer going back to the client's pool."""
        if prefix is not None and prefix < 1:  # 0 would travel as "no prefix": refuse it as the other tiers do
            chunks_for(self.stat(ref, model_fp=model_fp).header, layers, prefix)
        reuse = not keep
        span = store_pb2.LayerRange(first=layers[0], last=layers[1]) if layers else None
        request = store_pb2.GetPackRequest(
            ref=ref, model_fp=model_fp or "", template_fp=template_fp or "", layers=span, prefix=prefix or 0, bulk=self.bulk
        )
        stored, second, responses = self._start_get_pack(request)
        header = stored.header
        indices = chunks_for(header, layers, prefix)
        if isinstance(second, store_pb2.GetPackResponse) and second.WhichOneof("item") == "bulk":
            started = self._start_bulk(second.bulk)
            if started is not None:
                sock, first = started
                return OpenedPack(header, stored.signatures, indices, lambda: self._received(sock, header, indices, reuse, first))
            request.ref, request.bulk = header.key, False  # the key, not a name that may have moved meanwhile
            stored, second, responses = self._start_get_pack(request)

        def chunks() -> Iterator[tuple[int, Buffer]]:
            assembler = ChunkAssembler(header, indices)
            try:
                for response in chain([second] if second is not None else [], responses):
                    if not isinstance(response, ChunkPiece):
                        raise PackstoreError(f"pack {header.key}: GetPack sent a {response.WhichOneof('item')} where a chunk was expected")
                    whole = assembler.add(response)
                    if whole is not None:
                        yield whole
            except grpc.RpcError as exc:
                raise self._error(exc) from None
            if not assembler.complete:
                raise PackstoreError(
                    f"pack {header.key}: the stream ended after {assembler.received} of {len(assembler.indices)} chunks asked for"
                )

        return OpenedPack(header, stored.signatures, indices, lambda: nullcontext(chunks()))

    def _start_bulk(self, ticket: store_pb2.BulkTicket) -> tuple[socket.socket, tuple[int, int, int]] | None:
        """A bulk connection with the ticket presented and the transfer's first frame read (over the local socket when
        offered and reachable, else TCP); None when this fetch streams instead: the port cannot be reached (and then
        no later fetch asks for it), or the server refused the transfer for now (LIMIT_EXCEEDED, a ticket that lapsed)
        or did not answer in time. Each reason is logged once per client."""
        try:
            sock = self._connect_local(ticket)
            if sock is None:
                sock = connect(self.address.rsplit(":", 1)[0], ticket.port, ticket.ticket, timeout=self.timeout, tls=self._bulk_tls(ticket))
        except OSError as exc:
            self._fall_back(
                "unreachable", f"the bulk port {ticket.port} of {self.target} cannot be reached ({exc}): GetPack streams from now on"
            )
            self.bulk = False
            return None
        try:
            return sock, first_frame(sock, self.timeout)
        except (LimitExceeded, Unauthenticated, OSError, EOFError) as exc:
            sock.close()
            self._fall_back(
                type(exc).__name__, f"the bulk port of {self.target} did not start a transfer ({exc}): that fetch streamed instead"
            )
            return None
        except BaseException:
            sock.close()
            raise

    def _fall_back(self, reason: str, message: str) -> None:
        """Log ``message`` the first time this client falls back to the stream for ``reason``."""
        if reason not in self._fallbacks:
            self._fallbacks.add(reason)
            log.warning(message)

    def _connect_local(self, ticket: store_pb2.BulkTicket) -> socket.socket | None:
        """A connection to the service's local bulk socket with the ticket presented, when the service offers one and it
        is reachable from here (the same host and network namespace); None otherwise, and from then on."""
        if not (self.local_bulk and ticket.local_socket):
            return None
        try:
            return connect_local(ticket.local_socket, ticket.ticket, timeout=self.timeout)
        except OSError as exc:
            log.info("the local bulk socket of %s cannot be reached (%s): bulk reads go over TCP from now on", self.target, exc)
            self.local_bulk = False
            return None

    @contextmanager
    def _received(
        self, sock: socket.socket, header: PackHeader, indices: tuple[int, ...], reuse: bool, first: tuple[int, int, int]
    ) -> Iterator[Iterator[tuple[int, memoryview]]]:
        """The chunks from a bulk connection whose first frame was read, received into a leased buffer (``reuse``) or each
        into its own."""
        size = sum(header.chunks[index].stored_bytes for index in indices)
        with self._buffers.lease(size) if reuse else nullcontext() as buffer:
            yield bulk_chunks(sock, header, indices, f"{self.what} at {self.target}", buffer, first)

    def _start_get_pack(
        self, request: store_pb2.GetPackRequest
    ) -> tuple[StoredPack, store_pb2.GetPackResponse | ChunkPiece | None, Iterator[store_pb2.GetPackResponse | ChunkPiece]]:
        """Call GetPack and read its first two responses: the stored pack, then a bulk ticket, the first chunk
        piece, or None (no chunks); the rest of the responses follow."""
        responses = self._get_pack(request, timeout=self.timeout)
        first = self._call(lambda: next(responses, None))
        if first is None or first.WhichOneof("item") != "header":
            raise PackstoreError("GetPack did not start with the pack header")
        return stored_pack(first.header), self._call(lambda: next(responses, None)), responses

    def _bulk_tls(self, ticket: store_pb2.BulkTicket) -> ssl.SSLContext | None:
        """The TLS context for a bulk connection: the channel's trust and client certificate, when the port speaks TLS."""
        if not ticket.tls:
            return None
        if self._tls is None:
            self._tls = self.connection.ssl_context()
        return self._tls

    # -- writes ----------------------------------------------------------------------------------

    def put(self, encoded: EncodedPack, *, name: str | None = None) -> tuple[str, bool]:
        """Upload a pack (header, then every chunk in pieces); returns ``(key, created)``."""
        if name is not None:
            check_name(name)  # an empty name would travel as "no name"

        def requests() -> Iterator[store_pb2.PutPackRequest]:
            signatures = [signature.to_json().decode() for signature in encoded.signatures]
            yield store_pb2.PutPackRequest(
                begin=store_pb2.PutPackBegin(header_json=encoded.header.to_json(), name=name or "", signatures=signatures)
            )
            for index, (chunk, info) in enumerate(zip(encoded.chunks, encoded.header.chunks)):
                for piece in chunk_pieces(index, chunk, info.digest):
                    yield store_pb2.PutPackRequest(chunk=piece)

        response = self._call(lambda: self._stub.PutPack(requests(), timeout=self.timeout))
        return response.pack.key, response.created

    def add_signature(self, ref: str, signature: Signature, *, model_fp: str | None = None) -> str:
        request = store_pb2.SignPackRequest(ref=ref, model_fp=model_fp or "", signature=signature.to_json().decode())
        reply: store_pb2.SignPackResponse = self._call(lambda: self._stub.SignPack(request, timeout=self.timeout))
        return reply.key

    def delete(self, ref: str, *, model_fp: str | None = None) -> str:
        request = store_pb2.DeletePackRequest(ref=ref, model_fp=model_fp or "")
        reply: store_pb2.DeletePackResponse = self._call(lambda: self._stub.DeletePack(request, timeout=self.timeout))
        return reply.key

    def set_name(self, ref: str, name: str, *, model_fp: str | None = None) -> str:
        request = store_pb2.SetNameRequest(ref=ref, name=name, model_fp=model_fp or "")
        reply: store_pb2.SetNameResponse = self._call(lambda: self._stub.SetName(request, timeout=self.timeout))
        return reply.key

    def delete_name(self, name: str, *, model_fp: str) -> str:
        request = store_pb2.DeleteNameRequest(name=name, model_fp=model_fp)
        reply: store_pb2.DeleteNameResponse = self._call(lambda: self._stub.DeleteName(request, timeout=self.timeout))
        return reply.key

    def gc(self, *, compact: bool = False) -> GcReport:
        request = store_pb2.CollectGarbageRequest(compact=compact)
        reply = self._call(lambda: self._stub.CollectGarbage(request, timeout=self.timeout))
        return GcReport(**{name: getattr(reply, name) for name in GcReport.__dataclass_fields__})

    def banks(self) -> RemoteBanks:
        return RemoteBanks(self)

    def verify(self, ref: str) -> VerifyResult:
        return self._verify([ref])[0]

    def verify_all(self) -> builtins.list[VerifyResult]:  # (list: the method above)
        return self._verify([])

    def _verify(self, refs: builtins.list[str]) -> builtins.list[VerifyResult]:
        request = store_pb2.VerifyPacksRequest(refs=refs)
        results = self._call(lambda: list(self._stub.VerifyPacks(request, timeout=self.timeout)))
        return [VerifyResult(key=r.key, error=r.error or None) for r in results]


FACT_BATCH = 1000


class RemoteBanks:
    """Bank operations on the service: the same methods as ``packstore.bank.bank.LocalBanks``."""

    def __init__(self, store: RemoteStore) -> None:
        self.store = store

    def _upload(self, rpc: Callable[..., store_pb2.BankInfo], name: str, facts: list[str], embedder: str, vectors: str) -> BankMeta:
        def batches() -> Iterator[store_pb2.BankFacts]:
            for start in range(0, max(len(facts), 1), FACT_BATCH):
                yield store_pb2.BankFacts(name=name, embedder=embedder, vectors=vectors, facts=facts[start : start + FACT_BATCH])

        return bank_meta(self.store._call(lambda: rpc(batches(), timeout=self.store.timeout)))[0]

    def build(
        self, name: str, facts: Sequence[str], embedder: str = DEFAULT_EMBEDDER, *, vectors: str = DEFAULT_VECTORS, progress: bool = False
    ) -> BankMeta:
        return self._upload(self.store._stub.BuildBank, name, list(facts), embedder, vectors)

    def add(self, name: str, facts: Sequence[str], embedder: str | None = None, *, progress: bool = False) -> BankMeta:
        return self._upload(self.store._stub.AddFacts, name, list(facts), embedder or "", "")

    def route(
        self,
        name: str,
        queries: Sequence[str],
        embedder: str | None = None,
        *,
        top_k: int = DEFAULT_TOP_K,
        probe: int | None = None,
        mode: str = "hybrid",
        rerank: str = "none",
        rerank_weight: float | None = None,
    ) -> list[Route]:
        request = store_pb2.RouteQueryRequest(
            name=name, queries=list(queries), top_k=top_k, probe=probe or 0, embedder=embedder or "", mode=mode, rerank=rerank,
            rerank_weight=rerank_weight,
        )
        reply = self.store._call(lambda: self.store._stub.RouteQuery(request, timeout=self.store.timeout))
        return [
            Route(query=r.query, clusters=list(r.clusters), facts=[(f.text, f.score) for f in r.facts], reranker=r.reranker or "none",
                  reranker_fp=r.reranker_fp)
            for r in reply.routes
        ]

    def list(self) -> list[tuple[BankMeta, int]]:
        reply = self.store._call(lambda: self.store._stub.ListBanks(store_pb2.ListBanksRequest(), timeout=self.store.timeout))
        return [bank_meta(info) for info in reply.banks]

    def stored_bytes(self, name: str) -> int:
        for meta, size in self.list():
            if meta.name == name:
                return size
        raise PackNotFound(f"no bank named {name!r}")

    def delete(self, name: str) -> None:
        request = store_pb2.DeleteBankRequest(name=name)
        self.store._call(lambda: self.store._stub.DeleteBank(request, timeout=self.store.timeout))

    def _status(self, name: str) -> store_pb2.BankStatus:
        request = store_pb2.StatBankRequest(name=name)
        reply: store_pb2.BankStatus = self.store._call(lambda: self.store._stub.StatBank(request, timeout=self.store.timeout))
        return reply

    def digest(self, name: str) -> str:
        return self._status(name).digest

    def signatures(self, name: str) -> tuple[Signature, ...]:
        return signatures_of(self._status(name).signatures)

    def sign(self, name: str, signature: Signature) -> None:
        request = store_pb2.SignBankRequest(name=name, signature=signature.to_json().decode())
        self.store._call(lambda: self.store._stub.SignBank(request, timeout=self.store.timeout))


if TYPE_CHECKING:  # mypy proves the tier is each interface its users take it as (isinstance checks only at run time)
    _packs: type[PackStore] = RemoteStore
    _serves_banks: type[ServesBanks] = RemoteStore
    _verifies: type[VerifiesWhereStored] = RemoteStore
    _banks: type[BankStore] = RemoteBanks
