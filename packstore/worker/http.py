"""The worker's OpenAI-compatible HTTP API (``packstore worker --http``): Starlette on uvicorn, in a thread of the
worker process beside its gRPC server, answering through the same ``WorkerService`` Answerers, so an answer here is
the worker's answer (text and tokens) to the same pack, question and sampling.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (whole, or as server-sent events ending ``data: [DONE]``),
``GET /v1/models``, ``GET /health``. Callers, tokens and namespaces are the gRPC ones (``Auth.authenticate`` over the
HTTP headers); a completion holds one of the worker's generation slots (``WorkerService.slots``, shared with gRPC
``Generate`` and fair among principals: security/shares.py), taken only once its caller is authenticated and its
body has arrived. Slow or stalled clients are cut off: headers (``HEADER_SECONDS``, worker/http_connections.py) and
bodies (``BODY_SECONDS``, 408) each have a deadline, every response is read at the minimum rate of gRPC's streams
(the worker's ``StreamWatch``: ``stream_seconds`` in all plus 1 s per 16 MiB, serving/pacing.py) or cut, freeing its
slot, and a client gone midway stops its generation within one token. Connections are capped in all and per host
(``HTTP_CONNECTIONS``, ``HTTP_CONNECTIONS_PER_PEER``), refused past that with 503.
Errors are OpenAI's ``{"error": {...}}`` with the status of ``HTTP_STATUS``, unknown paths and
methods included. docs/protocol.md, "OpenAI-compatible HTTP API", is the reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import ssl
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import uvicorn
from anyio import CancelScope
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from packstore.answering.records import AnswerResult
from packstore.errors import InvalidInput, PackstoreError
from packstore.kv.device import Cancel, Left
from packstore.kv.inject import TextDeltas
from packstore.security.auth import Auth, Principal
from packstore.security.shares import Shares, principal_key
from packstore.serving.connections import HTTP_CONNECTIONS, HTTP_CONNECTIONS_PER_PEER, peer_of
from packstore.serving.metrics_http import metrics_address
from packstore.serving.pacing import StreamWatch, WatchedStream
from packstore.worker.chat import ChatRequest, chat_request, completion_request, packstore_fields, usage
from packstore.worker.http_connections import ConnectionGuard
from packstore.worker.worker_metrics import WorkerMetrics

if TYPE_CHECKING:
    from packstore.answering.answer import Answers
    from packstore.kv.models import ModelSide

MAX_BODY_BYTES = 8 << 20  # a request body past this is refused (413) before it is read whole
BODY_SECONDS = 30.0  # a request body must arrive within this, once its headers have (else 408)
HEADER_SECONDS = 30.0  # a request's line and headers must arrive within this of the connection or of the last response
STARTUP_SECONDS = 10.0
HTTP_STATUS = {  # a PackstoreError's gRPC status -> the HTTP status it answers with
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
    "DEADLINE_EXCEEDED": 408, "RESOURCE_EXHAUSTED": 429, "INTERNAL": 500, "DATA_LOSS": 500, "UNAVAILABLE": 503,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "invalid_request_error"}
ERROR_TYPE |= {405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
# (every other status: server_error)
CANCELLED_STATUS = 499  # the response to a client that has gone (nobody reads it): nginx's "client closed request"
log = logging.getLogger("packstore.worker")


class HttpBackend(Protocol):
    """What the HTTP API needs of the worker (``server.WorkerService``, which starts it): its model, callers' tokens,
    metrics, generation slots, the watch of slow readers, and what answers a namespace's questions."""

    @property
    def lm(self) -> ModelSide: ...

    auth: Auth
    metrics: WorkerMetrics
    slots: Shares
    watch: StreamWatch

    def answerer(self, namespace: str) -> Answers: ...


class BodyTooLarge(InvalidInput):
    """A request body longer than MAX_BODY_BYTES: HTTP 413."""

    http_status = 413


class BodyTimeout(PackstoreError):
    """A request body that did not arrive within its deadline: HTTP 408."""

    code = "REQUEST_TIMEOUT"
    grpc_status = "DEADLINE_EXCEEDED"


@dataclass(frozen=True)
class LoopCancel:
    """The watch's handle on one response (``Cancellable``): the watch runs on a thread of its own, the response on
    the event loop, where ``scope`` is cancelled."""

    loop: asyncio.AbstractEventLoop
    scope: CancelScope

    def cancel(self) -> None:
        with contextlib.suppress(RuntimeError):  # (the loop has closed: the response is over anyway)
            self.loop.call_soon_threadsafe(self.scope.cancel)


