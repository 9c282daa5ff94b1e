"""The PackStore gRPC servicer and ``serve``: streams packs chunk by chunk, never a whole pack in memory."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import grpc

from packstore.bank.bank import BankCache, LocalBanks
from packstore.errors import InvalidInput, LimitExceeded, PackstoreError
from packstore.format import PackHeader
from packstore.format.bank import DEFAULT_VECTORS
from packstore.format.body import chunks_for
from packstore.format.signature import Signature
from packstore.packs.reader import PackReader, verified_chunks
from packstore.rpc.fields import signatures_of
from packstore.rpc.status import abort_with_error, status_for
from packstore.rpc.wire import ChunkAssembler, chunk_responses, serialize_get_pack_response
from packstore.security.auth import Auth, Principal
from packstore.security.shares import ShareRule, Shares, principal_key
from packstore.service.bulk import BulkServer, Tickets, bulk_address
from packstore.service.config import ServiceConfig
from packstore.service.hot import HotPacks
from packstore.service.namespace_stores import NamespaceStores
from packstore.service.service_metrics import ServiceMetrics
from packstore.service.to_messages import bank_info, pack_info, summary_info
from packstore.serving.admission import Admission
from packstore.serving.connections import ensure_open_files
from packstore.serving.listen import server_ssl_context
from packstore.serving.metrics_http import serve_metrics
from packstore.serving.pacing import StreamWatch
from packstore.serving.scaffold import Registrar, Server, log_as_json
from packstore.store.protocol import DEFAULT_EMBEDDER, DEFAULT_PAGE, DEFAULT_TOP_K, BankStore, BankTables, ServedStore, check_name
from packstore.store.records import PackPage
from packstore.v1 import store_pb2, store_pb2_grpc

SERVICE_NAME = store_pb2.DESCRIPTOR.services_by_name["PackStore"].full_name
log = logging.getLogger("packstore.service")


# The role each RPC needs (security/auth.py: read < write < admin).
ROLE_OF = {
    "GetPack": "read", "StatPack": "read", "ListPacks": "read", "VerifyPacks": "read", "StoreStats": "read", "WhoAmI": "read",
    "RouteQuery": "read", "ListBanks": "read", "StatBank": "read",
    "PutPack": "write", "DeletePack": "write", "SetName": "write", "DeleteName": "write", "SignPack": "write",
    "BuildBank": "write", "AddFacts": "write", "DeleteBank": "write", "SignBank": "write",
    "CollectGarbage": "admin",
}
# The calls that may hold a thread for long (streams, uploads, bank builds and routes, verification, GC): each runs on
# the ``workers`` transfer threads and takes one of the ``workers`` transfer slots, shared among principals
# (security/shares.py). Every other call is cheap and runs on the cheap-call threads, never queueing behind transfers
# (serving/admission.py).
TRANSFERS = frozenset({"GetPack", "VerifyPacks", "PutPack", "BuildBank", "AddFacts", "RouteQuery", "CollectGarbage"})
IN_FLIGHT_PER_WORKER = 4  # calls of every kind in flight at once, shared among principals: 4 per transfer slot


class Call(dict[str, object]):
    """One RPC's log fields (the dict), the store of its namespace, and who made it."""

    store: ServedStore
    principal: Principal
    share_key: str  # whom its shares are counted for (security/shares.py)
    complete = False  # a stream's last message was handed over: its client may close it without cancelling anything


