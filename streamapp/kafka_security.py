"""A secured Apache Kafka for the project's own broker (issue 21): SASL_SSL with SCRAM-SHA-512,
a CA and broker certificate made for the run, and the KRaft ``StandardAuthorizer``.

:class:`BrokerSecurity` holds what :class:`streamapp.kafka_server.KafkaBroker` needs to start
such a broker: the users and their passwords (SCRAM credentials written into the metadata
when the storage is formatted, ``kafka-storage format --add-scram``), the super user the broker
itself and the admin tools use, and the PEM files. The certificates are made with the
``cryptography`` package's X.509 builder (:func:`make_pki`): a self-signed CA and a broker
certificate it signs for the broker's address. Kafka (since 2.7, KIP-651) reads PEM key stores
directly (``ssl.keystore.type=PEM``), so no PKCS12 or JKS file is written.

The client listener is ``SASL_SSL`` (SCRAM-SHA-512 only), also used between brokers as the super
user. The controller listener (KRaft, loopback) is ``SASL_PLAINTEXT`` with ``PLAIN`` and a
static JAAS user: controllers cannot check SCRAM credentials, which live in the metadata they
serve (Kafka's docs, "KRaft Principal Forwarding"). ``allow.everyone.if.no.acl.found`` stays
false: a user may do only what an ACL grants (:mod:`streamapp.acls`).

Everything here holds passwords in clear: the files are written with mode 0600 and no password
is ever logged (Kafka prints ``[hidden]`` for password properties).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamapp.exceptions import BrokerError

__all__ = [
    "ADMIN_USER",
    "SCRAM_MECHANISM",
    "BrokerSecurity",
    "PkiFiles",
    "load_security",
    "make_pki",
    "secure_setup",
]

#: The super user: the broker between its nodes, and the admin client of the tests and tools.
ADMIN_USER = "admin"
#: The one SASL mechanism of the client listener.
SCRAM_MECHANISM = "SCRAM-SHA-512"
#: Days the run's certificates are valid (a test broker lives minutes).
_VALID_DAYS = 7


@dataclass(frozen=True)
class PkiFiles:
    """The PEM files of one run.

    Attributes:
        ca: The CA certificate (clients' ``ssl_cafile``, the broker's trust store).
        keystore: The broker's private key (PKCS#8, unencrypted) followed by its certificate
            and the CA's (``ssl.keystore.type=PEM``).
    """

    ca: Path
    keystore: Path


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def make_pki(directory: Path, host: str, *, ca_name: str = "streamapp test CA") -> PkiFiles:
    """Make a CA and a broker certificate for ``host`` in ``directory`` (``ca.pem``,
    ``broker-keystore.pem``).

    The broker certificate names ``host`` as its only subject alternative name (an IP address
    or a DNS name): a client that connects by another name fails the host name check, as it
    should. Keys are RSA 2048 bits; certificates are valid for a week.

    Args:
        directory: Where the files go (created when missing).
        host: The address clients connect to, e.g. ``127.0.0.1``.
        ca_name: The CA's common name (a second CA, for tests of an unknown CA, takes another).

    Returns:
        The files.

    Raises:
        BrokerError: The ``cryptography`` package is not installed.
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise BrokerError(
            "A secured Kafka needs the 'cryptography' package for its certificates: pip "
            "install cryptography (make install does)"
        ) from None
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=_VALID_DAYS)

    def key() -> rsa.RSAPrivateKey:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    ca_key, broker_key = key(), key()
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_subject).issuer_name(ca_subject)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    try:
        name: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        name = x509.DNSName(host)
    broker = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kafka {host}")]))
        .issuer_name(ca_subject)
        .public_key(broker_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([name]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = PkiFiles(ca=directory / "ca.pem", keystore=directory / "broker-keystore.pem")
    files.ca.write_bytes(ca.public_bytes(pem))
    _write_private(files.keystore, broker_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption(),
    ) + broker.public_bytes(pem) + ca.public_bytes(pem))
    return files


def _jaas(module: str, username: str, password: str, **users: str) -> str:
    extra = "".join(f' user_{name}="{secret}"' for name, secret in users.items())
    return f'{module} required username="{username}" password="{password}"{extra};'


@dataclass
class BrokerSecurity:
    """SASL_SSL (SCRAM-SHA-512) and ACLs for a :class:`~streamapp.kafka_server.KafkaBroker`.

    Args:
        users: User name -> password of the SCRAM users besides :data:`ADMIN_USER` (e.g. a
            worker and a publisher). Passwords are made of URL-safe characters (the format
            tool's ``--add-scram`` syntax breaks on ``,`` ``]`` and ``=``).
        admin_password: The super user's password; default: a random one.

    Attributes:
        pki: The CA and broker key store, made in the broker's data directory at its first
            start (:meth:`prepare`).
    """

    users: Mapping[str, str] = field(default_factory=dict)
    admin_password: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    pki: PkiFiles | None = None

    def __post_init__(self) -> None:
        for name, password in {ADMIN_USER: self.admin_password, **self.users}.items():
            if not name or not password or any(c in name + password for c in ',]="\' \\'):
                raise BrokerError(
                    f"SCRAM user {name!r}: the name and password must be non-empty and hold "
                    "none of , ] = \" ' \\ or spaces (use secrets.token_urlsafe())"
                )

    @property
    def ca_file(self) -> Path:
        """The CA certificate clients verify the broker with (``ssl_cafile``).

        Raises:
            BrokerError: The broker has not been started yet.
        """
        if self.pki is None:
            raise BrokerError("The secured broker has no certificates yet: call start() first.")
        return self.pki.ca

    def prepare(self, directory: Path, host: str) -> None:
        """Make the certificates in ``directory`` unless they are there from a previous start
        (a kept data directory keeps its CA)."""
        files = PkiFiles(ca=directory / "ca.pem", keystore=directory / "broker-keystore.pem")
        if files.ca.is_file() and files.keystore.is_file():
            self.pki = files
        else:
            self.pki = make_pki(directory, host)

    def scram_arguments(self) -> list[str]:
        """``--add-scram`` arguments of ``kafka-storage format`` for every user."""
        out = []
        for name, password in {ADMIN_USER: self.admin_password, **self.users}.items():
            out += ["--add-scram", f"{SCRAM_MECHANISM}=[name={name},password={password}]"]
        return out

    def properties(self, host: str, port: int, controller_port: int) -> dict[str, str]:
        """The listener, SASL, TLS and authorizer properties of one node.

        Raises:
            BrokerError: :meth:`prepare` has not run.
        """
        if self.pki is None:
            raise BrokerError("BrokerSecurity.prepare() must run before properties().")
        scram = "org.apache.kafka.common.security.scram.ScramLoginModule"
        plain = "org.apache.kafka.common.security.plain.PlainLoginModule"
        mechanism = SCRAM_MECHANISM.lower()
        return {
            "listeners": f"SASL_SSL://{host}:{port},CONTROLLER://{host}:{controller_port}",
            "advertised.listeners": f"SASL_SSL://{host}:{port}",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
            "listener.name.sasl_ssl.sasl.enabled.mechanisms": SCRAM_MECHANISM,
            f"listener.name.sasl_ssl.{mechanism}.sasl.jaas.config": _jaas(
                scram, ADMIN_USER, self.admin_password),
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": _jaas(
                plain, ADMIN_USER, self.admin_password, **{ADMIN_USER: self.admin_password}),
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.pki.keystore),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.pki.ca),
            "ssl.client.auth": "none",
            "ssl.endpoint.identification.algorithm": "https",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{ADMIN_USER}",
            "allow.everyone.if.no.acl.found": "false",
        }

    def client_settings(self, user: str = ADMIN_USER) -> dict[str, Any]:
        """streamapp settings (keyword arguments of :func:`~streamapp.settings.load_settings`)
        for ``user``: SASL_SSL, SCRAM-SHA-512, this run's CA.

        Raises:
            BrokerError: Unknown user, or the broker has not been started.
        """
        password = self.admin_password if user == ADMIN_USER else self.users.get(user)
        if password is None:
            raise BrokerError(f"no SCRAM user {user!r}; known: {ADMIN_USER}, "
                              f"{', '.join(self.users)}")
        return {
            "security_protocol": "SASL_SSL", "sasl_mechanism": SCRAM_MECHANISM,
            "sasl_username": user, "sasl_password": password, "ssl_cafile": self.ca_file,
        }

    def client_options(self, user: str = ADMIN_USER) -> dict[str, Any]:
        """aiokafka keyword arguments for ``user`` (what
        :func:`streamapp.kafka.kafka_security_options` makes of :meth:`client_settings`).

        Raises:
            BrokerError: Unknown user, or the broker has not been started.
        """
        given = self.client_settings(user)
        return {
            "security_protocol": "SASL_SSL", "sasl_mechanism": SCRAM_MECHANISM,
            "sasl_plain_username": user, "sasl_plain_password": given["sasl_password"],
            "ssl_context": ssl.create_default_context(cafile=str(given["ssl_cafile"])),
        }

    def __repr__(self) -> str:  # no passwords
        return f"BrokerSecurity(users={sorted(self.users)}, pki={self.pki})"


