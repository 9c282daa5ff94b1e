"""Ed25519 pack and bank signatures: keys, records, storage on every store, pack files, the trust policy."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import struct

import pytest

from packstore.answering.answer import Answerer, Question
from packstore.answering.api import sign_bank, store_pack, verify_banks
from packstore.bank.bank import open_banks
from packstore.cli.packctl import main as packctl
from packstore.errors import IntegrityError, InvalidInput, PackNotFound, Untrusted
from packstore.format.packfile import pack_file_parts, parse_pack_file
from packstore.format.signature import Signature, signed_message
from packstore.kv.build import build_pack
from packstore.kv.inject import Sampling
from packstore.kv.records import Pair
from packstore.kv.steer import build_steering
from packstore.packs.admin import export_pack, import_pack, sign_pack, verify_packs
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.security.trust import SigningKey, TrustedKeys, generate_key
from packstore.store import LmdbStore
from packstore.store.remote.store import RemoteStore
from tests.helpers.banks import TEST_BANK_CACHE
from tests.helpers.packs import make_pack
from tools.lib.servers import running_server

GREEDY = Sampling(max_new_tokens=6)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    made = {name: generate_key(root / name) for name in ("alice", "mallory")}
    trusted = root / "trusted.pem"
    trusted.write_bytes(b"# the release key\n" + made["alice"][1].read_bytes())
    return {name: SigningKey.load(private) for name, (private, _, _) in made.items()} | {"trusted": TrustedKeys.load(trusted), "trusted_path": trusted}


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(tmp_path) -> None:
    private, public, key_id = generate_key(tmp_path / "k")
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600 and public.name == "k.pub"
    assert SigningKey.load(private).key_id == key_id and len(key_id) == 64
    with pytest.raises(InvalidInput, match="never overwrites"):
        generate_key(tmp_path / "k")
    with pytest.raises(InvalidInput, match="not an unencrypted PEM private key"):
        SigningKey.load(public)
    (tmp_path / "empty.pem").write_text("no keys here\n")
    with pytest.raises(InvalidInput, match="holds no public key"):
        TrustedKeys.load(tmp_path / "empty.pem")


def test_records_round_trip_and_are_parsed_strictly(keys) -> None:
    signature = keys["alice"].sign("pack", "a" * 64)
    again = Signature.from_json(signature.to_json())
    assert again == signature and again.valid() and again.check("pack", "a" * 64) is again
    with pytest.raises(IntegrityError, match="for another pack"):
        signature.check("pack", "b" * 64)
    forged = dataclasses.replace(signature, digest="b" * 64)
    assert not forged.valid()
    record = json.loads(signature.to_json())
    for change, problem in (
        ({"key_id": "0" * 64}, "key_id"),
        ({"signature": "AAAA"}, "signature must be base64 of 64 bytes"),
        ({"algorithm": "rsa"}, "algorithm"),
        ({"extra": 1}, "exactly the fields"),
        ({"digest": "A" * 64}, "digest"),
    ):
        with pytest.raises(InvalidInput, match=problem):
            Signature.from_json(json.dumps(record | change))
    assert signed_message("pack", "a" * 64) == b"packstore-signature-v1:pack:" + b"a" * 64


@pytest.fixture(scope="module", params=["lmdb", "grpc"])
def any_store(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"signing-{request.param}")
    if request.param == "lmdb":
        with LmdbStore(root / "store") as store:
            yield store
        return
    with running_server(root / "data") as server, RemoteStore(server.url) as store:
        yield store


def test_signatures_are_stored_served_and_removed_with_their_pack(any_store, keys, tmp_path) -> None:
    pack = make_pack(tokens=7)
    key, _ = any_store.put(encode_pack(pack))
    assert verify_packs(any_store, [key], keys["trusted"])[0].error == "not trusted: unsigned"
    sign_pack(any_store, key, keys["mallory"])
    assert "untrusted keys" in verify_packs(any_store, [key], keys["trusted"])[0].error
    sign_pack(any_store, key, keys["alice"])
    sign_pack(any_store, key, keys["alice"])  # one signature per key: signing again replaces it
    assert verify_packs(any_store, [key], keys["trusted"])[0].ok
    assert len(any_store.stat(key).signatures) == 2 and len(PackReader(any_store).get(key).signatures) == 2
    other = any_store.put(encode_pack(make_pack(tokens=8)))[0]
    wrong = keys["alice"].sign("pack", any_store.stat(other).header.pack_sha256)
    with pytest.raises(IntegrityError, match="for another pack"):
        any_store.add_signature(key, wrong)
    export_pack(any_store, key, tmp_path / "signed.pack")
    with LmdbStore(tmp_path / "copy") as copy:
        imported, _ = import_pack(copy, tmp_path / "signed.pack")
        assert len(imported.signatures) == 2 and verify_packs(copy, [], keys["trusted"])[0].ok
    any_store.delete(key)
    any_store.put(encode_pack(pack))
    assert any_store.stat(key).signatures == ()  # a deleted pack's signatures went with it


def test_a_signed_upload_carries_its_signatures_and_a_bad_one_stores_nothing(any_store, keys) -> None:
    encoded = encode_pack(make_pack(tokens=9))
    signed = dataclasses.replace(encoded, signatures=(keys["alice"].sign("pack", encoded.header.pack_sha256),))
    key, created = any_store.put(signed)
    assert created and verify_packs(any_store, [key], keys["trusted"])[0].ok
    fresh = encode_pack(make_pack(tokens=10))
    bad = dataclasses.replace(fresh, signatures=(keys["alice"].sign("pack", "c" * 64),))
    with pytest.raises(IntegrityError):
        any_store.put(bad)
    with pytest.raises(PackNotFound):
        any_store.stat(fresh.header.key)


def test_pack_files_with_damaged_signature_sections_are_refused(keys) -> None:
    encoded = encode_pack(make_pack(tokens=5))
    signed = dataclasses.replace(encoded, signatures=(keys["alice"].sign("pack", encoded.header.pack_sha256),))
    data = b"".join(pack_file_parts(signed))
    assert struct.unpack_from("<I", data, 8)[0] == 2 and parse_pack_file(data).signatures == signed.signatures
    assert struct.unpack_from("<I", b"".join(pack_file_parts(encoded)), 8)[0] == 1  # unsigned: still version 1
    for damaged, problem in ((data[:-3], "truncated"), (data + b"x", "unexpected bytes"), (data[:-10] + b"}" * 10, "malformed")):
        with pytest.raises(IntegrityError, match=problem):
            parse_pack_file(damaged)


def test_a_trusting_answerer_injects_only_signed_packs_and_trusts_what_it_derives(tiny_lm, keys, tmp_path) -> None:
    with LmdbStore(tmp_path / "store") as store:
        for name, facts in (("a", ["Alice lives in Paris."]), ("b", ["Bob lives in Oslo."])):
            store_pack(store, build_pack(tiny_lm, facts), name=name)
        store_pack(store, build_steering(tiny_lm, [Pair("Alice lives in Paris.", "Bob lives in Oslo.")]), name="joy")
        trusting = Answerer(tiny_lm, store, trusted=keys["trusted"])
        with pytest.raises(Untrusted, match="pack .* is not trusted: unsigned") as refused:
            trusting.ask(Question("Who lives in Oslo?", refs=("a",), sampling=GREEDY))
        assert refused.value.grpc_status == "FAILED_PRECONDITION"
        for name in ("a", "b"):
            sign_pack(store, name, keys["alice"])
        trusting.ask(Question("Who lives in Oslo?", refs=("a",), sampling=GREEDY))
        with pytest.raises(Untrusted):
            trusting.ask(Question("Who lives in Oslo?", refs=("a",), steering=(("joy", 1.0),), sampling=GREEDY))
        sign_pack(store, "joy", keys["alice"])
        trusting.ask(Question("Who lives in Oslo?", refs=("a",), steering=(("joy", 1.0),), sampling=GREEDY))
        # an unsigned stored composition is not taken: the composition of the signed parts is computed
        from packstore.answering.api import compose_and_store

        composed, _, _ = compose_and_store(store, tiny_lm, ["a", "b"], name="ab")
        result = trusting.ask(Question("Who lives in Oslo?", refs=("a", "b"), sampling=GREEDY))
        assert result.pack == composed.key and result.composed_tokens > 0
        trusting.ask(Question("Who lives in Oslo?", refs=("ab",), sampling=GREEDY))  # the ready copy it derived itself
        with pytest.raises(Untrusted):  # a fresh Answerer would have to take the unsigned stored bytes
            Answerer(tiny_lm, store, trusted=keys["trusted"]).ask(Question("Who lives in Oslo?", refs=("ab",), sampling=GREEDY))


def test_banks_are_signed_over_their_whole_contents(tiny_lm, keys, tmp_path) -> None:
    from packstore.kv.synthetic import synthetic_facts

    cases = synthetic_facts(40)
    with LmdbStore(tmp_path / "store") as store:
        banks = open_banks(store, TEST_BANK_CACHE)
        banks.build("kb", [c.fact for c in cases[:30]])
        trusting = Answerer(tiny_lm, store, trusted=keys["trusted"])
        question = Question(cases[3].query, bank="kb", top_k=2, sampling=GREEDY)
        with pytest.raises(Untrusted, match="bank 'kb' is not trusted: unsigned"):
            trusting.ask(question)
        signature = sign_bank(store, "kb", keys["alice"])
        assert verify_banks(store, [], keys["trusted"])[0].ok and signature.digest == banks.digest("kb")
        assert trusting.ask(question).facts[0] == cases[3].fact
        banks.add("kb", [c.fact for c in cases[30:]])
        assert banks.digest("kb") != signature.digest
        assert "do not verify" in verify_banks(store, ["kb"], keys["trusted"])[0].error
        with pytest.raises(Untrusted):
            trusting.ask(question)
        with pytest.raises(IntegrityError):
            banks.sign("kb", signature)  # a signature of the old contents is refused


def test_cli_keygen_sign_and_verify(tmp_path, capsys) -> None:
    store = ["--store", str(tmp_path / "store")]
    with LmdbStore(tmp_path / "store") as local:
        key, _ = local.put(encode_pack(make_pack(tokens=6)), name="p")
    assert packctl([*store, "keygen", "--out", str(tmp_path / "release"), "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert packctl([*store, "verify", "--trusted-keys", made["public_key"]]) == 1
    out, err = capsys.readouterr()
    assert f"UNTRUSTED  {key}: not trusted: unsigned" in out and "1 damaged or untrusted" in err
    assert packctl([*store, "sign", "p", "--key", made["private_key"]]) == 0
    assert made["key_id"] in capsys.readouterr().out
    assert packctl([*store, "verify", "--trusted-keys", made["public_key"]]) == 0
    assert packctl([*store, "inspect", "p"]) == 0 and f"signed by:    {made['key_id']}" in capsys.readouterr().out
    assert packctl([*store, "sign", "p", "--key", made["public_key"]]) == 1
    assert "not an unencrypted PEM private key" in capsys.readouterr().err


def test_a_worker_with_trusted_keys_refuses_unsigned_packs_over_grpc(tiny_lm, tiny_model_dir, keys, tmp_path) -> None:
    import grpc

    from packstore.v1 import worker_pb2, worker_pb2_grpc
    from tools.lib.servers import running_worker

    with running_server(tmp_path / "data") as server, RemoteStore(server.url) as remote:
        remote.put(encode_pack(build_pack(tiny_lm, ["Alice lives in Paris."])), name="a")
        extra = ("--threads", "1", "--trusted-keys", str(keys["trusted_path"]))
        with running_worker(server.url, str(tiny_model_dir), tmp_path, *extra) as worker:
            stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker.address))
            request = worker_pb2.GenerateRequest(packs=["a"], question="Who lives in Paris?", sampling=worker_pb2.Sampling(max_new_tokens=4))
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"pack {remote.resolve('a')} is not trusted: unsigned" in refused.value.details()
            sign_pack(remote, "a", keys["alice"])
            assert list(stub.Generate(request))[-1].WhichOneof("item") == "done"