class PackStoreService(store_pb2_grpc.PackStoreServicer):
    """The pack service over the stores of its namespaces, embedded or on an object store (``ServedStore``: packs,
    bank tables, chunk-by-chunk reads and staged uploads). ``bank_cache``: the embedders and decoded bank records
    bank calls share."""

    def __init__(
        self,
        stores: NamespaceStores,
        config: ServiceConfig,
        metrics: ServiceMetrics,
        auth: Auth | None = None,
        bulk: BulkServer | None = None,
        hot: HotPacks | None = None,
        bank_cache: BankCache | None = None,
    ) -> None:
        self.stores = stores
        self.bank_cache = bank_cache if bank_cache is not None else BankCache()
        self.auth = auth or Auth()
        self.config = config
        self.metrics = metrics
        self.bulk = bulk  # the bulk port GetPack hands tickets for; None: GetPack always streams
        self.hot = hot  # packs kept in the service's memory for the bulk port, per namespace; uploads join, deletions leave
        self.transfers = Shares("transfer slots", ShareRule.default(config.workers))
        self.watch = StreamWatch(log, seconds=config.stream_seconds)

    @contextmanager
    def _call(self, method: str, context: grpc.ServicerContext, **fields: object) -> Iterator[Call]:
        """Authenticate, time, count and log one RPC (by its token's name, never the token); hold a transfer slot
        for the TRANSFERS; turn packstore errors into a status with a clear message. Only a write or admin call
        creates its namespace's store: a read of a namespace without one reads an empty store, so reading creates
        nothing."""
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        info = Call(fields)
        try:
            with ExitStack() as held:
                info.principal = principal = self.auth.authenticate(context.invocation_metadata(), method, ROLE_OF[method])
                info.update(token=principal.token, namespace=principal.namespace)
                info.share_key = principal_key(principal.token, self.auth.enabled, context.peer())
                if method in TRANSFERS:
                    held.enter_context(self.transfers.slot(info.share_key, method))
                reads = ROLE_OF[method] == "read"
                info.store = self.stores.for_reading(principal.namespace) if reads else self.stores.get(principal.namespace)
                yield info
        except PackstoreError as exc:
            code = status_for(exc)
            info["error"] = str(exc)
            abort_with_error(context, exc)
        except GeneratorExit:  # a stream closed early: its client went away, or StreamWatch cancelled it
            if not info.complete:  # (a client may close once it has the last message, e.g. a bulk ticket)
                code = grpc.StatusCode.CANCELLED
                info.setdefault("error", "the client went away" if not info.get("slow_reader") else self.watch.rule())
            raise
        except Exception as exc:  # an unexpected failure: report INTERNAL, keep serving
            if isinstance(exc, grpc.RpcError) or type(exc).__name__ == "_AbortionError":
                raise
            code = grpc.StatusCode.INTERNAL
            log.exception("internal error", extra={"fields": {"method": method}})
            abort_with_error(context, PackstoreError(f"internal error: {exc}"))
        finally:
            if info.get("slow_reader") or info.get("cancelled"):
                code = grpc.StatusCode.CANCELLED
            self.metrics.record(method, code.name, time.perf_counter() - start, {"peer": context.peer(), **info})

    def refused(self, method: str, error: PackstoreError, peer: str) -> None:
        """Count and log a call refused before it ran (its token, or its share of the calls in flight)."""
        self.metrics.record(method, status_for(error).name, 0.0, {"peer": peer, "error": str(error)})

    def _track_store_gauges(self) -> None:
        """Have each scrape read, per open namespace, its packs and stored bytes (running counters in an embedded
        store, a listing in an object store, where other replicas write too) and its hot packs, and the size of
        the local files and the hot memory of the whole service; a namespace whose store cannot be read then
        reports NaN rather than fail the scrape."""

        def counts(field: str) -> dict[str, float]:
            found: dict[str, float] = {}
            for namespace, store in self.stores.opened().items():
                try:
                    found[namespace] = float(getattr(store.counts(), field))
                except PackstoreError:
                    found[namespace] = float("nan")
            return found

        self.metrics.store_packs.set_function(lambda: counts("packs"))
        self.metrics.store_pack_bytes.set_function(lambda: counts("stored_bytes"))
        self.metrics.store_bytes.set_function(self.stores.local_file_bytes)
        hot_packs = self.hot
        if hot_packs is not None:

            def hot(index: int) -> dict[str, float]:
                held = hot_packs.stats_by_namespace()
                return {namespace: float(held.get(namespace, (0, 0))[index]) for namespace in self.stores.opened().keys() | held.keys()}

            self.metrics.hot_packs.set_function(lambda: hot(0))
            self.metrics.hot_bytes.set_function(lambda: hot(1))
            self.metrics.hot_memory.set_function(lambda: hot_packs.bytes)

    # -- RPCs ------------------------------------------------------------------------------------

    def PutPack(self, request_iterator: Iterator[store_pb2.PutPackRequest], context: grpc.ServicerContext) -> store_pb2.PutPackResponse:
        with self._call("PutPack", context) as call, upload_deadline(context, self.config.upload_seconds):
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("item") != "begin":
                raise InvalidInput("PutPack must start with a PutPackBegin message carrying the header")
            if len(first.begin.header_json) > self.config.max_header_bytes:
                raise LimitExceeded(f"header of {len(first.begin.header_json)} bytes exceeds the limit of {self.config.max_header_bytes}")
            header = PackHeader.from_json(first.begin.header_json)
            self._check_upload_limits(header)
            name = check_name(first.begin.name) if first.begin.name else None
            signatures = signatures_of(first.begin.signatures)
            call["key"] = header.key
            upload = call.store.begin_upload(header)
            assembler = ChunkAssembler(header)
            namespace = call.principal.namespace
            hot_packs = self.hot
            hot = hot_packs.writer(namespace, header) if hot_packs is not None else None  # a pack just uploaded is likely read soon
            try:
                for message in request_iterator:
                    if message.WhichOneof("item") != "chunk":
                        raise InvalidInput("after the header, PutPack takes only chunks")
                    self.metrics.bytes_received.labels(namespace).inc(len(message.chunk.data))
                    whole = assembler.add(message.chunk)
                    if whole is not None:
                        index, data = whole
                        upload.add_chunk(index, bytes(data))  # verified against its digest, then staged (protobuf's bytes: no copy)
                        if hot is not None:
                            hot.add(index, data)
                if not assembler.complete:
                    raise InvalidInput(f"upload ended after {assembler.received} of {len(header.chunks)} chunks")
                key, created = upload.commit(name=name, signatures=signatures)
                # (a pack already stored keeps its own header, and so its own digest)
                if hot_packs is not None and hot is not None and created:
                    hot_packs.add(hot)
                    hot = None
            except BaseException:
                upload.abort()
                raise
            finally:
                if hot is not None:
                    hot.discard()
            call["created"] = created
            return store_pb2.PutPackResponse(pack=pack_info(call.store.stat(key)), created=created)

    def _check_upload_limits(self, header: PackHeader) -> None:
        """Refuse, before taking any chunk, a pack or chunk larger than configured: an upload holds
        one chunk in memory at a time, so the chunk limit bounds its memory whatever the client sends."""
        for index, chunk in enumerate(header.chunks):
            if chunk.stored_bytes > self.config.max_chunk_bytes:
                raise LimitExceeded(
                    f"chunk {index} of {chunk.stored_bytes} stored bytes exceeds the chunk limit of {self.config.max_chunk_bytes}"
                )
        total = sum(c.stored_bytes for c in header.chunks)
        if total > self.config.max_pack_bytes:
            raise LimitExceeded(f"pack of {total} stored bytes exceeds the limit of {self.config.max_pack_bytes}")

    def GetPack(self, request: store_pb2.GetPackRequest, context: grpc.ServicerContext) -> Iterator[store_pb2.GetPackResponse | bytes]:
        with self._call("GetPack", context, ref=request.ref) as call:
            yield from self.watch.paced(context, self._get_pack(request, context, call), call, _message_size)

    def _get_pack(
        self, request: store_pb2.GetPackRequest, context: grpc.ServicerContext, call: Call
    ) -> Iterator[store_pb2.GetPackResponse | bytes]:
        """GetPack's messages: the pack's info, then a bulk ticket or the chunks."""
        stored = call.store.stat(request.ref, model_fp=request.model_fp or None)
        header = stored.header
        call["key"] = header.key
        header.check_identities(request.model_fp, request.template_fp)
        span = (request.layers.first, request.layers.last) if request.HasField("layers") else None
        indices = chunks_for(header, span, request.prefix or None)
        yield store_pb2.GetPackResponse(header=pack_info(stored))
        if request.bulk and self.bulk is not None:
            fields = {k: call[k] for k in ("token", "namespace", "key")}
            try:
                ticket = self.bulk.tickets.issue(call.store, call.principal.namespace, header, indices, fields, call.share_key)
            except LimitExceeded as exc:  # past the caller's share of the tickets: it streams, on its transfer slot
                call["bulk_refused"] = str(exc)
            else:
                call["bulk"] = True
                call.complete = True  # the ticket is the call's last message
                yield store_pb2.GetPackResponse(bulk=self.bulk.ticket_message(ticket))
                return
        for index, data in verified_chunks(header, zip(indices, call.store.read_chunks(header, indices))):
            if not context.is_active():
                call["cancelled"] = True
                return
            yield from chunk_responses(index, data, header.chunks[index].digest)
            self.metrics.bytes_sent.labels(call.principal.namespace).inc(len(data))

    def StatPack(self, request: store_pb2.StatPackRequest, context: grpc.ServicerContext) -> store_pb2.PackInfo:
        with self._call("StatPack", context, ref=request.ref) as call:
            return pack_info(call.store.stat(request.ref, model_fp=request.model_fp or None))

    def SignPack(self, request: store_pb2.SignPackRequest, context: grpc.ServicerContext) -> store_pb2.SignPackResponse:
        with self._call("SignPack", context, ref=request.ref) as call:
            call["key"] = key = call.store.add_signature(
                request.ref, Signature.from_json(request.signature), model_fp=request.model_fp or None
            )
            return store_pb2.SignPackResponse(key=key)

    def ListPacks(self, request: store_pb2.ListPacksRequest, context: grpc.ServicerContext) -> store_pb2.ListPacksResponse:
        with self._call("ListPacks", context) as call:
            page = call.store.list_page(
                page_size=request.page_size or DEFAULT_PAGE,
                page_token=request.page_token,
                model_fp=request.model_fp or None,
                template_fp=request.template_fp or None,
                name=request.name or None,
            )
            return self._bounded_page(page)

    def _bounded_page(self, page: PackPage) -> store_pb2.ListPacksResponse:
        """The page as a response within half the message limit: entries past the budget (many long
        names, say) are left to the next page, whose token is the last entry sent."""
        response = store_pb2.ListPacksResponse()
        budget, used = self.config.max_message_bytes // 2, 0
        for index, summary in enumerate(page.packs):
            entry = summary_info(summary)
            used += entry.ByteSize() + 8  # the entry's tag and length prefix
            if index and used > budget:
                response.next_page_token = page.packs[index - 1].key
                return response
            response.packs.append(entry)
        response.next_page_token = page.next_token
        return response

    def DeletePack(self, request: store_pb2.DeletePackRequest, context: grpc.ServicerContext) -> store_pb2.DeletePackResponse:
        with self._call("DeletePack", context, ref=request.ref) as call:
            call["key"] = key = call.store.delete(request.ref, model_fp=request.model_fp or None)
            if self.hot is not None:
                self.hot.evict(call.principal.namespace, key)
            return store_pb2.DeletePackResponse(key=key)

    def SetName(self, request: store_pb2.SetNameRequest, context: grpc.ServicerContext) -> store_pb2.SetNameResponse:
        with self._call("SetName", context, ref=request.ref, name=request.name) as call:
            return store_pb2.SetNameResponse(key=call.store.set_name(request.ref, request.name, model_fp=request.model_fp or None))

    def DeleteName(self, request: store_pb2.DeleteNameRequest, context: grpc.ServicerContext) -> store_pb2.DeleteNameResponse:
        with self._call("DeleteName", context, name=request.name) as call:
            if not request.model_fp:
                raise InvalidInput("DeleteName needs model_fp: names are scoped per model")
            return store_pb2.DeleteNameResponse(key=call.store.delete_name(request.name, model_fp=request.model_fp))

    def VerifyPacks(self, request: store_pb2.VerifyPacksRequest, context: grpc.ServicerContext) -> Iterator[store_pb2.VerifyResult]:
        with self._call("VerifyPacks", context) as call:
            keys = [call.store.resolve(ref) for ref in request.refs] if request.refs else call.store.keys()
            reader = PackReader(call.store)  # verifying decodes without torch: no decoder needed
            results = (reader.verify(key) for key in keys)
            messages = (store_pb2.VerifyResult(key=r.key, ok=r.ok, error=r.error or "") for r in results)
            yield from self.watch.paced(context, messages, call, _message_size)


    def StoreStats(self, request: store_pb2.StoreStatsRequest, context: grpc.ServicerContext) -> store_pb2.StoreStatsResponse:
        with self._call("StoreStats", context) as call:
            counts = call.store.counts()
            return store_pb2.StoreStatsResponse(packs=counts.packs, stored_bytes=counts.stored_bytes)

    def WhoAmI(self, request: store_pb2.WhoAmIRequest, context: grpc.ServicerContext) -> store_pb2.Caller:
        with self._call("WhoAmI", context) as call:
            who = call.principal
            return store_pb2.Caller(token=who.token, role=who.role, namespace=who.namespace)

    def CollectGarbage(self, request: store_pb2.CollectGarbageRequest, context: grpc.ServicerContext) -> store_pb2.CollectGarbageResponse:
        with self._call("CollectGarbage", context, compact=request.compact) as call:
            report = call.store.gc(compact=request.compact)
            return store_pb2.CollectGarbageResponse(**report.__dict__)

    # -- banks ---------------------------------------------------------------------------------

    @staticmethod
    def _embedder(spec: str) -> str | None:
        """Over the service an embedder is an installed alias, never a path on the server; empty means None."""
        from packstore.bank.embedder import EMBEDDER_ALIASES

        if not spec:
            return None
        if spec not in EMBEDDER_ALIASES:
            raise InvalidInput(f"embedder {spec!r}: over the service, use one of {', '.join(EMBEDDER_ALIASES)}")
        return spec

    def _bank_stream(self, request_iterator: Iterator[store_pb2.BankFacts]) -> tuple[str, str | None, str, list[str]]:
        name: str | None = None
        embedder: str | None = None
        facts: list[str] = []
        vectors, size = "", 0
        for message in request_iterator:
            if name is None:
                name, embedder, vectors = check_name(message.name), self._embedder(message.embedder), message.vectors
            facts.extend(message.facts)
            size += sum(map(len, message.facts))
            if size > self.config.max_facts_bytes:
                raise LimitExceeded(f"facts exceed the limit of {self.config.max_facts_bytes} bytes")
        if name is None:
            raise InvalidInput("no facts were sent")
        return name, embedder, vectors, facts


    def BuildBank(self, request_iterator: Iterator[store_pb2.BankFacts], context: grpc.ServicerContext) -> store_pb2.BankInfo:
        with self._call("BuildBank", context) as call, upload_deadline(context, self.config.upload_seconds):
            name, embedder, vectors, facts = self._bank_stream(request_iterator)
            call["bank"] = name
            meta = self._banks(call.store).build(name, facts, embedder or DEFAULT_EMBEDDER, vectors=vectors or DEFAULT_VECTORS)
            return bank_info(meta, call.store.bank_stored_bytes(name))

    def AddFacts(self, request_iterator: Iterator[store_pb2.BankFacts], context: grpc.ServicerContext) -> store_pb2.BankInfo:
        with self._call("AddFacts", context) as call, upload_deadline(context, self.config.upload_seconds):
            name, embedder, _, facts = self._bank_stream(request_iterator)
            call["bank"] = name
            meta = self._banks(call.store).add(name, facts, embedder)
            return bank_info(meta, call.store.bank_stored_bytes(name))

    def RouteQuery(self, request: store_pb2.RouteQueryRequest, context: grpc.ServicerContext) -> store_pb2.RouteQueryResponse:
        with self._call("RouteQuery", context, bank=request.name) as call:
            routes = self._banks(call.store).route(
                request.name,
                list(request.queries),
                self._embedder(request.embedder),
                top_k=request.top_k or DEFAULT_TOP_K,
                probe=request.probe or None,
                mode=request.mode or "hybrid",
                rerank=request.rerank or "none",
                rerank_weight=request.rerank_weight if request.HasField("rerank_weight") else None,
            )
            return store_pb2.RouteQueryResponse(
                routes=[
                    store_pb2.Route(
                        query=r.query, clusters=r.clusters, facts=[store_pb2.RoutedFact(text=t, score=s) for t, s in r.facts],
                        reranker="" if r.reranker == "none" else r.reranker, reranker_fp=r.reranker_fp,
                    )
                    for r in routes
                ]
            )

    def ListBanks(self, request: store_pb2.ListBanksRequest, context: grpc.ServicerContext) -> store_pb2.ListBanksResponse:
        with self._call("ListBanks", context) as call:
            return store_pb2.ListBanksResponse(banks=[bank_info(meta, size) for meta, size in self._banks(call.store).list()])

    def DeleteBank(self, request: store_pb2.DeleteBankRequest, context: grpc.ServicerContext) -> store_pb2.DeleteBankResponse:
        with self._call("DeleteBank", context, bank=request.name) as call:
            self._banks(call.store).delete(request.name)
            return store_pb2.DeleteBankResponse()

    def _banks(self, store: BankTables) -> BankStore:
        """The banks of a namespace's store, with the service's embedders and decoded records."""
        return LocalBanks(store, self.bank_cache)

    def _bank_status(self, store: BankTables, name: str) -> store_pb2.BankStatus:
        banks = self._banks(store)
        return store_pb2.BankStatus(
            bank=bank_info(store.bank(name), store.bank_stored_bytes(name)),
            digest=banks.digest(name),
            signatures=[signature.to_json().decode() for signature in banks.signatures(name)],
        )

    def StatBank(self, request: store_pb2.StatBankRequest, context: grpc.ServicerContext) -> store_pb2.BankStatus:
        with self._call("StatBank", context, bank=request.name) as call:
            return self._bank_status(call.store, request.name)

    def SignBank(self, request: store_pb2.SignBankRequest, context: grpc.ServicerContext) -> store_pb2.BankStatus:
        with self._call("SignBank", context, bank=request.name) as call:
            self._banks(call.store).sign(request.name, Signature.from_json(request.signature))
            return self._bank_status(call.store, request.name)