#: Users ``streamapp broker --kafka --secure`` creates besides the admin.
CLI_USERS = ("worker", "publisher")
_SAVED = "security.json"


def load_security(data_dir: Path | None) -> BrokerSecurity:
    """The users of ``streamapp broker --kafka --secure``: those saved in ``data_dir`` by an
    earlier run (their SCRAM credentials are in its formatted storage), else new random ones.

    Raises:
        BrokerError: The saved file cannot be read.
    """
    saved = data_dir / _SAVED if data_dir is not None else None
    if saved is not None and saved.is_file():
        try:
            fields = json.loads(saved.read_text())
            return BrokerSecurity(users=fields["users"], admin_password=fields["admin"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BrokerError(
                f"{saved} cannot be read ({type(exc).__name__}); the broker's SCRAM users are "
                "in it: restore it, or start with a new --data-dir"
            ) from None
    return BrokerSecurity(users={u: secrets.token_urlsafe(18) for u in CLI_USERS})


def secure_setup(kafka: Any) -> dict[str, Path]:
    """After a secured broker started: save its users (``security.json``), create the topics of
    the configured app (``STREAMAPP_APP_ID``, ``STREAMAPP_TOPIC_PREFIX``), grant the worker and
    publisher ACLs, and write each user's client settings to ``client-<user>.env`` (all mode
    0600) in the broker's data directory.

    Returns:
        User -> its ``.env`` file.

    Raises:
        BrokerError: The topics or ACLs could not be created, or the settings are invalid.
    """
    from streamapp.acls import create_acls, publisher_acls, worker_acls
    from streamapp.exceptions import StreamAppError
    from streamapp.kafka import create_topics, run_sync
    from streamapp.partitions import TABLE_NAMES, changelog_topic
    from streamapp.settings import load_settings

    security: BrokerSecurity = kafka.security
    directory: Path = kafka.data_dir
    try:
        settings = load_settings()
    except StreamAppError as exc:
        raise BrokerError(str(exc)) from None
    _write_private(directory / _SAVED, json.dumps(
        {"users": dict(security.users), "admin": security.admin_password}).encode())
    admin = security.client_options()
    changelogs = [changelog_topic(settings.app_id, t) for t in TABLE_NAMES]
    create_topics(
        kafka.bootstrap_servers,
        dict.fromkeys([*settings.topics, *changelogs], settings.topic_partitions),
        security=admin,
        configs={n: {"cleanup.policy": "compact", **settings.changelog_topic_configs}
                 for n in changelogs},
    )
    run_sync(lambda: create_acls(
        kafka.bootstrap_servers,
        worker_acls(settings, "worker") + publisher_acls(settings, "publisher"),
        security=admin))
    files = {}
    for user in (ADMIN_USER, *security.users):
        given = {"broker": kafka.url, **security.client_settings(user)}
        path = directory / f"client-{user}.env"
        _write_private(path, "".join(
            f"STREAMAPP_{k.upper()}={v}\n" for k, v in given.items()).encode())
        files[user] = path
    return files
