"""The Worker gRPC servicer: requests become ``Question``s for the caller's namespace's ``Answerer``; its tokens stream back."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

import grpc
import torch

from packstore.answering.answer import REF_TTL_SECONDS, Answerer, Question, ReadyCache
from packstore.errors import PackstoreError
from packstore.kv.inject import Sampling, TextDeltas
from packstore.kv.models import LoadedModel
from packstore.rpc.serving import Server, log_as_json
from packstore.rpc.status import abort_with_error
from packstore.security.auth import Auth
from packstore.store.protocol import DEFAULT_TOP_K, PackStore
from packstore.v1 import store_pb2, worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from packstore.security.trust import TrustedKeys

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
log = logging.getLogger("packstore.worker")


def sampling_from(message: worker_pb2.Sampling) -> Sampling:
    return Sampling(
        max_new_tokens=message.max_new_tokens or 64,
        temperature=message.temperature,
        top_p=message.top_p or 1.0,
        seed=message.seed if message.HasField("seed") else None,
    )


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """A thin gRPC shell over ``Answerer``s: one model, one device and one LRU, and one Answerer per
    caller namespace (its store, and its partition of the LRU, so tenants never share ready packs).

    ``store_for(namespace)`` gives the store a namespace reads; ``auth`` (the worker's own tokens file)
    decides each caller's namespace; without one every caller is in ``default``."""

    def __init__(
        self,
        lm: LoadedModel,
        store_for: Callable[[str], PackStore],
        *,
        cache_bytes: int,
        trusted: "TrustedKeys | None" = None,
        auth: Auth | None = None,
        ref_ttl: float = REF_TTL_SECONDS,
    ) -> None:
        self.lm = lm
        self.ref_ttl = ref_ttl
        self.store_for = store_for
        self.auth = auth or Auth()
        self.trusted = trusted
        self.ready = ReadyCache(cache_bytes)
        self._device_lock = threading.Lock()
        self._answerers: dict[str, Answerer] = {}
        self._lock = threading.Lock()

    def answerer(self, namespace: str) -> Answerer:
        with self._lock:
            if namespace not in self._answerers:
                self._answerers[namespace] = Answerer(
                    self.lm, self.store_for(namespace), ready=self.ready.partition(namespace), device_lock=self._device_lock,
                    trusted=self.trusted, ref_ttl=self.ref_ttl,
                )
            return self._answerers[namespace]

    def Generate(self, request, context):
        start = time.perf_counter()
        fields: dict = {"method": "Generate"}
        try:
            principal = self.auth.authenticate(context.invocation_metadata(), "Generate", "read")
            fields.update(token=principal.token, namespace=principal.namespace)
            answerer = self.answerer(principal.namespace)
            question = Question(
                request.question,
                refs=tuple(request.packs),
                bank=request.bank or None,
                top_k=request.top_k or DEFAULT_TOP_K,
                probe=request.probe or None,
                embedder=request.embedder or None,
                compare_rag=request.compare_rag,
                sampling=sampling_from(request.sampling),
                steering=tuple((steer.pack, steer.alpha) for steer in request.steering),
                steer_layers=(request.steer_layers.first, request.steer_layers.last) if request.HasField("steer_layers") else None,
                steer_on=request.steer_on or "values",
                mode=request.mode or "exact",
                adapter=request.adapter or None,
            )
            tokens = answerer.stream(question)
            deltas = TextDeltas(self.lm.tokenizer)
            try:
                while True:
                    token = next(tokens)
                    if token in self.lm.stop_token_ids:
                        yield worker_pb2.GenerateResponse(token=worker_pb2.Token(id=token, stop=True))
                    else:
                        yield worker_pb2.GenerateResponse(token=worker_pb2.Token(id=token, text=deltas.add(token)))
            except StopIteration as finished:
                result = finished.value
            done = worker_pb2.GenerateDone(
                pack=result.pack or "",
                answer=result.answer,
                kv_prompt_tokens=result.kv_prompt_tokens,
                generated_tokens=len(deltas.ids),
                cache_hit=result.cache_hit,
                facts=result.facts or [],
                parts=result.parts or [],
                composed_tokens=result.composed_tokens or 0,
                steering=[
                    worker_pb2.SteerApplied(pack=applied["pack"], alpha=applied["alpha"], layers=store_pb2.LayerRange(first=applied["layers"][0], last=applied["layers"][1]))
                    for applied in result.steering or ()
                ],
                steer_on=result.steer_on or "",
            )
            if question.compare_rag:
                done.compared, done.rag_answer, done.rag_prompt_tokens = True, result.rag_answer, result.rag_prompt_tokens
                done.identical = result.identical
            fields.update(code="OK", key=result.pack, cache_hit=result.cache_hit, tokens=len(deltas.ids))
            yield worker_pb2.GenerateResponse(done=done)
        except PackstoreError as exc:
            fields.update(code=exc.grpc_status, error=str(exc))
            abort_with_error(context, exc)
        except Exception as exc:  # an unexpected failure: report INTERNAL with a message, keep serving
            if isinstance(exc, grpc.RpcError) or type(exc).__name__ == "_AbortionError":
                raise
            fields.update(code="INTERNAL", error=str(exc))
            log.exception("internal error", extra={"fields": {"method": "Generate"}})
            abort_with_error(context, PackstoreError(f"internal error: {exc}"))
        finally:
            fields["ms"] = round((time.perf_counter() - start) * 1000, 2)
            log.info("Generate", extra={"fields": fields})

    def Status(self, request, context):
        try:
            principal = self.auth.authenticate(context.invocation_metadata(), "Status", "read")
        except PackstoreError as exc:
            abort_with_error(context, exc)
        answerer = self.answerer(principal.namespace)
        lm, store = self.lm, answerer.store
        packs, size = answerer.ready.stats  # the caller's own partition: never what other tenants made ready
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
        )


def serve_worker(
    lm: LoadedModel,
    store_for: Callable[[str], PackStore],
    listen: str,
    cache_bytes: int,
    grace_seconds: float = 30.0,
    *,
    trusted: "TrustedKeys | None" = None,
    auth: Auth | None = None,
    tls_cert: str = "",
    tls_key: str = "",
    tls_client_ca: str = "",
    ref_ttl: float = REF_TTL_SECONDS,
) -> None:
    """Serve Generate on ``listen`` (TLS with ``tls_cert``/``tls_key``, mutual with ``tls_client_ca``)
    until SIGTERM/SIGINT, then finish in-flight generations; with ``trusted``, only packs signed by a
    trusted key are injected; with ``auth``, callers need a token (SIGHUP reloads the file); ``ref_ttl``: see ``Answerer``."""
    log_as_json("INFO")
    service = WorkerService(lm, store_for, cache_bytes=cache_bytes, trusted=trusted, auth=auth, ref_ttl=ref_ttl)
    server = Server(
        SERVICE_NAME, lambda grpc_server: worker_pb2_grpc.add_WorkerServicer_to_server(service, grpc_server), listen, log=log,
        workers=8, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca,
    )
    fields = {"listen": listen, "model": lm.name, "model_fp": lm.model_fp, "device": str(lm.device)}
    fields |= {"auth": f"callers need a token from {auth.path}" if auth and auth.enabled else "none: callers need no token"}
    fields |= {"tls": server.tls, "mutual_tls": bool(tls_client_ca), "trusted_keys": trusted.source if trusted else None}
    server.run(service.auth, grace_seconds, fields)
