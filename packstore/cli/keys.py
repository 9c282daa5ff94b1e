"""packctl keygen: the Ed25519 key pairs that sign packs and banks (``packctl sign``, ``packctl bank sign``)."""

from __future__ import annotations

import argparse

from packstore.cli.program import CommandLine, emit_json
from packstore.security.trust import generate_key


def cmd_keygen(args: argparse.Namespace) -> int:
    private, public, key_id = generate_key(args.out)
    if args.json:
        emit_json({"private_key": str(private), "public_key": str(public), "key_id": key_id})
    else:
        print(f"wrote {private} (private, mode 0600) and {public}; key id {key_id}")
    return 0


def add_commands(cli: CommandLine) -> None:
    """``keygen``, with its arguments."""
    p = cli.command("keygen", cmd_keygen, "write a new Ed25519 key pair: KEY (private, 0600) and KEY.pub")
    p.add_argument("--out", required=True, metavar="KEY")
