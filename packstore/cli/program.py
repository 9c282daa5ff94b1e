"""The frame of both console scripts: global options, running a subcommand (a PackstoreError becomes one line and an
exit code), and output for machines and people."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from packstore import __version__
from packstore.cli.store_options import connection_options
from packstore.errors import PackstoreError
from packstore.extras import missing_extra

EXIT_ERROR = 1


def global_options(add_defaults: bool, *, client: bool = False) -> argparse.ArgumentParser:
    """``--store`` and ``--json`` (and with ``client`` the connection options), accepted before or after the subcommand."""
    parser = argparse.ArgumentParser(add_help=False)
    default = None if add_defaults else argparse.SUPPRESS
    parser.add_argument(
        "--store",
        default=default,
        metavar="PATH",
        help=(
            "pack store directory, grpc://HOST:PORT / grpcs://HOST:PORT (TLS), or s3://BUCKET/PREFIX"
            " (default: $PACKSTORE_STORE, else a per-user data dir)"
        ),
    )
    if client:
        connection_options(parser, default=default)
    parser.add_argument(
        "--json", action="store_true", default=False if add_defaults else argparse.SUPPRESS, help="machine-readable output on stdout"
    )
    parser.add_argument("--quiet", "-q", action="store_true", default=False if add_defaults else argparse.SUPPRESS, help="no progress bars")
    return parser


def deferred(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The handler ``module.name``, imported only when its command runs: parsing, ``--help`` and the other
    commands never load what it needs (torch, the model side)."""

    def handler(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), name)(args)

    return handler


def emit_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False), flush=True)


def progress(args: argparse.Namespace) -> bool:
    """Whether to draw progress bars: not with ``--quiet``, and only for a person at a terminal."""
    return not args.quiet and sys.stderr.isatty()


def human_bytes(n: float) -> str:
    """``n`` bytes as a person reads them: B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def fail(program: str, message: str) -> int:
    print(f"{program}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_ERROR


def run_command(program: str, handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a subcommand; a PackstoreError, or a missing module of an extra this installation lacks, becomes one line
    on stderr and a non-zero exit."""
    try:
        return handler(args)
    except PackstoreError as exc:
        return fail(program, str(exc))
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc)
        if extra is None:
            raise
        return fail(program, str(extra))
    except KeyboardInterrupt:
        return fail(program, "interrupted")
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR


class CommandLine:
    """A program whose subcommands all take the global options; ``main`` runs one and returns its exit code."""

    def __init__(self, prog: str, description: str, *, client: bool = False) -> None:
        self.prog = prog
        self.client = client
        self.parser = argparse.ArgumentParser(
            prog=prog, description=description, parents=[global_options(add_defaults=True, client=client)]
        )
        self.parser.add_argument("--version", action="version", version=f"{prog} {__version__}")
        self._commands = self.parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
        self._common = global_options(add_defaults=False, client=client)

    def command(self, name: str, handler: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        parser = self._commands.add_parser(name, parents=[self._common], help=help, description=help)
        parser.set_defaults(handler=handler)
        return parser

    def main(self, argv: list[str] | None = None) -> int:
        args = self.parser.parse_args(argv)
        return run_command(self.prog, args.handler, args)
