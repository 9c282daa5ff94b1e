"""``packstore serve --objects``: replicas (real subprocesses) serving one SeaweedFS bucket.

A pack put through one replica is listed and streamed by another, and so is a bank built through
one (routed, listed, signed, deleted); a replica killed mid-upload leaves no visible pack; damage
is DATA_LOSS through the service; a missing bucket, wrong credentials and an unreachable endpoint
are clear errors at start, a store gone while serving is UNAVAILABLE per call.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import grpc
import pytest
import torch

from packstore.answering.api import sign_bank
from packstore.bank.bank import open_banks
from packstore.errors import IntegrityError, InvalidInput, PackNotFound, Unavailable
from packstore.packs.migrate import migrate
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.rpc.channel import Connection
from packstore.rpc.wire import chunk_pieces
from packstore.security.trust import SigningKey, generate_key
from packstore.store import LmdbStore
from packstore.store.objects.cache import ObjectCache
from packstore.store.remote.store import RemoteStore
from packstore.store.spec import DEFAULT_OBJECT_CACHE_BYTES
from packstore.v1 import store_pb2, store_pb2_grpc
from tests.helpers.auth import TOKENS, refusal, tokens_file
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.packs import FP_B
from tests.helpers.s3 import FACTS, objects, random_pack, same_tensors
from tools.lib.seaweed import Seaweed, running_seaweed
from tools.lib.servers import RunningServer, free_port, running_server


@contextmanager
def replica(server: Seaweed, url: str, data: Path, *extra: str) -> Iterator[tuple[RunningServer, RemoteStore]]:
    """``packstore serve --objects URL`` with its caches in ``data``, and a client of it."""
    with running_server(data, "--objects", url, *extra, env=server.env()) as running, RemoteStore(running.url) as client:
        yield running, client


def test_two_replicas_serve_each_others_packs(seaweed, url, tmp_path, model_fp) -> None:
    pack = random_pack(model_fp, 1)
    with replica(seaweed, url, tmp_path / "a") as (_, a), replica(seaweed, url, tmp_path / "b") as (_, b):
        key, created = a.put(encode_pack(pack), name="shared")
        assert created and b.put(encode_pack(pack)) == (key, False)
        assert [(p.key, p.names) for p in b.list(model_fp=model_fp)] == [(key, ("shared",))]
        assert same_tensors(PackReader(b).fetch("shared", model_fp=model_fp, template_fp=FP_B), pack)  # GetPack, streamed chunk by chunk
        assert b.stat(key).stored_bytes == encode_pack(pack).stored_bytes and PackReader(b).verify(key).ok
        assert b.counts().packs == 1
        b.delete(key)
        with pytest.raises(PackNotFound):
            PackReader(a).fetch(key)  # a streamed it from its cache before; the commit object is gone, so it is gone for a too
    assert sorted(p.name for p in (tmp_path / "a").rglob("data.mdb")) == ["data.mdb"]  # the data directory holds only the cache
    assert (tmp_path / "a" / "object-cache" / "default" / "data.mdb").exists()


def test_a_bank_built_through_one_replica_is_served_alike_by_another(seaweed, url, tmp_path) -> None:
    queries = ["Which umbrella is in locker 13?", "guest 207", "amber umbrella"]

    def answers(client: RemoteStore) -> tuple:
        banks = open_banks(client, TEST_BANK_CACHE)
        routes = [[r.to_json() for r in banks.route("lockers", queries, top_k=3, mode=mode)] for mode in ("hybrid", "dense", "lexical")]
        return routes, banks.list(), banks.digest("lockers"), banks.signatures("lockers")

    with replica(seaweed, url, tmp_path / "a") as (_, a), replica(seaweed, url, tmp_path / "b") as (_, b):
        assert open_banks(a, TEST_BANK_CACHE).build("lockers", FACTS).facts == len(FACTS)
        assert open_banks(b, TEST_BANK_CACHE).route("lockers", queries[:1], top_k=1)[0].facts[0][0] == FACTS[13]
        sign_bank(a, "lockers", SigningKey.load(generate_key(tmp_path / "key")[0]))
        before = answers(b)
        assert before == answers(a) and len(before[3]) == 1
        open_banks(b, TEST_BANK_CACHE).add("lockers", ["Locker 900 holds a spare key."])
        assert open_banks(a, TEST_BANK_CACHE).route("lockers", ["spare key"], top_k=1, mode="lexical")[0].facts[0][0] == "Locker 900 holds a spare key."
        after = answers(a)
        assert after == answers(b) and after[2] != before[2] and after[1][0][0].facts == len(FACTS) + 1
        with LmdbStore(tmp_path / "copy") as target:  # a service gives no bank records: migrate names the bank it could not copy
            assert migrate(b, target).banks_skipped == ("lockers",) and target.bank_metas() == []
        open_banks(a, TEST_BANK_CACHE).delete("lockers")
        assert open_banks(b, TEST_BANK_CACHE).list() == []
        with pytest.raises(PackNotFound, match="no bank named 'lockers'"):
            open_banks(b, TEST_BANK_CACHE).route("lockers", queries[:1])


def test_getpack_of_a_prefix_sends_only_its_token_blocks(seaweed, url, tmp_path, model_fp) -> None:
    pack = random_pack(model_fp, 5, layers=2, tokens=1500)  # two token blocks per layer
    with replica(seaweed, url, tmp_path / "a") as (_, a), replica(seaweed, url, tmp_path / "b") as (b_server, b):
        key, _ = a.put(encode_pack(pack))
        with grpc.insecure_channel(b_server.address) as channel:
            request = store_pb2.GetPackRequest(ref=key, prefix=1024)
            sent = [r.chunk.index for r in store_pb2_grpc.PackStoreStub(channel).GetPack(request) if r.WhichOneof("item") == "chunk"]
        assert sorted(set(sent)) == [0, 2]  # the first block of each layer
        part = PackReader(b).fetch_part(key, layers=(1, 1), prefix=1025)
        assert torch.equal(part.keys[0], pack.keys[1][:, :1025]) and torch.equal(part.values[0], pack.values[1][:, :1025])
        with pytest.raises(InvalidInput, match="a prefix of 1501 positions is not within its 1-1500"):
            PackReader(b).fetch_part(key, prefix=1501)


def test_getpack_of_a_layer_range_reads_only_its_chunk_objects(seaweed, url, tmp_path, model_fp) -> None:
    pack = random_pack(model_fp, 4, layers=10)
    encoded = encode_pack(pack)
    with replica(seaweed, url, tmp_path / "a") as (_, a), replica(seaweed, url, tmp_path / "b") as (b_server, b):
        key, _ = a.put(encoded)
        with grpc.insecure_channel(b_server.address) as channel:
            request = store_pb2.GetPackRequest(ref=key, layers=store_pb2.LayerRange(first=2, last=3))
            sent = [r.chunk.index for r in store_pb2_grpc.PackStoreStub(channel).GetPack(request) if r.WhichOneof("item") == "chunk"]
        assert sorted(set(sent)) == [2, 3]
        part = PackReader(b).fetch_part(key, layers=(2, 3), model_fp=model_fp, template_fp=FP_B)
        assert all(torch.equal(x, y) for x, y in zip(pack.keys[2:4] + pack.values[2:4], part.keys + part.values))
        with pytest.raises(InvalidInput, match="not within its layers 0-9"):
            PackReader(b).fetch_part(key, layers=(9, 10))
    with closing(ObjectCache(tmp_path / "b" / "object-cache" / "default", DEFAULT_OBJECT_CACHE_BYTES)) as cache:
        cached = {name.rsplit("/", 1)[1] for name in cache.names() if "/chunks/" in name}
    assert cached == {c.address for c in encoded.header.chunks[2:4]}  # b got only these chunk objects from the bucket


def test_a_replica_killed_mid_upload_leaves_no_visible_pack(seaweed, url, tmp_path, model_fp) -> None:
    encoded = encode_pack(random_pack(model_fp, 2, layers=12))
    halfway, never = threading.Event(), threading.Event()

    def requests() -> Iterator[store_pb2.PutPackRequest]:
        yield store_pb2.PutPackRequest(begin=store_pb2.PutPackBegin(header_json=encoded.header.to_json(), name="half"))
        for index, (chunk, info) in enumerate(zip(encoded.chunks, encoded.header.chunks)):
            if index == 4:
                halfway.set()
                never.wait(60)
            for piece in chunk_pieces(index, chunk, info.digest):
                yield store_pb2.PutPackRequest(chunk=piece)

    with replica(seaweed, url, tmp_path / "a") as (a, _), replica(seaweed, url, tmp_path / "b") as (_, b):
        with grpc.insecure_channel(a.address) as channel:
            upload = store_pb2_grpc.PackStoreStub(channel).PutPack.future(requests())
            assert halfway.wait(60)
            deadline = time.monotonic() + 60
            while len(objects(seaweed, url, "chunks/")) < 4:  # the replica uploads each chunk as it arrives
                assert time.monotonic() < deadline, "the replica did not upload the chunks it received"
                time.sleep(0.05)
            a.process.kill()
            a.process.wait()
            never.set()
            assert isinstance(upload.exception(timeout=60), grpc.RpcError)
        assert len(objects(seaweed, url, "chunks/")) == 4 and objects(seaweed, url, "headers/") == {}
        assert b.list() == [] and b.counts().packs == 0
        for ref in (encoded.header.key, "half"):
            with pytest.raises(PackNotFound):
                PackReader(b).fetch(ref, model_fp=model_fp)


def test_a_damaged_object_is_data_loss_through_the_service(seaweed, url, tmp_path, model_fp) -> None:
    encoded = encode_pack(random_pack(model_fp, 3))
    with replica(seaweed, url, tmp_path / "a") as (_, a), replica(seaweed, url, tmp_path / "b") as (b_server, b):
        key, _ = a.put(encoded)
        digest = encoded.header.chunks[1].address
        name = url.split("/", 3)[3] + f"/ns/default/chunks/{digest}"
        seaweed.client().put_object(Bucket=seaweed.bucket, Key=name, Body=b"\0" * len(encoded.chunks[1]))
        with pytest.raises(IntegrityError, match="chunk 1 .* is damaged"):
            PackReader(b).fetch(key)
        with grpc.insecure_channel(b_server.address) as channel:
            stream = store_pb2_grpc.PackStoreStub(channel).GetPack(store_pb2.GetPackRequest(ref=key))
            with pytest.raises(grpc.RpcError) as error:
                list(stream)
        assert error.value.code() == grpc.StatusCode.DATA_LOSS and "is damaged" in error.value.details()
        assert [r.ok for r in PackReader(b).verify_all()] == [False]


def test_a_read_creates_no_namespace_in_the_bucket_or_the_cache(seaweed, url, tmp_path, model_fp) -> None:
    """A namespace exists on the object tier once its tree of the bucket holds an object: a read of one that holds
    none creates nothing (no cache, no object) and answers as an empty namespace; a write through any replica creates it."""
    tokens = str(tokens_file(tmp_path / "tokens.toml"))

    def as_operator(namespace: str) -> Connection:
        return Connection(token=TOKENS["operator"][0], namespace=namespace)

    ghost_objects = {"Bucket": seaweed.bucket, "Prefix": url.split("/", 3)[3] + "/ns/ghost/"}
    with replica(seaweed, url, tmp_path / "a", "--auth", tokens) as (a, _), replica(seaweed, url, tmp_path / "b", "--auth", tokens) as (b, _):
        with RemoteStore(a.url, connection=as_operator("ghost")) as ghost, RemoteStore(a.url, connection=as_operator("default")) as default:
            assert (ghost.list(), ghost.counts().packs, PackReader(ghost).verify_all(), open_banks(ghost, TEST_BANK_CACHE).list()) == ([], 0, [], [])
            for read in (lambda store: store.stat("nothing"), lambda store: PackReader(store).fetch("nothing"), lambda store: open_banks(store, TEST_BANK_CACHE).route("nothing", ["?"])):
                assert refusal(lambda read=read: read(ghost)) == refusal(lambda read=read: read(default))  # as a namespace that exists answers
        assert not (tmp_path / "a" / "object-cache" / "ghost").exists() and seaweed.client().list_objects_v2(**ghost_objects)["KeyCount"] == 0
        with RemoteStore(b.url, connection=as_operator("ghost")) as writer:
            key, _ = writer.put(encode_pack(random_pack(model_fp, 6)))
        with RemoteStore(a.url, connection=as_operator("ghost")) as ghost:
            assert [p.key for p in ghost.list()] == [key]  # b's write made the namespace: a finds it in the bucket
        assert (tmp_path / "a" / "object-cache" / "ghost").is_dir()


def _serve_fails(url: str, data: Path, env: dict[str, str], *extra: str) -> str:
    """Start ``packstore serve --objects URL``, expect it to exit non-zero at once; returns its stderr."""
    packstore = Path(sys.executable).parent / "packstore"
    command = [str(packstore), "serve", "--data", str(data), "--objects", url, "--listen", f"127.0.0.1:{free_port()}", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=os.environ | env)
    assert done.returncode == 1, done
    return done.stderr


def test_store_problems_are_named_at_start(seaweed, url, tmp_path) -> None:
    env = seaweed.env()
    missing = _serve_fails("s3://no-such-bucket/packs", tmp_path / "d1", env)
    assert "bucket 'no-such-bucket' at http://127.0.0.1" in missing and "does not exist" in missing
    denied = _serve_fails(url, tmp_path / "d2", env | {"AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    assert "refused access to bucket 'packs'" in denied and "403" in denied
    unreachable = _serve_fails(url, tmp_path / "d3", env, "--s3-endpoint", f"http://127.0.0.1:{free_port()}")
    assert "object store is unreachable" in unreachable


def test_a_store_gone_while_serving_is_unavailable_per_call(tmp_path, model_fp) -> None:
    with running_seaweed(tmp_path / "own-seaweed") as own:
        with replica(own, f"s3://{own.bucket}/gone", tmp_path / "a") as (_, a):
            key, _ = a.put(encode_pack(random_pack(model_fp, 4)))
            own.process.terminate()
            own.process.wait(30)
            with pytest.raises(Unavailable, match="object store is unreachable") as error:
                a.list()
            assert error.value.grpc_status == "UNAVAILABLE"
            with pytest.raises(Unavailable):
                PackReader(a).fetch(key)  # the header is checked at the object store, cache or not
