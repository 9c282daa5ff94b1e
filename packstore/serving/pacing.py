"""A minimum read rate for server streams: a client that stops reading loses its stream, and the thread it held.

gRPC gives a server stream no deadline of its own, and HTTP/2 flow control makes the thread that sends to a client
that does not read wait for as long as the client likes. ``StreamWatch`` lets a stream spend at most ``seconds``
plus one second per ``rate`` bytes it sent waiting for its client to take its messages, the bulk port's rule
(``service/bulk.py``). Only the wait for the client counts: time the server spends making the next message (reading
the store, generating a token) is its own. One daemon thread watches every stream of a server and cancels one
past its allowance, with a log line naming the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

STREAM_SECONDS = 60.0  # the wait any stream is allowed, before its bytes earn more
STREAM_RATE = 16 << 20  # bytes per second: the slowest reader a stream waits for
CHECK_SECONDS = 0.25  # how often the watch looks

Message = TypeVar("Message")


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class WatchedStream:
    """One watched stream: the bytes it sent, the time it spent waiting for its client, since when it waits now."""

    def __init__(self, context: Cancellable, fields: dict[str, Any]) -> None:
        self.context, self.fields = context, fields
        self.sent = 0
        self.waited = 0.0
        self.waiting_since: float | None = None

    def sending(self, size: int) -> None:
        """A message of ``size`` bytes goes to the client: the wait for it to be taken begins."""
        self.sent += size
        self.waiting_since = time.monotonic()

    def taken(self) -> None:
        """The client took it (or the server may send the next): the wait ends."""
        if self.waiting_since is not None:
            self.waited += time.monotonic() - self.waiting_since
            self.waiting_since = None


class StreamWatch:
    """Cancels the server streams (``paced``) whose clients take their messages slower than the rule allows."""

    def __init__(self, log: logging.Logger, seconds: float = STREAM_SECONDS, rate: int = STREAM_RATE) -> None:
        self.log, self.seconds, self.rate = log, seconds, rate
        self._streams: set[WatchedStream] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def rule(self) -> str:
        return f"a stream may wait {self.seconds:g} s plus 1 s per {self.rate >> 20} MiB it sends for its client to read"

    def paced(
        self, context: Cancellable, messages: Iterator[Message], fields: dict[str, Any], size: Callable[[Message], int]
    ) -> Iterator[Message]:
        """``messages`` as they are sent, the stream cancelled if its client reads too slowly; ``fields``: the call's
        log fields (who, what), which the cancellation's log line repeats and marks ``slow_reader``."""
        with self.watching(context, fields) as stream:
            for message in messages:
                stream.sending(size(message))
                yield message  # gRPC sends it, waiting for the client's flow control, before asking for the next
                stream.taken()

    @contextmanager
    def watching(self, context: Cancellable, fields: dict[str, Any]) -> Iterator[WatchedStream]:
        """A stream watched while the context runs, for a server that sends by itself (the HTTP API): it marks each
        message's wait with ``sending`` and ``taken``; ``context`` is cancelled once it is past the rule."""
        stream = WatchedStream(context, fields)
        with self._lock:
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="packstore-stream-watch", daemon=True)
                self._thread.start()
        try:
            yield stream
        finally:
            with self._lock:
                self._streams.discard(stream)

    def _watch(self) -> None:
        while True:
            time.sleep(CHECK_SECONDS)
            now = time.monotonic()
            with self._lock:
                late = [s for s in self._streams if self._overdue(s, now)]
                self._streams.difference_update(late)
            for stream in late:
                stream.fields["slow_reader"] = True
                self.log.warning("stream cancelled: its client reads too slowly", extra={"fields": stream.fields | {
                    "bytes_sent": stream.sent, "rule": self.rule(),
                }})
                stream.context.cancel()

    def _overdue(self, stream: WatchedStream, now: float) -> bool:
        since = stream.waiting_since
        return since is not None and stream.waited + (now - since) > self.seconds + stream.sent / self.rate
