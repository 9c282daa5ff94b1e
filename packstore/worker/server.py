"""The Worker gRPC servicer: resolve and fetch packs, refuse mismatches, stream generated tokens."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from packstore.api import banks_of, load_pack, pack_for_facts, resolve_for_model
from packstore.bank.bank import DEFAULT_TOP_K
from packstore.bank.embedder import DEFAULT_EMBEDDER
from packstore.errors import InvalidInput, PackstoreError
from packstore.format import pack_key
from packstore.kv.inject import Sampling, TextDeltas, answer_with_text, cache_from_pack, generate_stream, prepare
from packstore.kv.models import LoadedModel
from packstore.kv.render import pack_prefix_ids
from packstore.rpc.status import status_for
from packstore.service.server import JsonLogFormatter
from packstore.v1 import worker_pb2, worker_pb2_grpc
from packstore.worker.cache import PackCache

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
    """One model, one store, one LRU; generation runs one request at a time on the device."""

    def __init__(self, lm: LoadedModel, store, cache: PackCache) -> None:
        self.lm = lm
        self.store = store
        self.cache = cache
        self._device_lock = threading.Lock()

    def _route(self, request) -> tuple[list[str], str]:
        """The bank's top facts for the question, and the key their pack has for this model."""
        routed = banks_of(self.store).route(
            request.bank, [request.question], request.embedder or DEFAULT_EMBEDDER, top_k=request.top_k or DEFAULT_TOP_K, probe=request.probe or None
        )[0]
        facts = [text for text, _ in routed.facts]
        if not facts:
            raise InvalidInput(f"bank {request.bank!r} routed the question to no facts")
        return facts, pack_key(self.lm.model_fp, self.lm.template_fp, pack_prefix_ids(self.lm.tokenizer, facts))

    def Generate(self, request, context):
        start = time.perf_counter()
        fields: dict = {"method": "Generate"}
        try:
            sampling = sampling_from(request.sampling)
            facts: list[str] = []
            if request.bank:
                if request.packs:
                    raise InvalidInput("give either packs or a bank, not both")
                facts, key = self._route(request)
                pack, hit = self.cache.get(key, lambda k: pack_for_facts(self.store, self.lm, facts)[0])
            else:
                if len(request.packs) != 1:
                    raise InvalidInput(f"Generate takes exactly one pack in this version, got {len(request.packs)}")
                key = resolve_for_model(self.store, request.packs[0], self.lm)
                pack, hit = self.cache.get(key, lambda k: load_pack(self.store, k, self.lm))
            fields["key"] = key
            rendering = prepare(self.lm, pack.header, request.question)
            with self._device_lock:
                tokens = generate_stream(self.lm, rendering.token_ids, sampling, cache_from_pack(pack, self.lm.device))
                deltas = TextDeltas(self.lm.tokenizer)
                try:
                    while True:
                        token = next(tokens)
                        yield worker_pb2.GenerateResponse(token=worker_pb2.Token(id=token, text=deltas.add(token)))
                except StopIteration as finished:
                    answer = finished.value
                done = worker_pb2.GenerateDone(
                    pack=key,
                    answer=answer.text,
                    kv_prompt_tokens=answer.prompt_tokens,
                    generated_tokens=len(answer.token_ids),
                    cache_hit=hit,
                    facts=facts,
                )
                if request.compare_rag:
                    rag = answer_with_text(self.lm, pack.header.facts, request.question, raw=pack.header.raw, sampling=sampling)
                    done.compared, done.rag_answer, done.rag_prompt_tokens = True, rag.text, rag.prompt_tokens
                    done.identical = rag.token_ids == answer.token_ids
            fields.update(code="OK", cache_hit=hit, tokens=len(answer.token_ids))
            yield worker_pb2.GenerateResponse(done=done)
        except PackstoreError as exc:
            fields.update(code=status_for(exc).name, error=str(exc))
            context.abort(status_for(exc), str(exc))
        finally:
            fields["ms"] = round((time.perf_counter() - start) * 1000, 2)
            log.info("Generate", extra={"fields": fields})

    def Status(self, request, context):
        packs, size = self.cache.stats
        return worker_pb2.WorkerStatus(
            model=self.lm.name,
            model_fp=self.lm.model_fp,
            template_fp=self.lm.template_fp,
            device=str(self.lm.device),
            dtype=self.lm.dtype_name,
            cached_packs=packs,
            cached_bytes=size,
            cache_limit_bytes=self.cache.limit_bytes,
            store=str(getattr(self.store, "target", getattr(self.store, "path", ""))),
            cpu_threads=torch.get_num_threads(),
        )


def serve_worker(lm: LoadedModel, store, listen: str, cache_bytes: int, grace_seconds: float = 30.0) -> None:
    """Serve Generate on ``listen`` until SIGTERM/SIGINT, then finish in-flight generations."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    logging.basicConfig(level="INFO", handlers=[handler], force=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService(lm, store, PackCache(cache_bytes)), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if server.add_insecure_port(listen) == 0:
        raise InvalidInput(f"cannot listen on {listen}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", extra={"fields": {"listen": listen, "model": lm.name, "model_fp": lm.model_fp, "device": str(lm.device)}})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    health_servicer.enter_graceful_shutdown()
    server.stop(grace_seconds).wait()
