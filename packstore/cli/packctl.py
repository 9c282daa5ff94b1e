"""packctl: build, ask with, list, inspect and remove knowledge packs (DESIGN §4)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from packstore.cli.common import EXIT_ERROR, CommandLine, connection_of, emit_json, global_options
from packstore.errors import InvalidInput, PackMismatch


def _progress(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def _open_store(args: argparse.Namespace, *, readonly: bool = False, spec: str | None = None):
    """The store ``--store`` names (or ``spec``), reached with the connection options when it is not a directory."""
    from packstore.packs.stores import is_remote, open_store

    spec = spec or args.store or os.environ.get("PACKSTORE_STORE")
    return open_store(spec, readonly=readonly, connection=connection_of(args) if is_remote(spec) else None)


def _load_model(args: argparse.Namespace):
    from packstore.kv.models import load_model

    template = None
    if args.chat_template:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidInput(f"--chat-template {args.chat_template}: {exc.strerror}") from None
    return load_model(args.model, device=args.device, dtype=args.dtype, chat_template=template, progress=_progress(args))


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _print_summary(record: dict[str, Any]) -> None:
    names = ", ".join(record["names"]) or "-"
    print(f"key:          {record['key']}")
    print(f"names:        {names}")
    print(f"kind:         {record['kind']}{' (raw: built without chat template)' if record['raw'] else ''}")
    print(f"model:        {record['model_name']}  model_fp {record['model_fp'][:16]}…")
    print(f"template_fp:  {record['template_fp'][:16]}…")
    print(f"tokens:       {record['tokens']}  ({record['dtype']})")
    print(f"size:         {_human_bytes(record['raw_bytes'])} KV, {_human_bytes(record['stored_bytes'])} stored")
    if record["parents"]:
        print(f"composition:  {record['composition']}{'' if record['composition'] == 'exact' else ' (approximate: answers may differ from the facts as prompt text)'}")
        print("parents:      " + "\n              ".join(record["parents"]))


# -- commands -----------------------------------------------------------------------------------


def cmd_build(args: argparse.Namespace) -> int:
    from packstore.answering.api import build_and_store
    from packstore.packs.admin import pack_summary
    from packstore.answering.facts import read_facts

    facts = read_facts(args.facts)
    lm = _load_model(args)
    with _open_store(args) as store:
        stored, created = build_and_store(store, lm, facts, name=args.name, raw=args.raw, progress=_progress(args))
    record = pack_summary(stored) | {"created_new": created}
    if args.json:
        emit_json(record)
    else:
        print(stored.key)
        state = "stored" if created else "already stored"
        print(
            f"{state}: {record['tokens']} tokens from {len(facts)} facts, "
            f"{_human_bytes(record['stored_bytes'])}{', name ' + args.name if args.name else ''}",
            file=sys.stderr,
        )
    return 0


def _report_composed(args: argparse.Namespace, stored: Any, created: bool, composition: Any, what: str) -> None:
    from packstore.packs.admin import pack_summary

    record = pack_summary(stored) | {"created_new": created}
    record |= composition.to_json() if composition is not None else {"reused_tokens": 0, "prefilled_tokens": 0}
    if args.json:
        emit_json(record)
        return
    print(stored.key)
    state = f"{what} and stored" if created else "already stored"
    work = (
        f"{composition.prefilled_tokens} tokens prefilled, {composition.reused_tokens} reused" if composition is not None else "nothing computed"
    )
    print(
        f"{state}: {record['tokens']} tokens ({record['composition']}), {work}{', name ' + args.name if args.name else ''}",
        file=sys.stderr,
    )


def _pack_model(args: argparse.Namespace, ref: str):
    """The model to compute with: --model, or the pack's own (its recorded name and dtype)."""
    if args.model is None:
        with _open_store(args, readonly=True) as store:
            header = store.stat(ref).header
        args.model, args.dtype = header.model_name, header.dtype
    return _load_model(args)


