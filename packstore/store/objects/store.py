"""Packs in an object store over the S3 API, with a bounded local cache: the ``PackStore`` of the object tier.

Chunks are immutable objects named by their content address (``ChunkInfo.address``: the sha256 of packs written
before format version 4, ``blake3-`` and the BLAKE3 digest since), stored once however many packs share them,
the header is written last with ``If-None-Match: *`` and is the commit (a pack is visible only
when complete), names are registers of create-only versions (``registers.py``), and gc removes
only chunks unreferenced for longer than a grace period, so any number of replicas can share one
bucket. Layout, the write and gc protocols and their assumptions: docs/operations.md, "Object
store tier". Every byte read, from the cache or the object store, is verified before it is used.
"""

from __future__ import annotations

import builtins
import hashlib
import itertools
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from packstore.errors import IntegrityError, InvalidInput, PackNotFound, StoreBusy, Unavailable
from packstore.format import EncodedPack, PackHeader, parse_key
from packstore.format.body import chunks_for, verify_chunk
from packstore.format.signature import Signature
from packstore.store.namespaces import DEFAULT_NAMESPACE
from packstore.store.objects.banks import ObjectBankTables
from packstore.store.objects.bucket import Bucket, Conflict, Listed
from packstore.store.objects.cache import ObjectCache
from packstore.store.objects.registers import UNCHANGED, Registers, Version
from packstore.store.protocol import (
    DEFAULT_PAGE,
    HASH_PREFIX,
    MAX_PAGE,
    BankRecords,
    HoldsNamespaces,
    OpenedPack,
    ServedStore,
    check_name,
    pick_match,
)
from packstore.store.records import GcReport, PackPage, PackSummary, StoreCounts, StoredPack
from packstore.store.spec import DEFAULT_OBJECT_CACHE_BYTES
from packstore.store.summaries import pack_stored_bytes, parse_summary, summary_record

DEFAULT_GC_GRACE = 3600.0  # seconds an unreferenced object is kept (docs/operations.md, "Object store tier")
READ_AHEAD = 4  # chunks a stream fetches ahead of the one it sends
MIN_LEASE = 120.0  # seconds a gc run may hold the store's gc lease, at least
T = TypeVar("T")


def _stamp(moment: datetime) -> float:
    return moment.timestamp()


def namespace_prefix(namespace: str) -> str:
    """Where a namespace's tree starts below the store's prefix: every object of the namespace is named under it."""
    return f"ns/{check_name(namespace)}/"


