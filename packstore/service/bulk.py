"""The service's bulk port: GetPack's chunks sent on a plain TCP (or TLS) connection, or on a local socket to a
client on this host, for a ticket GetPack issued.

GetPack authenticates the caller, resolves the pack and checks identities as always, then hands out a ticket
naming exactly what it would have streamed (the namespace's store, the header, the chunk indices). The bulk
port sends those chunks with one write of framing and one of the stored bytes per chunk: from the pack's hot
segment when the service holds one (``packstore.service.hot``: verified when it was written, so neither read
nor hashed again), else read and verified as GetPack's stream does, and written into a new hot segment as they
go when the ticket is for the whole pack. On the local socket a hot pack goes as its segment's descriptor. A
ticket is single-use and lapses after TICKET_SECONDS: that is the bound within which a revoked token or a
deletion is honoured (a chunk deleted before it is read still fails NOT_FOUND, unless the pack is hot).
"""

from __future__ import annotations

import logging
import secrets
import socket
import ssl
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

from packstore.errors import InvalidInput, LimitExceeded, PackstoreError, Unauthenticated
from packstore.format import PackHeader
from packstore.rpc.bulk import MAGIC, TICKET_BYTES, chunk_frame, end_frame, error_frame, recv_exact, segment_frame
from packstore.service.hot import HotPacks, Segment
from packstore.service.metrics import ServiceMetrics
from packstore.store.protocol import PackStore
from packstore.v1 import store_pb2

log = logging.getLogger("packstore.service")

TICKET_SECONDS = 30.0  # how long an issued ticket may wait to be used
MAX_TICKETS = 4096  # outstanding at once; past it GetPack streams instead
IDLE_SECONDS = 60.0  # a connection that presents no ticket for this long is closed
METHOD = "GetPack.bulk"  # how transfers appear in logs and metrics


@dataclass(frozen=True)
class Transfer:
    """What one ticket entitles its bearer to: these chunks of this pack, from this namespace's store."""

    store: PackStore
    header: PackHeader
    indices: tuple[int, ...]
    fields: dict  # the GetPack call's log fields (token, namespace, key), repeated in the transfer's log line
    expires: float  # time.monotonic()


class Tickets:
    """Single-use tickets for transfers, each valid for TICKET_SECONDS."""

    def __init__(self, lifetime: float = TICKET_SECONDS, limit: int = MAX_TICKETS) -> None:
        self.lifetime, self.limit = lifetime, limit
        self._transfers: dict[bytes, Transfer] = {}
        self._lock = threading.Lock()

    def issue(self, store: PackStore, header: PackHeader, indices: Sequence[int], fields: dict) -> bytes | None:
        """A new ticket for the transfer, or None when MAX_TICKETS are outstanding (the caller streams instead)."""
        now = time.monotonic()
        with self._lock:
            for ticket in [t for t, transfer in self._transfers.items() if transfer.expires <= now]:
                del self._transfers[ticket]
            if len(self._transfers) >= self.limit:
                return None
            ticket = secrets.token_bytes(TICKET_BYTES)
            self._transfers[ticket] = Transfer(store, header, tuple(indices), dict(fields), now + self.lifetime)
            return ticket

    def take(self, ticket: bytes) -> Transfer:
        """The ticket's transfer, which it no longer grants; Unauthenticated for one unknown, used or lapsed."""
        with self._lock:
            transfer = self._transfers.pop(bytes(ticket), None)
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


