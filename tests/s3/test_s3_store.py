"""The object-store tier against a real S3 server (SeaweedFS ``weed mini`` on loopback), never a mock.

Replicas share one bucket; writers die mid-upload; objects and cache entries are damaged; gc runs
with a short grace; credentials, endpoints and buckets are wrong. Each test works under its own
prefix of the bucket, so the module-wide server needs no reset.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from packstore.errors import IntegrityError, PackNotFound, PermissionDenied, StoreBusy, StoreNotFound, Unavailable
from packstore.format.body import EncodedPack
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.security.trust import SigningKey, generate_key
from packstore.store.objects.store import ObjectStore
from tests.helpers import child_env
from tests.helpers.packs import FP_B, pack_of
from tests.helpers.s3 import objects, random_pack, same_tensors
from tools.lib.servers import free_port


def counted_gets(store: ObjectStore) -> list[str]:
    """The object names ``store`` GETs from now on (a boto3 event hook on its client), growing as it reads."""
    names: list[str] = []
    store.bucket._client.meta.events.register("before-parameter-build.s3.GetObject", lambda params, **_: names.append(params["Key"].rsplit("/ns/default/", 1)[1]))
    return names


@pytest.mark.fast  # the fast lane's round trip through this tier
def test_a_pack_put_through_one_replica_is_listed_and_served_by_the_other(replicas, seaweed, url, model_fp) -> None:
    a, b = replicas
    first, second = pack_of(model_fp, 10), pack_of(model_fp, 20)  # the same tensors: their chunks are identical
    key, created = a.put(encode_pack(first), name="shared")
    assert created and b.put(encode_pack(first)) == (key, False)
    b.put(encode_pack(second))
    assert [p.key for p in b.list(model_fp=model_fp)] == sorted([key, second.header.key])
    assert b.stat("shared", model_fp=model_fp).key == key and b.list(name="shared")[0].names == ("shared",)
    assert same_tensors(PackReader(b).fetch("shared", model_fp=model_fp, template_fp=FP_B), first)
    chunks = objects(seaweed, url, "chunks/")
    assert len(chunks) == len({c.address for c in encode_pack(second).header.chunks}) == 3  # stored once across both packs
    assert b.counts().packs == 2 and a.counts() == b.counts()
    a.delete(key)
    with pytest.raises(PackNotFound):
        PackReader(b).get(key)  # b had it cached; the commit object is gone, so it is gone for b too
    assert [p.key for p in b.list()] == [second.header.key]


def test_concurrent_name_writes_from_two_replicas_lose_no_update(replicas, seaweed, url, model_fp) -> None:
    a, b = replicas
    keys = [a.put(encode_pack(pack_of(model_fp, 10 + 10 * i)))[0] for i in range(4)]
    writers, start = 8, threading.Barrier(8)
    failures: list[BaseException] = []

    def point(i: int) -> None:
        start.wait()
        try:
            (a, b)[i % 2].set_name(keys[i % 4], "contended")
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            failures.append(exc)

    threads = [threading.Thread(target=point, args=(i,)) for i in range(writers)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert failures == []
    versions = sorted(objects(seaweed, url, f"names/{model_fp}/contended/"))
    assert len(versions) == writers  # every write has its own version: none overwrote another
    newest = seaweed.client().get_object(Bucket=seaweed.bucket, Key=url.split("/", 3)[3] + "/ns/default/" + versions[-1])
    assert f'"value":"{a.resolve("contended", model_fp=model_fp)}"' in newest["Body"].read().decode()
    assert b.resolve("contended", model_fp=model_fp) == a.resolve("contended", model_fp=model_fp)
    for trial in range(3):  # two replicas remove one name at once: exactly one of them removed it
        a.set_name(keys[trial], "once")
        outcomes: list[object] = []
        removing = threading.Barrier(2)

        def remove(store: ObjectStore, removing: threading.Barrier = removing, outcomes: list[object] = outcomes) -> None:
            removing.wait()
            try:
                outcomes.append(store.delete_name("once", model_fp=model_fp))
            except PackNotFound as exc:
                outcomes.append(exc)

        pair = [threading.Thread(target=remove, args=(store,)) for store in (a, b)]
        [t.start() for t in pair]
        [t.join() for t in pair]
        assert sorted(map(type, outcomes), key=str) == sorted([str, PackNotFound], key=str), outcomes
        assert keys[trial] in outcomes


_KILLED_WRITER = """
import os, sys, time
from packstore.store.objects.store import ObjectStore
from packstore.packs.tensors import encode_pack
from tests.helpers.s3 import random_pack
upload = ObjectStore._upload_chunk
def slow_upload(self, digest, data):
    relied = upload(self, digest, data)
    time.sleep(2)  # the header waits for every chunk: this writer dies long before it
    return relied
