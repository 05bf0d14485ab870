"""The throw-away PKI of one e2e control plane: a CA, serving and client certificates, and
the service-account signing key, written as PEM files into the control plane's work dir."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough for any test session, short enough that a leaked key is worthless soon.
_VALIDITY = datetime.timedelta(days=2)


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: KeyPair
    apiserver: KeyPair
    admin: KeyPair
    controller_manager: KeyPair
    # The service-account token signing key; the public half verifies tokens.
    service_account_key: Path
    service_account_public_key: Path
    # Only with a real node (build_pki(node=...)).
    node: NodePki | None = None


@dataclass(frozen=True)
class NodeIdentity:
    name: str
    ip: str


@dataclass(frozen=True)
class NodePki:
    # The kubelet's client certificate (user system:node:<name>, group system:nodes).
    kubelet_client: KeyPair
    # The kubelet's serving certificate, so the API server can reach it for logs and exec.
    kubelet_serving: KeyPair
    # What the API server presents to the kubelet (group system:masters).
    apiserver_kubelet_client: KeyPair
    scheduler: KeyPair
    # User system:kube-proxy: the bootstrap policy binds it to system:node-proxier.
    kube_proxy: KeyPair


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256 keys are generated in microseconds; RSA would cost seconds on 2 cores.
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization is not None:
        # Kubernetes reads a client certificate's O as the user's groups.
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _issue(
    *,
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    is_ca: bool,
    usages: list[x509.ObjectIdentifier],
    sans: list[x509.GeneralName],
    validity: datetime.timedelta = _VALIDITY,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=not is_ca,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=is_ca,
                crl_sign=is_ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_pair(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> KeyPair:
    pair = KeyPair(cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, pair.key)
    return pair


def build_pki(directory: Path, *, service_ip: str, node: NodeIdentity | None = None) -> Pki:
    """Write a fresh CA and every certificate the control plane needs into `directory`.

    `service_ip` is the ClusterIP of the `kubernetes` Service; it is in the serving
    certificate as a real cluster's is; with a real `node`, pods reach the API
    server through it, and the node's address is in the certificate too.
    """
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _new_key()
    ca_name = _name("shardq-e2e-ca")
    ca_cert = _issue(
        subject=ca_name,
        key=ca_key,
        issuer=ca_name,
        issuer_key=ca_key,
        is_ca=True,
        usages=[],
        sans=[],
    )
    ca = _write_pair(directory, "ca", ca_cert, ca_key)

    def leaf(
        stem: str,
        subject: x509.Name,
        usage: x509.ObjectIdentifier,
        sans: list[x509.GeneralName],
    ) -> KeyPair:
        key = _new_key()
        cert = _issue(
            subject=subject,
            key=key,
            issuer=ca_name,
            issuer_key=ca_key,
            is_ca=False,
            usages=[usage],
            sans=sans,
        )
        return _write_pair(directory, stem, cert, key)

    serving_sans: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address(service_ip)),
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"),
        x509.DNSName("kubernetes.default.svc.cluster.local"),
    ]
    if node is not None:
        serving_sans.append(x509.IPAddress(ipaddress.ip_address(node.ip)))
    apiserver = leaf(
        "apiserver",
        _name("kube-apiserver"),
        ExtendedKeyUsageOID.SERVER_AUTH,
        serving_sans,
    )
    admin = leaf(
        "admin",
        _name("shardq-e2e-admin", "system:masters"),
        ExtendedKeyUsageOID.CLIENT_AUTH,
        [],
    )
    # The user name the bootstrap RBAC policy grants the controller manager's own rights to.
    controller_manager = leaf(
        "controller-manager",
        _name("system:kube-controller-manager"),
        ExtendedKeyUsageOID.CLIENT_AUTH,
        [],
    )

    sa_key = _new_key()
    service_account_key = directory / "service-account.key"
    _write_key(sa_key, service_account_key)
    service_account_public_key = directory / "service-account.pub"
    service_account_public_key.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    node_pki = None
    if node is not None:
        node_pki = NodePki(
            kubelet_client=leaf(
                "kubelet-client",
                _name(f"system:node:{node.name}", "system:nodes"),
                ExtendedKeyUsageOID.CLIENT_AUTH,
                [],
            ),
            kubelet_serving=leaf(
                "kubelet-serving",
                _name(node.name),
                ExtendedKeyUsageOID.SERVER_AUTH,
                [x509.IPAddress(ipaddress.ip_address(node.ip)), x509.DNSName(node.name)],
            ),
            apiserver_kubelet_client=leaf(
                "apiserver-kubelet-client",
                _name("kube-apiserver-kubelet-client", "system:masters"),
                ExtendedKeyUsageOID.CLIENT_AUTH,
                [],
            ),
            scheduler=leaf("scheduler", _name("system:kube-scheduler"), ExtendedKeyUsageOID.CLIENT_AUTH, []),
            kube_proxy=leaf("kube-proxy", _name("system:kube-proxy"), ExtendedKeyUsageOID.CLIENT_AUTH, []),
        )
    return Pki(
        node=node_pki,
        ca=ca,
        apiserver=apiserver,
        admin=admin,
        controller_manager=controller_manager,
        service_account_key=service_account_key,
        service_account_public_key=service_account_public_key,
    )


@dataclass(frozen=True)
class ServingCertificates:
    """A CA and one serving certificate it signed, as PEM files (what a
    `kubernetes.io/tls` Secret holds: ca.crt, tls.crt, tls.key)."""

    ca: Path
    cert: Path
    key: Path


def issue_serving_certificates(
    directory: Path,
    *,
    dns_names: list[str],
    ip_addresses: list[str] = [],  # noqa: B006 - never mutated
    ca_name: str = "shardq-test-ca",
    stem: str = "server",
    validity: datetime.timedelta = _VALIDITY,
) -> ServingCertificates:
    """Write a fresh CA and a serving certificate for `dns_names` (wildcards allowed) and
    `ip_addresses`, valid for `validity` from now, into `directory`. A second call with
    the same directory and another `stem` makes a second pair under a new CA (a rotation,
    or a CA nobody trusts)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _new_key()
    ca_subject = _name(ca_name)
    ca_cert = _issue(
        subject=ca_subject, key=ca_key, issuer=ca_subject, issuer_key=ca_key, is_ca=True, usages=[], sans=[]
    )
    ca = _write_pair(directory, f"{stem}-ca", ca_cert, ca_key)
    return _issue_serving(
        directory, ca=ca, dns_names=dns_names, ip_addresses=ip_addresses, stem=stem, validity=validity
    )


