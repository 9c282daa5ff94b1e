"""The S3 calls the object tier makes, with botocore's failures turned into packstore errors.

Any server speaking the S3 API serves (AWS S3, Ceph RGW, MinIO, SeaweedFS). Credentials come from
boto3's standard chain (environment, shared files, instance roles); the endpoint from the caller
or ``AWS_ENDPOINT_URL_S3``. Every call is retried with exponential backoff and jitter (botocore's
"standard" mode: connection errors, throttling, 5xx), which is safe for each call made here: reads
and deletes are idempotent, chunk and summary writes put the same bytes under the same name, and a
create-only write (``If-None-Match: *``) whose first attempt landed but whose answer was lost gets
412 on the retry, which its caller resolves by reading what is there (docs/operations.md,
"Object store tier").
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from packstore.errors import PackstoreError, PermissionDenied, StoreNotFound, Unauthenticated, Unavailable

T = TypeVar("T")
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "403"}
_ABSENT = {"NoSuchKey", "404", "NotFound"}
_CONFLICT = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
DELETE_BATCH = 1000  # the most DeleteObjects takes at once


class Conflict(Exception):
    """A conditional write found the object in another state than it required (HTTP 412 or 409)."""


@dataclass(frozen=True)
class Listed:
    """One object of a listing: its name below the store's root, size, ETag (without quotes) and time."""

    name: str
    size: int
    etag: str
    modified: datetime


@dataclass(frozen=True)
class Head:
    """What HEAD says of an object: its ETag, when it was last written, and the server's time now."""

    etag: str
    modified: datetime
    now: datetime


