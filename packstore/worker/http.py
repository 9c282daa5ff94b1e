"""The worker's OpenAI-compatible HTTP API (``packstore worker --http``): Starlette on uvicorn, in a thread of the
worker process beside its gRPC server, answering through the same ``WorkerService`` Answerers, so an answer here is
the worker's answer (text and tokens) to the same pack, question and sampling.

``POST /v1/chat/completions`` (whole, or as server-sent events ending ``data: [DONE]``), ``GET /v1/models``,
``GET /health``. Generation runs in Starlette's thread pool; callers, tokens and namespaces are the gRPC ones
(``Auth.authenticate`` over the HTTP headers); errors are OpenAI's ``{"error": {...}}`` with the status of
``HTTP_STATUS``. docs/protocol.md, "OpenAI-compatible HTTP API", is the reference.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import uvicorn
from anyio import CancelScope
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from packstore.answering.records import AnswerResult
from packstore.errors import InvalidInput, LimitExceeded, PackstoreError
from packstore.kv.inject import TextDeltas
from packstore.rpc.metrics_http import metrics_address
from packstore.security.auth import Auth
from packstore.worker.chat import ChatRequest, chat_request, packstore_fields, usage
from packstore.worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from packstore.answering.answer import Answerer
    from packstore.kv.models import LoadedModel

DEFAULT_MAX_CONCURRENT = 16
MAX_BODY_BYTES = 8 << 20  # a request body past this is refused (413) before it is read whole
STARTUP_SECONDS = 10.0
HTTP_STATUS = {  # a PackstoreError's gRPC status -> the HTTP status it answers with
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429, "INTERNAL": 500, "DATA_LOSS": 500, "UNAVAILABLE": 503,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "invalid_request_error"}
ERROR_TYPE |= {413: "invalid_request_error", 429: "rate_limit_error"}  # every other status: server_error
log = logging.getLogger("packstore.worker")


class WorkerService(Protocol):
    """What the HTTP API needs of the worker (``server.WorkerService``, which starts it): its model, callers' tokens,
    metrics, and the Answerer of a namespace."""

    lm: LoadedModel
    auth: Auth
    metrics: WorkerMetrics

    def answerer(self, namespace: str) -> Answerer: ...


class BodyTooLarge(InvalidInput):
    """A request body longer than MAX_BODY_BYTES: HTTP 413."""


def http_status(exc: PackstoreError) -> int:
    """The HTTP status ``exc`` answers with."""
    return 413 if isinstance(exc, BodyTooLarge) else HTTP_STATUS.get(exc.grpc_status, 500)


def error_body(exc: PackstoreError) -> dict[str, Any]:
    """OpenAI's error object for ``exc``: its message, type, the request field at fault (``param``) and its code."""
    status = http_status(exc)
    code = exc.fields.get("code", exc.code.lower())
    kind = ERROR_TYPE.get(status, "server_error")
    return {"error": {"message": exc.message, "type": kind, "param": exc.fields.get("param"), "code": code}}


def error_response(exc: PackstoreError) -> JSONResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="packstore"'} if exc.grpc_status == "UNAUTHENTICATED" else None
    return JSONResponse(error_body(exc), status_code=http_status(exc), headers=headers)


class Generation:
    """One answer being generated, as text pieces: the answerer's tokens decoded (``TextDeltas``: up to the first
    stop string), with the whitespace the answer's text is stripped of held back, so the pieces join to the answer."""

    def __init__(self, service: WorkerService, namespace: str, chat: ChatRequest) -> None:
        self.tokens = service.answerer(namespace).stream(chat.question)
        self.stop_ids = service.lm.stop_token_ids
        self.deltas = TextDeltas(service.lm.tokenizer, chat.question.sampling.stop)
        self.result: AnswerResult | None = None
        self.stop_token = False
        self._pieces = self._text_pieces()
        self._turn = threading.Lock()  # one thread at a time advances or closes the pieces

    def next_piece(self) -> str | None:
        """The next piece of text (blocking: generation runs here), or None once the answer is whole."""
        with self._turn:
            return next(self._pieces, None)

    def run_to_end(self) -> None:
        """Generate the whole answer (``result`` is set after)."""
        while self.next_piece() is not None:
            pass

    def close(self) -> None:
        """Stop generating (waiting for a piece another thread is computing), freeing the model for the next request."""
        with self._turn:
            self._pieces.close()

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stop_token or self.deltas.stopped else "length"

    def _text_pieces(self) -> Generator[str, None, None]:
        """The answer's text in pieces as it is generated (some empty); ``result`` is set once they end. Closing it
        early stops generation."""
        pending, started = "", False
        try:
            for piece in self._raw():
                text = pending + piece if started else (pending + piece).lstrip()
                body = text.rstrip()
                pending, started = text[len(body) :], started or bool(body)
                yield body
        finally:
            self.tokens.close()

    def _raw(self) -> Iterator[str]:
        try:
            while True:
                token = next(self.tokens)
                if token in self.stop_ids:
                    self.stop_token = True
                else:
                    yield self.deltas.add(token)
        except StopIteration as finished:
            self.result = finished.value
        yield self.deltas.rest()

    def usage(self) -> dict[str, int]:
        assert self.result is not None  # (after the pieces ended)
        return usage(self.result, len(self.deltas.ids))


