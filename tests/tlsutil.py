"""
A throwaway certificate authority for TLS tests, made with C{cryptography}:
a CA, and server certificates it signs for the names and addresses a test
asks for, written as PEM files.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "KCoral tests"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@attrs.frozen
class Issued:
    """A server certificate and its key, as PEM files."""

    cert: str
    key: str

    def options(self) -> list[str]:
        return ["--tls-cert", self.cert, "--tls-key", self.key]


class TestCA:
    """
    A CA whose certificate lives at L{path}; L{issue} signs server
    certificates. With a C{parent}, an intermediate CA signed by it: the
    certificates it issues are written followed by the intermediates.
    """

    __test__ = False  # not a test class, whatever its name

    def __init__(self, directory: Path, name: str = "KCoral test CA", parent: TestCA | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        public = self._key.public_key()
        issuer = parent.cert.subject if parent is not None else _name(name)
        signer = parent._key if parent is not None else self._key
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(name)).issuer_name(issuer)
            .public_key(public).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False))
        if parent is not None:
            builder = builder.add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(parent._key.public_key()),
                critical=False)
        self.cert = builder.sign(signer, hashes.SHA256())
        #: The intermediates a server sends after its own certificate.
        self.intermediates = ([self.cert] + parent.intermediates) if parent is not None else []
        self.path = str(self.directory / "ca.pem")
        Path(self.path).write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, label: str, *, dns: tuple[str, ...] = ("localhost",),
              ips: tuple[str, ...] = ("127.0.0.1",), client: bool = False) -> Issued:
        """A server certificate for C{dns} names and C{ips} addresses; with
        C{client}, for a client too (mutual TLS)."""
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        names = [x509.DNSName(n) for n in dns] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(dns[0] if dns else ips[0])).issuer_name(self.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False,
                                         content_commitment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False, crl_sign=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                           critical=False)
            .sign(self._key, hashes.SHA256()))
        cert_path = self.directory / f"{label}.pem"
        key_path = self.directory / f"{label}.key"
        cert_path.write_bytes(b"".join(c.public_bytes(serialization.Encoding.PEM)
                                       for c in [cert] + self.intermediates))
        key_path.write_bytes(_pem_key(key))
        key_path.chmod(0o600)
        return Issued(str(cert_path), str(key_path))

    def client_context(self, certificate: Issued | None = None) -> ssl.SSLContext:
        """What a client that trusts this CA (and only it) uses, presenting
        C{certificate} if given."""
        context = ssl.create_default_context(cafile=self.path)
        if certificate is not None:
            context.load_cert_chain(certificate.cert, certificate.key)
        return context
