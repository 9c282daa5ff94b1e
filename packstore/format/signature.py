"""Detached Ed25519 signatures over a pack's (or a bank's) sealed digest (docs/format.md §8).

A signature record is canonical JSON: the algorithm, the signer's public key (raw 32 bytes, base64)
and its id (sha256 of those bytes), what is signed (``subject`` and its ``digest``), and the 64-byte
signature over ``signed_message(subject, digest)``. A pack's digest is its ``pack_sha256``, which
covers the header and, through the chunk digests, every byte of the body, so one signature vouches
for the whole pack. Pure bytes: no I/O; key files are read by ``packstore.security.trust``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from packstore.errors import IntegrityError, InvalidInput
from packstore.format.header import canonical_json

ALGORITHM = "ed25519"
SUBJECTS = ("pack", "bank")
DOMAIN = "packstore-signature-v1"
MAX_SIGNATURE_BYTES = 4096  # a record is about 300 bytes
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIELDS = ("algorithm", "created", "digest", "key_id", "public_key", "signature", "subject")


def signed_message(subject: str, digest: str) -> bytes:
    """The bytes an Ed25519 key signs: a domain tag, the subject kind and its hex digest."""
    return f"{DOMAIN}:{subject}:{digest}".encode("ascii")


def key_id(public_key: bytes) -> str:
    """The id of a raw 32-byte Ed25519 public key: its sha256, hex."""
    return hashlib.sha256(public_key).hexdigest()


@dataclass(frozen=True)
class Signature:
    """One signer's signature over one pack's or bank's digest."""

    subject: str
    digest: str
    public_key: bytes
    signature: bytes
    created: str
    algorithm: str = ALGORITHM

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)

    def to_json(self) -> bytes:
        record = asdict(self) | {
            "public_key": base64.b64encode(self.public_key).decode(),
            "signature": base64.b64encode(self.signature).decode(),
            "key_id": self.key_id,
        }
        return canonical_json(record)

    @classmethod
    def from_json(cls, data: bytes | str) -> Signature:
        """Parse a record strictly: exact fields and types, valid base64 of the right lengths, a matching key id."""
        if len(data) > MAX_SIGNATURE_BYTES:
            raise InvalidInput(f"signature record of {len(data)} bytes exceeds {MAX_SIGNATURE_BYTES}")
        try:
            record = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidInput(f"signature record is not JSON: {exc}") from None
        if not isinstance(record, dict) or tuple(sorted(record)) != _FIELDS:
            raise InvalidInput(f"signature record must have exactly the fields {', '.join(_FIELDS)}")
        if record["algorithm"] != ALGORITHM or record["subject"] not in SUBJECTS:
            raise InvalidInput(f"signature record: algorithm must be {ALGORITHM!r} and subject one of {', '.join(SUBJECTS)}")
        if not isinstance(record["digest"], str) or not _HEX64.fullmatch(record["digest"]):
            raise InvalidInput("signature record: digest must be 64 lowercase hex digits")
        if not isinstance(record["created"], str) or len(record["created"]) > 64:
            raise InvalidInput("signature record: created must be a string of at most 64 characters")
        public_key, signature = _bytes(record, "public_key", 32), _bytes(record, "signature", 64)
        parsed = cls(record["subject"], record["digest"], public_key, signature, record["created"])
        if record["key_id"] != parsed.key_id:
            raise InvalidInput("signature record: key_id is not the sha256 of its public key")
        return parsed

    def valid(self) -> bool:
        """Whether the signature verifies under its own public key (trust is a separate question)."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            Ed25519PublicKey.from_public_bytes(self.public_key).verify(self.signature, signed_message(self.subject, self.digest))
        except (InvalidSignature, ValueError):
            return False
        return True

    def check(self, subject: str, digest: str) -> Signature:
        """Raise IntegrityError unless this signs exactly ``subject``/``digest`` and verifies."""
        if (self.subject, self.digest) != (subject, digest):
            raise IntegrityError(f"signature by key {self.key_id[:16]} is for another {self.subject} (digest {self.digest[:16]})")
        if not self.valid():
            raise IntegrityError(f"signature by key {self.key_id[:16]} does not verify")
        return self


def _bytes(record: dict[str, Any], field: str, length: int) -> bytes:
    value = record[field]
    try:
        data = base64.b64decode(value, validate=True) if isinstance(value, str) else b""
    except (binascii.Error, ValueError):
        data = b""
    if len(data) != length:
        raise InvalidInput(f"signature record: {field} must be base64 of {length} bytes")
    return data
