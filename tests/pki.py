"""A throwaway PKI for the TLS tests (redis with client certificates, s3 over https).

One CA and two leaf certificates, ECDSA P-256, valid for a day: a server
certificate for ``localhost``/``127.0.0.1`` and a client certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Any


def make_pki(d: Path) -> dict[str, str]:
    """Write ca.pem, server.pem/.key, client.pem/.key under ``d``; return paths by role."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key: Any, path: Path) -> None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("kvstore test CA"))
          .issuer_name(name("kvstore test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(cn: str, usage: Any, san: bool) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                 ca_key.public_key()), critical=False))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        (d / f"{cn}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(key, d / f"{cn}.key")

    leaf("server", ExtendedKeyUsageOID.SERVER_AUTH, san=True)
    leaf("client", ExtendedKeyUsageOID.CLIENT_AUTH, san=False)
    return {k: str(d / v) for k, v in {
        "ca": "ca.pem", "server_cert": "server.pem", "server_key": "server.key",
        "client_cert": "client.pem", "client_key": "client.key"}.items()}