SLOT_SCOPE_KEY = "packstore.slot"


class Slot:
    """One of an ``OpenAIApp``'s ``max_concurrent`` chat-completion slots, taken when made; ``release`` frees it
    once, however often it is called (when the answer is whole, and again when the response ends)."""

    def __init__(self, app: OpenAIApp) -> None:
        self.app, self.held = app, True
        app.in_flight += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.app.in_flight -= 1


class OpenAIApp:
    """The API over ``service`` (``app``, an ASGI app), answering at most ``max_concurrent`` chat completions at once
    (a 429 beyond)."""

    def __init__(self, service: WorkerService, max_concurrent: int = DEFAULT_MAX_CONCURRENT) -> None:
        self.service, self.max_concurrent, self.in_flight = service, max_concurrent, 0
        self.routes = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app: ``routes``, a chat completion holding one of the ``max_concurrent`` slots until its answer is
        whole (before its last bytes are sent, so a client that has read them can ask again at once) or its client has
        gone (and its generation has stopped); none free: 429 at once."""
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.routes(scope, receive, send)
        if self.in_flight >= self.max_concurrent:
            busy = LimitExceeded(f"more than {self.max_concurrent} requests in flight: retry later")
            return await self._done({"method": "ChatCompletions", "protocol": "http"}, time.perf_counter(), busy)(scope, receive, send)
        slot = Slot(self)
        scope[SLOT_SCOPE_KEY] = slot
        try:
            await self.routes(scope, receive, send)
        finally:
            slot.release()

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        try:
            self.service.auth.authenticate(request.headers.items(), "ListModels", "read")
        except PackstoreError as exc:
            return error_response(exc)
        model = {"id": self.service.lm.name, "object": "model", "created": 0, "owned_by": "packstore"}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat_completions(self, request: Request) -> Response:
        start, fields = time.perf_counter(), {"method": "ChatCompletions", "protocol": "http"}
        try:
            principal = self.service.auth.authenticate(request.headers.items(), "ChatCompletions", "read")
            fields |= {"token": principal.token, "namespace": principal.namespace}
            chat = chat_request(await _json(request), self.service.lm.name)
            generation = Generation(self.service, principal.namespace, chat)
            slot: Slot = request.scope[SLOT_SCOPE_KEY]
            if not chat.stream:
                await run_in_threadpool(generation.run_to_end)
                slot.release()
                return self._done(fields, start, None, generation, self._completion(generation))
            first = await run_in_threadpool(generation.next_piece)  # a refusal (unknown pack, mismatch) comes here, as a status
            return StreamingResponse(self._events(generation, slot, first, chat, fields, start), media_type="text/event-stream")
        except PackstoreError as exc:
            return self._done(fields, start, exc)
        except Exception as exc:  # an unexpected failure: a 500 with a message, the server keeps serving
            log.exception("internal error", extra={"fields": {"method": "ChatCompletions"}})
            return self._done(fields, start, PackstoreError(f"internal error: {exc}"))

    def _completion(self, generation: Generation) -> dict[str, Any]:
        assert generation.result is not None
        message = {"role": "assistant", "content": generation.result.answer}
        choice = {"index": 0, "message": message, "finish_reason": generation.finish_reason}
        body = _envelope("chat.completion", self.service.lm.name) | {"choices": [choice], "usage": generation.usage()}
        return body | {"packstore": packstore_fields(generation.result)}

    async def _events(
        self, generation: Generation, slot: Slot, first: str | None, chat: ChatRequest, fields: dict, start: float
    ) -> AsyncIterator[str]:
        """The answer as server-sent events: a role chunk, the text chunks, the finish chunk (with the ``packstore``
        object), with ``include_usage`` a chunk of usage and packstore, then ``[DONE]``; a failure midway is an error
        event. The slot frees once the answer is whole, before those last chunks; a client gone midway cancels this
        (Starlette): generation stops before the slot frees."""
        envelope = _envelope("chat.completion.chunk", self.service.lm.name)

        def chunk(delta: dict[str, str], finish: str | None = None, **extra: Any) -> str:
            return _event(envelope | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]} | extra)

        failure: PackstoreError | None = None
        try:
            yield chunk({"role": "assistant", "content": ""})
            piece = first
            while piece is not None:
                if piece:
                    yield chunk({"content": piece})
                piece = await run_in_threadpool(generation.next_piece)
            assert generation.result is not None
            slot.release()
            summary = packstore_fields(generation.result)
            yield chunk({}, generation.finish_reason, packstore=summary)
            if chat.include_usage:
                yield _event(envelope | {"choices": [], "usage": generation.usage(), "packstore": summary})
            yield "data: [DONE]\n\n"
        except PackstoreError as exc:
            failure = exc
            yield _event(error_body(exc))
        finally:
            with CancelScope(shield=True):  # (cancelled when the client goes: the clean-up must still run)
                await run_in_threadpool(generation.close)
            slot.release()
            self._done(fields, start, failure, generation)

    def _done(
        self, fields: dict, start: float, failure: PackstoreError | None, generation: Generation | None = None, body: dict | None = None
    ) -> JSONResponse:
        """Log and count a finished request (as the gRPC Generate is); its response: ``body``, or ``failure``'s error."""
        seconds = time.perf_counter() - start
        fields["ms"] = round(seconds * 1000, 2)
        if failure is not None:
            fields |= {"code": failure.grpc_status, "error": str(failure)}
        elif generation is not None and generation.result is not None:
            result = generation.result
            fields |= {"code": "OK", "key": result.pack, "cache_hit": result.cache_hit, "tokens": len(generation.deltas.ids)}
        else:  # the client went before the answer was whole
            fields |= {"code": "CANCELLED", "tokens": len(generation.deltas.ids) if generation is not None else 0}
        log.info("ChatCompletions", extra={"fields": fields})
        self.service.metrics.record(fields.get("namespace", ""), "ChatCompletions", fields["code"], seconds)
        return error_response(failure) if failure is not None else JSONResponse(body)


