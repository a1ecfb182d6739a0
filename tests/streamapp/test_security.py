"""Security settings reach Faust and aiokafka: SASL (PLAIN, SCRAM) and TLS options map to
``broker_credentials`` and to the aiokafka keyword arguments; bad combinations and unusable files
are refused with the setting named; passwords are never printed. No broker needed."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import faust
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth
from pydantic import ValidationError
from typer.testing import CliRunner

from streamapp.app import faust_options
from streamapp.cli import cli
from streamapp.exceptions import ConfigError
from streamapp.kafka import kafka_security_options, ssl_context
from streamapp.settings import Settings, load_settings

SECRET = "hunter2-secret"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("STREAMAPP_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A self-signed CA/server certificate, a client certificate with a plain key, and one with
    an encrypted key (password ``SECRET``), made with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    d = tmp_path_factory.mktemp("pki")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "2", "-subj", "/CN=streamapp-test-ca")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out",
            "client.pem", "-days", "2", "-subj", "/CN=streamapp-client")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-keyout", "locked.key", "-passout",
            f"pass:{SECRET}", "-out", "locked.pem", "-days", "2", "-subj", "/CN=locked")
    (d / "garbage.pem").write_text("not a certificate\n")
    return {p.stem + p.suffix.replace(".", "_"): p for p in d.iterdir()}


# -- PLAINTEXT ------------------------------------------------------------------------------------


def test_plaintext_is_the_default_and_adds_nothing() -> None:
    settings = load_settings()

    assert settings.security_protocol == "PLAINTEXT"
    assert "broker_credentials" not in faust_options(settings)
    assert kafka_security_options(settings) == {"security_protocol": "PLAINTEXT"}
    assert ssl_context(settings) is None


def test_web_server_binds_loopback_unless_told() -> None:
    assert faust_options(load_settings())["web_bind"] == "127.0.0.1"
    assert faust_options(load_settings(web_bind="0.0.0.0"))["web_bind"] == "0.0.0.0"


# -- SASL -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_plaintext(mechanism: str) -> None:
    settings = load_settings(
        security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism, sasl_username="svc",
        sasl_password=SECRET,
    )

    credentials = faust_options(settings)["broker_credentials"]
    ours = kafka_security_options(settings)

    assert isinstance(credentials, faust.SASLCredentials)
    assert credentials.protocol.value == "SASL_PLAINTEXT"
    assert credentials.mechanism.value == mechanism
    assert (credentials.username, credentials.password) == ("svc", SECRET)
    assert credentials.ssl_context is None
    assert ours == {
        "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": mechanism,
        "sasl_plain_username": "svc", "sasl_plain_password": SECRET,
    }
    # What Faust gives its own aiokafka clients is what we give ours.
    faust_kwargs = credentials_to_aiokafka_auth(credentials)
    assert {k: v for k, v in faust_kwargs.items() if k != "ssl_context"} == ours
    assert SECRET not in repr(credentials)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-512"])
def test_sasl_ssl_uses_a_verifying_tls_context(mechanism: str, pki: dict[str, Path]) -> None:
    settings = load_settings(
        security_protocol="SASL_SSL", sasl_mechanism=mechanism, sasl_username="svc",
        sasl_password=SECRET, ssl_cafile=pki["ca_pem"],
    )

    credentials = faust_options(settings)["broker_credentials"]
    ours = kafka_security_options(settings)

    assert isinstance(credentials, faust.SASLCredentials)
    assert credentials.protocol.value == "SASL_SSL"
    context = credentials.ssl_context
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [c["subject"] for c in context.get_ca_certs()] == [
        ((("commonName", "streamapp-test-ca"),),)
    ]
    assert ours["security_protocol"] == "SASL_SSL"
    assert ours["sasl_mechanism"] == mechanism and ours["sasl_plain_password"] == SECRET
    assert isinstance(ours["ssl_context"], ssl.SSLContext)
    faust_kwargs = credentials_to_aiokafka_auth(credentials)
    assert faust_kwargs["security_protocol"] == "SASL_SSL"
    assert faust_kwargs["ssl_context"] is context


# -- SSL ------------------------------------------------------------------------------------------


def test_ssl_with_ca_and_client_certificate(pki: dict[str, Path]) -> None:
    settings = load_settings(
        security_protocol="SSL", ssl_cafile=pki["ca_pem"], ssl_certfile=pki["client_pem"],
        ssl_keyfile=pki["client_key"],
    )

    credentials = faust_options(settings)["broker_credentials"]
    ours = kafka_security_options(settings)

    assert isinstance(credentials, faust.SSLCredentials)
    assert credentials.protocol.value == "SSL"
    assert credentials.context.verify_mode == ssl.CERT_REQUIRED
    assert credentials_to_aiokafka_auth(credentials) == {
        "security_protocol": "SSL", "ssl_context": credentials.context,
    }
    assert set(ours) == {"security_protocol", "ssl_context"}
    assert ours["security_protocol"] == "SSL"


def test_ssl_without_cafile_uses_the_system_trust_store() -> None:
    context = ssl_context(load_settings(security_protocol="SSL"))

    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname


def test_ssl_check_hostname_can_be_turned_off() -> None:
    context = ssl_context(load_settings(security_protocol="SSL", ssl_check_hostname=False))

    assert context is not None
    assert not context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED


def test_encrypted_client_key(pki: dict[str, Path]) -> None:
    base: dict[str, Any] = {"security_protocol": "SSL", "ssl_certfile": pki["locked_pem"],
                            "ssl_keyfile": pki["locked_key"]}

    assert ssl_context(load_settings(**base, ssl_key_password=SECRET)) is not None
    with pytest.raises(ConfigError, match="ssl_key_password") as info:
        ssl_context(load_settings(**base, ssl_key_password="wrong"))
    assert SECRET not in str(info.value) and "wrong" not in str(info.value)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"ssl_cafile": "missing.pem"}, "ssl_cafile"),
        ({"ssl_cafile": "garbage_pem"}, "ssl_cafile"),
        ({"ssl_certfile": "missing.pem"}, "ssl_certfile"),
        ({"ssl_certfile": "garbage_pem"}, "ssl_certfile"),
    ],
    ids=["cafile-missing", "cafile-garbage", "certfile-missing", "certfile-garbage"],
)
def test_unusable_tls_files_name_the_setting(
    pki: dict[str, Path], settings: dict[str, str], named: str
) -> None:
    resolved = {k: pki.get(v, pki["ca_pem"].parent / v) for k, v in settings.items()}
    loaded = load_settings(security_protocol="SSL", **resolved)

    with pytest.raises(ConfigError, match=named):
        faust_options(loaded)
    with pytest.raises(ConfigError, match=named):
        kafka_security_options(loaded)


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"security_protocol": "SASL_SSL"}, "sasl_username and sasl_password"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_username": "u"}, "sasl_password"),
        ({"sasl_username": "u", "sasl_password": "p"}, "security_protocol is PLAINTEXT"),
        ({"security_protocol": "SSL", "sasl_password": "p"}, "use SASL_SSL"),
        ({"ssl_cafile": "ca.pem"}, "ssl_cafile set but security_protocol is PLAINTEXT"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_username": "u", "sasl_password": "p",
          "ssl_certfile": "c.pem"}, "ssl_certfile"),
        ({"security_protocol": "SSL", "ssl_keyfile": "k.pem"}, "without ssl_certfile"),
        ({"security_protocol": "TLS"}, "security_protocol"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI", "sasl_username": "u",
          "sasl_password": "p"}, "sasl_mechanism"),
    ],
    ids=["sasl-no-credentials", "sasl-no-password", "credentials-plaintext",
         "credentials-ssl", "cafile-plaintext", "certfile-sasl-plaintext", "key-without-cert",
         "bad-protocol", "bad-mechanism"],
)
def test_invalid_security_settings(settings: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_settings(**settings)


def test_security_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMAPP_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("STREAMAPP_SASL_MECHANISM", "SCRAM-SHA-256")
    monkeypatch.setenv("STREAMAPP_SASL_USERNAME", "svc")
    monkeypatch.setenv("STREAMAPP_SASL_PASSWORD", SECRET)

    settings = load_settings()

    assert settings.sasl_password.get_secret_value() == SECRET
    assert kafka_security_options(settings)["sasl_mechanism"] == "SCRAM-SHA-256"


# -- secrets stay secret --------------------------------------------------------------------------


def test_passwords_are_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMAPP_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("STREAMAPP_SASL_USERNAME", "svc")
    monkeypatch.setenv("STREAMAPP_SASL_PASSWORD", SECRET)
    monkeypatch.setenv("STREAMAPP_SSL_KEY_PASSWORD", SECRET + "-key")

    result = CliRunner().invoke(cli, ["settings"])

    assert result.exit_code == 0, result.output
    assert SECRET not in result.output
    assert '"sasl_password": "**********"' in result.output
    assert '"sasl_username": "svc"' in result.output
    settings = load_settings()
    assert SECRET not in repr(settings) and SECRET not in str(settings)


def test_validation_errors_do_not_echo_the_password() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(sasl_username="u", sasl_password=SECRET)
    assert SECRET not in str(info.value) and SECRET not in str(info.value.__cause__)
    with pytest.raises(ValidationError) as raw:
        Settings(sasl_username="u", sasl_password=SECRET)  # type: ignore[call-arg]
    assert SECRET not in str(raw.value)


def test_reference_shows_no_secret_default() -> None:
    result = CliRunner().invoke(cli, ["settings", "--reference"])

    assert "| `STREAMAPP_SASL_PASSWORD` | SecretStr | `` |" in result.output


# -- the options work with real clients and a real Faust app --------------------------------------


async def test_aiokafka_clients_accept_the_options(pki: dict[str, Path]) -> None:
    for settings in [
        load_settings(),
        load_settings(security_protocol="SSL", ssl_cafile=pki["ca_pem"]),
        load_settings(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                      sasl_username="u", sasl_password=SECRET),
        load_settings(security_protocol="SASL_PLAINTEXT", sasl_username="u",
                      sasl_password=SECRET),
    ]:
        options = kafka_security_options(settings)
        producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", **options)
        consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1", **options)
        assert producer.client._security_protocol == settings.security_protocol
        assert consumer._client._security_protocol == settings.security_protocol
        await producer.stop()
        await consumer.stop()


def test_faust_app_takes_the_credentials() -> None:
    settings = load_settings(
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256", sasl_username="u",
        sasl_password=SECRET,
    )

    app = faust.App("security-test", **faust_options(settings))

    credentials = app.conf.broker_credentials
    assert isinstance(credentials, faust.SASLCredentials)
    assert credentials_to_aiokafka_auth(credentials, app.conf.ssl_context) == {
        "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "u", "sasl_plain_password": SECRET, "ssl_context": None,
    }
