"""Self-signed test PKI for TLS tests, made at test time with ``cryptography`` (no network, no files kept).

:func:`make_pki` builds a CA, a server certificate for ``127.0.0.1`` (an IP
subjectAltName, so hostname checking stays on), a client certificate, and a
second, unrelated CA with its own server and client certificates (what an
untrusted peer presents). :func:`server_context` / :func:`client_context`
turn them into ``ssl.SSLContext`` objects the way a user would.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import ssl
import tempfile

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCALHOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Identity:
    """PEM bytes of one certificate and its key."""

    cert: bytes
    key: bytes


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: bytes
    server: Identity
    client: Identity


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _issue(ca_key: ec.EllipticCurvePrivateKey, ca_name: x509.Name, common_name: str, *, server: bool) -> Identity:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(LOCALHOST))]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return Identity(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def make_pki(label: str = "aio_datadist test") -> Pki:
    """A fresh CA with one server (127.0.0.1) and one client certificate."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_name = _name(f"{label} CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    return Pki(ca.public_bytes(serialization.Encoding.PEM), _issue(ca_key, ca_name, f"{label} server", server=True),
               _issue(ca_key, ca_name, f"{label} client", server=False))


def _load_chain(context: ssl.SSLContext, identity: Identity) -> None:
    # load_cert_chain reads files only; the files live for this call and are gone after it.
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        with open(cert, "wb") as f:
            f.write(identity.cert)
        with open(key, "wb") as f:
            f.write(identity.key)
        context.load_cert_chain(cert, key)


def server_context(pki: Pki, *, require_client_cert: bool = True, trust: bytes | None = None) -> ssl.SSLContext:
    """A listening endpoint's context: presents ``pki.server``; with ``require_client_cert`` (mutual TLS)
    accepts only clients whose certificate ``trust`` (default: ``pki.ca``) signed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(context, pki.server)
    if require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=(trust or pki.ca).decode())
    return context


def client_context(pki: Pki, *, trust: bytes | None = None, present_cert: bool = True) -> ssl.SSLContext:
    """A dialling endpoint's context: trusts ``trust`` (default ``pki.ca``), checks the server's IP
    against its certificate, and presents ``pki.client`` when ``present_cert``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=(trust or pki.ca).decode())
    if present_cert:
        _load_chain(context, pki.client)
    return context