async def _json(request: Request) -> object:
    """The request's JSON body, read up to MAX_BODY_BYTES (BodyTooLarge past it, InvalidInput when it is not JSON)."""
    too_large = BodyTooLarge(f"the request body is over {MAX_BODY_BYTES} bytes", param="body", code="request_too_large")
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"the body is not JSON: {exc}", param="body") from None


def _envelope(kind: str, model: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class HttpServer:
    """uvicorn serving the app on a daemon thread; ``listening`` is HOST:PORT where it listens."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket) -> None:
        self.server, self.listening = server, "{}:{}".format(*sock.getsockname()[:2])
        self.thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="packstore-http", daemon=True)

    def stop(self, grace_seconds: float) -> None:
        """Refuse new connections and give the requests in flight up to ``grace_seconds`` to finish."""
        self.server.should_exit = True
        self.thread.join(grace_seconds + 1)


def serve_http(
    address: str, app: OpenAIApp, *, tls_cert: str = "", tls_key: str = "", tls_client_ca: str = "", grace_seconds: float = 30.0
) -> HttpServer:
    """Serve ``app`` at ``address`` (by the metrics port's rules: no host means loopback) on a thread, HTTPS with
    ``tls_cert``/``tls_key`` (client certificates signed by ``tls_client_ca`` required with it); returns once it
    takes requests. InvalidInput when the address or the TLS files are unusable."""
    host, port = metrics_address(address, "http")
    config = uvicorn.Config(
        app.app, interface="asgi3", log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=int(grace_seconds),
        ssl_certfile=tls_cert or None, ssl_keyfile=tls_key or None, ssl_ca_certs=tls_client_ca or None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca else ssl.CERT_NONE,
    )
    try:
        config.load()
    except (OSError, ssl.SSLError) as exc:
        raise InvalidInput(f"cannot load the TLS files {tls_cert}, {tls_key}: {exc}") from None
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidInput(f"cannot listen on {host}:{port} for HTTP: {exc.strerror or exc}") from None
    served = HttpServer(uvicorn.Server(config), sock)
    served.thread.start()
    deadline = time.monotonic() + STARTUP_SECONDS
    while not served.server.started and served.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not served.server.started:
        raise InvalidInput(f"the HTTP server on {served.listening} did not start")
    return served
