"""packctl's model-side commands: build, compose, amend, ask, render, steer build, adapter train and model export. This module
imports torch and transformers; packctl imports it only when one of these commands runs (their arguments
are ``packstore.cli.model_args``)."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from packstore.answering.answer import Answerer, Question
from packstore.answering.api import (
    amend_and_store,
    build_and_store,
    build_steering_and_store,
    compose_and_store,
    store_pack,
    train_adapter_and_store,
)
from packstore.answering.arithmetic import pack_salt
from packstore.answering.facts import read_examples, read_facts, read_pairs, read_questions
from packstore.cli.program import EXIT_ERROR, emit_json, human_bytes, progress
from packstore.cli.store_options import connection_of, store_of
from packstore.errors import InvalidInput, PackMismatch
from packstore.kv.engine_build import build_pack_with_engine
from packstore.kv.export import export_model
from packstore.kv.inject import Sampling
from packstore.kv.models import LoadedModel, load_model, load_tokenizer
from packstore.kv.options import parse_layers, parse_steer
from packstore.kv.prompt import pack_prompt
from packstore.packs.admin import pack_summary
from packstore.worker.client import WorkerClient


def _chat_template(args: argparse.Namespace) -> str | None:
    """The text of ``--chat-template FILE``, or None."""
    if not args.chat_template:
        return None
    try:
        return Path(args.chat_template).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidInput(f"--chat-template {args.chat_template}: {exc.strerror}") from None


def _load_model(args: argparse.Namespace) -> LoadedModel:
    return load_model(args.model, device=args.device, dtype=args.dtype, chat_template=_chat_template(args), progress=progress(args))


def cmd_build(args: argparse.Namespace) -> int:
    facts = read_facts(args.facts)
    if args.engine == "transformers":
        lm = _load_model(args)
        with store_of(args) as store:
            stored, created = build_and_store(store, lm, facts, name=args.name, raw=args.raw, progress=progress(args))
    else:
        pack = build_pack_with_engine(
            args.model, facts, engine=args.engine, dtype=args.dtype, block_size=args.block_size, raw=args.raw,
            chat_template=_chat_template(args),
        )
        with store_of(args) as store:
            stored, created = store_pack(store, pack, name=args.name)
    record = pack_summary(stored) | {"created_new": created}
    if args.json:
        emit_json(record)
    else:
        print(stored.key)
        state = "stored" if created else "already stored"
        print(
            f"{state}: {record['tokens']} tokens from {len(facts)} facts, "
            f"{human_bytes(record['stored_bytes'])}{', name ' + args.name if args.name else ''}",
            file=sys.stderr,
        )
    return 0


def _report_composed(args: argparse.Namespace, stored: Any, created: bool, composition: Any, what: str) -> None:
    record = pack_summary(stored) | {"created_new": created}
    record |= composition.to_json() if composition is not None else {"reused_tokens": 0, "prefilled_tokens": 0}
    if args.json:
        emit_json(record)
        return
    print(stored.key)
    state = f"{what} and stored" if created else "already stored"
    work = (
        f"{composition.prefilled_tokens} tokens prefilled, {composition.reused_tokens} reused"
        if composition is not None
        else "nothing computed"
    )
    print(
        f"{state}: {record['tokens']} tokens ({record['composition']}), {work}{', name ' + args.name if args.name else ''}",
        file=sys.stderr,
    )


def _pack_model(args: argparse.Namespace, ref: str) -> LoadedModel:
    """The model to compute with: --model, or the pack's own (its recorded name and dtype)."""
    if args.model is None:
        with store_of(args, readonly=True) as store:
            header = store.stat(ref).header
        args.model, args.dtype = header.model_name, header.dtype
    return _load_model(args)


def cmd_compose(args: argparse.Namespace) -> int:
    lm = _pack_model(args, args.refs[0])
    with store_of(args) as store:
        stored, created, composition = compose_and_store(store, lm, args.refs, mode=args.mode, name=args.name, adapter=args.adapter)
    _report_composed(args, stored, created, composition, f"composed ({args.mode})")
    return 0


def cmd_amend(args: argparse.Namespace) -> int:
    lm = _pack_model(args, args.ref)
    with store_of(args) as store:
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
    chunked = {True: "yes", False: "NO - answers differ", None: "unknown (the pack records no prefill)"}
    print(f"identical: {verdict}; chunked identical: {chunked[result.chunked_identical]}; the pack saved {saved} prompt tokens")


