"""Throwaway PKI for the TLS tests, made by the `openssl` command (Debian's `openssl`): a CA, a server certificate
for 127.0.0.1 and localhost, a client certificate, and a second CA that signed neither."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str  # trusts nothing above
    other_client_cert: str  # signed by other_ca
    other_client_key: str
    other_server_cert: str  # the same names as server_cert, signed by other_ca: a rotation to another CA
    other_server_key: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


def make_pki(d: Path) -> Pki:
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "other-client", "other-ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "other-server", "other-ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    return Pki(*(str(d / f) for f in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                                      "other-ca.pem", "other-client.pem", "other-client.key",
                                      "other-server.pem", "other-server.key")))


def replace(path: Path, source: str) -> None:
    """As a rotation tool writes a file: whole, under a temporary name, then renamed over the old one."""
    tmp = path.with_suffix(".new")
    shutil.copyfile(source, tmp)
    os.replace(tmp, path)
