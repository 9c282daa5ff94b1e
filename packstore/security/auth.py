"""Tokens, roles and namespaces: who may call the service, what they may do, and which namespace they see.

The tokens file (``serve --auth FILE``, TOML) lists ``[[token]]`` entries: ``name`` (shown in logs
instead of the token), ``sha256`` (hex digest of the token, never the token itself), ``namespaces``
(the namespaces it may use; ``"*"`` for all) and ``role`` (``read``, ``write`` or ``admin``). A call
carries ``authorization: Bearer <token>`` and, when its token has several namespaces, the one it
uses in ``x-packstore-namespace``. Without a tokens file every call is an admin in the namespace
``default``.
"""

from __future__ import annotations

import hashlib
import threading
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from packstore.errors import InvalidInput, PermissionDenied, Unauthenticated
from packstore.rpc.fields import NAMESPACE_HEADER
from packstore.store.namespaces import DEFAULT_NAMESPACE
from packstore.store.protocol import check_name

ROLES = ("read", "write", "admin")  # each may do what the ones before it may
ANY_NAMESPACE = "*"
_HEX64 = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Token:
    """One entry of the tokens file."""

    name: str
    sha256: str
    namespaces: tuple[str, ...]
    role: str

    def may_use(self, namespace: str) -> bool:
        return ANY_NAMESPACE in self.namespaces or namespace in self.namespaces


@dataclass(frozen=True)
class Principal:
    """Who a call is from and where it acts: the token's name (never the token), its role, the namespace."""

    token: str
    role: str
    namespace: str

    def require(self, role: str, method: str) -> None:
        if ROLES.index(self.role) < ROLES.index(role):
            article = "an" if role[0] in "aeiou" else "a"
            raise PermissionDenied(f"{method} needs {article} {role} token; token {self.token!r} is {self.role}")


def _check_token(entry: object, number: int, path: str) -> Token:
    where = f"{path}: token {number}"
    if not isinstance(entry, Mapping) or set(entry) != {"name", "sha256", "namespaces", "role"}:
        raise InvalidInput(f"{where} must have exactly name, sha256, namespaces and role")
    name, digest, namespaces, role = entry["name"], entry["sha256"], entry["namespaces"], entry["role"]
    if not isinstance(name, str) or not name.strip():
        raise InvalidInput(f"{where}: name must be a non-empty string")
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX64:
        raise InvalidInput(f"{where} ({name}): sha256 must be 64 lowercase hex digits (the token's digest, never the token)")
    if not isinstance(namespaces, list) or not namespaces:
        raise InvalidInput(f"{where} ({name}): namespaces must be a non-empty list")
    for namespace in namespaces:
        if namespace != ANY_NAMESPACE:
            try:
                check_name(namespace)
            except InvalidInput:
                raise InvalidInput(f"{where} ({name}): namespace {namespace!r} is not a valid name (or '*')") from None
    if role not in ROLES:
        raise InvalidInput(f"{where} ({name}): role must be one of {', '.join(ROLES)}")
    return Token(name, digest, tuple(namespaces), role)


def load_tokens(path: str | Path) -> dict[str, Token]:
    """The tokens of a tokens file by digest; InvalidInput naming the entry and field that are wrong."""
    try:
        table = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InvalidInput(f"tokens file {path}: {exc}") from None
    unknown = set(table) - {"token"}
    if unknown:
        raise InvalidInput(f"tokens file {path}: unknown table {sorted(unknown)[0]!r} (only [[token]] entries)")
    entries = table.get("token", [])
    if not isinstance(entries, list):
        raise InvalidInput(f"tokens file {path}: use [[token]] entries")
    tokens: dict[str, Token] = {}
    for number, entry in enumerate(entries, 1):
        token = _check_token(entry, number, str(path))
        if token.sha256 in tokens:
            raise InvalidInput(f"tokens file {path}: tokens {tokens[token.sha256].name!r} and {token.name!r} have the same sha256")
        tokens[token.sha256] = token
    return tokens


def bearer_secret(authorization: str) -> str | None:
    """The token of an ``authorization`` header value ``Bearer <token>``; None for another scheme or an empty token."""
    scheme, _, secret = authorization.partition(" ")
    return secret.strip() if scheme.lower() == "bearer" and secret.strip() else None


class Auth:
    """Authenticates calls against a tokens file (``path``), reloadable; with no file, everyone is admin in ``default``."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = str(path) if path else None
        self._lock = threading.Lock()
        self._tokens = load_tokens(path) if path else {}

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def reload(self) -> int:
        """Read the tokens file again (on SIGHUP); a file that does not parse leaves the old tokens in force.
        Returns how many tokens are in force."""
        if self.path is None:
            return 0
        tokens = load_tokens(self.path)
        with self._lock:
            self._tokens = tokens
        return len(tokens)

    def token_of(self, secret: str) -> Token | None:
        """The token entry for ``secret`` (a token as a caller sends it), or None if the file has none."""
        with self._lock:
            return self._tokens.get(hashlib.sha256(secret.encode()).hexdigest())

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]], method: str, role: str) -> Principal:
        """The principal a call with ``metadata`` acts as, checked for ``role``; Unauthenticated without a
        known token, PermissionDenied for a role or namespace the token does not have."""
        headers = {key.lower(): value for key, value in metadata if isinstance(value, str)}
        if self.path is None:
            return Principal("anonymous", "admin", DEFAULT_NAMESPACE)
        secret = bearer_secret(headers.get("authorization", ""))
        if secret is None:
            raise Unauthenticated(f"{method} needs a token: send 'authorization: Bearer <token>'")
        token = self.token_of(secret)
        if token is None:
            raise Unauthenticated("unknown token")
        asked = headers.get(NAMESPACE_HEADER)
        if asked is None:
            mine = [n for n in token.namespaces if n != ANY_NAMESPACE]
            if len(mine) != 1 or ANY_NAMESPACE in token.namespaces:
                raise InvalidInput(f"token {token.name!r} may use several namespaces: name one in the {NAMESPACE_HEADER} header")
            asked = mine[0]
        check_name(asked, "namespace")  # before anything quotes it or counts under it
        if not token.may_use(asked):
            raise PermissionDenied(f"token {token.name!r} may not use namespace {asked!r}")
        principal = Principal(token.name, token.role, asked)
        principal.require(role, method)
        return principal
