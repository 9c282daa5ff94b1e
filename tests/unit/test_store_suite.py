"""One behaviour suite for every PackStore: the embedded LMDB store and the service on loopback.

Each test works under its own model fingerprint, so the module-wide stores need no reset and
a behaviour that differs between the tiers shows up as one failing parameter.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from packstore.bank.bank import open_banks
from packstore.errors import AmbiguousRef, IntegrityError, InvalidInput, PackMismatch, PackNotFound
from packstore.format.body import chunks_for
from packstore.packs.reader import PackReader
from packstore.packs.tensors import Pack, encode_pack
from packstore.security.trust import SigningKey, generate_key
from packstore.store import BankStore, LmdbStore, PackStore
from packstore.store.records import GcReport, PackPage, PackSummary, StoreCounts
from packstore.store.remote.store import RemoteStore
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.packs import FP_B, pack_of
from tools.lib.servers import running_server

# The embedded store is a unit test; the others need a service on loopback or the session's SeaweedFS.
TIERS = ["lmdb", pytest.param("grpc", marks=pytest.mark.service), pytest.param("s3", marks=pytest.mark.s3)]


@pytest.fixture(scope="module", params=TIERS)
def store(request, tmp_path_factory) -> Iterator[PackStore]:
    root = tmp_path_factory.mktemp(f"suite-{request.param}")
    if request.param == "lmdb":
        with LmdbStore(root / "store") as local:
            yield local
        return
    if request.param == "s3":
        from packstore.store.objects.store import ObjectStore  # the s3 extra (boto3), only where it runs

        seaweed = request.getfixturevalue("seaweed")
        with ObjectStore(f"s3://{seaweed.bucket}/suite", cache_dir=root / "cache") as objects:
            yield objects
        return
    with running_server(root / "data") as server, RemoteStore(server.url) as remote:
        yield remote


@pytest.fixture
def model_fp(request) -> str:
    """A model fingerprint of this test's own, so tests sharing a store never see each other's packs."""
    return hashlib.sha256(request.node.name.encode()).hexdigest()


def test_implements_the_protocols(store: PackStore) -> None:
    assert isinstance(store, PackStore)
    assert isinstance(open_banks(store, TEST_BANK_CACHE), BankStore)


def test_banks_build_add_route_list_sign_delete(store: PackStore, tmp_path: Path) -> None:
    banks = open_banks(store, TEST_BANK_CACHE)
    colours = ("red", "green", "blue", "amber", "violet", "silver")
    facts = [f"The {colours[i % 6]} key number {i} opens the door of room {100 + i}." for i in range(60)]
    meta = banks.build("suite-bank", facts)
    assert (meta.name, meta.facts, meta.clusters) == ("suite-bank", 60, 3)
    [route] = banks.route("suite-bank", ["Which door does key number 17 open?"], top_k=3)
    assert route.facts[0][0] == facts[17] and route.clusters
    before = banks.digest("suite-bank")
    assert banks.add("suite-bank", ["The golden key opens the vault under the library."]).facts == 61
    assert banks.route("suite-bank", ["What opens the vault?"], top_k=1)[0].facts[0][0].startswith("The golden key")
    after = banks.digest("suite-bank")
    assert after != before  # every change to the bank changes what a signature covers
    [(listed, size)] = [(m, size) for m, size in banks.list() if m.name == "suite-bank"]
    assert listed.facts == 61 and size == banks.stored_bytes("suite-bank") > 0
    signer = SigningKey.load(generate_key(tmp_path / "bank-key")[0])
    with pytest.raises(IntegrityError, match="for another"):
        banks.sign("suite-bank", signer.sign("bank", before))
    banks.sign("suite-bank", signer.sign("bank", after))
    assert [s.key_id for s in banks.signatures("suite-bank")] == [signer.key_id]
    banks.delete("suite-bank")
    assert "suite-bank" not in [m.name for m, _ in banks.list()]
    for call in (lambda: banks.route("suite-bank", ["vault"]), lambda: banks.delete("suite-bank"), lambda: banks.stored_bytes("suite-bank")):
        with pytest.raises(PackNotFound, match="no bank named 'suite-bank'"):
            call()


def test_put_stat_get_fetch_round_trip(store: PackStore, model_fp: str) -> None:
    pack = pack_of(model_fp)
    key, created = store.put(encode_pack(pack), name="round")
    assert (key, created) == (pack.header.key, True)
    assert store.put(encode_pack(pack)) == (key, False)
    stored = store.stat("round", model_fp=model_fp)
    assert stored.key == key and stored.names == ("round",) and stored.header == PackReader(store).get(key).header
    assert stored.stored_bytes == encode_pack(pack).stored_bytes
    fetched = PackReader(store).fetch(key, model_fp=model_fp, template_fp=FP_B)
    assert all(torch.equal(a, b) for a, b in zip(pack.keys + pack.values, fetched.keys + fetched.values))


def test_start_fetch_checks_identities_at_once_then_hands_out_layers_as_they_decode(store: PackStore, model_fp: str) -> None:
    pack = pack_of(model_fp, tokens=2500)  # token blocks: each layer is whole only once its three chunks are in
    key, _ = store.put(encode_pack(pack))
    arriving = PackReader(store).start_fetch(key, model_fp=model_fp, template_fp=FP_B)
    assert arriving.header.key == key
    for slot in range(pack.header.layers):
        k, v = arriving.layer(slot)
        assert torch.equal(k, pack.keys[slot]) and torch.equal(v, pack.values[slot])
    whole = arriving.result()
    assert all(torch.equal(a, b) for a, b in zip(pack.keys + pack.values, whole.keys + whole.values))
    with pytest.raises(PackMismatch):
        PackReader(store).start_fetch(key, model_fp="0" * 64)
    with pytest.raises(PackMismatch):
        PackReader(store).start_fetch(key, template_fp="0" * 64)
    with pytest.raises(PackNotFound):
        PackReader(store).start_fetch("f" * 64 + "/" + "f" * 64 + "/" + "f" * 64)


def test_steering_packs_round_trip_with_their_partial_layer_range(store: PackStore, model_fp: str) -> None:
    base = pack_of(model_fp).header
    recipe = {"pairs": [{"good": "kind words", "bad": "cruel words"}], "pooling": "last", "layers": [1, base.layers - 1]}
    header = dataclasses.replace(base, kind="steering", token_ids=(), facts=(), recipe=recipe, metrics={})
    torch.manual_seed(0)
    shape = header.tensor_shape
    pack = Pack(header, [torch.randn(shape) for _ in header.body_layers], [torch.randn(shape) for _ in header.body_layers])
    key, created = store.put(encode_pack(pack), name="steer")
    assert created and store.resolve("steer", model_fp=model_fp) == key
    [summary] = store.list(model_fp=model_fp)
    assert (summary.kind, summary.tokens, summary.facts) == ("steering", 0, 0)
    fetched = PackReader(store).fetch(key)
    assert all(torch.equal(a, b) for a, b in zip(pack.keys + pack.values, fetched.keys + fetched.values))
    assert store.stat(key).header.recipe == recipe and PackReader(store).verify(key).ok
    part = PackReader(store).fetch_part(key, layers=(2, 2))  # a steering pack's body starts at its recipe's first layer
    assert part.layers == range(2, 3) and torch.equal(part.keys[0], pack.keys[1]) and torch.equal(part.values[0], pack.values[1])
    with pytest.raises(InvalidInput):
        PackReader(store).fetch_part(key, layers=(0, 1))
    with pytest.raises(InvalidInput, match="a steering pack has no token positions"):
        PackReader(store).fetch_part(key, prefix=1)


def test_fetch_part_decodes_only_the_layers_asked_for(store: PackStore, model_fp: str) -> None:
    pack = pack_of(model_fp)
    key, _ = store.put(encode_pack(pack))
    part = PackReader(store).fetch_part(key, layers=(1, 2), model_fp=model_fp, template_fp=FP_B)
    assert part.header.key == key and part.layers == range(1, 3)
    assert all(torch.equal(a, b) for a, b in zip(pack.keys[1:] + pack.values[1:], part.keys + part.values))
    assert [k.shape for k in PackReader(store).fetch_part(key, layers=(0, 0)).keys] == [pack.keys[0].shape]
    for first, last in ((2, 3), (2, 1)):
        with pytest.raises(InvalidInput, match="not within its layers 0-2"):
            PackReader(store).fetch_part(key, layers=(first, last))
    with pytest.raises(PackMismatch):
        PackReader(store).fetch_part(key, layers=(0, 0), model_fp="0" * 64)


def test_fetch_part_of_a_prefix_decodes_only_the_token_blocks_holding_it(store: PackStore, model_fp: str) -> None:
    pack = pack_of(model_fp, tokens=2500)
    encoded = encode_pack(pack)  # three token blocks per layer: 0-1023, 1024-2047, 2048-2499
    assert [(c.first_position, c.stop_position) for c in encoded.header.chunks[:3]] == [(0, 1024), (1024, 2048), (2048, 2500)]
    assert chunks_for(encoded.header, None, 1000) == (0, 3, 6) and chunks_for(encoded.header, (1, 2), 1025) == (3, 4, 6, 7)
    key, _ = store.put(encoded)
    fetched = PackReader(store).fetch(key)
    assert all(torch.equal(a, b) for a, b in zip(pack.keys + pack.values, fetched.keys + fetched.values))
    for layers, prefix in ((None, 1), (None, 1024), (None, 1025), ((1, 2), 2500), ((0, 0), 700)):
        part = PackReader(store).fetch_part(key, layers=layers, prefix=prefix, model_fp=model_fp, template_fp=FP_B)
        span = range(3) if layers is None else range(layers[0], layers[1] + 1)
        assert part.layers == span and part.positions == prefix
        wanted = [pack.keys[i][:, :prefix] for i in span] + [pack.values[i][:, :prefix] for i in span]
        assert all(torch.equal(a, b) for a, b in zip(wanted, part.keys + part.values))
    for prefix in (0, 2501):
        with pytest.raises(InvalidInput, match=f"a prefix of {prefix} positions is not within its 1-2500"):
            PackReader(store).fetch_part(key, prefix=prefix)


def test_stated_identities_must_match(store: PackStore, model_fp: str) -> None:
    key, _ = store.put(encode_pack(pack_of(model_fp)))
    for call in (PackReader(store).fetch, PackReader(store).get):
        with pytest.raises(PackMismatch) as model_error:
            call(key, model_fp="0" * 64)
        assert model_error.value.what == "model" and model_error.value.fields["what"] == "model"
        with pytest.raises(PackMismatch) as template_error:
            call(key, template_fp="0" * 64)
        assert template_error.value.what == "template"


def test_names_resolve_per_model_and_ambiguity_is_typed(store: PackStore, model_fp: str) -> None:
    other = hashlib.sha256(model_fp.encode()).hexdigest()
    key_a, _ = store.put(encode_pack(pack_of(model_fp)), name="shared-name")
    key_b, _ = store.put(encode_pack(pack_of(other)), name="shared-name")
    assert store.resolve("shared-name", model_fp=model_fp) == key_a
    assert store.resolve("shared-name", model_fp=other) == key_b
    with pytest.raises(AmbiguousRef) as error:
        store.resolve("shared-name")
    assert error.value.fields == {"ref": "shared-name", "matches": "2"}
    assert store.resolve(key_a.rsplit("/", 1)[1][:12], model_fp=model_fp) == key_a


def test_set_and_delete_names(store: PackStore, model_fp: str) -> None:
    first, _ = store.put(encode_pack(pack_of(model_fp, 10)), name="moving")
    second, _ = store.put(encode_pack(pack_of(model_fp, 20)))
    assert store.set_name(second, "moving") == second
    assert store.stat(first).names == () and store.stat(second).names == ("moving",)
    assert store.delete_name("moving", model_fp=model_fp) == second
    with pytest.raises(PackNotFound) as error:
        store.resolve("moving", model_fp=model_fp)
    assert error.value.fields["ref"] == "moving"
    assert store.stat(second).names == ()


def test_delete_removes_pack_and_names(store: PackStore, model_fp: str) -> None:
    key, _ = store.put(encode_pack(pack_of(model_fp)), name="doomed")
    before = store.counts()
    assert store.delete("doomed", model_fp=model_fp) == key
    with pytest.raises(PackNotFound):
        store.stat(key)
    assert store.list(model_fp=model_fp) == []
    after = store.counts()
    assert (after.packs, before.stored_bytes - after.stored_bytes) == (before.packs - 1, encode_pack(pack_of(model_fp)).stored_bytes)


def test_listing_pages_in_key_order_with_filters(store: PackStore, model_fp: str) -> None:
    other_template = "e" * 64
    keys = sorted(store.put(encode_pack(pack_of(model_fp, 100 + 10 * i)), name=f"p{i}")[0] for i in range(7))
    odd, _ = store.put(encode_pack(pack_of(model_fp, 500, template_fp=other_template)), name="p0")
    everything = store.list(model_fp=model_fp)
    assert [p.key for p in everything] == sorted(keys + [odd])
    assert all(isinstance(p, PackSummary) for p in everything)
    pages, token = [], ""
    while True:
        page = store.list_page(page_size=3, page_token=token, model_fp=model_fp, template_fp=FP_B)
        assert isinstance(page, PackPage) and len(page.packs) <= 3
        pages.append([p.key for p in page.packs])
        token = page.next_token
        if not token:
            break
    assert [len(p) for p in pages] == [3, 3, 1] and sum(pages, []) == keys
    assert [p.key for p in store.list(name="p0", model_fp=model_fp)] == [odd]  # the name moved to the last pack given it
    assert [p.names for p in store.list(name="p1", model_fp=model_fp)] == [("p1",)]
    assert [p.key for p in store.list(model_fp=model_fp, template_fp=other_template)] == [odd]
    summary = store.list_page(page_size=1, model_fp=model_fp).packs[0]
    stat = store.stat(summary.key).summary
    assert summary == stat


def test_counts_follow_writes(store: PackStore, model_fp: str) -> None:
    before = store.counts()
    assert isinstance(before, StoreCounts)
    encoded = encode_pack(pack_of(model_fp))
    store.put(encoded)
    store.put(encoded)  # idempotent: counted once
    after = store.counts()
    assert (after.packs - before.packs, after.stored_bytes - before.stored_bytes) == (1, encoded.stored_bytes)


def test_verify_and_gc(store: PackStore, model_fp: str) -> None:
    key, _ = store.put(encode_pack(pack_of(model_fp)))
    assert PackReader(store).verify(key).ok
    assert key in {r.key for r in PackReader(store).verify_all() if r.ok}
    assert key in store.keys()
    report = store.gc()
    assert isinstance(report, GcReport) and report.orphan_chunks == 0 and not report.compacted


def test_missing_refs_raise_the_same_error(store: PackStore, model_fp: str) -> None:
    for call in (store.stat, PackReader(store).get, PackReader(store).fetch, store.delete, store.resolve):
        with pytest.raises(PackNotFound, match="no pack named 'absent-pack'"):
            call("absent-pack", model_fp=model_fp)


def test_layout_1_store_is_upgraded_on_open(tmp_path: Path) -> None:
    """A store written before the listing indexes existed gains them (and its counters) on open."""
    import lmdb

    with LmdbStore(tmp_path / "old") as store:
        key, _ = store.put(encode_pack(pack_of("1" * 64)), name="kept")
    env = lmdb.open(str(tmp_path / "old"), max_dbs=16)
    with env.begin(write=True) as txn:
        for name in (b"summaries", b"key_names", b"by_name"):
            txn.drop(env.open_db(name, txn=txn), delete=True)
        meta = env.open_db(b"meta", txn=txn)
        txn.put(b"layout", b"1", db=meta)
        txn.delete(b"counts", db=meta)
    env.close()
    with LmdbStore(tmp_path / "old", readonly=True) as store:  # even a read-only open upgrades it
        assert [p.key for p in store.list()] == [key]
        assert store.resolve("kept") == key and store.stat(key).names == ("kept",)
        assert store.counts() == StoreCounts(packs=1, stored_bytes=store.stat(key).stored_bytes)
