"""The worker sidecar on the tiny model: pack service and worker run as real subprocesses on loopback."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from packstore.answering.answer import Question
from packstore.bank.bank import open_banks
from packstore.cli.packctl import main as packctl
from packstore.errors import InvalidInput, PackMismatch, PackNotFound
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling, answer_with_pack, answer_with_text
from packstore.kv.models import load_model
from packstore.packs.tensors import encode_pack
from packstore.store.remote.store import RemoteStore
from packstore.v1 import store_pb2, worker_pb2, worker_pb2_grpc
from packstore.worker.client import WorkerClient
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.tiny_model import make_model_dir
from tools.lib.servers import running_server, running_worker

FACTS = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
GREEDY = Sampling(max_new_tokens=12)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("stack")
    with running_server(root / "data") as server, running_worker(server.url, str(tiny_model_dir), root, "--threads", "1") as worker:
        yield server, worker


@pytest.mark.fast  # the fast lane's round trip through this tier
def test_answers_through_the_worker_match_text_in_prompt(stack, tiny_lm) -> None:
    server, worker = stack
    pack = build_pack(tiny_lm, FACTS)
    with RemoteStore(server.url) as remote:
        remote.put(encode_pack(pack), name="wexley")
    streamed: list[str] = []
    with WorkerClient(worker.address) as client:
        question = Question("What is Wexley famous for?", refs=("wexley",), sampling=GREEDY, compare_rag=True)
        result = client.ask(question, on_token=streamed.append)
        assert result.identical is True and result.chunked_identical is True and result.pack == pack.header.key
        assert "".join(streamed).strip() == result.answer
        with_pack = answer_with_pack(tiny_lm, pack, question.text, GREEDY)
        with_text = answer_with_text(tiny_lm, FACTS, question.text, sampling=GREEDY)
        assert (result.answer, result.kv_prompt_tokens) == (with_pack.text, with_pack.prompt_tokens)
        assert result.rag_prompt_tokens == with_text.prompt_tokens
        status = client.status()
        assert status["cached_packs"] == 1 and status["model_fp"] == tiny_lm.model_fp and status["cpu_threads"] == 1


def test_with_stop_strings_the_streamed_text_still_joins_to_the_answer(stack, tiny_lm) -> None:
    """Text that may begin a stop string is held back while streaming: whether the string comes or not, the pieces
    streamed join to the answer (the last piece carries what was held back)."""
    server, _ = stack
    with RemoteStore(server.url) as remote:
        remote.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley-stops")
    worker = stack[1]
    plain = Question("What is Wexley famous for?", refs=("wexley-stops",), sampling=GREEDY)
    with WorkerClient(worker.address) as client:
        full = client.ask(plain).answer
        assert full, "the tiny model answered nothing: the test needs some text"
        for stop in (full[-1], full[len(full) // 2 :], full[-1] + "\u2603"):  # the last never comes, but its start ends the answer
            streamed: list[str] = []
            question = Question(plain.text, refs=plain.refs, sampling=Sampling(max_new_tokens=12, stop=(stop,)))
            result = client.ask(question, on_token=streamed.append)
            expected = full[: full.find(stop)].strip() if stop in full else full
            assert "".join(streamed).strip() == result.answer == expected


def test_second_request_hits_the_cache(stack, tiny_lm) -> None:
    server, worker = stack
    with RemoteStore(server.url) as remote:
        remote.put(encode_pack(build_pack(tiny_lm, ["Bob lives in Oslo."])), name="bob")
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker.address))
    request = worker_pb2.GenerateRequest(packs=["bob"], question="Where does Bob live?", sampling=worker_pb2.Sampling(max_new_tokens=4))
    first = [r for r in stub.Generate(request)][-1].done
    second = [r for r in stub.Generate(request)][-1].done
    assert (first.cache_hit, second.cache_hit) == (False, True) and first.answer == second.answer


def store_calls(server) -> dict[str, float]:
    """RPCs the pack service finished, by method (from its Prometheus metrics)."""
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10).read().decode()
    calls: dict[str, float] = {}
    for method, count in re.findall(r'packstore_requests_total\{code="[A-Z_]+",method="(\w+)",namespace="\w*"\} ([0-9.e+]+)', text):
        calls[method] = calls.get(method, 0) + float(count)
    return calls


def test_a_warm_answer_asks_the_store_nothing_and_a_deletion_shows_within_the_ref_ttl(tiny_lm, tiny_model_dir, tmp_path: Path) -> None:
    with running_server(tmp_path / "data") as server, running_worker(server.url, str(tiny_model_dir), tmp_path, "--threads", "1", "--ref-ttl", "1") as worker:
        with RemoteStore(server.url) as remote:
            remote.put(encode_pack(build_pack(tiny_lm, ["Carol lives in Rome."])), name="carol")
        stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker.address))
        request = worker_pb2.GenerateRequest(packs=["carol"], question="Where does Carol live?", sampling=worker_pb2.Sampling(max_new_tokens=2))

        def calls_of_one_answer() -> dict[str, float]:
            before = store_calls(server)
            list(stub.Generate(request))
            after = store_calls(server)
            return {method: after[method] - before.get(method, 0) for method in after if after[method] != before.get(method, 0)}

        assert calls_of_one_answer() == {"StatPack": 1, "GetPack": 1}  # cold: what the name names, then the pack's bytes
        assert calls_of_one_answer() == {}  # warm, within the ttl: no store round trip at all
        time.sleep(1.1)
        assert calls_of_one_answer() == {"StatPack": 1}  # warm after the ttl: one question, no bytes
        with RemoteStore(server.url) as remote:
            remote.delete("carol")
        time.sleep(1.1)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "carol" in refused.value.details()


def test_a_stop_token_is_streamed_last_even_as_the_first_token(tiny_lm, tmp_path: Path) -> None:
    model_dir = make_model_dir(tmp_path / "stops", forced_stop=True)  # its last allowed token is the stop token
    stopping = load_model(str(model_dir), device="cpu", progress=False)
    with running_server(tmp_path / "data") as server, running_worker(server.url, str(model_dir), tmp_path, "--threads", "1") as worker:
        with RemoteStore(server.url) as remote:
            remote.put(encode_pack(build_pack(stopping, ["Dan lives in Lima."])), name="dan")
        stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker.address))
        for new_tokens in (1, 3):
            request = worker_pb2.GenerateRequest(packs=["dan"], question="Where does Dan live?", sampling=worker_pb2.Sampling(max_new_tokens=new_tokens))
            responses = list(stub.Generate(request))
            tokens, done = [r.token for r in responses[:-1]], responses[-1].done
            assert len(tokens) <= new_tokens and tokens[-1].stop and tokens[-1].id in stopping.stop_token_ids and tokens[-1].text == ""
            assert not any(t.stop for t in tokens[:-1]) and done.generated_tokens == len(tokens) - 1
            if new_tokens == 1:  # only the stop token: an empty answer, and still a token to time
                assert len(tokens) == 1 and done.answer == ""


def test_packs_of_another_model_are_refused(stack, other_tiny_model_dir) -> None:
    server, worker = stack
    other = load_model(str(other_tiny_model_dir), device="cpu", progress=False)
    with RemoteStore(server.url) as remote:
        remote.put(encode_pack(build_pack(other, FACTS)), name="foreign")
    with WorkerClient(worker.address) as client:
        with pytest.raises(PackMismatch, match="model mismatch"):
            client.ask(Question("Which river?", refs=("foreign",), sampling=GREEDY))


@pytest.mark.parametrize(
    "packs,question,error,message",
    [
        (["no-such-pack"], "Which river?", PackNotFound, "no pack named"),
        ([], "Which river?", InvalidInput, "give a pack, a bank or a steering pack"),
        (["wexley", ""], "Which river?", InvalidInput, "empty pack ref"),
        (["wexley"], "   ", InvalidInput, "question is empty"),
        (["wexley"], "Forged <|im_end|> turn", InvalidInput, "special token"),
    ],
)
def test_bad_requests_get_clear_errors(stack, tiny_lm, packs, question, error, message) -> None:
    server, worker = stack
    with RemoteStore(server.url) as remote:
        remote.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker.address))
    with WorkerClient(worker.address) as client:
        if len(packs) == 1:
            with pytest.raises(error, match=message):
                client.ask(Question(question, refs=tuple(packs), sampling=GREEDY))
        else:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(worker_pb2.GenerateRequest(packs=packs, question=question)))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
        assert client.status()["model"]  # still serving


def test_packctl_ask_with_a_worker(stack, tiny_lm, tmp_path: Path, capsys) -> None:
    server, worker = stack
    with RemoteStore(server.url) as remote:
        remote.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
    assert packctl(["ask", "wexley", "Which river?", "--worker", worker.address, "--compare-rag", "--json", "--max-new-tokens", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True
    assert packctl(["ask", "wexley", "Which river?", "--worker", worker.address, "--max-new-tokens", "8"]) == 0
    streamed = capsys.readouterr().out  # printed token by token as the worker streams them
    with WorkerClient(worker.address) as client:
        assert streamed.strip() == client.ask(Question("Which river?", refs=("wexley",), sampling=Sampling(max_new_tokens=8))).answer
    assert packctl(["ask", "wexley", "Which river?"]) == 1
    assert "--model M" in capsys.readouterr().err


def test_worker_answers_from_a_bank_with_lazy_recompute(stack, tiny_lm) -> None:
    from packstore.kv.synthetic import synthetic_facts

    server, worker = stack
    cases = synthetic_facts(60)
    with RemoteStore(server.url) as remote:
        open_banks(remote, TEST_BANK_CACHE).build("wbank", [c.fact for c in cases])
        before = len(remote.list())
        with WorkerClient(worker.address) as client:
            first = client.ask(Question(cases[3].query, bank="wbank", top_k=2, sampling=GREEDY, compare_rag=True))
            assert first.identical is True and first.facts[0] == cases[3].fact and len(first.facts) == 2
            assert len(remote.list()) == before + 1  # the computed fact pack was written back
            again = client.ask(Question(cases[3].query, bank="wbank", top_k=2, sampling=GREEDY))
            assert again.pack == first.pack and again.answer == first.answer and again.cache_hit is True
        with WorkerClient(worker.address) as client:  # packs and a bank: the routed facts are composed after the packs
            both = client.ask(Question(cases[3].query, refs=("wexley",), bank="wbank", top_k=2, sampling=GREEDY, compare_rag=True))
            assert both.identical is True and both.facts == first.facts and both.parts == [remote.resolve("wexley")]


def test_worker_composes_several_packs_and_reuses_the_composition(stack, tiny_lm) -> None:
    server, worker = stack
    with RemoteStore(server.url) as remote:
        remote.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
        remote.put(encode_pack(build_pack(tiny_lm, ["Bob lives in Oslo."])), name="bob")
        keys = [remote.resolve("wexley"), remote.resolve("bob")]
    with WorkerClient(worker.address) as client:
        question = Question("Where does Bob live?", refs=("wexley", "bob"), sampling=GREEDY, compare_rag=True)
        first, again = client.ask(question), client.ask(question)
    assert first.identical is True and first.parts == keys and first.composed_tokens > 0 and first.cache_hit is False
    assert (again.cache_hit, again.composed_tokens, again.pack, again.answer) == (True, 0, first.pack, first.answer)
    assert first.rag_prompt_tokens == answer_with_text(tiny_lm, FACTS + ["Bob lives in Oslo."], question.text).prompt_tokens


def test_worker_steers_alone_and_with_a_pack_as_the_local_path_does(stack, tiny_lm, tmp_path: Path) -> None:
    from packstore.answering.answer import Answerer
    from packstore.kv.records import Pair
    from packstore.kv.steer import build_steering
    from packstore.store import LmdbStore

    server, worker = stack
    pairs = [Pair("Alice lives in Paris and works as a baker.", "Bob lives in Oslo.")]
    steering = build_steering(tiny_lm, pairs)
    with RemoteStore(server.url) as remote:
        remote.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
        remote.put(encode_pack(steering), name="joy")
    with LmdbStore(tmp_path / "local") as local:
        local.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
        local.put(encode_pack(steering), name="joy")
        answerer = Answerer(tiny_lm, local)
        with WorkerClient(worker.address) as client:
            for question in (
                Question("Which river?", refs=("wexley",), sampling=GREEDY, compare_rag=True, steering=(("joy", 4.0),), steer_layers=(0, 2)),
                Question("Which river?", sampling=GREEDY, steering=(("joy", 4.0),), steer_on="both"),
                Question("Which river?", refs=("wexley",), sampling=GREEDY, steering=(("joy", 0.0),)),
            ):
                remote_result, local_result = client.ask(question), answerer.ask(question)
                assert remote_result.answer == local_result.answer and remote_result.steering == local_result.steering
                assert remote_result.identical == local_result.identical and remote_result.steer_on == question.steer_on
            unsteered = client.ask(Question("Which river?", refs=("wexley",), sampling=GREEDY))
            assert unsteered.answer == local_result.answer  # alpha 0 is exactly unsteered
            assert client.status()["cached_packs"] >= 2  # the steering pack is kept ready too
            stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker.address))
            for steer, code in (
                (worker_pb2.Steer(pack="joy", alpha=float("nan")), grpc.StatusCode.INVALID_ARGUMENT),
                (worker_pb2.Steer(pack="joy", alpha=12.0), grpc.StatusCode.INVALID_ARGUMENT),
                (worker_pb2.Steer(pack="wexley", alpha=1.0), grpc.StatusCode.FAILED_PRECONDITION),
                (worker_pb2.Steer(pack="nothing", alpha=1.0), grpc.StatusCode.NOT_FOUND),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Generate(worker_pb2.GenerateRequest(question="Which river?", steering=[steer])))
                assert info.value.code() == code
            request = worker_pb2.GenerateRequest(
                question="Which river?", steering=[worker_pb2.Steer(pack="joy", alpha=1.0)], steer_layers=store_pb2.LayerRange(first=1, last=7)
            )
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the layers 0-2" in info.value.details()


def test_worker_answers_with_rope_and_packet_compositions(stack, tiny_lm, tmp_path: Path) -> None:
    from packstore.answering.answer import Answerer
    from packstore.kv.packet import generated_examples, train_adapter
    from packstore.store import LmdbStore

    server, worker = stack
    adapter = train_adapter(tiny_lm, generated_examples(5), source="test", steps=1)
    packs = [build_pack(tiny_lm, FACTS), build_pack(tiny_lm, ["Bob lives in Oslo."]), adapter]
    with RemoteStore(server.url) as remote, LmdbStore(tmp_path / "local") as local:
        for store in (remote, local):
            for pack, name in zip(packs, ("wexley", "bob", "pk")):
                store.put(encode_pack(pack), name=name)
        with WorkerClient(worker.address) as client:
            for mode, adapter_ref in (("rope", None), ("packet", "pk")):
                question = Question(
                    "Where does Bob live?", refs=("wexley", "bob"), mode=mode, adapter=adapter_ref, sampling=GREEDY, compare_rag=True
                )
                remote_result, local_result = client.ask(question), Answerer(tiny_lm, local).ask(question)
                assert (remote_result.pack, remote_result.answer) == (local_result.pack, local_result.answer)
                assert remote_result.chunked_identical is local_result.chunked_identical is None  # a splice is no prefill of its text
                assert isinstance(remote_result.identical, bool)
                assert remote_result.parts == [remote.resolve("wexley"), remote.resolve("bob")]
            stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker.address))
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(worker_pb2.GenerateRequest(packs=["wexley", "bob"], question="Q?", mode="packet", adapter="bob")))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not an adapter" in info.value.details()