class ObjectStore(ObjectBankTables):
    """A namespace of packs under ``s3://BUCKET/PREFIX``, cached in a bounded local LMDB cache.

    Several processes and machines ("replicas") may open the same bucket, prefix and namespace:
    what one commits, all list and serve. Banks are kept beside the packs (``banks.py``).
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint: str | None = None,
        cache_dir: str | Path | None = None,
        cache_bytes: int = DEFAULT_OBJECT_CACHE_BYTES,
        namespace: str = DEFAULT_NAMESPACE,
        gc_grace: float = DEFAULT_GC_GRACE,
        retries: int = 5,
        timeout: float = 60.0,
    ) -> None:
        """``cache_dir``: the cache's directory, one per open store (None: a temporary one, removed on close);
        ``gc_grace``: how long gc keeps unreferenced objects, and bounds how long a put may take;
        ``retries``/``timeout``: attempts per S3 call and seconds per connect and read."""
        self._base = namespace_prefix(namespace)
        try:
            self.bucket = Bucket(url, endpoint=endpoint, retries=retries, timeout=timeout)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        self.bucket.check()
        self.namespace = namespace
        self.gc_grace = float(gc_grace)
        self.path = f"s3://{self.bucket.bucket}/{self.bucket.root}{self._base}"  # where the store is (bank caches key on it)
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        if cache_dir is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="packstore-cache-")
            cache_dir = self._scratch.name
        self.cache = ObjectCache(cache_dir, cache_bytes)
        self._cache_scope = f"{self.bucket.bucket}/{self.bucket.root}"
        self._registers = Registers(self.bucket, self._fetch_bytes)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="packstore-s3")

    def holds_namespace(self, namespace: str) -> bool:
        """Whether the bucket, under this store's prefix, holds any object of ``namespace`` (someone wrote to it): how
        a service tells a namespace that exists from one a read must not create. One listing of at most one name."""
        return self.bucket.holds(namespace_prefix(namespace))

    @property
    def writer_window(self) -> float:
        """Seconds a put may rely on a chunk before its header must be committed (a quarter of the grace)."""
        return self.gc_grace / 4

    def close(self) -> None:
        self._pool.shutdown()
        self.cache.close()
        if self._scratch is not None:
            self._scratch.cleanup()

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- object names ------------------------------------------------------------------------

    def _header_name(self, key: str) -> str:
        return f"{self._base}headers/{key}"

    def _summary_name(self, key: str) -> str:
        return f"{self._base}summaries/{key}"

    def _chunk_name(self, address: str) -> str:
        return f"{self._base}chunks/{address}"

    def _signatures_prefix(self, key: str) -> str:
        return f"{self._base}signatures/{key}/"

    def _name_path(self, model_fp: str, name: str) -> str:
        return f"{self._base}names/{model_fp}/{name}"

    # -- verified, cached reads --------------------------------------------------------------

    def _fetch_bytes(self, name: str, etag: str | None) -> bytes | None:
        """An object's bytes: from the cache when it holds the version with ``etag``, else fetched and cached."""
        return self._fetch(name, etag, lambda data: data)

    def _fetch(self, name: str, etag: str | None, check: Callable[[bytes], T]) -> T | None:
        """``check(bytes)`` of an object (None if there is none). A cached copy is used only if it is the
        version with ``etag`` and passes ``check``; a damaged one is dropped and fetched again. ``check``
        raises IntegrityError on damage, so damaged bytes from the object store are never used or cached."""
        slot = self._cache_scope + name
        if etag is not None:
            cached = self.cache.get(slot)
            if cached is not None and cached.startswith(etag.encode() + b"\n"):
                try:
                    return check(cached[len(etag) + 1 :])
                except (IntegrityError, InvalidInput):
                    self.cache.discard(slot)
        found = self.bucket.get(name)
        if found is None:
            return None
        data, stored_etag = found
        result = check(data)
        self.cache.put(slot, stored_etag.encode() + b"\n" + data)
        return result

    def _parse_header(self, key: str, data: bytes) -> PackHeader:
        try:
            header = PackHeader.from_json(data)
        except (IntegrityError, InvalidInput) as exc:
            raise IntegrityError(f"pack {key}: stored header is damaged: {exc}") from None
        if header.key != key:
            raise IntegrityError(f"pack {key}: stored header describes a different key")
        return header

    def _header(self, key: str, etag: str | None = None) -> tuple[PackHeader, bytes]:
        """The committed header of ``key`` and its JSON; PackNotFound if the pack is not (or no longer) stored."""
        if etag is None:
            head = self.bucket.head(self._header_name(key))
            if head is None:
                raise PackNotFound(f"no pack with key {key}")
            etag = head.etag
        found = self._fetch(self._header_name(key), etag, lambda data: (self._parse_header(key, data), data))
        if found is None:
            raise PackNotFound(f"no pack with key {key}")
        return found

    def _immutable(self, name: str, check: Callable[[bytes], None], *, cached: bool = True, missing: str) -> bytes:
        """An object that never changes under its name (a chunk, a bank record), passed through ``check``
        (which raises IntegrityError on damage): from the cache, else fetched and cached (``cached`` False:
        straight from the object store). IntegrityError with ``missing`` if there is no such object."""
        slot = self._cache_scope + name
        if cached:
            data = self.cache.get(slot)
            if data is not None:
                try:
                    check(data)
                    return data
                except IntegrityError:
                    self.cache.discard(slot)
        found = self.bucket.get(name)
        if found is None:
            raise IntegrityError(missing)
        check(found[0])
        if cached:
            self.cache.put(slot, found[0])
        return found[0]

    def _chunk(self, header: PackHeader, index: int, *, cached: bool = True) -> bytes:
        """Chunk ``index`` of a pack, checked against its digest (``cached`` False: straight from the object store,
        and returned as stored, for ``verify`` to report)."""
        check = (lambda data: verify_chunk(header, index, data)) if cached else (lambda data: None)
        missing = f"pack {header.key}: chunk {index} is missing from the object store"
        return self._immutable(self._chunk_name(header.chunks[index].address), check, cached=cached, missing=missing)

    def read_chunks(self, header: PackHeader, indices: Sequence[int]) -> Iterator[bytes]:
        """Chunks ``indices`` of a pack in order, each checked against its digest, with up to ``READ_AHEAD`` fetched
        ahead in parallel: a stream costs about one object-store round trip per READ_AHEAD chunks, not per chunk,
        and a stalled reader holds at most READ_AHEAD + 1 chunks."""
        pending: deque[Future[bytes]] = deque()
        try:
            for index in indices:
                pending.append(self._pool.submit(self._chunk, header, index))
                if len(pending) > READ_AHEAD:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()

    def _signatures(self, key: str) -> tuple[Signature, ...]:
        def parse(data: bytes) -> Signature:
            try:
                return Signature.from_json(data)
            except InvalidInput as exc:
                raise IntegrityError(f"pack {key}: a stored signature is damaged: {exc}") from None

        found = (self._fetch(o.name, o.etag, parse) for o in self.bucket.list(self._signatures_prefix(key)))
        return tuple(s for s in found if s is not None)

    # -- names ---------------------------------------------------------------------------------

    def _name_value(self, version: Version | None) -> str | None:
        """The key a name version points at (None: the name was removed)."""
        if version is None or version.value is None:
            return None
        if not isinstance(version.value, str) or not parse_key(version.value):
            raise IntegrityError(f"name record {version.name} is damaged: it holds no pack key")
        return version.value

    def _names_of_model(self, model_fp: str) -> dict[str, str]:
        """Every name of one model and the key it points at (one listing, versions read from the cache)."""
        prefix = f"{self._base}names/{model_fp}/"
        found = {}
        for path, versions in self._registers.versions(prefix).items():
            key = self._name_value(self._registers.newest(versions))
            if key is not None:
                found[path[len(prefix) :]] = key
        return found

    def _names_of(self, keys: list[str]) -> dict[str, tuple[str, ...]]:
        """The names pointing at each of ``keys``, sorted (one listing per model among them)."""
        names: dict[str, list[str]] = {key: [] for key in keys}
        for model_fp in sorted({key.split("/", 1)[0] for key in keys}):
            for name, key in self._names_of_model(model_fp).items():
                if key in names:
                    names[key].append(name)
        return {key: tuple(sorted(found)) for key, found in names.items()}

    def _point(self, model_fp: str, name: str, key: str) -> None:
        """Point ``name`` at ``key``: always a new version, so a gc that judged the name dangling loses the race."""
        self._registers.update(self._name_path(model_fp, name), lambda current: key)

    def _unpoint(self, model_fp: str, name: str, key: str) -> None:
        """Remove ``name`` if it still points at ``key``."""
        path = self._name_path(model_fp, name)
        self._registers.update(path, lambda current: None if self._name_value(current) == key else UNCHANGED)

    # -- reads ---------------------------------------------------------------------------------

    def resolve(self, ref: str, *, model_fp: str | None = None) -> str:
        """Turn a REF into a stored key: a full key, a name, or a unique prefix (8+ hex) of a content hash."""
        if parse_key(ref):
            if self.bucket.head(self._header_name(ref)) is None:
                raise PackNotFound(f"no pack with key {ref}")
            return ref
        matches: list[str] = []
        if _is_name(ref):
            models = [model_fp] if model_fp is not None else self.bucket.folders(f"{self._base}names/")
            pointed = (self._name_value(self._registers.latest(self._name_path(m, ref))) for m in models)
            matches = [key for key in pointed if key is not None and self.bucket.head(self._header_name(key)) is not None]
        by_name = bool(matches)
        if not matches and HASH_PREFIX.fullmatch(ref):
            within = f"{self._base}headers/{model_fp}/" if model_fp else f"{self._base}headers/"
            keys = (o.name[len(self._base) + len("headers/") :] for o in self.bucket.list(within))
            matches = [key for key in keys if key.rsplit("/", 1)[1].startswith(ref)]
        return pick_match(ref, matches, by_name=by_name, model_fp=model_fp)

    def stat(self, ref: str, *, model_fp: str | None = None) -> StoredPack:
        """Header, names, size and signatures of one pack, without reading its body."""
        key = self.resolve(ref, model_fp=model_fp)
        header, data = self._header(key)
        names = self._names_of([key])[key]
        return StoredPack(header=header, names=names, stored_bytes=pack_stored_bytes(header, data), signatures=self._signatures(key))

    def _committed(self, after: str, model_fp: str | None, template_fp: str | None, name: str | None) -> Iterator[tuple[str, str]]:
        """(key, header ETag) of each matching committed pack whose key sorts after ``after``, in key order."""
        headers = f"{self._base}headers/"
        if name is not None:
            models = [model_fp] if model_fp else self.bucket.folders(f"{self._base}names/")
            pointed = {self._name_value(self._registers.latest(self._name_path(m, name))) for m in models} if _is_name(name) else set()
            for key in sorted(k for k in pointed if k is not None and k > after):
                head = self.bucket.head(self._header_name(key))
                if head is not None and (template_fp is None or key.split("/")[1] == template_fp):
                    yield key, head.etag
            return
        prefix = f"{model_fp}/{template_fp}/" if model_fp and template_fp else f"{model_fp}/" if model_fp else ""
        for listed in self.bucket.list(headers + prefix, after=headers + after if after > prefix else ""):
            key = listed.name[len(headers) :]
            if template_fp is None or key.split("/")[1] == template_fp:
                yield key, listed.etag

    def _summary(self, key: str, etag: str) -> bytes:
        """The summary record of the committed header version with ``etag``: cached, else the summary object
        written with it, else made from the header (its writer died before writing the summary, or the
        summary object belongs to another version of the pack)."""
        slot = f"{self._cache_scope}summary-of/{key}"
        record = _bound_record(key, etag, self.cache.get(slot))
        if record is None:
            record = _bound_record(key, etag, self._stored_summary(key))
            if record is None:
                header, data = self._header(key, etag)
                record = summary_record(header, pack_stored_bytes(header, data))
            self.cache.put(slot, etag.encode() + b"\n" + record)
        return record

    def _stored_summary(self, key: str) -> bytes | None:
        found = self.bucket.get(self._summary_name(key))
        return found[0] if found else None

    def _summaries(self, found: list[tuple[str, str]]) -> list[PackSummary]:
        names = self._names_of([key for key, _ in found])
        records = self._pool.map(lambda item: self._summary(*item), found)
        return [parse_summary(key, names[key], record) for (key, _), record in zip(found, records)]

    def list_page(
        self,
        *,
        page_size: int = DEFAULT_PAGE,
        page_token: str = "",
        model_fp: str | None = None,
        template_fp: str | None = None,
        name: str | None = None,
    ) -> PackPage:
        """Summaries of the matching packs after ``page_token``, in key order, at most ``page_size``.

        One listing of headers, a summary per pack (cached), and one listing of names per model on the page.
        """
        if not 1 <= page_size <= MAX_PAGE:
            raise InvalidInput(f"page size {page_size} is outside 1-{MAX_PAGE}")
        found = list(itertools.islice(self._committed(page_token, model_fp, template_fp, name), page_size + 1))
        packs = self._summaries(found[:page_size])
        return PackPage(packs=packs, next_token=packs[-1].key if len(found) > page_size else "")

    def list(self, *, model_fp: str | None = None, template_fp: str | None = None, name: str | None = None) -> list[PackSummary]:
        """Every matching pack's summary, in key order."""
        return self._summaries(list(self._committed("", model_fp, template_fp, name)))

    def keys(self) -> builtins.list[str]:
        """Every committed key (a header object), whether or not its header still parses."""
        headers = f"{self._base}headers/"
        return [o.name[len(headers) :] for o in self.bucket.list(headers)]

    def counts(self) -> StoreCounts:
        """Packs committed and their stored bytes: one listing of headers, summaries from the cache."""
        found = list(self._committed("", None, None, None))
        sizes = self._pool.map(lambda item: parse_summary(item[0], (), self._summary(*item)).stored_bytes, found)
        return StoreCounts(packs=len(found), stored_bytes=sum(sizes))

    def _stored_header(self, key: str) -> PackHeader:
        """The header as the object store holds it, bypassing the cache."""
        found = self.bucket.get(self._header_name(key))
        if found is None:
            raise PackNotFound(f"no pack with key {key}")
        return self._parse_header(key, found[0])

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
        """Chunks come through the cache (each checked against its content address before it is cached or served
        from it) with ``READ_AHEAD`` fetched in parallel; ``as_stored``: header and chunks straight from the object
        store, unchecked, for the reader's ``verify`` to report."""
        key = ref if as_stored and parse_key(ref) else self.resolve(ref, model_fp=model_fp)
        header = self._stored_header(key) if as_stored else self._header(key)[0]
        indices = chunks_for(header, layers, prefix)
        signed = self._signatures(key) if signatures else ()
        if as_stored:
            return OpenedPack(header, signed, indices, lambda: nullcontext(self._as_stored(header, indices)))
        return OpenedPack(header, signed, indices, lambda: nullcontext(zip(indices, self.read_chunks(header, indices))))

    def _as_stored(self, header: PackHeader, indices: Sequence[int]) -> Iterator[tuple[int, bytes]]:
        """Chunks straight from the object store, as stored (read in parallel, in order)."""
        yield from zip(indices, self._pool.map(lambda index: self._chunk(header, index, cached=False), indices))

    # -- writes --------------------------------------------------------------------------------

    def put(self, encoded: EncodedPack, *, name: str | None = None) -> tuple[str, bool]:
        """Store a pack (and optionally name it). Returns ``(key, created)``; same content is stored once."""
        if len(encoded.chunks) != len(encoded.header.chunks):
            raise InvalidInput(f"pack has {len(encoded.chunks)} chunks, header lists {len(encoded.header.chunks)}")
        upload = self.begin_upload(encoded.header)
        upload.add_all(encoded.chunks)
        return upload.commit(name=name, signatures=encoded.signatures)

    def begin_upload(self, header: PackHeader) -> ObjectUpload:
        """Start an upload that takes the chunks one at a time (the service's PutPack), or all at once."""
        header.validate(encoded=True)
        return ObjectUpload(self, header)

    def _commit(self, header: PackHeader, relied: float, recheck: Callable[[int], float]) -> bool:
        """Create the header (the commit) within the writer window of ``relied``, the earliest time the
        writer relied on a chunk; True if this call committed it. Past the window, every chunk is checked
        again (``recheck(index)`` returns the time it is relied on from), three times at most."""
        header_json = header.to_json()
        for _ in range(3):
            if _stamp(self.bucket.now()) - relied < self.writer_window:
                break
            relied = min(self._pool.map(recheck, range(len(header.chunks))), default=relied)
        else:
            raise Unavailable(
                f"the object store is too slow: checking the chunks of {header.key} took longer than {self.writer_window:.0f} s three times"
            )
        try:
            etag, _ = self.bucket.put(self._header_name(header.key), header_json, create_only=True)
        except Conflict:
            stored = self.bucket.get(self._header_name(header.key))
            return stored is not None and stored[0] == header_json  # our own write, if its answer was lost
        self.cache.put(self._cache_scope + self._header_name(header.key), etag.encode() + b"\n" + header_json)
        summary = summary_record(header, pack_stored_bytes(header, header_json))
        self.bucket.put(self._summary_name(header.key), etag.encode() + b"\n" + summary)
        return True

    def _upload_chunk(self, address: str, data: bytes | None) -> float:
        """Make ``chunks/ADDRESS`` hold ``data`` (None: it must be there already); returns the server time
        from which the writer relies on it.

        A new object is safe to rely on at once; an existing one only if it is younger than half the grace
        (no gc can be about to remove it), else only while no gc runs (docs/operations.md, "Object store tier").
        """
        name = self._chunk_name(address)
        while True:
            if data is not None:
                try:
                    return _stamp(self.bucket.put(name, data, create_only=True)[1])
                except Conflict:
                    pass
            head = self.bucket.head(name)
            if head is None:
                if data is None:
                    raise Unavailable(
                        f"chunk {address} was removed by a gc while its upload took longer than {self.writer_window:.0f} s; "
                        "upload the pack again"
                    )
                continue  # a gc removed it between the two calls: create it again
            damaged = data is not None and head.etag != hashlib.md5(data).hexdigest() and "-" not in head.etag
            if not damaged and _stamp(head.now) - _stamp(head.modified) < self.gc_grace / 2:
                return _stamp(head.now)
            now = self._wait_out_gc()
            if damaged and data is not None:  # the stored copy is not these bytes (ETags of single-part writes are their MD5): heal it
                return _stamp(self.bucket.put(name, data)[1])
            return now

    def add_signature(self, ref: str, signature: Signature, *, model_fp: str | None = None) -> str:
        """Store ``signature`` with the pack ``ref`` (one per signing key: a newer one replaces it),
        after checking that it signs this pack's digest and verifies; returns the key."""
        key = self.resolve(ref, model_fp=model_fp)
        signature.check("pack", self._header(key)[0].pack_sha256)
        self.bucket.put(self._signatures_prefix(key) + signature.key_id, signature.to_json())
        return key

    def set_name(self, ref: str, name: str, *, model_fp: str | None = None) -> str:
        """Point ``name`` at the pack ``ref`` (within the pack's model); returns the key."""
        check_name(name)
        key = self.resolve(ref, model_fp=model_fp)
        self._point(key.split("/", 1)[0], name, key)
        return key

    def delete_name(self, name: str, *, model_fp: str) -> str:
        """Remove one name of one model (the pack stays); returns the key it pointed at. Of two replicas
        removing the same name at once, one succeeds and the other finds no such name."""

        def clear(current: Version | None) -> None:
            if self._name_value(current) is None:
                raise PackNotFound(f"no pack named {name!r} for model {model_fp[:12]}", ref=name)

        before, _ = self._registers.update(self._name_path(model_fp, name), clear)
        return self._name_value(before)  # type: ignore[return-value]

    def delete(self, ref: str, *, model_fp: str | None = None) -> str:
        """Remove a pack (its header first: from then on it is gone), every name pointing at it and its
        signatures; returns the key. Its chunks are left to gc (other packs may share them)."""
        key = self.resolve(ref, model_fp=model_fp)
        model_fp = key.split("/", 1)[0]
        self.bucket.delete([self._header_name(key)])
        for name, pointed in self._names_of_model(model_fp).items():
            if pointed == key:
                self._unpoint(model_fp, name, key)
        self.bucket.delete([o.name for o in self.bucket.list(self._signatures_prefix(key))] + [self._summary_name(key)])
        return key

    # -- gc --------------------------------------------------------------------------------------

    def _lease(self) -> Version | None:
        return self._registers.latest(f"{self._base}gc/lease")

    def _wait_out_gc(self) -> float:
        """Wait until no gc holds the lease (at most its expiry); returns the server time then."""
        while True:
            lease = self._lease()
            now = _stamp(self.bucket.now())
            if lease is None or lease.value is None or now >= lease.value["expires"]:
                return now
            time.sleep(min(2.0, lease.value["expires"] - now))

    def gc(self, *, compact: bool = False) -> GcReport:
        """Remove chunks no committed header references that are older than the grace period, dangling
        names, old name versions, and summaries and signatures left without a header; safe while other
        replicas write (the protocol is in docs/operations.md, "Object store tier")."""
        if compact:
            raise InvalidInput("an object store has nothing to compact: deleting an object frees its space")
        before = sum(o.size for o in self.bucket.list(self._base))
        holder, expires, start = self._take_lease()
        try:
            orphans, dangling = self._collect(start, expires)
        finally:
            self._registers.update(
                f"{self._base}gc/lease",
                lambda current: None if current and current.value and current.value["holder"] == holder else UNCHANGED,
            )
        after = sum(o.size for o in self.bucket.list(self._base))
        return GcReport(len(orphans), sum(o.size for o in orphans), dangling, before, after, False)

    def _take_lease(self) -> tuple[str, float, float]:
        """Take the namespace's gc lease (StoreBusy if another gc holds it); returns (holder, expiry, start)."""
        holder = uuid.uuid4().hex
        now = _stamp(self.bucket.now())
        expires = now + max(self.gc_grace, MIN_LEASE)

        def take(current: Version | None) -> dict[str, str | float]:
            if current is not None and current.value is not None and current.value["expires"] > now:
                raise StoreBusy(f"another gc is running on {self.bucket.where}, namespace {self.namespace!r}; try again later")
            return {"holder": holder, "expires": expires}

        self._registers.update(f"{self._base}gc/lease", take)
        return holder, expires, now

    def _collect(self, start: float, expires: float) -> tuple[builtins.list[Listed], int]:
        """The gc run under the lease: returns (chunks removed, names removed)."""
        cutoff = start - self.gc_grace
        old_chunks = [o for o in self.bucket.list(f"{self._base}chunks/") if _stamp(o.modified) < cutoff]
        if old_chunks:  # a writer that relied on an old chunk before the lease was taken commits within the writer window
            time.sleep(max(0.0, start + self.writer_window - _stamp(self.bucket.now())))
        headers = f"{self._base}headers/"
        live = {o.name[len(headers) :]: o.etag for o in self.bucket.list(headers)}
        referenced: set[str] = set()
        for key, etag in live.items():
            try:
                referenced.update(c.address for c in self._header(key, etag)[0].chunks)
            except PackNotFound:
                continue  # deleted since the listing
            except IntegrityError as exc:
                raise IntegrityError(
                    f"gc stopped before removing anything: {exc}; its chunks are unknown, so restore or delete it first"
                ) from None
        orphans = [o for o in old_chunks if o.name.rsplit("/", 1)[1] not in referenced]
        leftovers = [
            o.name
            for kind in ("summaries/", "signatures/")
            for o in self.bucket.list(self._base + kind)
            if _stamp(o.modified) < cutoff and _pack_of(o.name[len(self._base + kind) :]) not in live
        ]
        self._delete_before(expires, [o.name for o in orphans] + leftovers + self._prune_banks(cutoff))
        return orphans, self._prune_names(cutoff, live, expires)

    def _delete_before(self, expires: float, names: builtins.list[str]) -> None:
        """Delete ``names`` in batches, stopping (for the next run to finish) if the lease would run out."""
        margin = min(30.0, (expires - time.time()) / 4)
        for start in range(0, len(names), 1000):
            if _stamp(self.bucket.now()) > expires - margin:
                return
            self.bucket.delete(names[start : start + 1000])

    def _prune_names(self, cutoff: float, live: dict[str, str], expires: float) -> int:
        """Remove names whose pack is gone (only if their version is older than the grace and the pack is still
        absent), and every name version but the newest; returns the names removed."""
        removed = 0
        old_versions: builtins.list[str] = []
        for versions in self._registers.versions(f"{self._base}gc/").values():
            old_versions += [v.name for v in versions[:-1]]
        for path, versions in self._registers.versions(f"{self._base}names/").items():
            newest = versions[-1]
            old_versions += [v.name for v in versions[:-1]]
            key = self._name_value(self._registers.newest(versions))
            if key is None or key in live or _stamp(newest.modified) >= cutoff or self.bucket.head(self._header_name(key)) is not None:
                continue
            seen = int(newest.name.rsplit("/", 1)[1])
            _, after = self._registers.update(path, _clear_at(seen))
            removed += after is not None and after.value is None and after.seq == seen + 1
        self._delete_before(expires, old_versions)
        return removed