def http_status(exc: PackstoreError) -> int:
    """The HTTP status ``exc`` answers with."""
    return getattr(exc, "http_status", None) or HTTP_STATUS.get(exc.grpc_status, 500)


def error_body(exc: PackstoreError) -> dict[str, Any]:
    """OpenAI's error object for ``exc``: its message, type, the request field at fault (``param``) and its code."""
    status = http_status(exc)
    code = exc.fields.get("code", exc.code.lower())
    return _error(exc.message, status, code, exc.fields.get("param"))


def _error(message: str, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param, "code": code}}


def error_response(exc: PackstoreError) -> JSONResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="packstore"'} if exc.grpc_status == "UNAUTHENTICATED" else {}
    if isinstance(exc, BodyTimeout):
        headers["Connection"] = "close"  # (the rest of the body may still come: it must not be read as a request)
    if "retry_after_seconds" in exc.fields:  # a share refused: Retry-After counts whole seconds (RFC 9110 §10.2.3)
        headers["Retry-After"] = str(math.ceil(float(exc.fields["retry_after_seconds"])))
    return JSONResponse(error_body(exc), status_code=http_status(exc), headers=headers or None)


class Generation:
    """One answer being generated, as text pieces: the answerer's tokens decoded (``TextDeltas``: up to the first
    stop string), with the whitespace the answer's text is stripped of held back, so the pieces join to the answer."""

    def __init__(self, service: HttpBackend, namespace: str, asked: ChatRequest) -> None:
        self.cancel = Cancel()  # cancelled once the client has gone: the generation stops within a step (Left)
        self.tokens = service.answerer(namespace).stream(asked.question, self.cancel)
        self.stop_ids = service.lm.stop_token_ids
        self.deltas = TextDeltas(service.lm.tokenizer, asked.question.sampling.stop)
        self.result: AnswerResult | None = None
        self.stop_token = False
        self._pieces = self._text_pieces()
        self._turn = threading.Lock()  # one thread at a time advances or closes the pieces

    def next_piece(self) -> str | None:
        """The next piece of text (blocking: generation runs here), or None once the answer is whole."""
        with self._turn:
            return next(self._pieces, None)

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


