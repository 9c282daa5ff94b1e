"""The records stores return: pack summaries and headers, listing pages, verify and gc reports, counts, routes.

No torch, no lmdb, no grpc: a client that only lists packs imports this and nothing heavy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packstore.format.header import PackHeader
    from packstore.format.signature import Signature


@dataclass(frozen=True)
class PackSummary:
    """What listing a pack shows: its identities and sizes, without token ids, facts or chunks.

    Stores keep this record beside the header so that listing never parses whole headers.
    """

    key: str
    names: tuple[str, ...]
    kind: str
    model_fp: str
    template_fp: str
    model_name: str
    tokens: int
    dtype: str
    raw: bool
    raw_bytes: int
    stored_bytes: int
    facts: int
    created: str
    parents: tuple[str, ...] = ()
    composition: str = "exact"

    @property
    def name(self) -> str | None:
        return self.names[0] if self.names else None

    def to_json(self) -> dict[str, Any]:
        """The public JSON record of ``build``, ``inspect`` and each ``ls`` entry (README, "Using packctl on your own facts and model")."""
        record = asdict(self)
        record["name"] = self.name
        record["names"] = list(self.names)
        record["parents"] = list(self.parents)
        return record


@dataclass(frozen=True)
class StoredPack:
    """A stored pack's full header, the names that point at it, its size on disk and its signatures."""

    header: PackHeader
    names: tuple[str, ...]
    stored_bytes: int
    signatures: tuple[Signature, ...] = ()

    @property
    def key(self) -> str:
        return self.header.key

    @property
    def summary(self) -> PackSummary:
        h = self.header
        return PackSummary(
            key=h.key,
            names=self.names,
            kind=h.kind,
            model_fp=h.model_fp,
            template_fp=h.template_fp,
            model_name=h.model_name,
            tokens=h.tokens,
            dtype=h.dtype,
            raw=h.raw,
            raw_bytes=h.raw_bytes,
            stored_bytes=self.stored_bytes,
            facts=len(h.facts),
            created=h.created,
            parents=tuple(h.parents),
            composition=h.composition,
        )


@dataclass(frozen=True)
class PackPage:
    """One page of a listing; ``next_token`` is empty on the last page."""

    packs: list[PackSummary]
    next_token: str = ""


@dataclass(frozen=True)
class VerifyResult:
    """One pack's integrity check: ``error`` is None when every byte checked out."""

    key: str
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class GcReport:
    """What ``gc`` removed, and the data file size before and after (compaction shrinks it)."""

    orphan_chunks: int
    orphan_chunk_bytes: int
    dangling_names: int
    file_bytes_before: int
    file_bytes_after: int
    compacted: bool


@dataclass(frozen=True)
class MigrateReport:
    """What copying one store into another did: packs in the source, those copied (the rest were
    there already), and the names and signatures added to packs that were there; the same for
    banks, and the banks not copied because one of the stores is a service (``grpc://``)."""

    packs: int
    copied: int
    names_set: int
    signatures_added: int
    banks: int
    banks_copied: int
    bank_signatures_added: int
    banks_skipped: tuple[str, ...]


@dataclass(frozen=True)
class Caller:
    """Who a service takes a client's calls to be: its token's name, its role (read, write, admin), its namespace."""

    token: str
    role: str
    namespace: str

    @property
    def may_write(self) -> bool:
        return self.role in ("write", "admin")


@dataclass(frozen=True)
class StoreCounts:
    """Running totals a store keeps in the same transactions as its writes (for metrics)."""

    packs: int
    stored_bytes: int


@dataclass
class Route:
    """Where a query went: the clusters probed, the best facts with their ranking scores, timings, and the second
    stage that reranked them (its name and its model files' digest) when one did."""

    query: str
    clusters: list[int]
    facts: list[tuple[str, float]]
    seconds: dict[str, float] = field(default_factory=dict)
    reranker: str = "none"
    reranker_fp: str = ""

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "query": self.query,
            "clusters": self.clusters,
            "facts": [{"text": text, "score": round(score, 6)} for text, score in self.facts],
        }
        if self.reranker != "none":
            found |= {"reranker": self.reranker, "reranker_fp": self.reranker_fp}
        return found