class ObjectUpload:
    """A pack arriving at an object store: each chunk is verified and uploaded as it comes (so a streamed
    upload holds one chunk in memory), and ``commit`` writes the signatures, then creates the header.
    A pack already committed when the upload began is not uploaded again."""

    def __init__(self, store: ObjectStore, header: PackHeader) -> None:
        self.store = store
        self.header = header
        self._stored = store.bucket.head(store._header_name(header.key)) is not None
        self._relied: list[float] = []
        self._chunks: list[bytes] | None = None  # kept by ``add_all`` (the caller holds them anyway) for a recheck

    def _upload(self, index: int, data: bytes) -> float:
        verify_chunk(self.header, index, data)
        return float("inf") if self._stored else self.store._upload_chunk(self.header.chunks[index].address, data)

    def add_chunk(self, index: int, data: bytes) -> None:
        """Verify and upload the next chunk (they come in order)."""
        if index != len(self._relied):
            raise InvalidInput(f"chunk {index} arrived out of order; expected chunk {len(self._relied)}")
        if index >= len(self.header.chunks):
            raise InvalidInput(f"chunk {index} is beyond the {len(self.header.chunks)} chunks the header lists")
        self._relied.append(self._upload(index, data))

    def add_all(self, chunks: list[bytes]) -> None:
        """Verify and upload every chunk, several at a time."""
        self._chunks = list(chunks)
        self._relied = list(self.store._pool.map(self._upload, range(len(chunks)), chunks))

    def _recheck(self, index: int) -> float:
        return self.store._upload_chunk(self.header.chunks[index].address, self._chunks[index] if self._chunks else None)

    def commit(self, *, name: str | None = None, signatures: tuple[Signature, ...] = ()) -> tuple[str, bool]:
        """Commit the pack (idempotent by key) with its signatures (checked against its digest) and name."""
        if len(self._relied) != len(self.header.chunks):
            raise InvalidInput(f"upload ended after {len(self._relied)} of {len(self.header.chunks)} chunks")
        if name is not None:
            check_name(name)
        EncodedPack(self.header, [], tuple(signatures)).check_signatures()
        store, key = self.store, self.header.key
        for signature in signatures:  # before the commit, so the pack appears with them
            store.bucket.put(store._signatures_prefix(key) + signature.key_id, signature.to_json())
        created = not self._stored and store._commit(self.header, min(self._relied, default=float("inf")), self._recheck)
        if name is not None:
            store._point(self.header.model_fp, name, key)
        return key, created

    def abort(self) -> None:
        """Nothing to undo: the chunks uploaded so far are referenced by no header, and gc reclaims them."""


def _clear_at(seq: int) -> Callable[[Version | None], object]:
    """A register change that clears the register if its newest version is still ``seq``, else leaves it as it is."""
    return lambda current: None if current is not None and current.seq == seq else UNCHANGED


def _pack_of(rest: str) -> str:
    """The pack key at the start of a ``summaries/`` or ``signatures/`` object's name below its kind."""
    return "/".join(rest.split("/")[:3])


def _bound_record(key: str, etag: str, data: bytes | None) -> bytes | None:
    """The summary record in ``data`` (header ETag, newline, record) if it is whole and belongs to the header
    version with ``etag``; a damaged or stale one is made again from the header."""
    header_etag, _, record = (data or b"").partition(b"\n")
    if header_etag.decode(errors="replace") != etag:
        return None
    try:
        parse_summary(key, (), record)
    except IntegrityError:
        return None
    return record


def _is_name(ref: str) -> bool:
    try:
        check_name(ref)
    except InvalidInput:
        return False
    return True


if TYPE_CHECKING:  # mypy proves the tier is each interface its users take it as (isinstance checks only at run time)
    _served: type[ServedStore] = ObjectStore
    _migrated: type[BankRecords] = ObjectStore
    _namespaces: type[HoldsNamespaces] = ObjectStore