def not_valid_after(cert: Path) -> float:
    """When the PEM certificate in `cert` expires, in Unix seconds."""
    return x509.load_pem_x509_certificate(cert.read_bytes()).not_valid_after_utc.timestamp()


def renew_serving_certificate(
    issued: ServingCertificates,
    *,
    dns_names: list[str],
    ip_addresses: list[str] = [],  # noqa: B006 - never mutated
    stem: str,
    validity: datetime.timedelta = _VALIDITY,
) -> ServingCertificates:
    """A new key and certificate for `dns_names` and `ip_addresses` from the CA that signed
    `issued` (what a cert-manager renewal writes: ca.crt unchanged), written beside it
    under `stem`."""
    ca = KeyPair(cert=issued.ca, key=issued.ca.with_suffix(".key"))
    return _issue_serving(
        issued.ca.parent, ca=ca, dns_names=dns_names, ip_addresses=ip_addresses, stem=stem, validity=validity
    )


def _issue_serving(
    directory: Path,
    *,
    ca: KeyPair,
    dns_names: list[str],
    ip_addresses: list[str],
    stem: str,
    validity: datetime.timedelta,
) -> ServingCertificates:
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_subject = ca_cert.subject
    key = _new_key()
    sans: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(address)) for address in ip_addresses]
    cert = _issue(
        subject=_name(dns_names[0] if dns_names else ip_addresses[0]),
        key=key,
        issuer=ca_subject,
        issuer_key=ca_key,
        is_ca=False,
        # Both: the servers present it to clients, and to each other.
        usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        sans=sans,
        validity=validity,
    )
    pair = _write_pair(directory, stem, cert, key)
    return ServingCertificates(ca=ca.cert, cert=pair.cert, key=pair.key)
