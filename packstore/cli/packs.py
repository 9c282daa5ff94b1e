"""packctl's pack commands: list, inspect, verify, sign, export, import, remove, collect garbage, back up and
migrate stores. None needs a model, so this module imports nothing heavy: no torch, no transformers."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import Any

from packstore.cli.program import EXIT_ERROR, CommandLine, emit_json, human_bytes
from packstore.cli.store_options import spec_of, store_of
from packstore.errors import InvalidInput
from packstore.packs.admin import export_pack, import_pack, pack_details, pack_summary, sign_pack, verify_packs
from packstore.packs.backup import backup
from packstore.security.trust import SigningKey, TrustedKeys
from packstore.store.protocol import DEFAULT_PAGE


def _print_summary(record: dict[str, Any]) -> None:
    """The first lines ``inspect`` shows a person: key, names, kind, model, size and parents."""
    names = ", ".join(record["names"]) or "-"
    print(f"key:          {record['key']}")
    print(f"names:        {names}")
    print(f"kind:         {record['kind']}{' (raw: built without chat template)' if record['raw'] else ''}")
    print(f"model:        {record['model_name']}  model_fp {record['model_fp'][:16]}…")
    print(f"template_fp:  {record['template_fp'][:16]}…")
    print(f"tokens:       {record['tokens']}  ({record['dtype']})")
    print(f"size:         {human_bytes(record['raw_bytes'])} KV, {human_bytes(record['stored_bytes'])} stored")
    if record["parents"]:
        approximate = "" if record["composition"] == "exact" else " (approximate: answers may differ from the facts as prompt text)"
        print(f"composition:  {record['composition']}{approximate}")
        print("parents:      " + "\n              ".join(record["parents"]))


def cmd_ls(args: argparse.Namespace) -> int:
    """One page of packs in key order (``--limit``, default 100), or every pack with ``--all``.

    A page by default because listing a large store whole takes seconds (docs/benchmarks.md, "Listing") while a
    page costs what one pack costs.
    """
    if args.all and (args.limit is not None or args.page_token is not None):
        raise InvalidInput("--all lists every pack: it takes neither --limit nor --page-token")
    with store_of(args) as store:
        if args.all:
            summaries, next_token = store.list(), ""
        else:
            page = store.list_page(page_size=DEFAULT_PAGE if args.limit is None else args.limit, page_token=args.page_token or "")
            summaries, next_token = page.packs, page.next_token
    records = [summary.to_json() for summary in summaries]
    if next_token:
        print(f"more packs follow: next page with --page-token {next_token} (--all lists every pack)", file=sys.stderr)
    if args.json:
        emit_json({"packs": records, "next_page_token": next_token})
        return 0
    if not records:
        print("no packs", file=sys.stderr)
        return 0
    print(f"{'NAME':<20} {'KIND':<10} {'TOKENS':>7} {'DTYPE':<9} {'RAW':<4} {'DERIVED':<10} {'STORED':>10}  {'MODEL':<14} CONTENT HASH")
    for r in records:
        derived = f"{r['composition']}:{len(r['parents'])}" if r["parents"] else "-"
        print(
            f"{(r['name'] or '-'):<20} {r['kind']:<10} {r['tokens']:>7} {r['dtype']:<9} {('yes' if r['raw'] else 'no'):<4} "
            f"{derived:<10} {human_bytes(r['stored_bytes']):>10}  {r['model_name'][:14]:<14} {r['key'].rsplit('/', 1)[1][:16]}"
        )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    with store_of(args, readonly=True) as store:
        stored = store.stat(args.ref)
        record = pack_details(stored)
        if stored.header.kind == "steering":
            # A steering pack's delta norms are read from its tensors: the model side, imported for it alone.
            from packstore.answering.api import steering_details

            record |= steering_details(store, stored)
    if args.json:
        emit_json(record)
        return 0
    _print_summary(record)
    print(f"shape:        {record['layers']} layers x {record['kv_heads']} KV heads x {record['head_dim']} head dim")
    blocks = [c["stop_position"] - c["first_position"] for c in record["chunks"] if "first_position" in c]
    in_blocks = f", in token blocks of {max(blocks)} positions" if blocks else ""
    print(f"codec:        {record['codec']}, {len(record['chunks'])} chunks{in_blocks}")
    print(f"created:      {record['created']}")
    engine = record["engine"]
    print(f"computed by:  {'packstore (transformers)' if engine is None else ' '.join(f'{k} {v}' for k, v in engine.items())}")
    if record["built_on"] is not None:
        print(f"built on:     {', '.join(f'{k} {v}' for k, v in record['built_on'].items())}")
    for signature in record["signatures"]:
        print(f"signed by:    {signature['key_id']} ({signature['created']}){'' if signature['valid'] else ' INVALID'}")
    if record["kind"] == "steering":
        first, last = record["steer_layers"]
        pooled = f"pooling: {record['pooling']} token, texts framed as {record['framing']}; key deltas {record['key_space']}"
        print(f"pairs:        {record['pairs']} ({pooled})")
        print(f"layers:       {first}-{last} held; applied by default to {record['default_layers'][0]}-{record['default_layers'][1]}")
        print("norms:        layer  |dK|       |dV|")
        for norm in record["norms"]:
            print(f"              {norm['layer']:>5}  {norm['key_norm']:<9.4f}  {norm['value_norm']:.4f}")
        return 0
    print(f"facts:        {len(record['facts'])}")
    for fact in record["facts"]:
        print(f"  - {fact if len(fact) <= 100 else fact[:99] + '…'}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    with store_of(args) as store:
        removed = [store.delete(ref) for ref in args.refs]
    if args.json:
        emit_json({"removed": removed})
    else:
        for key in removed:
            print(f"removed {key}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    trusted = TrustedKeys.load(args.trusted_keys) if args.trusted_keys else None
    with store_of(args, readonly=True) as store:
        results = verify_packs(store, args.refs, trusted)
    failed = [r for r in results if not r.ok]
    if args.json:
        emit_json([{"key": r.key, "ok": r.ok, "error": r.error} for r in results])
    else:
        for r in results:
            state = "ok" if r.error is None else "UNTRUSTED" if r.error.startswith("not trusted") else "DAMAGED"
            print(f"{state:<10} {r.key}" + (f": {r.error}" if r.error else ""))
        what = "damaged or untrusted" if trusted else "damaged"
        print(f"{len(results)} packs verified{' with signatures' if trusted else ''}, {len(failed)} {what}", file=sys.stderr)
    return EXIT_ERROR if failed else 0


def cmd_backup(args: argparse.Namespace) -> int:
    spec = spec_of(args)
    if not spec.is_directory:
        raise InvalidInput(
            "backup copies a store directory: run it on the service's host with --store DATA (it is safe while the service runs); "
            "copy an s3:// store with packctl migrate --to DIR"
        )
    source = spec.location
    report = backup(source, args.destination)
    if args.json:
        emit_json({"destination": report.destination, "namespaces": report.namespaces})
    else:
        for namespace, counts in report.namespaces.items():
            print(f"{namespace:<16} {counts['packs']:>8} packs  {human_bytes(counts['file_bytes']):>10}")
        print(f"backed up {source} to {report.destination}", file=sys.stderr)
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    key = SigningKey.load(args.key)
    with store_of(args) as store:
        signed, signature = sign_pack(store, args.ref, key)
    if args.json:
        emit_json({"key": signed, "key_id": signature.key_id, "created": signature.created})
    else:
        print(f"signed {signed} with key {signature.key_id}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    with store_of(args, readonly=True) as store:
        key, size = export_pack(store, args.ref, args.output)
    if args.json:
        emit_json({"key": key, "file": args.output, "bytes": size})
    else:
        print(f"exported {key} to {args.output} ({human_bytes(size)})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    with store_of(args) as store:
        stored, created = import_pack(store, args.file, name=args.name)
    if args.json:
        emit_json(pack_summary(stored) | {"created_new": created})
    else:
        print(stored.key)
        print("imported" if created else "already stored", file=sys.stderr)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    # store.migrate loads the object-store tier (boto3, a tenth of a second): only migrate pays for it.
    from packstore.packs.migrate import migrate

    show = None if args.json or args.quiet else lambda key, what: print(f"{what:<8} {key}", file=sys.stderr)
    with store_of(args, readonly=True) as source, store_of(args, location=args.to) as target:
        report = migrate(source, target, progress=show)
    if args.json:
        emit_json(asdict(report))
    else:
        print(
            f"{report.packs} packs: {report.copied} copied, {report.packs - report.copied} already there; "
            f"{report.names_set} names and {report.signatures_added} signatures added"
        )
        if report.banks:
            there = report.banks - report.banks_copied - len(report.banks_skipped)
            print(
                f"{report.banks} banks: {report.banks_copied} copied, {there} already there;"
                f" {report.bank_signatures_added} signatures added"
            )
        if report.banks_skipped:
            print(
                f"not copied: banks {', '.join(report.banks_skipped)} (a grpc:// service takes and gives no bank records; "
                "migrate them between directories or s3:// stores)",
                file=sys.stderr,
            )
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    with store_of(args) as store:
        report = store.gc(compact=args.compact)
    if args.json:
        emit_json(asdict(report))
    else:
        print(
            f"removed {report.orphan_chunks} unreferenced chunks ({human_bytes(report.orphan_chunk_bytes)}) "
            f"and {report.dangling_names} dangling names; data file {human_bytes(report.file_bytes_before)} -> "
            f"{human_bytes(report.file_bytes_after)}{'' if report.compacted else ' (freed pages are reused; --compact shrinks the file)'}"
        )
    return 0


def add_commands(cli: CommandLine) -> None:
    """The pack commands, with their arguments."""
    p = cli.command("ls", cmd_ls, f"list stored packs: one page in key order ({DEFAULT_PAGE} by default), or --all")
    p.add_argument("--limit", type=int, metavar="N", help=f"packs per page (1-1000, default {DEFAULT_PAGE})")
    p.add_argument(
        "--page-token",
        "--after",
        dest="page_token",
        metavar="TOKEN",
        help="start after this token: the last key of the page before (printed when more follow)",
    )
    p.add_argument("--all", action="store_true", help="list every pack (seconds for a store of 100,000)")

    p = cli.command("inspect", cmd_inspect, "show a pack's header")
    p.add_argument("ref", metavar="REF")

    p = cli.command("rm", cmd_rm, "delete packs and their names")
    p.add_argument("refs", metavar="REF", nargs="+")

    p = cli.command("verify", cmd_verify, "check every checksum of the given packs (default: all); exit 1 on damage")
    p.add_argument("refs", metavar="REF", nargs="*")
    p.add_argument(
        "--trusted-keys",
        metavar="FILE",
        help="also require a valid signature by one of these public keys (PEM blocks); exit 1 naming each unsigned or untrusted pack",
    )

    p = cli.command("backup", cmd_backup, "consistent hot copy of a store directory (every namespace) into DEST; safe while it is in use")
    p.add_argument("destination", metavar="DEST", help="a new directory: the copy is a store itself")

    p = cli.command("sign", cmd_sign, "sign a pack's sealed digest with a private key and store the signature with it")
    p.add_argument("ref", metavar="REF")
    p.add_argument("--key", required=True, metavar="KEY", help="private key file written by packctl keygen")

    p = cli.command("export", cmd_export, "write a pack to a single self-describing file")
    p.add_argument("ref", metavar="REF")
    p.add_argument("-o", "--output", required=True, metavar="FILE")

    p = cli.command("import", cmd_import, "verify a pack file and store it")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--name", help="name (alias) for the pack, per model")

    p = cli.command(
        "migrate", cmd_migrate,
        "copy every pack of --store with its names and signatures, and every bank with its signatures, into another store "
        "(a directory, grpc:// or s3://; banks not to or from grpc://); running it again copies only what is missing",
    )
    p.add_argument("--to", required=True, metavar="STORE", help="the store to copy into")

    p = cli.command("gc", cmd_gc, "remove what no pack references; --compact also shrinks the data file")
    p.add_argument("--compact", action="store_true", help="rewrite the data file without free pages (needs the store to itself)")
