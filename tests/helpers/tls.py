"""Certificates made in the tests: a CA, a server certificate for 127.0.0.1/localhost, a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _certificate(subject: str, key, issuer_name, issuer_key, *, ca: bool, usage=None, names=()):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certificates(directory: Path, prefix: str = "") -> dict[str, str]:
    """Write ca.pem, server.pem/server.key and client.pem/client.key; returns their paths by role."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca = _certificate(f"{prefix}packstore test CA", ca_key, None, ca_key, ca=True)
    server_key, client_key = _key(), _key()
    names = (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    server = _certificate("127.0.0.1", server_key, ca.subject, ca_key, ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH, names=names)
    client = _certificate("test client", client_key, ca.subject, ca_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    paths = {name: directory / f"{prefix}{name}" for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}
    for name, certificate in (("ca.pem", ca), ("server.pem", server), ("client.pem", client)):
        paths[name].write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    _write_key(paths["server.key"], server_key)
    _write_key(paths["client.key"], client_key)
    return {
        "ca": str(paths["ca.pem"]), "cert": str(paths["server.pem"]), "key": str(paths["server.key"]),
        "client_cert": str(paths["client.pem"]), "client_key": str(paths["client.key"]),
    }