@dataclass(frozen=True)
class Shape:
    """How one generating endpoint reads its body and writes its answer: ``method`` (as logged and counted),
    ``parse`` (body, model -> ChatRequest), the ``id`` prefix and the ``object`` of a whole answer and of a chunk."""

    method: str
    parse: Callable[[object, str], ChatRequest]
    prefix: str
    whole: str
    chunk: str

    def envelope(self, model: str, streamed: bool) -> dict[str, Any]:
        kind = self.chunk if streamed else self.whole
        return {"id": f"{self.prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}

    def answer(self, text: str, finish: str) -> dict[str, Any]:
        """The one choice of a whole answer."""
        if self.whole == "chat.completion":
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

    def piece(self, text: str | None, finish: str | None = None) -> dict[str, Any]:
        """The choice of one chunk: ``text`` (None: none, as in the finish chunk)."""
        if self.whole == "chat.completion":
            return {"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish}
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

    @property
    def opening(self) -> dict[str, Any] | None:
        """The choice of the chunk that opens a stream, if this shape has one (chat's role)."""
        if self.whole == "chat.completion":
            return {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return None


CHAT = Shape("ChatCompletions", chat_request, "chatcmpl", "chat.completion", "chat.completion.chunk")
COMPLETION = Shape("Completions", completion_request, "cmpl", "text_completion", "text_completion")
GENERATING = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}  # POST paths that take a generation slot
CALL_SCOPE_KEY = "packstore.call"


class GeneratingRequest:
    """One generating request (a chat completion or a completion): its log fields, the generation slot it holds for
    its principal (``share``), its Generation; logged and counted once however it ends (``finish``)."""

    def __init__(self, service: HttpBackend, shape: Shape) -> None:
        self.service, self.shape = service, shape
        self.start = time.perf_counter()
        self.fields: dict[str, Any] = {"method": shape.method, "protocol": "http"}
        self.share: str | None = None
        self.generation: Generation | None = None
        self.events: AsyncGenerator[str, None] | None = None  # a streamed answer's events, once the response streams them
        self.logged = False

    def take_slot(self, share: str) -> None:
        """Take a generation slot for the principal ``share``: LimitExceeded (429) when the rule refuses it."""
        if not self.service.slots.try_take(share):
            raise self.service.slots.refused(share, self.shape.method)
        self.share = share

    def release(self) -> None:
        """Free the slot (once, however often called): when the answer is whole, or the generation has stopped."""
        if self.share is not None:
            self.service.slots.give_back(self.share)
            self.share = None

    async def stop(self) -> None:
        """Stop the generation (waiting for a token being computed: within one token), then free the slot."""
        if self.generation is not None:
            self.generation.cancel.cancel()
            with CancelScope(shield=True):  # (also when cancelled because the client went: the clean-up must run)
                await run_in_threadpool(self.generation.close)
        self.release()

    async def end(self) -> None:
        """Once the response has ended, however it ended: its events closed (a stream left midway by a client that
        stopped reading is never closed by Starlette), the generation stopped, the slot free, the call logged."""
        if self.events is not None:
            with CancelScope(shield=True):
                await self.events.aclose()
        await self.stop()
        self.finish()

    def finish(self, failure: PackstoreError | None = None) -> None:
        """Log and count the call, once (as the gRPC Generate is): ``failure``'s code, OK with a whole answer, else
        CANCELLED (the client went first) with the tokens generated until then."""
        if self.logged:
            return
        self.logged = True
        seconds = time.perf_counter() - self.start
        fields, generation = self.fields, self.generation
        fields["ms"] = round(seconds * 1000, 2)
        if failure is not None:
            fields |= {"code": failure.grpc_status, "error": str(failure)}
        elif generation is not None and generation.result is not None:
            result = generation.result
            fields |= {"code": "OK", "key": result.pack, "cache_hit": result.cache_hit, "tokens": len(generation.deltas.ids)}
        else:
            fields |= {"code": "CANCELLED", "tokens": len(generation.deltas.ids) if generation is not None else 0}
        log.info(self.shape.method, extra={"fields": fields})
        self.service.metrics.record(fields.get("namespace", ""), self.shape.method, fields["code"], seconds)

    def failed(self, failure: PackstoreError) -> JSONResponse:
        self.finish(failure)
        return error_response(failure)


class OpenAIApp:
    """The API over ``service`` (``app``, an ASGI app). A request body must arrive within ``body_seconds``, and every
    response be read at the rate of ``service.watch``."""

    def __init__(self, service: HttpBackend, *, body_seconds: float = BODY_SECONDS) -> None:
        self.service, self.body_seconds = service, body_seconds
        self.routes = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={404: self.unknown_path, 405: self.wrong_method},
        )

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app: ``routes``, each response watched by ``service.watch`` (a client reading it too slowly has it
        cut, its connection closed and the cancellation logged naming it); each generating request a
        ``GeneratingRequest``, whose generation is stopped, slot freed and line logged once its response has ended,
        however it ended (``slow_reader: true`` when the watch cut it)."""
        if scope["type"] != "http":
            return await self.routes(scope, receive, send)
        shape = GENERATING.get(scope["path"]) if scope["method"] == "POST" else None
        call = scope[CALL_SCOPE_KEY] = GeneratingRequest(self.service, shape) if shape is not None else None
        fields = call.fields if call is not None else {"method": f"{scope['method']} {scope['path']}", "protocol": "http"}
        fields["peer"] = peer_of(*(scope.get("client") or ("", 0)))
        cut = CancelScope()  # (left unfinished, the response's connection is closed by uvicorn)
        try:
            with self.service.watch.watching(LoopCancel(asyncio.get_running_loop(), cut), fields) as stream, cut:
                await self.routes(scope, _heeding(receive, call) if call is not None else receive, _paced(send, stream))
        finally:
            if call is not None:
                await call.end()

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        try:
            self.service.auth.authenticate(request.headers.items(), "ListModels", "read")
        except PackstoreError as exc:
            return error_response(exc)
        model = {"id": self.service.lm.name, "object": "model", "created": 0, "owned_by": "packstore"}
        return JSONResponse({"object": "list", "data": [model]})

    async def unknown_path(self, request: Request, exc: Exception) -> Response:
        endpoints = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health"
        return JSONResponse(_error(f"unknown path {request.url.path}: this worker serves {endpoints}", 404, "not_found"), 404)

    async def wrong_method(self, request: Request, exc: Exception) -> Response:
        allowed = exc.headers.get("Allow", "") if isinstance(exc, HTTPException) and exc.headers else ""
        allowed = ", ".join(sorted(method.strip() for method in allowed.split(",") if method.strip()))  # (Starlette's order is a set's)
        message = f"{request.method} is not allowed on {request.url.path}: use {allowed}"
        return JSONResponse(_error(message, 405, "method_not_allowed"), 405, headers={"Allow": allowed} if allowed else None)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request)

    async def _generate(self, request: Request) -> Response:
        """One answer, in the order that keeps slots for callers that can use them: authenticate, read the body (under
        its deadline), parse it, and only then take a slot; whole (the client checked for between tokens) or streamed."""
        call: GeneratingRequest = request.scope[CALL_SCOPE_KEY]
        try:
            principal = self.service.auth.authenticate(request.headers.items(), call.shape.method, "read")
            call.fields |= {"token": principal.token, "namespace": principal.namespace}
            asked = call.shape.parse(await _json(request, self.body_seconds), self.service.lm.name)
            call.take_slot(self._share(request, principal))
            generation = call.generation = Generation(self.service, principal.namespace, asked)
            if not asked.stream:
                return await self._whole(request, call, generation)
            first = await _next_piece(request, generation)  # a refusal (unknown pack, mismatch) comes here, as a status
            call.events = self._events(call, generation, first, asked)
            return StreamingResponse(call.events, media_type="text/event-stream")
        except ClientDisconnect:  # the client went while sending its body
            call.finish()
            return Response(status_code=CANCELLED_STATUS)
        except Left:  # the client went while its answer was generated (or compared): stopped within a step
            await call.stop()
            call.finish()
            return Response(status_code=CANCELLED_STATUS)
        except PackstoreError as exc:
            await call.stop()  # (the slot frees before the client reads the error, and may ask again at once)
            return call.failed(exc)
        except Exception as exc:  # an unexpected failure: a 500 with a message, the server keeps serving
            log.exception("internal error", extra={"fields": {"method": call.shape.method}})
            await call.stop()
            return call.failed(PackstoreError(f"internal error: {exc}"))

    def _share(self, request: Request, principal: Principal) -> str:
        """Whom the call's slot counts for: the token's name with tokens, else the client's host, written as a gRPC
        peer is, so that one host is one principal on both ports."""
        return principal_key(principal.token, self.service.auth.enabled, peer_of(*(request.client or ("", 0))))

    async def _whole(self, request: Request, call: GeneratingRequest, generation: Generation) -> Response:
        """The whole answer, generated piece by piece; a client gone meanwhile stops it (within one step: Left, which
        ``_generate`` answers), frees its slot and logs it CANCELLED. The slot frees when the answer is whole, before
        it is sent."""
        while (await _next_piece(request, generation)) is not None:
            pass
        call.release()
        call.finish()
        result = generation.result
        assert result is not None
        choice = call.shape.answer(result.answer, generation.finish_reason)
        body = call.shape.envelope(self.service.lm.name, False) | {"choices": [choice], "usage": generation.usage()}
        return JSONResponse(body | {"packstore": packstore_fields(result)})

    async def _events(
        self, call: GeneratingRequest, generation: Generation, first: str | None, asked: ChatRequest
    ) -> AsyncGenerator[str, None]:
        """The answer as server-sent events: chat's role chunk, the text chunks, the finish chunk (with the
        ``packstore`` object), with ``include_usage`` a chunk of usage and packstore, then ``[DONE]``; a failure midway is
        an error event. The slot frees once the answer is whole, before those last chunks; a client gone midway cancels
        this (Starlette): generation stops before the slot frees."""
        shape, envelope = call.shape, call.shape.envelope(self.service.lm.name, True)
        failure: PackstoreError | None = None
        try:
            if shape.opening is not None:
                yield _event(envelope | {"choices": [shape.opening]})
            piece = first
            while piece is not None:
                if piece:
                    yield _event(envelope | {"choices": [shape.piece(piece)]})
                piece = await run_in_threadpool(generation.next_piece)
            assert generation.result is not None
            call.release()
            summary = packstore_fields(generation.result)
            yield _event(envelope | {"choices": [shape.piece(None, generation.finish_reason)], "packstore": summary})
            if asked.include_usage:
                yield _event(envelope | {"choices": [], "usage": generation.usage(), "packstore": summary})
            yield "data: [DONE]\n\n"
        except PackstoreError as exc:
            failure = exc
            yield _event(error_body(exc))
        except Left:  # the client has gone (``_heeding``): nothing more is sent
            pass
        finally:
            await call.stop()
            call.finish(failure)


def _heeding(receive: Receive, call: GeneratingRequest) -> Receive:
    """``receive``, cancelling the call's generation as soon as it reports its client gone (Starlette listens for that
    while a response streams; ``_next_piece`` while a piece is computed), so the generation stops within a step even
    while its next piece is being computed (the comparisons of compare_rag, say)."""

    async def heeded() -> Message:
        message = await receive()
        if message["type"] == "http.disconnect" and call.generation is not None:
            call.generation.cancel.cancel()
        return message

    return heeded


async def _next_piece(request: Request, generation: Generation) -> str | None:
    """``generation``'s next piece, computed in a thread while the client's going is listened for (``_heeding``); what
    the piece raises is raised as it is (not in a task group's ExceptionGroup)."""
    failure: Exception | None = None
    piece = None
    async with anyio.create_task_group() as group:

        async def listen() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        group.start_soon(listen)
        try:
            piece = await run_in_threadpool(generation.next_piece)
        except Exception as exc:
            failure = exc
        group.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return piece


async def _json(request: Request, seconds: float) -> object:
    """The request's JSON body, read up to MAX_BODY_BYTES within ``seconds`` (BodyTooLarge past it, BodyTimeout when it
    has not all come by then, InvalidInput when it is not JSON)."""
    too_large = BodyTooLarge(f"the request body is over {MAX_BODY_BYTES} bytes", param="body", code="request_too_large")
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    with anyio.move_on_after(seconds) as waited:
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise too_large
    if waited.cancelled_caught:
        raise BodyTimeout(f"the request body did not arrive within {seconds:g} s", param="body", code="request_timeout")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"the body is not JSON: {exc}", param="body") from None


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _paced(send: Send, stream: WatchedStream) -> Send:
    """``send``, its waits for the client (its connection full: uvicorn waits to write) counted by ``stream``."""

    async def paced(message: Message) -> None:
        stream.sending(len(message.get("body", b"")))
        try:
            await send(message)
        finally:
            stream.taken()

    return paced


