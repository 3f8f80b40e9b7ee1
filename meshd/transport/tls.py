"""TLS 1.3 contexts whose certificate key is the peer's Ed25519 identity key.

Certificates are self-signed and made fresh at start: nobody checks a chain or a validity period,
the client checks that the certificate's key derives the peer id it dialled (TLS CertificateVerify
has already proved the server holds that key). The validity window only keeps TLS stacks happy.
"""

from __future__ import annotations

import datetime
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from meshd.identity import Identity, peer_id_from_public_key
from meshd.transport.errors import PeerAuthError

ALPN = "h2"
CERT_VALIDITY = datetime.timedelta(days=1)
CERT_BACKDATE = datetime.timedelta(hours=1)


@dataclass(frozen=True)
class Certificate:
    der: bytes
    cert_pem: bytes
    key_pem: bytes


def make_certificate(identity: Identity, *, now: datetime.datetime | None = None) -> Certificate:
    """A self-signed certificate for the identity key, CN = peer id."""
    key = Ed25519PrivateKey.from_private_bytes(identity.seed)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.peer_id)])
    now = now or datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CERT_BACKDATE)
        .not_valid_after(now + CERT_VALIDITY)
        .sign(key, algorithm=None)
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return Certificate(
        der=cert.public_bytes(serialization.Encoding.DER),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key_pem,
    )


def server_context(certificate: Certificate) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols([ALPN])
    ctx.num_tickets = 0  # no resumption: every connection shows the certificate again
    # ssl only loads keys from files; keep them in a private temporary directory for the call.
    with tempfile.TemporaryDirectory(prefix="meshd-tls-") as tmp:
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_path.write_bytes(certificate.cert_pem)
        key_path.touch(mode=0o600)
        key_path.write_bytes(certificate.key_pem)
        ctx.load_cert_chain(cert_path, key_path)
    return ctx


def client_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols([ALPN])
    # No CA can vouch for a self-signed peer key; the key is checked against the peer id instead.
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def peer_id_from_certificate(der: bytes | None) -> str:
    """The peer id named by a certificate's Ed25519 key; ``PeerAuthError`` for anything else."""
    if not der:
        raise PeerAuthError("peer presented no TLS certificate")
    try:
        public_key = x509.load_der_x509_certificate(der).public_key()
    except ValueError as exc:
        raise PeerAuthError(f"peer's TLS certificate does not parse: {exc}") from exc
    if not isinstance(public_key, Ed25519PublicKey):
        raise PeerAuthError(f"peer's TLS certificate key is {type(public_key).__name__}, not Ed25519")
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return peer_id_from_public_key(raw)