def split_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> (bucket, prefix without surrounding slashes)."""
    if not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
        raise ValueError(f"object store URL {url!r} must look like s3://BUCKET/PREFIX")
    bucket, _, prefix = url[5:].partition("/")
    return bucket, prefix.strip("/")


class Bucket:
    """Objects under one prefix of one bucket; names passed in are relative to that prefix."""

    def __init__(self, url: str, *, endpoint: str | None = None, retries: int = 5, timeout: float = 60.0) -> None:
        """``retries``: attempts per call (1 = no retry); ``timeout``: seconds to connect, and to wait for each read."""
        self.bucket, prefix = split_url(url)
        self.root = f"{prefix}/" if prefix else ""
        self.endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or None
        config = Config(
            retries={"mode": "standard", "max_attempts": retries},
            connect_timeout=min(timeout, 10.0),
            read_timeout=timeout,
            max_pool_connections=32,
        )
        self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint, config=config)
        self.where = f"bucket {self.bucket!r} at {self.endpoint or 'the default S3 endpoint'}"

    def _call(self, operation: Callable[..., T], **params: Any) -> T:
        """Run one S3 call; absent and conflict answers are left to the caller, the rest become packstore errors."""
        try:
            return operation(Bucket=self.bucket, **params)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                raise StoreNotFound(f"{self.where} does not exist; create it first", bucket=self.bucket) from None
            if code in _DENIED or status == 403:
                raise PermissionDenied(f"the object store refused access to {self.where}: {code} ({error.get('Message', '')})") from None
            if code in _CONFLICT or status in (409, 412):
                raise Conflict(code) from None
            if code in _ABSENT or status == 404:
                raise
            if status is not None and status >= 500 or code in ("SlowDown", "RequestTimeout", "ServiceUnavailable"):
                raise Unavailable(f"the object store keeps failing for {self.where}: {code} ({error.get('Message', '')})") from None
            raise PackstoreError(f"the object store answered {code} for {self.where}: {error.get('Message', '')}") from None
        except NoCredentialsError:
            raise Unauthenticated(
                f"no S3 credentials found for {self.where} (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)"
            ) from None
        except BotoCoreError as exc:  # connection refused, DNS, timeouts: after the retries
            raise Unavailable(f"the object store is unreachable for {self.where}: {exc}") from None

    @staticmethod
    def _absent(exc: ClientError) -> bool:
        status: object = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status == 404

    def check(self) -> None:
        """Raise StoreNotFound, PermissionDenied or Unavailable unless the bucket is there and ours to use."""
        try:
            self._call(self._client.head_bucket)
        except ClientError:
            raise StoreNotFound(f"{self.where} does not exist; create it first", bucket=self.bucket) from None

    def get(self, name: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) of an object, or None if there is none."""
        try:
            answer = self._call(self._client.get_object, Key=self.root + name)
        except ClientError as exc:
            if self._absent(exc):
                return None
            raise
        try:
            return answer["Body"].read(), answer["ETag"].strip('"')
        except BotoCoreError as exc:
            raise Unavailable(f"the object store went away while sending {name} from {self.where}: {exc}") from None

    def head(self, name: str) -> Head | None:
        """An object's ETag and age, or None if there is none."""
        try:
            answer = self._call(self._client.head_object, Key=self.root + name)
        except ClientError as exc:
            if self._absent(exc):
                return None
            raise
        return Head(answer["ETag"].strip('"'), answer["LastModified"], server_time(answer))

    def put(self, name: str, data: bytes, *, create_only: bool = False) -> tuple[str, datetime]:
        """Write an object; ``create_only`` sends ``If-None-Match: *`` (Conflict if it exists).
        Returns its ETag and the server's time."""
        extra = {"IfNoneMatch": "*"} if create_only else {}
        answer = self._call(self._client.put_object, Key=self.root + name, Body=data, **extra)
        return answer["ETag"].strip('"'), server_time(answer)

    def now(self) -> datetime:
        """The object store's clock (every age the tier compares is on this one clock)."""
        return server_time(self._call(self._client.list_objects_v2, MaxKeys=1, Prefix=self.root))

    def delete(self, names: list[str]) -> None:
        """Remove objects (absent ones are no error), in batches."""
        for start in range(0, len(names), DELETE_BATCH):
            batch = [{"Key": self.root + name} for name in names[start : start + DELETE_BATCH]]
            answer = self._call(self._client.delete_objects, Delete={"Objects": batch, "Quiet": True})
            failed = [e for e in answer.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if failed:
                raise Unavailable(f"the object store did not delete {len(failed)} objects in {self.where}: {failed[0].get('Code')}")

    def list(self, prefix: str, *, after: str = "") -> Iterator[Listed]:
        """Objects whose names start with ``prefix`` and sort after ``after``, in name order (lazily, 1000 a call)."""
        params: dict[str, Any] = {"Prefix": self.root + prefix}
        if after:
            params["StartAfter"] = self.root + after
        while True:
            answer = self._call(self._client.list_objects_v2, **params)
            for item in answer.get("Contents", []):
                yield Listed(item["Key"][len(self.root) :], item["Size"], item["ETag"].strip('"'), item["LastModified"])
            if not answer.get("IsTruncated"):
                return
            params["ContinuationToken"] = answer["NextContinuationToken"]
            params.pop("StartAfter", None)

    def holds(self, prefix: str) -> bool:
        """Whether any object's name starts with ``prefix`` (a listing of at most one name)."""
        answer = self._call(self._client.list_objects_v2, Prefix=self.root + prefix, MaxKeys=1)
        return bool(answer.get("Contents"))

    def folders(self, prefix: str) -> builtins.list[str]:
        """The next path segment of every object below ``prefix`` (``Delimiter="/"``), in order."""
        params: dict[str, Any] = {"Prefix": self.root + prefix, "Delimiter": "/"}
        found = []
        while True:
            answer = self._call(self._client.list_objects_v2, **params)
            found += [p["Prefix"][len(self.root + prefix) :].rstrip("/") for p in answer.get("CommonPrefixes", [])]
            if not answer.get("IsTruncated"):
                return found
            params["ContinuationToken"] = answer["NextContinuationToken"]


def server_time(answer: dict[str, Any]) -> datetime:
    """The ``Date`` the server stamped its answer with."""
    return parsedate_to_datetime(answer["ResponseMetadata"]["HTTPHeaders"]["date"])
