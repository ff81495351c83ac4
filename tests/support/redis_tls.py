"""A redis-server of the test's own with a TLS port (generated certs) and an ACL user."""

from __future__ import annotations

from pathlib import Path

from rigs.ports import free_port
from rigs.redis_server import RedisServer
from tests.support.tls_certs import TlsFiles


def start_tls_server(workdir: Path, tls: TlsFiles, *extra_args: str) -> tuple[RedisServer, int]:
    """Start a redis-server with a TLS port too; returns the server and the TLS port.

    The plain port stays open for the test's own checks; clients need no certificate.
    """
    tls_port = free_port()
    server = RedisServer(
        workdir,
        "--tls-port", str(tls_port), "--tls-cert-file", str(tls.server_cert),
        "--tls-key-file", str(tls.server_key), "--tls-ca-cert-file", str(tls.ca_cert),
        "--tls-auth-clients", "no", *extra_args).start()
    return server, tls_port


def start_tls_acl_server(workdir: Path, tls: TlsFiles, user: str,
                         password: str) -> tuple[RedisServer, int]:
    """:func:`start_tls_server` with an ACL ``user`` that may do everything with ``password``."""
    return start_tls_server(workdir, tls, "--user", user, "on", f">{password}", "~*", "&*",
                            "+@all")


def tls_url(port: int, user: str, password: str) -> str:
    return f"rediss://{user}:{password}@127.0.0.1:{port}/0"
