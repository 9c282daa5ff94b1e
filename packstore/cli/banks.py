"""packctl bank: build, grow, route, list, sign, verify and remove banks. The embedder and the indexes load
inside the store's bank tables when a command needs them, so this module itself stays light."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from packstore.answering.facts import read_facts, read_items
from packstore.bank.bank import MIN_PROBE, PROBED_SHARE, ROUTE_MODES
from packstore.bank.rerank import CANDIDATES, CROSS_RARE_FACTS, CROSS_WEIGHT, DEFAULT_RERANK, DEFAULT_WEIGHT, RERANKERS, default_rerank
from packstore.cli.program import EXIT_ERROR, CommandLine, emit_json, global_options, progress
from packstore.cli.store_options import store_of
from packstore.errors import InvalidInput
from packstore.format.bank import DEFAULT_VECTORS, VECTOR_KINDS
from packstore.security.trust import SigningKey, TrustedKeys
from packstore.store.protocol import DEFAULT_TOP_K


def _bank_record(meta: Any, stored_bytes: int) -> dict[str, Any]:
    return meta.__dict__ | {"stored_bytes": stored_bytes, "bytes_per_fact": round(stored_bytes / max(meta.facts, 1), 1)}


def _routes(args: argparse.Namespace, banks: Any, queries: list[str]) -> Any:
    """``bank route``'s routes: reranked where the bank is (``--rerank cross`` or ``late``: in this process, or by the
    service holding the store), or here by ``--rerank-model`` (``lm``)."""
    from packstore.bank.rerank import reranked_route, reranker

    options = {"top_k": args.top_k, "probe": args.probe, "mode": args.mode}
    rerank = args.rerank or default_rerank(args.mode)
    if rerank == "lm":
        from packstore.kv.models import load_model

        lm = load_model(args.rerank_model, progress=False)
        second = reranker("lm", lm=(lm.tokenizer, lm.model), weight=args.rerank_weight)
        return reranked_route(banks, args.name, queries, args.embedder, reranker=second, **options)
    return banks.route(args.name, queries, args.embedder, rerank=rerank, rerank_weight=args.rerank_weight, **options)


def cmd_bank(args: argparse.Namespace) -> int:
    from packstore.bank.bank import open_banks  # the embedder loads only for what embeds (packstore.extras names a missing extra)

    with store_of(args, readonly=args.bank_command in ("route", "ls", "verify")) as store:
        banks = open_banks(store)
        if args.bank_command in ("build", "add"):
            facts = read_facts(args.facts)
            if args.bank_command == "build":
                meta = banks.build(args.name, facts, args.embedder, vectors=args.vectors, progress=progress(args))
            else:
                meta = banks.add(args.name, facts, args.embedder, progress=progress(args))
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
            for result in _routes(args, banks, queries):
                if args.json or args.queries is not None:
                    emit_json(result.to_json())
                    continue
                stage = f"    reranked by {result.reranker}" if result.reranker != "none" else ""
                print(f"Q: {result.query}    clusters {result.clusters}{stage}")
                for text, score in result.facts:
                    print(f"  {score:6.3f}  {text}")
        elif args.bank_command == "sign":
            from packstore.answering.api import sign_bank

            signature = sign_bank(store, args.name, SigningKey.load(args.key))
            if args.json:
                emit_json({"bank": args.name, "key_id": signature.key_id, "digest": signature.digest})
            else:
                print(f"signed bank {args.name} (digest {signature.digest[:16]}) with key {signature.key_id}")
        elif args.bank_command == "verify":
            from packstore.answering.api import verify_banks

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
            for b in [] if args.json else records:
                print(
                    f"{b['name']:<24} {b['facts']:>9} facts {b['clusters']:>7} clusters {b['bytes_per_fact']:>7.0f} B/fact  {b['embedder']}"
                )
        else:
            banks.delete(args.name)
            print(f"removed bank {args.name}", file=sys.stderr)
    return 0


def bank_options(parser: argparse.ArgumentParser) -> None:
    """How many facts to keep and clusters to probe, and the embedder (``bank route`` and ``ask --bank``)."""
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, metavar="K", help=f"facts to keep (default {DEFAULT_TOP_K})")
    parser.add_argument(
        "--probe", type=int, metavar="P",
        help=f"nearest clusters to search (default {PROBED_SHARE * 100:g} %% of the bank's clusters, at least {MIN_PROBE})",
    )
    if not any(a.dest == "embedder" for a in parser._actions):
        parser.add_argument("--embedder", default=None, help="the bank's own embedder (default); another is refused")
    parser.add_argument(
        "--rerank", choices=RERANKERS, default=None,
        help=f"{DEFAULT_RERANK} (the default, except with --mode lexical): a cross-encoder reads the question with each of the "
        f"top {CANDIDATES['cross']}, from a pool widened by up to {CROSS_RARE_FACTS} facts holding the question's rarest terms "
        "(ms-marco-MiniLM-L-12 over onnxruntime; MS MARCO's terms are non-commercial); none: the "
        f"route's own order; late: MaxSim over the embedder's token embeddings of the top {CANDIDATES['late']}; lm: the "
        f"language model's likelihood of the question after each of the top {CANDIDATES['lm']} (neither beat none on the "
        "tuning data). docs/evaluation.md",
    )
    parser.add_argument(
        "--rerank-weight", type=float, default=None, metavar="W",
        help=f"late, lm: how much of the reranker's score is added to the route's (default {DEFAULT_WEIGHT:g}); cross: how much "
        f"of the route's score is added to the cross-encoder's logit (default {CROSS_WEIGHT:g})",
    )


def add_commands(cli: CommandLine) -> None:
    """``bank`` and its subcommands, with their arguments."""
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
        "--vectors", choices=VECTOR_KINDS, default=DEFAULT_VECTORS,
        help="store fact embeddings as int8 with a scale per fact (default) or fp16 (about 380 bytes a fact more, no measured gain)",
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
    bank_options(p)
    p.add_argument("--rerank-model", default="smollm2-135m", metavar="M", help="the language model of --rerank lm (default smollm2-135m)")
    sub.add_parser("ls", parents=common, help="list banks")
    p = sub.add_parser("sign", parents=common, help="sign bank N's current contents with a private key (packctl keygen)")
    p.add_argument("name", metavar="N")
    p.add_argument("--key", required=True, metavar="KEY")
    p = sub.add_parser(
        "verify", parents=common, help="check that a trusted key signed each bank's current contents; exit 1 naming each that is not"
    )
    p.add_argument("names", metavar="N", nargs="*")
    p.add_argument("--trusted-keys", required=True, metavar="FILE")
    p = sub.add_parser("rm", parents=common, help="delete bank N")
    p.add_argument("name", metavar="N")