def _message_size(message: store_pb2.GetPackResponse | store_pb2.VerifyResult | bytes) -> int:
    """A response's size on the wire (GetPack's chunk pieces come serialized already)."""
    return len(message) if isinstance(message, bytes) else message.ByteSize()


@contextmanager
def upload_deadline(context: grpc.ServicerContext, seconds: float) -> Iterator[None]:
    """Cancel the call if it is still running after ``seconds``: a stalled upload (a pack's chunks, a bank's facts)
    holds a transfer slot, what it staged and the room reserved for its hot copy, and gRPC gives a call no deadline
    unless its client sets one."""
    timer = threading.Timer(seconds, context.cancel)
    timer.daemon = True
    timer.start()
    try:
        yield
    except grpc.RpcError:
        if not timer.is_alive():
            log.warning("upload cancelled", extra={"fields": {"reason": f"not finished within upload_seconds ({seconds:g} s)"}})
        raise
    finally:
        timer.cancel()


class _Handlers:
    """Stands in for a server to catch the method handlers that generated code registers."""

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_pack_store(service: PackStoreService, server: Registrar) -> None:
    """Register the PackStore methods as generated, except GetPack's serializer, which passes the chunk
    messages ``chunk_responses`` wrote through as they are."""
    caught = _Handlers()
    store_pb2_grpc.add_PackStoreServicer_to_server(service, caught)  # type: ignore[no-untyped-call]  # grpcio-tools writes no annotations
    caught.handlers["GetPack"] = grpc.unary_stream_rpc_method_handler(
        service.GetPack, request_deserializer=store_pb2.GetPackRequest.FromString, response_serializer=serialize_get_pack_response
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(caught.service, caught.handlers),))
    server.add_registered_method_handlers(caught.service, caught.handlers)


