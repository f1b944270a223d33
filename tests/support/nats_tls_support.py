"""Test certificates for NATS TLS: a CA, a server certificate for 127.0.0.1, client certs.

Made with ``cryptography`` at test time (nothing secret is committed)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TLSFiles:
    ca: str  # CA certificate (signs server and client certs)
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    rogue_ca: str  # an unrelated CA
    rogue_client_cert: str  # signed by the rogue CA
    rogue_client_key: str


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer else (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


def make_tls_files(folder: Path) -> TLSFiles:
    """Write a CA, a server cert/key for 127.0.0.1, a client cert/key, and a rogue CA's client
    cert/key under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, rogue_key = _key(), _key()
    ca = _cert("wavepp-test-ca", ca_key, None, ca=True)
    rogue = _cert("rogue-ca", rogue_key, None, ca=True)
    _write(folder / "ca", ca, None)
    _write(folder / "rogue-ca", rogue, None)
    server_key, client_key, rogue_client_key = _key(), _key(), _key()
    _write(
        folder / "server", _cert("nats", server_key, (ca.subject, ca_key), server=True), server_key
    )
    _write(folder / "client", _cert("stage", client_key, (ca.subject, ca_key)), client_key)
    _write(
        folder / "rogue-client",
        _cert("intruder", rogue_client_key, (rogue.subject, rogue_key)),
        rogue_client_key,
    )
    f = {
        name: str(folder / name) for name in ("ca", "rogue-ca", "server", "client", "rogue-client")
    }
    return TLSFiles(
        ca=f["ca"] + ".crt",
        server_cert=f["server"] + ".crt",
        server_key=f["server"] + ".key",
        client_cert=f["client"] + ".crt",
        client_key=f["client"] + ".key",
        rogue_ca=f["rogue-ca"] + ".crt",
        rogue_client_cert=f["rogue-client"] + ".crt",
        rogue_client_key=f["rogue-client"] + ".key",
    )
