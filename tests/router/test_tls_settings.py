"""TLS settings and files: the config's pairing rules, and each bad file named at load, not at a handshake."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from tls_certs import Pki, replace

from switchyard.router.config import ConfigError, build
from switchyard.tls import ClientTls, ServerTls, TlsError


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"server": {"tls_cert": "c.pem"}}, "server.tls_cert and server.tls_key go together"),
        ({"server": {"tls_key": "k.pem"}}, "server.tls_cert and server.tls_key go together"),
        ({"server": {"tls_client_ca": "ca.pem"}}, "needs server.tls_cert"),
        ({"server": {"metrics_tls": True}}, "server.metrics_tls serves the metrics with server.tls_cert"),
        ({"workers": {"tls_ca": "ca.pem"}}, "set workers.tls = true"),
        ({"workers": {"tls": True, "tls_cert": "c.pem"}}, "workers.tls_cert and workers.tls_key go together"),
    ],
)
def test_half_a_tls_setting_is_a_config_error(data: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=message):
        build(data)


def test_tls_settings_make_the_credentials_objects(pki: Pki) -> None:
    cfg = build({
        "server": {"tls_cert": pki.server_cert, "tls_key": pki.server_key, "tls_client_ca": pki.ca},
        "workers": {"tls": True, "tls_ca": pki.ca, "tls_cert": pki.client_cert, "tls_key": pki.client_key,
                    "tls_server_name": "localhost"},
    })
    assert cfg.server.tls() == ServerTls(pki.server_cert, pki.server_key, pki.ca)
    assert isinstance(cfg.server.tls().credentials(), grpc.ServerCredentials)
    client = cfg.workers.client_tls()
    assert client == ClientTls(pki.ca, pki.client_cert, pki.client_key, "localhost")
    assert isinstance(client.credentials, grpc.ChannelCredentials)
    assert client.options() == [("grpc.ssl_target_name_override", "localhost")]
    plain = build({})
    assert plain.server.tls() is None and plain.workers.client_tls() is None
    assert build({"workers": {"tls": True}}).workers.client_tls() == ClientTls()  # the system's roots


def test_each_bad_file_is_named(pki: Pki, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TlsError, match="do not load as a pair"):
        ServerTls(pki.server_cert, pki.client_key).credentials()
    with pytest.raises(TlsError, match="cannot read the private key"):
        ServerTls(pki.server_cert, str(tmp_path / "missing.key")).credentials()
    text = tmp_path / "notes.txt"
    text.write_text("not a certificate\n")
    with pytest.raises(TlsError, match="is not PEM"):
        ClientTls(ca=str(text)).credentials  # noqa: B018
    with pytest.raises(TlsError, match="holds no usable certificate"):
        ClientTls(ca=pki.server_key).credentials  # noqa: B018 - a key where the CA belongs
    with pytest.raises(TlsError, match="client CA file"):
        ServerTls(pki.server_cert, pki.server_key, str(tmp_path / "none.pem")).credentials()
    with pytest.raises(TlsError, match="give both or neither"):
        ClientTls(cert=pki.client_cert)
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", pki.server_key, "-aes256", "-passout", "pass:x", "-out", encrypted],
                   check=True, capture_output=True, stdin=subprocess.DEVNULL)
    with pytest.raises(TlsError, match="encrypted private keys are not supported"):  # never a password prompt
        ServerTls(pki.server_cert, str(encrypted)).credentials()


def test_client_files_reload_only_when_rotated_and_whole(pki: Pki, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    replace(cert, pki.client_cert)
    replace(key, pki.client_key)
    tls = ClientTls(pki.ca, str(cert), str(key))
    assert not tls.reload()  # nothing loaded yet: the first use reads the files
    first, generation = tls.credentials, tls.generation
    assert not tls.reload() and tls.credentials is first  # nothing moved
    replace(cert, pki.other_client_cert)  # half a rotation: the new certificate beside the old key
    with caplog.at_level("WARNING", logger="switchyard.watched"):
        assert not tls.reload() and not tls.reload()
    assert tls.credentials is first and tls.generation == generation
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # once per state of the files
    assert "do not load as a pair" in caplog.records[0].message
    replace(key, pki.other_client_key)
    assert tls.reload()
    assert tls.credentials is not first and tls.generation == generation + 1
    assert not tls.reload()
    assert not ClientTls().reload()  # the system's roots: no file to watch
