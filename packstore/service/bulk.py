"""The service's bulk port: GetPack's chunks sent on a plain TCP (or TLS) connection, or on a local unix socket to a
client on this host, for a ticket GetPack issued.

GetPack authenticates the caller, resolves the pack and checks identities as always, then hands out a ticket
naming exactly what it would have streamed (the namespace and its store, the header, the chunk indices). The bulk
port sends those chunks with one write of framing and one of the stored bytes per chunk: from the namespace's hot
copy of the pack when the service holds one (``packstore.service.hot``: verified when it was written, so neither
read nor hashed again), else read and verified as GetPack's stream does, and written into a new hot copy as they
go when the ticket is for the whole pack. A ticket is single-use and lapses after TICKET_SECONDS: that is the bound
within which a revoked token or a deletion is honoured (a chunk deleted before it is read still fails NOT_FOUND,
unless the pack is hot). The MAX_TICKETS outstanding are shared among the GetPack callers by the rule of
``security/shares.py``, a ticket's unit held until it is presented or lapses, so a caller that takes tickets and
never presents them cannot push the others off the bulk port: past its share, its own GetPacks stream instead.

Nobody without a ticket holds anything for long: one thread waits on every new connection at once until it has
finished any TLS handshake and presented a valid ticket, within HELLO_SECONDS, and only then does the connection
take one of ``max_connections`` transfer slots, shared among principals by the rule of ``security/shares.py``: the
principal is the GetPack caller the ticket was issued to (its token; without tokens, its address), whatever address
or process presents the ticket. Connections awaiting their ticket are bounded per peer (an address for TCP, a process
for the local socket; no principal is known yet) and in all. A transfer must end within ``transfer_seconds`` plus its
bytes at TRANSFER_RATE, or it is cut off.
"""

from __future__ import annotations

import logging
import secrets
import selectors
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import cast

from packstore.errors import InvalidInput, LimitExceeded, PackstoreError, Unauthenticated
from packstore.format import PackHeader
from packstore.format.chunks import Buffer
from packstore.packs.reader import verified_chunks
from packstore.rpc.frames import HELLO, HELLO_SECONDS, MAGIC, TICKET_BYTES, chunk_frame, end_frame, error_frame
from packstore.security.shares import ShareRule, Shares
from packstore.service.hot import HotPacks
from packstore.service.service_metrics import ServiceMetrics
from packstore.serving.pacing import STREAM_RATE, STREAM_SECONDS
from packstore.store.protocol import StreamsChunks
from packstore.v1 import store_pb2

log = logging.getLogger("packstore.service")

TICKET_SECONDS = 30.0  # how long an issued ticket may wait to be used
MAX_TICKETS = 4096  # outstanding at once, shared among principals; past a caller's share its GetPack streams instead
PEER_PENDING = 16  # connections one peer may have awaiting their ticket at once; more are closed on accept
MAX_PENDING = 1024  # connections awaiting their ticket, all peers together
TRANSFER_RATE = STREAM_RATE  # bytes per second: the slowest reader a transfer waits for, as for gRPC streams
METHOD = "GetPack.bulk"  # how transfers appear in logs and metrics
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


@dataclass(frozen=True)
class Transfer:
    """What one ticket entitles its bearer to: these chunks of this pack, from this namespace's store."""

    store: StreamsChunks
    namespace: str
    header: PackHeader
    indices: tuple[int, ...]
    fields: dict[str, object]  # the GetPack call's log fields (token, namespace, key), repeated in the transfer's log line
    principal: str  # whose bulk share it takes (security/shares.principal_key of the GetPack call)
    expires: float  # time.monotonic()


