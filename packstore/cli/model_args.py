"""The arguments of packctl's model-side commands. Their handlers (``packstore.cli.models``) import torch,
so they are imported only when one of these commands runs: parsing and the store commands never load it."""

from __future__ import annotations

import argparse

from packstore.cli.banks import bank_options
from packstore.cli.program import CommandLine, deferred, global_options
from packstore.format.header import COMPOSITIONS as COMPOSE_MODES
from packstore.format.header import FRAMINGS, KEY_SPACES, POOLINGS
from packstore.kv.options import ADAPTER_LEARNING_RATE, ADAPTER_STEPS, ADAPTER_TOKENS, MAX_ALPHA, STEER_TARGETS

HANDLERS = "packstore.cli.models"


def _model_options(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "--model", required=required, metavar="M", help="smollm2-135m, gemma3-270m, or a local Hugging Face model directory"
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="compute dtype (part of the model identity)"
    )
    _chat_template_option(parser)


def _composition_options(parser: argparse.ArgumentParser, modes: tuple[str, ...]) -> None:
    parser.add_argument(
        "--mode", choices=modes, default="exact",
        help="exact (default): prefill each later part after the earlier ones, same answers as all facts as text; "
        "rope: splice independently built parts, keys rotated to their new positions (approximate, no part prefilled); "
        "naive: splice without re-positioning (wrong; only to measure it); "
        "packet: rope plus the soft tokens of --adapter around each part (approximate, no part prefilled)",
    )
    parser.add_argument("--adapter", metavar="REF", help="the adapter (packctl adapter train) for --mode packet")


def _chat_template_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", metavar="FILE", help="use this Jinja chat template instead of the tokenizer's own")


def add_commands(cli: CommandLine) -> None:
    """build, compose, amend, ask, render, adapter train, steer build and model export, with their arguments and deferred
    handlers."""
    p = cli.command("build", deferred(HANDLERS, "cmd_build"), "build a pack from a facts file and store it; prints the key")
    p.add_argument("facts", metavar="FACTS", help="one fact per line, or JSONL with a 'text' field")
    _model_options(p)
    p.add_argument("--name", help="name (alias) for the pack, per model")
    p.add_argument("--raw", action="store_true", help="no chat template around the facts (to measure that pitfall)")
    p.add_argument(
        "--engine", choices=("transformers", "vllm"), default="transformers",
        help="whose prefill computes the K/V: packstore's own (transformers, default) or vLLM's (a pack vLLM then loads bit for "
        "bit as its own prefix cache; the header records the engine, which is part of the key)",
    )
    p.add_argument("--block-size", type=int, default=128, metavar="N", help="--engine vllm: vLLM's KV cache block size (default 128)")

    p = cli.command(
        "compose", deferred(HANDLERS, "cmd_compose"),
        "compose packs in order into a new pack (model: --model, else the first pack's own); prints its key",
    )
    p.add_argument("refs", metavar="REF", nargs="+", help="two or more packs, in order")
    _model_options(p, required=False)
    p.add_argument("--name", help="name (alias) for the composed pack, per model")
    _composition_options(p, COMPOSE_MODES)

    p = cli.command(
        "amend", deferred(HANDLERS, "cmd_amend"),
        "append an erratum to a pack as a new pack, the old one kept (model: --model, else the pack's own); prints its key",
    )
    p.add_argument("ref", metavar="REF")
    p.add_argument("--erratum", required=True, metavar="TEXT", help="one line; rendered as 'Correction: TEXT' after the facts")
    _model_options(p, required=False)
    p.add_argument("--name", help="name (alias) for the amended pack, per model")

    p = cli.command("ask", deferred(HANDLERS, "cmd_ask"), "answer with a pack injected as past_key_values")
    p.add_argument(
        "ref", metavar="REF", nargs="?",
        help=(
            "pack key, name, or content-hash prefix; A,B,C answers with their exact composition"
            " (with --bank: the routed facts follow them)"
        ),
    )
    p.add_argument("question", metavar="QUESTION", nargs="?")
    p.add_argument("--questions", metavar="FILE", help='JSONL lines {"question": ...}; prints one JSON object per line')
    _model_options(p, required=False)
    p.add_argument(
        "--worker", metavar="HOST:PORT", help="answer on a packstore worker instead of loading the model here (grpcs://HOST:PORT: TLS)"
    )
    p.add_argument("--bank", metavar="N", help="route the question in bank N and answer with its top facts' pack (computed lazily)")
    bank_options(p)
    p.add_argument(
        "--compare-rag",
        action="store_true",
        help="also answer with the facts in the prompt (in one prefill, and in the pack's own prefill passes) and compare",
    )
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
    p.add_argument(
        "--stop", action="append", default=[], metavar="STR", help="end the answer before this string (repeatable; the first found wins)"
    )

    p = cli.command(
        "render", deferred(HANDLERS, "cmd_render"),
        "print what a client sends a serving engine (vLLM) so the pack applies: the chat messages and the prompt's token ids",
    )
    p.add_argument("ref", metavar="REF", help="pack key or name")
    p.add_argument("question", metavar="QUESTION")
    p.add_argument(
        "--model", metavar="M", help="the model whose tokenizer renders (default: the pack's own); smollm2-135m, gemma3-270m or a directory"
    )
    _chat_template_option(p)

    adapter = cli.command(
        "adapter", deferred(HANDLERS, "cmd_adapter"), "KV Packet adapters: soft tokens trained to splice independently built packs"
    )
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

    steer = cli.command(
        "steer", deferred(HANDLERS, "cmd_steer"), "steering packs: contrastive value deltas that change how a model answers"
    )
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
    p.add_argument(
        "--keys", choices=KEY_SPACES, default="rotated", dest="key_space",
        help="key deltas as cached, after RoPE (default), or unrotated: pooled before RoPE and applied rotated to each "
        "position (the key-arithmetic control with --steer-on keys; needs a model whose RoPE is a pure rotation)",
    )
    p.add_argument(
        "--framing", choices=FRAMINGS, default="text",
        help="pool each pair text alone (default) or as a user message in the chat template, over the message and the "
        "template after it (the positions steering is added to when asking)",
    )

    model = cli.command("model", deferred(HANDLERS, "cmd_model"), "models: write one as a Hugging Face directory a serving engine loads")
    sub = model.add_subparsers(dest="model_command", required=True, metavar="MODEL_COMMAND")
    p = sub.add_parser(
        "export", parents=[global_options(add_defaults=False, client=True)],
        help="write model M to DIR as a Hugging Face directory (config, tokenizer with chat template, safetensors) for vllm serve DIR",
        description="write model M to DIR as a Hugging Face directory (config, generation config, tokenizer with its chat template, "
        "safetensors) that vLLM serves (vllm serve DIR); prints DIR and the model_fp and template_fp packs for it carry",
    )
    p.add_argument("model", metavar="M", help="smollm2-135m, gemma3-270m, or a local Hugging Face model directory")
    p.add_argument("dir", metavar="DIR", help="the directory to write (new or empty, unless --force)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
        help="the compute dtype whose model_fp is printed (the weights are written as they are)",
    )
    _chat_template_option(p)
    p.add_argument(
        "--force", action="store_true", help="write into a non-empty DIR: same-named files are replaced, other weight files removed"
    )
