"""TLS and mutual TLS on the pack service and the worker, with certificates made in the test."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.request

import pytest
import torch

from packstore.cli.packctl import main as packctl
from packstore.errors import Unavailable
from packstore.kv.build import build_pack
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.rpc.channel import Connection
from packstore.rpc.frames import MAGIC, read_frame
from packstore.store.remote.bulk_reads import connect
from packstore.store.remote.store import RemoteStore
from packstore.v1 import store_pb2
from tests.helpers.packs import make_pack
from tests.helpers.tls import make_certificates
from tools.lib.servers import running_server, running_worker


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    return make_certificates(tmp_path_factory.mktemp("tls"))


def test_the_service_speaks_tls_only_to_clients_that_trust_its_ca(certs, tmp_path) -> None:
    tls = ["--tls-cert", certs["cert"], "--tls-key", certs["key"]]
    with running_server(tmp_path / "data", *tls, tls={"ca": certs["ca"]}) as server:
        secure = f"grpcs://{server.address}"
        with RemoteStore(secure, connection=Connection(tls_ca=certs["ca"]), timeout=10) as store:
            pack = make_pack()
            key, created = store.put(encode_pack(pack))
            assert created and store.stat(key).key == key
            assert torch.equal(PackReader(store).fetch(key).keys[0], pack.keys[0]) and store.bulk  # the bulk port spoke TLS: no fallback
            _, ticket, _ = store._start_get_pack(store_pb2.GetPackRequest(ref=key, bulk=True))
            assert ticket.bulk.tls
        scrape = urllib.request.urlopen(f"https://{server.metrics}/metrics", context=ssl.create_default_context(cafile=certs["ca"]), timeout=10)
        assert "packstore_requests_total" in scrape.read().decode()  # the metrics port speaks TLS with the same certificate
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10)
        with socket.create_connection(("127.0.0.1", ticket.bulk.port), timeout=5) as raw, pytest.raises((OSError, EOFError)):
            raw.sendall(MAGIC + ticket.bulk.ticket)  # in the clear, to a TLS port
            read_frame(raw)
        with RemoteStore(f"grpc://{server.address}", connection=Connection(), timeout=5) as plain, pytest.raises(Unavailable):
            plain.stat(key)  # a plain client cannot talk to a TLS port
        other = make_certificates(tmp_path / "other", prefix="other-")
        with RemoteStore(secure, connection=Connection(tls_ca=other["ca"]), timeout=5) as wrong, pytest.raises(Unavailable):
            wrong.stat(key)  # nor one that trusts another CA


def test_mutual_tls_requires_a_client_certificate_from_the_client_ca(certs, tmp_path, capsys) -> None:
    tls = ["--tls-cert", certs["cert"], "--tls-key", certs["key"], "--tls-client-ca", certs["ca"]]
    health = {"ca": certs["ca"], "client_cert": certs["client_cert"], "client_key": certs["client_key"]}
    with running_server(tmp_path / "data", *tls, tls=health) as server:
        secure = f"grpcs://{server.address}"
        with RemoteStore(secure, connection=Connection(tls_ca=certs["ca"]), timeout=5) as anonymous, pytest.raises(Unavailable):
            anonymous.counts()
        mutual = Connection(tls_ca=certs["ca"], tls_client_cert=certs["client_cert"], tls_client_key=certs["client_key"])
        with RemoteStore(secure, connection=mutual, timeout=10) as store:
            store.put(encode_pack(make_pack()), name="p")
            assert PackReader(store).fetch("p") and store.bulk
            _, ticket, _ = store._start_get_pack(store_pb2.GetPackRequest(ref="p", bulk=True))
        with pytest.raises((OSError, EOFError)):  # the bulk port, too, wants a client certificate
            read_frame(connect("127.0.0.1", ticket.bulk.port, ticket.bulk.ticket, timeout=5, tls=Connection(tls_ca=certs["ca"]).ssl_context()))
        with pytest.raises((OSError, http.client.HTTPException)):  # and the metrics port
            urllib.request.urlopen(f"https://{server.metrics}/metrics", context=Connection(tls_ca=certs["ca"]).ssl_context(), timeout=10).read()
        assert b"packstore_requests_total" in urllib.request.urlopen(f"https://{server.metrics}/metrics", context=mutual.ssl_context(), timeout=10).read()
        argv = ["--store", secure, "--tls-ca", certs["ca"], "--tls-client-cert", certs["client_cert"], "--tls-client-key", certs["client_key"]]
        assert packctl([*argv, "ls", "--json"]) == 0 and json.loads(capsys.readouterr().out)["packs"][0]["name"] == "p"
        assert packctl(["--store", secure, "--tls-ca", certs["ca"], "--tls-client-cert", certs["client_cert"], "ls"]) == 1
        assert "needs its key" in capsys.readouterr().err


def test_the_worker_serves_tls_and_reaches_a_tls_store_with_its_own_settings(certs, tiny_lm, tiny_model_dir, tmp_path, capsys) -> None:
    store_certs = make_certificates(tmp_path / "store-tls", prefix="store-")
    store_tls = ["--tls-cert", store_certs["cert"], "--tls-key", store_certs["key"]]
    with running_server(tmp_path / "data", *store_tls, tls={"ca": store_certs["ca"]}) as server:
        store_url = f"grpcs://{server.address}"
        with RemoteStore(store_url, connection=Connection(tls_ca=store_certs["ca"])) as remote:
            key, _ = remote.put(encode_pack(build_pack(tiny_lm, ["Alice lives in Paris."])), name="alice")
        listener = ["--tls-cert", certs["cert"], "--tls-key", certs["key"], "--store-tls-ca", store_certs["ca"], "--threads", "1"]
        with running_worker(store_url, str(tiny_model_dir), tmp_path, *listener, tls={"ca": certs["ca"]}) as worker:
            ask = ["ask", "alice", "Who lives in Paris?", "--worker", f"grpcs://{worker.address}", "--json", "--max-new-tokens", "4"]
            assert packctl(["--tls-ca", certs["ca"], *ask]) == 0
            assert json.loads(capsys.readouterr().out)["pack"] == key
            assert packctl(["--tls-ca", store_certs["ca"], *ask]) == 1  # the worker's certificate is not from the store's CA
            assert "unavailable" in capsys.readouterr().err.lower()
