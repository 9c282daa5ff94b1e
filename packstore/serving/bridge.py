"""Synchronous servicers on the asyncio gRPC server: each method becomes a coroutine that checks the call's token and
shares (``Admission``) from its metadata, holding no thread, and only then runs the synchronous handler on a thread
pool, with ``SyncContext`` standing in for gRPC's context. A server stream's next message is made on the pool only
after the previous one was written, and a client stream's messages are awaited on the event loop: so a thread is
held only while the servicer's own code runs, never while a client is slow to send or to read (except by a handler
reading its request stream, which it does after its token and its transfer slot are checked)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Executor
from contextlib import ExitStack
from typing import Any, NoReturn

import grpc

from packstore.errors import PackstoreError
from packstore.rpc.status import rich_status
from packstore.serving.admission import Admission

_END = object()  # a stream has no more messages
CHEAP_WAIT_SECONDS = 10.0  # the longest a cheap call waits its turn for a cheap-call thread before it is refused
ASK_AGAIN_SECONDS = 0.05  # a waiting cheap call asks again at least this often (its ask stays remembered meanwhile)


class Aborted(grpc.RpcError):
    """Raised in a handler's thread by ``SyncContext.abort``: the call ends with ``status``, as grpc's own abort does."""

    def __init__(self, status: grpc.Status) -> None:
        super().__init__(status.details)
        self.status = status


class Cancelled(grpc.RpcError):
    """Raised by a request stream that was cancelled (``SyncContext.cancel``) while its handler read it."""


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


class SyncContext:
    """What the synchronous servicers use of a call's context, over the asyncio one: metadata, peer, abort, whether
    it is still active, and ``cancel`` (from any thread: the stream watch, an upload's deadline), which stops the
    call's wait for its client and ends it CANCELLED."""

    def __init__(self, context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop) -> None:
        self.context, self.loop = context, loop
        self.cancelled = False
        self._waiting: asyncio.Future[Any] | concurrent.futures.Future[Any] | None = None  # the wait for the client
        self._callbacks: list[Callable[[], object]] | None = []  # None once the call has terminated
        self._callbacks_lock = threading.Lock()

    def invocation_metadata(self) -> Any:
        return self.context.invocation_metadata()

    def peer(self) -> str:
        return self.context.peer()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(_Status(code, details))

    def abort_with_status(self, status: grpc.Status) -> None:
        raise Aborted(status)

    def is_active(self) -> bool:
        return not self.cancelled and not self.context.done()

    def cancel(self) -> None:
        self.cancelled = True
        waiting = self._waiting
        if isinstance(waiting, concurrent.futures.Future):
            waiting.cancel()  # a handler's thread reading the request stream
        elif waiting is not None:
            self.loop.call_soon_threadsafe(waiting.cancel)  # a write waiting for the client to read
        self.terminate()

    def add_callback(self, callback: Callable[[], object]) -> bool:
        """Have ``callback`` run when the call terminates: it ends, is cancelled, or its client goes away, at once,
        even while the handler's thread is still busy (so a generation can stop within a step); False if the call
        has terminated already (as gRPC's ``add_callback``)."""
        with self._callbacks_lock:
            if self._callbacks is None:
                return False
            self._callbacks.append(callback)
            return True

    def terminate(self) -> None:
        """Run the callbacks registered (once; later calls do nothing)."""
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for callback in callbacks:
            callback()

    async def write(self, message: object) -> None:
        """Send ``message`` when the client takes it; asyncio.CancelledError if the call is cancelled meanwhile."""
        self._waiting = writing = asyncio.ensure_future(self.context.write(message))
        if self.cancelled:
            writing.cancel()
        try:
            await writing
        finally:
            self._waiting = None

    def requests(self, messages: AsyncIterator[Any]) -> Iterator[Any]:
        """The request stream for a handler's thread: each message awaited on the event loop; Cancelled once the
        call is cancelled."""
        while True:
            waiting = asyncio.run_coroutine_threadsafe(anext(messages, _END), self.loop)
            self._waiting = waiting
            if self.cancelled:
                waiting.cancel()
            try:
                message = waiting.result()
            except concurrent.futures.CancelledError:
                raise Cancelled("the call was cancelled") from None
            finally:
                self._waiting = None
            if message is _END:
                return
            yield message


class Bridge:
    """Wraps a synchronous servicer's method handlers for the asyncio server: ``admission`` decides each call, heavy
    methods (``admission.heavy``) run on ``transfers``, the others on ``cheap``."""

    def __init__(self, admission: Admission, transfers: Executor, cheap: Executor) -> None:
        self.admission, self.transfers, self.cheap = admission, transfers, cheap
        self._freed: asyncio.Event | None = None  # set when a cheap-call thread is given back (made on the loop)

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` (a synchronous method, unary or streaming on one side) as the asyncio server runs it."""
        pool = self.transfers if method in self.admission.heavy else self.cheap
        kind, behaviour = _behaviour(handler)

        def body(request: Any, sync: SyncContext) -> Awaitable[Any]:
            if kind == "unary_unary":
                return _run(pool, behaviour, request, sync, cancelled=sync.terminate)
            if kind == "stream_unary":
                return _run(pool, behaviour, sync.requests(request), sync, cancelled=sync.terminate)
            if kind == "unary_stream":
                return _send(pool, behaviour(request, sync), sync)
            raise ValueError(f"{method}: a bidirectional stream has no synchronous bridge")

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                held, key = self.admission.admit(method, context.invocation_metadata(), context.peer())
            except PackstoreError as exc:
                await _abort(context, rich_status(exc))
            ending: grpc.Status | None = None
            with held:
                if method not in self.admission.heavy:
                    refusal = await self._cheap_thread(method, key, held, context)
                    if refusal is not None:
                        ending = rich_status(refusal)
                if ending is None:
                    sync = SyncContext(context, asyncio.get_running_loop())
                    try:
                        return await body(request, sync)
                    except Aborted as exc:
                        ending = exc.status
                    except grpc.RpcError:
                        if not sync.cancelled:
                            raise
                        ending = _Status(grpc.StatusCode.CANCELLED, "the call was cancelled")
                    finally:
                        sync.terminate()
            # The call's units go back before its status is sent: a client that reads nothing (a stream the watch
            # cancelled) may keep the status from being sent for as long as it keeps its connection, but then holds
            # none of the shares. Aborted outside the except clauses, the abort carries no context whose traceback
            # would keep the handler's frames, and the store transactions they held, alive until the cycle collector.
            await _abort(context, ending)

        return _FACTORIES[kind](call, handler.request_deserializer, handler.response_serializer)

    async def _cheap_thread(self, method: str, key: str, held: ExitStack, context: grpc.aio.ServicerContext) -> PackstoreError | None:
        """Wait, on the event loop (no thread held), for a unit of the cheap-call threads for ``key``, in the share
        rule's order (the callers holding fewest first, then those asking longest), at most CHEAP_WAIT_SECONDS or the
        call's own deadline; the unit goes back to the share, waking the waiters, when ``held`` closes. A caller past
        that wait is refused, naming its own use (a burst of cheap calls queues; only a flood that never drains is
        turned away): None once it holds one, else the refusal."""
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        deadline = loop.time() + min(CHEAP_WAIT_SECONDS, remaining if remaining is not None else CHEAP_WAIT_SECONDS)
        cheap = self.admission.cheap
        while not cheap.try_take(key):
            if loop.time() >= deadline:
                refusal = cheap.refused(key, method)
                self.admission.refused(method, refusal, context.peer())
                return refusal
            freed = self._freed = self._freed or asyncio.Event()
            try:
                await asyncio.wait_for(freed.wait(), min(ASK_AGAIN_SECONDS, max(0.0, deadline - loop.time())))
            except TimeoutError:
                pass
        held.callback(self._give_back_cheap, key)
        return None

    def _give_back_cheap(self, key: str) -> None:
        """Return ``key``'s cheap-call thread and wake the calls waiting for one (on the event loop's thread)."""
        self.admission.cheap.give_back(key)
        freed, self._freed = self._freed, None
        if freed is not None:
            freed.set()

    def wrap_anonymous(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """An asyncio handler of the health or reflection service (a coroutine, or an async generator), holding its
        caller's host's unit of their share while it runs."""
        kind, behaviour = _behaviour(handler)

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                held = self.admission.admit_anonymous(method, context.peer())
            except PackstoreError as exc:
                await _abort(context, rich_status(exc))
            with held:
                result = behaviour(request, context)
                if not inspect.isasyncgen(result):
                    return await result
                async for message in result:
                    await context.write(message)
                return None

        return _FACTORIES[kind](call, handler.request_deserializer, handler.response_serializer)


_FACTORIES: dict[str, Callable[..., grpc.RpcMethodHandler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _behaviour(handler: grpc.RpcMethodHandler) -> tuple[str, Callable[..., Any]]:
    """Which kind of method ``handler`` is, and its function."""
    for kind in _FACTORIES:
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            return kind, behaviour
    raise ValueError("a method handler without a behaviour")


async def _abort(context: grpc.aio.ServicerContext, status: grpc.Status) -> NoReturn:
    """End the call with ``status`` (raises, as the context's abort does)."""
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("a call's abort returned")  # (grpc.aio's abort raises; its stubs do not say so)


async def _run(pool: Executor, handler: Callable[..., Any], *args: Any, cancelled: Callable[[], None] | None = None) -> Any:
    """``handler(*args)`` on ``pool``; if the call is cancelled meanwhile (its client gone), ``cancelled`` runs at
    once (the call's callbacks: a generation told to stop), then the handler is waited for (its units are given back
    only once its thread is free) and the cancellation passed on."""
    running = asyncio.get_running_loop().run_in_executor(pool, handler, *args)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        if cancelled is not None:
            cancelled()
        await asyncio.wait([running])
        raise
    finally:
        # the future holds the handler's exception, whose traceback holds this frame: a cycle that would keep the
        # handler's frames (and the LMDB read transactions, each a reader slot, that they held) until the cycle
        # collector ran; long fuzz runs filled all 126 reader slots so
        del running


async def _send(pool: Executor, messages: Iterator[Any], sync: SyncContext) -> None:
    """Write ``messages``, each made on ``pool`` once the one before it was written; a stream cancelled or ended
    early closes the generator on the pool (its cleanup runs as in a synchronous server), then ends CANCELLED."""
    try:
        while (message := await _run(pool, next, messages, _END, cancelled=sync.terminate)) is not _END:
            await sync.write(message)
    except asyncio.CancelledError:
        if not sync.cancelled:
            raise  # the client went away: nothing more to send
        raise Cancelled("the stream was cancelled") from None
    finally:
        close = getattr(messages, "close", None)
        if close is not None:
            await _run(pool, close)
