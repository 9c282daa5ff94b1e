"""The worker's OpenAI-compatible HTTP API on the tiny model, with the real ``openai`` client on loopback: answers equal
the local answering path's (``packctl ask``'s), streamed or not, with packs, a bank and steering; ``/v1/completions``
answers as chat does; every error status, strict fields, unknown paths and methods. Attacks on its slots and
deadlines: tests/unit/test_worker_fairness.py."""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from http.client import HTTPConnection
from pathlib import Path

import anyio
import openai
import pytest

from packstore.answering.answer import Answerer, Question
from packstore.bank.bank import open_banks
from packstore.cli.packctl import main as packctl
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling
from packstore.kv.records import Pair
from packstore.kv.steer import build_steering
from packstore.kv.synthetic import synthetic_facts
from packstore.packs.tensors import encode_pack
from packstore.security.auth import Auth
from packstore.store import LmdbStore
from packstore.store.lmdb.store import _chunk_key
from packstore.worker.http import MAX_BODY_BYTES, OpenAIApp, serve_http
from packstore.worker.server import WorkerService
from tests.helpers.banks import TEST_BANK_CACHE

FACTS = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
GREEDY = Sampling(max_new_tokens=12)
QUESTION = "What is Wexley famous for?"


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_lm):
    """A store with packs, a bank and a steering pack; a worker service over it answering on an HTTP port."""
    root = tmp_path_factory.mktemp("http")
    store = LmdbStore(root / "store")
    store.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
    store.put(encode_pack(build_pack(tiny_lm, ["Bob lives in Oslo."])), name="bob")
    store.put(encode_pack(build_pack(tiny_lm, FACTS, raw=True)), name="wexley-raw")
    store.put(encode_pack(build_steering(tiny_lm, [Pair("Alice lives in Paris and works as a baker.", "Bob lives in Oslo.")])), name="joy")
    cases = synthetic_facts(40)
    open_banks(store, TEST_BANK_CACHE).build("wbank", [case.fact for case in cases])
    service = WorkerService(tiny_lm, lambda namespace: store, cache_bytes=1 << 30, max_concurrent=4)
    app = OpenAIApp(service)
    server = serve_http("127.0.0.1:0", app)
    client = openai.OpenAI(base_url=f"http://{server.listening}/v1", api_key="unused", max_retries=0)
    yield store, app, server, client, cases
    server.stop(1)
    store.close()


