"""The worker as a front for vLLM, whole, for the benchmark and the evaluation that measure it: smollm2-135m exported
(``packctl model export``), a store of packs and one bank, vLLM's OpenAI server with ``PackstoreConnector`` (saving
on, ``--enable-prompt-tokens-details``) and ``packstore worker --engine vllm`` in front, all on loopback; plus the
calls both tools make (a streamed chat through the front with its first-token time, vLLM asked directly)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from packstore.answering.api import build_and_store
from packstore.bank.bank import BankCache, open_banks
from packstore.errors import PackNotFound
from packstore.kv.export import export_model
from packstore.kv.models import LoadedModel, load_model
from packstore.store import LmdbStore
from tools.lib.servers import free_port, running_vllm, running_worker

SERVED = "smollm2"  # the name vLLM serves the model under


@dataclass(frozen=True)
class FrontStack:
    """The running stack: vLLM's ``/v1`` URL, the front's HTTP ``/v1`` URL and gRPC address, the store, the model
    directory (the front's model name), the stored packs' keys by name, and the tokenizer."""

    vllm: str
    http: str
    grpc: str
    store: Path
    model_dir: Path
    keys: dict[str, str]
    tokenizer: Any


@contextmanager
def front_stack(
    workdir: Path,
    packs: Mapping[str, Sequence[str]],
    banks: Mapping[str, Sequence[str]],
    *,
    dtype: str = "float32",
    block_size: int = 32,
    bank_cache: BankCache | None = None,
    more: Callable[[LmdbStore, LoadedModel], dict[str, str]] | None = None,
) -> Iterator[FrontStack]:
    """Build the packs and banks (``name -> facts``) in ``dtype`` (and whatever ``more`` stores: its packs' keys by
    name), start vLLM and the front, yield the stack."""
    model_dir = workdir / "smollm2"
    if not (model_dir / "config.json").exists():
        export_model("smollm2-135m", model_dir)
    store_path = workdir / f"store-{dtype}"
    fresh = not store_path.exists()
    lm = load_model(str(model_dir), device="cpu", dtype=dtype, progress=False)
    with LmdbStore(store_path) as store:
        keys = {name: build_and_store(store, lm, facts, name=name)[0].key for name, facts in packs.items()}
        for name, facts in banks.items() if fresh else ():
            open_banks(store, bank_cache).build(name, list(facts))
        keys |= more(store, lm) if more is not None else {}
    tokenizer = lm.tokenizer
    del lm
    connector = {"store": str(store_path), "allow_save": True}
    extra = ("--dtype", dtype, "--enable-prompt-tokens-details", "--enable-log-requests")
    with running_vllm(model_dir, connector, workdir / f"vllm-{dtype}.log", block_size=block_size, extra=extra) as vllm:
        http = f"127.0.0.1:{free_port()}"
        args = ("--engine", "vllm", "--engine-url", vllm.removesuffix("/v1"), "--dtype", dtype, "--http", http)
        with running_worker(str(store_path), str(model_dir), workdir, *args) as front:
            yield FrontStack(vllm, f"http://{http}/v1", front.address, store_path, model_dir, keys, tokenizer)


@dataclass(frozen=True)
class Timed:
    """One streamed answer: its text, seconds to the first token and in all, and the packstore object or usage."""

    text: str
    first_token_s: float
    total_s: float
    report: dict[str, Any]


def _stream(client: httpx.Client, url: str, body: dict[str, Any], key: str) -> Timed:
    """POST ``body`` streamed to ``url``; ``key``: the field of the chunk that carries the report (``packstore`` or ``usage``)."""
    start = time.perf_counter()
    first, text, report = None, "", {}
    with client.stream("POST", url, json=body | {"stream": True, "stream_options": {"include_usage": True}}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if (piece or choice.get("token_ids")) and first is None:
                    first = time.perf_counter() - start
                text += piece
            report = chunk.get(key) or report
    total = time.perf_counter() - start
    return Timed(text.strip(), first if first is not None else total, total, report)


def ask_front(client: httpx.Client, stack: FrontStack, question: str, max_tokens: int, **fields: Any) -> Timed:
    """A streamed chat completion through the front (greedy), with its packstore object."""
    body = {"model": str(stack.model_dir), "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0} | fields
    return _stream(client, f"{stack.http}/chat/completions", body, "packstore")


def ask_vllm(client: httpx.Client, stack: FrontStack, prompt: Sequence[int], max_tokens: int, params: Any, salt: str | None) -> Timed:
    """A streamed completion of token ids straight to vLLM (greedy), with its usage; ``params``: kv_transfer_params."""
    body: dict[str, Any] = {"model": SERVED, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                            "kv_transfer_params": params}
    if salt is not None:
        body["cache_salt"] = salt
    return _stream(client, f"{stack.vllm}/completions", body, "usage")


def wait_stored(store: LmdbStore, key: str, seconds: float = 120.0) -> None:
    """A save is written after its answer: wait until pack ``key`` is in ``store``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            store.stat(key)
            return
        except PackNotFound:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"pack {key} was not saved within {seconds:g} s")
        time.sleep(0.2)
