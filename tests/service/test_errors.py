"""Typed errors: stable codes, and the same class with the same fields on both sides of gRPC."""

from __future__ import annotations

import ast
import re
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from packstore import errors
from packstore.errors import ERROR_CLASSES, PackMismatch, PackstoreError
from packstore.rpc.channel import GrpcClient
from packstore.rpc.status import abort_with_error, status_for
from tools.lib.servers import free_port

SAMPLES: list[PackstoreError] = [
    errors.PackNotFound("no pack named 'x'", ref="x"),
    errors.AmbiguousRef("name 'x' exists for 2 models; use the full key or state the model", ref="x", matches=2),
    PackMismatch("embedder", "embedder mismatch: bank 'b' was built with 'e1'"),
    PackMismatch("template", "template mismatch: ...", expected="ab", got="cd"),
    errors.IntegrityError("pack k: chunk 3 is damaged"),
    errors.InvalidInput("the query is empty"),
    errors.LimitExceeded("pack of 5 bytes exceeds the limit of 4"),
    errors.StoreBusy("store s is open in another process"),
    errors.Unavailable("server went away"),
    errors.MissingExtra("torch is not installed: this needs packstore's 'model' extra", extra="model", module="torch"),
    PackstoreError("internal error: boom"),
]


def test_every_error_class_has_a_unique_code_and_a_real_status() -> None:
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, PackstoreError)]
    assert sorted(ERROR_CLASSES) == sorted(c.code for c in classes)
    assert len({c.code for c in classes}) == len(classes)
    for cls in classes:
        assert isinstance(grpc.StatusCode[cls.grpc_status], grpc.StatusCode)


@pytest.fixture(scope="module")
def raising_server():
    """An in-process server whose one method aborts with SAMPLES[i] for request byte i."""

    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        abort_with_error(context, SAMPLES[request[0]])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(handle, request_deserializer=bytes, response_serializer=bytes)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Errors", {"Raise": handler})])
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    yield address
    server.stop(0)


@pytest.mark.parametrize("index", range(len(SAMPLES)), ids=[type(e).__name__ + ":" + e.fields.get("what", "") for e in SAMPLES])
def test_errors_cross_grpc_with_class_status_and_fields(raising_server: str, index: int) -> None:
    sent = SAMPLES[index]
    with GrpcClient(raising_server) as client:
        call = client._channel.unary_unary("/test.Errors/Raise", request_serializer=bytes, response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as raw:
            call(bytes([index]))
        assert raw.value.code() == status_for(sent) and raw.value.details() == str(sent)
        with pytest.raises(PackstoreError) as received:
            client._call(lambda: call(bytes([index])))
    assert type(received.value) is type(sent)
    assert (str(received.value), received.value.fields) == (str(sent), sent.fields)
    if isinstance(sent, PackMismatch):
        assert received.value.what == sent.what


def test_an_unreachable_server_is_unavailable() -> None:
    with GrpcClient(f"127.0.0.1:{free_port()}", timeout=2) as client:
        call = client._channel.unary_unary("/test.Errors/Raise", request_serializer=bytes, response_deserializer=bytes)
        with pytest.raises(errors.Unavailable, match="is unavailable"):
            client._call(lambda: call(b"\0"))


def test_library_errors_do_not_name_command_line_flags() -> None:
    """Messages raised outside packstore/cli must make sense to a Python caller too."""
    root = Path(errors.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if "cli" in path.parts or "v1" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                text = ast.unparse(node.exc)
                if re.search(r"(?<!pip install )--[a-z]", text):  # pip's own flags in an install hint are fine
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}: {text[:80]}")
    assert not offenders, "\n".join(offenders)
