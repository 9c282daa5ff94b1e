"""Tokens, roles and namespaces on the pack service and the worker: tenants never see each other."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from packstore.answering.answer import Question
from packstore.bank.bank import open_banks
from packstore.errors import InvalidInput, PackNotFound, PermissionDenied, Unauthenticated
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.rpc.channel import Connection
from packstore.security.auth import Auth, load_tokens
from packstore.store.namespaces import namespace_path
from packstore.store.records import Caller
from packstore.store.remote.store import RemoteStore
from packstore.worker.client import WorkerClient
from tests.helpers.auth import TOKENS, refusal, tokens_file
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.packs import make_pack
from tools.lib.servers import free_port, running_server, running_worker


def client(server, name: str | None, namespace: str | None = None) -> RemoteStore:
    token = TOKENS[name][0] if name else None
    return RemoteStore(server.url, connection=Connection(token=token, namespace=namespace), timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    with running_server(root / "data", "--auth", str(tokens_file(root / "tokens.toml"))) as running:
        running.tokens = root / "tokens.toml"
        yield running


def test_tokens_files_are_checked_entry_by_entry(tmp_path) -> None:
    assert {t.name for t in load_tokens(tokens_file(tmp_path / "t.toml")).values()} == set(TOKENS)
    for text, problem in (
        ('[[token]]\nname = "x"\nsha256 = "abc"\nnamespaces = ["a"]\nrole = "read"\n', "sha256 must be 64"),
        ('[[token]]\nname = "x"\nsha256 = "' + "a" * 64 + '"\nnamespaces = ["a/b"]\nrole = "read"\n', "not a valid name"),
        ('[[token]]\nname = "x"\nsha256 = "' + "a" * 64 + '"\nnamespaces = ["a"]\nrole = "root"\n', "role must be one of"),
        ('[[token]]\nname = "x"\ntoken = "plain"\n', "exactly name, sha256"),
        ("[server]\n", "unknown table"),
    ):
        (tmp_path / "bad.toml").write_text(text)
        with pytest.raises(InvalidInput, match=problem):
            load_tokens(tmp_path / "bad.toml")
    assert Auth().authenticate([], "GetPack", "admin").namespace == "default"  # no tokens file: one open namespace


def test_no_token_or_an_unknown_one_is_unauthenticated_but_health_answers(server) -> None:
    for _name, token in ((None, None), ("stranger", "not-a-token")):
        with RemoteStore(server.url, connection=Connection(token=token), timeout=10) as store, pytest.raises(Unauthenticated):
            store.list()
    with grpc.insecure_channel(server.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_namespaces_partition_keys_names_and_banks(server) -> None:
    pack = make_pack(tokens=11)
    with client(server, "a-writer") as a, client(server, "b-writer") as b, client(server, "a-reader") as reader:
        key, created_a = a.put(encode_pack(pack), name="shared")
        time.sleep(1.1)
        _, created_b = b.put(encode_pack(pack), name="shared")
        assert created_a and created_b  # the same content is two packs, one per tenant
        assert a.stat(key).header == b.stat(key).header and [p.key for p in reader.list()] == [key]
        b.delete(key)
        assert a.stat(key).key == key  # b deleting its copy leaves a's
        with pytest.raises(PackNotFound) as theirs:
            b.stat(key)
        with pytest.raises(PackNotFound) as missing:
            b.stat(key[:-8] + "00000000")
        assert str(theirs.value).replace(key, "K") == str(missing.value).replace(key[:-8] + "00000000", "K")  # alike
        open_banks(a, TEST_BANK_CACHE).build("kb", ["The lighthouse Zorel was founded in 1801.", "The bakery Mirtel opened in 1922."])
        assert [meta.name for meta, _ in open_banks(reader, TEST_BANK_CACHE).list()] == ["kb"] and open_banks(b, TEST_BANK_CACHE).list() == []
        with pytest.raises(PackNotFound):
            open_banks(b, TEST_BANK_CACHE).route("kb", ["Who founded Zorel?"])


def test_roles_bound_what_a_token_may_do(server) -> None:
    with client(server, "a-reader") as reader, pytest.raises(PermissionDenied, match="needs a write token"):
        reader.put(encode_pack(make_pack(tokens=12)))
    with client(server, "a-writer") as writer:
        writer.put(encode_pack(make_pack(tokens=13)), name="mine")
        with pytest.raises(PermissionDenied, match="needs an admin token"):
            writer.gc()
    with client(server, "operator", namespace="a") as operator:
        assert operator.gc().orphan_chunks >= 0 and operator.stat("mine", model_fp="a" * 64).names == ("mine",)


def test_whoami_says_whose_token_a_call_carries_its_role_and_namespace(server) -> None:
    """A client checks its role before it offers to write (the vLLM connector's saves): WhoAmI needs only a read token."""
    with client(server, "a-reader") as reader, client(server, "a-writer") as writer:
        assert reader.caller() == Caller("a-reader", "read", "a") and not reader.caller().may_write
        assert writer.caller() == Caller("a-writer", "write", "a") and writer.caller().may_write
    with client(server, "operator", namespace="a") as operator:
        assert operator.caller().role == "admin" and operator.caller().may_write
    with client(server, None) as anonymous, pytest.raises(Unauthenticated):
        anonymous.caller()


def test_a_token_with_several_namespaces_names_one_and_only_its_own(server) -> None:
    with client(server, "ab-reader") as unnamed, pytest.raises(InvalidInput, match="several namespaces"):
        unnamed.list()
    with client(server, "ab-reader", namespace="b") as b:
        b.list()
    with client(server, "ab-reader", namespace="c") as c, pytest.raises(PermissionDenied, match="may not use namespace 'c'"):
        c.list()
    with client(server, "a-writer", namespace="b") as elsewhere, pytest.raises(PermissionDenied):
        elsewhere.list()


def scrape(server, secret: str | None) -> str:
    """The metrics port's text for a bearer token (None: no Authorization header); HTTPError when refused."""
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    request = urllib.request.Request(f"http://{server.metrics}/metrics", headers=headers)
    return urllib.request.urlopen(request, timeout=10).read().decode()


def samples(text: str) -> list[Sample]:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def test_metrics_need_a_token_and_show_a_tenant_only_its_namespaces(server) -> None:
    for secret in (None, "not-a-token"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            scrape(server, secret)
        assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"].startswith("Bearer")
    with client(server, "a-writer") as a:
        a.put(encode_pack(make_pack(tokens=21)), name="metered")
    before = scrape(server, TOKENS["a-reader"][0])
    with client(server, "b-writer") as b:
        key, _ = b.put(encode_pack(make_pack(tokens=22)))
        PackReader(b).fetch(key)
        with pytest.raises(PackNotFound):
            b.stat("metered")
    assert scrape(server, TOKENS["a-reader"][0]) == before  # b's activity shows nowhere in what a's token reads
    mine = samples(before)
    assert {s.labels.get("namespace") for s in mine} == {"a"}  # no series of b, none of the whole service
    assert {"packstore_requests_total", "packstore_received_bytes_total", "packstore_store_packs", "packstore_hot_packs"} <= {s.name for s in mine}
    assert {s.labels.get("namespace") for s in samples(scrape(server, TOKENS["ab-reader"][0]))} == {"a", "b"}
    everything = samples(scrape(server, TOKENS["operator"][0]))  # "*": every namespace and the whole service's series
    assert {"a", "b", ""} <= {s.labels.get("namespace", "") for s in everything}
    assert any(s.name == "packstore_store_file_bytes" for s in everything)


def test_a_read_creates_no_namespace_and_answers_as_an_empty_one(server) -> None:
    ghost = namespace_path(server.data, "ghost")
    with client(server, "operator", namespace="ghost") as reader, client(server, "a-reader") as a:
        assert (reader.list(), reader.keys(), reader.counts().packs, PackReader(reader).verify_all(), open_banks(reader, TEST_BANK_CACHE).list()) == ([], [], 0, [], [])
        for read in (
            lambda store: store.stat("nothing"), lambda store: PackReader(store).fetch("nothing"), lambda store: PackReader(store).verify("nothing"),
            lambda store: open_banks(store, TEST_BANK_CACHE).route("kb-nothing", ["who?"]), lambda store: open_banks(store, TEST_BANK_CACHE).digest("kb-nothing"),
        ):
            absent, missing = refusal(lambda read=read: read(reader)), refusal(lambda read=read: read(a))  # a: a namespace that exists
            assert absent == missing and "nothing" in absent
    assert not ghost.exists()
    operator_view = samples(scrape(server, TOKENS["operator"][0]))
    assert not any(s.labels.get("namespace") == "ghost" for s in operator_view if s.name.startswith("packstore_store_"))
    with client(server, "operator", namespace="ghost") as writer:
        key, _ = writer.put(encode_pack(make_pack(tokens=23)))
        assert (ghost / "data.mdb").exists() and [p.key for p in writer.list()] == [key]  # a write creates it


def test_tokens_never_reach_the_log_and_sighup_reloads_them(server, tmp_path) -> None:
    log = (server.data.parent / f"{server.data.name}-server.log").read_text()
    assert "a-writer" in log and not any(secret in log for secret, _, _ in TOKENS.values())
    assert "tokens from" in log
    new = dict(TOKENS) | {"c-writer": ("secret-c-writer", ["c"], "write")}
    tokens_file(server.tokens, new)
    server.process.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    with RemoteStore(server.url, connection=Connection(token="secret-c-writer"), timeout=10) as c:
        assert c.list() == []
    tokens_file(server.tokens)  # back to the first file
    server.process.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    with RemoteStore(server.url, connection=Connection(token="secret-c-writer"), timeout=10) as c, pytest.raises(Unauthenticated):
        c.list()


def test_without_auth_the_start_log_says_so(tmp_path) -> None:
    with running_server(tmp_path / "data") as open_server:
        with RemoteStore(open_server.url) as store:
            store.list()
    log = (tmp_path / "data-server.log").read_text()
    assert "no tokens, every caller is admin in the one namespace 'default'" in log


def test_the_worker_reads_each_callers_namespace_with_its_own_token(server, tiny_lm, tiny_model_dir, tmp_path) -> None:
    """...and its Status tells each caller of its own namespace's ready packs only (``default`` included)."""
    facts = {"a-writer": "Alice lives in Paris.", "b-writer": "Bob lives in Oslo, Norway."}
    packs = {name: encode_pack(build_pack(tiny_lm, [fact])) for name, fact in facts.items()}
    with client(server, "a-writer") as a, client(server, "b-writer") as b:
        a.put(packs["a-writer"], name="facts")
        b.put(packs["b-writer"], name="facts")
    (tmp_path / "worker.token").write_text(TOKENS["operator"][0])  # the worker's own token reads every namespace
    extra = ("--threads", "1", "--token-file", str(tmp_path / "worker.token"), "--auth", str(server.tokens), "--ref-ttl", "0.5")
    with running_worker(server.url, str(tiny_model_dir), tmp_path, *extra) as worker:
        question = Question("Who lives where?", refs=("facts",), sampling=Sampling(max_new_tokens=4))
        with WorkerClient(worker.address, connection=Connection()) as anonymous, pytest.raises(Unauthenticated):
            anonymous.ask(question)
        answers = {}
        for name in ("a-writer", "b-writer"):
            with WorkerClient(worker.address, connection=Connection(token=TOKENS[name][0])) as caller:
                first, again = caller.ask(question), caller.ask(question)
                answers[name] = first.pack
                assert (first.cache_hit, again.cache_hit) == (False, True)  # a's ready pack is never a hit for b
        assert answers["a-writer"] != answers["b-writer"]
        for name, namespace in (("a-writer", None), ("b-writer", None), ("operator", "default")):
            with WorkerClient(worker.address, connection=Connection(token=TOKENS[name][0], namespace=namespace)) as caller:
                status = caller.status()
            mine = (1, packs[name].header.raw_bytes) if name in packs else (0, 0)
            assert (status["cached_packs"], int(status["cached_bytes"])) == mine and int(status["cache_limit_bytes"]) == 2 << 30
        with client(server, "a-writer") as a:
            a.delete("facts", model_fp=tiny_lm.model_fp)
        time.sleep(0.6)
        with WorkerClient(worker.address, connection=Connection(token=TOKENS["a-writer"][0])) as caller, pytest.raises(PackNotFound):
            caller.ask(question)  # a deletion is honoured once the ref ttl has passed


def tier_reads(text: str) -> dict[tuple[str, str], float]:
    """The worker's ``packstore_worker_pack_reads_total`` by (namespace, tier)."""
    return {(s.labels["namespace"], s.labels["tier"]): s.value for s in samples(text) if s.name == "packstore_worker_pack_reads_total"}


def test_the_worker_serves_evicted_packs_from_its_host_tier_and_meters_each_namespace_apart(server, tiny_lm, tiny_model_dir, tmp_path) -> None:
    """A device LRU of one pack and a host cache: a pack the device LRU evicted comes back from the host cache, not the
    store; each namespace's tiers never meet, and the metrics port shows a tenant its own series only."""
    facts = {"tier-x": "Xavier lives in Quito.", "tier-y": "Yolanda lives in Nairobi, Kenya."}
    packs = {name: encode_pack(build_pack(tiny_lm, [fact])) for name, fact in facts.items()}
    with client(server, "a-writer") as a, client(server, "b-writer") as b:
        for name, pack in packs.items():
            a.put(pack, name=name)
        b.put(packs["tier-x"], name="tier-x")
    (tmp_path / "worker.token").write_text(TOKENS["operator"][0])
    device_bytes, host_bytes = max(p.header.raw_bytes for p in packs.values()), 64 << 20
    port = free_port()
    extra = (
        "--threads", "1", "--token-file", str(tmp_path / "worker.token"), "--auth", str(server.tokens), "--cache-bytes", str(device_bytes),
        "--host-cache-bytes", str(host_bytes), "--metrics", f":{port}",
    )
    with running_worker(server.url, str(tiny_model_dir), tmp_path, *extra) as worker:
        worker.metrics = f"127.0.0.1:{port}"  # ":PORT" listens on loopback
        with WorkerClient(worker.address, connection=Connection(token=TOKENS["a-reader"][0])) as a_reader:
            hits = [a_reader.ask(Question("Who?", refs=(name,), sampling=Sampling(max_new_tokens=2))).cache_hit
                    for name in ("tier-x", "tier-y", "tier-x", "tier-x")]
            status = a_reader.status()
        assert hits == [False, False, False, True]  # tier-y evicted tier-x from the device; it came back from the host cache
        assert tier_reads(scrape(worker, TOKENS["a-reader"][0])) == {("a", "store"): 2, ("a", "host"): 1, ("a", "device"): 1}
        assert (status["host_cached_packs"], int(status["host_cached_bytes"])) == (2, sum(p.header.raw_bytes for p in packs.values()))
        assert int(status["host_cache_limit_bytes"]) == host_bytes and (status["cached_packs"], int(status["cache_limit_bytes"])) == (1, device_bytes)
        before = scrape(worker, TOKENS["a-reader"][0])
        with WorkerClient(worker.address, connection=Connection(token=TOKENS["b-writer"][0])) as b_writer:
            assert b_writer.ask(Question("Who?", refs=("tier-x",), sampling=Sampling(max_new_tokens=2))).cache_hit is False
            assert b_writer.status()["host_cached_packs"] == 1  # a's packs are nothing of b's
        shared = ("packstore_worker_tier_packs", "packstore_worker_tier_bytes", "packstore_worker_tier_evictions_total")

        def own(text: str) -> list[Sample]:
            """All but what the shared byte budget may change: b's pack may evict a's from the device LRU."""
            return [sample for sample in samples(text) if sample.name not in shared]

        assert own(scrape(worker, TOKENS["a-reader"][0])) == own(before)  # b's reads show nowhere in what a's token reads
        assert {s.labels.get("namespace") for s in samples(before)} == {"a"}
        assert tier_reads(scrape(worker, TOKENS["b-writer"][0])) == {("b", "store"): 1, ("b", "host"): 0, ("b", "device"): 0}  # a's packs: no hit for b
        everything = samples(scrape(worker, TOKENS["operator"][0]))
        limits = {s.labels["tier"]: s.value for s in everything if s.name == "packstore_worker_tier_limit_bytes"}
        assert limits == {"device": device_bytes, "host": host_bytes}
        assert any(s.name == "packstore_worker_requests_total" and s.labels["namespace"] == "b" for s in everything)
        buffers = {(s.name, s.labels.get("kind")) for s in everything if s.name.startswith("packstore_worker_buffer_")}
        assert ("packstore_worker_buffer_pool_waits_total", None) in buffers  # the decoder's buffers: the operator's alone
        assert ("packstore_worker_buffer_fallbacks_total", "memory") in buffers
        for secret in (None, "not-a-token"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                scrape(worker, secret)
            assert refused.value.code == 401