def build_server(config: ServiceConfig, stores: NamespaceStores, metrics: ServiceMetrics, auth: Auth) -> tuple[Server, PackStoreService]:
    """The pack service on the servers' scaffold (health, reflection, TLS), bound to ``config.listen``; the service's
    bulk port is bound too, not yet started."""
    limits = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
    ]
    address = bulk_address(config.listen, config.bulk_listen)
    bulk, hot = None, HotPacks(config.hot_bytes) if config.hot_bytes else None
    if address is not None:
        tls = server_ssl_context(config.tls_cert, config.tls_key, config.tls_client_ca)
        local = config.bulk_local == "on"
        bulk = BulkServer(
            address, Tickets(), metrics, tls=tls, max_connections=config.bulk_connections, per_principal=config.bulk_per_principal,
            hot=hot, local=local, transfer_seconds=config.stream_seconds,
        )
    service = PackStoreService(stores, config, metrics, auth, bulk, hot)
    service._track_store_gauges()
    admission = Admission(auth, ROLE_OF, TRANSFERS, in_flight=config.workers * IN_FLIGHT_PER_WORKER, refused=service.refused)
    server = Server(
        SERVICE_NAME, lambda grpc_server: add_pack_store(service, grpc_server), config.listen, log=log,
        admission=admission, workers=config.workers, options=limits,
        tls_cert=config.tls_cert, tls_key=config.tls_key, tls_client_ca=config.tls_client_ca,
    )
    return server, service


