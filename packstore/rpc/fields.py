"""What both ends of the gRPC API spell alike beside the bytes: the metadata key a caller names its namespace in, and
signature records (JSON strings) read back into Signatures."""

from __future__ import annotations

from collections.abc import Iterable

from packstore.errors import InvalidInput
from packstore.format.signature import Signature

NAMESPACE_HEADER = "x-packstore-namespace"  # the metadata a caller names its namespace in


def signatures_of(records: Iterable[str]) -> tuple[Signature, ...]:
    """Signature records (JSON strings) as Signatures; InvalidInput naming the first malformed one."""
    found = []
    for index, record in enumerate(records):
        try:
            found.append(Signature.from_json(record))
        except InvalidInput as exc:
            raise InvalidInput(f"signature {index}: {exc}") from None
    return tuple(found)
