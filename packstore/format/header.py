"""Pack header: the self-describing JSON record of a pack, and key derivation."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from packstore.errors import IntegrityError, InvalidInput, PackMismatch

FORMAT_NAME = "packstore-pack"
FORMAT_VERSION = 1
KINDS = ("knowledge",)
DTYPES = ("float32", "float16", "bfloat16")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def canonical_json(value: Any) -> bytes:
    """The one JSON encoding used for hashing and storage: sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def content_hash(token_ids: Iterable[int]) -> str:
    """sha256 of the prefix token ids as little-endian uint32: the same on every machine."""
    ids = list(token_ids)
    return sha256_hex(struct.pack(f"<{len(ids)}I", *ids))


def facts_digest(facts: Iterable[str]) -> str:
    """sha256 of the canonical JSON list of fact strings."""
    return sha256_hex(canonical_json(list(facts)))


def pack_key(model_fp: str, template_fp: str, token_ids: Iterable[int]) -> str:
    """The store key ``model_fp/template_fp/content_hash``."""
    return f"{model_fp}/{template_fp}/{content_hash(token_ids)}"


def parse_key(text: str) -> tuple[str, str, str] | None:
    """Split a full key into its three hex digests, or None if ``text`` is not a key."""
    parts = text.split("/")
    if len(parts) == 3 and all(_HEX64.match(p) for p in parts):
        return parts[0], parts[1], parts[2]
    return None


@dataclass(frozen=True)
class ChunkInfo:
    """One stored chunk of the body: which layers it holds, its sizes and its checksum."""

    first_layer: int
    stop_layer: int
    raw_bytes: int
    stored_bytes: int
    sha256: str


@dataclass(frozen=True)
class PackHeader:
    """Everything about a pack except its tensors. ``chunks`` is empty until the body is encoded."""

    kind: str
    model_fp: str
    template_fp: str
    model_name: str
    token_ids: tuple[int, ...]
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    facts: tuple[str, ...]
    raw: bool
    created: str
    parents: tuple[str, ...] = ()
    codec: str = ""
    chunks: tuple[ChunkInfo, ...] = field(default=())

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def content_hash(self) -> str:
        return content_hash(self.token_ids)

    @property
    def key(self) -> str:
        return pack_key(self.model_fp, self.template_fp, self.token_ids)

    @property
    def pack_sha256(self) -> str:
        """sha256 of the header without this field: it covers every chunk through the chunk digests."""
        return json.loads(self.to_json())["pack_sha256"]

    @property
    def raw_bytes(self) -> int:
        """Bytes of K and V once decoded."""
        return sum(c.raw_bytes for c in self.chunks)

    def to_json(self) -> bytes:
        record = asdict(self)
        record["chunks"] = [asdict(c) for c in self.chunks]
        record["format"] = FORMAT_NAME
        record["version"] = FORMAT_VERSION
        record["tokens"] = self.tokens
        record["content_hash"] = self.content_hash
        record["source_sha256"] = facts_digest(self.facts)
        record["pack_sha256"] = sha256_hex(canonical_json(record))
        return canonical_json(record)

    @classmethod
    def from_json(cls, data: bytes) -> "PackHeader":
        try:
            record = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise IntegrityError(f"pack header is not valid JSON: {exc}") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT_NAME:
            raise IntegrityError("not a packstore pack header")
        digest = record.pop("pack_sha256", None)
        if digest != sha256_hex(canonical_json(record)):
            raise IntegrityError("pack header is damaged: pack_sha256 does not match its contents")
        if record.get("version") != FORMAT_VERSION:
            raise IntegrityError(
                f"pack format version {record.get('version')!r} is not supported (this build reads {FORMAT_VERSION})"
            )
        try:
            header = cls(
                kind=record["kind"],
                model_fp=record["model_fp"],
                template_fp=record["template_fp"],
                model_name=record["model_name"],
                token_ids=tuple(int(t) for t in record["token_ids"]),
                layers=int(record["layers"]),
                kv_heads=int(record["kv_heads"]),
                head_dim=int(record["head_dim"]),
                dtype=record["dtype"],
                facts=tuple(record["facts"]),
                raw=bool(record["raw"]),
                created=record["created"],
                parents=tuple(record["parents"]),
                codec=record["codec"],
                chunks=tuple(ChunkInfo(**c) for c in record["chunks"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"pack header is malformed: {exc}") from None
        derived = {
            "tokens": header.tokens,
            "content_hash": header.content_hash,
            "source_sha256": facts_digest(header.facts),
        }
        for name, value in derived.items():
            if record.get(name) != value:
                raise IntegrityError(f"pack header field {name!r} does not match its contents")
        header.validate()
        return header

    def check_identities(self, model_fp: str | None, template_fp: str | None) -> None:
        """Raise PackMismatch naming the model or template when a caller states identities this pack lacks."""
        if model_fp and model_fp != self.model_fp:
            raise PackMismatch(
                "model",
                f"model mismatch: pack was built for model {self.model_name!r} (model_fp {self.model_fp[:12]}), "
                f"the caller's model has model_fp {model_fp[:12]}",
            )
        if template_fp and template_fp != self.template_fp:
            raise PackMismatch(
                "template",
                f"template mismatch: pack was built with template_fp {self.template_fp[:12]}, "
                f"the caller's tokenizer and chat template have template_fp {template_fp[:12]}",
            )

    def validate(self) -> None:
        """Reject headers whose fields are out of range (raises InvalidInput)."""
        if self.kind not in KINDS:
            raise InvalidInput(f"unknown pack kind {self.kind!r}")
        if self.dtype not in DTYPES:
            raise InvalidInput(f"unsupported dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        for name in ("model_fp", "template_fp"):
            if not _HEX64.match(getattr(self, name)):
                raise InvalidInput(f"{name} must be 64 lowercase hex digits")
        if not self.token_ids:
            raise InvalidInput("a pack needs at least one token")
        if min(self.layers, self.kv_heads, self.head_dim) <= 0:
            raise InvalidInput("layers, kv_heads and head_dim must be positive")
