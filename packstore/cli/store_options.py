"""The store a command names: ``--store`` and the options to reach it (TLS files, token, namespace, the object store's
endpoint), made into one ``StoreSpec`` and opened by ``packstore.store.open_store``."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from packstore.rpc.channel import Connection
from packstore.store import PackStore, StoreSpec, open_store


def connection_options(parser: argparse.ArgumentParser, *, default: Any = None, prefix: str = "") -> None:
    """How a client reaches a service: TLS files, token file, namespace (each also from the environment)."""
    what = "the store's" if prefix else "a grpcs:// server's"
    parser.add_argument(
        f"--{prefix}tls-ca", default=default, metavar="FILE", help=f"CA certificate to trust for {what} TLS ($PACKSTORE_TLS_CA)"
    )
    parser.add_argument(
        f"--{prefix}tls-client-cert", default=default, metavar="FILE", help="client certificate for mutual TLS ($PACKSTORE_TLS_CLIENT_CERT)"
    )
    parser.add_argument(f"--{prefix}tls-client-key", default=default, metavar="FILE", help="its private key ($PACKSTORE_TLS_CLIENT_KEY)")
    if not prefix:
        parser.add_argument("--token-file", default=default, metavar="FILE", help="bearer token to send (default: $PACKSTORE_TOKEN)")
        parser.add_argument(
            "--namespace",
            default=default,
            metavar="NS",
            help="namespace, when the token has several, or of an s3:// store ($PACKSTORE_NAMESPACE)",
        )
        parser.add_argument(
            "--s3-endpoint",
            default=default,
            metavar="URL",
            help="endpoint of an s3:// store ($PACKSTORE_S3_ENDPOINT, else $AWS_ENDPOINT_URL_S3, else AWS S3)",
        )


def connection_of(args: argparse.Namespace, prefix: str = "") -> Connection:
    """The Connection the parsed options (``prefix``: ``store_`` for the worker's own store) and the environment give."""

    def given(name: str) -> str | None:
        return getattr(args, f"{prefix}{name}", None)

    return Connection.from_env(
        token_file=getattr(args, "token_file", None),
        tls_ca=given("tls_ca"),
        tls_client_cert=given("tls_client_cert"),
        tls_client_key=given("tls_client_key"),
        namespace=getattr(args, "namespace", None),
    )


def spec_of(args: argparse.Namespace, *, prefix: str = "", location: str | None = None) -> StoreSpec:
    """The store ``--store`` (or ``location``) names, with the options that reach it (``prefix``: ``store_`` for the
    worker's own store's TLS files)."""
    spec = StoreSpec.of(location or args.store, s3_endpoint=getattr(args, "s3_endpoint", None), namespace=getattr(args, "namespace", None))
    return replace(spec, connection=connection_of(args, prefix)) if spec.tier == "grpc" else spec  # a token file is read only if used


def store_of(args: argparse.Namespace, *, readonly: bool = False, location: str | None = None) -> PackStore:
    """The store ``--store`` (or ``location``) names, opened."""
    return open_store(spec_of(args, location=location), readonly=readonly)