class HttpServer:
    """uvicorn serving the app on a daemon thread; ``listening`` is HOST:PORT where it listens, ``guard`` its connections."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, guard: ConnectionGuard) -> None:
        self.server, self.listening, self.guard = server, "{}:{}".format(*sock.getsockname()[:2]), guard
        self.thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="packstore-http", daemon=True)

    def stop(self, grace_seconds: float) -> None:
        """Refuse new connections and give the requests in flight up to ``grace_seconds`` to finish."""
        self.server.should_exit = True
        self.thread.join(grace_seconds + 1)


def serve_http(
    address: str, app: OpenAIApp, *, tls_cert: str = "", tls_key: str = "", tls_client_ca: str = "", grace_seconds: float = 30.0,
    header_seconds: float = HEADER_SECONDS, connections: int = HTTP_CONNECTIONS, connections_per_peer: int = HTTP_CONNECTIONS_PER_PEER,
) -> HttpServer:
    """Serve ``app`` at ``address`` (by the metrics port's rules: no host means loopback) on a thread, HTTPS with
    ``tls_cert``/``tls_key`` (client certificates signed by ``tls_client_ca`` required with it), at most ``connections``
    at once and ``connections_per_peer`` from one host, closing those whose headers take over ``header_seconds``
    (``ConnectionGuard``); returns once it takes requests. InvalidInput when the address, the caps or the TLS files are
    unusable. Forwarded-for headers are not believed: a caller is the address it connects from."""
    host, port = metrics_address(address, "http")
    guard = ConnectionGuard(connections, connections_per_peer, header_seconds)
    config = uvicorn.Config(
        guard.app(app.app), interface="asgi3", log_config=None, access_log=False, lifespan="off",
        timeout_graceful_shutdown=int(grace_seconds), http=guard.protocol(), proxy_headers=False, backlog=socket.SOMAXCONN,
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
    served = HttpServer(uvicorn.Server(config), sock, guard)
    served.thread.start()
    deadline = time.monotonic() + STARTUP_SECONDS
    while not served.server.started and served.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not served.server.started:
        raise InvalidInput(f"the HTTP server on {served.listening} did not start")
    return served