def cmd_compose(args: argparse.Namespace) -> int:
    from packstore.answering.api import compose_and_store

    lm = _pack_model(args, args.refs[0])
    with _open_store(args) as store:
        stored, created, composition = compose_and_store(store, lm, args.refs, mode=args.mode, name=args.name, adapter=args.adapter)
    _report_composed(args, stored, created, composition, f"composed ({args.mode})")
    return 0


def cmd_amend(args: argparse.Namespace) -> int:
    from packstore.answering.api import amend_and_store

    lm = _pack_model(args, args.ref)
    with _open_store(args) as store:
        stored, created, composition = amend_and_store(store, lm, args.ref, args.erratum, name=args.name)
    _report_composed(args, stored, created, composition, "amended")
    return 0


def _print_answer(result: Any, compare: bool) -> None:
    if not compare:
        print(result.answer)
        return
    print(f"Q:    {result.question}")
    print(f"pack: {result.answer}    [prompt {result.kv_prompt_tokens} tokens]")
    print(f"rag:  {result.rag_answer}    [prompt {result.rag_prompt_tokens} tokens]")
    saved = result.rag_prompt_tokens - result.kv_prompt_tokens
    verdict = "yes" if result.identical else "NO - answers differ"
    print(f"identical: {verdict}; the pack saved {saved} prompt tokens")