ObjectStore._upload_chunk = slow_upload
with ObjectStore(sys.argv[1], cache_dir=sys.argv[2]) as store:
    store.put(encode_pack(random_pack(sys.argv[3], 7, layers=24)), name="half")
"""


def test_a_writer_killed_mid_upload_leaves_no_visible_pack(url, seaweed, tmp_path, model_fp) -> None:
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, url, str(tmp_path / "writer"), model_fp], env=child_env())
    deadline = time.monotonic() + 120
    while not objects(seaweed, url, "chunks/"):
        assert writer.poll() is None and time.monotonic() < deadline, "the writer ended before uploading a chunk"
        time.sleep(0.05)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    uploaded = objects(seaweed, url, "chunks/")
    assert 0 < len(uploaded) < 24 and not objects(seaweed, url, "headers/")
    key = random_pack(model_fp, 7, layers=24).header.key
    with ObjectStore(url, cache_dir=tmp_path / "reader", gc_grace=2) as reader:
        assert reader.list() == [] and reader.keys() == [] and reader.counts().packs == 0
        for ref in (key, "half"):
            with pytest.raises(PackNotFound):
                PackReader(reader).get(ref, model_fp=model_fp)
        time.sleep(3.5)  # past the grace (+1 s: the server's times are whole seconds): the dead writer's chunks are garbage now
        report = reader.gc()
        assert (report.orphan_chunks, report.orphan_chunk_bytes) == (len(uploaded), sum(uploaded.values()))
    assert objects(seaweed, url, "chunks/") == {}


def test_a_damaged_object_is_data_loss_and_never_served(replicas, seaweed, url, model_fp) -> None:
    a, b = replicas
    pack = pack_of(model_fp)
    key, _ = a.put(encode_pack(pack))
    digest = encode_pack(pack).header.chunks[1].address
    chunk = url.split("/", 3)[3] + f"/ns/default/chunks/{digest}"
    size = objects(seaweed, url, f"chunks/{digest}")[f"chunks/{digest}"]
    seaweed.client().put_object(Bucket=seaweed.bucket, Key=chunk, Body=b"\0" * size)
    for read in (PackReader(b).get, PackReader(b).fetch):
        with pytest.raises(IntegrityError, match="chunk 1 .* is damaged") as error:
            read(key)
        assert error.value.grpc_status == "DATA_LOSS"
    assert b.cache.get(b._cache_scope + b._chunk_name(digest)) is None  # damaged bytes are never cached
    assert not PackReader(b).verify(key).ok and [r.ok for r in PackReader(b).verify_all()] == [False]
    # a writer that needs the same chunk for another pack heals the stored copy (its ETag is not the bytes' MD5)
    a.put(encode_pack(pack_of(model_fp, 20)))
    assert PackReader(b).verify(key).ok and same_tensors(PackReader(b).fetch(key), pack)
    header = url.split("/", 3)[3] + f"/ns/default/headers/{key}"
    stored = seaweed.client().get_object(Bucket=seaweed.bucket, Key=header)["Body"].read()
    seaweed.client().put_object(Bucket=seaweed.bucket, Key=header, Body=stored.replace(b'"raw":false', b'"raw":true '))
    for read in (b.stat, PackReader(b).get):
        with pytest.raises(IntegrityError, match="stored header is damaged"):
            read(key)


def test_the_cache_is_bounded_and_evicts_the_least_recently_used(url, tmp_path, model_fp) -> None:
    packs = [random_pack(model_fp, seed, layers=4, tokens=64) for seed in range(6)]
    chunk_bytes = len(encode_pack(packs[0]).chunks[0])
    bound = 6 * chunk_bytes
    with ObjectStore(url, cache_dir=tmp_path / "w") as writer:
        for pack in packs:
            writer.put(encode_pack(pack))
    with ObjectStore(url, cache_dir=tmp_path / "r", cache_bytes=bound) as reader:
        for pack in packs:
            assert same_tensors(PackReader(reader).fetch(pack.header.key), pack)
            assert reader.cache.held_bytes <= bound
        cached = set(reader.cache.names())
        first = {reader._cache_scope + reader._chunk_name(c.address) for c in packs[0].header.chunks}
        last = {reader._cache_scope + reader._chunk_name(c.address) for c in encode_pack(packs[-1]).header.chunks}
        assert not first & cached and last <= cached  # the oldest went first
        assert same_tensors(PackReader(reader).fetch(packs[0].header.key), packs[0])  # evicted: fetched again
        assert reader.cache.held_bytes <= bound


def test_a_layer_range_gets_only_the_chunk_objects_holding_it(url, tmp_path, model_fp) -> None:
    pack = random_pack(model_fp, 7, layers=12)
    encoded = encode_pack(pack)
    with ObjectStore(url, cache_dir=tmp_path / "w") as writer:
        key, _ = writer.put(encoded)
    with ObjectStore(url, cache_dir=tmp_path / "r") as reader:
        gets = counted_gets(reader)
        part = PackReader(reader).fetch_part(key, layers=(4, 6))
        assert all(torch.equal(a, b) for a, b in zip(pack.keys[4:7] + pack.values[4:7], part.keys + part.values))
        wanted = sorted(f"chunks/{c.address}" for c in encoded.header.chunks[4:7])
        assert sorted(g for g in gets if g.startswith("chunks/")) == wanted  # 3 of the 12 chunk objects
        assert [g for g in gets if not g.startswith("chunks/")] == [f"headers/{key}"]
        gets.clear()
        PackReader(reader).fetch_part(key, layers=(5, 5))
        assert gets == []  # header and chunk from the cache (the header's version checked by a HEAD)
        PackReader(reader).fetch(key)
        assert len(gets) == 9  # the whole pack: only the 9 chunks not read before


def test_a_prefix_gets_only_the_token_block_objects_holding_it(url, tmp_path, model_fp) -> None:
    pack = random_pack(model_fp, 8, layers=4, tokens=2100)  # blocks of positions 0-1023, 1024-2047, 2048-2099
    encoded = encode_pack(pack)
    with ObjectStore(url, cache_dir=tmp_path / "w") as writer:
        key, _ = writer.put(encoded)
    with ObjectStore(url, cache_dir=tmp_path / "r") as reader:
        gets = counted_gets(reader)
        part = PackReader(reader).fetch_part(key, prefix=1000)
        assert all(torch.equal(a[:, :1000], b) for a, b in zip(pack.keys + pack.values, part.keys + part.values))
        wanted = sorted(f"chunks/{c.address}" for c in encoded.header.chunks if c.first_position == 0)
        assert sorted(g for g in gets if g.startswith("chunks/")) == wanted  # the first block of each of the 4 layers


def test_a_damaged_cache_entry_is_dropped_and_fetched_again(replicas, model_fp) -> None:
    a, b = replicas
    pack = pack_of(model_fp)
    key, _ = a.put(encode_pack(pack))
    assert same_tensors(PackReader(b).fetch(key), pack)  # now cached in b
    encoded = encode_pack(pack)
    chunk_slot = b._cache_scope + b._chunk_name(encoded.header.chunks[0].address)
    b.cache.put(chunk_slot, b"\xff" * len(encoded.chunks[0]))
    header_slot = b._cache_scope + b._header_name(key)
    etag = b.cache.get(header_slot).split(b"\n", 1)[0]
    b.cache.put(header_slot, etag + b"\n" + encoded.header.to_json().replace(b'"raw":false', b'"raw":true '))
    assert same_tensors(PackReader(b).fetch(key), pack) and b.stat(key).header == encoded.header
    assert b.cache.get(chunk_slot) == encoded.chunks[0]  # the good bytes replaced the damaged ones


def test_gc_keeps_fresh_unreferenced_chunks_and_removes_old_ones(url, seaweed, tmp_path, model_fp) -> None:
    with ObjectStore(url, cache_dir=tmp_path / "c", gc_grace=3) as store:
        live, doomed = random_pack(model_fp, 1), random_pack(model_fp, 2)
        store.put(encode_pack(live), name="live")
        key, _ = store.put(encode_pack(doomed), name="doomed")
        store.delete(key)
        assert len(objects(seaweed, url, "chunks/")) == 6
        assert store.gc().orphan_chunks == 0  # unreferenced, but younger than the grace: a writer may be about to commit
        assert len(objects(seaweed, url, "chunks/")) == 6
        time.sleep(4.5)  # past the grace, +1 s: LastModified and Date are whole seconds
        report = store.gc()
        assert report.orphan_chunks == 3 and report.file_bytes_after < report.file_bytes_before
        assert set(objects(seaweed, url, "chunks/")) == {f"chunks/{c.address}" for c in encode_pack(live).header.chunks}
        assert PackReader(store).verify("live").ok and store.resolve("live", model_fp=model_fp) == live.header.key
        assert list(objects(seaweed, url, "names/")) == [f"names/{model_fp}/doomed/{1:020d}", f"names/{model_fp}/live/{0:020d}"]


def test_one_gc_at_a_time(replicas) -> None:
    a, b = replicas
    a._take_lease()
    with pytest.raises(StoreBusy, match="another gc is running"):
        b.gc()


def test_wrong_credentials_are_permission_denied(url, monkeypatch) -> None:
    for variable, value in (("AWS_SECRET_ACCESS_KEY", "not-the-secret"), ("AWS_ACCESS_KEY_ID", "nobody")):
        with monkeypatch.context() as env:
            env.setenv(variable, value)
            with pytest.raises(PermissionDenied, match="refused access to bucket") as error:
                ObjectStore(url, retries=1)
            assert error.value.grpc_status == "PERMISSION_DENIED"


def test_an_unreachable_endpoint_is_unavailable(url) -> None:
    started = time.monotonic()
    with pytest.raises(Unavailable, match="unreachable") as error:
        ObjectStore(url, endpoint=f"http://127.0.0.1:{free_port()}", retries=2, timeout=2)
    assert error.value.grpc_status == "UNAVAILABLE" and time.monotonic() - started < 30


def test_a_missing_bucket_is_a_clear_error(seaweed) -> None:
    with pytest.raises(StoreNotFound, match="bucket 'no-such-bucket' at .* does not exist") as error:
        ObjectStore("s3://no-such-bucket/packs")
    assert error.value.fields == {"bucket": "no-such-bucket"} and error.value.grpc_status == "FAILED_PRECONDITION"


def test_namespaces_keep_keys_and_names_apart(url, tmp_path, model_fp) -> None:
    with ObjectStore(url, cache_dir=tmp_path / "a", namespace="team-a") as a, ObjectStore(url, cache_dir=tmp_path / "b", namespace="team-b") as b:
        shared, own = pack_of(model_fp, 10), pack_of(model_fp, 20)
        assert a.put(encode_pack(shared), name="same-name")[1] and b.put(encode_pack(shared), name="same-name")[1]
        a.put(encode_pack(own), name="only-a")
        assert [p.key for p in b.list()] == [shared.header.key] and len(a.list()) == 2
        for ref in (own.header.key, "only-a"):
            with pytest.raises(PackNotFound):
                b.stat(ref, model_fp=model_fp)
        a.delete("same-name", model_fp=model_fp)
        assert PackReader(b).verify(shared.header.key).ok and b.stat("same-name", model_fp=model_fp).names == ("same-name",)


def test_signatures_are_stored_and_served_with_their_packs(replicas, tmp_path, model_fp) -> None:
    a, b = replicas
    signers = [SigningKey.load(generate_key(tmp_path / f"key{i}")[0]) for i in range(2)]
    encoded = encode_pack(pack_of(model_fp))
    signed = EncodedPack(encoded.header, encoded.chunks, (signers[0].sign("pack", encoded.header.pack_sha256),))
    key, _ = a.put(signed)
    assert b.stat(key).signatures == signed.signatures and PackReader(b).get(key).signatures == signed.signatures
    a.add_signature(key, signers[1].sign("pack", encoded.header.pack_sha256))
    assert {s.key_id for s in b.stat(key).signatures} == {s.key_id for s in signers} and PackReader(b).verify(key).ok
    with pytest.raises(IntegrityError, match="for another pack"):
        a.add_signature(key, signers[1].sign("pack", "0" * 64))
    a.delete(key)
    a.put(encoded)
    assert b.stat(key).signatures == ()  # deleting the pack removed its signatures with it
