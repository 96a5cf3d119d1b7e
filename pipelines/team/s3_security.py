"""What keeps SeaweedFS's inner ports shut to anyone but itself: ``FOLDER/security.toml`` and its keys.

The store (``weed mini``) binds its master, volume server and filer to 127.0.0.1, and the S3 gateway
(``weed s3``) binds to ``--host``; but the S3 gateway's gRPC port (which accepts identity updates, ``PutIdentity``) always
shares the S3 gateway's address. So every gRPC port speaks mutual TLS: a private CA made here on first
start signs the one certificate every part presents (and its key is then dropped), and a peer without a certificate of that CA is
refused in the handshake. The volume server's and filer's HTTP ports (on 127.0.0.1 only) also require
JWTs signed with keys kept here, and the filer's web UI is off. ``weed`` reads ``security.toml`` from
its working directory, the folder. Every key is in a file of mode 600, made once and kept.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from pathlib import Path

from . import service

SECURITY = "security.toml"
ROLES = ("master", "volume", "filer", "s3", "admin")
COMMON_NAME = "seaweedfs"
JWT = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")


def _names(host: str) -> list:
    from cryptography import x509

    names = {"127.0.0.1", "localhost", host}
    out = []
    for name in sorted(names - {"0.0.0.0", "::", ""}):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def _certificates(tls: Path, host: str) -> None:
    """A CA and the one certificate it signs (server and client use), in ``tls/`` (the key mode 600); the CA's
    key is not kept, so no other certificate can be made for it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def pem_key(key) -> str:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption()).decode()

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = {"not_valid_before": now - datetime.timedelta(days=1), "not_valid_after": now + datetime.timedelta(days=3650)}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "team S3 server CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(valid["not_valid_before"])
          .not_valid_after(valid["not_valid_after"])
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, COMMON_NAME)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
            .add_extension(x509.SubjectAlternativeName(_names(host)), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    service.write_secret(tls / "node.key", pem_key(key))  # the CA's key signs this one certificate and is dropped
    (tls / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tls / "node.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def ensure(folder: Path, host: str) -> Path:
    """``folder/security.toml``, made on first use (with its CA, certificate and JWT keys); its path."""
    path = folder / SECURITY
    tls = folder / "tls"
    if not (tls / "node.crt").is_file():
        _certificates(tls, host)

    def make() -> str:
        lines = [f'[grpc]\nca = "{tls / "ca.crt"}"\n']
        for role in ROLES:
            lines.append(f'[grpc.{role}]\ncert = "{tls / "node.crt"}"\nkey = "{tls / "node.key"}"\n'
                         f'allowed_commonNames = "{COMMON_NAME}"\n')
        lines.append(f'[grpc.client]\ncert = "{tls / "node.crt"}"\nkey = "{tls / "node.key"}"\n')
        for table in JWT:
            lines.append(f'[{table}]\nkey = "{secrets.token_hex(32)}"\nexpires_after_seconds = 10\n')
        lines.append("[access]\nui = false\n")
        return "\n".join(lines)

    service.secret(path, make)
    return path
