"""packctl: build, ask with, list, inspect and remove knowledge packs (README, "Using packctl on your own facts and model").

Each command group lives in its own module; this one builds the parser from them and runs a command.
The model-side handlers are imported only when their command runs, so the store commands start
without torch.
"""

from __future__ import annotations

import sys

from packstore.cli import banks, keys, model_args, packs
from packstore.cli.program import CommandLine


def build_cli() -> CommandLine:
    """The packctl parser: every command group's commands and their arguments."""
    cli = CommandLine("packctl", "Build, store and use knowledge packs (pre-computed KV caches).", client=True)
    for group in (model_args, packs, keys, banks):
        group.add_commands(cli)
    return cli


def main(argv: list[str] | None = None) -> int:
    """Run one packctl command; returns its exit code."""
    return build_cli().main(argv)


if __name__ == "__main__":
    sys.exit(main())
