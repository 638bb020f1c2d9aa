"""The run's own certificate authority: `megaheal run` makes one per run and issues the healer and each host a
certificate naming it (ground/tls.py says how they are used). Nothing outside the run is trusted, and nothing
inside it needs a site's PKI.

    <run_dir>/launcher/tls/ca.pem, ca.key     the authority (its key stays in the healer's directory)
    <run_dir>/launcher/tls/healer/            the healer's ca.pem, cert.pem, key.pem
    <run_dir>/launcher/tls/hosts/NODE/        each host's, read by its agent (`megaheal agent --tls-dir`)

Keys are EC P-256 (fast to make: a host's certificate costs about a millisecond), written 0600 through
ground/secretfile.py. A healer that takes the run over finds the authority and issues from it again.

NOTE: the run directory is on a filesystem every host shares, so a host's key can be read there by the job's own
user on any host. The certificates bind batches and orders to hosts against other users and the network, not
against the job's own code, which runs as that user on every host anyway (docs/operations.md, "Security").
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ground.names import check_name, name_path
from ground.secretfile import read_secret, replace_private
from ground.tls import ROLES, Identity, TlsFiles

VALID_FOR = datetime.timedelta(days=400)
"""A run may last months; the authority and every certificate outlive it (a take-over reissues the hosts')."""


@dataclass(frozen=True, slots=True)
class RunAuthority:
    directory: Path

    @classmethod
    def of_run(cls, launcher_dir: Path) -> RunAuthority:
        """The run's authority under its launcher directory: made on first use, found again after."""
        authority = cls(launcher_dir / "tls")
        if not (authority.ca_cert.is_file() and authority.ca_key.is_file()):
            authority._create()
        return authority

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    def healer(self) -> TlsFiles:
        """The healer's files: issued once per run, the same for a healer that takes the run over."""
        files = TlsFiles(self.directory / "healer")
        if all(p.is_file() for p in (files.ca, files.cert, files.key)):
            return files
        return self.issue(Identity("healer", "healer"), files.directory)

    def host(self, node: str) -> TlsFiles:
        return self.issue(Identity("host", check_name(node, "node")), name_path(self.directory / "hosts", node))

    def relay(self, name: str) -> TlsFiles:
        return self.issue(Identity("relay", check_name(name, "relay")), name_path(self.directory / "relays", name))

    def issue(self, who: Identity, directory: Path) -> TlsFiles:
        """A new key and certificate for `who` in `directory` (what was there is replaced), with the CA beside."""
        if who.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {who.role!r}")
        ca_cert = x509.load_pem_x509_certificate(self.ca_cert.read_bytes())
        ca_key = serialization.load_pem_private_key(read_secret(self.ca_key, "run CA key", private=True).encode(),
                                                    password=None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "megaheal run"),
                                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, who.role),
                                         x509.NameAttribute(NameOID.COMMON_NAME, who.name[:64])]))
                .issuer_name(ca_cert.subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))  # NOTE: hosts' clocks differ a little
                .not_valid_after(now + VALID_FOR)
                .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(who.urn)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        files = TlsFiles(directory)
        replace_private(files.key, _pem_key(key))
        replace_private(files.cert, cert.public_bytes(serialization.Encoding.PEM).decode())
        replace_private(files.ca, self.ca_cert.read_text())
        return files

    def _create(self) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "megaheal run"),
                          x509.NameAttribute(NameOID.COMMON_NAME, "megaheal run authority")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID_FOR)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        replace_private(self.ca_key, _pem_key(key))
        replace_private(self.ca_cert, cert.public_bytes(serialization.Encoding.PEM).decode())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()