class Tickets:
    """Single-use tickets for transfers, each valid for ``lifetime`` seconds; at most ``limit`` outstanding, shared
    among principals (a ticket holds its principal's unit until it is taken or lapses)."""

    def __init__(self, lifetime: float = TICKET_SECONDS, limit: int = MAX_TICKETS) -> None:
        self.lifetime, self.limit = lifetime, limit
        self.shares = Shares("bulk tickets", ShareRule.default(limit))
        self._transfers: dict[bytes, Transfer] = {}  # in the order issued, which is the order they lapse
        self._lock = threading.Lock()

    def issue(
        self,
        store: StreamsChunks,
        namespace: str,
        header: PackHeader,
        indices: Sequence[int],
        fields: dict[str, object],
        principal: str,
    ) -> bytes:
        """A new ticket for the transfer; LimitExceeded when ``principal`` is past its share of the tickets (the
        caller streams instead)."""
        now = time.monotonic()
        with self._lock:
            self._drop_lapsed(now)
            if not self.shares.try_take(principal):
                raise self.shares.refused(principal, "bulk ticket")
            ticket = secrets.token_bytes(TICKET_BYTES)
            self._transfers[ticket] = Transfer(store, namespace, header, tuple(indices), dict(fields), principal, now + self.lifetime)
            return ticket

    def _drop_lapsed(self, now: float) -> None:
        """Forget the tickets that lapsed, giving their units back (the oldest come first: stop at one still valid)."""
        while self._transfers:
            ticket, transfer = next(iter(self._transfers.items()))
            if transfer.expires > now:
                return
            del self._transfers[ticket]
            self.shares.give_back(transfer.principal)

    def take(self, ticket: bytes) -> Transfer:
        """The ticket's transfer, which it no longer grants; Unauthenticated for one unknown, used or lapsed."""
        with self._lock:
            transfer = self._transfers.pop(bytes(ticket), None)
            if transfer is not None:
                self.shares.give_back(transfer.principal)
        if transfer is None or transfer.expires <= time.monotonic():
            raise Unauthenticated(f"bulk ticket unknown, already used or lapsed (tickets are single-use and last {self.lifetime:g} s)")
        return transfer


def bulk_address(listen: str, bulk_listen: str) -> tuple[str, int] | None:
    """Where the bulk port binds: ``bulk_listen`` (HOST:PORT), or with it empty the gRPC listen host on a free
    port; None when it is ``off`` or the gRPC port is not a TCP address (a unix socket)."""
    if bulk_listen == "off" or (not bulk_listen and listen.startswith("unix:")):
        return None
    host, sep, port = (bulk_listen or listen).rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidInput(f"bad bulk address {bulk_listen or listen!r}: use HOST:PORT, or off")
    return host.strip("[]"), int(port) if bulk_listen else 0


@dataclass(frozen=True)
class Peer:
    """Who is at the other end: ``key`` is what the limits count by, ``name`` what logs show."""

    key: str
    name: str

    @staticmethod
    def of_tcp(address: tuple[str, int] | tuple[str, int, int, int]) -> Peer:
        host, port = address[0], address[1]
        return Peer(host, f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}")

    @staticmethod
    def of_local(conn: socket.socket) -> Peer:
        """The connecting process, from the kernel's credentials of the socket (SO_PEERCRED)."""
        pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        name = f"unix:uid={uid},pid={pid}"
        return Peer(name, name)


@dataclass(eq=False)
class Pending:
    """A connection that has yet to present its ticket, by ``deadline`` (time.monotonic())."""

    conn: socket.socket
    peer: Peer
    local: bool
    deadline: float
    handshaking: bool
    hello: bytearray = field(default_factory=bytearray)


