"""The connector's tier runtime against a TLS redis-server with an ACL user (no vLLM).

The engine-level runs are in tests/e2e/test_connector_faults.py; these cover the cases that
need no engine: a CA that did not sign the server, and the right CA.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.connector_config import load_config
from connector.worker_side import TierRuntime
from tests.support.redis_tls import start_tls_acl_server, tls_url
from tests.support.tls_certs import TlsFiles, make_tls_files

USER, PASSWORD = "kvt", "Rt-Pw-5e1d0c"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tls: TlsFiles) -> Iterator[Any]:
    srv, port = start_tls_acl_server(tmp_path_factory.mktemp("redis"), tls, USER, PASSWORD)
    yield port
    srv.stop()


def _runtime(port: int, ca: Path, password: str = PASSWORD) -> TierRuntime:
    cfg = load_config({"redis_url": tls_url(port, USER, password),
                       "redis_ssl_ca_certs": str(ca), "redis_timeout_s": 1.0})
    return TierRuntime(cfg)


def test_right_ca_and_user_connect(server: int, tls: TlsFiles) -> None:
    rt = _runtime(server, tls.ca_cert)
    try:
        assert rt.redis_available() and rt.stats()["redis_available"] == 1
    finally:
        rt.close()


@pytest.mark.parametrize("case", ["other-ca", "wrong-password"])
def test_unverifiable_server_or_wrong_password_is_a_clear_cpu_only_start(
        server: int, tls: TlsFiles, case: str) -> None:
    ca = tls.other_ca_cert if case == "other-ca" else tls.ca_cert
    wrong = "Bad-Pw-99aa" if case == "wrong-password" else PASSWORD
    rt = _runtime(server, ca, wrong)
    try:
        stats = rt.stats()
        assert stats["redis_available"] == 0 and stats["redis_configured"] == 1
        error = stats["redis_tier"]["last_error"].lower()
        assert ("certificate verify failed" in error if case == "other-ca"
                else "authentication failed" in error), error
        assert wrong not in str(stats) and PASSWORD not in str(stats)
    finally:
        rt.close()
