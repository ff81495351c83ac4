"""A throwaway CA and a server certificate for 127.0.0.1/localhost, made with openssl."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    other_ca_cert: Path  # a CA that did not sign the server: verification must fail


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_tls_files(directory: Path) -> TlsFiles:
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("ca", "other-ca"):
        _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-subj", f"/CN=kvtier-test-{name}",
             cwd=directory)
    _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=localhost", cwd=directory)
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-days", "2", "-out", "server.crt", "-extfile", "san.ext",
         cwd=directory)
    return TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key",
                    directory / "other-ca.crt")