def serve(config: ServiceConfig) -> None:
    """Run until SIGTERM/SIGINT, then stop taking calls and let in-flight ones finish (up to the grace
    period); SIGHUP reads the tokens file again."""
    log_as_json(config.log_level)
    ensure_open_files(
        (config.metrics_connections if config.metrics else 0) + (config.bulk_connections if config.bulk_listen != "off" else 0),
        "--metrics-connections and --workers",
    )
    metrics = ServiceMetrics()
    auth = Auth(config.auth or None)
    stores = NamespaceStores(
        config.data, max_bytes=config.max_store_bytes or None, objects=config.objects or None,
        endpoint=config.s3_endpoint or None, cache_bytes=config.cache_bytes,
    )
    try:
        server, service = build_server(config, stores, metrics, auth)
        metrics_at = None  # where the metrics port listens (loopback unless --metrics names a host)
        if config.metrics:
            tls = server_ssl_context(config.tls_cert, config.tls_key, config.tls_client_ca)
            metrics_at = serve_metrics(
                config.metrics, metrics.registry, auth, tls=tls, connections=config.metrics_connections,
                per_peer=config.metrics_connections_per_peer,
            ).listening
        if service.bulk is not None:
            service.bulk.start()
        fields = {
            "listen": config.listen,
            "bulk_port": service.bulk.port if service.bulk else None,
            "data": config.data,
            "objects": config.objects or None,
            "metrics": metrics_at,
        }
        fields |= {"tls": server.tls, "mutual_tls": bool(config.tls_client_ca)}
        if auth.enabled:
            fields |= {"auth": f"tokens from {config.auth} ({auth.reload()} tokens; SIGHUP reloads)"}
        else:
            fields |= {"auth": "none: no tokens, every caller is admin in the one namespace 'default'"}
        server.run(auth, config.shutdown_grace_seconds, fields, stopping=service.bulk.stop if service.bulk is not None else None)
    finally:
        stores.close()