def http(url: str, body: dict | None = None) -> tuple[int, str, str]:
    """A plain HTTP request (POST with a JSON ``body``, else GET): the status, content type and text of its response."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def local(store, tiny_lm, question: Question):
    """The answer of the local answering path (``packctl ask --model``'s) on a fresh Answerer."""
    return Answerer(tiny_lm, store).ask(question)


def ask(client, tiny_lm, stream: bool = False, **extra):
    return client.chat.completions.create(
        model=tiny_lm.name, messages=[{"role": "user", "content": QUESTION}], max_tokens=GREEDY.max_new_tokens, stream=stream, extra_body=extra
    )


def test_an_answer_with_a_pack_is_the_worker_answer_with_usage_and_packstore_fields(world, tiny_lm) -> None:
    store, _, _, client, _ = world
    expected = local(store, tiny_lm, Question(QUESTION, refs=("wexley",), sampling=GREEDY))
    completion = ask(client, tiny_lm, packs=["wexley"])
    assert completion.object == "chat.completion" and completion.model == tiny_lm.name
    assert completion.choices[0].message.content == expected.answer and completion.choices[0].message.role == "assistant"
    assert completion.usage.prompt_tokens == expected.kv_prompt_tokens and completion.usage.completion_tokens > 0
    facts = completion.model_extra["packstore"]
    assert facts["packs"] == [expected.pack] and facts["pack"] == expected.pack
    assert facts["prompt_tokens_saved"] == store.stat("wexley").header.tokens and isinstance(facts["cache_hit"], bool)
    assert ask(client, tiny_lm, packs=["wexley"]).model_extra["packstore"]["cache_hit"] is True


def test_a_streamed_answer_joins_to_the_same_answer_and_ends_with_usage(world, tiny_lm) -> None:
    store, _, _, client, _ = world
    expected = local(store, tiny_lm, Question(QUESTION, refs=("wexley",), sampling=GREEDY))
    chunks = list(
        client.chat.completions.create(
            model=tiny_lm.name, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body={"packs": ["wexley"]},
        )
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == expected.answer and all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == expected.kv_prompt_tokens
    assert chunks[-1].model_extra["packstore"]["packs"] == [expected.pack]


def test_several_packs_a_bank_steering_and_stop_strings_answer_as_the_local_path(world, tiny_lm) -> None:
    store, _, _, client, cases = world
    keys = [store.resolve("wexley"), store.resolve("bob")]
    composed = ask(client, tiny_lm, packs=["wexley", "bob"])
    expected = local(store, tiny_lm, Question(QUESTION, refs=("wexley", "bob"), sampling=GREEDY))
    assert composed.choices[0].message.content == expected.answer and composed.model_extra["packstore"]["packs"] == keys
    again = ask(client, tiny_lm, packs=["wexley", "bob"]).model_extra["packstore"]
    assert again["cache_hit"] is True and again["prompt_tokens_saved"] > composed.model_extra["packstore"]["prompt_tokens_saved"]
    banked = client.chat.completions.create(
        model=tiny_lm.name, messages=[{"role": "user", "content": cases[3].query}], max_tokens=12, extra_body={"bank": "wbank", "top_k": 2}
    )
    expected = local(store, tiny_lm, Question(cases[3].query, bank="wbank", top_k=2, sampling=GREEDY))
    assert banked.choices[0].message.content == expected.answer and banked.model_extra["packstore"]["facts"] == expected.facts
    reranked = client.chat.completions.create(
        model=tiny_lm.name, messages=[{"role": "user", "content": cases[3].query}], max_tokens=12,
        extra_body={"bank": "wbank", "top_k": 2, "rerank": "lm", "rerank_weight": 2.0},
    )
    expected = local(store, tiny_lm, Question(cases[3].query, bank="wbank", top_k=2, rerank="lm", rerank_weight=2.0, sampling=GREEDY))
    assert reranked.choices[0].message.content == expected.answer and reranked.model_extra["packstore"]["facts"] == expected.facts
    steered = ask(client, tiny_lm, packs=["wexley"], steer=[{"pack": "joy", "alpha": 4.0}], steer_layers=[0, 2])
    question = Question(QUESTION, refs=("wexley",), sampling=GREEDY, steering=(("joy", 4.0),), steer_layers=(0, 2))
    expected = local(store, tiny_lm, question)
    assert steered.choices[0].message.content == expected.answer and steered.model_extra["packstore"]["steering"] == expected.steering
    free = ask(client, tiny_lm, packs=["wexley"]).choices[0].message.content
    stop = free[3:6]
    cut = client.chat.completions.create(
        model=tiny_lm.name, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, stop=[stop], extra_body={"packs": ["wexley"]}
    )
    assert cut.choices[0].message.content == free[: free.find(stop)].strip() and cut.choices[0].finish_reason == "stop"


def test_the_answer_equals_packctl_ask_with_the_same_pack_question_and_sampling(world, tiny_lm, tiny_model_dir, tmp_path, capsys) -> None:
    *_, client, _ = world
    with LmdbStore(tmp_path / "own") as own:  # packctl opens its store itself: one of its own with the same pack
        own.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
    argv = ["--store", str(tmp_path / "own"), "ask", "wexley", QUESTION, "--model", str(tiny_model_dir), "--json", "--max-new-tokens", "12"]
    assert packctl(argv + ["--temperature", "0.5", "--seed", "7"]) == 0
    sampled = json.loads(capsys.readouterr().out)["answer"]
    completion = ask(client, tiny_lm, packs=["wexley"], temperature=0.5, seed=7)
    assert completion.choices[0].message.content == sampled


@pytest.mark.parametrize(
    ("extra", "status", "code", "message"),
    [
        ({"packs": ["nothing"]}, 404, "not_found", "nothing"),
        ({"packs": ["wexley"], "model": "gpt-4o"}, 404, "model_not_found", "gpt-4o"),
        ({"packs": ["wexley"], "n": 2}, 400, "invalid_input", "n is not supported"),
        ({"packs": ["wexley"], "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "invalid_input", "tools"),
        ({"packs": ["wexley"], "logprobs": True}, 400, "invalid_input", "logprobs"),
        ({"packs": ["wexley"], "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}, 400, "invalid_input", "cannot place these earlier turns (system)"),
        ({"packs": ["wexley"], "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}, 400, "invalid_input", "last message must be a user message"),
        ({"packs": ["wexley"], "messages": [{"role": "assistant", "content": None, "tool_calls": []}, {"role": "user", "content": "Hi"}]}, 400, "invalid_input", "tool calls"),
        ({"packs": ["wexley"], "messages": []}, 400, "invalid_input", "non-empty list"),
        ({"packs": ["joy"]}, 400, "pack_mismatch", "steering pack"),
        ({"packs": ["wexley"], "temperature": -1}, 400, "invalid_input", "temperature"),
        ({"packs": ["wexley"], "steer_layers": [0]}, 400, "invalid_input", "steer_layers"),
        ({"packs": ["wexley"], "top_k": "many"}, 400, "invalid_input", "top_k"),
        ({"bank": "wbank", "rerank": "bogus"}, 400, "invalid_input", "unknown reranker 'bogus'"),
        ({"wat": 1}, 400, "invalid_input", "unknown field 'wat'"),
        ({}, 400, "invalid_input", "nothing to answer with"),
    ],
)
def test_bad_requests_get_openai_errors_with_their_status(world, tiny_lm, extra, status, code, message) -> None:
    *_, server, _, _ = world
    body = {"model": tiny_lm.name, "messages": [{"role": "user", "content": QUESTION}]} | extra
    got, _, text = http(f"http://{server.listening}/v1/chat/completions", body)
    error = json.loads(text)["error"]
    assert got == status and error["code"] == code and message in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_the_openai_client_raises_its_own_errors(world, tiny_lm) -> None:
    *_, client, _ = world
    with pytest.raises(openai.NotFoundError):
        ask(client, tiny_lm, packs=["nothing"])
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": QUESTION}])
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        ask(client, tiny_lm, packs=["wexley"], n=3)


def test_a_conversation_renders_after_the_pack_and_answers_as_the_local_path_and_as_text(world, tiny_lm) -> None:
    store, _, _, client, _ = world
    history = (("user", "Which river flows through Wexley?"), ("assistant", "The river Tamsin."))
    messages = [{"role": role, "content": content} for role, content in history] + [{"role": "user", "content": QUESTION}]
    completion = client.chat.completions.create(
        model=tiny_lm.name, messages=messages, max_tokens=12, extra_body={"packs": ["wexley"], "compare_rag": True}
    )
    expected = local(store, tiny_lm, Question(QUESTION, refs=("wexley",), sampling=GREEDY, history=history, compare_rag=True))
    assert completion.choices[0].message.content == expected.answer and expected.identical is True
    summary = completion.model_extra["packstore"]
    assert summary["identical"] is True and summary["chunked_identical"] is True
    single = ask(client, tiny_lm, packs=["wexley"])
    assert completion.usage.prompt_tokens == expected.kv_prompt_tokens > single.usage.prompt_tokens  # the turns are prefilled
    streamed = client.chat.completions.create(
        model=tiny_lm.name, messages=messages, max_tokens=12, stream=True, extra_body={"packs": ["wexley"]}
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected.answer


def test_a_request_finding_no_generation_slot_gets_429_and_a_damaged_pack_500_naming_it(world, tiny_lm) -> None:
    store, app, _, client, _ = world
    slots = app.service.slots
    others = [f"ipv4:10.0.0.{n}" for n in range(slots.rule.capacity)]  # (as if other hosts were generating on them all)
    assert all(slots.try_take(other) for other in others)
    try:
        with pytest.raises(openai.RateLimitError, match="all 4 generation slots are in use"):
            ask(client, tiny_lm, packs=["wexley"])
    finally:
        for other in others:
            slots.give_back(other)
    key, _ = store.put(encode_pack(build_pack(tiny_lm, ["Carol lives in Lima."])), name="broken")
    last = len(store.stat(key).header.chunks) - 1

    def flip(txn) -> None:  # one bit of the stored chunk: its checksum no longer matches
        damaged = bytearray(txn.get(_chunk_key(key, last), db=store._chunks))
        damaged[-1] ^= 1
        txn.put(_chunk_key(key, last), bytes(damaged), db=store._chunks)

    store._env.write(flip)
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as info:
            list(ask(client, tiny_lm, packs=["broken"], stream=stream)) if stream else ask(client, tiny_lm, packs=["broken"])
        assert key in info.value.message and info.value.code == "data_loss"
    assert ask(client, tiny_lm, packs=["wexley"]).choices[0].message.content  # the worker goes on serving


def test_a_slot_is_free_before_the_last_bytes_of_its_answer_are_sent(world, tiny_lm) -> None:
    """A client that has read a whole answer can ask again at once under --max-concurrent 1: the slot frees when the
    answer is whole, not after its response has gone out (the race test_http_real met as a 429)."""
    _, app, *_ = world

    async def in_flight_while_sending_the_end(stream: bool) -> list[int]:
        body = {"model": tiny_lm.name, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "stream": stream, "packs": ["wexley"]}
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [(b"content-type", b"application/json")]}
        requested = [False]
        seen: list[int] = []

        async def receive() -> dict:
            if not requested[0]:
                requested[0] = True
                return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
            await anyio.sleep_forever()  # (the client stays: Starlette listens for a disconnect while it streams)
            return {}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and (b"[DONE]" in message.get("body", b"") or not stream):
                seen.append(app.service.slots.in_use)

        await app.app(scope, receive, send)
        return seen

    for stream in (False, True):
        assert anyio.run(in_flight_while_sending_the_end, stream)[:1] == [0], f"stream={stream}"
    assert app.service.slots.in_use == 0


def test_a_body_over_the_limit_is_refused_with_413(world, tiny_lm) -> None:
    *_, server, _, _ = world
    host, port = server.listening.rsplit(":", 1)
    for announced, sent in ((MAX_BODY_BYTES + 1, b""), (None, b"x" * (MAX_BODY_BYTES + 1))):  # said up front, or found reading
        connection = HTTPConnection(host, int(port), timeout=60)
        connection.putrequest("POST", "/v1/chat/completions")
        connection.putheader("Content-Type", "application/json")
        if announced is not None:
            connection.putheader("Content-Length", str(announced))
            connection.endheaders()
        else:
            connection.putheader("Transfer-Encoding", "chunked")
            connection.endheaders()
            try:
                connection.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(sent), sent))
            except OSError:  # the server may answer and close before the whole body is sent
                pass
        response = connection.getresponse()
        assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
        connection.close()


def test_raw_sse_framing_and_models_and_health(world, tiny_lm) -> None:
    *_, server, _, _ = world
    base = f"http://{server.listening}"
    body = {"model": tiny_lm.name, "messages": [{"role": "user", "content": QUESTION}], "stream": True, "packs": ["wexley"], "max_tokens": 6}
    status, kind, raw = http(f"{base}/v1/chat/completions", body)
    assert status == 200 and kind.startswith("text/event-stream")
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]" and all(event.startswith("data: ") for event in events[:-1])
    chunks = [json.loads(event[len("data: ") :]) for event in events[:-2]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["choices"][0]["finish_reason"] is not None
    assert "packstore" in chunks[-1] and "usage" not in chunks[-1]
    models = json.loads(http(f"{base}/v1/models")[2])
    assert models["object"] == "list" and [model["id"] for model in models["data"]] == [tiny_lm.name]
    assert json.loads(http(f"{base}/health")[2]) == {"status": "ok"}


def test_with_tokens_a_bearer_token_and_its_namespace_are_required(tmp_path: Path, tiny_lm) -> None:
    stores = {name: LmdbStore(tmp_path / name) for name in ("alpha", "beta")}
    stores["alpha"].put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
    digest = lambda token: hashlib.sha256(token.encode()).hexdigest()  # noqa: E731
    (tmp_path / "tokens.toml").write_text(
        f'[[token]]\nname = "a"\nsha256 = "{digest("secret-a")}"\nnamespaces = ["alpha"]\nrole = "read"\n'
        f'[[token]]\nname = "both"\nsha256 = "{digest("secret-both")}"\nnamespaces = ["alpha", "beta"]\nrole = "read"\n'
    )
    service = WorkerService(tiny_lm, stores.__getitem__, cache_bytes=1 << 30, auth=Auth(tmp_path / "tokens.toml"))
    server = serve_http("127.0.0.1:0", OpenAIApp(service))
    try:
        def client(token: str, namespace: str | None = None) -> openai.OpenAI:
            headers = {"X-Packstore-Namespace": namespace} if namespace else None
            return openai.OpenAI(base_url=f"http://{server.listening}/v1", api_key=token, max_retries=0, default_headers=headers)

        assert ask(client("secret-a"), tiny_lm, packs=["wexley"]).choices[0].message.content
        assert ask(client("secret-both", "alpha"), tiny_lm, packs=["wexley"]).choices[0].message.content
        with pytest.raises(openai.NotFoundError):  # another tenant's pack is simply unknown
            ask(client("secret-both", "beta"), tiny_lm, packs=["wexley"])
        with pytest.raises(openai.AuthenticationError):
            ask(client("wrong"), tiny_lm, packs=["wexley"])
        with pytest.raises(openai.AuthenticationError):
            client("wrong").models.list()
        with pytest.raises(openai.PermissionDeniedError):
            ask(client("secret-a", "beta"), tiny_lm, packs=["wexley"])
        with pytest.raises(openai.BadRequestError, match="several namespaces"):
            ask(client("secret-both"), tiny_lm, packs=["wexley"])
        status, _, text = http(f"http://{server.listening}/v1/chat/completions", {})
        assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error"
        assert http(f"http://{server.listening}/health")[0] == 200  # health needs no token
    finally:
        server.stop(1)
        for store in stores.values():
            store.close()


def test_packstore_worker_http_serves_https_with_the_tls_flags_and_answers_as_its_grpc_port(tiny_lm, tiny_model_dir, tmp_path, capsys) -> None:
    import ssl

    from packstore.store.remote.store import RemoteStore
    from tests.helpers.tls import make_certificates
    from tools.lib.servers import free_port, running_server, running_worker

    certs = make_certificates(tmp_path / "tls")
    with running_server(tmp_path / "data") as server:
        with RemoteStore(server.url) as remote:
            remote.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
        port = free_port()
        flags = ["--threads", "1", "--http", str(port), "--tls-cert", certs["cert"], "--tls-key", certs["key"]]
        with running_worker(server.url, str(tiny_model_dir), tmp_path, *flags, tls={"ca": certs["ca"]}) as worker:
            ask_argv = ["--tls-ca", certs["ca"], "ask", "wexley", QUESTION, "--worker", f"grpcs://{worker.address}", "--json", "--max-new-tokens", "12"]
            assert packctl(ask_argv) == 0
            expected = json.loads(capsys.readouterr().out)
            body = {"model": str(tiny_model_dir), "messages": [{"role": "user", "content": QUESTION}], "packs": ["wexley"], "max_tokens": 12}
            request = urllib.request.Request(  # no host in --http: loopback
                f"https://localhost:{port}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=certs["ca"]), timeout=60) as response:
                completion = json.loads(response.read())
            assert completion["choices"][0]["message"]["content"] == expected["answer"]
            assert completion["packstore"]["pack"] == expected["pack"] and completion["usage"]["prompt_tokens"] == expected["kv_prompt_tokens"]
            with pytest.raises(OSError):  # HTTPS only: plain HTTP gets no answer
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)


def test_with_a_client_ca_the_https_port_answers_only_clients_with_a_certificate_it_signed(world, tiny_lm, tmp_path) -> None:
    import ssl

    from tests.helpers.tls import make_certificates

    _, app, _, _, _ = world
    certs = make_certificates(tmp_path / "tls")
    server = serve_http("127.0.0.1:0", app, tls_cert=certs["cert"], tls_key=certs["key"], tls_client_ca=certs["ca"])
    try:
        url = f"https://localhost:{server.listening.rsplit(':', 1)[1]}/v1/chat/completions"
        body = json.dumps({"model": tiny_lm.name, "messages": [{"role": "user", "content": QUESTION}], "packs": ["wexley"], "max_tokens": 4})
        request = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
        anonymous = ssl.create_default_context(cafile=certs["ca"])
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(request, context=anonymous, timeout=30).read()
        signed = ssl.create_default_context(cafile=certs["ca"])
        signed.load_cert_chain(certs["client_cert"], certs["client_key"])
        with urllib.request.urlopen(request, context=signed, timeout=60) as response:
            assert json.loads(response.read())["choices"][0]["message"]["content"]
    finally:
        server.stop(1)


def complete(client, tiny_lm, prompt: str | list = QUESTION, stream: bool = False, **extra):
    return client.completions.create(model=tiny_lm.name, prompt=prompt, max_tokens=GREEDY.max_new_tokens, stream=stream, extra_body=extra)


@pytest.mark.parametrize("pack", ["wexley", "wexley-raw"])
def test_a_completion_is_the_chat_answer_to_its_prompt_as_one_user_message(world, tiny_lm, pack) -> None:
    """With a pack the prompt is the user turn after it (a raw pack's: after its bare text), checked and answered as
    chat's one user message: the same text, usage and packstore fields, whole or streamed."""
    store, _, _, client, _ = world
    expected = local(store, tiny_lm, Question(QUESTION, refs=(pack,), sampling=GREEDY))
    chat = ask(client, tiny_lm, packs=[pack])
    completion = complete(client, tiny_lm, packs=[pack])
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-") and completion.model == tiny_lm.name
    choice = completion.choices[0]
    assert choice.text == chat.choices[0].message.content == expected.answer and choice.index == 0 and choice.logprobs is None
    assert choice.finish_reason == chat.choices[0].finish_reason
    assert completion.usage.prompt_tokens == chat.usage.prompt_tokens == expected.kv_prompt_tokens
    assert completion.usage.completion_tokens == chat.usage.completion_tokens
    assert completion.model_extra["packstore"]["pack"] == expected.pack == store.resolve(pack)
    assert complete(client, tiny_lm, prompt=[QUESTION], packs=[pack]).choices[0].text == expected.answer  # a list of one
    chunks = list(
        client.completions.create(
            model=tiny_lm.name, prompt=QUESTION, max_tokens=12, stream=True, stream_options={"include_usage": True}, extra_body={"packs": [pack]}
        )
    )
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected.answer
    assert all(chunk.object == "text_completion" for chunk in chunks) and chunks[-2].choices[0].finish_reason == choice.finish_reason
    assert chunks[-2].model_extra["packstore"]["pack"] == expected.pack
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == expected.kv_prompt_tokens


def test_a_completion_takes_chats_bank_steering_and_sampling_fields(world, tiny_lm) -> None:
    store, _, _, client, cases = world
    banked = client.completions.create(model=tiny_lm.name, prompt=cases[3].query, max_tokens=12, extra_body={"bank": "wbank", "top_k": 2})
    expected = local(store, tiny_lm, Question(cases[3].query, bank="wbank", top_k=2, sampling=GREEDY))
    assert banked.choices[0].text == expected.answer and banked.model_extra["packstore"]["facts"] == expected.facts
    steered = complete(client, tiny_lm, packs=["wexley"], steer=[{"pack": "joy", "alpha": 4.0}], steer_layers=[0, 2])
    question = Question(QUESTION, refs=("wexley",), sampling=GREEDY, steering=(("joy", 4.0),), steer_layers=(0, 2))
    assert steered.choices[0].text == local(store, tiny_lm, question).answer
    sampled = client.completions.create(
        model=tiny_lm.name, prompt=QUESTION, max_tokens=12, temperature=0.5, top_p=0.9, seed=7, extra_body={"packs": ["wexley"]}
    )
    sampling = Sampling(max_new_tokens=12, temperature=0.5, top_p=0.9, seed=7)
    assert sampled.choices[0].text == local(store, tiny_lm, Question(QUESTION, refs=("wexley",), sampling=sampling)).answer
    free = complete(client, tiny_lm, packs=["wexley"]).choices[0].text
    cut = client.completions.create(model=tiny_lm.name, prompt=QUESTION, max_tokens=12, stop=free[3:6], extra_body={"packs": ["wexley"]})
    assert cut.choices[0].text == free[: free.find(free[3:6])].strip() and cut.choices[0].finish_reason == "stop"


def test_raw_sse_framing_of_a_streamed_completion(world, tiny_lm) -> None:
    *_, server, _, _ = world
    body = {"model": tiny_lm.name, "prompt": QUESTION, "stream": True, "packs": ["wexley"], "max_tokens": 6}
    status, kind, raw = http(f"http://{server.listening}/v1/completions", body)
    assert status == 200 and kind.startswith("text/event-stream")
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]" and all(event.startswith("data: ") for event in events[:-1])
    chunks = [json.loads(event[len("data: ") :]) for event in events[:-2]]
    assert all(set(chunk["choices"][0]) == {"index", "text", "finish_reason", "logprobs"} for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] is not None and "packstore" in chunks[-1]


@pytest.mark.parametrize(
    ("extra", "status", "param", "message"),
    [
        ({"prompt": ["one", "two"]}, 400, "prompt", "exactly one"),
        ({"prompt": ""}, 400, "prompt", "non-empty string"),
        ({"prompt": 5}, 400, "prompt", "non-empty string"),
        ({"prompt": None}, 400, "prompt", "non-empty string"),
        ({"echo": True}, 400, "echo", "echo is not supported"),
        ({"best_of": 2}, 400, "best_of", "best_of is not supported"),
        ({"logprobs": 2}, 400, "logprobs", "logprobs is not supported"),
        ({"suffix": "!"}, 400, "suffix", "suffix is not supported"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, 400, "messages", "unknown field 'messages'"),
        ({"max_completion_tokens": 4}, 400, "max_completion_tokens", "unknown field"),
        ({"packs": ["nothing"]}, 404, None, "nothing"),
        ({"model": "gpt-3.5-turbo-instruct"}, 404, "model", "does not exist here"),
    ],
)
def test_bad_completion_requests_get_openai_errors(world, tiny_lm, extra, status, param, message) -> None:
    *_, server, _, _ = world
    body = {"model": tiny_lm.name, "prompt": QUESTION, "packs": ["wexley"], "max_tokens": 4} | extra
    got, _, text = http(f"http://{server.listening}/v1/completions", body)
    error = json.loads(text)["error"]
    assert got == status and error["param"] == param and message in error["message"], text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", "5"), ("max_tokens", 1.5), ("max_tokens", 4.0), ("max_tokens", True),
        ("max_tokens", 10**9), ("max_tokens", [4]), ("max_completion_tokens", 0), ("temperature", "hot"), ("temperature", True),
        ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_p", "1"), ("seed", -1), ("seed", "7"), ("seed", 1.5),
        ("seed", False), ("stop", 5), ("stop", ["\n", 3]),
    ],
)
def test_sampling_fields_must_be_numbers_of_their_kind_and_range(world, tiny_lm, path, field, value) -> None:
    """max_tokens 0 used to be read as unset (64 tokens), and -5 refused by the protobuf parser naming ``body``: each
    is now a 400 naming the field, as a JSON bool, a string of digits or a float is (max_completion_tokens on
    /v1/completions: an unknown field, named alike)."""
    *_, server, _, _ = world
    body = {"model": tiny_lm.name, "packs": ["wexley"], field: value}
    body |= {"prompt": QUESTION} if path == "/v1/completions" else {"messages": [{"role": "user", "content": QUESTION}]}
    got, _, text = http(f"http://{server.listening}{path}", body)
    error = json.loads(text)["error"]
    assert got == 400 and error["param"] == field and error["code"] == "invalid_input" and error["type"] == "invalid_request_error", text
    assert field in error["message"]


def test_max_tokens_of_one_and_the_limit_are_taken(world, tiny_lm) -> None:
    *_, client, _ = world
    one = client.chat.completions.create(
        model=tiny_lm.name, messages=[{"role": "user", "content": QUESTION}], max_completion_tokens=1, extra_body={"packs": ["wexley"]}
    )
    assert one.usage.completion_tokens == 1
    assert complete(client, tiny_lm, packs=["wexley"]).usage.completion_tokens <= GREEDY.max_new_tokens


@pytest.mark.parametrize(
    ("method", "path", "status", "code", "allow"),
    [
        ("GET", "/v1/nothing", 404, "not_found", None),
        ("POST", "/v2/chat/completions", 404, "not_found", None),
        ("GET", "/", 404, "not_found", None),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed", "POST"),
        ("GET", "/v1/completions", 405, "method_not_allowed", "POST"),
        ("DELETE", "/v1/completions", 405, "method_not_allowed", "POST"),
        ("POST", "/v1/models", 405, "method_not_allowed", "GET, HEAD"),
        ("POST", "/health", 405, "method_not_allowed", "GET, HEAD"),
    ],
)
def test_unknown_paths_and_wrong_methods_answer_openai_json_errors(world, method, path, status, code, allow) -> None:
    *_, server, _, _ = world
    host, port = server.listening.rsplit(":", 1)
    connection = HTTPConnection(host, int(port), timeout=60)
    connection.request(method, path, body=b"{}" if method == "POST" else None, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    body = json.loads(response.read())
    connection.close()
    assert response.status == status and response.headers["Content-Type"] == "application/json", body
    assert body["error"]["code"] == code and body["error"]["type"] == "invalid_request_error" and set(body["error"]) == {"message", "type", "param", "code"}
    assert path in body["error"]["message"] and response.headers.get("Allow") == allow
