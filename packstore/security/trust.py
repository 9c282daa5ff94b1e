"""Ed25519 key files, signing, and the trusted-keys policy (docs/format.md §8, docs/operations.md "Signed packs").

``KEY`` is a PKCS#8 PEM private key (written 0600), ``KEY.pub`` its SubjectPublicKeyInfo PEM; a
trusted-keys file is any number of such public-key PEM blocks, one after another (lines outside the
blocks are comments).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from packstore.errors import InvalidInput, Untrusted
from packstore.format.signature import Signature, key_id

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

_PEM_BLOCK = re.compile(rb"-----BEGIN PUBLIC KEY-----.*?-----END PUBLIC KEY-----", re.S)


def _raw_public(public_key: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def generate_key(out: str | os.PathLike[str]) -> tuple[Path, Path, str]:
    """Write a new Ed25519 key pair to ``out`` (private, mode 0600) and ``out.pub``; returns both paths and the key id.
    Refuses to overwrite either file."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

    private_path = Path(out)
    public_path = private_path.with_name(private_path.name + ".pub")
    for path in (private_path, public_path):
        if path.exists():
            raise InvalidInput(f"{path} exists: keygen never overwrites a key")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    public_pem = key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    try:
        descriptor = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as private_file:
            private_file.write(private_pem)
        public_path.write_bytes(public_pem)
    except OSError as exc:
        raise InvalidInput(f"cannot write the key pair at {private_path}: {exc.strerror}") from None
    return private_path, public_path, key_id(_raw_public(key.public_key()))


@dataclass(frozen=True)
class SigningKey:
    """A private key read from a KEY file."""

    key: Ed25519PrivateKey

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        try:
            key = load_pem_private_key(Path(path).read_bytes(), password=None)
        except OSError as exc:
            raise InvalidInput(f"cannot read key {path}: {exc.strerror}") from None
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"{path} is not an unencrypted PEM private key: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise InvalidInput(f"{path} is not an Ed25519 key")
        return cls(key)

    @property
    def key_id(self) -> str:
        return key_id(_raw_public(self.key.public_key()))

    def sign(self, subject: str, digest: str) -> Signature:
        """A signature record over ``subject``/``digest`` (docs/format.md §8)."""
        from packstore.format.signature import signed_message

        return Signature(
            subject=subject,
            digest=digest,
            public_key=_raw_public(self.key.public_key()),
            signature=self.key.sign(signed_message(subject, digest)),
            created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )


@dataclass(frozen=True)
class TrustedKeys:
    """The public keys whose signatures make a pack trusted, by key id."""

    keys: frozenset[str]
    source: str = ""

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TrustedKeys:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        from cryptography.hazmat.primitives.serialization import load_pem_public_key

        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise InvalidInput(f"cannot read trusted keys {path}: {exc.strerror}") from None
        ids = set()
        for number, block in enumerate(_PEM_BLOCK.findall(data), 1):
            try:
                key = load_pem_public_key(block)
            except ValueError as exc:
                raise InvalidInput(f"{path}: public key {number} is not valid PEM: {exc}") from None
            if not isinstance(key, Ed25519PublicKey):
                raise InvalidInput(f"{path}: public key {number} is not an Ed25519 key")
            ids.add(key_id(_raw_public(key)))
        if not ids:
            raise InvalidInput(f"{path}: holds no public key (PEM blocks 'BEGIN PUBLIC KEY')")
        return cls(frozenset(ids), str(path))

    def problem(self, subject: str, digest: str, signatures: Iterable[Signature]) -> str | None:
        """None when a trusted key's valid signature covers ``digest``; else why not, in a few words."""
        signatures = list(signatures)
        if not signatures:
            return "unsigned"
        mine = [s for s in signatures if s.subject == subject and s.digest == digest]
        if any(s.key_id in self.keys and s.valid() for s in mine):
            return None
        if not mine or not any(s.valid() for s in mine):
            return "its signatures do not verify for its current contents"
        return "signed only by untrusted keys " + ", ".join(sorted(s.key_id[:16] for s in mine))

    def require(self, what: str, subject: str, digest: str, signatures: Iterable[Signature]) -> None:
        """Raise Untrusted naming ``what`` unless a trusted key signed ``digest``."""
        problem = self.problem(subject, digest, signatures)
        if problem is not None:
            raise Untrusted(f"{what} is not trusted: {problem} (trusted keys: {self.source or 'given'})", ref=what)