def cmd_ask(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from packstore.answering.answer import Answerer, Question
    from packstore.answering.facts import read_questions
    from packstore.kv.inject import Sampling

    from packstore.kv.options import parse_layers, parse_steer

    if (args.bank is not None or args.steer) and args.question is None and args.questions is None:
        args.question, args.ref = args.ref, None  # `ask --bank N QUESTION`: the one positional is the question
    if (args.question is None) == (args.questions is None):
        raise InvalidInput("give either a QUESTION or --questions FILE")
    if args.ref is None and args.bank is None and not args.steer:
        raise InvalidInput("give a pack REF, --bank N, or --steer REF[:ALPHA]")
    if (args.model is None) == (args.worker is None):
        raise InvalidInput("give --model M to answer here, or --worker HOST:PORT to answer on a worker")
    questions = [args.question] if args.question is not None else read_questions(args.questions)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    refs = tuple(args.ref.split(",")) if args.ref is not None else ()
    if any(not ref.strip() for ref in refs):
        raise InvalidInput(f"empty pack ref in {args.ref!r}: separate refs with single commas (names never contain one)")
    steering = tuple(parse_steer(text) for text in args.steer or ())
    layers = parse_layers(args.layers) if args.layers is not None else None
    question_for = lambda text: Question(  # noqa: E731
        text, refs=refs, bank=args.bank, top_k=args.top_k, probe=args.probe,
        embedder=args.embedder, compare_rag=args.compare_rag, sampling=sampling,
        steering=steering, steer_layers=layers, steer_on=args.steer_on, mode=args.mode, adapter=args.adapter,
    )
    as_lines = args.json or args.questions is not None
    live = bool(args.worker) and not as_lines and not args.compare_rag  # one answer for a person: shown as the worker generates it
    status = 0
    with ExitStack() as stack:
        if args.worker:
            from packstore.worker.client import WorkerClient

            worker = stack.enter_context(WorkerClient(args.worker, connection=connection_of(args)))
            show = (lambda text: print(text, end="", flush=True)) if live else None
            answer_one = lambda text: worker.ask(question_for(text), on_token=show)  # noqa: E731
        else:
            lm = _load_model(args)
            answerer = Answerer(lm, stack.enter_context(_open_store(args, readonly=args.bank is None)))
            if refs:
                answerer.parts(refs)  # checked once, before any question: a refusal fails the command
            if steering:
                answerer.steering(question_for(questions[0]))  # the steering packs and layers too
            answer_one = lambda text: answerer.ask(question_for(text))  # noqa: E731
        for question in questions:
            try:
                result = answer_one(question)
            except (PackMismatch, InvalidInput) as exc:
                if not as_lines:
                    raise
                emit_json({"question": question, "error": str(exc)})
                status = EXIT_ERROR
                continue
            if as_lines:
                emit_json(result.to_json())
            elif live:
                print()
            else:
                _print_answer(result, args.compare_rag)
    return status


def cmd_ls(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        if args.limit is None:
            summaries, next_token = store.list(), ""
        else:
            page = store.list_page(page_size=args.limit, page_token=args.after or "")
            summaries, next_token = page.packs, page.next_token
    records = [summary.to_json() for summary in summaries]
    if next_token:
        print(f"more packs follow: continue with --after {next_token}", file=sys.stderr)
    if args.json:
        emit_json(records)
        return 0
    if not records:
        print("no packs", file=sys.stderr)
        return 0
    print(f"{'NAME':<20} {'KIND':<10} {'TOKENS':>7} {'DTYPE':<9} {'RAW':<4} {'DERIVED':<10} {'STORED':>10}  {'MODEL':<14} CONTENT HASH")
    for r in records:
        derived = f"{r['composition']}:{len(r['parents'])}" if r["parents"] else "-"
        print(
            f"{(r['name'] or '-'):<20} {r['kind']:<10} {r['tokens']:>7} {r['dtype']:<9} {('yes' if r['raw'] else 'no'):<4} "
            f"{derived:<10} {_human_bytes(r['stored_bytes']):>10}  {r['model_name'][:14]:<14} {r['key'].rsplit('/', 1)[1][:16]}"
        )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from packstore.answering.api import steering_details
    from packstore.packs.admin import pack_details

    with _open_store(args, readonly=True) as store:
        stored = store.stat(args.ref)
        record = pack_details(stored)
        if stored.header.kind == "steering":
            record |= steering_details(store, stored)
    if args.json:
        emit_json(record)
        return 0
    _print_summary(record)
    print(f"shape:        {record['layers']} layers x {record['kv_heads']} KV heads x {record['head_dim']} head dim")
    blocks = [c["stop_position"] - c["first_position"] for c in record["chunks"] if "first_position" in c]
    print(f"codec:        {record['codec']}, {len(record['chunks'])} chunks{f', in token blocks of {max(blocks)} positions' if blocks else ''}")
    print(f"created:      {record['created']}")
    for signature in record["signatures"]:
        print(f"signed by:    {signature['key_id']} ({signature['created']}){'' if signature['valid'] else ' INVALID'}")
    if record["kind"] == "steering":
        first, last = record["steer_layers"]
        print(f"pairs:        {record['pairs']} (pooling: {record['pooling']} token)")
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
    with _open_store(args) as store:
        removed = [store.delete(ref) for ref in args.refs]
    if args.json:
        emit_json({"removed": removed})
    else:
        for key in removed:
            print(f"removed {key}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from packstore.packs.admin import verify_packs
    from packstore.security.trust import TrustedKeys

    trusted = TrustedKeys.load(args.trusted_keys) if args.trusted_keys else None
    with _open_store(args, readonly=True) as store:
        results = verify_packs(store, args.refs, trusted)
    failed = [r for r in results if not r.ok]
    if args.json:
        emit_json([{"key": r.key, "ok": r.ok, "error": r.error} for r in results])
    else:
        for r in results:
            state = "ok" if r.ok else "UNTRUSTED" if r.error.startswith("not trusted") else "DAMAGED"
            print(f"{state:<10} {r.key}" + (f": {r.error}" if r.error else ""))
        what = "damaged or untrusted" if trusted else "damaged"
        print(f"{len(results)} packs verified{' with signatures' if trusted else ''}, {len(failed)} {what}", file=sys.stderr)
    return EXIT_ERROR if failed else 0


def cmd_backup(args: argparse.Namespace) -> int:
    from packstore.store import default_store_path
    from packstore.packs.stores import is_remote
    from packstore.store.namespaces import backup

    source = args.store or os.environ.get("PACKSTORE_STORE") or str(default_store_path())
    if is_remote(source):
        raise InvalidInput(
            "backup copies a store directory: run it on the service's host with --store DATA (it is safe while the service runs); "
            "copy an s3:// store with packctl migrate --to DIR"
        )
    report = backup(source, args.destination)
    if args.json:
        emit_json({"destination": report.destination, "namespaces": report.namespaces})
    else:
        for namespace, counts in report.namespaces.items():
            print(f"{namespace:<16} {counts['packs']:>8} packs  {_human_bytes(counts['file_bytes']):>10}")
        print(f"backed up {source} to {report.destination}", file=sys.stderr)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from packstore.security.trust import generate_key

    private, public, key_id = generate_key(args.out)
    if args.json:
        emit_json({"private_key": str(private), "public_key": str(public), "key_id": key_id})
    else:
        print(f"wrote {private} (private, mode 0600) and {public}; key id {key_id}")
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    from packstore.packs.admin import sign_pack
    from packstore.security.trust import SigningKey

    key = SigningKey.load(args.key)
    with _open_store(args) as store:
        signed, signature = sign_pack(store, args.ref, key)
    if args.json:
        emit_json({"key": signed, "key_id": signature.key_id, "created": signature.created})
    else:
        print(f"signed {signed} with key {signature.key_id}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from packstore.packs.admin import export_pack

    with _open_store(args, readonly=True) as store:
        key, size = export_pack(store, args.ref, args.output)
    if args.json:
        emit_json({"key": key, "file": args.output, "bytes": size})
    else:
        print(f"exported {key} to {args.output} ({_human_bytes(size)})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from packstore.packs.admin import import_pack, pack_summary

    with _open_store(args) as store:
        stored, created = import_pack(store, args.file, name=args.name)
    if args.json:
        emit_json(pack_summary(stored) | {"created_new": created})
    else:
        print(stored.key)
        print("imported" if created else "already stored", file=sys.stderr)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from packstore.packs.migrate import migrate

    show = None if args.json or args.quiet else lambda key, what: print(f"{what:<8} {key}", file=sys.stderr)
    with _open_store(args, readonly=True) as source, _open_store(args, spec=args.to) as target:
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
            print(f"{report.banks} banks: {report.banks_copied} copied, {there} already there; {report.bank_signatures_added} signatures added")
        if report.banks_skipped:
            print(
                f"not copied: banks {', '.join(report.banks_skipped)} (a grpc:// service takes and gives no bank records; "
                "migrate them between directories or s3:// stores)",
                file=sys.stderr,
            )
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    with _open_store(args) as store:
        report = store.gc(compact=args.compact)
    if args.json:
        emit_json(asdict(report))
    else:
        print(
            f"removed {report.orphan_chunks} unreferenced chunks ({_human_bytes(report.orphan_chunk_bytes)}) "
            f"and {report.dangling_names} dangling names; data file {_human_bytes(report.file_bytes_before)} -> "
            f"{_human_bytes(report.file_bytes_after)}{'' if report.compacted else ' (freed pages are reused; --compact shrinks the file)'}"
        )
    return 0


def cmd_steer(args: argparse.Namespace) -> int:
    from packstore.answering.api import build_steering_and_store
    from packstore.packs.admin import pack_summary
    from packstore.answering.facts import read_pairs
    from packstore.kv.options import parse_layers

    pairs = read_pairs(args.pairs)
    layers = parse_layers(args.layers) if args.layers is not None else None
    lm = _load_model(args)
    with _open_store(args) as store:
        stored, created = build_steering_and_store(store, lm, pairs, name=args.name, layers=layers, pooling=args.pooling)
    record = pack_summary(stored) | {"created_new": created, "pairs": len(pairs)}
    if args.json:
        emit_json(record)
    else:
        print(stored.key)
        first, last = stored.header.recipe["layers"]
        state = "stored" if created else "already stored"
        print(f"{state}: steering pack from {len(pairs)} pairs, layers {first}-{last}, name {args.name}", file=sys.stderr)
    return 0


def cmd_adapter(args: argparse.Namespace) -> int:
    from packstore.answering.api import train_adapter_and_store
    from packstore.packs.admin import pack_summary
    from packstore.answering.facts import read_examples

    examples = read_examples(args.data) if args.data else None
    lm = _load_model(args)
    show = _progress(args) or args.verbose
    progress = (lambda step, loss: print(f"step {step}/{args.steps}: KL {loss:.4f}", file=sys.stderr, flush=True)) if show else None
    with _open_store(args) as store:
        stored, created = train_adapter_and_store(
            store, lm, name=args.name, examples=examples, source=f"file {Path(args.data).name}" if args.data else "",
            tokens=args.tokens, steps=args.steps, learning_rate=args.learning_rate, seed=args.seed, progress=progress,
        )
    metrics = dict(stored.header.metrics)
    record = pack_summary(stored) | {"created_new": created, "recipe": stored.header.recipe, "metrics": metrics}
    if args.json:
        emit_json(record)
    else:
        print(stored.key)
        print(
            f"adapter {args.name}: {args.tokens} soft tokens a side, {args.steps} steps in {metrics['train_seconds']} s, "
            f"held-out KL {metrics['holdout_kl_before']} -> {metrics['holdout_kl_after']}, peak RSS {metrics['peak_rss_mb']} MB",
            file=sys.stderr,
        )
    return 0


def _bank_record(meta: Any, stored_bytes: int) -> dict[str, Any]:
    return meta.__dict__ | {"stored_bytes": stored_bytes, "bytes_per_fact": round(stored_bytes / max(meta.facts, 1), 1)}


def cmd_bank(args: argparse.Namespace) -> int:
    from packstore.answering.facts import read_facts, read_items
    from packstore.bank.bank import open_banks

    with _open_store(args, readonly=args.bank_command in ("route", "ls", "verify")) as store:
        banks = open_banks(store)
        if args.bank_command in ("build", "add"):
            facts = read_facts(args.facts)
            if args.bank_command == "build":
                meta = banks.build(args.name, facts, args.embedder, vectors=args.vectors, progress=_progress(args))
            else:
                meta = banks.add(args.name, facts, args.embedder, progress=_progress(args))
            record = _bank_record(meta, banks.stored_bytes(meta.name))
            if args.json:
                emit_json(record)
            else:
                print(
                    f"bank {meta.name}: {meta.facts} facts in {meta.clusters} clusters, {record['bytes_per_fact']:.0f} bytes per fact "
                    f"({meta.embedder}, {meta.vectors} vectors)"
                )
        elif args.bank_command == "route":
            if (args.query is None) == (args.queries is None):
                raise InvalidInput("give either a QUERY or --queries FILE")
            queries = [args.query] if args.query is not None else read_items(args.queries, "query")
            for result in banks.route(args.name, queries, args.embedder, top_k=args.top_k, probe=args.probe, mode=args.mode):
                if args.json or args.queries is not None:
                    emit_json(result.to_json())
                    continue
                print(f"Q: {result.query}    clusters {result.clusters}")
                for text, score in result.facts:
                    print(f"  {score:6.3f}  {text}")
        elif args.bank_command == "sign":
            from packstore.answering.api import sign_bank
            from packstore.security.trust import SigningKey

            signature = sign_bank(store, args.name, SigningKey.load(args.key))
            if args.json:
                emit_json({"bank": args.name, "key_id": signature.key_id, "digest": signature.digest})
            else:
                print(f"signed bank {args.name} (digest {signature.digest[:16]}) with key {signature.key_id}")
        elif args.bank_command == "verify":
            from packstore.answering.api import verify_banks
            from packstore.security.trust import TrustedKeys

            results = verify_banks(store, args.names, TrustedKeys.load(args.trusted_keys))
            if args.json:
                emit_json([{"bank": r.key, "ok": r.ok, "error": r.error} for r in results])
            for r in [] if args.json else results:
                print(f"{'ok' if r.ok else 'UNTRUSTED':<10} {r.key}" + (f": {r.error}" if r.error else ""))
            if any(not r.ok for r in results):
                return EXIT_ERROR
        elif args.bank_command == "ls":
            records = [_bank_record(meta, size) for meta, size in banks.list()]
            if args.json:
                emit_json(records)
            for r in [] if args.json else records:
                print(f"{r['name']:<24} {r['facts']:>9} facts {r['clusters']:>7} clusters {r['bytes_per_fact']:>7.0f} B/fact  {r['embedder']}")
        else:
            banks.delete(args.name)
            print(f"removed bank {args.name}", file=sys.stderr)
    return 0


# -- parser -------------------------------------------------------------------------------------


def _model_options(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("--model", required=required, metavar="M", help="smollm2-135m, gemma3-270m, or a local Hugging Face model directory")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="compute dtype (part of the model identity)")
    parser.add_argument("--chat-template", metavar="FILE", help="use this Jinja chat template instead of the tokenizer's own")


def _composition_options(parser: argparse.ArgumentParser, modes: tuple[str, ...]) -> None:
    parser.add_argument(
        "--mode", choices=modes, default="exact",
        help="exact (default): prefill each later part after the earlier ones, same answers as all facts as text; "
        "rope: splice independently built parts, keys rotated to their new positions (approximate, no part prefilled); "
        "naive: splice without re-positioning (wrong; only to measure it); "
        "packet: rope plus the soft tokens of --adapter around each part (approximate, no part prefilled)",
    )
    parser.add_argument("--adapter", metavar="REF", help="the adapter (packctl adapter train) for --mode packet")


def _bank_options(parser: argparse.ArgumentParser) -> None:
    from packstore.store.protocol import DEFAULT_TOP_K, MIN_PROBE, PROBED_SHARE

    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, metavar="K", help=f"facts to keep (default {DEFAULT_TOP_K})")
    parser.add_argument(
        "--probe", type=int, metavar="P",
        help=f"nearest clusters to search (default {PROBED_SHARE * 100:g} %% of the bank's clusters, at least {MIN_PROBE})",
    )
    if not any(a.dest == "embedder" for a in parser._actions):
        parser.add_argument("--embedder", default=None, help="the bank's own embedder (default); another is refused")


def build_cli() -> CommandLine:
    from packstore.format.bank import VECTOR_KINDS
    from packstore.format.header import COMPOSITIONS as COMPOSE_MODES
    from packstore.format.header import POOLINGS
    from packstore.kv.options import MAX_ALPHA, STEER_TARGETS
    from packstore.store.protocol import ROUTE_MODES

    cli = CommandLine("packctl", "Build, store and use knowledge packs (pre-computed KV caches).", client=True)

    p = cli.command("build", cmd_build, "build a pack from a facts file and store it; prints the key")
    p.add_argument("facts", metavar="FACTS", help="one fact per line, or JSONL with a 'text' field")
    _model_options(p)
    p.add_argument("--name", help="name (alias) for the pack, per model")
    p.add_argument("--raw", action="store_true", help="no chat template around the facts (to measure that pitfall)")

    p = cli.command("compose", cmd_compose, "compose packs in order into a new pack (model: --model, else the first pack's own); prints its key")
    p.add_argument("refs", metavar="REF", nargs="+", help="two or more packs, in order")
    _model_options(p, required=False)
    p.add_argument("--name", help="name (alias) for the composed pack, per model")
    _composition_options(p, COMPOSE_MODES)

    p = cli.command("amend", cmd_amend, "append an erratum to a pack as a new pack, the old one kept (model: --model, else the pack's own); prints its key")
    p.add_argument("ref", metavar="REF")
    p.add_argument("--erratum", required=True, metavar="TEXT", help="one line; rendered as 'Correction: TEXT' after the facts")
    _model_options(p, required=False)
    p.add_argument("--name", help="name (alias) for the amended pack, per model")

    p = cli.command("ask", cmd_ask, "answer with a pack injected as past_key_values")
    p.add_argument(
        "ref", metavar="REF", nargs="?",
        help="pack key, name, or content-hash prefix; A,B,C answers with their exact composition (with --bank: the routed facts follow them)",
    )
    p.add_argument("question", metavar="QUESTION", nargs="?")
    p.add_argument("--questions", metavar="FILE", help='JSONL lines {"question": ...}; prints one JSON object per line')
    _model_options(p, required=False)
    p.add_argument("--worker", metavar="HOST:PORT", help="answer on a packstore worker instead of loading the model here (grpcs://HOST:PORT: TLS)")
    p.add_argument("--bank", metavar="N", help="route the question in bank N and answer with its top facts' pack (computed lazily)")
    _bank_options(p)
    p.add_argument("--compare-rag", action="store_true", help="also answer with the facts in the prompt and compare")
    _composition_options(p, COMPOSE_MODES)
    p.add_argument(
        "--steer", action="append", metavar="REF[:ALPHA]",
        help=f"add a steering pack's value deltas times ALPHA (default 1, 0 is unsteered, |ALPHA| <= {MAX_ALPHA:g}, negative steers "
        "the other way); repeat to sum several directions; alone (no REF, no --bank) it steers the question with no knowledge",
    )
    p.add_argument(
        "--layers", metavar="FIRST-LAST",
        help="layers to steer, 0-based and inclusive, within those the steering packs hold (default: the middle third)",
    )
    p.add_argument(
        "--steer-on", choices=STEER_TARGETS, default="values",
        help="values (default); keys or both only as the control that measures how key arithmetic breaks coherence",
    )
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)

    p = cli.command("ls", cmd_ls, "list stored packs (all, or one page with --limit)")
    p.add_argument("--limit", type=int, metavar="N", help="list at most N packs (1-1000), in key order")
    p.add_argument("--after", metavar="KEY", help="with --limit: start after this key (printed when more follow)")

    p = cli.command("inspect", cmd_inspect, "show a pack's header")
    p.add_argument("ref", metavar="REF")

    p = cli.command("rm", cmd_rm, "delete packs and their names")
    p.add_argument("refs", metavar="REF", nargs="+")

    p = cli.command("verify", cmd_verify, "check every checksum of the given packs (default: all); exit 1 on damage")
    p.add_argument("refs", metavar="REF", nargs="*")
    p.add_argument("--trusted-keys", metavar="FILE", help="also require a valid signature by one of these public keys (PEM blocks); exit 1 naming each unsigned or untrusted pack")

    p = cli.command("backup", cmd_backup, "consistent hot copy of a store directory (every namespace) into DEST; safe while it is in use")
    p.add_argument("destination", metavar="DEST", help="a new directory: the copy is a store itself")

    p = cli.command("keygen", cmd_keygen, "write a new Ed25519 key pair: KEY (private, 0600) and KEY.pub")
    p.add_argument("--out", required=True, metavar="KEY")

    p = cli.command("sign", cmd_sign, "sign a pack's sealed digest with a private key and store the signature with it")
    p.add_argument("ref", metavar="REF")
    p.add_argument("--key", required=True, metavar="KEY", help="private key file written by packctl keygen")

    p = cli.command("export", cmd_export, "write a pack to a single self-describing file")
    p.add_argument("ref", metavar="REF")
    p.add_argument("-o", "--output", required=True, metavar="FILE")

    p = cli.command("import", cmd_import, "verify a pack file and store it")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--name", help="name (alias) for the pack, per model")

    from packstore.kv.options import ADAPTER_LEARNING_RATE, ADAPTER_STEPS, ADAPTER_TOKENS

    adapter = cli.command("adapter", cmd_adapter, "KV Packet adapters: soft tokens trained to splice independently built packs")
    sub = adapter.add_subparsers(dest="adapter_command", required=True, metavar="ADAPTER_COMMAND")
    p = sub.add_parser(
        "train", parents=[global_options(add_defaults=False, client=True)],
        help="train an adapter by distillation (model frozen) and store it; prints its key",
        description="train an adapter by distillation from the exact composition (model frozen) and store it; prints its key",
    )
    _model_options(p)
    p.add_argument("--name", required=True, help="name (alias) for the adapter, per model")
    p.add_argument(
        "--data", metavar="FILE",
        help='JSONL {"documents": [TEXT, ...], "question": TEXT} (default: 96 examples from the built-in fact generator)',
    )
    p.add_argument("--steps", type=int, default=ADAPTER_STEPS, help=f"optimizer steps, one example each (default {ADAPTER_STEPS})")
    p.add_argument("--tokens", type=int, default=ADAPTER_TOKENS, help=f"soft tokens before and after each part (default {ADAPTER_TOKENS})")
    p.add_argument("--learning-rate", type=float, default=ADAPTER_LEARNING_RATE, help=f"Adam step size (default {ADAPTER_LEARNING_RATE})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", "-v", action="store_true", help="print the training loss as it goes")

    steer = cli.command("steer", cmd_steer, "steering packs: contrastive value deltas that change how a model answers")
    sub = steer.add_subparsers(dest="steer_command", required=True, metavar="STEER_COMMAND")
    p = sub.add_parser(
        "build", parents=[global_options(add_defaults=False, client=True)],
        help="build a steering pack from contrastive pairs and store it; prints its key",
        description="build a steering pack from contrastive pairs and store it; prints its key",
    )
    p.add_argument("pairs", metavar="PAIRS", help='JSONL lines {"good": ..., "bad": ...}')
    _model_options(p)
    p.add_argument("--name", required=True, help="name (alias) for the steering pack, per model")
    p.add_argument("--layers", metavar="FIRST-LAST", help="layers to compute deltas for, 0-based and inclusive (default: every layer)")
    p.add_argument(
        "--pooling", choices=POOLINGS, default="last",
        help="pool each text's K/V at its last token (default) or as the mean over its tokens",
    )

    bank = cli.command("bank", cmd_bank, "banks: thousands to millions of facts, routed by embedding")
    sub = bank.add_subparsers(dest="bank_command", required=True, metavar="BANK_COMMAND")
    common = [global_options(add_defaults=False, client=True)]
    p = sub.add_parser("build", parents=common, help="embed and cluster a facts file into bank N (replaces it)")
    p.add_argument("facts", metavar="FACTS")
    p.add_argument("--name", required=True)
    p.add_argument(
        "--embedder", default="all-minilm-l6-v2",
        help="all-minilm-l6-v2 (default), all-mpnet-base-v2, or a local sentence-transformers directory; recorded in the bank",
    )
    p.add_argument(
        "--vectors", choices=VECTOR_KINDS, default="fp16",
        help="store fact embeddings as fp16 (default) or int8 with a scale per fact (half the bytes)",
    )
    p = sub.add_parser("add", parents=common, help="add a facts file to bank N without re-clustering")
    p.add_argument("name", metavar="N")
    p.add_argument("facts", metavar="FACTS")
    p.add_argument("--embedder", default=None, help="the bank's own embedder (default); another is refused")
    p = sub.add_parser("route", parents=common, help="show the clusters and ranked facts a query routes to")
    p.add_argument("name", metavar="N")
    p.add_argument("query", metavar="QUERY", nargs="?")
    p.add_argument("--queries", metavar="FILE", help='JSONL lines {"query": ...} (or one per line); one JSON object per line out')
    p.add_argument(
        "--mode", choices=ROUTE_MODES, default="hybrid",
        help="hybrid (default): embedding clusters and the BM25 index together; dense or lexical: one alone",
    )
    _bank_options(p)
    sub.add_parser("ls", parents=common, help="list banks")
    p = sub.add_parser("sign", parents=common, help="sign bank N's current contents with a private key (packctl keygen)")
    p.add_argument("name", metavar="N")
    p.add_argument("--key", required=True, metavar="KEY")
    p = sub.add_parser("verify", parents=common, help="check that a trusted key signed each bank's current contents; exit 1 naming each that is not")
    p.add_argument("names", metavar="N", nargs="*")
    p.add_argument("--trusted-keys", required=True, metavar="FILE")
    p = sub.add_parser("rm", parents=common, help="delete bank N")
    p.add_argument("name", metavar="N")

    p = cli.command(
        "migrate", cmd_migrate,
        "copy every pack of --store with its names and signatures, and every bank with its signatures, into another store "
        "(a directory, grpc:// or s3://; banks not to or from grpc://); running it again copies only what is missing",
    )
    p.add_argument("--to", required=True, metavar="STORE", help="the store to copy into")

    p = cli.command("gc", cmd_gc, "remove what no pack references; --compact also shrinks the data file")
    p.add_argument("--compact", action="store_true", help="rewrite the data file without free pages (needs the store to itself)")
    return cli


def main(argv: list[str] | None = None) -> int:
    return build_cli().main(argv)


if __name__ == "__main__":
    sys.exit(main())