def cmd_ask(args: argparse.Namespace) -> int:
    if (args.bank is not None or args.steer) and args.question is None and args.questions is None:
        args.question, args.ref = args.ref, None  # `ask --bank N QUESTION`: the one positional is the question
    if (args.question is None) == (args.questions is None):
        raise InvalidInput("give either a QUESTION or --questions FILE")
    if args.ref is None and args.bank is None and not args.steer:
        raise InvalidInput("give a pack REF, --bank N, or --steer REF[:ALPHA]")
    if (args.model is None) == (args.worker is None):
        raise InvalidInput("give --model M to answer here, or --worker HOST:PORT to answer on a worker")
    questions = [args.question] if args.question is not None else read_questions(args.questions)
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop=tuple(args.stop)
    )
    refs = tuple(args.ref.split(",")) if args.ref is not None else ()
    if any(not ref.strip() for ref in refs):
        raise InvalidInput(f"empty pack ref in {args.ref!r}: separate refs with single commas (names never contain one)")
    steering = tuple(parse_steer(text) for text in args.steer or ())
    layers = parse_layers(args.layers) if args.layers is not None else None
    question_for = lambda text: Question(  # noqa: E731
        text, refs=refs, bank=args.bank, top_k=args.top_k, probe=args.probe,
        embedder=args.embedder, rerank=args.rerank or "", rerank_weight=args.rerank_weight, compare_rag=args.compare_rag, sampling=sampling,
        steering=steering, steer_layers=layers, steer_on=args.steer_on, mode=args.mode, adapter=args.adapter,
    )
    as_lines = args.json or args.questions is not None
    live = bool(args.worker) and not as_lines and not args.compare_rag  # one answer for a person: shown as the worker generates it
    status = 0
    with ExitStack() as stack:
        if args.worker:
            worker = stack.enter_context(WorkerClient(args.worker, connection=connection_of(args)))
            show = (lambda text: print(text, end="", flush=True)) if live else None
            answer_one = lambda text: worker.ask(question_for(text), on_token=show)  # noqa: E731
        else:
            lm = _load_model(args)
            answerer = Answerer(lm, stack.enter_context(store_of(args, readonly=args.bank is None)))
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


def cmd_steer(args: argparse.Namespace) -> int:
    pairs = read_pairs(args.pairs)
    layers = parse_layers(args.layers) if args.layers is not None else None
    lm = _load_model(args)
    with store_of(args) as store:
        stored, created = build_steering_and_store(
            store, lm, pairs, name=args.name, layers=layers, pooling=args.pooling, key_space=args.key_space, framing=args.framing
        )
    record = pack_summary(stored) | {"created_new": created, "pairs": len(pairs)}
    if args.json:
        emit_json(record)
    else:
        print(stored.key)
        recipe = stored.header.recipe
        assert recipe is not None, "a steering pack records its recipe"
        first, last = recipe["layers"]
        state = "stored" if created else "already stored"
        print(f"{state}: steering pack from {len(pairs)} pairs, layers {first}-{last}, name {args.name}", file=sys.stderr)
    return 0


def cmd_adapter(args: argparse.Namespace) -> int:
    examples = read_examples(args.data) if args.data else None
    lm = _load_model(args)
    show = progress(args) or args.verbose
    report = (lambda step, loss: print(f"step {step}/{args.steps}: KL {loss:.4f}", file=sys.stderr, flush=True)) if show else None
    with store_of(args) as store:
        stored, created = train_adapter_and_store(
            store, lm, name=args.name, examples=examples, source=f"file {Path(args.data).name}" if args.data else "",
            tokens=args.tokens, steps=args.steps, learning_rate=args.learning_rate, seed=args.seed, progress=report,
        )
    assert stored.header.metrics is not None, "an adapter pack records how it was trained"
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


def cmd_render(args: argparse.Namespace) -> int:
    with store_of(args, readonly=True) as store:
        header = store.stat(args.ref).header
    model = args.model or header.model_name
    prompt = pack_prompt(load_tokenizer(model, chat_template=_chat_template(args)), header, args.question, model=model)
    if args.json:
        emit_json(prompt.to_json() | {"pack_salt": pack_salt(prompt.key)})  # the cache_salt tail vLLM's connector may ask for
        return 0
    if prompt.messages is None:
        print(
            f"pack {prompt.key} was built without the chat template (raw): chat messages cannot express it; "
            "send this prompt text (a completions request) or its token ids",
            file=sys.stderr,
        )
        print(prompt.prompt)
    else:
        print(json.dumps(prompt.messages, ensure_ascii=False))
    print(f"{len(prompt.prompt_token_ids)} prompt tokens, the first {prompt.pack_tokens} from the pack", file=sys.stderr)
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    directory = Path(args.dir).expanduser()
    if not args.force and directory.is_dir() and any(directory.iterdir()):
        raise InvalidInput(f"{directory} is not empty: give a new or empty directory, or --force to write into it")
    exported = export_model(args.model, directory, dtype=args.dtype, chat_template=_chat_template(args), overwrite=args.force)
    if args.json:
        emit_json(exported.to_json())
    else:
        print(exported.directory)
        print(f"model_fp:    {exported.model_fp} ({exported.dtype})")
        print(f"template_fp: {exported.template_fp}")
    return 0