class BulkServer:
    """Accepts bulk connections on its own threads (the TCP port, and with ``local`` an abstract unix socket that
    only clients on this host and in this network namespace reach) and serves each on another, at most
    ``max_connections`` at once. ``hot``: the service's hot packs, which transfers read from and add to."""

    def __init__(
        self,
        address: tuple[str, int],
        tickets: Tickets,
        metrics: ServiceMetrics,
        *,
        tls: ssl.SSLContext | None,
        max_connections: int,
        hot: HotPacks | None = None,
        local: bool = False,
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
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = False

    def ticket_message(self, ticket: bytes) -> store_pb2.BulkTicket:
        """What GetPack sends for ``ticket``: this port, whether it speaks TLS, and the local socket's name."""
        return store_pb2.BulkTicket(
            port=self.port, ticket=ticket, expires_ms=int(self.tickets.lifetime * 1000), tls=self.tls is not None, local_socket=self.local_name
        )

    def start(self) -> None:
        threading.Thread(target=self._accept, args=(self._listener, False), name="packstore-bulk", daemon=True).start()
        if self._local is not None:
            threading.Thread(target=self._accept, args=(self._local, True), name="packstore-bulk-local", daemon=True).start()

    def stop(self) -> None:
        """Take no more connections; transfers under way go on until they end."""
        self._closed = True
        self._listener.close()
        if self._local is not None:
            self._local.close()

    def _accept(self, listener: socket.socket, local: bool) -> None:
        while not self._closed:
            try:
                conn, peer = listener.accept()
            except OSError:
                if self._closed:
                    return
                continue  # e.g. out of file descriptors for a moment; keep serving
            if local:
                name = "unix:local"
            else:
                name = f"ipv6:[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"ipv4:{peer[0]}:{peer[1]}"
            threading.Thread(target=self._serve, args=(conn, name, local), name="packstore-bulk-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str, local: bool = False) -> None:
        """One connection: a ticket, its transfer, and again, until the client closes or something fails."""
        if not local:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(IDLE_SECONDS)
        if not self._slots.acquire(blocking=False):
            self._send_error(conn, LimitExceeded("too many bulk connections at once; try again, or read the pack on the gRPC stream"))
            conn.close()
            return
        try:
            if self.tls is not None and not local:
                conn = self.tls.wrap_socket(conn, server_side=True)
            while self._transfer(conn, peer, local):
                pass
        except (OSError, EOFError) as exc:
            log.debug("bulk connection closed", extra={"fields": {"peer": peer, "reason": str(exc)}})
        finally:
            self._slots.release()
            conn.close()

    def _send_chunk(self, conn: socket.socket, index: int, data: bytes | memoryview) -> int:
        """One CHUNK frame and its bytes; their count."""
        conn.sendall(chunk_frame(index, len(data)))
        conn.sendall(data)
        self.metrics.bytes_sent.inc(len(data))
        return len(data)

    def _send_segment(self, conn: socket.socket, segment: Segment, indices: Sequence[int]) -> int:
        """A SEGMENT frame carrying the hot segment's descriptor and where the ticket's chunks are in it."""
        entries = [(index, segment.offsets[index], segment.header.chunks[index].stored_bytes) for index in indices]
        frame = segment_frame(entries)
        at = socket.send_fds(conn, [frame], [segment.fd])
        if at < len(frame):
            conn.sendall(frame[at:])
        shared = sum(size for _, _, size in entries)
        self.metrics.bytes_sent.inc(shared)
        return shared

    def _send_from_store(self, conn: socket.socket, transfer: Transfer) -> int:
        """The ticket's chunks read (and verified) from the store; when they are the whole pack, also written into a
        new hot segment, kept once every chunk is sent."""
        header, indices = transfer.header, transfer.indices
        writer = self.hot.writer(header) if self.hot is not None and len(indices) == len(header.chunks) else None
        sent = 0
        try:
            for index, data in zip(indices, transfer.store.read_chunks(header, indices)):
                sent += self._send_chunk(conn, index, data)
                if writer is not None:
                    writer.add(index, data)
            if writer is not None:
                self.hot.add(writer)
                writer = None
            return sent
        finally:
            if writer is not None:
                writer.discard()

    def _send_error(self, conn: socket.socket, error: PackstoreError) -> None:
        """An ERROR frame, if the client still listens; the connection ends after it (its owner closes it)."""
        try:
            conn.sendall(error_frame(error))
        except OSError:
            pass

    def _transfer(self, conn: socket.socket, peer: str, local: bool = False) -> bool:
        """Serve the next ticket on ``conn``; False when the connection is done with."""
        try:
            hello = recv_exact(conn, len(MAGIC) + TICKET_BYTES)
        except EOFError:
            return False  # closed between transfers
        start, sent, code, fields = time.perf_counter(), 0, "OK", {"peer": peer}
        try:
            if hello[: len(MAGIC)] != MAGIC:
                raise InvalidInput("not a packstore bulk connection (its first bytes are not the bulk magic)")
            transfer = self.tickets.take(hello[len(MAGIC) :])
            fields |= transfer.fields
            with self.hot.lease(transfer.header) if self.hot is not None else nullcontext() as segment:
                fields["hot"] = segment is not None
                self.metrics.hot_reads.labels("hit" if segment is not None else "miss").inc()
                if segment is not None and local:
                    sent = self._send_segment(conn, segment, transfer.indices)
                elif segment is not None:
                    sent = sum(self._send_chunk(conn, index, segment.chunk(index)) for index in transfer.indices)
                else:
                    sent = self._send_from_store(conn, transfer)
            conn.sendall(end_frame())
            return True
        except PackstoreError as exc:
            code, fields["error"] = exc.grpc_status, str(exc)
            self._send_error(conn, exc)
            return False
        except OSError as exc:
            code, fields["error"] = "CANCELLED", f"the client went away: {exc}"
            return False
        except Exception as exc:  # an unexpected failure: report INTERNAL, keep serving others
            code = "INTERNAL"
            log.exception("internal error", extra={"fields": {"method": METHOD}})
            self._send_error(conn, PackstoreError(f"internal error: {exc}"))
            return False
        finally:
            self.metrics.record(METHOD, code, time.perf_counter() - start, {"bytes": sent, **fields})
