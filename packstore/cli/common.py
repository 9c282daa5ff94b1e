"""What both console scripts share: global options, output, and turning errors into exit codes."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from packstore import __version__
from packstore.errors import PackstoreError

EXIT_ERROR = 1


def global_options(add_defaults: bool) -> argparse.ArgumentParser:
    """``--store`` and ``--json``, accepted before or after the subcommand."""
    parser = argparse.ArgumentParser(add_help=False)
    default = None if add_defaults else argparse.SUPPRESS
    parser.add_argument(
        "--store",
        default=default,
        metavar="PATH",
        help="pack store directory (default: $PACKSTORE_STORE, else a per-user data dir)",
    )
    parser.add_argument("--json", action="store_true", default=False if add_defaults else argparse.SUPPRESS, help="machine-readable output on stdout")
    parser.add_argument("--quiet", "-q", action="store_true", default=False if add_defaults else argparse.SUPPRESS, help="no progress bars")
    return parser


def emit_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False), flush=True)


def fail(program: str, message: str) -> int:
    print(f"{program}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_ERROR


def run_command(program: str, handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a subcommand; a PackstoreError becomes one line on stderr and a non-zero exit."""
    try:
        return handler(args)
    except PackstoreError as exc:
        return fail(program, str(exc))
    except KeyboardInterrupt:
        return fail(program, "interrupted")
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR


class CommandLine:
    """A program whose subcommands all take the global options; ``main`` runs one and returns its exit code."""

    def __init__(self, prog: str, description: str) -> None:
        self.prog = prog
        self.parser = argparse.ArgumentParser(prog=prog, description=description, parents=[global_options(add_defaults=True)])
        self.parser.add_argument("--version", action="version", version=f"{prog} {__version__}")
        self._commands = self.parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
        self._common = global_options(add_defaults=False)

    def command(self, name: str, handler: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        parser = self._commands.add_parser(name, parents=[self._common], help=help, description=help)
        parser.set_defaults(handler=handler)
        return parser

    def main(self, argv: list[str] | None = None) -> int:
        args = self.parser.parse_args(argv)
        return run_command(self.prog, args.handler, args)
