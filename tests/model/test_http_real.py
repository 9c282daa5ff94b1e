"""The OpenAI-compatible HTTP API of a real ``packstore worker`` process on smollm2-135m, with the ``openai`` client:
answers equal the gRPC port's and the facts' as prompt text, a conversation included; a second request past
``--max-concurrent`` while one streams gets 429; SIGTERM closes both ports. ``/v1/completions`` answers a prompt as chat
answers it as one user message, exactly after the pack. Conversations on gemma3-270m, whose template has no system
role, render after its packs exactly too."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import openai
import pytest

from packstore.answering.answer import Answerer, Question
from packstore.errors import InvalidInput
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling
from packstore.kv.render import pack_prefix_ids, render
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from packstore.store.remote.store import RemoteStore
from packstore.worker.client import WorkerClient
from tests.helpers.real_models import WORKER_FLAGS, eval_rows, fact_sets
from tools.lib.servers import free_port, running_server, running_worker

pytestmark = [pytest.mark.model, pytest.mark.service]
TOKENS = 12  # answers are compared token for token: a divergence shows within the first tokens
GREEDY = Sampling(max_new_tokens=TOKENS)


def test_the_http_api_answers_as_the_grpc_port_and_as_text_on_smollm2(real_model, tmp_path: Path) -> None:
    lm = real_model("smollm2-135m")
    facts, rows = fact_sets(lm.tokenizer, eval_rows())[0]
    question = rows[0]["question"]
    http = f"127.0.0.1:{free_port()}"
    with running_server(tmp_path / "data") as server:
        with RemoteStore(server.url) as remote:
            remote.put(encode_pack(build_pack(lm, facts)), name="ckc")
        with running_worker(server.url, "smollm2-135m", tmp_path, *WORKER_FLAGS, "--http", http, "--max-concurrent", "1") as worker:
            client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0, timeout=300)
            with WorkerClient(worker.address) as grpc_client:
                expected = grpc_client.ask(Question(question, refs=("ckc",), sampling=GREEDY))
            messages = [{"role": "user", "content": question}]
            extra = {"packs": ["ckc"], "compare_rag": True}
            completion = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=TOKENS, extra_body=extra)
            summary = completion.model_extra["packstore"]
            assert completion.choices[0].message.content == expected.answer and summary["identical"] is True
            assert summary["prompt_tokens_saved"] >= 500 and completion.usage.prompt_tokens == expected.kv_prompt_tokens
            streamed = client.chat.completions.create(
                model="smollm2-135m", messages=messages, max_tokens=TOKENS, stream=True, extra_body={"packs": ["ckc"]}
            )
            assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected.answer

            conversation = [*messages, {"role": "assistant", "content": expected.answer}, {"role": "user", "content": rows[1]["question"]}]
            follow_up = client.chat.completions.create(model="smollm2-135m", messages=conversation, max_tokens=TOKENS, extra_body=extra)
            assert follow_up.model_extra["packstore"]["identical"] is True  # the turns after the pack render exactly
            with pytest.raises(openai.BadRequestError, match="cannot place these earlier turns"):
                client.chat.completions.create(
                    model="smollm2-135m", messages=[{"role": "system", "content": "Be brief."}, *messages], extra_body=extra
                )

            long = client.chat.completions.create(
                model="smollm2-135m", messages=messages, max_tokens=400, stream=True, extra_body={"packs": ["ckc"]}
            )
            next(iter(long))  # one request generating: the worker's only slot is taken
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=4, extra_body={"packs": ["ckc"]})
            long.close()  # the client goes: generation stops and the slot frees once the worker sees it gone
            patient = client.with_options(max_retries=6)  # (the OpenAI client's own backoff on 429)
            again = patient.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=TOKENS, extra_body={"packs": ["ckc"]})
            assert again.choices[0].message.content == expected.answer
            assert worker.stop() == 0
            lines = [json.loads(line) for line in (tmp_path / "worker.log").read_text().splitlines() if line.startswith("{")]
            cancelled = [line for line in lines if line.get("method") == "ChatCompletions" and line.get("code") == "CANCELLED"]
            assert len(cancelled) == 1 and 0 < cancelled[0]["tokens"] < 400
            for address in (http, worker.address):  # both ports closed with the process
                host, port = address.rsplit(":", 1)
                with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=5):
                    pass


def test_a_completion_is_the_chat_answer_to_its_prompt_after_the_pack_on_smollm2(real_model, tmp_path: Path) -> None:
    lm = real_model("smollm2-135m")
    facts, rows = fact_sets(lm.tokenizer, eval_rows())[0]
    question = rows[0]["question"]
    with LmdbStore(tmp_path / "store") as store:
        store.put(encode_pack(build_pack(lm, facts)), name="ckc")
    http = f"127.0.0.1:{free_port()}"
    with running_worker(str(tmp_path / "store"), "smollm2-135m", tmp_path, *WORKER_FLAGS, "--http", http):
        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0, timeout=300)
        extra = {"packs": ["ckc"], "compare_rag": True}
        chat = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": question}], max_tokens=TOKENS, extra_body=extra
        )
        completion = client.completions.create(model="smollm2-135m", prompt=question, max_tokens=TOKENS, extra_body=extra)
        assert completion.choices[0].text == chat.choices[0].message.content and completion.usage == chat.usage
        summary = completion.model_extra["packstore"]
        assert summary["identical"] is True and summary["prompt_tokens_saved"] >= 500  # the prompt rendered exactly after the pack
        streamed = client.completions.create(model="smollm2-135m", prompt=question, max_tokens=TOKENS, stream=True, extra_body={"packs": ["ckc"]})
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == completion.choices[0].text


def test_a_conversation_renders_after_a_gemma_pack_exactly(real_model, tmp_path: Path) -> None:
    lm = real_model("gemma3-270m")
    facts, rows = fact_sets(lm.tokenizer, eval_rows())[0]
    history = (("user", rows[0]["question"]), ("assistant", rows[0]["answers"][0]))
    rendering = render(lm.tokenizer, facts, rows[1]["question"], history=history)
    assert rendering.prefix_ids == pack_prefix_ids(lm.tokenizer, facts)
    with pytest.raises(InvalidInput, match="chat template cannot"):
        render(lm.tokenizer, facts, rows[1]["question"], history=(("system", "Be brief."),))
    with LmdbStore(tmp_path / "store") as store:
        store.put(encode_pack(build_pack(lm, facts)), name="ckc")
        result = Answerer(lm, store).ask(Question(rows[1]["question"], refs=("ckc",), history=history, sampling=GREEDY, compare_rag=True))
    assert result.identical is True and result.chunked_identical is True