class BulkServer:
    """The bulk port (TCP, and with ``local`` an abstract unix socket that only clients on this host and in this
    network namespace reach). One thread accepts connections and waits for each one's ticket; each admitted
    transfer runs on a thread of its own, at most ``max_connections`` at once, shared among principals (at most
    ``per_principal`` each; 0: ``ShareRule.default``'s).
    ``hot``: the service's hot packs, which transfers read from and add to."""

    def __init__(
        self,
        address: tuple[str, int],
        tickets: Tickets,
        metrics: ServiceMetrics,
        *,
        tls: ssl.SSLContext | None,
        max_connections: int,
        per_principal: int = 0,
        hot: HotPacks | None = None,
        local: bool = False,
        transfer_seconds: float = STREAM_SECONDS,
    ) -> None:
        host, port = address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            raise InvalidInput(f"cannot listen on {host}:{port} for bulk transfers: {exc.strerror}") from None
        self.port = self._listener.getsockname()[1]
        self.local_name, self._local = "", None
        if local:  # a random name: only a client GetPack told it can find it
            self.local_name = f"packstore-bulk-{secrets.token_hex(16)}"
            self._local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._local.bind("\0" + self.local_name)
            self._local.listen(128)
        self.tickets, self.metrics, self.tls, self.hot = tickets, metrics, tls, hot
        self.shares = Shares("bulk transfers", ShareRule.default(max_connections, per_principal))
        self.transfer_seconds = transfer_seconds
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake = socket.socketpair()
        self._pending: set[Pending] = set()
        self._pending_by_peer: Counter[str] = Counter()
        self._closed = False
        self._thread: threading.Thread | None = None

    def ticket_message(self, ticket: bytes) -> store_pb2.BulkTicket:
        """What GetPack sends for ``ticket``: this port, whether it speaks TLS, and the local socket's name."""
        return store_pb2.BulkTicket(
            port=self.port,
            ticket=ticket,
            expires_ms=int(self.tickets.lifetime * 1000),
            tls=self.tls is not None,
            local_socket=self.local_name,
        )

    def start(self) -> None:
        for listener, local in ((self._listener, False), (self._local, True)):
            if listener is not None:
                listener.setblocking(False)
                self._selector.register(listener, selectors.EVENT_READ, local)
        self._wake_read.setblocking(False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="packstore-bulk", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Take no more connections, drop those still without a ticket; transfers under way go on until they end."""
        self._closed = True
        self._wake.send(b"\0")
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- the gate: accepting connections and reading their tickets ---------------------------------

    def _run(self) -> None:
        try:
            while not self._closed:
                soonest = min((p.deadline for p in self._pending), default=None)
                wait = 0.25 if soonest is None else min(0.25, max(0.0, soonest - time.monotonic()))
                for key, _ in self._selector.select(wait):
                    if key.data == "wake":
                        continue
                    if isinstance(key.data, bool):  # a listener, registered by start()
                        self._accept(cast(socket.socket, key.fileobj), key.data)
                    else:
                        self._advance(key.data)
                self._expire()
        finally:
            for pending in list(self._pending):
                self._forget(pending)
                pending.conn.close()
            for listener in (self._listener, self._local, self._wake_read, self._wake):
                if listener is not None:
                    listener.close()
            self._selector.close()

    def _accept(self, listener: socket.socket, local: bool) -> None:
        """Every connection waiting on ``listener``: closed at once when its peer, or everyone, has too many awaiting
        their ticket; else waited on."""
        while True:
            try:
                conn, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors for a moment; keep serving
                return
            try:
                peer = Peer.of_local(conn) if local else Peer.of_tcp(address)
            except OSError:
                conn.close()
                continue
            if self._pending_by_peer[peer.key] >= PEER_PENDING or len(self._pending) >= MAX_PENDING:
                self._refused(peer, "pending")
                conn.close()
                continue
            conn.setblocking(False)
            if not local:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = self.tls if not local else None
            if tls is not None:
                conn = tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            pending = Pending(conn, peer, local, time.monotonic() + HELLO_SECONDS, tls is not None)
            self._pending.add(pending)
            self._pending_by_peer[peer.key] += 1
            self._selector.register(conn, selectors.EVENT_READ, pending)
            self._advance(pending)  # a TLS client may have sent its hello already

    def _advance(self, pending: Pending) -> None:
        """Go on with the TLS handshake and the hello as far as the bytes that came allow."""
        conn = pending.conn
        try:
            if pending.handshaking and isinstance(conn, ssl.SSLSocket):  # (handshaking: a TLS connection)
                conn.do_handshake()
                pending.handshaking = False
            while len(pending.hello) < HELLO:
                data = conn.recv(HELLO - len(pending.hello))
                if not data:
                    self._forget(pending)
                    conn.close()
                    return
                pending.hello += data
        except ssl.SSLWantReadError:
            self._selector.modify(conn, selectors.EVENT_READ, pending)
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(conn, selectors.EVENT_WRITE, pending)
            return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # a failed handshake (ssl.SSLError), a reset
            self._refused(pending.peer, "handshake")
            self._forget(pending)
            conn.close()
            return
        self._forget(pending)
        self._admit(pending)

    def _expire(self) -> None:
        """Close the connections whose ticket did not come in time."""
        now = time.monotonic()
        for pending in [p for p in self._pending if p.deadline <= now]:
            self._refused(pending.peer, "timeout")
            self._forget(pending)
            pending.conn.close()

    def _forget(self, pending: Pending) -> None:
        """Stop waiting on ``pending`` (it leaves the selector and the counts; its connection stays open)."""
        self._pending.discard(pending)
        self._pending_by_peer[pending.peer.key] -= 1
        if self._pending_by_peer[pending.peer.key] <= 0:
            del self._pending_by_peer[pending.peer.key]
        try:
            self._selector.unregister(pending.conn)
        except (KeyError, ValueError):
            pass

    def _admit(self, pending: Pending) -> None:
        """A whole hello: its ticket taken, then a slot for its peer; the transfer runs on a thread of its own. A bad
        hello or a full port gets an ERROR frame (the client streams instead on LIMIT_EXCEEDED)."""
        conn, peer, hello = pending.conn, pending.peer, bytes(pending.hello)
        fields: dict[str, object] = {"peer": pending.peer.name}
        try:
            if hello[: len(MAGIC)] != MAGIC:
                self._refused(peer, "magic")
                raise InvalidInput("not a packstore bulk connection (its first bytes are not the bulk magic)")
            try:
                transfer = self.tickets.take(hello[len(MAGIC) :])
            except Unauthenticated:
                self._refused(peer, "ticket")
                raise
            fields |= transfer.fields
            if not self.shares.try_take(transfer.principal):
                refused = self.shares.refused(transfer.principal, "bulk transfer")
                raise LimitExceeded(f"{refused}, or read the pack on the gRPC stream", **refused.fields)
        except PackstoreError as exc:
            self._send_error(conn, exc)
            conn.close()
            self.metrics.record(METHOD, exc.grpc_status, 0.0, fields | {"error": str(exc)})
            return
        threading.Thread(target=self._serve, args=(conn, transfer, fields), name="packstore-bulk-conn", daemon=True).start()

    def _refused(self, peer: Peer, reason: str) -> None:
        """Count a connection turned away before it showed a valid ticket (logged at debug only: no caller is known)."""
        self.metrics.bulk_refused.labels(reason).inc()
        log.debug("bulk connection refused", extra={"fields": {"peer": peer.name, "reason": reason}})

    # -- transfers ----------------------------------------------------------------------------

    def _serve(self, conn: socket.socket, transfer: Transfer, fields: dict[str, object]) -> None:
        """One admitted transfer, then the connection closes (one ticket per connection)."""
        start, sent, code = time.perf_counter(), 0, "OK"
        size = sum(transfer.header.chunks[index].stored_bytes for index in transfer.indices)
        deadline = time.monotonic() + self.transfer_seconds + size / TRANSFER_RATE
        try:
            conn.setblocking(True)
            with self.hot.lease(transfer.namespace, transfer.header) if self.hot is not None else nullcontext() as segment:
                fields["hot"] = segment is not None
                self.metrics.hot_reads.labels(transfer.namespace, "hit" if segment is not None else "miss").inc()
                if segment is not None:
                    for index in transfer.indices:
                        sent += self._send_chunk(conn, transfer, index, segment.chunk(index), deadline)
                else:
                    sent = self._send_from_store(conn, transfer, deadline)
            _send(conn, end_frame(), deadline)
        except PackstoreError as exc:
            code, fields["error"] = exc.grpc_status, str(exc)
            self._send_error(conn, exc)
        except OSError as exc:
            code, fields["error"] = "CANCELLED", f"the client went away: {exc}"
        except Exception as exc:  # an unexpected failure: report INTERNAL, keep serving others
            code = "INTERNAL"
            log.exception("internal error", extra={"fields": {"method": METHOD}})
            self._send_error(conn, PackstoreError(f"internal error: {exc}"))
        finally:
            conn.close()
            self.shares.give_back(transfer.principal)
            self.metrics.record(METHOD, code, time.perf_counter() - start, {"bytes": sent, **fields})

    def _send_chunk(self, conn: socket.socket, transfer: Transfer, index: int, data: Buffer, deadline: float) -> int:
        """One CHUNK frame and its bytes; their count."""
        _send(conn, chunk_frame(index, len(data)), deadline)
        _send(conn, data, deadline)
        self.metrics.bytes_sent.labels(transfer.namespace).inc(len(data))
        return len(data)

    def _send_from_store(self, conn: socket.socket, transfer: Transfer, deadline: float) -> int:
        """The ticket's chunks read (and verified) from the store; when they are the whole pack, also written into a
        new hot copy, kept once every chunk is sent."""
        header, indices = transfer.header, transfer.indices
        hot = self.hot if len(indices) == len(header.chunks) else None
        writer = hot.writer(transfer.namespace, header) if hot is not None else None
        sent = 0
        try:
            for index, data in verified_chunks(header, zip(indices, transfer.store.read_chunks(header, indices))):
                sent += self._send_chunk(conn, transfer, index, data, deadline)
                if writer is not None:
                    writer.add(index, data)
            if hot is not None and writer is not None:
                hot.add(writer)
                writer = None
            return sent
        finally:
            if writer is not None:
                writer.discard()

    def _send_error(self, conn: socket.socket, error: PackstoreError) -> None:
        """An ERROR frame, if the client still listens (never waiting on it); the connection ends after it."""
        try:
            conn.setblocking(False)
            conn.send(error_frame(error))
        except (OSError, ValueError):
            pass


def _send(conn: socket.socket, data: Buffer, deadline: float) -> None:
    """Send all of ``data`` by ``deadline``, or raise LimitExceeded (a reader too slow holds a slot no longer)."""
    remaining = deadline - time.monotonic()
    try:
        if remaining <= 0:
            raise TimeoutError
        conn.settimeout(remaining)
        conn.sendall(data)
    except TimeoutError:
        limit = f"a transfer may take stream_seconds plus 1 s per {TRANSFER_RATE >> 20} MiB"
        raise LimitExceeded(f"the bulk transfer was read too slowly ({limit})") from None
