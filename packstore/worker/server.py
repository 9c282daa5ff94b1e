"""The Worker gRPC servicer: requests become ``Question``s for the caller's namespace's ``Answerer``; its tokens stream back.
``run_worker`` builds a whole worker from its settings (``worker/config.py``): model, decoder, stores, servers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import grpc
import torch

from packstore.answering.answer import REF_TTL_SECONDS, Answerer, Answers, RefCache
from packstore.answering.engine_answer import EngineAnswerer, check_namespace
from packstore.answering.engine_client import EngineClient, EngineIdentity
from packstore.answering.ready_caches import ReadyCache
from packstore.answering.records import AnswerResult
from packstore.bank.bank import BankCache
from packstore.errors import InvalidInput, PackstoreError
from packstore.kv import exactness
from packstore.kv.device import Cancel, DeviceLock, Left
from packstore.kv.inject import TextDeltas
from packstore.kv.models import LoadedModel, RenderingModel, load_model
from packstore.packs.buffers import HostBuffers
from packstore.packs.decoder import Decoder
from packstore.packs.memory import PackMemory
from packstore.packs.tensors import FETCH_SECONDS
from packstore.rpc.status import abort_with_error
from packstore.security.auth import Auth, Principal
from packstore.security.shares import ShareRule, Shares, principal_key
from packstore.security.trust import TrustedKeys
from packstore.serving.admission import CHEAP_THREADS, Admission
from packstore.serving.connections import ConnectionCaps, ensure_open_files
from packstore.serving.listen import server_ssl_context
from packstore.serving.metrics_http import serve_metrics
from packstore.serving.pacing import STREAM_SECONDS, StreamWatch
from packstore.serving.scaffold import Server, log_as_json
from packstore.store.protocol import PackStore
from packstore.v1 import worker_pb2, worker_pb2_grpc
from packstore.worker.config import DEFAULT_MAX_CONCURRENT, MAX_REF_TTL, WorkerConfig, decode_modes, decoded_memory_bytes, host_cache_bound
from packstore.worker.front import check_engine_config, engine_front
from packstore.worker.http import OpenAIApp, serve_http
from packstore.worker.messages import generate_done, question_of
from packstore.worker.namespace_readers import NamespaceReaders
from packstore.worker.worker_metrics import WorkerMetrics

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# calls in flight beyond the threads (max_concurrent + CHEAP_THREADS), shared among principals as they are
QUEUED_RPCS = 16
ROLE_OF = {"Generate": "read", "Status": "read"}
log = logging.getLogger("packstore.worker")


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """A thin gRPC shell over ``Answerer``s: one model, one device, one device LRU and (with ``host_cache_bytes``)
    one host cache under it, and one Answerer per caller namespace (its store, and its partition of each tier, so
    tenants never share ready packs).

    ``store_for(namespace)`` gives the store a namespace reads; ``auth`` (the worker's own tokens file)
    decides each caller's namespace; without one every caller is in ``default``. With ``engine`` (a vLLM server's client
    and identity) the worker is its front: ``lm`` is a ``RenderingModel`` (no weights) and each namespace is answered by
    an ``EngineAnswerer`` instead (worker/front.py).

    ``slots``: the worker's ``max_concurrent`` generation slots, taken by gRPC ``Generate`` and the HTTP API's
    completions alike, per principal (a token's name; without tokens, the caller's host) by ``ShareRule.default``:
    at most ``per_principal`` each, and the last ``reserve`` free only to principals holding none. The generations
    holding them share the device per token (one ``DeviceLock`` for every namespace's Answerer: each takes one decode
    step at a time, in turn with the others running; ``kv/device.py``). ``watch``
    cancels a ``Generate`` whose client stops taking its tokens (``stream_seconds``, ``serving/pacing.py``)."""

    def __init__(
        self,
        lm: LoadedModel | RenderingModel,
        store_for: Callable[[str], PackStore],
        *,
        engine: tuple[EngineClient, EngineIdentity] | None = None,
        cache_bytes: int,
        host_cache_bytes: int = 0,
        trusted: TrustedKeys | None = None,
        auth: Auth | None = None,
        ref_ttl: float = REF_TTL_SECONDS,
        decoder: Decoder | None = None,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        stream_seconds: float = STREAM_SECONDS,
        fetch_seconds: float = FETCH_SECONDS,
    ) -> None:
        self.lm = lm
        self.engine = engine
        self.fetch_seconds = fetch_seconds
        self.slots = Shares("generation slots", ShareRule.default(max_concurrent))
        self.watch = StreamWatch(log, seconds=stream_seconds)
        self.decoder = decoder if decoder is not None else Decoder()  # one pool and buffer provider for every namespace
        self.bank_cache = BankCache()
        self.ref_ttl = ref_ttl
        self.store_for = store_for
        self.auth = auth or Auth()
        self.trusted = trusted
        self.host = ReadyCache(host_cache_bytes) if host_cache_bytes > 0 else None
        self.ready = ReadyCache(cache_bytes, below=self.host)
        buffers = self.decoder.buffers
        self.metrics = WorkerMetrics(
            {"device": self.ready} | ({"host": self.host} if self.host else {}), self.store_reads,
            buffers.stats if isinstance(buffers, HostBuffers) else None,
        )
        self._device_lock = DeviceLock()  # every namespace's Answerer's: generations take steps in turn (kv/device.py)
        self._answerers: dict[str, Answerer | EngineAnswerer] = {}
        self._lock = threading.Lock()

    def answerer(self, namespace: str) -> Answers:
        with self._lock:
            if namespace not in self._answerers:
                self._answerers[namespace] = self._new_answerer(namespace)
            return self._answerers[namespace]

    def _new_answerer(self, namespace: str) -> Answerer | EngineAnswerer:
        if self.engine is not None:
            assert isinstance(self.lm, RenderingModel)
            client, identity = self.engine
            check_namespace(identity, namespace, client.url)  # (before the namespace's store is opened)
            return EngineAnswerer(
                self.lm, self.store_for(namespace), client, identity, namespace=namespace, trusted=self.trusted,
                bank_cache=self.bank_cache, refs=RefCache(self.ref_ttl),
            )
        assert isinstance(self.lm, LoadedModel)
        return Answerer(
            self.lm, self.store_for(namespace), ready=self.ready.partition(namespace),
            host=self.host.partition(namespace) if self.host is not None else None, device_lock=self._device_lock,
            trusted=self.trusted, ref_ttl=self.ref_ttl, decoder=self.decoder, bank_cache=self.bank_cache,
            fetch_seconds=self.fetch_seconds,
        )

    def store_reads(self) -> dict[str, int]:
        """Packs fetched from the store so far, by namespace."""
        with self._lock:
            return {namespace: answerer.store_reads for namespace, answerer in self._answerers.items()}

    def share(self, principal: Principal, peer: str) -> str:
        """Whom a call from ``peer`` (a gRPC peer, or an HTTP client's address written as one) by ``principal`` holds
        its generation slot for."""
        return principal_key(principal.token, self.auth.enabled, peer)

    def refused(self, method: str, error: PackstoreError, peer: str) -> None:
        """Count and log a gRPC call refused before it ran (its token, or its share of the calls in flight)."""
        log.info(method, extra={"fields": {"method": method, "code": error.grpc_status, "error": str(error), "peer": peer}})
        self.metrics.record("", method, error.grpc_status, 0.0)

    def Generate(self, request, context):
        """The answer's tokens, then its summary; a client that leaves the stream untaken longer than the watch allows
        (``StreamWatch``: ``stream_seconds`` plus 1 s per 16 MiB) is cancelled, as a store stream is."""
        fields: dict = {"method": "Generate"}
        yield from self.watch.paced(context, self._generate(request, context, fields), fields, lambda message: message.ByteSize())

    def _generate(self, request, context, fields: dict) -> Iterator[worker_pb2.GenerateResponse]:
        start = time.perf_counter()
        share: str | None = None  # the principal holding a generation slot, while this call holds one
        tokens: Generator[int, None, AnswerResult] | None = None
        deltas: TextDeltas | None = None
        try:
            principal = self.auth.authenticate(context.invocation_metadata(), "Generate", "read")
            fields.update(token=principal.token, namespace=principal.namespace)
            answerer = self.answerer(principal.namespace)
            question = question_of(request)
            asking = self.share(principal, context.peer())
            if not self.slots.try_take(asking):
                raise self.slots.refused(asking, "Generate")
            share = asking
            cancel = Cancel()
            context.add_callback(cancel.cancel)  # the client gone: the generation (comparisons too) stops within a step
            tokens = answerer.stream(question, cancel)
            deltas = TextDeltas(self.lm.tokenizer, question.sampling.stop)
            held: worker_pb2.Token | None = None  # with stop strings, each token goes out one late: see _flush
            try:
                while True:
                    token = next(tokens)
                    if token in self.lm.stop_token_ids:
                        yield from self._flush(held, deltas)
                        held = None
                        yield worker_pb2.GenerateResponse(token=worker_pb2.Token(id=token, stop=True))
                    elif question.sampling.stop:
                        yield from self._flush(held, None)
                        held = worker_pb2.Token(id=token, text=deltas.add(token))
                    else:
                        yield worker_pb2.GenerateResponse(token=worker_pb2.Token(id=token, text=deltas.add(token)))
            except StopIteration as finished:
                result = finished.value
            yield from self._flush(held, deltas)
            self.slots.give_back(share)  # before the summary goes: a client that has read it may ask again at once
            share = None
            fields.update(code="OK", key=result.pack, cache_hit=result.cache_hit, tokens=len(deltas.ids))
            yield worker_pb2.GenerateResponse(done=generate_done(result, len(deltas.ids)))
        except PackstoreError as exc:
            fields.update(code=exc.grpc_status, error=str(exc))
            abort_with_error(context, exc)
        except Left:  # the client went (``cancel``): nothing to send; logged CANCELLED below
            pass
        except Exception as exc:  # an unexpected failure: report INTERNAL with a message, keep serving
            if isinstance(exc, grpc.RpcError) or type(exc).__name__ == "_AbortionError":
                raise
            fields.update(code="INTERNAL", error=str(exc))
            log.exception("internal error", extra={"fields": {"method": "Generate"}})
            abort_with_error(context, PackstoreError(f"internal error: {exc}"))
        finally:
            if tokens is not None:
                tokens.close()  # (a client gone: gRPC dropped this generator; its generation stops before the slot frees)
            if share is not None:
                self.slots.give_back(share)
            seconds = time.perf_counter() - start
            fields["ms"] = round(seconds * 1000, 2)
            if "code" not in fields:  # the client went first: the tokens generated until then
                fields.update(code="CANCELLED", tokens=len(deltas.ids) if deltas is not None else 0)
            log.info("Generate", extra={"fields": fields})
            self.metrics.record(fields.get("namespace", ""), "Generate", fields["code"], seconds)

    @staticmethod
    def _flush(held: worker_pb2.Token | None, deltas: TextDeltas | None) -> Iterator[worker_pb2.GenerateResponse]:
        """Send the token held back, with, when the answer is over (``deltas`` given), the text ``TextDeltas`` held back
        as the possible start of a stop string that never came: so the streamed texts always join to the answer."""
        if held is not None:
            if deltas is not None:
                held.text += deltas.rest()
            yield worker_pb2.GenerateResponse(token=held)

    def Status(self, request, context):
        start = time.perf_counter()
        try:
            principal = self.auth.authenticate(context.invocation_metadata(), "Status", "read")
        except PackstoreError as exc:
            self.metrics.record("", "Status", exc.grpc_status, time.perf_counter() - start)
            abort_with_error(context, exc)
        lm, store = self.lm, self.store_for(principal.namespace)
        packs, size = self.ready.partition(principal.namespace).stats  # the caller's own: never what other tenants made ready
        host_packs, host_bytes = self.host.partition(principal.namespace).stats if self.host is not None else (0, 0)
        self.metrics.record(principal.namespace, "Status", "OK", time.perf_counter() - start)
        return worker_pb2.WorkerStatus(
            model=lm.name,
            model_fp=lm.model_fp,
            template_fp=lm.template_fp,
            device=str(lm.device),
            dtype=lm.dtype_name,
            cached_packs=packs,
            cached_bytes=size,
            cache_limit_bytes=self.ready.limit_bytes,
            store=str(getattr(store, "target", getattr(store, "path", ""))),
            cpu_threads=torch.get_num_threads(),
            host_cached_packs=host_packs,
            host_cached_bytes=host_bytes,
            host_cache_limit_bytes=self.host.limit_bytes if self.host is not None else 0,
        )


def worker_server(service: WorkerService, listen: str, *, tls_cert: str = "", tls_key: str = "", tls_client_ca: str = "") -> Server:
    """The gRPC server of ``service`` on ``listen`` (not started): a thread for each of its generation slots, and the
    cheap-call threads that ``Status`` runs on, however many generations run or wait for the device; a principal may
    have its share of max_concurrent + CHEAP_THREADS + QUEUED_RPCS calls in flight."""
    slots = service.slots.rule.capacity
    admission = Admission(
        service.auth, ROLE_OF, frozenset({"Generate"}), in_flight=slots + CHEAP_THREADS + QUEUED_RPCS, refused=service.refused
    )
    return Server(
        SERVICE_NAME, lambda grpc_server: worker_pb2_grpc.add_WorkerServicer_to_server(service, grpc_server), listen, log=log,
        admission=admission, workers=slots, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca,
    )


def serve_worker(
    lm: LoadedModel | RenderingModel,
    store_for: Callable[[str], PackStore],
    listen: str,
    cache_bytes: int,
    grace_seconds: float = 30.0,
    *,
    host_cache_bytes: int = 0,
    metrics: str = "",
    trusted: TrustedKeys | None = None,
    auth: Auth | None = None,
    tls_cert: str = "",
    tls_key: str = "",
    tls_client_ca: str = "",
    ref_ttl: float = REF_TTL_SECONDS,
    decoder: Decoder | None = None,
    http: str = "",
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    stream_seconds: float = STREAM_SECONDS,
    fetch_seconds: float = FETCH_SECONDS,
    caps: ConnectionCaps | None = None,
    engine: tuple[EngineClient, EngineIdentity] | None = None,
) -> None:
    """Serve Generate on ``listen`` (TLS with ``tls_cert``/``tls_key``, mutual with ``tls_client_ca``)
    until SIGTERM/SIGINT, then finish in-flight generations; with ``trusted``, only packs signed by a
    trusted key are injected; with ``auth``, callers need a token (SIGHUP reloads the file); ``ref_ttl``: see ``Answerer``;
    ``decoder``: the chunk decoder packs are fetched with (its threads, its buffers); ``host_cache_bytes``: the host
    cache (0: none); ``metrics``: where to serve Prometheus metrics (HOST:PORT; by the rules of serving/metrics_http.py); ``http``:
    where to serve the OpenAI-compatible API (same rules and TLS; ``worker/http.py``); ``max_concurrent``: the
    worker's generation slots, both ports together, shared among callers (``WorkerService.slots``); a caller refused
    one gets RESOURCE_EXHAUSTED, HTTP 429; ``stream_seconds``: the minimum read rate of Generate's streams and HTTP
    responses (``StreamWatch``); ``fetch_seconds``: the longest an answer waits for a pack's next layer from the
    store (``Answerer``); ``caps``: the metrics and HTTP ports' connections, for which the open files limit is
    raised, or the start refused (None: the default caps); ``engine``: answer with this vLLM server (``WorkerService``)."""
    log_as_json("INFO")
    caps = caps or ConnectionCaps()
    ensure_open_files((caps.metrics if metrics else 0) + (caps.http if http else 0), "--metrics-connections and --http-connections")
    service = WorkerService(
        lm, store_for, cache_bytes=cache_bytes, host_cache_bytes=host_cache_bytes, trusted=trusted, auth=auth, ref_ttl=ref_ttl,
        decoder=decoder, max_concurrent=max_concurrent, stream_seconds=stream_seconds, fetch_seconds=fetch_seconds,
        engine=engine,
    )
    server = worker_server(service, listen, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca)
    metrics_at = None  # where the metrics port listens (loopback unless ``metrics`` names a host)
    if metrics:
        tls = server_ssl_context(tls_cert, tls_key, tls_client_ca)
        metrics_at = serve_metrics(
            metrics, service.metrics.registry, service.auth, tls=tls, connections=caps.metrics,
            per_peer=caps.metrics_per_peer,
        ).listening
    api = None
    if http:
        api = serve_http(
            http, OpenAIApp(service), grace_seconds=grace_seconds, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca,
            connections=caps.http, connections_per_peer=caps.http_per_peer,
        )
    fields: dict[str, object] = {"listen": listen, "model": lm.name, "model_fp": lm.model_fp, "device": str(lm.device)}
    fields |= {"engine": engine[0].url if engine else "transformers"}
    fields |= {"cache_bytes": cache_bytes, "host_cache_bytes": host_cache_bytes, "metrics": metrics_at}
    fields |= {"http": api.listening if api else None, "max_concurrent": max_concurrent}
    fields |= {"auth": f"callers need a token from {auth.path}" if auth and auth.enabled else "none: callers need no token"}
    fields |= {"tls": server.tls, "mutual_tls": bool(tls_client_ca), "trusted_keys": trusted.source if trusted else None}
    server.run(service.auth, grace_seconds, fields, stopping=(lambda: api.stop(grace_seconds)) if api else None)


def run_worker(config: WorkerConfig) -> None:
    """Check ``config``, load the model, build the decoder (its host memory, where it decodes) and the stores of the
    callers' namespaces, and serve until stopped. Every check that needs no model runs before the model loads. With
    engine 'vllm', load the front's tokenizer and identities instead and check the engine (worker/front.py)."""
    check_engine_config(config)
    front = config.engine == "vllm"
    decode_on_device, join_on_device = decode_modes(config) if not front else (False, False)
    if config.threads is not None:
        if config.threads < 1:
            raise InvalidInput(f"threads must be at least 1, got {config.threads}")
        torch.set_num_threads(config.threads)
    trusted = TrustedKeys.load(config.trusted_keys) if config.trusted_keys else None
    ref_ttl = REF_TTL_SECONDS if config.ref_ttl is None else config.ref_ttl
    if not 0 <= ref_ttl <= MAX_REF_TTL:  # also refuses NaN
        raise InvalidInput(f"ref_ttl must be from 0 to {MAX_REF_TTL:g} seconds, got {config.ref_ttl}")
    fetch_seconds = FETCH_SECONDS if config.fetch_seconds is None else config.fetch_seconds
    if not fetch_seconds > 0:  # also refuses NaN
        raise InvalidInput(f"fetch_seconds must be more than 0, got {config.fetch_seconds}")
    if config.max_concurrent < 1:
        raise InvalidInput(f"max_concurrent must be at least 1, got {config.max_concurrent}")
    if not 0 < config.stream_seconds <= 86400:  # also refuses NaN
        raise InvalidInput(f"stream_seconds must be from 0 to 86400, got {config.stream_seconds}")
    caps = ConnectionCaps(
        config.metrics_connections, config.metrics_connections_per_peer, config.http_connections, config.http_connections_per_peer
    )
    if config.host_cache_bytes is not None and config.host_cache_bytes < 0:
        raise InvalidInput(f"host_cache_bytes must be 0 or more, got {config.host_cache_bytes}")
    auth = Auth(config.auth) if config.auth else None
    if front:
        rendering, client, identity = engine_front(config)
        with NamespaceReaders(config.store, per_caller=auth is not None) as stores:
            try:
                serve_worker(
                    rendering, stores.get, config.listen, 0, metrics=config.metrics, trusted=trusted, auth=auth, ref_ttl=ref_ttl,
                    tls_cert=config.tls_cert, tls_key=config.tls_key, tls_client_ca=config.tls_client_ca, http=config.http,
                    max_concurrent=config.max_concurrent, stream_seconds=config.stream_seconds, caps=caps, engine=(client, identity),
                )
            finally:
                client.close()
        return
    template = Path(config.chat_template).read_text(encoding="utf-8") if config.chat_template else None
    exactness.apply(config.exactness)  # before the model first runs (cuBLAS reads its workspace setting once); refuses an unknown mode
    lm = load_model(config.model, device=config.device, dtype=config.dtype, chat_template=template, progress=config.progress)
    host_cache_bytes = host_cache_bound(config.host_cache_bytes, lm.device.type)
    reserved = decoded_memory_bytes(config.cache_bytes, host_cache_bytes, lm.device.type) if config.reserve_memory else 0
    pinned = lm.device.type == "cuda"  # the host cache's packs cross to the GPU at link speed only from page-locked memory
    memory = PackMemory(reserved, background=True, pinned=pinned) if reserved else None
    decoder = Decoder(buffers=HostBuffers(memory, join_on_device=join_on_device, decode_on_device=decode_on_device))
    with NamespaceReaders(config.store, per_caller=auth is not None) as stores:
        serve_worker(
            lm,
            stores.get,
            config.listen,
            config.cache_bytes,
            host_cache_bytes=host_cache_bytes,
            metrics=config.metrics,
            trusted=trusted,
            auth=auth,
            ref_ttl=ref_ttl,
            decoder=decoder,
            tls_cert=config.tls_cert,
            tls_key=config.tls_key,
            tls_client_ca=config.tls_client_ca,
            http=config.http,
            max_concurrent=config.max_concurrent,
            stream_seconds=config.stream_seconds,
            fetch_seconds=fetch_seconds,
            caps=caps,
        )
